#!/usr/bin/env bash
# One device call (nvidia-h200): where the default COD attention kernels (wgmma, PIPE=2 on sm_90)
# spend fwd+bwd time at 8K (bench/profile_attention.py, capped and uncapped), and Nsight Compute
# sections of the wgmma forward, dQ and dK/dV kernels at 8K capped. Logs in $OUT/prof.tgz,
# summary in $OUT/summary.txt.
#   OUT=/path bash bench/gpu_profile_default.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/_gpu_box.sh
unset PEAGLE_ATTN_FWD PEAGLE_ATTN_BWD PEAGLE_ATTN_FWD_MF PEAGLE_ATTN_FWD_WARPS PEAGLE_ATTN_WGMMA_BMQ PEAGLE_ATTN_WGMMA_PIPE
call_start prof 400
for cap in 1024 none; do
  box 60 "$work/profile_8192_$cap.log" python3 bench/profile_attention.py --n 8192 --cap $cap --out "$work"
  cat "$work/profile_8192_$cap.log" | tee -a "$sum"
done
if command -v ncu > /dev/null; then
  sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
--section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats"
  # one warm-up step (3 matching launches: fwd, dq, dkv), then the profiled step
  box 150 "$work/ncu_default.log" ncu --clock-control none -k "regex:cod_attn_(fwd|dq|dkv)_wgmma_kernel" \
    --launch-skip 3 --launch-count 3 $sections python3 bench/profile_attention.py --ncu --n 8192 --cap 1024
  grep -E "cod_attn_.*wgmma_kernel|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Issued Warp|Block Limit|Dynamic Shared|One or More Eligible|Warp Cycles Per Issued" \
    "$work/ncu_default.log" | head -80 | tee -a "$sum"
fi
call_end
