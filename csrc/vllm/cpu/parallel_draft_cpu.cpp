// vLLM parallel-drafting batch step on the CPU (docs/design.md section 6), plus the checks and
// allocation shared with the CUDA glue. Per output row the rule is draft_row() of
// parallel_draft_kernels.h, the same function the CUDA kernel calls.
//
// The CPU op also checks the tensor VALUES (query_start_loc, num_rejected_tokens, start
// positions), which is free here; the CUDA op cannot without a host sync, so it only
// guarantees memory safety for inconsistent values.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>
#include <limits>

#include "vllm/parallel_draft.h"
#include "vllm/parallel_draft_kernels.h"

namespace peagle::vllm {
namespace {

constexpr const char* kOp = "prepare_parallel_draft_inputs: ";
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

void check_1d(const at::Tensor& t, const char* name, at::ScalarType dtype, const char* dtype_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, kOp, name, " must be ", dtype_name, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, kOp, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), kOp, name, " must be contiguous");
}

void check_len(const at::Tensor& t, const char* name, int64_t n, const char* what) {
  TORCH_CHECK_VALUE(t.size(0) == n, kOp, name, " must have shape [", what, "] = [", n, "], got ", t.sizes());
}

void check_device(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, kOp, name, " must be on ", device, " (the device of target_token_ids), got ",
                    t.device());
}

bool is_hidden_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// Byte ranges of two tensors intersect (outputs must not alias the inputs they are read from).
bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) return false;
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  const auto* a1 = a0 + a.numel() * a.element_size();
  const auto* b1 = b0 + b.numel() * b.element_size();
  return a0 < b1 && b0 < a1;
}

}  // namespace

