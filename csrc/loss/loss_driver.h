// The chunk loop of the fused linear-KL / CE loss, shared by the CPU and CUDA ops.
//
// Draft row t is compared with target row target_index[t] (identity when no index is given).
// The driver drops the rows of weight 0, groups the others by target row (a stable counting
// sort on the host, after one device-to-host copy of the row keys) and cuts the groups into
// chunks of at most chunk_rows target rows and chunk_rows draft rows. Per chunk it runs the
// target GEMM and the back end's target-statistics kernel once per distinct target row (a
// target row whose draft rows span several chunks keeps its logits across them), the draft
// GEMM, the back end's draft row kernel (softmax, loss, argmax agreement, in-place logit
// gradient) and the two gradient GEMMs. Two [chunk_rows, Vd] logit buffers are the only
// vocab-sized memory the op holds. The gradients w.r.t. the draft hidden states and head are
// complete when the forward returns; the autograd backward only scales them.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <tuple>

namespace peagle::loss {

// Target statistics of one chunk: logits [rows, Vd]; lse [rows] (weight's dtype; kl only) and
// argmax [rows] int32 are written.
struct TargetChunk {
  at::Tensor logits;
  at::Tensor lse;
  at::Tensor argmax;
  bool ce = false;
};

// One chunk of draft rows (the contract of launch_draft_rows in loss_kernels.h): draft [rows,
// Vd] (gradient written in place when write_grad); row r reads target row target_slot[r] -
// target_base of target_logits and its statistics; weight/depth/row_loss [rows]; correct/total
// [num_depths] int64 counters accumulated across chunks.
struct DraftChunk {
  at::Tensor draft_logits;
  at::Tensor target_logits;
  at::Tensor target_slot;
  int64_t target_base = 0;
  at::Tensor target_lse;
  at::Tensor target_argmax;
  at::Tensor weight;
  at::Tensor depth;
  at::Tensor row_loss;
  at::Tensor correct;
  at::Tensor total;
  int64_t num_depths = 0;
  bool ce = false;
  bool write_grad = false;
};

struct RowKernels {
  std::function<void(TargetChunk&)> target_stats;
  std::function<void(DraftChunk&)> draft_rows;
};

// Returns (loss, correct, total, grad_hidden, grad_head); the gradients are the gradients of
// `loss` (empty [0] tensors when not requested). Checks every argument (TORCH_CHECK_VALUE /
// TORCH_CHECK_TYPE), including d2t's range (one host sync when d2t is given) and the target
// index of every row of weight > 0 (on the host copy the plan is made from).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_kl_driver(
    const at::Tensor& draft_hidden, const at::Tensor& draft_head, const at::Tensor& target_hidden,
    const at::Tensor& target_head, const at::Tensor& weight, const at::Tensor& depth,
    const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& target_index, int64_t num_depths,
    int64_t chunk_rows, c10::string_view kind, bool compute_grad_hidden, bool compute_grad_head,
    const RowKernels& kernels);

}  // namespace peagle::loss
