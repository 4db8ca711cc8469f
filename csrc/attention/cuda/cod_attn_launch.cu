// COD attention launchers: the metadata build and the (head dim, dtype) dispatch of the
// forward and backward kernels (instantiated in cod_attn_{fwd,bwd}_d{64,128}.cu).
#include <cub/device/device_scan.cuh>

#include "attention/attention_kernels.h"
#include "attention/cuda/cod_attn_configs.cuh"

namespace peagle::attention {
namespace cuda {

extern template cudaError_t run_fwd<64, __nv_bfloat16>(const CodAttnParams&, cudaStream_t);
extern template cudaError_t run_fwd<64, __half>(const CodAttnParams&, cudaStream_t);
extern template cudaError_t run_fwd<128, __nv_bfloat16>(const CodAttnParams&, cudaStream_t);
extern template cudaError_t run_fwd<128, __half>(const CodAttnParams&, cudaStream_t);
extern template cudaError_t run_bwd<64, __nv_bfloat16>(const CodAttnParams&, bool, cudaStream_t);
extern template cudaError_t run_bwd<64, __half>(const CodAttnParams&, bool, cudaStream_t);
extern template cudaError_t run_bwd<128, __nv_bfloat16>(const CodAttnParams&, bool, cudaStream_t);
extern template cudaError_t run_bwd<128, __half>(const CodAttnParams&, bool, cudaStream_t);

namespace {

struct MaxOp {
  __device__ __forceinline__ int operator()(int a, int b) const { return a > b ? a : b; }
};

// run_start[p] (before the max-scan): p where a run of equal document ids starts, else 0.
__global__ void run_start_flags_kernel(const int32_t* doc, int n, int32_t* out) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p < n) out[p] = (p == 0 || doc[p] != doc[p - 1]) ? p : 0;
}

struct Offsets {
  int64_t v[kMaxChain + 1];
};

// One thread per (token i, chain slot e): slot 0 also writes the token's ranges.
__global__ void metadata_kernel(const int32_t* anchor, const int32_t* depth, const int32_t* doc,
                                const int32_t* run_start, int T, int N, int K, Offsets off, bool cross, int64_t window,
                                int64_t sink, int32_t* ranges, int32_t* chain, int32_t* rchain) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(T) * K) return;
  const int64_t i = idx / K;
  const int e = static_cast<int>(idx % K);
  const int32_t a_raw = anchor[i];
  const bool in_seq = a_raw >= 0 && a_raw < N;  // malformed layouts: treat as padding, never read out of bounds
  const int32_t a = in_seq ? a_raw : 0;
  const int32_t d = depth[i];
  TokenRanges r = token_ranges(a, d, in_seq ? doc[a] : -1, run_start[a], window, sink);
  if (e == 0) {
    ranges[kLo * int64_t(T) + i] = r.lo;
    ranges[kHi * int64_t(T) + i] = r.hi;
    ranges[kSinkLo * int64_t(T) + i] = r.slo;
    ranges[kSinkHi * int64_t(T) + i] = r.shi;
    ranges[kValid * int64_t(T) + i] = r.valid;
  }
  const int32_t c = (d >= 0 && d < K) ? chain_key(anchor, off.v[e], off.v[e + 1], a, d, e, !cross, r) : -1;
  chain[idx] = c;
  if (c >= 0) rchain[int64_t(c) * K + d] = static_cast<int32_t>(i);
}

}  // namespace
}  // namespace cuda

size_t cod_attn_metadata_workspace(int N) {
  size_t scan_bytes = 0;
  cub::DeviceScan::InclusiveScan(nullptr, scan_bytes, static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                 cuda::MaxOp{}, N);
  return ((scan_bytes + 255) / 256) * 256 + 2 * ((static_cast<size_t>(N) * sizeof(int32_t) + 255) / 256) * 256;
}

