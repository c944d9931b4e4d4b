#!/usr/bin/env bash
# Thirty-first session, call 4 (prepared for the next session, after call3.sh holds): the card
# bench under the GPU's defaults with routing pallas (the measured form) and pallas-tickets,
# then llama-bench all on the card, and the ratios of both.
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s31/call4.sh     (carry .whl and .baseline)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=/tmp/s31/c4; mkdir -p $R  # packed into $OUT/c4.tgz
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=/tmp/site:$PWD bash scripts/start_builds.sh
for ((t = 0; t < 150; t += 2)); do [ -f /tmp/model48.done ] && break; sleep 2; done
for routing in pallas-tickets pallas; do  # both records in $R: their names carry the routing
  PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out $R --reps 3 --parallel 1 --kernels pallas-q8-bf16 \
    --attention pallas --routing $routing --decode-block 8 --variant-timeout 200 bench --only card
  tar czf $OUT/c4.tgz -C $R .
done
bash scripts/await_builds.sh 300 || exit 1
PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out $R llamacpp --only card
PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out $R compare
tar czf $OUT/c4.tgz -C $R .; echo "end ${SECONDS}s"
