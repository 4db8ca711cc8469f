// The mma.sync kernels' shapes per head dim, from attention_dispatch.h (one place, so the per-file
// instantiations, the dispatcher and what peagle_ext reports agree): forward 16 query rows per
// warp, key blocks of 64, 8 warps at D = 64 and 4 at D = 128; dQ 4 warps; dK/dV query blocks of 64
// rows (32 at D = 128, to stay within 255 registers).
#pragma once
#include "attention/attention_dispatch.h"
#include "attention/cuda/cod_attn_bwd.cuh"
#include "attention/cuda/cod_attn_fwd.cuh"

namespace peagle::attention::cuda {

template <int D>
struct AttnConfig {
  static constexpr int kFwdWarps = portable_fwd_warps(D), kFwdBN = kKeyBlock, kDqWarps = kPortableDqWarps,
                       kDkvBMQ = portable_dkv_block_q(D);
};

template <int D, typename T>
cudaError_t run_fwd(const CodAttnParams& p, cudaStream_t s) {
  return launch_fwd<D, T, AttnConfig<D>::kFwdWarps, AttnConfig<D>::kFwdBN>(p, s);
}
// hopper: the dQ and dK/dV passes on the Hopper kernels (the delta and chain passes are shared).
template <int D, typename T>
cudaError_t run_bwd(const CodAttnParams& p, bool hopper, cudaStream_t s) {
  return launch_bwd<D, T, AttnConfig<D>::kDqWarps, AttnConfig<D>::kDkvBMQ>(p, hopper, s);
}

}  // namespace peagle::attention::cuda
