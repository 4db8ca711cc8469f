// The sm_90a (Hopper warpgroup MMA) forward: instantiations and launch. Compiled like
// cod_attn_bwd_wgmma_sm90a.cu (CMakeLists.txt: every *_sm90a.cu, for arch=compute_90a,code=sm_90a
// ONLY, when 90 is among PEAGLE_CUDA_ARCHS); compiled for any other target the kernel bodies are
// empty and nothing here is linked. cod_attn_wgmma_available() is defined in
// cod_attn_bwd_wgmma_sm90a.cu.
#include "attention/cuda/cod_attn_fwd_wgmma.cuh"

namespace peagle::attention::cuda {

// 64 query rows x 64 keys per block at both head dims: D = 128 needs 64 accumulator registers for
// O and 32 for S (Q stays in shared memory), 80 KiB of tiles (+ chain scratch): two CTAs per SM.
cudaError_t cod_attn_fwd_wgmma_launch(const CodAttnParams& p, AttnDtype dtype, cudaStream_t stream) {
  if (!cod_attn_wgmma_available()) return cudaErrorNotSupported;
  const bool bf = dtype == AttnDtype::kBF16;
  if (p.D == 128)
    return bf ? launch_fwd_wgmma<128, __nv_bfloat16>(p, stream) : launch_fwd_wgmma<128, __half>(p, stream);
  if (p.D == 64) return bf ? launch_fwd_wgmma<64, __nv_bfloat16>(p, stream) : launch_fwd_wgmma<64, __half>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace peagle::attention::cuda
