#!/usr/bin/env bash
# Thirty-second session (no device: loans paused), prepared for the next: where pp512's gap to
# llama.cpp goes. The 8-layer prefill profiles (512-token prompts) of pallas-q8-bf16 (the GPU
# default: "ggml"-layout quant tiles, 0.946x llama.cpp in the thirtieth session, now with the
# paired tiles of Q4_K/Q5_K/Q8_0) and pallas-bf16 (the same q-bf16 tiles on the "planes" layout,
# 1.027x in the seventeenth), kernel families side by side: how far apart are the two layouts'
# moe_gemm (gate/up Q4_K, down Q6_K) and dense products now?
#   OUT=$OUT bash benchmarks/gpu_2026-12-07-s32/call_prefill.sh     (carry .whl)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
R=/tmp/s32/pf; mkdir -p $R  # packed into $OUT/pf.tgz
nvidia-smi --query-gpu=name --format=csv,noheader
M8=/tmp/bloomery/qwen3-30b-a3b-shape-8l-q4km.gguf
[ -f $M8 ] || PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_session.py --out /tmp/m8out model --layers 8 > $R/model8.log 2>&1
export XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true
for kernels in pallas-q8-bf16 pallas-bf16; do
  P="scripts/profile_decode.py --model $M8 --kernels $kernels --attention pallas --routing pallas --prefill --prompt 512 --steps 3"
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 $P --out /tmp/pf_$kernels > $R/pf_$kernels.log 2>&1
  cp /tmp/pf_$kernels/profile.json $R/pf_$kernels.json
  echo "$kernels: $(grep -o '"step_ms": [0-9.]*, "device_busy_ms": [0-9.]*' $R/pf_$kernels.log)"
  grep "^families" $R/pf_$kernels.log | cut -c1-600
  tar czf $OUT/pf.tgz -C $R .
done
echo "end ${SECONDS}s"
