#!/usr/bin/env bash
# One device call: how OpenMP's wait between parallel regions changes the host expert kernels,
# alone (host_bench.py), inside each bridge (bridge_bench.py --work: 36 layer calls a step) and in
# the 8-layer model's decode through the FFI bridge (6 of 8 layers' experts on the host).
#
# Spinning workers (libgomp's default: 300,000 spins after each region) starved the FFI bridge's
# host calls ~20x on the H200 (benchmarks/gpu_2026-12-04-s8); sleeping ones paid to wake. From
# this probe and the n-cpu-moe=36 runs after it (benchmarks/gpu_2026-12-04-s9), bloomery_jax sets
# GOMP_SPINCOUNT=10000 and leaves two cores free (host.bridge.default_threads); each variant here
# sets its own wait and thread count.
#
#   run: bash scripts/host_wait_probe.sh   (carry .whl; writes under $OUT)
set -u
# The run's JSON goes to $RES and comes back as one archive: a device call returns 8 files at most.
OUT=${OUT:-/tmp/host_wait_probe}
RES=/tmp/host_wait_probe_json
mkdir -p "$OUT" "$RES"
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
python3 scripts/gpu_session.py --out "$RES" model --layers 8 2>&1 | tail -1 | cut -c1-120
C=$(nproc)
# variant = wait policy and thread count: all cores, two left to the threads that wait on the GPU, half
for v in passive-t$C passive-t$((C - 2)) passive-t$((C / 2)) spin1k-t$C spin10k-t$C spin100k-t$C; do
  T=${v##*-t} w=${v%-t*}
  case $w in
    passive) wait_env="OMP_WAIT_POLICY=PASSIVE" ;;
    spin*) n=${w#spin}; wait_env="GOMP_SPINCOUNT=${n%k}000" ;;
  esac
  env $wait_env timeout 150 python3 scripts/host_bench.py --weights q4_k_m --acts q8 --tokens 1,8 --threads $T \
    --reps 15 --out "$RES/host_bench-$v.json" > /dev/null 2>&1
  env $wait_env timeout 150 python3 scripts/bridge_bench.py --work 64 --layers 36 --reps 10 --threads $T \
    --json "$RES/bridge_work-$v.json" > /dev/null 2>&1
  env $wait_env NUMBA_NUM_THREADS=$T timeout 120 python3 -m bloomery_jax.generate --model $M8 --prompt "the sea is" -n 32 --temperature 0 \
    --place n-cpu-moe=6 --kernels pallas --bridge ffi --json > "$RES/generate-$v.json" 2> /dev/null
  python3 - "$RES" $v <<'PY'
import json, sys
out, v = sys.argv[1], sys.argv[2]
def read(name):
    try:
        return json.load(open(f"{out}/{name}-{v}.json"))
    except (OSError, ValueError):
        return None
hb, bw, g = read("host_bench"), read("bridge_work"), read("generate")
line = [v]
if hb:
    line += [f"host N={r['N']} {r['ms']:.3f} ms" for r in hb["runs"] if r.get("act") == "q8"]
if bw:
    line += [f"36 calls: kernel {bw['kernel_ms']:.1f} ms"] + [f"{k} {b['step_ms']:.1f}" for k, b in bw["bridges"].items()]
if g:
    line += [f"decode {g['timings']['decode_tps']:.1f} tok/s, host {g['placement']['host_kernel_s']:.3f} s"]
print(" | ".join(line), flush=True)
PY
done
tar czf "$OUT/host_wait_probe_json.tgz" -C "$RES" .
