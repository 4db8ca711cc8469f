// vLLM parallel-drafting batch step in ONE kernel (DESIGN.md section 6). No torch includes.
//
// What vLLM does in a Triton kernel (copy_and_expand_eagle_inputs_kernel), an index_put of the
// hidden states, a torch.where with mask_hidden and ~6 ops of slot mapping, this kernel does
// in one pass over the OUTPUT rows: every output row reads exactly one source (a target
// hidden row, mask_hidden, or nothing -> zero), so the hidden scatter becomes a gather with
// no write conflicts, and rejected target rows that vLLM writes and then overwrites with
// mask_hidden are never read.
//
// Work split: a block owns `rows_per_block` consecutive output rows, sized so that its hidden
// slice is ~kThreads*kVecsPerThread 16-byte vectors (2 rows at H=4096 bf16). T_out is known
// from the shapes (T_in + (K-1)*B), so the grid needs no host sync; each row finds its request
// by a binary search over query_start_loc, staged in shared memory.
//   phase 1: one thread per row: request index + hidden source -> shared memory
//   phase 2: all threads: the hidden rows, kVecsPerThread vector loads in flight per thread
//   phase 3: one thread per row: ids, positions, masks, slot mapping, sample index, mapping
// Phase 3 comes after the copy so its dependent loads (position -> block table) overlap the
// copy's stores instead of delaying them.
#include <cuda_runtime.h>

#include <cstdint>

#include "vllm/parallel_draft_kernels.h"

