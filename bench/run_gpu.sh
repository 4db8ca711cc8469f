#!/usr/bin/env bash
# One call on a GPU machine (the H200): build, GPU tests, benchmarks, sanitizers.
# Results go under $OUT (or ./gpu_out): build.log, tests.log, junit xml, bench_*.json, a summary.
#   bash bench/run_gpu.sh [build] [tests] [bench] [sanitize] [quick]   (default: build tests bench)
# TEST_FILES / BENCH_FILES override the lists below, TEST_K selects tests by name (pytest -k, e.g.
# "cuda"); TRAIN_STEP_CASES / TRAIN_STEP_BUDGET pick bench_train_step's cases and seconds and
# TRAIN_STEP_ARGS adds its other options (e.g. "--num-depths 4 --steps 21"); wheels
# in .whl/ (speculators and its pure-Python dependencies, for bench_train_step's anchor) are
# installed with --no-deps into /tmp/site for the benchmarks; SANITIZE_TOOLS / SANITIZE_OPS pick a
# subset of the sanitizer runs (tools/sanitize/sanitize_all.sh).
# `quick` shrinks the benchmark sizes. Every phase runs even if an earlier one failed; the exit
# code is non-zero if any phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
# The H200 image sets CXX=/opt/gcc/bin/g++; ops built with it segfault on every op error
# (setup.py checks it at build time). Use the system compiler.
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++; fi
phases=${*:-build tests bench}
status=0
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
have() { [[ " $phases " == *" $1 "* ]]; }

note "== run_gpu $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$summary"

if have build || ! python3 -c "import peagle_ext" 2>/dev/null; then
  t0=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-16} PEAGLE_WITH_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
  rc=$?; note "build: rc=$rc in $(( $(date +%s) - t0 ))s"; [ $rc -eq 0 ] || { status=1; tail -40 "$OUT/build.log"; exit 1; }
  python3 -c "import peagle_ext; print(peagle_ext.build_info())" | tee -a "$summary"
fi

if have tests; then
  # one pytest process per file: a crash in one op's tests must not hide the others' results
  for f in ${TEST_FILES:-tests/ops/test_cod.py tests/ops/test_decode_attention.py tests/ops/test_attention_cuda.py tests/ops/test_attention_safety.py tests/ops/test_attention.py tests/ops/test_loss.py tests/ops/test_parallel_draft.py tests/test_bad_inputs.py tests/train/test_optim.py}; do
    [ -f "$f" ] || continue
    t0=$(date +%s); name=$(basename "$f" .py)
    kargs=(); [ -n "${TEST_K:-}" ] && kargs=(-k "$TEST_K")
    python3 -c "import pytest_timeout" 2> /dev/null && kargs+=(--timeout=180)  # per test, where the plugin is
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -ra "${kargs[@]}" $f > "$OUT/$name.log" 2>&1
    rc=$?; note "$name: rc=$rc in $(( $(date +%s) - t0 ))s: $(tail -1 "$OUT/$name.log")"; [ $rc -eq 0 ] || status=1
    grep -E "^(FAILED|ERROR)|Fatal Python error|File .*tests/" "$OUT/$name.log" | head -20 | tee -a "$summary"
  done
fi

if have bench; then
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} || note "bench: installing .whl/ into /tmp/site failed"
  fi
  for b in ${BENCH_FILES:-bench/bench_cod.py bench/bench_attention.py bench/bench_loss.py bench/bench_parallel_draft.py bench/bench_optim.py}; do
    [ -f "$b" ] || continue
    t0=$(date +%s)
    name=$(basename "$b" .py)
    # FULL_BENCHES: names that run full size even in a quick suite; TRAIN_STEP_BUDGET bounds
    # bench_train_step (it stops launching cases when its budget is spent)
    quick=$([[ " $phases " == *" quick "* && " ${FULL_BENCHES:-} " != *" $name "* ]] && echo 1 || echo 0)
    extra=(); [ "$name" = bench_train_step ] && extra=(--budget-s "${TRAIN_STEP_BUDGET:-170}")
    [ "$name" = bench_train_step ] && [ -n "${TRAIN_STEP_CASES:-}" ] && extra+=(--cases "$TRAIN_STEP_CASES")
    # shellcheck disable=SC2206  # TRAIN_STEP_ARGS is a list of options, split on spaces
    [ "$name" = bench_train_step ] && [ -n "${TRAIN_STEP_ARGS:-}" ] && extra+=($TRAIN_STEP_ARGS)
    QUICK=$quick OUT="$OUT" timeout ${BENCH_TIMEOUT:-240} python3 "$b" "${extra[@]}" > "$OUT/$name.log" 2>&1
    rc=$?; note "$name: rc=$rc in $(( $(date +%s) - t0 ))s"; [ $rc -eq 0 ] || status=1
    tail -25 "$OUT/$name.log" >> "$summary"
  done
fi

if have sanitize; then
  # every op's driver under memcheck (+ without the caching allocator), racecheck, initcheck,
  # synccheck; SANITIZE_TOOLS / SANITIZE_OPS pick a subset (see tools/sanitize/sanitize_all.sh)
  t0=$(date +%s)
  OUT="$OUT" bash tools/sanitize/sanitize_all.sh > "$OUT/sanitize_all.log" 2>&1
  rc=$?; note "sanitize_all: rc=$rc in $(( $(date +%s) - t0 ))s"; [ $rc -eq 0 ] || status=1
  [ -f "$OUT/sanitize_summary.md" ] && cat "$OUT/sanitize_summary.md" >> "$summary"
fi
note "== done, status=$status"
# the device tool returns at most 8 files: logs travel as one archive beside summary + JSON
(cd "$OUT" && extra=$(ls sanitize_summary.md sanitize.json 2>/dev/null); tar czf all_logs.tgz *.log $extra 2>/dev/null && rm -f *.log $extra)
cat "$summary"
exit $status