DraftShapes check_parallel_draft_inputs(const at::Tensor& target_token_ids, const at::Tensor& target_positions,
                                        const at::Tensor& next_token_ids, const at::Tensor& query_start_loc,
                                        const std::optional<at::Tensor>& num_rejected_tokens,
                                        const at::Tensor& target_hidden, const at::Tensor& mask_hidden,
                                        const at::Tensor& block_table, int64_t num_spec_tokens, int64_t mask_token_id,
                                        int64_t block_size, int64_t max_model_len) {
  check_1d(target_token_ids, "target_token_ids", at::kInt, "int32");
  check_1d(target_positions, "target_positions", at::kLong, "int64");
  check_1d(next_token_ids, "next_token_ids", at::kInt, "int32");
  check_1d(query_start_loc, "query_start_loc", at::kInt, "int32");
  TORCH_CHECK_VALUE(query_start_loc.size(0) >= 1, kOp, "query_start_loc must have shape [B+1] (at least 1 entry), got ",
                    query_start_loc.sizes());
  const int64_t T_in = target_token_ids.size(0);
  const int64_t B = query_start_loc.size(0) - 1;
  check_len(target_positions, "target_positions", T_in, "T_in");
  check_len(next_token_ids, "next_token_ids", B, "B");
  if (num_rejected_tokens.has_value()) {
    check_1d(*num_rejected_tokens, "num_rejected_tokens", at::kInt, "int32");
    check_len(*num_rejected_tokens, "num_rejected_tokens", B, "B");
  }

  TORCH_CHECK_TYPE(is_hidden_dtype(target_hidden.scalar_type()), kOp,
                   "target_hidden must be float32, float16 or bfloat16, got ", target_hidden.scalar_type());
  TORCH_CHECK_VALUE(target_hidden.dim() == 2 && target_hidden.size(0) == T_in, kOp,
                    "target_hidden must have shape [T_in, H] with T_in = ", T_in, ", got ", target_hidden.sizes());
  const int64_t H = target_hidden.size(1);
  TORCH_CHECK_VALUE(H >= 1, kOp, "target_hidden must have H >= 1 columns, got shape ", target_hidden.sizes());
  TORCH_CHECK_VALUE(target_hidden.is_contiguous(), kOp, "target_hidden must be contiguous");
  TORCH_CHECK_TYPE(mask_hidden.scalar_type() == target_hidden.scalar_type(), kOp,
                   "mask_hidden must have the dtype of target_hidden (", target_hidden.scalar_type(), "), got ",
                   mask_hidden.scalar_type());
  TORCH_CHECK_VALUE(mask_hidden.dim() == 1 && mask_hidden.size(0) == H, kOp, "mask_hidden must have shape [H] = [", H,
                    "] (the hidden size of target_hidden), got ", mask_hidden.sizes());
  TORCH_CHECK_VALUE(mask_hidden.is_contiguous(), kOp, "mask_hidden must be contiguous");

  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt, kOp, "block_table must be int32, got ",
                   block_table.scalar_type());
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.size(0) >= B && block_table.size(1) >= 1, kOp,
                    "block_table must have shape [B, max_blocks] with B = ", B,
                    " rows (extra rows are ignored) and max_blocks >= 1, got ", block_table.sizes());
  TORCH_CHECK_VALUE(
      block_table.stride(1) == 1 && (block_table.size(0) <= 1 || block_table.stride(0) >= block_table.size(1)), kOp,
      "block_table rows must be contiguous (stride(1) == 1), got strides ", block_table.strides());

  const at::Device device = target_token_ids.device();
  check_device(target_positions, "target_positions", device);
  check_device(next_token_ids, "next_token_ids", device);
  check_device(query_start_loc, "query_start_loc", device);
  if (num_rejected_tokens.has_value()) check_device(*num_rejected_tokens, "num_rejected_tokens", device);
  check_device(target_hidden, "target_hidden", device);
  check_device(mask_hidden, "mask_hidden", device);
  check_device(block_table, "block_table", device);

  TORCH_CHECK_VALUE(num_spec_tokens >= 1, kOp, "num_spec_tokens (K) must be >= 1, got ", num_spec_tokens);
  // slot = block id (int32) * block_size + offset must fit in int64: a block_size past 2^31 wraps
  // the slot negative, and vLLM would write the KV cache there
  TORCH_CHECK_VALUE(block_size >= 1 && block_size <= kInt32Max, kOp, "block_size must be in [1, 2^31 - 1], got ",
                    block_size);
  TORCH_CHECK_VALUE(max_model_len >= 1, kOp, "max_model_len must be > 0, got ", max_model_len);
  TORCH_CHECK_VALUE(mask_token_id >= 0 && mask_token_id <= kInt32Max, kOp,
                    "mask_token_id must be a token id in [0, 2^31), got ", mask_token_id);
  // Every position the slot mapping looks up is <= max_model_len - 1, so its block index is
  // in range exactly when the table covers max_model_len tokens (as vLLM sizes it).
  TORCH_CHECK_VALUE(block_table.size(1) * block_size >= max_model_len, kOp, "block_table has ", block_table.size(1),
                    " blocks per request of block_size ", block_size, " = ", block_table.size(1) * block_size,
                    " tokens, fewer than max_model_len = ", max_model_len);
  TORCH_CHECK_VALUE(num_spec_tokens <= kInt32Max / std::max<int64_t>(B, 1), kOp,
                    "B * num_spec_tokens must fit in int32");
  const int64_t T_out = T_in + (num_spec_tokens - 1) * B;
  TORCH_CHECK_VALUE(T_out <= kInt32Max, kOp, "T_out = T_in + (K-1)*B = ", T_out, " must fit in int32");
  return DraftShapes{T_in, T_out, B, H};
}

