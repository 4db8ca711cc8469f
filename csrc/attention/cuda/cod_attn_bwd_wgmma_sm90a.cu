// The sm_90a (Hopper warpgroup MMA) dK/dV pass: instantiations and launch. CMakeLists.txt compiles
// the *_sm90a.cu files for arch=compute_90a,code=sm_90a ONLY (their own object library, when 90 is
// among PEAGLE_CUDA_ARCHS) and defines PEAGLE_ATTN_WGMMA for them and the other kernel files;
// compiled for any other target the kernel bodies are empty and nothing here is linked.
#include "attention/cuda/cod_attn_bwd_wgmma.cuh"

namespace peagle::attention {

bool cod_attn_hopper_built() {
#ifdef PEAGLE_ATTN_WGMMA
  return true;
#else
  return false;
#endif
}

bool cod_attn_wgmma_available() {
#ifdef PEAGLE_ATTN_WGMMA
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return false;
  return major == 9 && minor == 0;  // sm_90a code runs on compute capability 9.0 only
#else
  return false;
#endif
}

namespace cuda {

cudaError_t cod_attn_dkv_wgmma_launch(const CodAttnParams& p, AttnDtype dtype, cudaStream_t stream) {
  if (!cod_attn_wgmma_available()) return cudaErrorNotSupported;
  const bool bf = dtype == AttnDtype::kBF16;
  if (p.D == 128)
    return bf ? launch_dkv_wgmma<128, __nv_bfloat16>(p, stream) : launch_dkv_wgmma<128, __half>(p, stream);
  if (p.D == 64) return bf ? launch_dkv_wgmma<64, __nv_bfloat16>(p, stream) : launch_dkv_wgmma<64, __half>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace peagle::attention
