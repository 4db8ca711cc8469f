// Launchers of the fused linear-KL row kernels (csrc/loss/cuda/loss_kernels.cu). Plain C++ and
// the CUDA runtime only, no torch: the .cu file is compiled by nvcc without torch headers and
// the torch-facing glue (loss_glue.cpp) calls these launchers on the current stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace peagle::loss {

enum class LogitDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
enum class LossKind : int { kKL = 0, kCE = 1 };

// One chunk of target logits [rows, vocab], row-major and contiguous. Per row (one thread block
// each): lse[r] = logsumexp(logits[r]) (kl only; 0 for ce) and argmax[r] = its first argmax.
// This is the only pass over a target row's softmax: every draft row that shares the target
// reads these statistics.
struct TargetStatsArgs {
  const void* logits = nullptr;
  int64_t rows = 0;
  int64_t vocab = 0;
  float* lse = nullptr;       // [rows]
  int32_t* argmax = nullptr;  // [rows]
  LogitDtype dtype = LogitDtype::kBFloat16;
  LossKind kind = LossKind::kKL;
};

// One chunk of draft logits [rows, vocab] (gradient written in place when write_grad), each row
// t reading target row s = target_slot[t] - target_base of target_logits [*, vocab] and its
// statistics target_lse[s], target_argmax[s]. With w = weight[t],
// p = softmax(target row s), q = softmax(draft row t):
//   kl:  loss_t = sum_v p_v (log p_v - log q_v),  dloss_t/dlogit_v = q_v - p_v
//   ce:  loss_t = -log q_{argmax p},               dloss_t/dlogit_v = q_v - [v == argmax p]
//   row_loss[t] = w * loss_t
//   write_grad: draft_logits[t][v] <- w * dloss_t/dlogit_v   (1/sum(weight) is applied by the
//               caller after the GEMMs, so fp16 gradients do not underflow)
//   w > 0: total[depth[t]] += 1, correct[depth[t]] += (argmax q == argmax p)  (first index on ties)
// The driver passes rows of weight > 0 only. Depths outside [0, num_depths) are not counted.
struct DraftRowsArgs {
  void* draft_logits = nullptr;
  const void* target_logits = nullptr;
  int64_t rows = 0;
  int64_t vocab = 0;
  const int64_t* target_slot = nullptr;  // [rows]
  int64_t target_base = 0;
  const float* target_lse = nullptr;       // [target rows]
  const int32_t* target_argmax = nullptr;  // [target rows]
  const float* weight = nullptr;           // [rows]
  const int32_t* depth = nullptr;          // [rows]
  float* row_loss = nullptr;               // [rows]
  int64_t* correct = nullptr;              // [num_depths]
  int64_t* total = nullptr;                // [num_depths]
  int num_depths = 0;
  LogitDtype dtype = LogitDtype::kBFloat16;
  LossKind kind = LossKind::kKL;
  bool write_grad = false;
};

// Enqueue the kernel on `stream`; return the launch status (cudaSuccess when rows == 0).
cudaError_t launch_target_stats(const TargetStatsArgs& args, cudaStream_t stream);
cudaError_t launch_draft_rows(const DraftRowsArgs& args, cudaStream_t stream);

}  // namespace peagle::loss
