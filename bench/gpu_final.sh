#!/usr/bin/env bash
# One device call for the open GPU items of issues 3, 7 and 10, in priority order, each
# time-boxed against a total budget (CALL_BUDGET seconds, default 570): build; the forward CTA
# shapes (bench/attn_variants.sh: tests, timing, memcheck); the tiny-layout gradient test and its
# diagnosis; initcheck of the loss op with per-case markers plus the cuBLAS probe; the 2,000-step
# long run on CUDA; the 8K train step under the default and the MF=2 forward. Everything lands in
# $OUT/final.tgz plus $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/_gpu_box.sh
call_start final 570

# 0. the default forward after the MF-generalised rewrite: every default-shape CUDA attention test
box 150 "$work/attn_default_tests.log" python3 -m pytest -q -ra --timeout=120 python_tests/test_attention.py \
  -k "(cuda and not fwd_configs and not mf2w4 and not mf2w8 and not mf1w4) or flash_backward_reference"
tail -1 "$work/attn_default_tests.log" | tee -a "$sum"
grep -E "^(FAILED|ERROR)" "$work/attn_default_tests.log" | head -8 | tee -a "$sum"
grep -E "^E  .*Assertion" "$work/attn_default_tests.log" | head -4 | cut -c1-600 | tee -a "$sum"

# 1. forward CTA shapes
box 240 "$work/attn_variants.log" env OUT="$work/attn" SANITIZE_TIMEOUT=60 bash bench/attn_variants.sh
grep -E "^(tests|bench|compute-sanitizer|attn_variants|FAILED)" "$work/attn/attn_variants_summary.txt" | tee -a "$sum"
grep -A14 -E "^== fwd configs|speed-up|vs default" "$work/attn/attn_variants_bench.log" | head -40 | tee -a "$sum"

# 4. long run on CUDA
box 120 "$work/long_run.log" python3 bench/long_run.py --device cuda --steps 2000 --out "$work/long_run"
tail -8 "$work/long_run.log" | tee -a "$sum"

# 3. initcheck: the loss op with case markers, and the cuBLAS probe
box 60 "$work/initcheck_loss.log" compute-sanitizer --tool initcheck --print-limit 4 --error-exitcode 99 \
  python3 bench/sanitize_ops.py loss
grep -E "^case|Uninitialized|ERROR SUMMARY|Device Frame" "$work/initcheck_loss.log" | awk '/^case/{c=$0; next} {print c " | " $0}' | head -12 | tee -a "$sum"
box 60 "$work/initcheck_probe.log" compute-sanitizer --tool initcheck --error-exitcode 99 python3 bench/initcheck_cublas_probe.py
grep -E "ERROR SUMMARY|probe ok" "$work/initcheck_probe.log" | tee -a "$sum"

# diagnosis of the tiny-layout gradient error (test above)
box 45 "$work/diag_tiny.log" python3 bench/diag_attention_tiny.py
grep -E "^(==|dq|dk|dv)" "$work/diag_tiny.log" | head -20 | tee -a "$sum"

# 5. the 8K train step under each forward shape (peagle only: speculators ran in the e2e call)
for mf in 1 2; do
  box 45 "$work/train_step_mf$mf.log" env PEAGLE_ATTN_FWD_MF=$mf python3 bench/bench_train_step.py \
    --cases peagle-1L-8K --budget-s 40 --out "$work/train_step_mf$mf" --logdir "$work/train_step_mf${mf}_logs"
  grep -E "^\| peagle" "$work/train_step_mf$mf.log" | sed "s/^/MF=$mf /" | tee -a "$sum"
done
call_end
