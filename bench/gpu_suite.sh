#!/usr/bin/env bash
# One call on a GPU machine (the H200): build, GPU tests, benchmarks, sanitizers.
# Results go under $OUT (or ./gpu_out): build.log, tests.log, junit xml, bench_*.json, a summary.
#   bash bench/gpu_suite.sh [build] [tests] [bench] [sanitize] [quick]   (default: build tests bench)
# `quick` shrinks the benchmark sizes. Every phase runs even if an earlier one failed; the exit
# code is non-zero if any phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
phases=${*:-build tests bench}
status=0
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
have() { [[ " $phases " == *" $1 "* ]]; }

note "== gpu_suite $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$summary"

if have build || ! python3 -c "import peagle_ext" 2>/dev/null; then
  t0=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-16} PEAGLE_WITH_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
  rc=$?; note "build: rc=$rc in $(( $(date +%s) - t0 ))s"; [ $rc -eq 0 ] || { status=1; tail -40 "$OUT/build.log"; exit 1; }
  python3 -c "import peagle_ext; print(peagle_ext.build_info())" | tee -a "$summary"
fi

if have tests; then
  t0=$(date +%s)
  files=$(ls python_tests/test_{cod,attention,loss,vllm}.py 2>/dev/null)
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -ra -x --junitxml="$OUT/junit.xml" $files > "$OUT/tests.log" 2>&1
  rc=$?; note "tests: rc=$rc in $(( $(date +%s) - t0 ))s: $(tail -1 "$OUT/tests.log")"; [ $rc -eq 0 ] || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30 | tee -a "$summary"
fi

if have bench; then
  for b in bench/bench_cod.py bench/bench_attention.py bench/bench_loss.py bench/bench_vllm.py; do
    [ -f "$b" ] || continue
    t0=$(date +%s)
    name=$(basename "$b" .py)
    QUICK=$([[ " $phases " == *" quick "* ]] && echo 1 || echo 0) OUT="$OUT" timeout ${BENCH_TIMEOUT:-240} python3 "$b" > "$OUT/$name.log" 2>&1
    rc=$?; note "$name: rc=$rc in $(( $(date +%s) - t0 ))s"; [ $rc -eq 0 ] || status=1
    tail -25 "$OUT/$name.log" >> "$summary"
  done
fi

if have sanitize; then
  for tool in memcheck racecheck initcheck synccheck; do
    t0=$(date +%s)
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 99 python3 bench/sanitize_ops.py > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool: rc=$rc in $(( $(date +%s) - t0 ))s: $(grep -E 'ERROR SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  done
fi
note "== done, status=$status"
cat "$summary"
exit $status
