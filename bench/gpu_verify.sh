#!/usr/bin/env bash
# The last device call of a session: re-validate what changed after gpu_final.sh (the D=128
# forward default is now 4 warps; the tiny-layout test's float64 algorithm reference), then the
# loss initcheck diagnosis and the CUDA long run. Time-boxed (CALL_BUDGET, default 400 s).
# Everything lands in $OUT/verify.tgz plus $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/_gpu_box.sh
call_start verify 400

# every default-shape CUDA attention test (D=128 forward now 4 warps) + the former default shape
box 120 "$work/attn_tests.log" python3 -m pytest -q -ra --timeout=100 python_tests/test_attention.py \
  -k "(cuda and not fwd_configs and not mf2w4 and not mf2w8 and not mf1w4) or flash_backward_reference or (fwd_configs and mf1w8)"
tail -1 "$work/attn_tests.log" | tee -a "$sum"
grep -E "^(FAILED|ERROR)" "$work/attn_tests.log" | head -8 | tee -a "$sum"
grep -E "^E  .*Assertion" "$work/attn_tests.log" | head -4 | cut -c1-700 | tee -a "$sum"

# the new default under memcheck and racecheck
box 90 "$work/sanitize_attention.log" env OUT="$work/sanitize" SANITIZE_TOOLS="memcheck racecheck" \
  SANITIZE_OPS=attention SANITIZE_TIMEOUT=60 bash bench/sanitize_all.sh
grep -E "^\| (memcheck|racecheck)" "$work/sanitize/sanitize_summary.md" | tee -a "$sum"

# forward timing of the shapes (default now 4 warps at D=128)
box 30 "$work/fwd_configs.log" env QUICK=1 OUT="$work" python3 bench/bench_attention.py --fwd-configs
grep -E "^ +[0-9]+ " "$work/fwd_configs.log" | tee -a "$sum"

box 90 "$work/initcheck_diag.log" env OUT="$work/initcheck" bash bench/initcheck_loss_diag.sh
cat "$work/initcheck_diag.log" | tee -a "$sum"

box 200 "$work/long_run.log" python3 bench/long_run.py --device cuda --steps 2000 --out "$work/long_run"
tail -8 "$work/long_run.log" | tee -a "$sum"
call_end
