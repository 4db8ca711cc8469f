// Launcher of the fused linear-KL row kernel (csrc/loss/cuda/loss_kernels.cu). Plain C++ and
// the CUDA runtime only, no torch: the .cu file is compiled by nvcc without torch headers and
// the torch-facing glue (loss_glue.cpp) calls this launcher on the current stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace peagle::loss {

enum class LogitDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
enum class LossKind : int { kKL = 0, kCE = 1 };

// One chunk of rows of both logit matrices, [rows, vocab] row-major and contiguous.
// Per row t (one thread block each), with w = weight[t]:
//   p = softmax(target_logits[t]), q = softmax(draft_logits[t])
//   kl:  loss_t = sum_v p_v (log p_v - log q_v),  dloss_t/dlogit_v = q_v - p_v
//   ce:  loss_t = -log q_{argmax p},               dloss_t/dlogit_v = q_v - [v == argmax p]
//   row_loss[t] = w * loss_t
//   write_grad: draft_logits[t][v] <- w * dloss_t/dlogit_v   (in place; 1/sum(weight) is
//               applied by the caller after the GEMMs, so fp16 gradients do not underflow)
//   w > 0: total[depth[t]] += 1, correct[depth[t]] += (argmax q == argmax p)  (first index on ties)
// Rows with w == 0 contribute nothing and get a zero gradient row. Depths outside
// [0, num_depths) are not counted (the Python wrapper rejects them beforehand).
struct FusedKlRowsArgs {
  void* draft_logits = nullptr;
  const void* target_logits = nullptr;
  int64_t rows = 0;
  int64_t vocab = 0;
  const float* weight = nullptr;   // [rows]
  const int32_t* depth = nullptr;  // [rows]
  float* row_loss = nullptr;       // [rows]
  int64_t* correct = nullptr;      // [num_depths]
  int64_t* total = nullptr;        // [num_depths]
  int num_depths = 0;
  LogitDtype dtype = LogitDtype::kBFloat16;
  LossKind kind = LossKind::kKL;
  bool write_grad = false;
};

// Enqueues the kernel on `stream`; returns the launch status (cudaSuccess when rows == 0).
cudaError_t launch_fused_kl_rows(const FusedKlRowsArgs& args, cudaStream_t stream);

}  // namespace peagle::loss
