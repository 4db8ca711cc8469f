// The chunk loop of the fused linear-KL / CE loss, shared by the CPU and CUDA ops.
//
// Per chunk of rows it runs the two logit GEMMs through ATen (cuBLAS / CPU BLAS) into two
// preallocated [rows, Vd] buffers (the only [*, V]-sized memory the op ever holds), hands
// them to the back end's row kernel (softmax stats, loss, argmax agreement, in-place logit
// gradient), then runs the two gradient GEMMs of the chunk. The gradients w.r.t. the draft
// hidden states and head are therefore complete when the forward returns; the autograd
// backward only scales them by the incoming gradient.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <tuple>

namespace peagle::loss {

// One chunk for the row kernel: draft [rows, Vd] (gradient written in place when write_grad),
// target [rows, Vd], weight/depth/row_loss [rows] (slices of the full vectors), correct/total
// [num_depths] int64 counters (accumulated across chunks). The contract is the one of
// launch_fused_kl_rows in loss_kernels.h: rows get weight * dloss/dlogit, row_loss = weight * loss.
struct RowsChunk {
  at::Tensor draft_logits;
  at::Tensor target_logits;
  at::Tensor weight;
  at::Tensor depth;
  at::Tensor row_loss;
  at::Tensor correct;
  at::Tensor total;
  int64_t num_depths = 0;
  bool ce = false;
  bool write_grad = false;
};

using RowsFn = std::function<void(RowsChunk&)>;

// Returns (loss, correct, total, grad_hidden, grad_head); the gradients are the gradients of
// `loss` (empty [0] tensors when not requested). Checks every argument (TORCH_CHECK_VALUE /
// TORCH_CHECK_TYPE), including d2t's range, which costs one host sync when d2t is given.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_kl_driver(
    const at::Tensor& draft_hidden, const at::Tensor& draft_head, const at::Tensor& target_hidden,
    const at::Tensor& target_head, const at::Tensor& weight, const at::Tensor& depth,
    const std::optional<at::Tensor>& d2t, int64_t num_depths, int64_t chunk_rows, c10::string_view kind,
    bool compute_grad_hidden, bool compute_grad_head, const RowsFn& rows_fn);

}  // namespace peagle::loss
