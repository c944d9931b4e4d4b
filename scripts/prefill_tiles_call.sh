#!/usr/bin/env bash
# One short device call: pp512 of a few layers of the 30B shape with the prefill products on quant
# tiles with x in one bf16 part (pallas-bf16, q-bf16: the default's prefill), in two (pallas-qtiles, q-bf16x2)
# and on f32 tiles (--kernels pallas, tf32x3), in one call, so the choice of the GPU's prefill
# default rests on an end-to-end number. Decode is not run
# (-n 0): the kernels differ only in prefill. Writes <kernels>.jsonl and model.json under $OUT.
#   run: [LAYERS=4] [TINY=1] bash scripts/prefill_tiles_call.sh      (carry .whl)
set -u
OUT=${OUT:-/tmp/prefill_tiles}
LAYERS=${LAYERS:-4}
mkdir -p "$OUT"
T=""; P=512; [ "${TINY:-0}" = 1 ] && T="--tiny" && P=64
python3 scripts/gpu_session.py --out "$OUT" $T --layers "$LAYERS" model 2>&1 | tail -1 | cut -c1-160
M=$(ls /tmp/bloomery/*-"$LAYERS"l-q4km.gguf | head -1)
for k in pallas-bf16 pallas-qtiles pallas; do
  timeout "${VARIANT_TIMEOUT:-110}" python3 -m bloomery_jax.bench --model "$M" -p $P -n 0 --parallel 1 --reps 5 --json \
    --kernels $k --attention pallas --routing pallas > "$OUT/$k.jsonl" 2> "$OUT/$k.err"
  echo "$k rc $? at ${SECONDS}s: $(grep -h tps_median "$OUT/$k.jsonl" | cut -c1-300)"
done
