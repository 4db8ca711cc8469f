// COD attention CUDA launchers (no torch): raw pointers + a cudaStream_t. Implemented in
// csrc/attention/cuda/*.cu, called by csrc/attention/cuda/cod_attn_glue.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attention/attention_common.h"
#include "attention/attention_dispatch.h"

namespace peagle::attention {

enum class AttnDtype : int { kBF16 = 0, kFP16 = 1 };

// Everything a COD attention kernel reads. Tensors are contiguous: q/out/dout/dq [T, Hq, D],
// k/v/dk/dv [T, Hkv, D], range keys rk/rv/drk/drv [N, Hkv, D] (symmetric: the first N rows of
// k/v themselves; cross: context_k/v), lse/delta [Hq, T] float32, ranges [5, T], chain/rchain [T, K].
struct CodAttnParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* rk = nullptr;
  const void* rv = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  const int32_t* ranges = nullptr;
  const int32_t* chain = nullptr;
  const int32_t* rchain = nullptr;
  // backward
  const void* dout = nullptr;
  float* delta = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* drk = nullptr;  // == dk in symmetric mode
  void* drv = nullptr;
  int T = 0, N = 0, Hq = 0, Hkv = 0, D = 0, K = 0, group = 1;
  int symmetric = 1, use_sink = 0;
  float scale = 1.f, scale_log2 = 1.f;
  int depth_offsets[kMaxChain + 1] = {};
};

// workspace for the metadata build (the document-run scan); query with ws == nullptr.
size_t cod_attn_metadata_workspace(int N);
void cod_attn_metadata_launch(const int32_t* anchor, const int32_t* depth, const int32_t* document_ids, int T, int N,
                              const int64_t* depth_offsets, int K, bool cross, int64_t window, int64_t sink,
                              int32_t* ranges, int32_t* chains, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream);

// out, lse with the kernels of `family` (kPortable or kHopper, from choose_attn_kernel). Returns a
// cudaError_t from the launch (cudaSuccess when nothing to do; cudaErrorNotSupported for kHopper
// where those kernels cannot run).
cudaError_t cod_attn_fwd_launch(const CodAttnParams& p, AttnDtype dtype, AttnKernelFamily family, cudaStream_t stream);
// dq, dk, dv (+ drk/drv in cross mode); needs delta scratch [Hq, T] float32 in p.delta.
cudaError_t cod_attn_bwd_launch(const CodAttnParams& p, AttnDtype dtype, AttnKernelFamily family, cudaStream_t stream);
// Whether this build holds the Hopper kernels (sm_90a code: 90 among PEAGLE_CUDA_ARCHS).
bool cod_attn_hopper_built();
// Whether they run here: a build that holds them and a device of compute capability 9.0.
bool cod_attn_wgmma_available();

}  // namespace peagle::attention
