#!/usr/bin/env bash
# Thirty-first session, call 3 (prepared; no machine came, and then the budget was spent: the
# next session's first call). A fresh machine: the ticket check of the router, down, o and
# (thirty-second session) the one-launch attention (route_fused_check.py), then the 8-layer decode profiles of this tree under routing
# pallas (the measured default: 1.184x in the thirtieth session) and pallas-tickets (the router's
# launch routes, o and down add x in their last programs).
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s31/call3.sh     (carry .whl)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=/tmp/s31/c3; mkdir -p $R  # packed into $OUT/c3.tgz
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out /tmp/m8out model --layers 8 > $R/model8.log 2>&1 &
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 scripts/route_fused_check.py --calls 8 --layers 16 --rows 1,8 \
  --json $R/route_check.json > $R/route_check.log 2>&1
grep '"launch"' $R/route_check.log | cut -c1-260; tail -1 $R/route_check.log | grep -o '"ok": [a-z]*'
wait
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
export XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true
for routing in pallas pallas-tickets; do
  P="scripts/profile_decode.py --model $M8 --kernels pallas-q8-bf16 --attention pallas --routing $routing --steps 16"
  PYTHONPATH=/tmp/site:$PWD timeout 100 python3 $P --out /tmp/p_$routing > $R/p_$routing.log 2>&1
  cp /tmp/p_$routing/profile.json $R/p_$routing.json
  echo "$routing: $(grep -o '"step_ms": [0-9.]*, "device_busy_ms": [0-9.]*' $R/p_$routing.log)"
  grep "^families" $R/p_$routing.log | cut -c1-600
  tar czf $OUT/c3.tgz -C $R .
done
echo "end ${SECONDS}s"
