#!/usr/bin/env bash
# Thirtieth session, call 4 (a fresh machine): the hybrid default under this session's q8 path
# (the router's rounded x with the host experts beside: n-cpu-moe=36, the ffi bridge with its
# doorbell, the host team's default), beside llama.cpp -ncmoe 36 before and after ours.
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s30/call4.sh     (carry .whl and .baseline)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/s30/c4; mkdir -p $R  # packed into $OUT/c4.tgz
nvidia-smi --query-gpu=name --format=csv,noheader
bash scripts/start_builds.sh
for ((t = 0; t < 150; t += 2)); do [ -f /tmp/model48.done ] && break; sleep 2; done
python3 scripts/gpu_session.py --out $R --reps 3 --parallel 1 --kernels pallas-q8-bf16 --attention pallas --routing pallas \
  --decode-block 8 --variant-timeout 330 --bridge ffi --signal doorbell bench --only ncmoe36
tar czf $OUT/c4.tgz -C $R .
bash scripts/await_builds.sh 300 || exit 1
python3 scripts/gpu_session.py --out $R llamacpp --only ncmoe36
python3 scripts/gpu_session.py --out $R compare
tar czf $OUT/c4.tgz -C $R .
echo "end ${SECONDS}s"
