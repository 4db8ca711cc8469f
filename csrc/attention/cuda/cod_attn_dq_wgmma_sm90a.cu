// The sm_90a (Hopper warpgroup MMA) dQ pass: instantiations and launch (cod_attn_dq_wgmma.cuh).
// Compiled like cod_attn_bwd_wgmma_sm90a.cu: for arch=compute_90a,code=sm_90a ONLY, in the sm_90a
// object library (CMakeLists.txt globs *_sm90a.cu), so the kernel bodies are empty for any other
// target and nothing here is linked then (cod_attn_launch.cu defines the "not supported" fallback
// instead). Its own file so it compiles in parallel with the dK/dV one.
#include "attention/cuda/cod_attn_dq_wgmma.cuh"

namespace peagle::attention::cuda {

// One configuration per head dim: 64 query rows, 64-key blocks, as the mma.sync dQ kernel.
cudaError_t cod_attn_dq_wgmma_launch(const CodAttnParams& p, AttnDtype dtype, cudaStream_t stream) {
  if (!cod_attn_wgmma_available()) return cudaErrorNotSupported;
  const bool bf = dtype == AttnDtype::kBF16;
  if (p.D == 128) return bf ? launch_dq_wgmma<128, __nv_bfloat16>(p, stream) : launch_dq_wgmma<128, __half>(p, stream);
  if (p.D == 64) return bf ? launch_dq_wgmma<64, __nv_bfloat16>(p, stream) : launch_dq_wgmma<64, __half>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace peagle::attention::cuda
