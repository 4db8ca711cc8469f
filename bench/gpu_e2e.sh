#!/usr/bin/env bash
# Issue 7's GPU run in one device call: build, a few targeted GPU tests, the initcheck probe of
# cuBLAS-written buffers, then bench_train_step.py (peagle_ext vs speculators 0.9.0 vs plain
# PyTorch) with speculators' wheels from .whl/ (carried beside the repo, git-ignored).
# Everything lands in $OUT: bench_train_step.{json,png}, e2e.tgz (logs), summary.txt.
#   OUT=/tmp/o TRAIN_STEP_BUDGET=420 bash bench/gpu_e2e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
work="$OUT/e2e"
mkdir -p "$work"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
OUT="$work/suite" bash bench/gpu_suite.sh build > /dev/null 2>&1 || { cat "$work/suite/summary.txt"; }
{
  cat "$work/suite/summary.txt"
  if [ -n "${E2E_TESTS:-}" ]; then
    timeout 240 python3 -m pytest -q -ra $E2E_TESTS ${E2E_K:+-k "$E2E_K"} > "$work/tests.log" 2>&1
    echo "tests ($E2E_TESTS): rc=$? $(tail -1 "$work/tests.log")"
    grep -E "^(FAILED|ERROR)" "$work/tests.log" | head
  fi
  timeout 120 compute-sanitizer --tool initcheck --error-exitcode 99 python3 bench/initcheck_cublas_probe.py \
    > "$work/initcheck_probe.log" 2>&1
  echo "initcheck cuBLAS probe: rc=$? $(grep -E 'ERROR SUMMARY' "$work/initcheck_probe.log" | tail -1)"
  grep -E "max rel err|probe ok" "$work/initcheck_probe.log"
  grep -m3 -A8 "Uninitialized" "$work/initcheck_probe.log" | grep -E "Uninitialized|Device Frame" | head -6
} | tee -a "$OUT/summary.txt"
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$work/pip.log" 2>&1
echo "speculators wheels: rc=$?" | tee -a "$OUT/summary.txt"
PYTHONPATH=/tmp/site:$PWD timeout $(( ${TRAIN_STEP_BUDGET:-420} + 60 )) python3 bench/bench_train_step.py \
  --budget-s "${TRAIN_STEP_BUDGET:-420}" --out "$OUT" --logdir "$work/train_step_logs" > "$work/bench_train_step.log" 2>&1
echo "bench_train_step: rc=$?" | tee -a "$OUT/summary.txt"
tail -40 "$work/bench_train_step.log" | tee -a "$OUT/summary.txt"
(cd "$OUT" && tar czf e2e.tgz e2e && rm -rf e2e)
