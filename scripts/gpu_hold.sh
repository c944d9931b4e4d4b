#!/usr/bin/env bash
# One hold of the GPU machine as back-to-back calls (each under 10 minutes; the machine stays
# warm only ~30 s between calls, so /tmp keeps the builds and the files only if the next call
# follows at once: have its command ready). Each call packs what it wrote into $OUT/<call>.tgz.
# Every call carries .whl; a call that may start the builds (scripts/start_builds.sh: llama.cpp
# on cores 0-11, the 48-layer file on core 12) carries .baseline too. What each call answered
# and what it replaced is in docs/LOG.md.
#
#   host    a fresh machine's first call: the host's read bandwidth, the host kernels at 1 and 8
#           tokens (HOST_LAYOUTS, rows per item : prefetch bytes) and the three bridges on a quiet
#           host, then the builds (275-310 s), which would disturb the host bench
#   team    at once after `host`: llama.cpp -ncmoe 36 before and after our runs, RUNS'
#           variant:placement pairs (bench_as's variants: r2 two parallel regions, the default;
#           r1 one; team the host team, -spinN, -tN), LAST_START and AFTER_BY the call's time
#           marks, and n-cpu-moe=36's bound from `host`'s bandwidth (host_bound.py). By default
#           issues 8 and 9 in one call (twenty-fourth session: 469 s; run it under timeout 575)
#   probe   `host` in more detail: host_bench under HOST_LAYOUTS and under OLD (an earlier
#           package's copy: a kernel change's A/B), host_call_probe.py's layouts (PROBE_LAYOUTS,
#           default r2, r1p1 and team) with no card at PROBE_THREADS, then the builds
#   teamprobe  why the host team's work doubles on the H100 host, ours only, n-cpu-moe=36 (PLACE)
#           under RUNS' variants (one region, two, the team, at 12 threads); `team` with the same
#           RUNS measures them beside llama.cpp
#   targets the builds, our card bench while llama.cpp builds, llama-bench all on the card and
#           -ncmoe 36, the quarter lfu-stream and (time left) static
#   side    llama-bench all on the card and -ncmoe 36, our card bench (block 8), our n-cpu-moe=36
#           (HUGE=1: again with the host experts on huge pages)
#   trace   the builds in the background while the 8-layer decode step is traced on cores 13-15
#           (graph_trace_probe.sh), decode attention at 640 visible of 4096 slots, the decode
#           layer's GEMV launch configs (layer_kernel_bench.py: the later calls run under its
#           winners, BLOOMERY_GEMV_TUNED, unless TUNED=0; LKB=0 skips it, ATTN=0 the attention
#           bench) and the prefill expert GEMM's tiles at 512 tokens (moe_prefill_bench.py)
#   q8      issue 7's integer dot products with the Q8_1 rounding inside the launches (twenty-eighth
#           session): the builds, those launches against the same on blocks rounded before them
#           (q8_rounding_check.py: plain x must agree bit for bit), the decode layer's launches as picked (layer_kernel_bench.py
#           --current-only: planes, q8 rounding in-kernel, q8 after a rounding launch), our card
#           bench under KERNELS (run it with KERNELS=pallas-q8), then llama-bench all on the card
#           (CHECK=0: no rounding check; LKB_SWEEP=1: the families' sweeps, LKB_BUDGET seconds)
#   prefill the card bench with the prefill products on quant tiles with x in one bf16 part
#           (KERNELS, default pallas-q8-bf16) and in two (pallas-qtiles), time left pallas-q8 and the
#           8-layer pp512 profile
#
#   run: bash scripts/gpu_hold.sh host|probe|team|teamprobe|targets|side|trace|prefill|q8
set -u
call=$1
OUT=${OUT:-/tmp/gpu_hold_out}
RES=/tmp/gpu_hold_$call
mkdir -p "$OUT" "$RES"
K="--kernels ${KERNELS:-pallas-q8-bf16} --attention pallas --routing pallas"  # the GPU's defaults
# the trace call's GEMV launch winners on this card (TUNED=0: the committed tables alone)
[ "${TUNED:-1}" = 1 ] && [ -s /tmp/gemv_tuned.json ] && export BLOOMERY_GEMV_TUNED=/tmp/gemv_tuned.json
B="python3 scripts/gpu_session.py --out $RES --reps 3 --parallel 1 $K --decode-block 8 --variant-timeout 220"
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
M48=/tmp/bloomery/qwen3-30b-a3b-shape-q4km.gguf
pack() { tar czf "$OUT/$call.tgz" -C "$RES" .; }  # also between runs, where a call may be cut short
# One of our benches over the FFI bridge as variant $1 (its records under $RES/$1), placement $2:
# r2 the default (two parallel regions a call), r1 one region, team the host team; -spinN: the
# team's helpers spin N us after a call (0: they sleep at once; default 20000); -tN: N Numba
# threads; -gompNk: OpenMP's workers spin N thousand times after a region (default 10k); -pfN:
# the host prefetch hint N bytes ahead (default 2304); -partsN: N shares a thread in one region;
# -plain: the team without its threads' one-thread regions (team-plain: the engine's default since
# the twenty-ninth session; team alone is the team with those regions).
# Compared with llama.cpp where this call ran it.
bench_as() {
  local v=$1 place=$2 vars=(BLOOMERY_HOST_TEAM=0 BLOOMERY_HOST_REGIONS=2 BLOOMERY_HOST_TEAM_PLAIN=0)  # whatever the caller exported
  case $v in team*) vars+=(BLOOMERY_HOST_TEAM=1) ;; r1*) vars+=(BLOOMERY_HOST_REGIONS=1) ;; esac
  [[ $v =~ -spin([0-9]+) ]] && vars+=(BLOOMERY_HOST_TEAM_SPIN_US=${BASH_REMATCH[1]})
  [[ $v =~ -t([0-9]+) ]] && vars+=(NUMBA_NUM_THREADS=${BASH_REMATCH[1]})
  [[ $v =~ -gomp([0-9]+k) ]] && vars+=(GOMP_SPINCOUNT=${BASH_REMATCH[1]%k}000)
  [[ $v =~ -pf([0-9]+) ]] && vars+=(BLOOMERY_HOST_PREFETCH_BYTES=${BASH_REMATCH[1]})
  [[ $v =~ -parts([0-9]+) ]] && vars+=(BLOOMERY_HOST_PARTS=${BASH_REMATCH[1]})
  [[ $v =~ -plain ]] && vars+=(BLOOMERY_HOST_TEAM_PLAIN=1)
  mkdir -p $RES/$v
  env "${vars[@]}" ${B/--out $RES/--out $RES/$v} --bridge ffi --signal doorbell bench --only $place
  [ -f $RES/llamacpp.json ] && cp $RES/llamacpp.json $RES/$v/
  [ -f $RES/$v/llamacpp.json ] && python3 scripts/gpu_session.py --out $RES/$v compare
  pack
}
# side's and targets' start: the builds (nothing when the trace call's run or are done), our card
# bench once the file is written and synced (a build may still have cores 0-11: the card bench
# waits on the card), then llama-bench all on the card and -ncmoe 36
card_beside_llamacpp() {
  bash scripts/start_builds.sh
  for ((t = 0; t < 150; t += 2)); do [ -f /tmp/model48.done ] && break; sleep 2; done
  $B bench --only card
  pack
  bash scripts/await_builds.sh 300 || exit 1
  python3 scripts/gpu_session.py --out $RES llamacpp --only card,ncmoe36
  pack
}
case $call in
trace)
  VARIANTS="${VARIANTS:-graph block8 block8_dev}" OUT=$RES bash scripts/graph_trace_probe.sh
  [ "${ATTN:-1}" = 1 ] && taskset -c 13-15 timeout 120 python3 scripts/attention_bench.py --lengths 4096 --visible 640 --batch 1 \
    --splits 0,4,16 --heads-per-program 8 > "$RES/attention_bench.txt" 2>&1
  tail -8 "$RES/attention_bench.txt" 2>/dev/null
  # (its winners go to /tmp/gemv_tuned.json, which the later calls on this warm machine run under)
  [ "${LKB:-1}" = 1 ] && taskset -c 13-15 timeout 180 python3 scripts/layer_kernel_bench.py --budget-s 160 --json "$RES/layer_kernels.json" \
    --tuned-out "$RES/tuned.json" > "$RES/layer_kernels.txt" 2>&1; cut -c1-90 "$RES/layer_kernels.txt" 2>/dev/null
  [ -s "$RES/tuned.json" ] && cp "$RES/tuned.json" /tmp/gemv_tuned.json
  # 512 tokens: tiles for q-bf16, the prefill default since the sixteenth session, beside q-bf16x2's winner
  taskset -c 13-15 timeout 150 python3 scripts/moe_prefill_bench.py --tokens 512 --skip-reference --reps 5 \
    --configs 32,64,4,2,q-bf16 16,64,4,2,q-bf16 64,64,4,2,q-bf16 32,128,4,2,q-bf16 32,64,8,2,q-bf16 \
    32,64,4,3,q-bf16 32,64,4,2,q-bf16x2 > "$RES/moe_prefill_T512.jsonl" 2>&1
  grep -h '"config"' "$RES/moe_prefill_T512.jsonl" | cut -c1-160
  ;;
