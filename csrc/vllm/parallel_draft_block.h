// The work of one CUDA block of the parallel-drafting kernel, split at its barriers into
// phases that take (thread index, block size) explicitly. The CUDA kernel
// (cuda/parallel_draft_kernels.cu) calls them with __syncthreads() in between; the CPU
// emulation (cpu/parallel_draft_emulation.cpp) runs each phase for every thread of a block
// in turn, which is exact because threads only exchange data through the shared arrays
// across those barriers. So the CPU tests exercise the kernel's own index arithmetic,
// launch plan, shared-memory staging and vector copies. Plain C++, no torch, no CUDA header.
//
// Mem: a policy with `ld(const T*)` (cached load) and `ld_stream(const T*)` (read-once load).
#pragma once
#include <cstdint>

#include "vllm/parallel_draft_kernels.h"

namespace peagle::vllm {

constexpr int kThreads = 256;
constexpr int kVecsPerThread = 4;
constexpr int kVecsPerBlock = kThreads * kVecsPerThread;
constexpr int kMaxRowsPerBlock = 1024;
// query_start_loc is staged in shared memory up to this many entries (32 KiB); larger
// batches search it in global memory (same result).
constexpr int64_t kMaxSmemQsl = 8192;

struct LaunchPlan {
  int64_t vecs_per_row;
  int rows_per_block;
  int64_t blocks;
  bool qsl_in_smem;
  int64_t smem_bytes;  // dynamic shared memory: the staged query_start_loc
};

// A block owns rows_per_block consecutive output rows, sized so that its hidden slice is
// about kVecsPerBlock copy units (2 rows at H=4096 bf16 with 16-byte units).
inline LaunchPlan plan_launch(const ParallelDraftParams& p, int64_t vec_bytes) {
  LaunchPlan plan{};
  plan.vecs_per_row = p.hidden_row_bytes / vec_bytes;
  int64_t rows = plan.vecs_per_row > 0 ? kVecsPerBlock / plan.vecs_per_row : kMaxRowsPerBlock;
  if (rows < 1) rows = 1;
  if (rows > kMaxRowsPerBlock) rows = kMaxRowsPerBlock;
  plan.rows_per_block = static_cast<int>(rows);
  plan.blocks = (p.num_output_tokens + rows - 1) / rows;
  if (plan.blocks < 1) plan.blocks = 1;  // block 0 always writes the new query_start_loc
  plan.qsl_in_smem = p.batch_size + 1 <= kMaxSmemQsl;
  plan.smem_bytes = plan.qsl_in_smem ? (p.batch_size + 1) * static_cast<int64_t>(sizeof(int32_t)) : 0;
  return plan;
}

// Rows [row_begin, row_begin + rows_here) of block `block`.
PEAGLE_HD int block_rows(const ParallelDraftParams& p, int64_t block, int rows_per_block, int64_t* row_begin) {
  *row_begin = block * rows_per_block;
  const int64_t left = p.num_output_tokens - *row_begin;
  return left <= 0 ? 0 : static_cast<int>(left < rows_per_block ? left : rows_per_block);
}

// Block 0: the new query_start_loc (each request grows by K-1 rows).
PEAGLE_HD void phase_out_qsl(const ParallelDraftParams& p, int tid, int nthreads) {
  for (int64_t i = tid; i <= p.batch_size; i += nthreads)
    p.out_query_start_loc[i] = static_cast<int32_t>(p.query_start_loc[i] + i * (p.num_spec_tokens - 1));
}

template <class Mem>
PEAGLE_HD void phase_stage_qsl(const ParallelDraftParams& p, int32_t* s_qsl, int tid, int nthreads) {
  for (int64_t i = tid; i <= p.batch_size; i += nthreads) s_qsl[i] = Mem::ld(p.query_start_loc + i);
}

template <class Mem>
struct QslReader {
  const int32_t* staged;  // shared copy, or nullptr: read global memory
  const int32_t* global;
  PEAGLE_HD int32_t operator()(int64_t i) const { return staged ? staged[i] : Mem::ld(global + i); }
};

// One thread per row: its request (binary search) and where its hidden row comes from.
template <class Mem>
PEAGLE_HD void phase_rows(const ParallelDraftParams& p, const QslReader<Mem>& qsl, int64_t row_begin, int rows_here,
                          int32_t* s_src, int32_t* s_req, int tid, int nthreads) {
  const int64_t K = p.num_spec_tokens;
  for (int t = tid; t < rows_here; t += nthreads) {
    const int64_t o = row_begin + t;
    const int64_t r = find_request(o, p.batch_size, K, qsl);
    const int64_t qs = qsl(r), qe = qsl(r + 1);
    const int64_t nrej = p.num_rejected ? Mem::ld(p.num_rejected + r) : 0;
    const int64_t num_valid = qe - qs - 1 - nrej;
    const int64_t j = o - (qs + r * (K - 1));
    const int64_t in_row = qs + j;
    int32_t src = kHiddenZero;  // same rule as draft_row().hidden_source
    if (j > num_valid && j < num_valid + K)
      src = kHiddenFromMask;
    else if (j < qe - qs && in_row >= 0 && in_row < p.num_input_tokens)
      src = static_cast<int32_t>(in_row);
    s_src[t] = src;
    s_req[t] = static_cast<int32_t>(r);
  }
}

// All threads: the block's hidden rows, kVecsPerThread loads in flight per thread before
// their stores. Within a block rows_here * vecs_per_row <= max(kVecsPerBlock, vecs_per_row),
// so a 32-bit division suffices whenever a block holds several rows.
template <class Vec, class Mem>
PEAGLE_HD void phase_hidden(const ParallelDraftParams& p, int64_t vecs_per_row, int64_t row_begin, int rows_here,
                            const int32_t* s_src, int tid, int nthreads) {
  const Vec* target = static_cast<const Vec*>(p.target_hidden);
  const Vec* mask = static_cast<const Vec*>(p.mask_hidden);
  Vec* out = static_cast<Vec*>(p.hidden);
  const int64_t total = static_cast<int64_t>(rows_here) * vecs_per_row;
  const uint32_t vpr32 = static_cast<uint32_t>(vecs_per_row);
  const int64_t step = static_cast<int64_t>(nthreads) * kVecsPerThread;
  for (int64_t base = 0; base < total; base += step) {
    Vec v[kVecsPerThread];
    int64_t dst[kVecsPerThread];
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int k = 0; k < kVecsPerThread; ++k) {
      const int64_t idx = base + static_cast<int64_t>(k) * nthreads + tid;
      dst[k] = -1;
      if (idx < total) {
        int64_t rr = 0, col = idx;
        if (rows_here > 1) {
          rr = static_cast<uint32_t>(idx) / vpr32;
          col = idx - rr * vecs_per_row;
        }
        const int32_t src = s_src[rr];
        if (src >= 0)
          v[k] = Mem::ld_stream(target + static_cast<int64_t>(src) * vecs_per_row + col);
        else if (src == kHiddenFromMask)
          v[k] = Mem::ld(mask + col);
        else
          v[k] = Vec{};
        dst[k] = (row_begin + rr) * vecs_per_row + col;
      }
    }
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int k = 0; k < kVecsPerThread; ++k)
      if (dst[k] >= 0) out[dst[k]] = v[k];
  }
}

