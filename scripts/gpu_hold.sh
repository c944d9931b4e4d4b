#!/usr/bin/env bash
# One hold of the GPU machine as four back-to-back calls (each under 10 minutes; the machine
# stays warm only ~30 s between calls, so /tmp keeps the builds and the files only if the next
# call follows at once). Each call packs what it wrote into $OUT/<call>.tgz (a call returns 8
# files at most). Every call: carry .whl (and .baseline for `trace`, which builds llama.cpp; a
# later call that carries it too gets its build back from /tmp, scripts/await_builds.sh).
#
#   trace   llama.cpp builds and the 48-layer file is written in the background (cores 0-12)
#           while the 8-layer decode step is traced on cores 13-15 (graph_trace_probe.sh:
#           single steps and blocks of 8), decode attention at 640 visible of 4096 slots,
#           the decode layer's GEMV launch configs (layer_kernel_bench.py; its winners are what
#           the later calls run under, BLOOMERY_GEMV_TUNED, unless TUNED=0), and the prefill
#           expert GEMM's tiles for q-bf16 at 512 tokens (moe_prefill_bench.py).
#           (The sixteenth session dropped the sampler bench, which spent its 90 s compiling,
#           and the GEMM at 1 and 8 tokens: the GEMV won both, benchmarks/gpu_2026-12-05-s16.)
#   side    llama-bench all on the card and -ncmoe 36, our card bench (block 8), our n-cpu-moe=36
#           bench over the FFI bridge (doorbell signal; HUGE=1: again with the host experts on huge
#           pages), ratios
#   targets the hold's first call: start_builds, our card bench while llama.cpp builds, then
#           llama-bench all on the card and -ncmoe 36, the quarter budget lfu-stream and (time
#           left) static (issue 9), ratios. (The twentieth session's pallas-q8 card bench is
#           answered: 269.2 against 276.0 tok/s; layer_kernel_bench.py's *_q8 families stay.)
#   team    after targets, or first (it starts the builds where none ran): the quarter budget
#           (lfu-stream, static) and n-cpu-moe=36 with decode host calls on the host team
#           (BLOOMERY_HOST_TEAM=1: threads that stay awake, no fork or join), in one parallel
#           region (BLOOMERY_HOST_REGIONS=1) and in two (the default), beside llama.cpp -ncmoe 36
#           before and after; each record's decode_host_us_per_call_split says what moved. RUNS
#           picks the variant:placement runs, LAST_START and AFTER_BY the call's time marks.
#           (The twenty-first session's `spins` call is answered: 1M spins +6% on whole calls, nothing
#           over the halves, now the default.)
#   teamprobe  why the host team's work doubles on the H100 host: host_call_probe.py's r2, r1p1
#           and team layouts with no card, then the quarter lfu-stream (ours only) in one region, two,
#           the team spinning 300 us after a call and the team on 12 threads (RUNS names them).
#           Twenty-third session: the team ran 47.4 against two regions' 60.4 tok/s, 32.6 asleep
#           between calls; the probe's team calls had run beside r2's spinning OpenMP workers
#   host    a fresh machine's first call: the host's read bandwidth, the host kernels (HOST_LAYOUTS:
#           rows per item : prefetch bytes) and the three bridges on a quiet host, then the builds.
#           With `team` at once after it (RUNS with r2:ncmoe36), issue 8's whole measure; with
#           RUNS="r2:quarter-static r2:quarter-lfu r2:quarter-lfu-stream" too, issue 9's (the
#           twenty-fourth session: 469 s). (It replaced `hybrid`, whose host bench waited on the
#           builds and left no time for our bench on a fresh machine.)
#           (answered and removed: the nineteenth session's `link`, `quarter` and `regions` (the link
#           and the host share DRAM; one region then still made three), the twenty-first's `overlap`
#           (halves +21.6% lfu-stream, +15.8% static: the default now); their probes stay in scripts/)
#           (the eighteenth session replaced `hostab`, answered in the seventeenth: the defaults won)
#   prefill the card bench with the prefill products on quant tiles with x in one bf16 part (pallas-bf16,
#           the default since the sixteenth session, unmeasured end to end) and in two (pallas-qtiles,
#           the sixteenth session's side-by-side), with time left pallas-q8 and the 8-layer pp512 profile
#
#   order: host, then team at once after it (the build and the file stay in /tmp only while the
#           machine is warm: it goes back 30 s after a call, so have the next call's command ready
#           before this one returns), then side, trace or prefill if device time is left (about
#           5-10 minutes each; every bench launches decode blocks ahead, bench --no-lookahead not)
#
#   run: bash scripts/gpu_hold.sh trace|side|targets|team|teamprobe|prefill|host   (ATTN=0 skips the attention bench,
#        LKB=0 the launch-config sweep, so that the committed tables are what runs; HOST_LAYOUTS narrows gpu_session's host sweep)
set -u
call=$1
OUT=${OUT:-/tmp/gpu_hold_out}
RES=/tmp/gpu_hold_$call
mkdir -p "$OUT" "$RES"
K="--kernels ${KERNELS:-pallas-bf16} --attention pallas --routing pallas"  # the GPU's defaults
# the trace call's GEMV launch winners on this card (TUNED=0: the committed tables alone)
[ "${TUNED:-1}" = 1 ] && [ -s /tmp/gemv_tuned.json ] && export BLOOMERY_GEMV_TUNED=/tmp/gemv_tuned.json
B="python3 scripts/gpu_session.py --out $RES --reps 3 --parallel 1 $K --decode-block 8 --variant-timeout 220"
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
M48=/tmp/bloomery/qwen3-30b-a3b-shape-q4km.gguf
pack() { tar czf "$OUT/$call.tgz" -C "$RES" .; }  # also between runs, where a call may be cut short
# One of our benches over the FFI bridge as variant $1 (its records under $RES/$1), placement $2:
# r2 the default (two parallel regions a call), r1 one region, team the host team; -spinN: the
# team's helpers spin N us after a call (0: they sleep at once; default 20000); -tN: N Numba
# threads. Compared with llama.cpp where this call ran it.
bench_as() {
  local v=$1 place=$2 vars=(BLOOMERY_HOST_TEAM=0 BLOOMERY_HOST_REGIONS=2)  # the defaults, whatever the caller exported
  case $v in team*) vars+=(BLOOMERY_HOST_TEAM=1) ;; r1*) vars+=(BLOOMERY_HOST_REGIONS=1) ;; esac
  [[ $v =~ -spin([0-9]+) ]] && vars+=(BLOOMERY_HOST_TEAM_SPIN_US=${BASH_REMATCH[1]})
  [[ $v =~ -t([0-9]+) ]] && vars+=(NUMBA_NUM_THREADS=${BASH_REMATCH[1]})
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
  # at once after `targets`. The twenty-first session's split (H100 host, lfu-stream, us a call):
  # serial 13.4 (8 + ~1.8 a pair: the hidden rows' rounding between the regions), wake 14.2 (~6 a
  # fork even with spinning workers), join 6.4, work 75.4. Predicted: one region ~10-15 us a call
  # less (one fork, the hidden rows rounded in parallel), +6-8% on the quarter lfu-stream; the team
  # ~20-25 us less, +10-12%, and n-cpu-moe=36 +4-6%. Measured (twenty-second session): both
  # slower, their work a call 1.6x and 2x two regions' (docs/LOG.md).
  # (the first call of a hold where `targets` did not run: the builds start here, ~200 s)
  # RUNS="r2:quarter-static r2:quarter-lfu r2:quarter-lfu-stream" is issue 9's whole measure:
  # llama.cpp -ncmoe 36 before and after residency off, the swap rule, and the swap rule with
  # prompt streaming, in one call (~420 s on a warm machine)
  bash scripts/start_builds.sh
  bash scripts/await_builds.sh 330 || exit 1
  python3 scripts/gpu_session.py --out $RES llamacpp --only ncmoe36
  # issue 8's n-cpu-moe=36 before one region: the call may not reach the last runs
  for run in ${RUNS:-team:quarter-lfu-stream r2:quarter-lfu-stream team:quarter-static team:ncmoe36 r2:ncmoe36 \
             r2:quarter-static r1:quarter-lfu-stream}; do
    [ $SECONDS -gt ${LAST_START:-440} ] && { echo "$run: skipped, the call's time is nearly spent"; continue; }
    bench_as ${run%%:*} ${run#*:}
  done
  [ $SECONDS -lt ${AFTER_BY:-510} ] && python3 scripts/gpu_session.py --out $RES/llamacpp-after llamacpp --only ncmoe36
  # issue 8's bound for n-cpu-moe=36, from the `host` call's bandwidth on this warm machine
  for f in $RES/r2/bench-ncmoe36-*.json; do
    [ -f $f ] && [ -f /tmp/gpu_hold_host/host_bench.json ] && python3 scripts/host_bound.py --bench $f \
      --host /tmp/gpu_hold_host/host_bench.json --model $M48 --json $RES/host_bound.json
  done
  pack
  ;;
teamprobe)
  # what doubles the host team's work on the H100 host (2.0x two regions' on three machines; on
  # the VM's 2 threads the team costs what two regions do, twenty-third session). First the three
  # layouts with no card, no doorbell and nothing else running (host_call_probe.py: 14 threads,
  # calls back to back and 100 us apart, each layout after the last one's threads sleep): if the
  # team is slow here too, the cause is in the call itself, else in the engine around it. Then
  # the quarter lfu-stream in the engine, ours only (RUNS, bench_as's variant names).
  PYTHONPATH=$PYTHONPATH:$PWD/scripts timeout 300 python3 scripts/host_call_probe.py --reps 20 --waits 1M \
    --gaps 0,100 --layouts r2,r1p1,team --rounds 1 --json $RES/host_call_probe.json
  pack
  python3 scripts/gpu_session.py --out /tmp/model48-out model; sync
  # one region (unmeasured on the card since the twenty-second session's inlining fix; on the VM's
  # 2 threads 270-307 us an expert against two regions' 309-314), two regions, the team with its
  # helpers spinning about one gap between calls (not 20 ms), the team on 12 threads
  for v in ${RUNS:-r1 r2 team-spin300 team-t12}; do
    [ $SECONDS -gt ${LAST_START:-470} ] && { echo "$v: skipped, the call's time is nearly spent"; continue; }
    bench_as $v quarter-lfu-stream
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
  # the card bench with the prefill products on quant tiles with x in one bf16 part (pallas-bf16, the
  # default) and in two (pallas-qtiles) in one call, llama.cpp's card row from the side call; then
  # where an 8-layer pp512 goes
  bash scripts/await_builds.sh 240 || exit 1
  [ "${BASE:-1}" = 1 ] && $B bench --only card  # BASE=0: side's card bench on this warm machine is the base
  F=${B/--out $RES/--out $RES/qtiles}  # x in two bf16 parts (1.42 against 0.95 ms a layer, H100 s14)
  mkdir -p $RES/qtiles && ${F/--kernels pallas-bf16 /--kernels pallas-qtiles } bench --only card
  if [ $SECONDS -lt 330 ]; then  # int8 tile products (and Q8_1 activations everywhere)
    Q=${B/--out $RES/--out $RES/q8}
    mkdir -p $RES/q8 && ${Q/--kernels pallas-bf16 /--kernels pallas-q8 } bench --only card
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
