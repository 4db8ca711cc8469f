// COD attention CUDA launchers (no torch): raw pointers + a cudaStream_t. Implemented in
// csrc/attention/cuda/*.cu, called by csrc/attention/cuda/cod_attn_glue.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attention/attention_common.h"

namespace peagle::attention {

enum class AttnDtype : int { kBF16 = 0, kFP16 = 1 };

// Backward variants (CodAttnParams::bwd_variant, env PEAGLE_ATTN_BWD read by the glue; see
// launch_bwd in cuda/cod_attn_bwd.cuh).
enum BwdVariant : int {
  kBwdDefault = 0,  // deterministic: separate query-major dQ pass
  kBwdAtomic = 1,   // "atomic": the key-major dK/dV pass also adds dS K into dq_accum (fp32 atomics)
  kBwdWgmma = 2,    // deterministic, the dQ and dK/dV passes on sm_90a warpgroup MMAs (32-query blocks at D = 128)
  kBwdWgmma64 = 3,  // the same with 64-query blocks at D = 128 (what "auto" picks on sm_90 at D = 128)
};

// CodAttnParams::fwd_mf value of the forward on sm_90a warpgroup MMAs (PEAGLE_ATTN_FWD=wgmma, or
// auto on sm_90; one warpgroup per 64 query rows; cuda/cod_attn_fwd_wgmma.cuh). A value of the
// existing field, so the params layout and the mma.sync kernels' SASS stay unchanged.
constexpr int kFwdWgmma = -1;

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
  // forward CTA shape (env PEAGLE_ATTN_FWD_WARPS / PEAGLE_ATTN_FWD_MF, read by the glue; see
  // run_fwd in cuda/cod_attn_configs.cuh): warps 4 or 8 (0 = the default of the MF), MF 1 or 2;
  // fwd_mf == kFwdWgmma (env PEAGLE_ATTN_FWD=wgmma) selects the sm_90a warpgroup forward
  // (cuda/cod_attn_fwd_wgmma.cuh) instead, fwd_warps then unused
  int fwd_warps = 0;
  int fwd_mf = 1;
  // backward variant, a BwdVariant (env PEAGLE_ATTN_BWD, read by the glue; see launch_bwd in
  // cuda/cod_attn_bwd.cuh): kBwdDefault = deterministic (separate query-major dQ pass),
  // kBwdAtomic: the key-major dK/dV pass also adds dS K into dq_accum with fp32 atomics
  // (run-to-run differences at fp32 rounding level), kBwdWgmma / kBwdWgmma64: the deterministic
  // one with the dQ and dK/dV passes on sm_90a warpgroup MMAs (cuda/cod_attn_{dq,bwd}_wgmma.cuh).
  // dq_accum: float32 [T, Hq, D] workspace, 16-byte aligned, only read with kBwdAtomic (the
  // launcher zeroes it on the stream).
  int bwd_variant = kBwdDefault;
  float* dq_accum = nullptr;
  int depth_offsets[kMaxChain + 1] = {};
  // software pipelining of the sm_90a warpgroup kernels (env PEAGLE_ATTN_WGMMA_PIPE, read by the
  // glue; appended last so the fields above keep their offsets): 0 = the kernels as verified
  // first (every wgmma group waited for before the next step); 1 = the second MMA of each block
  // (O += P V, dQ += dS K, dV / dK += ...) left in flight over the next block's copies and first
  // MMA; 2 = additionally, in the forward and the dK/dV pass, the next block's first MMA (S = Q K^T,
  // S^T / dP^T) issued before this block's second one, so that the softmax / P^T, dS^T run while the
  // tensor cores do it (FlashAttention-3's intra-warpgroup overlap; the dQ pass, and the dK/dV pass
  // at D = 128 with 64-query blocks, run level 1 there). Results are bitwise equal at every level
  // (same operations on the same values; see cod_attn_fwd_wgmma.cuh).
  int wgmma_pipe = 0;
};

// workspace for the metadata build (the document-run scan); query with ws == nullptr.
size_t cod_attn_metadata_workspace(int N);
void cod_attn_metadata_launch(const int32_t* anchor, const int32_t* depth, const int32_t* document_ids, int T, int N,
                              const int64_t* depth_offsets, int K, bool cross, int64_t window, int64_t sink,
                              int32_t* ranges, int32_t* chains, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream);

// out, lse. Returns a cudaError_t from the launch (cudaSuccess when nothing to do).
cudaError_t cod_attn_fwd_launch(const CodAttnParams& p, AttnDtype dtype, cudaStream_t stream);
// dq, dk, dv (+ drk/drv in cross mode); needs delta scratch [Hq, T] float32 in p.delta, and with
// kBwdAtomic the workspace p.dq_accum (cod_attn_bwd_dq_accum_elems(p) floats).
cudaError_t cod_attn_bwd_launch(const CodAttnParams& p, AttnDtype dtype, cudaStream_t stream);
// PEAGLE_ATTN_BWD=wgmma / PEAGLE_ATTN_FWD=wgmma: true when this build has the sm_90a kernels (90
// among PEAGLE_CUDA_ARCHS) and the current device has compute capability 9.0. cod_attn_bwd_launch returns
// cudaErrorNotSupported for kBwdWgmma / kBwdWgmma64 when this is false, cod_attn_fwd_launch for
// fwd_mf == kFwdWgmma.
bool cod_attn_wgmma_available();
inline int64_t cod_attn_bwd_dq_accum_elems(const CodAttnParams& p) { return int64_t(p.T) * p.Hq * p.D; }

}  // namespace peagle::attention
