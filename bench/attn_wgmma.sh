#!/usr/bin/env bash
# GPU check of the Hopper variants PEAGLE_ATTN_BWD=wgmma (the dQ and dK/dV passes on sm_90a warpgroup
# MMAs: csrc/attention/cuda/cod_attn_dq_wgmma.cuh, cod_attn_bwd_wgmma.cuh) and PEAGLE_ATTN_FWD=wgmma
# (cod_attn_fwd_wgmma.cuh), building blocks in cod_attn_wgmma.cuh, ONE
# unattended run on an H100/H200 after the CUDA build (about 6 minutes plus the build):
#   OUT=/path bash bench/attn_wgmma.sh
# 0. build (as bench/attn_bwd_variants.sh) unless the installed build already has the wgmma glue;
# 1. tools/wgmma_selftest.cu (nvcc -arch=sm_90a here): the B128 layout, descriptors, SS / RS wgmma
#    wrappers and fences in isolation against a CPU reference (PASS / FAIL per case, first
#    mismatches printed) - read this first if anything below fails;
# 2. tests (python_tests/test_attention.py -k wgmma): reference scenarios in both modes and head
#    dims (and BMQ=64 at D=128), agreement with the default backward (dq, dk, dv to rounding;
#    out bitwise), K=64 chains,
#    tiny / padding / all-padding, determinism, CUDA-graph capture, CPU float32 equality, kernel
#    selection, the N=32K large-N spot check (FULL=1 adds N=128K);
# 3. fwd+bwd timing of default vs wgmma vs wgmma64 (PEAGLE_ATTN_WGMMA_BMQ=64: 64-query blocks at
#    D=128) (bench_attention.py --bwd-configs, QUICK sizes);
# 3b. the Hopper forward PEAGLE_ATTN_FWD=wgmma (cod_attn_fwd_wgmma.cuh): tests -k fwd_wgmma (reference
#    scenarios fwd+bwd at both head dims, with the wgmma backward too, tiny / padding / K=64 chains,
#    agreement with the default forward, kernel selection, CPU float32 equality, N=32K spot check)
#    and forward timing default vs wgmma (bench_attention.py --fwd-configs, QUICK sizes);
# 4. compute-sanitizer memcheck and racecheck (SANITIZE_TOOLS to change; SANITIZE=0 skips) of the
#    wgmma backward, then the wgmma forward + backward, on bench/sanitize_attention.py's small
#    shapes, garbage layouts included.
# Logs under $OUT; the summary is $OUT/attn_wgmma_summary.txt. Exit code non-zero if any phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/_attn_gpu.sh
attn_gpu_start attn_wgmma
# A build from before the wgmma forward has no PEAGLE_ATTN_FWD=wgmma glue: its error sentence is the marker.
attn_gpu_build attn_wgmma "PEAGLE_ATTN_FWD=wgmma needs"

# 1. building blocks
attn_gpu_selftest ${SELFTEST_TIMEOUT:-60}

# 2. tests
sel="wgmma and not fwd_wgmma and not pipe"  # the forward variant's tests are phase 3b; pipelined: bench/attn_pipe.sh
[ "${FULL:-0}" = "1" ] || sel="$sel and not 131072"
t0=$(date +%s)
timeout $(cap ${TEST_TIMEOUT:-200}) python3 -m pytest -q -ra --timeout=90 python_tests/test_attention.py -k "$sel" \
  --junitxml="$OUT/attn_wgmma_tests.xml" > "$OUT/attn_wgmma_tests.log" 2>&1
rc=$?; note "tests (-k \"$sel\"): rc=$rc in $(( $(date +%s) - t0 ))s: $(tail -1 "$OUT/attn_wgmma_tests.log")"
[ $rc -eq 0 ] || status=1
grep -E "^(FAILED|ERROR|SKIPPED)|Fatal Python error|Error" "$OUT/attn_wgmma_tests.log" | head -30 | tee -a "$summary"

