// vLLM parallel-drafting batch step in ONE kernel (docs/design.md section 6). No torch includes.
//
// What vLLM does in a Triton kernel (copy_and_expand_eagle_inputs_kernel), an index_put of the
// hidden states, a torch.where with mask_hidden and ~6 ops of slot mapping, this kernel does
// in one pass over the OUTPUT rows: every output row reads exactly one source (a target
// hidden row, mask_hidden, or nothing -> zero), so the hidden scatter becomes a gather with
// no write conflicts, and rejected target rows that vLLM writes and then overwrites with
// mask_hidden are never read.
//
// Work split (parallel_draft_block.h, which the CPU emulation shares): a block owns
// `rows_per_block` consecutive output rows, sized so that its hidden slice is ~1024 copy units
// (2 rows at H=4096 bf16 with 16-byte units). T_out is known from the shapes (T_in + (K-1)*B),
// so the grid needs no host sync; each row finds its request by a binary search over
// query_start_loc, staged in shared memory.
//   phase_rows:    one thread per row: request index + hidden source -> shared memory
//   phase_hidden:  all threads: the hidden rows, 4 vector loads in flight per thread
//   phase_scalars: one thread per row: ids, positions, masks, slot mapping, sample index, mapping
// phase_scalars comes after the copy so its dependent loads (position -> block table) overlap
// the copy's stores instead of delaying them.
#include <cuda_runtime.h>

#include <cstdint>

#include "vllm/parallel_draft_block.h"
#include "vllm/parallel_draft_kernels.h"

namespace peagle::vllm {
namespace {

// Streaming load for target rows (read once), cached (read-only path) load for everything
// else, mask_hidden included (read by every masked row).
struct DeviceMem {
  template <typename T>
  __device__ __forceinline__ static T ld(const T* p) {
    return __ldg(p);
  }
  template <typename T>
  __device__ __forceinline__ static T ld_stream(const T* p) {
    return __ldcs(p);
  }
};

template <typename Vec>
__global__ void __launch_bounds__(kThreads)
    parallel_draft_kernel(const ParallelDraftParams p, int rows_per_block, int64_t vecs_per_row, bool qsl_in_smem) {
  extern __shared__ int32_t s_qsl[];           // [B+1] when qsl_in_smem
  __shared__ int32_t s_src[kMaxRowsPerBlock];  // hidden source of each row of this block
  __shared__ int32_t s_req[kMaxRowsPerBlock];  // request of each row of this block
  const int tid = threadIdx.x;
  int64_t row_begin;
  const int rows_here = block_rows(p, blockIdx.x, rows_per_block, &row_begin);
  if (blockIdx.x == 0) phase_out_qsl(p, tid, kThreads);
  if (rows_here == 0) return;  // block-uniform
  if (qsl_in_smem) {
    phase_stage_qsl<DeviceMem>(p, s_qsl, tid, kThreads);
    __syncthreads();
  }
  const QslReader<DeviceMem> qsl{qsl_in_smem ? s_qsl : nullptr, p.query_start_loc};
  phase_rows(p, qsl, row_begin, rows_here, s_src, s_req, tid, kThreads);
  __syncthreads();
  phase_hidden<Vec, DeviceMem>(p, vecs_per_row, row_begin, rows_here, s_src, tid, kThreads);
  phase_scalars(p, qsl, row_begin, rows_here, s_req, tid, kThreads);
}

template <typename Vec>
int launch_with(const ParallelDraftParams& p, cudaStream_t stream) {
  const LaunchPlan plan = plan_launch(p, sizeof(Vec));
  if (plan.blocks > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  parallel_draft_kernel<Vec>
      <<<static_cast<unsigned>(plan.blocks), kThreads, static_cast<size_t>(plan.smem_bytes), stream>>>(
          p, plan.rows_per_block, plan.vecs_per_row, plan.qsl_in_smem);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_parallel_draft(const ParallelDraftParams& p, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (copy_unit_bytes(p)) {
    case 16:
      return launch_with<uint4>(p, stream);
    case 8:
      return launch_with<uint2>(p, stream);
    case 4:
      return launch_with<unsigned int>(p, stream);
    case 2:
      return launch_with<unsigned short>(p, stream);
    default:
      return static_cast<int>(cudaErrorMisalignedAddress);  // element sizes are >= 2 bytes
  }
}

}  // namespace peagle::vllm
