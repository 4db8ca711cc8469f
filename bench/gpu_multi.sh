#!/usr/bin/env bash
# One device call on nvidia-h200-x2: issue 9's distributed bench (1 vs 2 GPUs, DDP and FSDP2,
# N = 8K and 32K, plus the 2-vs-1 parameter check), then, with the time left, the atomic-dQ
# attention backward's GPU check (bench/attn_bwd_variants.sh) on GPU 0. Time-boxed (CALL_BUDGET,
# default 570 s). Logs in $OUT/multi.tgz, summary in $OUT/summary.txt, the bench's JSON/MD in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/_gpu_box.sh
call_start multi 570
nvidia-smi topo -m > "$work/topo.txt" 2>&1; head -4 "$work/topo.txt" | tee -a "$sum"

# NVLink multicast off (shared host); the bench also sets these when unset
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
box ${DIST_BOX:-300} "$work/bench_distributed.log" torchrun --standalone --nproc_per_node 2 \
  bench/bench_distributed.py --sizes ${DIST_SIZES:-8192,32768} --steps 3 --warmup 1 --out "$OUT"
grep -E "N=|check|^\|" "$work/bench_distributed.log" | tee -a "$sum"
grep -E "Error|error" "$work/bench_distributed.log" | head -10 | tee -a "$sum"

if [ "${ATTN_BWD:-1}" = "1" ]; then
  box $(( $(left) - 10 )) "$work/attn_bwd.log" env OUT="$work/attn_bwd" CUDA_VISIBLE_DEVICES=0 \
    TEST_TIMEOUT=150 BENCH_TIMEOUT=70 SANITIZE_TIMEOUT=60 bash bench/attn_bwd_variants.sh
  cat "$work/attn_bwd/attn_bwd_variants_summary.txt" 2>/dev/null | grep -vE "^\s*$" | head -60 >> "$sum"
fi
call_end
