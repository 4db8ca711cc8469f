// Kernel configurations per head dim (one place, so the per-file instantiations and the
// dispatcher agree): forward 8 warps x 16 query rows, key blocks of 64; dQ 4 warps; dK/dV
// query blocks of 64 rows (32 for D = 128 to stay within 255 registers).
#pragma once
#include "attention/cuda/cod_attn_bwd.cuh"
#include "attention/cuda/cod_attn_fwd.cuh"

namespace peagle::attention::cuda {

template <int D>
struct AttnConfig;
template <>
struct AttnConfig<64> {
  static constexpr int kFwdWarps = 8, kFwdBN = 64, kDqWarps = 4, kDkvBMQ = 64;
};
template <>
struct AttnConfig<128> {
  static constexpr int kFwdWarps = 8, kFwdBN = 64, kDqWarps = 4, kDkvBMQ = 32;
};

// p.fwd_warps (PEAGLE_ATTN_FWD_WARPS, default 8) picks 8 warps (BM=128, one CTA per SM) or
// 4 warps (BM=64, two CTAs per SM overlap each other's prologue/epilogue): tune on the GPU.
template <int D, typename T>
cudaError_t run_fwd(const CodAttnParams& p, cudaStream_t s) {
  if (p.fwd_warps == 4) return launch_fwd<D, T, 4, AttnConfig<D>::kFwdBN>(p, s);
  return launch_fwd<D, T, AttnConfig<D>::kFwdWarps, AttnConfig<D>::kFwdBN>(p, s);
}
template <int D, typename T>
cudaError_t run_bwd(const CodAttnParams& p, cudaStream_t s) {
  return launch_bwd<D, T, AttnConfig<D>::kDqWarps, AttnConfig<D>::kDkvBMQ>(p, s);
}

}  // namespace peagle::attention::cuda
