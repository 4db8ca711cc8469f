// Torch-facing pieces shared by the CPU op and the CUDA glue of prepare_parallel_draft_inputs:
// argument checks (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE -> ValueError / TypeError), output
// allocation, and the raw-pointer parameter block the kernels take. Defined in
// cpu/parallel_draft_cpu.cpp, which every build compiles.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "vllm/parallel_draft_kernels.h"

namespace peagle::vllm {

struct DraftShapes {
  int64_t num_input_tokens;   // T_in
  int64_t num_output_tokens;  // T_out = T_in + (K-1)*B
  int64_t batch_size;         // B
  int64_t hidden_size;        // H
};

// dtypes, ranks, shapes, devices, contiguity and the scalar arguments. No tensor values are
// read (the CUDA path must not sync).
DraftShapes check_parallel_draft_inputs(const at::Tensor& target_token_ids, const at::Tensor& target_positions,
                                        const at::Tensor& next_token_ids, const at::Tensor& query_start_loc,
                                        const std::optional<at::Tensor>& num_rejected_tokens,
                                        const at::Tensor& target_hidden, const at::Tensor& mask_hidden,
                                        const at::Tensor& block_table, int64_t num_spec_tokens, int64_t mask_token_id,
                                        int64_t block_size, int64_t max_model_len);

// The nine outputs of the out= form: shapes, dtypes, device, contiguity, and no overlap with
// an input they are computed from.
void check_parallel_draft_outputs(const DraftShapes& s, int64_t num_spec_tokens, const at::Tensor& target_token_ids,
                                  const at::Tensor& target_positions, const at::Tensor& query_start_loc,
                                  const at::Tensor& target_hidden, const at::Tensor& mask_hidden,
                                  const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& hidden,
                                  const at::Tensor& is_rejected, const at::Tensor& is_masked,
                                  const at::Tensor& token_indices_to_sample, const at::Tensor& hidden_state_mapping,
                                  const at::Tensor& slot_mapping, const at::Tensor& new_query_start_loc);

using DraftOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                at::Tensor, at::Tensor>;

DraftOutputs allocate_parallel_draft_outputs(const DraftShapes& s, int64_t num_spec_tokens,
                                             const at::Tensor& target_hidden);

ParallelDraftParams make_parallel_draft_params(
    const DraftShapes& s, const at::Tensor& target_token_ids, const at::Tensor& target_positions,
    const at::Tensor& next_token_ids, const at::Tensor& query_start_loc,
    const std::optional<at::Tensor>& num_rejected_tokens, const at::Tensor& target_hidden,
    const at::Tensor& mask_hidden, const at::Tensor& block_table, int64_t num_spec_tokens, int64_t mask_token_id,
    int64_t block_size, int64_t max_model_len, at::Tensor& input_ids, at::Tensor& positions, at::Tensor& hidden,
    at::Tensor& is_rejected, at::Tensor& is_masked, at::Tensor& token_indices_to_sample,
    at::Tensor& hidden_state_mapping, at::Tensor& slot_mapping, at::Tensor& new_query_start_loc);

}  // namespace peagle::vllm