// One thread per row: ids, positions, masks, slot mapping, sample index, hidden mapping.
// After the copy, so its dependent loads (position -> block table) overlap the copy's stores.
template <class Mem>
PEAGLE_HD void phase_scalars(const ParallelDraftParams& p, const QslReader<Mem>& qsl, int64_t row_begin, int rows_here,
                             const int32_t* s_req, int tid, int nthreads) {
  const int64_t K = p.num_spec_tokens;
  for (int t = tid; t < rows_here; t += nthreads) {
    const int64_t o = row_begin + t;
    const int64_t r = s_req[t];
    const int64_t qs = qsl(r), qe = qsl(r + 1);
    const int64_t nrej = p.num_rejected ? Mem::ld(p.num_rejected + r) : 0;
    const int64_t start_pos = (qs >= 0 && qs < p.num_input_tokens) ? Mem::ld(p.target_positions + qs) : 0;
    const int32_t next_token = Mem::ld(p.next_token_ids + r);
    const int32_t* tokens = p.target_token_ids;
    const int32_t* table = p.block_table;
    const int64_t stride = p.block_table_stride;
    const DraftRow row = draft_row(
        o, r, qs, qe, nrej, start_pos, next_token, K, p.num_input_tokens, p.mask_token_id, p.block_size,
        p.max_model_len, p.max_blocks, [tokens](int64_t i) { return Mem::ld(tokens + i); },
        [table, stride](int64_t req, int64_t blk) { return Mem::ld(table + req * stride + blk); });
    p.input_ids[o] = row.input_id;
    p.positions[o] = row.position;
    p.is_rejected[o] = row.is_rejected;
    p.is_masked[o] = row.is_masked;
    p.slot_mapping[o] = row.slot;
    if (row.sample_index >= 0) p.token_indices_to_sample[row.sample_index] = static_cast<int32_t>(o);
    if (row.mapped_input >= 0) p.hidden_state_mapping[row.mapped_input] = static_cast<int32_t>(o);
  }
}

}  // namespace peagle::vllm