q8)
  bash scripts/start_builds.sh
  if [ "${CHECK:-1}" = 1 ]; then
    taskset -c 13-15 timeout 120 python3 scripts/q8_rounding_check.py --json "$RES/q8_rounding_check.json" > "$RES/q8_rounding_check.txt" 2>&1
    echo "q8_rounding_check rc=$?"; cut -c1-150 "$RES/q8_rounding_check.txt" | grep -v Warning
  fi
  # LKB_SWEEP=1: each family's sweep too (its winners in tuned.json), not only the current picks
  [ "${LKB_SWEEP:-0}" = 1 ] && LKB_MODE="--tuned-out $RES/tuned.json" || LKB_MODE=--current-only
  taskset -c 13-15 timeout $((${LKB_BUDGET:-200} + 20)) python3 scripts/layer_kernel_bench.py $LKB_MODE --budget-s ${LKB_BUDGET:-200} --json "$RES/layer_kernels.json" \
    --families ${LKB_FAMILIES:-gate_up,gate_up_q8,gate_up_q8_pre,down,down_q8,down_q8_pre,qkv,qkv_q8} > "$RES/layer_kernels.txt" 2>&1
  cut -c1-100 "$RES/layer_kernels.txt"
  pack
  card_beside_llamacpp
  python3 scripts/gpu_session.py --out $RES compare
  ;;
