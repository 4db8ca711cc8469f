// Kernel configurations per head dim (one place, so the per-file instantiations and the
// dispatcher agree): forward 16 query rows per warp, key blocks of 64, 8 warps at D = 64 and 4 at
// D = 128 (4 warps measured 1.04-1.19x faster than 8 at D = 128 on an H200, bench/RESULTS.md);
// dQ 4 warps; dK/dV query blocks of 64 rows (32 for D = 128 to stay within 255 registers).
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
  static constexpr int kFwdWarps = 4, kFwdBN = 64, kDqWarps = 4, kDkvBMQ = 32;
};

// Forward CTA shapes, picked per call by the glue's env reads (tune on the GPU):
//   p.fwd_mf (PEAGLE_ATTN_FWD_MF, default 1): m16 fragments per warp (1: 16 rows per warp,
//     2: 32 rows per warp, each K/V fragment read from shared memory feeds two mmas);
//   p.fwd_warps (PEAGLE_ATTN_FWD_WARPS, 0 = unset): MF = 1: 8 warps (BM=128, one CTA per SM)
//     or 4 (BM=64, two CTAs per SM overlap each other's prologue/epilogue), default kFwdWarps;
//     MF = 2: 4 warps (default, BM=128, FA2's hdim-128 shape) or 8 (BM=256).
//     MF = 2 with 8 warps needs kBM * K * 8 bytes of chain scratch on top of 128 KiB of tiles at
//     D = 128: when that exceeds the device's shared memory per block (K > 46 on sm_90), it
//     runs with 4 warps.
template <int D, int NWARPS, int BN, int MF>
bool fwd_smem_fits(int K) {
  int dev = 0, max_smem = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return false;
  using Cfg = FwdConfig<D, NWARPS, BN, MF>;
  return Cfg::kSmemBytes + Cfg::chain_bytes(K) <= max_smem;
}

template <int D, typename T>
cudaError_t run_fwd(const CodAttnParams& p, cudaStream_t s) {
  constexpr int BN = AttnConfig<D>::kFwdBN;
  if (p.fwd_mf == 2) {
    if (p.fwd_warps == 8 && fwd_smem_fits<D, 8, BN, 2>(p.K)) return launch_fwd<D, T, 8, BN, 2>(p, s);
    return launch_fwd<D, T, 4, BN, 2>(p, s);
  }
  const int warps = p.fwd_warps != 0 ? p.fwd_warps : AttnConfig<D>::kFwdWarps;
  if (warps == 4) return launch_fwd<D, T, 4, BN, 1>(p, s);
  return launch_fwd<D, T, 8, BN, 1>(p, s);
}
template <int D, typename T>
cudaError_t run_bwd(const CodAttnParams& p, cudaStream_t s) {
  return launch_bwd<D, T, AttnConfig<D>::kDqWarps, AttnConfig<D>::kDkvBMQ>(p, s);
}

}  // namespace peagle::attention::cuda
