#!/usr/bin/env bash
# GPU check of the pipelined sm_90a wgmma kernels (PEAGLE_ATTN_WGMMA_PIPE=1|2: the forward's
# key-block loop in cod_attn_fwd_wgmma.cuh, the dQ pass in cod_attn_dq_wgmma.cuh, the dK/dV pass in
# cod_attn_bwd_wgmma.cuh), ONE unattended run of at most CALL_BUDGET seconds (default 540, build
# included) on an H100/H200:
#   OUT=/path bash bench/attn_pipe.sh
# 0. build (as bench/attn_wgmma.sh) unless the installed build already reads PEAGLE_ATTN_WGMMA_PIPE;
# 1. tools/wgmma_selftest.cu (the building blocks, unchanged: a failure here is not the pipelining);
# 2. the bitwise test (PIPE=1 and 2 vs 0: out, LSE and every gradient torch.equal, with the wgmma
#    forward and backward at D=64 / 128 and BMQ=64, on padding, window + sink, cross, K=64 chains,
#    many full blocks, tiny T) and the kernel-selection test (profiler: the PIPE template argument of
#    the three kernels follows the env) - read this first;
# 3. compute-sanitizer memcheck and racecheck of the pipelined kernels (bench/sanitize_attention.py
#    shapes, garbage layouts included), every pipelined loop: PIPE=2 (fwd level 2, dQ level 1, dK/dV
#    level 2 at BMQ=32 / D=64), PIPE=1 (levels 1; dK/dV BMQ=32 at D=128), PIPE=1 with BMQ=64 (the
#    dK/dV loop of its own at D=128);
# 4. timing, QUICK sizes: --bwd-configs mma,wgmma64,wgmma64_pipe,wgmma,wgmma_pipe1,wgmma_pipe
#    (mma.sync forward) and --fwd-configs mma,wgmma,wgmma_pipe1,wgmma_pipe;
# 5. the other pipe tests (-k pipe: reference scenarios, tiny / padding, K=64 chains, agreement
#    with the default forward, determinism, graph capture) with what is left of the budget.
# Logs under $OUT; summary in $OUT/attn_pipe_summary.txt. Exit code non-zero if any phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/_attn_gpu.sh
attn_gpu_start attn_pipe
# 0. build: a build from before this change has no PEAGLE_ATTN_WGMMA_PIPE in its glue
attn_gpu_build attn_pipe PEAGLE_ATTN_WGMMA_PIPE

# 1. building blocks (unchanged by the pipelining: a failure here is not the pipelining)
attn_gpu_selftest 40

run_tests() {  # run_tests NAME SELECTION CAP
  local t0=$(date +%s)
  timeout $(cap $3) python3 -m pytest -q -ra --timeout=90 python_tests/test_attention.py -k "$2" \
    --junitxml="$OUT/attn_pipe_$1.xml" > "$OUT/attn_pipe_$1.log" 2>&1
  local rc=$?
  note "tests $1 (-k \"$2\"): rc=$rc in $(( $(date +%s) - t0 ))s: $(tail -1 "$OUT/attn_pipe_$1.log")"
  [ $rc -eq 0 ] || status=1
  grep -E "^(FAILED|ERROR)|Fatal Python error|differs from PIPE=0" "$OUT/attn_pipe_$1.log" | head -30 | tee -a "$summary"
}

# 2. bitwise equality and kernel selection
run_tests bitwise "pipe_bitwise or pipe_selects" 100

# 3. sanitizers (the verdict is compute-sanitizer's; --soft only reports CPU-vs-CUDA tolerance misses)
if [ "${SANITIZE:-1}" != "0" ] && command -v compute-sanitizer > /dev/null; then
  args="--soft --variant PEAGLE_ATTN_FWD=wgmma,PEAGLE_ATTN_BWD=wgmma,PEAGLE_ATTN_WGMMA_PIPE=2"
  args="$args --variant PEAGLE_ATTN_FWD=wgmma,PEAGLE_ATTN_BWD=wgmma,PEAGLE_ATTN_WGMMA_PIPE=1"
  args="$args --variant PEAGLE_ATTN_FWD=wgmma,PEAGLE_ATTN_BWD=wgmma,PEAGLE_ATTN_WGMMA_BMQ=64,PEAGLE_ATTN_WGMMA_PIPE=1"
  for tool in ${SANITIZE_TOOLS:-racecheck memcheck}; do
    t0=$(date +%s)
    timeout $(cap ${SANITIZE_TIMEOUT:-80}) compute-sanitizer --tool "$tool" --error-exitcode 99 \
      python3 bench/sanitize_attention.py $args > "$OUT/attn_pipe_$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool (pipelined wgmma): rc=$rc in $(( $(date +%s) - t0 ))s: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/attn_pipe_$tool.log" | tail -1); $(grep -E "tolerance misses" "$OUT/attn_pipe_$tool.log" | tail -1)"
    [ $rc -eq 0 ] || { status=1; grep -m 20 -E "=========|Error|error" "$OUT/attn_pipe_$tool.log" | tee -a "$summary"; }
  done
else
  note "compute-sanitizer: skipped"
fi

# 4. timing (QUICK sizes)
bench() {  # bench NAME FLAG NAMES_VAR NAMES CAP
  local t0=$(date +%s)
  env "$3=$4" QUICK=${QUICK:-1} OUT="$OUT" timeout $(cap $5) python3 bench/bench_attention.py "$2" \
    > "$OUT/attn_pipe_$1.log" 2>&1
  local rc=$?
  note "bench $2 ($4): rc=$rc in $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || status=1
  cat "$OUT/attn_pipe_$1.log" >> "$summary"; tail -6 "$OUT/attn_pipe_$1.log"
}
# the forward of the --bwd-configs runs: mma.sync, which PEAGLE_ATTN_WGMMA_PIPE does not touch, so
# "bwd" (f+b minus the forward alone) is the backward's own time under every variant
export PEAGLE_ATTN_FWD=mma
bench bwd_bench --bwd-configs BWD_NAMES "${BWD_NAMES:-mma,wgmma64,wgmma64_pipe,wgmma,wgmma_pipe1,wgmma_pipe}" 85
unset PEAGLE_ATTN_FWD
bench fwd_bench --fwd-configs FWD_NAMES "${FWD_NAMES:-mma,wgmma,wgmma_pipe1,wgmma_pipe}" 50

# 5. the other pipe tests, with what is left
run_tests reference "pipe and not pipe_bitwise and not pipe_selects and not 131072" 300

note "attn_pipe: status=$status"
exit $status