side)
  card_beside_llamacpp
  $B --bridge ffi --signal doorbell bench --only ncmoe36
  pack
  [ "${HUGE:-0}" = 1 ] && $B --bridge ffi --signal doorbell --pages huge bench --only ncmoe36  # refuted on the H100 (s14)
  python3 scripts/gpu_session.py --out $RES compare
  ;;
targets)
  # one call that measures what the issues' targets need, for a hold that may get only one: our
  # card bench while llama.cpp builds, then beside llama.cpp all on the card and -ncmoe 36, the
  # quarter budget lfu-stream and static (issue 9). On a fresh machine each of our benches
  # compiles cold (100-135 s; twentieth session), so the quarter budget may not fit: `team`
  # after it measures both again
  card_beside_llamacpp
  $B --bridge ffi --signal doorbell bench --only quarter-lfu-stream
  pack
  [ $SECONDS -lt 400 ] && $B --bridge ffi --signal doorbell bench --only quarter-static
  python3 scripts/gpu_session.py --out $RES compare
  ;;
team)
  # at once after `host` (or first: the builds start here where none ran, 275-310 s). The default
  # RUNS are issues 8 and 9 in one call: llama.cpp -ncmoe 36 before and after residency off, the
  # swap rule, the swap rule with prompt streaming, and n-cpu-moe=36 (469 s warm, twenty-fourth
  # session)
  bash scripts/start_builds.sh
  bash scripts/await_builds.sh 330 || exit 1
  python3 scripts/gpu_session.py --out $RES llamacpp --only ncmoe36
  for run in ${RUNS:-r2:quarter-static r2:quarter-lfu r2:quarter-lfu-stream r2:ncmoe36}; do
    [ $SECONDS -gt ${LAST_START:-420} ] && { echo "$run: skipped, the call's time is nearly spent"; continue; }
    bench_as ${run%%:*} ${run#*:}
  done
  [ $SECONDS -lt ${AFTER_BY:-545} ] && python3 scripts/gpu_session.py --out $RES/llamacpp-after llamacpp --only ncmoe36
  # issue 8's bound for n-cpu-moe=36, from the `host` call's bandwidth on this warm machine
  for f in $RES/r2/bench-ncmoe36-*.json; do
    [ -f $f ] && [ -f /tmp/gpu_hold_host/host_bench.json ] && python3 scripts/host_bound.py --bench $f \
      --host /tmp/gpu_hold_host/host_bench.json --model $M48 --json $RES/host_bound.json
  done
  pack
  ;;
probe)
  # a fresh machine's first call, `host`'s questions in more detail: host_bench under
  # HOST_LAYOUTS, the same under OLD (a copy of an earlier package, e.g. .baseline/old/bloomery_jax
  # from `git archive`: an A/B of a kernel change on one quiet host), host_call_probe's layouts
  # (two regions, one, the team; no card, no doorbell), then the builds (carry .baseline; BUILDS=0:
  # the 48-layer file alone; BUILDS=skip: neither). `team` with RUNS follows at once.
  H="--weights q4_k_m --acts q8 --tokens 1,8 --threads $(( $(nproc) - 2 )) --memory numpy"
  timeout 150 python3 scripts/host_bench.py $H --layouts ${HOST_LAYOUTS:-0:2304,0:3456,0:4608} \
    --out $RES/host_bench.json > $RES/host_bench.txt 2>&1; tail -12 $RES/host_bench.txt
  mkdir -p /tmp/gpu_hold_host && cp $RES/host_bench.json /tmp/gpu_hold_host/  # `team`'s bound reads it there
  if [ -n "${OLD:-}" ]; then
    PYTHONPATH=${PYTHONPATH/$PWD/$PWD/$OLD} timeout 120 python3 scripts/host_bench.py $H --layouts 0:2304 \
      --out $RES/host_bench_old.json > $RES/host_bench_old.txt 2>&1; tail -6 $RES/host_bench_old.txt
  fi
  pack
  # at each of PROBE_THREADS' Numba thread counts (the team's fixed ~100 us a call: does it grow
  # with the team?)
  for t in ${PROBE_THREADS:-$(( $(nproc) - 2 ))}; do
    NUMBA_NUM_THREADS=$t PYTHONPATH=$PYTHONPATH:$PWD/scripts timeout 200 python3 scripts/host_call_probe.py --reps 20 \
      --waits 10k --gaps 0,100 --layouts ${PROBE_LAYOUTS:-r2,r1p1,team} --rounds 1 --json $RES/host_call_probe_t$t.json \
      > $RES/host_call_probe_t$t.txt 2>&1
    echo "threads $t:"; grep -h -A4 "^10k" $RES/host_call_probe_t$t.txt
    pack
  done
  if [ "${BUILDS:-1}" = 1 ]; then
    bash scripts/start_builds.sh
    bash scripts/await_builds.sh 330
  elif [ "${BUILDS}" = 0 ]; then  # the 48-layer file alone, for `teamprobe` in the same command
    python3 scripts/gpu_session.py --out /tmp/model48-out model > $RES/model.log 2>&1; sync
  fi
  ;;