namespace peagle::vllm {
namespace {

constexpr int kThreads = 256;
constexpr int kVecsPerThread = 4;
constexpr int kVecsPerBlock = kThreads * kVecsPerThread;
constexpr int kMaxRowsPerBlock = 1024;
// query_start_loc is staged in shared memory up to this many entries (32 KiB); larger
// batches search it in global memory (same result).
constexpr int64_t kMaxSmemQsl = 8192;

// Streaming load for target rows (read once), cached load for mask_hidden (read by every
// masked row). Both have overloads for the vector types used here.
template <typename Vec>
__device__ __forceinline__ Vec load_stream(const Vec* p) { return __ldcs(p); }
template <typename Vec>
__device__ __forceinline__ Vec load_cached(const Vec* p) { return __ldg(p); }

template <typename Vec>
__global__ void __launch_bounds__(kThreads)
parallel_draft_kernel(const ParallelDraftParams p, int rows_per_block, int64_t vecs_per_row, bool qsl_in_smem) {
  extern __shared__ int32_t s_qsl[];               // [B+1] when qsl_in_smem
  __shared__ int32_t s_src[kMaxRowsPerBlock];      // hidden source per row of this block
  __shared__ int32_t s_req[kMaxRowsPerBlock];      // request index per row of this block

  const int tid = threadIdx.x;
  const int64_t B = p.batch_size;
  const int64_t K = p.num_spec_tokens;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  int64_t rows_left = p.num_output_tokens - row_begin;
  const int rows_here = rows_left <= 0 ? 0 : static_cast<int>(rows_left < rows_per_block ? rows_left : rows_per_block);

  // The new query_start_loc: each request grows by K-1 rows.
  if (blockIdx.x == 0) {
    for (int64_t i = tid; i <= B; i += kThreads)
      p.out_query_start_loc[i] = static_cast<int32_t>(p.query_start_loc[i] + i * (K - 1));
  }
  if (rows_here == 0) return;  // block-uniform

  if (qsl_in_smem) {
    for (int64_t i = tid; i <= B; i += kThreads) s_qsl[i] = p.query_start_loc[i];
    __syncthreads();
  }
  const int32_t* qsl_global = p.query_start_loc;
  auto load_qsl = [&](int64_t i) -> int32_t { return qsl_in_smem ? s_qsl[i] : __ldg(qsl_global + i); };

  // ---- phase 1: request and hidden source of each row ----------------------------------
  for (int t = tid; t < rows_here; t += kThreads) {
    const int64_t o = row_begin + t;
    const int64_t r = find_request(o, B, K, load_qsl);
    const int64_t qs = load_qsl(r), qe = load_qsl(r + 1);
    const int64_t nrej = p.num_rejected ? __ldg(p.num_rejected + r) : 0;
    const int64_t num_valid = qe - qs - 1 - nrej;
    const int64_t j = o - (qs + r * (K - 1));
    const int64_t in_row = qs + j;
    int32_t src = kHiddenZero;
    if (j > num_valid && j < num_valid + K) src = kHiddenFromMask;
    else if (j < qe - qs && in_row >= 0 && in_row < p.num_input_tokens) src = static_cast<int32_t>(in_row);
    s_src[t] = src;
    s_req[t] = static_cast<int32_t>(r);
  }
  __syncthreads();

  // ---- phase 2: hidden rows (16-byte vectors when the row and pointers allow) -----------
  {
    const Vec* __restrict__ target = static_cast<const Vec*>(p.target_hidden);
    const Vec* __restrict__ mask = static_cast<const Vec*>(p.mask_hidden);
    Vec* __restrict__ out = static_cast<Vec*>(p.hidden);
    const int64_t total = static_cast<int64_t>(rows_here) * vecs_per_row;
    // Within a block, rows_here * vecs_per_row <= max(kVecsPerBlock, vecs_per_row), so a
    // 32-bit division suffices when a block holds several rows.
    const uint32_t vpr32 = static_cast<uint32_t>(vecs_per_row);
    for (int64_t base = 0; base < total; base += kVecsPerBlock) {
      Vec v[kVecsPerThread];
      int64_t dst[kVecsPerThread];
#pragma unroll
      for (int k = 0; k < kVecsPerThread; ++k) {
        const int64_t idx = base + k * kThreads + tid;
        dst[k] = -1;
        if (idx < total) {
          int64_t rr, col;
          if (rows_here == 1) {
            rr = 0;
            col = idx;
          } else {
            const uint32_t q = static_cast<uint32_t>(idx) / vpr32;
            rr = q;
            col = idx - static_cast<int64_t>(q) * vecs_per_row;
          }
          const int32_t src = s_src[rr];
          if (src >= 0) {
            v[k] = load_stream(target + static_cast<int64_t>(src) * vecs_per_row + col);
          } else if (src == kHiddenFromMask) {
            v[k] = load_cached(mask + col);
          } else {
            v[k] = Vec{};
          }
          dst[k] = (row_begin + rr) * vecs_per_row + col;
        }
      }
#pragma unroll
      for (int k = 0; k < kVecsPerThread; ++k)
        if (dst[k] >= 0) out[dst[k]] = v[k];
    }
  }

  // ---- phase 3: the per-row scalars ------------------------------------------------------
  for (int t = tid; t < rows_here; t += kThreads) {
    const int64_t o = row_begin + t;
    const int64_t r = s_req[t];
    const int64_t qs = load_qsl(r), qe = load_qsl(r + 1);
    const int64_t nrej = p.num_rejected ? __ldg(p.num_rejected + r) : 0;
    const int64_t start_pos = (qs >= 0 && qs < p.num_input_tokens) ? __ldg(p.target_positions + qs) : 0;
    const int32_t next_token = __ldg(p.next_token_ids + r);
    auto load_token = [&](int64_t i) -> int32_t { return __ldg(p.target_token_ids + i); };
    auto load_block = [&](int64_t req, int64_t blk) -> int32_t {
      return __ldg(p.block_table + req * p.block_table_stride + blk);
    };
    const DraftRow row = draft_row(o, r, qs, qe, nrej, start_pos, next_token, K, p.num_input_tokens,
                                   p.mask_token_id, p.block_size, p.max_model_len, p.max_blocks,
                                   load_token, load_block);
    p.input_ids[o] = row.input_id;
    p.positions[o] = row.position;
    p.is_rejected[o] = row.is_rejected;
    p.is_masked[o] = row.is_masked;
    p.slot_mapping[o] = row.slot;
    if (row.sample_index >= 0) p.token_indices_to_sample[row.sample_index] = static_cast<int32_t>(o);
    if (row.mapped_input >= 0) p.hidden_state_mapping[row.mapped_input] = static_cast<int32_t>(o);
  }
}

template <typename Vec>
int launch_with(const ParallelDraftParams& p, cudaStream_t stream) {
  const int64_t vecs_per_row = p.hidden_row_bytes / static_cast<int64_t>(sizeof(Vec));
  int64_t rows_per_block = vecs_per_row > 0 ? kVecsPerBlock / vecs_per_row : kMaxRowsPerBlock;
  if (rows_per_block < 1) rows_per_block = 1;
  if (rows_per_block > kMaxRowsPerBlock) rows_per_block = kMaxRowsPerBlock;
  int64_t blocks = (p.num_output_tokens + rows_per_block - 1) / rows_per_block;
  if (blocks < 1) blocks = 1;  // block 0 always writes the new query_start_loc
  if (blocks > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  const bool qsl_in_smem = p.batch_size + 1 <= kMaxSmemQsl;
  const size_t smem = qsl_in_smem ? static_cast<size_t>(p.batch_size + 1) * sizeof(int32_t) : 0;
  parallel_draft_kernel<Vec><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
      p, static_cast<int>(rows_per_block), vecs_per_row, qsl_in_smem);
  return static_cast<int>(cudaGetLastError());
}

bool aligned(const void* ptr, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; }

}  // namespace

int launch_parallel_draft(const ParallelDraftParams& p, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // The widest copy unit that divides the row and aligns all three hidden pointers.
  auto fits = [&](uintptr_t w) {
    return p.hidden_row_bytes % static_cast<int64_t>(w) == 0 && aligned(p.target_hidden, w) &&
           aligned(p.mask_hidden, w) && aligned(p.hidden, w);
  };
  if (fits(16)) return launch_with<uint4>(p, stream);
  if (fits(8)) return launch_with<uint2>(p, stream);
  if (fits(4)) return launch_with<unsigned int>(p, stream);
  if (fits(2)) return launch_with<unsigned short>(p, stream);
  return static_cast<int>(cudaErrorMisalignedAddress);  // element sizes are >= 2 bytes
}

}  // namespace peagle::vllm
