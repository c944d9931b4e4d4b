#!/usr/bin/env bash
# Thirty-first session, call 3 (at once after call2.sh, same machine): our card bench under the
# GPU's defaults (pallas-q8-bf16, attention and routing pallas, decode block 8) from
# .baseline/old (4866694), then llama-bench all on the card again, and the ratios.
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s31/call3.sh     (carry .whl and .baseline)
set -u
export PYTHONUNBUFFERED=1
R=/tmp/s31/c3; mkdir -p $R/old  # packed into $OUT/c3.tgz
bash scripts/await_builds.sh 200 || exit 1
B="scripts/gpu_session.py --reps 3 --parallel 1 --kernels pallas-q8-bf16 --attention pallas --routing pallas --decode-block 8 --variant-timeout 230"
(cd .baseline/old && PYTHONPATH=/tmp/site:$PWD python3 $B --out $R/old bench --only card)
echo "ours done at ${SECONDS}s"
PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out $R llamacpp --only card
for v in old; do
  cp $R/llamacpp.json $R/$v/ && PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out $R/$v compare
done
tar czf $OUT/c3.tgz -C $R .; echo "end ${SECONDS}s"
