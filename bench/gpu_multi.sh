#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (or -x4, -x8; phases switched by env, 1 = run):
#   DIST      issue 9's distributed bench (1 vs all GPUs, DDP and FSDP2, N = 8K and 32K
#             (DIST_SIZES, space-separated), and the all-vs-1 parameter check)
#   MODELTEST the CUDA model tests (fp32 parameters without autocast among them)
#   PROFILE   per-kernel attention time (bench/profile_attention.py, default and atomic backward)
#             and Nsight Compute sections of the forward, dQ and dK/dV kernels
#   ATTN_BWD  the atomic-dQ attention backward's GPU check (bench/attn_bwd_variants.sh)
#   TRAIN     `peagle train` on 2 GPUs: 1 GPU vs DDP vs FSDP2, FSDP resumed on 1 GPU
#             (bench/gpu_train_smoke.sh)
#   MEMTRACE  allocator traces of one 8K step, 1 process vs DDP rank 0, and their peak breakdown
#             (bench/memory_trace_distributed.py)
# Time-boxed (CALL_BUDGET, default 570 s). Logs in $OUT/multi.tgz, summary in $OUT/summary.txt,
# the distributed bench's JSON/MD in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/_gpu_box.sh
call_start multi 570
nvidia-smi topo -m > "$work/topo.txt" 2>&1; head -4 "$work/topo.txt" | tee -a "$sum"

# NVLink multicast off (shared host); the bench also sets these when unset
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${DIST:-1}" = "1" ]; then
  # every GPU of the machine (NPROC to override); one torchrun per size, so a size the time box cuts
  # off does not take the finished ones with it (each writes $OUT/dist_N/bench_distributed.*)
  nproc=${NPROC:-$(nvidia-smi -L | wc -l)}
  for n in ${DIST_SIZES:-8192 32768}; do
    box ${DIST_BOX:-300} "$work/bench_distributed_$n.log" torchrun --standalone --nproc_per_node $nproc \
      bench/bench_distributed.py --sizes $n --steps 3 --warmup 1 --out "$OUT/dist_$n"
    grep -E "N=|check|^\|" "$work/bench_distributed_$n.log" | tee -a "$sum"
    grep -E "Error|error" "$work/bench_distributed_$n.log" | head -10 | tee -a "$sum"
  done
fi

if [ "${MODELTEST:-0}" = "1" ]; then
  box 90 "$work/model_tests.log" python3 -m pytest -q -ra --timeout=60 python_tests/test_model.py -k cuda
  tail -1 "$work/model_tests.log" | tee -a "$sum"
  grep -E "^(FAILED|ERROR)" "$work/model_tests.log" | head -8 | tee -a "$sum"
fi

if [ "${PROFILE:-0}" = "1" ]; then
  for cfg in "8192 1024" "8192 none"; do
    set -- $cfg
    for bwd in default atomic; do
      if [ $bwd = atomic ]; then export PEAGLE_ATTN_BWD=atomic; else unset PEAGLE_ATTN_BWD; fi
      box 60 "$work/profile_${1}_${2}_$bwd.log" python3 bench/profile_attention.py --n $1 --cap $2 --out "$work"
      cat "$work/profile_${1}_${2}_$bwd.log" | tee -a "$sum"
    done
  done
  unset PEAGLE_ATTN_BWD
  if command -v ncu > /dev/null; then
    sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
--section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats"
    # one warm-up step (3 matching launches: fwd, dq, dkv), then the profiled step
    box 120 "$work/ncu_default.log" ncu --clock-control none -k "regex:cod_attn_(fwd|dq|dkv)(_wgmma)?_kernel" \
      --launch-skip 3 --launch-count 3 $sections python3 bench/profile_attention.py --ncu --n 8192 --cap 1024
    box 90 "$work/ncu_atomic.log" env PEAGLE_ATTN_BWD=atomic ncu --clock-control none \
      -k "regex:cod_attn_(fwd|dq|dkv)(_wgmma)?_kernel" --launch-skip 2 --launch-count 2 $sections \
      python3 bench/profile_attention.py --ncu --n 8192 --cap 1024
    for f in "$work"/ncu_*.log; do
      echo "== $f" >> "$sum"
      grep -E "cod_attn_|Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Shared Memory Configuration Size|Dynamic Shared" "$f" \
        | head -80 >> "$sum"
    done
  fi
fi

if [ "${TRAIN:-0}" = "1" ]; then
  box 200 "$work/train_smoke.log" bash bench/gpu_train_smoke.sh "$work/train_smoke"
  tail -12 "$work/train_smoke.log" | tee -a "$sum"
  # keep the logs, not the checkpoints and the verifier (the archive must stay small to come back)
  find "$work/train_smoke" -type f ! -name "*.log" ! -name "*.jsonl" ! -name "*.png" -delete
fi

if [ "${MEMTRACE:-0}" = "1" ]; then
  box 150 "$work/memtrace.log" torchrun --standalone --nproc_per_node 2 bench/memory_trace_distributed.py \
    --tokens 8192 --out "$work/memtrace"
  grep -E "rest|Error" "$work/memtrace.log" | tee -a "$sum"
  box 60 "$work/memtrace_analysis.log" python3 bench/memory_trace_distributed.py --analyze "$work/memtrace"
  cat "$work/memtrace_analysis.log" | tee -a "$sum"
fi

if [ "${ATTN_BWD:-0}" = "1" ]; then
  box $(( $(left) - 10 )) "$work/attn_bwd.log" env OUT="$work/attn_bwd" CUDA_VISIBLE_DEVICES=0 \
    TEST_TIMEOUT=150 BENCH_TIMEOUT=70 SANITIZE_TIMEOUT=60 bash bench/attn_bwd_variants.sh
  cat "$work/attn_bwd/attn_bwd_variants_summary.txt" 2>/dev/null | grep -vE "^\s*$" | head -60 >> "$sum"
fi
call_end