void check_parallel_draft_outputs(const DraftShapes& s, int64_t K, const at::Tensor& target_token_ids,
                                  const at::Tensor& target_positions, const at::Tensor& query_start_loc,
                                  const at::Tensor& target_hidden, const at::Tensor& mask_hidden,
                                  const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& hidden,
                                  const at::Tensor& is_rejected, const at::Tensor& is_masked,
                                  const at::Tensor& token_indices_to_sample, const at::Tensor& hidden_state_mapping,
                                  const at::Tensor& slot_mapping, const at::Tensor& new_query_start_loc) {
  struct Want {
    const at::Tensor* t;
    const char* name;
    at::ScalarType dtype;
    int64_t n;
    const char* what;
  };
  const Want wants[] = {
      {&input_ids, "out.input_ids", at::kInt, s.num_output_tokens, "T_out"},
      {&positions, "out.positions", at::kLong, s.num_output_tokens, "T_out"},
      {&is_rejected, "out.is_rejected", at::kBool, s.num_output_tokens, "T_out"},
      {&is_masked, "out.is_masked", at::kBool, s.num_output_tokens, "T_out"},
      {&token_indices_to_sample, "out.token_indices_to_sample", at::kInt, s.batch_size * K, "B*K"},
      {&hidden_state_mapping, "out.hidden_state_mapping", at::kInt, s.num_input_tokens, "T_in"},
      {&slot_mapping, "out.slot_mapping", at::kLong, s.num_output_tokens, "T_out"},
      {&new_query_start_loc, "out.query_start_loc", at::kInt, s.batch_size + 1, "B+1"},
  };
  const at::Device device = target_token_ids.device();
  for (const Want& w : wants) {
    TORCH_CHECK_TYPE(w.t->scalar_type() == w.dtype, kOp, w.name, " must be ", w.dtype, ", got ", w.t->scalar_type());
    TORCH_CHECK_VALUE(w.t->dim() == 1 && w.t->size(0) == w.n, kOp, w.name, " must have shape [", w.what, "] = [", w.n,
                      "], got ", w.t->sizes());
    TORCH_CHECK_VALUE(w.t->is_contiguous(), kOp, w.name, " must be contiguous");
    check_device(*w.t, w.name, device);
  }
  TORCH_CHECK_TYPE(hidden.scalar_type() == target_hidden.scalar_type(), kOp,
                   "out.hidden must have the dtype of target_hidden (", target_hidden.scalar_type(), "), got ",
                   hidden.scalar_type());
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(0) == s.num_output_tokens && hidden.size(1) == s.hidden_size, kOp,
                    "out.hidden must have shape [T_out, H] = [", s.num_output_tokens, ", ", s.hidden_size, "], got ",
                    hidden.sizes());
  TORCH_CHECK_VALUE(hidden.is_contiguous(), kOp, "out.hidden must be contiguous");
  check_device(hidden, "out.hidden", device);
  TORCH_CHECK_VALUE(!overlaps(hidden, target_hidden) && !overlaps(hidden, mask_hidden), kOp,
                    "out.hidden must not overlap target_hidden or mask_hidden (the op is not in-place)");
  TORCH_CHECK_VALUE(!overlaps(input_ids, target_token_ids), kOp, "out.input_ids must not overlap target_token_ids");
  TORCH_CHECK_VALUE(!overlaps(positions, target_positions), kOp, "out.positions must not overlap target_positions");
  TORCH_CHECK_VALUE(!overlaps(new_query_start_loc, query_start_loc), kOp,
                    "out.query_start_loc must not overlap query_start_loc");
  // outputs that share memory overwrite each other's values: wrong results without an error
  const std::pair<const at::Tensor*, const char*> outs[] = {{&input_ids, "input_ids"},
                                                            {&positions, "positions"},
                                                            {&hidden, "hidden"},
                                                            {&is_rejected, "is_rejected"},
                                                            {&is_masked, "is_masked"},
                                                            {&token_indices_to_sample, "token_indices_to_sample"},
                                                            {&hidden_state_mapping, "hidden_state_mapping"},
                                                            {&slot_mapping, "slot_mapping"},
                                                            {&new_query_start_loc, "query_start_loc"}};
  for (size_t i = 0; i < std::size(outs); ++i) {
    for (size_t j = i + 1; j < std::size(outs); ++j) {
      TORCH_CHECK_VALUE(!overlaps(*outs[i].first, *outs[j].first), kOp, "out.", outs[i].second, " and out.",
                        outs[j].second, " overlap: every output needs its own memory");
    }
  }
}

