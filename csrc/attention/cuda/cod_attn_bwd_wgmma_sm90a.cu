// The sm_90a (Hopper warpgroup MMA) dK/dV pass of PEAGLE_ATTN_BWD=wgmma: instantiations and
// dispatch. CMakeLists.txt compiles the *_sm90a.cu files for arch=compute_90a,code=sm_90a ONLY
// (their own object library, when 90 is among PEAGLE_CUDA_ARCHS) and defines PEAGLE_ATTN_WGMMA
// for them and the other kernel files; compiled for any other target (e.g. CI's nvcc -arch=sm_90
// check), the kernel bodies are empty and nothing here is linked.
#include "attention/cuda/cod_attn_bwd_wgmma.cuh"

namespace peagle::attention {

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

// Query block per head dim: at D = 128, BMQ = 32 by default (206 registers, 68 KiB of shared
// memory: the dK, dV accumulators take 128 registers, as in the mma.sync kernel) or 64 with
// p.bwd_variant == kBwdWgmma64 (255 registers, no spills, 101 KiB; a quarter less shared-memory traffic per
// query: K / V are read once per 64 queries); BMQ = 64 at D = 64 (174 registers).
cudaError_t cod_attn_dkv_wgmma_launch(const CodAttnParams& p, AttnDtype dtype, cudaStream_t stream) {
  if (!cod_attn_wgmma_available()) return cudaErrorNotSupported;
  const bool bf = dtype == AttnDtype::kBF16;
  if (p.D == 128 && p.bwd_variant == kBwdWgmma64)
    return bf ? launch_dkv_wgmma<128, __nv_bfloat16, 64>(p, stream) : launch_dkv_wgmma<128, __half, 64>(p, stream);
  if (p.D == 128)
    return bf ? launch_dkv_wgmma<128, __nv_bfloat16, 32>(p, stream) : launch_dkv_wgmma<128, __half, 32>(p, stream);
  if (p.D == 64)
    return bf ? launch_dkv_wgmma<64, __nv_bfloat16, 64>(p, stream) : launch_dkv_wgmma<64, __half, 64>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace peagle::attention
