// CPU emulation of the CUDA kernel's schedule, for tests on machines without a GPU:
// peagle::_parallel_draft_kernel_emulation runs the kernel's launch plan and its block phases
// (parallel_draft_block.h, the same code the .cu compiles) block by block, each phase for
// every thread of the block in turn. That is exact for this kernel: threads exchange data only
// through shared arrays across __syncthreads(), which separate the phases. vec_bytes picks
// the copy unit (0 = what the CUDA launcher would pick for these pointers).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "vllm/parallel_draft.h"
#include "vllm/parallel_draft_block.h"
#include "vllm/parallel_draft_kernels.h"

namespace peagle::vllm {
namespace {

struct HostMem {
  template <typename T>
  static T ld(const T* p) {
    return *p;
  }
  template <typename T>
  static T ld_stream(const T* p) {
    return *p;
  }
};

// Copy units standing in for uint4 / uint2 / unsigned / unsigned short.
template <int W>
struct alignas(W) Unit {
  unsigned char bytes[W];
};

template <typename Vec>
void emulate(const ParallelDraftParams& p) {
  const LaunchPlan plan = plan_launch(p, sizeof(Vec));
  std::vector<int32_t> s_qsl(p.batch_size + 1), s_src(kMaxRowsPerBlock), s_req(kMaxRowsPerBlock);
  for (int64_t block = 0; block < plan.blocks; ++block) {
    // "Uninitialised" shared memory: a row whose entry was not written by this block reads
    // these and produces visibly wrong output (zero hidden row, request 0).
    std::fill(s_src.begin(), s_src.end(), kHiddenZero - 1);
    std::fill(s_req.begin(), s_req.end(), 0);
    std::fill(s_qsl.begin(), s_qsl.end(), 0);
    int64_t row_begin;
    const int rows_here = block_rows(p, block, plan.rows_per_block, &row_begin);
    if (block == 0)
      for (int tid = 0; tid < kThreads; ++tid) phase_out_qsl(p, tid, kThreads);
    if (rows_here == 0) continue;
    if (plan.qsl_in_smem)
      for (int tid = 0; tid < kThreads; ++tid) phase_stage_qsl<HostMem>(p, s_qsl.data(), tid, kThreads);
    const QslReader<HostMem> qsl{plan.qsl_in_smem ? s_qsl.data() : nullptr, p.query_start_loc};
    for (int tid = 0; tid < kThreads; ++tid)
      phase_rows(p, qsl, row_begin, rows_here, s_src.data(), s_req.data(), tid, kThreads);
    for (int tid = 0; tid < kThreads; ++tid)
      phase_hidden<Vec, HostMem>(p, plan.vecs_per_row, row_begin, rows_here, s_src.data(), tid, kThreads);
    for (int tid = 0; tid < kThreads; ++tid) phase_scalars(p, qsl, row_begin, rows_here, s_req.data(), tid, kThreads);
  }
}

DraftOutputs parallel_draft_kernel_emulation(const at::Tensor& target_token_ids, const at::Tensor& target_positions,
                                             const at::Tensor& next_token_ids, const at::Tensor& query_start_loc,
                                             const std::optional<at::Tensor>& num_rejected_tokens,
                                             const at::Tensor& target_hidden, const at::Tensor& mask_hidden,
                                             const at::Tensor& block_table, int64_t num_spec_tokens,
                                             int64_t mask_token_id, int64_t block_size, int64_t max_model_len,
                                             int64_t vec_bytes) {
  const DraftShapes s = check_parallel_draft_inputs(target_token_ids, target_positions, next_token_ids, query_start_loc,
                                                    num_rejected_tokens, target_hidden, mask_hidden, block_table,
                                                    num_spec_tokens, mask_token_id, block_size, max_model_len);
  DraftOutputs outs = allocate_parallel_draft_outputs(s, num_spec_tokens, target_hidden);
  auto& [ids, pos, hid, rej, msk, tis, hsm, slot, qsl] = outs;
  const ParallelDraftParams p = make_parallel_draft_params(
      s, target_token_ids, target_positions, next_token_ids, query_start_loc, num_rejected_tokens, target_hidden,
      mask_hidden, block_table, num_spec_tokens, mask_token_id, block_size, max_model_len, ids, pos, hid, rej, msk, tis,
      hsm, slot, qsl);
  const int auto_bytes = copy_unit_bytes(p);
  if (vec_bytes == 0) vec_bytes = auto_bytes;
  TORCH_CHECK_VALUE(vec_bytes == 16 || vec_bytes == 8 || vec_bytes == 4 || vec_bytes == 2,
                    "_parallel_draft_kernel_emulation: vec_bytes must be 0, 2, 4, 8 or 16, got ", vec_bytes);
  TORCH_CHECK_VALUE(auto_bytes % vec_bytes == 0, "_parallel_draft_kernel_emulation: vec_bytes ", vec_bytes,
                    " does not divide the hidden row / align the pointers (widest allowed: ", auto_bytes, ")");
  switch (vec_bytes) {
    case 16:
      emulate<Unit<16>>(p);
      break;
    case 8:
      emulate<Unit<8>>(p);
      break;
    case 4:
      emulate<Unit<4>>(p);
      break;
    default:
      emulate<Unit<2>>(p);
      break;
  }
  return outs;
}

}  // namespace
}  // namespace peagle::vllm

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("_parallel_draft_kernel_emulation", &peagle::vllm::parallel_draft_kernel_emulation);
}
