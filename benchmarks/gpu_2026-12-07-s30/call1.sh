#!/usr/bin/env bash
# Thirtieth session, call 1: does the gate/up launch gain from reading x rounded by the router?
# (1) layer_kernel_bench: gate/up as picked (norm and rounding in the launch) and on given Q8_1
# blocks (sweep; its winner to tuned_gu.json); (2) 8-layer decode profiles: the package before
# the router rounded (.baseline/old = git archive 5f73e27), after, and after under tuned_gu.json;
# (3) the other q8 launches as picked and on given blocks (what rounding in the producer could give).
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s30/call1.sh     (carry .whl and .baseline)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/c1; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader
(taskset -c 12-15 python3 scripts/gpu_session.py --out /tmp/m8out model --layers 8 > $R/model8.log 2>&1; echo done > /tmp/m8.done) &
L="taskset -c 0-11 python3 scripts/layer_kernel_bench.py"
timeout 130 $L --budget-s 110 --json $R/lkb_gu.json --tuned-out $R/tuned_gu.json \
  --families gate_up_q8:current,gate_up_q8_given > $R/lkb_gu.txt 2>&1
grep -v Warn $R/lkb_gu.txt | cut -c1-80; cat $R/tuned_gu.json
for i in $(seq 60); do [ -f /tmp/m8.done ] && break; sleep 2; done
tail -1 $R/model8.log | cut -c1-160
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
P="python3 scripts/profile_decode.py --model $M8 --kernels pallas-q8-bf16 --attention pallas --routing pallas --steps 16"
summ() {
  python3 - "$1" <<'PY'
import collections, json, sys
d = json.load(open(sys.argv[1]))
a = collections.defaultdict(float)
for k in d["kernels_top"]:
    a[k["name"].split("__")[0]] += k["us_per_step"]
print(sys.argv[1].split("/")[-1], {k: d.get(k) for k in ("step_ms", "device_busy_ms")})
print(sorted([(round(v, 1), k) for k, v in a.items()], reverse=True)[:16])
PY
}
export XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true
PYTHONPATH=/tmp/site:$PWD/.baseline/old:$PWD timeout 100 $P --out /tmp/p_old > $R/p_old.log 2>&1
cp /tmp/p_old/profile.json $R/p_old.json && summ $R/p_old.json
timeout 100 $P --out /tmp/p_new > $R/p_new.log 2>&1
cp /tmp/p_new/profile.json $R/p_new.json && summ $R/p_new.json
BLOOMERY_GEMV_TUNED=$R/tuned_gu.json timeout 100 $P --out /tmp/p_newt > $R/p_newt.log 2>&1
cp /tmp/p_newt/profile.json $R/p_newt.json && summ $R/p_newt.json
echo "profiles done at ${SECONDS}s"
unset XLA_FLAGS
timeout $((560 - SECONDS)) $L --budget-s $((540 - SECONDS)) --json $R/lkb_rest.json \
  --families down_q8:current,down_q8_given,o_q8:current,o_q8_given,qkv_q8:current,qkv_q8_given,down_q4k_q8:current,down_q4k_q8_given \
  > $R/lkb_rest.txt 2>&1
grep -v Warn $R/lkb_rest.txt | cut -c1-80
echo "end ${SECONDS}s"
