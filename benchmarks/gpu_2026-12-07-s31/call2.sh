#!/usr/bin/env bash
# Thirty-first session, call 2 (a fresh machine): the builds start (llama.cpp on cores 0-11, the
# 48-layer file on core 12); meanwhile on cores 13-15 the router launch's own top-k checked
# against route_topk on the card (route_fused_check.py), and the 8-layer decode profile of the
# tree before this session (.baseline/old = git archive 4866694 bloomery_jax scripts configs
# pyproject.toml, run from its own root), of this tree with the top-k a launch of its own
# (routing pallas-split: the router adds o's partials only) and of this tree's default; then our
# card bench under the GPU's defaults, llama-bench all on the card, and the ratios.
# call3.sh (the old tree's card bench) may follow at once.
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s31/call2.sh     (carry .whl and .baseline)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=/tmp/s31/c2; mkdir -p $R  # packed into $OUT/c2.tgz
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=/tmp/site:$PWD bash scripts/start_builds.sh
PYTHONPATH=/tmp/site:$PWD taskset -c 13-15 timeout 150 python3 scripts/route_fused_check.py --calls 60 \
  --json $R/route_check.json > $R/route_check.log 2>&1
tail -1 $R/route_check.log | cut -c1-400
PYTHONPATH=/tmp/site:$PWD taskset -c 13-15 python3 scripts/gpu_session.py --out /tmp/m8out model --layers 8 > $R/model8.log 2>&1
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
export XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true
for v in old:pallas split:pallas-split new:pallas; do
  tree=${v%%:*}; routing=${v#*:}; root=$PWD; [ $tree = old ] && root=$PWD/.baseline/old
  P="scripts/profile_decode.py --model $M8 --kernels pallas-q8-bf16 --attention pallas --routing $routing --steps 16"
  (cd $root && PYTHONPATH=/tmp/site:$root taskset -c 13-15 timeout 130 python3 $P --out /tmp/p_$tree > $R/p_$tree.log 2>&1)
  cp /tmp/p_$tree/profile.json $R/p_$tree.json
  grep "^families" $R/p_$tree.log | cut -c1-700
done
unset XLA_FLAGS
tar czf $OUT/c2.tgz -C $R .
for ((t = 0; t < 150; t += 2)); do [ -f /tmp/model48.done ] && break; sleep 2; done
B="scripts/gpu_session.py --out $R/new --reps 3 --parallel 1 --kernels pallas-q8-bf16 --attention pallas --routing pallas --decode-block 8 --variant-timeout 230"
mkdir -p $R/new && PYTHONPATH=/tmp/site:$PWD python3 $B bench --only card
tar czf $OUT/c2.tgz -C $R .
bash scripts/await_builds.sh 300 || exit 1
PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out $R/new llamacpp --only card
PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out $R/new compare
tar czf $OUT/c2.tgz -C $R .
echo "end ${SECONDS}s; llama.cpp build: $(cat /tmp/llbuild.done 2>/dev/null || echo running), 48-layer file: $(cat /tmp/model48.done 2>/dev/null || echo running)"
