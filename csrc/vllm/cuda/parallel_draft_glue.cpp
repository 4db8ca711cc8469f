// CUDA glue of prepare_parallel_draft_inputs: checks (no tensor values: no host sync),
// allocation for the functional form, and one kernel launch on the current stream. Both
// forms work under CUDA graph capture (allocation goes through the caching allocator).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "vllm/parallel_draft.h"
#include "vllm/parallel_draft_kernels.h"

namespace peagle::vllm {
namespace {

void launch(const ParallelDraftParams& p, const at::Tensor& like) {
  const int err = launch_parallel_draft(p, c10::cuda::getCurrentCUDAStream(like.get_device()).stream());
  TORCH_CHECK(err == 0,
              "prepare_parallel_draft_inputs: CUDA launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void check_on_cuda(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_cuda(), "prepare_parallel_draft_inputs: tensors must be on a CUDA device, got ", t.device());
}

void prepare_parallel_draft_inputs_out_cuda(const at::Tensor& target_token_ids, const at::Tensor& target_positions,
                                            const at::Tensor& next_token_ids, const at::Tensor& query_start_loc,
                                            const std::optional<at::Tensor>& num_rejected_tokens,
                                            const at::Tensor& target_hidden, const at::Tensor& mask_hidden,
                                            const at::Tensor& block_table, int64_t num_spec_tokens,
                                            int64_t mask_token_id, int64_t block_size, int64_t max_model_len,
                                            at::Tensor& input_ids, at::Tensor& positions, at::Tensor& hidden,
                                            at::Tensor& is_rejected, at::Tensor& is_masked,
                                            at::Tensor& token_indices_to_sample, at::Tensor& hidden_state_mapping,
                                            at::Tensor& slot_mapping, at::Tensor& new_query_start_loc) {
  check_on_cuda(target_token_ids);
  const DraftShapes s = check_parallel_draft_inputs(target_token_ids, target_positions, next_token_ids, query_start_loc,
                                                    num_rejected_tokens, target_hidden, mask_hidden, block_table,
                                                    num_spec_tokens, mask_token_id, block_size, max_model_len);
  check_parallel_draft_outputs(s, num_spec_tokens, target_token_ids, target_positions, query_start_loc, target_hidden,
                               mask_hidden, input_ids, positions, hidden, is_rejected, is_masked,
                               token_indices_to_sample, hidden_state_mapping, slot_mapping, new_query_start_loc);
  const c10::cuda::CUDAGuard guard(target_token_ids.device());
  launch(make_parallel_draft_params(s, target_token_ids, target_positions, next_token_ids, query_start_loc,
                                    num_rejected_tokens, target_hidden, mask_hidden, block_table, num_spec_tokens,
                                    mask_token_id, block_size, max_model_len, input_ids, positions, hidden, is_rejected,
                                    is_masked, token_indices_to_sample, hidden_state_mapping, slot_mapping,
                                    new_query_start_loc),
         target_token_ids);
}

DraftOutputs prepare_parallel_draft_inputs_cuda(const at::Tensor& target_token_ids, const at::Tensor& target_positions,
                                                const at::Tensor& next_token_ids, const at::Tensor& query_start_loc,
                                                const std::optional<at::Tensor>& num_rejected_tokens,
                                                const at::Tensor& target_hidden, const at::Tensor& mask_hidden,
                                                const at::Tensor& block_table, int64_t num_spec_tokens,
                                                int64_t mask_token_id, int64_t block_size, int64_t max_model_len) {
  check_on_cuda(target_token_ids);
  const DraftShapes s = check_parallel_draft_inputs(target_token_ids, target_positions, next_token_ids, query_start_loc,
                                                    num_rejected_tokens, target_hidden, mask_hidden, block_table,
                                                    num_spec_tokens, mask_token_id, block_size, max_model_len);
  const c10::cuda::CUDAGuard guard(target_token_ids.device());
  DraftOutputs outs = allocate_parallel_draft_outputs(s, num_spec_tokens, target_hidden);
  auto& [ids, pos, hid, rej, msk, tis, hsm, slot, qsl] = outs;
  launch(make_parallel_draft_params(s, target_token_ids, target_positions, next_token_ids, query_start_loc,
                                    num_rejected_tokens, target_hidden, mask_hidden, block_table, num_spec_tokens,
                                    mask_token_id, block_size, max_model_len, ids, pos, hid, rej, msk, tis, hsm, slot,
                                    qsl),
         target_token_ids);
  return outs;
}

}  // namespace
}  // namespace peagle::vllm

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("prepare_parallel_draft_inputs", &peagle::vllm::prepare_parallel_draft_inputs_cuda);
  m.impl("prepare_parallel_draft_inputs_out", &peagle::vllm::prepare_parallel_draft_inputs_out_cuda);
}
