#!/usr/bin/env bash
# Nsight Compute on one decode layer's GEMV launches as the code picks them today (issue 7: the
# MoE launches move ~0.8 TB/s of a ~3.3 TB/s card): for each family of layer_kernel_bench.py, two
# launches after the warm-up, with the sections that say whether a launch waits on memory
# latency, on its issue slots or on too few resident warps. Needs a Firecracker machine (ncu
# reads no counters on gVisor) and leaves the clocks alone (--clock-control none).
#   OUT=$OUT bash scripts/ncu_decode_kernels.sh [family:kernel-regex ...]
set -u
OUT=${OUT:-/tmp/ncu_out}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
  --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis"
for pair in ${@:-gate_up:moe_gemv_many down:moe_gemv_q6_k down_q4k:moe_gemv_q4_k qkv:qgemv_many}; do
  fam=${pair%%:*} kernel=${pair#*:}
  timeout 150 ncu --clock-control none --launch-skip 6 --launch-count 2 -k "regex:$kernel" $SECTIONS \
    -f -o "$OUT/ncu_$fam" python3 scripts/layer_kernel_bench.py --families $fam --current-only --reps 1 \
    --max-copies 4 > "$OUT/ncu_$fam.log" 2>&1
  echo "$fam: rc $?"
  [ -f "$OUT/ncu_$fam.ncu-rep" ] && ncu -i "$OUT/ncu_$fam.ncu-rep" --page details --print-units base > "$OUT/ncu_$fam.txt" 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Size|Grid Size|Warp Cycles Per Issued|Stall|Waves Per SM" \
    "$OUT/ncu_$fam.txt" 2>/dev/null | head -24
done