DraftOutputs allocate_parallel_draft_outputs(const DraftShapes& s, int64_t K, const at::Tensor& target_hidden) {
  const auto opts = target_hidden.options();
  return {
      at::empty({s.num_output_tokens}, opts.dtype(at::kInt)),  at::empty({s.num_output_tokens}, opts.dtype(at::kLong)),
      at::empty({s.num_output_tokens, s.hidden_size}, opts),   at::empty({s.num_output_tokens}, opts.dtype(at::kBool)),
      at::empty({s.num_output_tokens}, opts.dtype(at::kBool)), at::empty({s.batch_size * K}, opts.dtype(at::kInt)),
      at::empty({s.num_input_tokens}, opts.dtype(at::kInt)),   at::empty({s.num_output_tokens}, opts.dtype(at::kLong)),
      at::empty({s.batch_size + 1}, opts.dtype(at::kInt))};
}

ParallelDraftParams make_parallel_draft_params(
    const DraftShapes& s, const at::Tensor& target_token_ids, const at::Tensor& target_positions,
    const at::Tensor& next_token_ids, const at::Tensor& query_start_loc,
    const std::optional<at::Tensor>& num_rejected_tokens, const at::Tensor& target_hidden,
    const at::Tensor& mask_hidden, const at::Tensor& block_table, int64_t K, int64_t mask_token_id, int64_t block_size,
    int64_t max_model_len, at::Tensor& input_ids, at::Tensor& positions, at::Tensor& hidden, at::Tensor& is_rejected,
    at::Tensor& is_masked, at::Tensor& token_indices_to_sample, at::Tensor& hidden_state_mapping,
    at::Tensor& slot_mapping, at::Tensor& new_query_start_loc) {
  ParallelDraftParams p{};
  p.target_token_ids = target_token_ids.const_data_ptr<int32_t>();
  p.target_positions = target_positions.const_data_ptr<int64_t>();
  p.next_token_ids = next_token_ids.const_data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.const_data_ptr<int32_t>();
  p.num_rejected = num_rejected_tokens.has_value() ? num_rejected_tokens->const_data_ptr<int32_t>() : nullptr;
  p.target_hidden = target_hidden.const_data_ptr();
  p.mask_hidden = mask_hidden.const_data_ptr();
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.input_ids = input_ids.mutable_data_ptr<int32_t>();
  p.positions = positions.mutable_data_ptr<int64_t>();
  p.hidden = hidden.mutable_data_ptr();
  p.is_rejected = is_rejected.mutable_data_ptr<bool>();
  p.is_masked = is_masked.mutable_data_ptr<bool>();
  p.token_indices_to_sample = token_indices_to_sample.mutable_data_ptr<int32_t>();
  p.hidden_state_mapping = hidden_state_mapping.mutable_data_ptr<int32_t>();
  p.slot_mapping = slot_mapping.mutable_data_ptr<int64_t>();
  p.out_query_start_loc = new_query_start_loc.mutable_data_ptr<int32_t>();
  p.num_input_tokens = s.num_input_tokens;
  p.num_output_tokens = s.num_output_tokens;
  p.batch_size = s.batch_size;
  p.num_spec_tokens = K;
  p.hidden_row_bytes = s.hidden_size * static_cast<int64_t>(target_hidden.element_size());
  p.block_table_stride = block_table.size(0) > 1 ? block_table.stride(0) : block_table.size(1);
  p.max_blocks = block_table.size(1);
  p.block_size = block_size;
  p.max_model_len = max_model_len;
  p.mask_token_id = static_cast<int32_t>(mask_token_id);
  return p;
}

