// CUDA op of the fused linear-KL / CE loss: the shared chunk driver (cpu/loss_driver.cpp) with
// the CUDA row kernels (loss_kernels.cu). The GEMMs run through ATen/cuBLAS on the current
// stream and the row kernels are enqueued on the same stream; the driver synchronizes once for
// its row plan (and once more for the d2t range check when d2t is given).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "loss/loss_driver.h"
#include "loss/loss_kernels.h"

namespace peagle::loss {
namespace {

LogitDtype logit_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return LogitDtype::kFloat32;
    case at::kHalf:
      return LogitDtype::kFloat16;
    case at::kBFloat16:
      return LogitDtype::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "fused_linear_kl (CUDA): logits must be float32, float16 or bfloat16, got ", t);
  }
  return LogitDtype::kFloat32;  // unreachable
}

void target_stats_cuda(TargetChunk& c) {
  TargetStatsArgs a;
  a.logits = c.logits.const_data_ptr();
  a.rows = c.logits.size(0);
  a.vocab = c.logits.size(1);
  a.lse = c.lse.data_ptr<float>();
  a.argmax = c.argmax.data_ptr<int32_t>();
  a.dtype = logit_dtype(c.logits.scalar_type());
  a.kind = c.ce ? LossKind::kCE : LossKind::kKL;
  const cudaError_t err = launch_target_stats(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fused_linear_kl: target row kernel launch failed: ", cudaGetErrorString(err));
}

void draft_rows_cuda(DraftChunk& c) {
  DraftRowsArgs a;
  a.draft_logits = c.draft_logits.data_ptr();
  a.target_logits = c.target_logits.const_data_ptr();
  a.rows = c.draft_logits.size(0);
  a.vocab = c.draft_logits.size(1);
  a.target_slot = c.target_slot.const_data_ptr<int64_t>();
  a.target_base = c.target_base;
  a.target_lse = c.target_lse.const_data_ptr<float>();
  a.target_argmax = c.target_argmax.const_data_ptr<int32_t>();
  a.weight = c.weight.const_data_ptr<float>();
  a.depth = c.depth.const_data_ptr<int32_t>();
  a.row_loss = c.row_loss.data_ptr<float>();
  a.correct = c.correct.data_ptr<int64_t>();
  a.total = c.total.data_ptr<int64_t>();
  a.num_depths = static_cast<int>(c.num_depths);
  a.dtype = logit_dtype(c.draft_logits.scalar_type());
  a.kind = c.ce ? LossKind::kCE : LossKind::kKL;
  a.write_grad = c.write_grad;
  const cudaError_t err = launch_draft_rows(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "fused_linear_kl: draft row kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_kl_cuda(
    const at::Tensor& draft_hidden, const at::Tensor& draft_head, const at::Tensor& target_hidden,
    const at::Tensor& target_head, const at::Tensor& weight, const at::Tensor& depth,
    const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& target_index, int64_t num_depths,
    int64_t chunk_rows, c10::string_view kind, bool compute_grad_hidden, bool compute_grad_head) {
  TORCH_CHECK_TYPE(draft_hidden.scalar_type() != at::kDouble,
                   "fused_linear_kl (CUDA): float64 is not supported on CUDA; use float32, float16 or bfloat16");
  TORCH_CHECK_VALUE(num_depths <= (int64_t(1) << 30), "fused_linear_kl: num_depths too large: ", num_depths);
  const c10::cuda::CUDAGuard device_guard(draft_hidden.device());
  return fused_linear_kl_driver(draft_hidden, draft_head, target_hidden, target_head, weight, depth, d2t, target_index,
                                num_depths, chunk_rows, kind, compute_grad_hidden, compute_grad_head,
                                RowKernels{target_stats_cuda, draft_rows_cuda});
}

}  // namespace
}  // namespace peagle::loss

TORCH_LIBRARY_IMPL(peagle, CUDA, m) { m.impl("fused_linear_kl", &peagle::loss::fused_linear_kl_cuda); }
