#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (SERIAL=1: one GPU, lanes one after the other):
#   GPU 0: bench/attn_pipe.sh (the pipelined wgmma loops, PEAGLE_ATTN_WGMMA_PIPE=1|2: bitwise test,
#          kernel selection, racecheck + memcheck, variant timing, the other pipe tests);
#   GPU 1: the attention bench (QUICK) with the default kernels against flex (mask build included)
#          and SDPA causal, then the same with PEAGLE_ATTN_WGMMA_PIPE=2 (its output is compared with
#          flex's too: max|diff| in the log).
# Build once first (call_start); logs in $OUT/pipe.tgz, summary in $OUT/summary.txt.
#   OUT=/path bash bench/gpu_pipe_and_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/_gpu_box.sh
unset PEAGLE_ATTN_FWD PEAGLE_ATTN_BWD PEAGLE_ATTN_FWD_MF PEAGLE_ATTN_FWD_WARPS PEAGLE_ATTN_WGMMA_BMQ PEAGLE_ATTN_WGMMA_PIPE
call_start pipe 545

lane0() {
  box $(( $(left) - 10 )) "$work/attn_pipe.log" env CUDA_VISIBLE_DEVICES=0 OUT="$work/attn_pipe" \
    CALL_BUDGET=$(( $(left) - 15 )) bash bench/attn_pipe.sh
}
lane1() {
  box 200 "$work/bench_auto.log" env CUDA_VISIBLE_DEVICES=$lane1_gpu QUICK=1 OUT="$work/auto" \
    python3 bench/bench_attention.py
  box 200 "$work/bench_pipe2.log" env CUDA_VISIBLE_DEVICES=$lane1_gpu QUICK=1 OUT="$work/pipe2" \
    PEAGLE_ATTN_WGMMA_PIPE=2 python3 bench/bench_attention.py
}
run_lanes lane0 lane1  # lane1 uses $lane1_gpu (bench/_gpu_box.sh)
note "-- attn_pipe"
cat "$work/attn_pipe/attn_pipe_summary.txt" >> "$sum"
grep -E "^(tests|bench|compute-sanitizer|wgmma_selftest|attn_pipe|FAILED|PASS:)" "$work/attn_pipe/attn_pipe_summary.txt"
for v in auto pipe2; do
  note "-- bench_attention QUICK ($v)"
  grep -E "^N=|mma.sync|^ +[0-9]+ +(None|[0-9]+) |^note" "$work/bench_$v.log" | tee -a "$sum"
done
call_end
