#!/usr/bin/env bash
# One device call: how XLA's command buffers (CUDA graphs) change the decode step's host dispatch,
# then the 48-layer bench under the variant with the shortest step. The default step's optimized
# HLO is counted by scripts/hlo_launches.py (what the host launches).
#
# A decode step of the 30B-shaped model runs ~1,600 kernels; the step call returned after 14 ms
# while the card was busy 5 ms (benchmarks/gpu_2026-12-03-s5). The step is one CUDA graph of
# ~266 commands per 8 layers in this XLA (command buffers are built from the thunk sequence, and
# a Pallas Triton call is a kernel command: thunk dump of 2026-12-04), yet it costs the host
# what launching kernel by kernel costs: XLA updates every command whose buffers moved since
# the last run. The default variant
# logs which allocations moved and how many commands were updated (graph_updates.log); the
# SKIP_TEMP / SKIP_PROFILED variants pin the temp buffer (and stable inputs/outputs) to fixed
# virtual addresses (XLA's VMM allocator). pallas_attn: default flags with --attention pallas;
# pallas_route: with --routing pallas; pallas_both: both.
# host_callback / host_ffi: the experts of 6 of the 8 layers on the host, through each bridge
# (pure_callback splits the step's graph at every host call; the FFI call is queued on the stream),
# with VLOG, so their graph logs show whether the FFI step stays one graph.
#
#   run: bash scripts/dispatch_probe.sh [--no-bench]   (carry .whl; writes under $OUT)
#   --no-bench: the 8-layer variants and the HLO count only (no 48-layer file, no bench)
#   VARIANTS="default host_ffi ...": run only these variants
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
  [skip_temp]="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
  [skip_profiled]="--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
  [dump]="--xla_dump_to=/tmp/probe-hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*"
  [pallas_attn]=""
  [pallas_route]=""
  [pallas_both]=""
  [host_callback]=""
  [host_ffi]=""
)
# XLA's own account of each execution of the default variant: which allocations moved
# (gpu_executable), how many graph commands were updated (command_executor, command_buffer_thunk).
VLOG=command_buffer_thunk=3,command_executor=1,gpu_executable=5
best="" best_ms=1e9
for name in ${VARIANTS:-default off skip_temp skip_profiled dump pallas_attn pallas_route pallas_both host_callback host_ffi}; do
  vmod=""; [ $name = default ] || [ ${name#host_} != $name ] && vmod=$VLOG
  attn=xla; [ $name = pallas_attn ] || [ $name = pallas_both ] && attn=pallas  # decode attention kernel
  route=xla; [ $name = pallas_route ] || [ $name = pallas_both ] && route=pallas  # routing kernel
  # the host variants also compile the Numba layer kernel (and the FFI library and cfunc) once
  host="--place card" tmo=100; [ ${name#host_} != $name ] && host="--place n-cpu-moe=6 --bridge ${name#host_}" tmo=240
  XLA_FLAGS="${FLAGS[$name]}" TF_CPP_VMODULE=$vmod TF_CPP_MIN_LOG_LEVEL=0 timeout $tmo python3 scripts/profile_decode.py \
    --model $M8 --kernels pallas --attention $attn --routing $route $host --steps 32 --no-trace --out /tmp/probe-$name > /tmp/probe-$name.log 2>&1
  rc=$?
  if [ -f /tmp/probe-$name/profile.json ]; then
    ms=$(python3 -c "import json;print(json.load(open('/tmp/probe-$name/profile.json'))['step_ms'])")
    python3 -c "import json;d=json.load(open('/tmp/probe-$name/profile.json'));d['variant']='$name';print(json.dumps(d))" >> $OUT/profiles.jsonl
    echo "$name: step_ms $ms (rc $rc)"
    if [ $name != dump ] && [ ${name#host_} = $name ] && python3 -c "import sys; sys.exit(0 if $ms < $best_ms else 1)"; then best=$name best_ms=$ms; fi
  else
    echo "$name: failed (rc $rc)"; tail -3 /tmp/probe-$name.log | cut -c1-300
    echo "{\"variant\": \"$name\", \"rc\": $rc}" >> $OUT/profiles.jsonl
  fi
done
grep -E "changed address|Updated [0-9]+ commands|Updated command buffer|needs_update|num_executions" /tmp/probe-default.log \
  | sed -E 's/^[^]]*\] //' | cut -c1-240 > $OUT/graph_updates.log
echo "graph log lines: $(wc -l < $OUT/graph_updates.log); last ones:"; tail -4 $OUT/graph_updates.log
for h in host_callback host_ffi; do
  grep -E "Updated [0-9]+ commands|Updated command buffer|num_executions|command buffer" /tmp/probe-$h.log \
    | sed -E 's/^[^]]*\] //' | cut -c1-240 > $OUT/graph_updates-$h.log
  echo "$h graph log lines: $(wc -l < $OUT/graph_updates-$h.log)"
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