# 3. timing
t0=$(date +%s)
bwd_names=${BWD_NAMES:-mma,wgmma,wgmma64}  # wgmma64: PEAGLE_ATTN_WGMMA_BMQ=64 (64-query blocks at D=128)
BWD_NAMES=$bwd_names QUICK=${QUICK:-1} OUT="$OUT" timeout $(cap ${BENCH_TIMEOUT:-75}) python3 bench/bench_attention.py \
  --bwd-configs > "$OUT/attn_wgmma_bench.log" 2>&1
rc=$?; note "bench --bwd-configs ($bwd_names): rc=$rc in $(( $(date +%s) - t0 ))s"
[ $rc -eq 0 ] || status=1
cat "$OUT/attn_wgmma_bench.log" >> "$summary"; tail -8 "$OUT/attn_wgmma_bench.log"

# 3b. the wgmma forward: tests, then timing
fsel="fwd_wgmma and not pipe"
[ "${FULL:-0}" = "1" ] || fsel="$fsel and not 131072"
t0=$(date +%s)
timeout $(cap ${FWD_TEST_TIMEOUT:-150}) python3 -m pytest -q -ra --timeout=90 python_tests/test_attention.py -k "$fsel" \
  --junitxml="$OUT/attn_wgmma_fwd_tests.xml" > "$OUT/attn_wgmma_fwd_tests.log" 2>&1
rc=$?; note "fwd tests (-k \"$fsel\"): rc=$rc in $(( $(date +%s) - t0 ))s: $(tail -1 "$OUT/attn_wgmma_fwd_tests.log")"
[ $rc -eq 0 ] || status=1
grep -E "^(FAILED|ERROR|SKIPPED)|Fatal Python error|Error" "$OUT/attn_wgmma_fwd_tests.log" | head -30 | tee -a "$summary"
t0=$(date +%s)
fwd_names=${FWD_NAMES:-mma,wgmma}
FWD_NAMES=$fwd_names QUICK=${QUICK:-1} OUT="$OUT" timeout $(cap ${FWD_BENCH_TIMEOUT:-60}) python3 bench/bench_attention.py \
  --fwd-configs > "$OUT/attn_wgmma_fwd_bench.log" 2>&1
rc=$?; note "bench --fwd-configs ($fwd_names): rc=$rc in $(( $(date +%s) - t0 ))s"
[ $rc -eq 0 ] || status=1
cat "$OUT/attn_wgmma_fwd_bench.log" >> "$summary"; tail -8 "$OUT/attn_wgmma_fwd_bench.log"

# 4. sanitizers
if [ "${SANITIZE:-1}" != "0" ] && command -v compute-sanitizer > /dev/null; then
  # bench/sanitize_attention.py's shapes with the wgmma backward. Its CPU-vs-CUDA tolerance checks
  # are reported but do not stop the run: the verdict here is compute-sanitizer's.
  args="--soft --variant PEAGLE_ATTN_BWD=wgmma --variant PEAGLE_ATTN_FWD=wgmma,PEAGLE_ATTN_BWD=wgmma"
  read -r -a tools <<< "${SANITIZE_TOOLS:-memcheck racecheck}"
  for tool in "${tools[@]}"; do
    t0=$(date +%s)
    timeout $(cap ${SANITIZE_TIMEOUT:-70}) compute-sanitizer --tool "$tool" --error-exitcode 99 python3 bench/sanitize_attention.py $args \
      > "$OUT/attn_wgmma_$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool (PEAGLE_ATTN_BWD=wgmma): rc=$rc in $(( $(date +%s) - t0 ))s: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/attn_wgmma_$tool.log" | tail -1); $(grep -E "tolerance misses" "$OUT/attn_wgmma_$tool.log" | tail -1)"
    [ $rc -eq 0 ] || { status=1; grep -m 20 -E "=========|Error|error" "$OUT/attn_wgmma_$tool.log" | tee -a "$summary"; }
  done
else
  note "compute-sanitizer: skipped"
fi

note "attn_wgmma: status=$status"
exit $status
