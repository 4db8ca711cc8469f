#!/usr/bin/env bash
# Issue 10's GPU sweep in one device call: build, the GPU tests of the hardened ops and the
# property / bad-input suites, every sanitizer on every op (sanitize_all.sh), and the long-run
# memory check on CUDA. Everything lands in $OUT/hardening.tgz (the device tool returns at most
# 8 files) plus $OUT/summary.txt.
#   OUT=/tmp/o bash bench/gpu_hardening.sh [--no-long-run]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
work="$OUT/hardening"
mkdir -p "$work"
TEST_FILES=${TEST_FILES:-"python_tests/test_cod.py python_tests/test_attention.py python_tests/test_properties.py python_tests/test_bad_inputs.py"} \
  OUT="$work/suite" bash bench/gpu_suite.sh build tests
OUT="$work/sanitize" SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-240} bash bench/sanitize_all.sh > "$work/sanitize_all.log" 2>&1
echo "sanitize_all rc=$?" >> "$work/suite/summary.txt"
if [ "${1:-}" != "--no-long-run" ]; then
  timeout ${LONG_RUN_TIMEOUT:-200} python3 bench/long_run.py --device cuda --steps 2000 --out "$work/long_run" \
    > "$work/long_run.log" 2>&1
  echo "long_run rc=$?" >> "$work/suite/summary.txt"
fi
cat "$work/suite/summary.txt" "$work/sanitize/sanitize_summary.md" > "$OUT/summary.txt" 2>/dev/null
(cd "$OUT" && tar czf hardening.tgz hardening && rm -rf hardening)
cat "$OUT/summary.txt"
