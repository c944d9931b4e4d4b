#!/usr/bin/env bash
# One device call: where the card decode step's time goes inside its CUDA graph, while llama.cpp
# builds and the 48-layer file is written on the other cores (both needed by the next calls).
#
# The 8-layer decode step takes ~2.4-3.4 ms (~300-400 us a layer, against ~68 us a layer for
# llama.cpp's whole decode) although its kernels summed to ~106 us a layer when launched one by
# one under the profiler (benchmarks/gpu_2026-12-03-s5): a profiler session turns XLA's command
# buffers off. --xla_enable_command_buffers_during_profiling keeps the graph, so the trace gives
# each node's time inside it and the gaps between nodes (profile_decode.py's device_span_ms and
# timeline). Variants, all with --kernels pallas --attention pallas --routing pallas (but one):
#   graph    the trace with the graphs kept
#   opbyop   the trace as XLA does it by default (kernels launched one by one)
#   dump     no trace; XLA's thunk sequence of the decode module (what the graph holds)
#   block8   as graph, eight decode steps a device call (--decode-block 8): a while loop
#   block8_dev  as block8, with loops and conditionals allowed as CUDA graph nodes too (command
#            buffer types WHILE and CONDITIONAL). In the tenth session's trace they stayed on the
#            host (the loop's body holds the cub sorts of the sampler and the top-n logprobs)
#   block8_xlaroute  as block8_dev with --routing xla (the router in XLA's kernels)
#
#   run: [VARIANTS="graph block8"] bash scripts/graph_trace_probe.sh   (carry .whl and, to build llama.cpp, .baseline;
#        BUILD=0 skips the build and the 48-layer file; writes under $OUT). The build and the
#        48-layer file go on after the call returns; the next call starts with
#        scripts/await_builds.sh.
set -u
# Files go to $RES and come back as one archive (a device call returns 8 files at most).
OUT=${OUT:-/tmp/graph_trace_probe}
RES=/tmp/graph_trace_probe_files
mkdir -p "$OUT" "$RES"
S="python3 scripts/gpu_session.py --out $RES"
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
[ "${BUILD:-1}" = 1 ] && bash scripts/start_builds.sh
CORES=13-15; [ "${BUILD:-1}" = 1 ] || CORES=0-15
taskset -c $CORES $S model --layers 8 2>&1 | tail -1 | cut -c1-160
declare -A FLAGS=(
  [graph]="--xla_enable_command_buffers_during_profiling=true"
  [opbyop]=""
  [dump]="--xla_dump_to=/tmp/gtp-dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*"
  [block8]="--xla_enable_command_buffers_during_profiling=true"
  [block8_dev]="--xla_enable_command_buffers_during_profiling=true --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
)
# block8_dev with the router's norm, product and top-k in XLA (the pallas router_logits took 5.6 us
# a layer where XLA's three kernels had taken 4.6: docs/LOG.md, seventeenth session)
FLAGS[block8_xlaroute]=${FLAGS[block8_dev]}
for v in ${VARIANTS:-graph block8 block8_dev dump opbyop}; do
  [ $SECONDS -gt 450 ] && { echo "$v: skipped, the call's time is nearly spent"; continue; }
  trace=""; [ $v = dump ] && trace="--no-trace"
  [[ $v == block8* ]] && trace="--decode-block 8"
  routing=pallas; [[ $v == *_xlaroute ]] && routing=xla
  XLA_FLAGS="${FLAGS[$v]}" taskset -c $CORES timeout 150 python3 scripts/profile_decode.py --model $M8 \
    --kernels pallas --attention pallas --routing $routing --steps 16 $trace --out /tmp/gtp-$v > /tmp/gtp-$v.log 2>&1
  echo "$v: rc $? at ${SECONDS}s"
  if [ -f /tmp/gtp-$v/profile.json ]; then
    cp /tmp/gtp-$v/profile.json "$RES/profile-$v.json"
    [ -f /tmp/gtp-$v/events.json.gz ] && cp /tmp/gtp-$v/events.json.gz "$RES/events-$v.json.gz"
    python3 - /tmp/gtp-$v/profile.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: d.get(k) for k in ("dispatch_ms", "step_ms", "device_busy_ms", "device_span_ms", "traced_steps_found")})
for k in d.get("kernels_top", [])[:12]:
    print("  ", k["name"][:50], k["calls_per_step"], k["us_per_step"])
PY
  else
    tail -5 /tmp/gtp-$v.log | cut -c1-300
  fi
done
seq_file=$(ls -t /tmp/gtp-dump/*decode*thunk_sequence_after_thunk_passes* 2>/dev/null | head -1)
[ -n "$seq_file" ] && cp "$seq_file" "$RES/decode_8l_thunk_sequence.txt" && echo "thunks: $(grep -c . "$seq_file") lines"
python3 scripts/hlo_launches.py /tmp/gtp-dump > "$RES/hlo_launches.json" 2>&1; cut -c1-300 "$RES/hlo_launches.json"
tar czf "$OUT/graph_trace_probe.tgz" -C "$RES" .
echo "end ${SECONDS}s; llama.cpp build done: $(cat /tmp/llbuild.done 2>/dev/null || echo no), 48-layer file: $(cat /tmp/model48.done 2>/dev/null || echo no)"
