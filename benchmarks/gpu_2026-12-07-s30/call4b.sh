#!/usr/bin/env bash
# Thirtieth session, call 4b (a fresh machine): call4.sh without llama.cpp, for a budget too
# small for its build: n-cpu-moe=36 under this session's q8 path (the card's gate/up on the
# router's rounded x, the host experts beside through the ffi bridge and its doorbell, the host
# team's default). Not side by side: it checks that the path runs on a card and what it decodes at.
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s30/call4b.sh     (carry .whl)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/s30/c4b; mkdir -p $R  # packed into $OUT/c4b.tgz
nvidia-smi --query-gpu=name --format=csv,noheader
python3 scripts/gpu_session.py --out /tmp/model48-out model > $R/model48.log 2>&1; sync
tail -1 $R/model48.log | cut -c1-160
python3 scripts/gpu_session.py --out $R --reps 3 --parallel 1 --kernels pallas-q8-bf16 --attention pallas --routing pallas \
  --decode-block 8 --variant-timeout $((320 - SECONDS)) --bridge ffi --signal doorbell bench --only ncmoe36
python3 - $R <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/bench-ncmoe36-*.json"):
    d = json.load(open(f))
    print(f.split("/")[-1], d["rc"], [(r["test"], round(r["tps_median"], 1), [round(s, 1) for s in r["samples"]]) for r in d["records"]])
    print(d["stderr"][-600:])
PY
tar czf $OUT/c4b.tgz -C $R .
echo "end ${SECONDS}s"