namespace {

// The values the layout depends on; cheap on the CPU, so always checked here.
void check_values_cpu(const ParallelDraftParams& p) {
  const int32_t* qsl = p.query_start_loc;
  TORCH_CHECK_VALUE(qsl[0] == 0, kOp, "query_start_loc[0] must be 0, got ", qsl[0]);
  TORCH_CHECK_VALUE(qsl[p.batch_size] == p.num_input_tokens, kOp,
                    "query_start_loc[B] must equal T_in = ", p.num_input_tokens, ", got ", qsl[p.batch_size]);
  for (const auto r : c10::irange(p.batch_size)) {
    const int64_t len = static_cast<int64_t>(qsl[r + 1]) - qsl[r];
    TORCH_CHECK_VALUE(len >= 1, kOp, "every request needs at least one input token: query_start_loc[", r + 1,
                      "] - query_start_loc[", r, "] = ", len);
    if (p.num_rejected) {
      const int64_t nrej = p.num_rejected[r];
      TORCH_CHECK_VALUE(nrej >= 0 && nrej <= len - 1, kOp, "num_rejected_tokens[", r, "] = ", nrej,
                        " must be in [0, query_len - 1] = [0, ", len - 1,
                        "] (the first token of a request is never rejected)");
    }
    TORCH_CHECK_VALUE(p.target_positions[qsl[r]] >= 0, kOp, "target_positions[", qsl[r], "] (start of request ", r,
                      ") must be >= 0, got ", p.target_positions[qsl[r]]);
    // a request's output positions run to start + len + K - 2; past the int64 maximum they wrap
    TORCH_CHECK_VALUE(p.target_positions[qsl[r]] <= std::numeric_limits<int64_t>::max() - len - p.num_spec_tokens, kOp,
                      "target_positions[", qsl[r], "] (start of request ", r, ") = ", p.target_positions[qsl[r]],
                      " is so large that the draft positions overflow int64");
  }
}

void run_cpu(const ParallelDraftParams& p) {
  check_values_cpu(p);
  const int64_t K = p.num_spec_tokens;
  const int64_t row_bytes = p.hidden_row_bytes;
  const char* target = static_cast<const char*>(p.target_hidden);
  const char* mask = static_cast<const char*>(p.mask_hidden);
  char* out = static_cast<char*>(p.hidden);
  auto load_token = [&](int64_t i) { return p.target_token_ids[i]; };
  auto load_block = [&](int64_t r, int64_t b) { return p.block_table[r * p.block_table_stride + b]; };
  for (int64_t i = 0; i <= p.batch_size; ++i)
    p.out_query_start_loc[i] = static_cast<int32_t>(p.query_start_loc[i] + i * (K - 1));
  for (const auto r : c10::irange(p.batch_size)) {
    const int64_t qs = p.query_start_loc[r], qe = p.query_start_loc[r + 1];
    const int64_t nrej = p.num_rejected ? p.num_rejected[r] : 0;
    const int64_t out_start = qs + r * (K - 1);
    const int64_t out_len = qe - qs + K - 1;
    for (int64_t o = out_start; o < out_start + out_len; ++o) {
      const DraftRow row =
          draft_row(o, r, qs, qe, nrej, p.target_positions[qs], p.next_token_ids[r], K, p.num_input_tokens,
                    p.mask_token_id, p.block_size, p.max_model_len, p.max_blocks, load_token, load_block);
      p.input_ids[o] = row.input_id;
      p.positions[o] = row.position;
      p.is_rejected[o] = row.is_rejected;
      p.is_masked[o] = row.is_masked;
      p.slot_mapping[o] = row.slot;
      if (row.sample_index >= 0) p.token_indices_to_sample[row.sample_index] = static_cast<int32_t>(o);
      if (row.mapped_input >= 0) p.hidden_state_mapping[row.mapped_input] = static_cast<int32_t>(o);
      char* dst = out + o * row_bytes;
      if (row.hidden_source >= 0)
        std::memcpy(dst, target + static_cast<int64_t>(row.hidden_source) * row_bytes, row_bytes);
      else if (row.hidden_source == kHiddenFromMask)
        std::memcpy(dst, mask, row_bytes);
      else
        std::memset(dst, 0, row_bytes);
    }
  }
}

void prepare_parallel_draft_inputs_out_cpu(const at::Tensor& target_token_ids, const at::Tensor& target_positions,
                                           const at::Tensor& next_token_ids, const at::Tensor& query_start_loc,
                                           const std::optional<at::Tensor>& num_rejected_tokens,
                                           const at::Tensor& target_hidden, const at::Tensor& mask_hidden,
                                           const at::Tensor& block_table, int64_t num_spec_tokens,
                                           int64_t mask_token_id, int64_t block_size, int64_t max_model_len,
                                           at::Tensor& input_ids, at::Tensor& positions, at::Tensor& hidden,
                                           at::Tensor& is_rejected, at::Tensor& is_masked,
                                           at::Tensor& token_indices_to_sample, at::Tensor& hidden_state_mapping,
                                           at::Tensor& slot_mapping, at::Tensor& new_query_start_loc) {
  const DraftShapes s = check_parallel_draft_inputs(target_token_ids, target_positions, next_token_ids, query_start_loc,
                                                    num_rejected_tokens, target_hidden, mask_hidden, block_table,
                                                    num_spec_tokens, mask_token_id, block_size, max_model_len);
  check_parallel_draft_outputs(s, num_spec_tokens, target_token_ids, target_positions, query_start_loc, target_hidden,
                               mask_hidden, input_ids, positions, hidden, is_rejected, is_masked,
                               token_indices_to_sample, hidden_state_mapping, slot_mapping, new_query_start_loc);
  run_cpu(make_parallel_draft_params(
      s, target_token_ids, target_positions, next_token_ids, query_start_loc, num_rejected_tokens, target_hidden,
      mask_hidden, block_table, num_spec_tokens, mask_token_id, block_size, max_model_len, input_ids, positions, hidden,
      is_rejected, is_masked, token_indices_to_sample, hidden_state_mapping, slot_mapping, new_query_start_loc));
}

DraftOutputs prepare_parallel_draft_inputs_cpu(const at::Tensor& target_token_ids, const at::Tensor& target_positions,
                                               const at::Tensor& next_token_ids, const at::Tensor& query_start_loc,
                                               const std::optional<at::Tensor>& num_rejected_tokens,
                                               const at::Tensor& target_hidden, const at::Tensor& mask_hidden,
                                               const at::Tensor& block_table, int64_t num_spec_tokens,
                                               int64_t mask_token_id, int64_t block_size, int64_t max_model_len) {
  const DraftShapes s = check_parallel_draft_inputs(target_token_ids, target_positions, next_token_ids, query_start_loc,
                                                    num_rejected_tokens, target_hidden, mask_hidden, block_table,
                                                    num_spec_tokens, mask_token_id, block_size, max_model_len);
  DraftOutputs outs = allocate_parallel_draft_outputs(s, num_spec_tokens, target_hidden);
  auto& [ids, pos, hid, rej, msk, tis, hsm, slot, qsl] = outs;
  run_cpu(make_parallel_draft_params(s, target_token_ids, target_positions, next_token_ids, query_start_loc,
                                     num_rejected_tokens, target_hidden, mask_hidden, block_table, num_spec_tokens,
                                     mask_token_id, block_size, max_model_len, ids, pos, hid, rej, msk, tis, hsm, slot,
                                     qsl));
  return outs;
}

}  // namespace
}  // namespace peagle::vllm

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("prepare_parallel_draft_inputs", &peagle::vllm::prepare_parallel_draft_inputs_cpu);
  m.impl("prepare_parallel_draft_inputs_out", &peagle::vllm::prepare_parallel_draft_inputs_out_cpu);
}