void cod_attn_metadata_launch(const int32_t* anchor, const int32_t* depth, const int32_t* document_ids, int T, int N,
                              const int64_t* depth_offsets, int K, bool cross, int64_t window, int64_t sink,
                              int32_t* ranges, int32_t* chains, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  if (T == 0) return;
  int32_t* rchain = chains + int64_t(T) * K;
  cudaMemsetAsync(rchain, 0xff, sizeof(int32_t) * int64_t(T) * K, stream);  // -1
  size_t scan_bytes = 0;
  cub::DeviceScan::InclusiveScan(nullptr, scan_bytes, static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                 cuda::MaxOp{}, N);
  const size_t scan_padded = ((scan_bytes + 255) / 256) * 256;
  // flags and run_start are separate buffers (no reliance on an in-place scan)
  const size_t n_padded = ((static_cast<size_t>(N) * sizeof(int32_t) + 255) / 256) * 256;
  int32_t* flags = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + scan_padded);
  int32_t* run_start = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + scan_padded + n_padded);
  if (N > 0) {
    cuda::run_start_flags_kernel<<<(N + 255) / 256, 256, 0, stream>>>(document_ids, N, flags);
    cub::DeviceScan::InclusiveScan(workspace, scan_bytes, flags, run_start, cuda::MaxOp{}, N, stream);
  }
  cuda::Offsets off;
  for (int e = 0; e <= K; ++e) off.v[e] = depth_offsets[e];
  const int64_t n = int64_t(T) * K;
  cuda::metadata_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      anchor, depth, document_ids, run_start, T, N, K, off, cross, window, sink, ranges, chains, rchain);
  (void)workspace_bytes;
}

#ifndef PEAGLE_ATTN_WGMMA
// This build has no sm_90a kernels (90 is not among PEAGLE_CUDA_ARCHS, see CMakeLists.txt): the
// dispatch never picks them, and the launchers refuse them.
bool cod_attn_hopper_built() { return false; }
bool cod_attn_wgmma_available() { return false; }
namespace cuda {
cudaError_t cod_attn_dkv_wgmma_launch(const CodAttnParams&, AttnDtype, cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t cod_attn_dq_wgmma_launch(const CodAttnParams&, AttnDtype, cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t cod_attn_fwd_wgmma_launch(const CodAttnParams&, AttnDtype, cudaStream_t) { return cudaErrorNotSupported; }
}  // namespace cuda
#endif

cudaError_t cod_attn_fwd_launch(const CodAttnParams& p, AttnDtype dtype, AttnKernelFamily family, cudaStream_t stream) {
  const bool bf = dtype == AttnDtype::kBF16;
  if (family == AttnKernelFamily::kHopper) return cuda::cod_attn_fwd_wgmma_launch(p, dtype, stream);
  if (family != AttnKernelFamily::kPortable) return cudaErrorInvalidValue;
  if (p.D == 64) return bf ? cuda::run_fwd<64, __nv_bfloat16>(p, stream) : cuda::run_fwd<64, __half>(p, stream);
  if (p.D == 128) return bf ? cuda::run_fwd<128, __nv_bfloat16>(p, stream) : cuda::run_fwd<128, __half>(p, stream);
  return cudaErrorInvalidValue;
}

cudaError_t cod_attn_bwd_launch(const CodAttnParams& p, AttnDtype dtype, AttnKernelFamily family, cudaStream_t stream) {
  const bool bf = dtype == AttnDtype::kBF16;
  if (family != AttnKernelFamily::kHopper && family != AttnKernelFamily::kPortable) return cudaErrorInvalidValue;
  const bool hopper = family == AttnKernelFamily::kHopper;
  if (hopper && !cod_attn_wgmma_available()) return cudaErrorNotSupported;  // before launching anything
  if (p.D == 64)
    return bf ? cuda::run_bwd<64, __nv_bfloat16>(p, hopper, stream) : cuda::run_bwd<64, __half>(p, hopper, stream);
  if (p.D == 128)
    return bf ? cuda::run_bwd<128, __nv_bfloat16>(p, hopper, stream) : cuda::run_bwd<128, __half>(p, hopper, stream);
  return cudaErrorInvalidValue;
}

}  // namespace peagle::attention