teamprobe)
  # what doubles the host team's work on the H100 host (2.0x two regions' on three machines; on
  # the VM's 2 threads the team costs what two regions do, twenty-third session), in the engine
  # after `probe` measured the layouts with no card: ours only, PLACE (n-cpu-moe=36, issue 8's
  # measure) under RUNS, bench_as's variant names: one region (unmeasured on the card since the
  # twenty-second session's inlining fix), two, the team, the team at 12 threads (room for
  # XLA's, Python's and the driver's threads beside it), two regions with OpenMP's workers
  # spinning through the gaps between calls
  python3 scripts/gpu_session.py --out /tmp/model48-out model; sync  # `probe` wrote it: nothing to do
  for v in ${RUNS:-r2 r1 team team-t12 r2-gomp1000k}; do
    [ $SECONDS -gt ${LAST_START:-470} ] && { echo "$v: skipped, the call's time is nearly spent"; continue; }
    bench_as $v ${PLACE:-ncmoe36}
  done
  ;;
host)
  # a fresh machine's first call, before anything else runs (twenty-fourth session): the host's
  # read bandwidth, the host kernels at 1 and 8 tokens under HOST_LAYOUTS (host_bench, 83 s) and
  # the three bridges (gpu_session.py host), then the builds (275-310 s), which would disturb the
  # host bench. `team` with r2:ncmoe36 in RUNS, at once after it, completes issue 8's measure:
  # llama.cpp -ncmoe 36 before and after, and the bound this host bench's bandwidth sets.
  HOST_LAYOUTS=${HOST_LAYOUTS:-0:1260,0:2304,0:4608} HOST_MEMORY=${HOST_MEMORY:-numpy} timeout 280 python3 scripts/gpu_session.py --out $RES host
  pack
  bash scripts/start_builds.sh
  bash scripts/await_builds.sh 330
  ;;
