#!/usr/bin/env bash
# Thirty-first session, call 3 (a fresh machine, ~450 s of device time left): after call 2 showed
# this session's first form slow (the router adding o's partials; down's combine reading 8 rows of
# x a program by a row-count slip) and the routing weights a few ulps off route_topk's: the ticket
# check of the router, down and o launches (route_fused_check.py, weights to ulps), then the
# 8-layer decode profile of the tree before this session (.baseline/old = git archive 4866694),
# of this tree with the top-k a launch of its own (routing pallas-split: o and down add x by
# ticket) and of this tree's default (routing pallas: the router's launch routes too).
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s31/call3.sh     (carry .whl and .baseline)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=/tmp/s31/c3; mkdir -p $R  # packed into $OUT/c3.tgz
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out /tmp/m8out model --layers 8 > $R/model8.log 2>&1 &
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 scripts/route_fused_check.py --calls 8 --layers 16 \
  --json $R/route_check.json > $R/route_check.log 2>&1
grep '"launch"' $R/route_check.log | cut -c1-260; tail -1 $R/route_check.log | grep -o '"ok": [a-z]*'
wait
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
export XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true
for v in old:pallas split:pallas-split new:pallas; do
  tree=${v%%:*}; routing=${v#*:}; root=$PWD; [ $tree = old ] && root=$PWD/.baseline/old
  P="scripts/profile_decode.py --model $M8 --kernels pallas-q8-bf16 --attention pallas --routing $routing --steps 16"
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 100 python3 $P --out /tmp/p_$tree > $R/p_$tree.log 2>&1)
  cp /tmp/p_$tree/profile.json $R/p_$tree.json
  echo "$tree: $(grep -o '"step_ms": [0-9.]*, "device_busy_ms": [0-9.]*' $R/p_$tree.log)"
  grep "^families" $R/p_$tree.log | cut -c1-600
  tar czf $OUT/c3.tgz -C $R .
done
echo "end ${SECONDS}s"
