#!/usr/bin/env bash
# GPU check of the COD attention backward variants (PEAGLE_ATTN_BWD unset = deterministic default,
# PEAGLE_ATTN_BWD=atomic = FlashAttention-2-style dQ with fp32 atomics; see launch_bwd in
# csrc/attention/cuda/cod_attn_bwd.cuh), for one unattended run after the CUDA build:
#   OUT=/path bash bench/attn_bwd_variants.sh          (about 3 minutes of GPU time, plus the build)
# 1. tests (python_tests/test_attention.py): every test of the atomic variant (reference
#    scenarios in both modes and head dims, agreement with the default, K=64 chains, tiny /
#    padding / all-padding, run-to-run closeness, CUDA-graph capture, CPU float32 equality, the
#    N=32K large-N spot check; FULL=1 adds the N=128K one) and, as a regression check of the shared
#    code, the default backward's new tests and its bf16 D=128 reference scenarios;
# 2. the fwd+bwd timing of both variants (bench_attention.py --bwd-configs, QUICK sizes);
# 3. compute-sanitizer memcheck and racecheck (SANITIZE_TOOLS to change) of the atomic variant on
#    bench/sanitize_attention.py's small shapes, garbage layouts included (skipped if
#    compute-sanitizer is absent; SANITIZE=0 skips it).
# Logs and JSON under $OUT; the summary is $OUT/attn_bwd_variants_summary.txt. Exit code non-zero
# if any phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
unset PEAGLE_ATTN_FWD_MF PEAGLE_ATTN_FWD_WARPS PEAGLE_ATTN_BWD  # the tests and the bench set them per case
summary="$OUT/attn_bwd_variants_summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
status=0

if ! python3 -c "import peagle_ext, sys; sys.exit(0 if peagle_ext.has_cuda_kernels() else 1)" 2>/dev/null; then
  # same build as bench/gpu_suite.sh (system compiler: see the note there)
  if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++; fi
  t0=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-16} PEAGLE_WITH_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -e . \
    > "$OUT/attn_bwd_variants_build.log" 2>&1
  rc=$?; note "build: rc=$rc in $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || { tail -40 "$OUT/attn_bwd_variants_build.log"; exit 1; }
fi
python3 -c "import peagle_ext; print(peagle_ext.build_info())" | tee -a "$summary"

sel="atomic or bwd_variants or (cuda_matches_reference and bf16 and 128)"
[ "${FULL:-0}" = "1" ] || sel="($sel) and not 131072"
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -ra --timeout=240 python_tests/test_attention.py -k "$sel" \
  --junitxml="$OUT/attn_bwd_variants_tests.xml" > "$OUT/attn_bwd_variants_tests.log" 2>&1
rc=$?; note "tests (-k \"$sel\"): rc=$rc in $(( $(date +%s) - t0 ))s: $(tail -1 "$OUT/attn_bwd_variants_tests.log")"
[ $rc -eq 0 ] || status=1
grep -E "^(FAILED|ERROR)|Fatal Python error|Error" "$OUT/attn_bwd_variants_tests.log" | head -30 | tee -a "$summary"

t0=$(date +%s)
QUICK=${QUICK:-1} OUT="$OUT" timeout ${BENCH_TIMEOUT:-240} python3 bench/bench_attention.py --bwd-configs \
  > "$OUT/attn_bwd_variants_bench.log" 2>&1
rc=$?; note "bench --bwd-configs: rc=$rc in $(( $(date +%s) - t0 ))s"
[ $rc -eq 0 ] || status=1
cat "$OUT/attn_bwd_variants_bench.log" >> "$summary"; tail -12 "$OUT/attn_bwd_variants_bench.log"

if [ "${SANITIZE:-1}" != "0" ] && command -v compute-sanitizer > /dev/null; then
  # one process per tool: bench/sanitize_attention.py's shapes with the atomic backward. Its
  # CPU-vs-CUDA tolerance checks are reported but do not stop the run (as in attn_variants.sh):
  # the verdict here is compute-sanitizer's; the tests above judge the values.
  args="--soft --variant PEAGLE_ATTN_BWD=atomic"
  read -r -a tools <<< "${SANITIZE_TOOLS:-memcheck racecheck}"
  for tool in "${tools[@]}"; do
    t0=$(date +%s)
    timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool "$tool" --error-exitcode 99 python3 bench/sanitize_attention.py $args \
      > "$OUT/attn_bwd_variants_$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool (PEAGLE_ATTN_BWD=atomic): rc=$rc in $(( $(date +%s) - t0 ))s: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/attn_bwd_variants_$tool.log" | tail -1); $(grep -E "tolerance misses" "$OUT/attn_bwd_variants_$tool.log" | tail -1)"
    [ $rc -eq 0 ] || { status=1; grep -m 20 -E "=========|Error|error" "$OUT/attn_bwd_variants_$tool.log" | tee -a "$summary"; }
  done
else
  note "compute-sanitizer: skipped"
fi

note "attn_bwd_variants: status=$status"
exit $status