prefill)
  # the card bench with the prefill products on quant tiles with x in one bf16 part (KERNELS, default
  # pallas-q8-bf16) and in two (pallas-qtiles) in one call, llama.cpp's card row from the side call; then
  # where an 8-layer pp512 goes
  bash scripts/await_builds.sh 240 || exit 1
  [ "${BASE:-1}" = 1 ] && $B bench --only card  # BASE=0: side's card bench on this warm machine is the base
  F=${B/--out $RES/--out $RES/qtiles}  # x in two bf16 parts (1.42 against 0.95 ms a layer, H100 s14)
  mkdir -p $RES/qtiles && ${F/--kernels ${KERNELS:-pallas-q8-bf16} /--kernels pallas-qtiles } bench --only card
  if [ $SECONDS -lt 330 ]; then  # int8 tile products (and Q8_1 activations everywhere)
    Q=${B/--out $RES/--out $RES/q8}
    mkdir -p $RES/q8 && ${Q/--kernels ${KERNELS:-pallas-q8-bf16} /--kernels pallas-q8 } bench --only card
  fi
  if [ $SECONDS -lt 450 ]; then
    timeout 140 python3 scripts/profile_decode.py --model $M8 $K --prefill --prompt 512 --steps 3 \
      --out /tmp/pprof > "$RES/prefill_profile.log" 2>&1
    echo "prefill profile: rc $?"; cp /tmp/pprof/profile.json "$RES/profile-prefill512.json" 2>/dev/null
  fi
  ;;
*) echo "unknown call $call"; exit 2 ;;
esac
pack
echo "$call: end at ${SECONDS}s"
