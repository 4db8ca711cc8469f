#!/usr/bin/env bash
# One device call (nvidia-h200-x2, or one GPU with SERIAL=1) for the switch of the COD attention
# default to the Hopper wgmma kernels (PEAGLE_ATTN_FWD/BWD unset = auto):
#   GPU 0: every CUDA attention test (auto = wgmma now, mma forced, the variants; the N=128K cases
#          only with FULL=1), then the model's CUDA tests, then the 8K train step under auto and
#          under the mma.sync kernels;
#   GPU 1: the attention bench (QUICK: ours vs flex incl. its mask, vs SDPA causal; the mma.sync
#          kernels at two sizes), then the kernel variants at head dim 64 (auto's choice there), the
#          backward variants at 128, and compute-sanitizer memcheck + racecheck of the defaults.
# Both lanes run at the same time, each time-boxed (bench/_gpu_box.sh); the two GPUs share nothing
# but the CPUs. Logs in $OUT/wgdef.tgz, the summary in $OUT/summary.txt.
#   OUT=/path [FULL=1] [BENCH_QUICK=0] bash bench/gpu_wgmma_default.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/_gpu_box.sh
unset PEAGLE_ATTN_FWD PEAGLE_ATTN_BWD PEAGLE_ATTN_FWD_MF PEAGLE_ATTN_FWD_WARPS PEAGLE_ATTN_WGMMA_BMQ
call_start wgdef 540

lane0() {
  local k="cuda"; [ "${FULL:-0}" = "1" ] || k="cuda and not 131072"
  box 230 "$work/test_attention.log" env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -ra --timeout=120 \
    python_tests/test_attention.py -k "$k" --junitxml="$work/test_attention.xml"
  box 60 "$work/test_model.log" env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -ra --timeout=60 \
    python_tests/test_model.py -k cuda
  for v in auto mma; do
    local env_v=(); [ $v = mma ] && env_v=(PEAGLE_ATTN_FWD=mma PEAGLE_ATTN_BWD=mma)
    box 60 "$work/train_step_$v.log" env CUDA_VISIBLE_DEVICES=0 "${env_v[@]}" python3 bench/bench_train_step.py \
      --cases peagle-1L-8K --budget-s 50 --out "$work/train_step_$v" --logdir "$work/train_step_${v}_logs"
  done
}
lane1() {
  # BENCH_QUICK=0: every size of the issue (4K, 8K, 16K, 32K, 128K), about 2.5x the QUICK time
  local bq=${BENCH_QUICK:-1} bt=240; [ "$bq" = "1" ] || bt=380
  box $bt "$work/bench_attention.log" env CUDA_VISIBLE_DEVICES=$lane1_gpu QUICK=$bq OUT="$work" \
    python3 bench/bench_attention.py
  box 45 "$work/bench_d64_bwd.log" env CUDA_VISIBLE_DEVICES=$lane1_gpu BENCH_D=64 QUICK=1 OUT="$work/d64" \
    BWD_NAMES=mma,wgmma,auto python3 bench/bench_attention.py --bwd-configs
  box 30 "$work/bench_d64_fwd.log" env CUDA_VISIBLE_DEVICES=$lane1_gpu BENCH_D=64 QUICK=1 OUT="$work/d64" \
    FWD_NAMES=mma,wgmma,auto python3 bench/bench_attention.py --fwd-configs
  box 45 "$work/bench_d128_bwd.log" env CUDA_VISIBLE_DEVICES=$lane1_gpu QUICK=1 OUT="$work/d128" \
    BWD_NAMES=mma,wgmma64,auto python3 bench/bench_attention.py --bwd-configs
  for tool in memcheck racecheck; do
    box 90 "$work/sanitize_$tool.log" env CUDA_VISIBLE_DEVICES=$lane1_gpu compute-sanitizer --tool $tool \
      --error-exitcode 99 python3 bench/sanitize_attention.py
  done
}
run_lanes lane0 lane1  # lane1 uses $lane1_gpu (bench/_gpu_box.sh)

note "-- test_attention: $(tail -1 "$work/test_attention.log")"
grep -E "^(FAILED|ERROR)" "$work/test_attention.log" | head -12 | tee -a "$sum"
grep -E "^E  .*(Assertion|Error)" "$work/test_attention.log" | head -6 | cut -c1-400 | tee -a "$sum"
note "-- test_model: $(tail -1 "$work/test_model.log")"
for v in auto mma; do grep -E "^\| peagle" "$work/train_step_$v.log" | sed "s/^/$v /" | tee -a "$sum"; done
note "-- bench_attention (QUICK=${BENCH_QUICK:-1})"
grep -vE "^\s*$" "$work/bench_attention.log" | tail -30 | tee -a "$sum"
note "-- head dim 64, and the backward variants at 128"
for f in bench_d64_bwd bench_d64_fwd bench_d128_bwd; do tail -n 6 "$work/$f.log" | tee -a "$sum"; done
for tool in memcheck racecheck; do
  note "-- $tool: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$work/sanitize_$tool.log" | tail -1)"
done
rm -rf "$work"/train_step_*/*.pt "$work"/train_step_*_logs 2>/dev/null
call_end
