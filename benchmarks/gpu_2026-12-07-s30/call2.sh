#!/usr/bin/env bash
# Thirtieth session, call 2 (a fresh machine): the builds start (llama.cpp on cores 0-11, the
# 48-layer file on core 12); meanwhile on cores 13-15 the 8-layer decode profile of the tree
# before this session's changes (.baseline/old = git archive 5f73e27 bloomery_jax scripts configs
# pyproject.toml, run from its own root) and of this tree, the router launch without rounding
# as picked and with it under its sweep (chunks up to whole rows); then our card bench under the GPU's defaults
# while llama.cpp builds, llama-bench all on the card, and the ratios (gpu_hold.sh's
# card_beside_llamacpp). call3.sh (the old tree's card bench) may follow at once.
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s30/call2.sh     (carry .whl and .baseline)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=/tmp/s30/c2; mkdir -p $R  # packed into $OUT/c2.tgz at the end (a call returns few files)
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=/tmp/site:$PWD bash scripts/start_builds.sh
PYTHONPATH=/tmp/site:$PWD taskset -c 13-15 python3 scripts/gpu_session.py --out /tmp/m8out model --layers 8 > $R/model8.log 2>&1
tail -1 $R/model8.log | cut -c1-160
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
P="scripts/profile_decode.py --model $M8 --kernels pallas-q8-bf16 --attention pallas --routing pallas --steps 16"
export XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true
for tree in old new; do
  root=$PWD; [ $tree = old ] && root=$PWD/.baseline/old
  (cd $root && PYTHONPATH=/tmp/site:$root taskset -c 13-15 timeout 130 python3 $P --out /tmp/p_$tree > $R/p_$tree.log 2>&1)
  cp /tmp/p_$tree/profile.json $R/p_$tree.json
  python3 - $R/p_$tree.json <<'PY'
import collections, json, sys
d = json.load(open(sys.argv[1]))
a = collections.defaultdict(float)
for k in d["kernels_top"]:
    a[k["name"].split("__")[0]] += k["us_per_step"]
print(sys.argv[1].split("/")[-1], {k: d.get(k) for k in ("step_ms", "device_busy_ms")})
print(sorted([(round(v, 1), k) for k, v in a.items()], reverse=True)[:14])
PY
done
unset XLA_FLAGS
PYTHONPATH=/tmp/site:$PWD taskset -c 13-15 timeout 70 python3 scripts/layer_kernel_bench.py --json $R/lkb.json \
  --budget-s 55 --families router:current,router_rounded > $R/lkb.txt 2>&1
grep -v Warn $R/lkb.txt | cut -c1-80
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
