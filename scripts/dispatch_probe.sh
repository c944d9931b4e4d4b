#!/usr/bin/env bash
# One device call: how XLA's command buffers (CUDA graphs) change the decode step's host dispatch,
# then the 48-layer bench under the variant with the shortest step.
#
# A decode step of the 30B-shaped model launches ~2,000 kernels; the step call returned after
# 14 ms while the card was busy 5 ms (benchmarks/gpu_2026-12-03-s5): the host enqueues kernel by
# kernel. XLA puts runs of >= 5 fusions into CUDA graphs by default, but a Pallas (Triton) call is
# not a command, so it cuts every graph short. Variants: default, graphs off, graphs of any size;
# then the default step's optimized HLO, counted by scripts/hlo_launches.py (what the host
# launches: graphs, Pallas calls, lone fusions, copies). The flags that would let XLA capture
# the Triton calls (--legacy_command_buffer_custom_call_targets, --xla_gpu_experimental_enable_
# command_buffer_on_thunks) are unknown to jaxlib 0.11.2: the 2026-12-03 run aborted on both.
#
#   run: bash scripts/dispatch_probe.sh [--no-bench]   (carry .whl; writes under $OUT)
#   --no-bench: the 8-layer variants and the HLO count only (no 48-layer file, no bench)
set -u
BENCH=1; [ "${1:-}" = "--no-bench" ] && BENCH=0
OUT=${OUT:-/tmp/dispatch_probe}
mkdir -p "$OUT"
S="python3 scripts/gpu_session.py --out $OUT"
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
# the 48-layer file for the last stage, written in the background at low priority
[ $BENCH = 1 ] && (nice -n 19 $S model >/dev/null 2>&1) &
$S model --layers 8 2>&1 | tail -1 | cut -c1-200

declare -A FLAGS=(
  [default]=""
  [off]="--xla_gpu_enable_command_buffer="
  [min1]="--xla_gpu_graph_min_graph_size=1"
  [dump]="--xla_dump_to=/tmp/probe-hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*"
)
best="" best_ms=1e9
for name in default off min1 dump; do
  XLA_FLAGS="${FLAGS[$name]}" timeout 100 python3 scripts/profile_decode.py --model $M8 --kernels pallas \
    --steps 32 --no-trace --out /tmp/probe-$name > /tmp/probe-$name.log 2>&1
  rc=$?
  if [ -f /tmp/probe-$name/profile.json ]; then
    ms=$(python3 -c "import json;print(json.load(open('/tmp/probe-$name/profile.json'))['step_ms'])")
    python3 -c "import json;d=json.load(open('/tmp/probe-$name/profile.json'));d['variant']='$name';print(json.dumps(d))" >> $OUT/profiles.jsonl
    echo "$name: step_ms $ms (rc $rc)"
    if [ $name != dump ] && python3 -c "import sys; sys.exit(0 if $ms < $best_ms else 1)"; then best=$name best_ms=$ms; fi
  else
    echo "$name: failed (rc $rc)"; tail -3 /tmp/probe-$name.log | cut -c1-300
    echo "{\"variant\": \"$name\", \"rc\": $rc}" >> $OUT/profiles.jsonl
  fi
done
python3 scripts/hlo_launches.py /tmp/probe-hlo | tee $OUT/hlo_launches.json
echo "best: $best ($best_ms ms) at ${SECONDS}s"
wait
if [ $BENCH = 1 ] && [ $SECONDS -lt 360 ]; then
  XLA_FLAGS="${FLAGS[$best]}" $S bench --only card --parallel 1 --kernels pallas --variant-timeout $((575 - SECONDS)) \
    2>&1 | grep -o '"test": "[a-z0-9]*", "parallel": 1, "depth": 0, "n_tokens": [0-9]*, "tps_median": [0-9.]*'
  echo "$best" > $OUT/bench-flags.txt
fi
echo "end ${SECONDS}s"
