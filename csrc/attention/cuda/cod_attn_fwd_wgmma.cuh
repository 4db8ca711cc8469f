// COD attention forward for Hopper: PEAGLE_ATTN_FWD=wgmma (sm_90a warpgroup MMAs).
// Same function and outputs as cod_attn_fwd_kernel (cod_attn_fwd.cuh) up to fp32 summation
// order: the same query tiles (TileMap / find_query_tile, tiles of 64 rows), the same per-tile
// key spans and blocks of 64 keys (setup_query_tile / key_block, `full` blocks unmasked), the
// same chain-key fold, online softmax and epilogue (fwd_chain_keys / fwd_softmax_fragment /
// fwd_store_row, shared with that kernel: LSE natural log, +inf and zero output for rows without
// keys, NaN propagation). What differs is the matrix engine: CTA = one warpgroup (4 warps) over
// 64 query rows of one q head; per key block (layout and descriptors: cod_attn_wgmma.cuh)
//   S  = Q K^T  m64nBNk16 x D/16, A = Q [64][D], B = K [BN][D], both K-major B128 tiles (SS)
//   P  = online softmax of S in the accumulators; warp w holds rows 16 w .. 16 w + 15 in the
//        mma.sync C-fragment layout, i.e. exactly the MF = 1 fragments of cod_attn_fwd_kernel
//   O += P V    m64nDk16 x BN/16, A = P packed from the accumulators (RS), B = V [BN][D] read
//        MN-major (the reduction runs over the tile's rows), as dV += P^T dO in the wgmma dK/dV
// so Q / K / V are read by the tensor cores straight from shared memory (no ldmatrix, no Q
// fragments in registers). K / V are double-buffered with cp.async as in the mma.sync kernel.
#pragma once
#include <cmath>
#include <cstdint>

#include "attention/cuda/cod_attn_fwd.cuh"
#include "attention/cuda/cod_attn_wgmma.cuh"

namespace peagle::attention::cuda {

template <int D, int BN>
struct FwdWgmmaConfig {
  static_assert(D % 64 == 0 && BN == 64, "wgmma forward tile shapes (wgmma_ss<64> for S, wgmma_rs<D> for O)");
  static constexpr int kBM = 64;  // query rows per CTA: the m64 of the warpgroup MMA
  static constexpr int kThreads = 128;
  static constexpr int kQTileBytes = kBM * D * 2;
  static constexpr int kKVTileBytes = BN * D * 2;  // one stage of K (or V)
  static constexpr int kTileBytes = kQTileBytes + 4 * kKVTileBytes;  // Q + 2 stages of K and V
  static_assert(kQTileBytes % 1024 == 0 && kKVTileBytes % 1024 == 0, "tiles must keep 1024-byte alignment");
  // + 1024: the dynamic shared memory base is aligned up to 1024 bytes in the kernel;
  // 5 kBM ints of row ranges, 8 per warp of setup_query_tile's reduction
  static constexpr int kSmemBytes = 1024 + kTileBytes + (5 * kBM + 8 * 4) * 4;
  // + chain scores and key rows: kBM * K floats and ints (K known at launch)
  static constexpr int chain_bytes(int K) { return kBM * K * 8; }
};

// Dot product of row `row` of a [ROWS][D] B128 tile (cod_attn_wgmma.cuh layout; generic shared
// pointer `tile`) with a global row (16-byte aligned).
template <int ROWS, int D, typename T>
__device__ __forceinline__ float dot_sw128_global(const unsigned char* tile, int row, const T* grow) {
  const uint4* g = reinterpret_cast<const uint4*>(grow);
  float s = 0.f;
#pragma unroll
  for (int ch = 0; ch < D / 8; ++ch) {
    const uint4 gv = __ldg(g + ch);
    const uint4 sv = *reinterpret_cast<const uint4*>(tile + wg::sw128_offset<ROWS>(row, ch));
    s += dot8<T>(sv, gv);
  }
  return s;
}

template <int D, typename T, int BN>
__global__ void __launch_bounds__(128, 1) cod_attn_fwd_wgmma_kernel(const CodAttnParams p, const TileMap tm) {
#if PEAGLE_WGMMA_DEVICE
  using Cfg = FwdWgmmaConfig<D, BN>;
  constexpr int BM = Cfg::kBM, NT = Cfg::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // B128 swizzle atoms must start on 1024-byte shared-memory boundaries (descriptor base offset 0)
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQa = base;                              // B128 tile [BM][D]
  const uint32_t sKa = base + Cfg::kQTileBytes;           // [2 stages] B128 tiles [BN][D]
  const uint32_t sVa = sKa + 2 * Cfg::kKVTileBytes;       // [2 stages]
  int* s_meta = reinterpret_cast<int*>(smem + Cfg::kTileBytes);  // [5][BM]
  int* s_red = s_meta + 5 * BM;                                  // [4 warps][8]
  float* s_chain_s = reinterpret_cast<float*>(s_red + 8 * 4);
  int* s_chain_c = reinterpret_cast<int*>(s_chain_s + BM * p.K);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int h = blockIdx.y, hk = h / p.group;
  const QTile qt = find_query_tile(p, tm, gridDim.x - 1 - blockIdx.x, BM);
  const TileKeys tk = setup_query_tile<BM, NT, BN>(p, qt, s_meta, s_red, tid);
  // warp w owns tile rows [16 w, 16 w + 16) of every accumulator (the wgmma m64 fragment layout);
  // this thread holds rows wrow0 + g (r = 0) and wrow0 + g + 8 (r = 1).
  const int wrow0 = 16 * warp;

  const int64_t qld = int64_t(p.Hq) * D, kld = int64_t(p.Hkv) * D;
  const T* qbase = static_cast<const T*>(p.q) + int64_t(h) * D;
  const T* rkbase = static_cast<const T*>(p.rk) + int64_t(hk) * D;
  const T* rvbase = static_cast<const T*>(p.rv) + int64_t(hk) * D;
  constexpr uint32_t kStageBytes = Cfg::kKVTileBytes;

  wg::load_tile_sw128<BM, D, NT>(sQa, qbase, qld, qt.row0, int64_t(qt.row0) + qt.rows, tid);
  if (tk.nblocks > 0) {
    int j0, jend;
    key_block<BN>(tk, 0, j0, jend);
    wg::load_tile_sw128<BN, D, NT>(sKa, rkbase, kld, j0, jend, tid);
    wg::load_tile_sw128<BN, D, NT>(sVa, rvbase, kld, j0, jend, tid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  wg::fence_proxy_async_smem();  // the cp.async data is read by wgmma (async proxy)
  __syncthreads();

  // MF = 1 shaped state, so the helpers shared with cod_attn_fwd_kernel apply unchanged
  float acc[1][D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[0][n][0] = acc[0][n][1] = acc[0][n][2] = acc[0][n][3] = 0.f;
  float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.f, 0.f}};
  const RowRanges rr[2] = {row_ranges<BM>(s_meta, wrow0 + g), row_ranges<BM>(s_meta, wrow0 + g + 8)};
  const float sl2 = p.scale_log2;

  // ---- chain keys (Q rows read from the B128 tile with ordinary shared loads)
  if (tk.any_chain)
    fwd_chain_keys<D, T, 1>(p, qt, hk, warp, lane, g, t, wrow0, kld, sl2, s_chain_s, s_chain_c,
                            [&](int row, const T* grow) { return dot_sw128_global<BM, D, T>(smem, row, grow); },
                            acc, m, l);

  // S accumulators: the first k-step of each block overwrites them (scale-d = 0)
  float s[BN / 8][4];
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;

  // ---- key blocks
#pragma unroll 1
  for (int b = 0; b < tk.nblocks; ++b) {
    const int stage = b & 1;
    if (b + 1 < tk.nblocks) {
      int nj0, njend;
      key_block<BN>(tk, b + 1, nj0, njend);
      wg::load_tile_sw128<BN, D, NT>(sKa + (stage ^ 1) * kStageBytes, rkbase, kld, nj0, njend, tid);
      wg::load_tile_sw128<BN, D, NT>(sVa + (stage ^ 1) * kStageBytes, rvbase, kld, nj0, njend, tid);
    }
    cp_async_commit();
    int j0, jend;
    key_block<BN>(tk, b, j0, jend);
    const uint32_t kt = sKa + stage * kStageBytes, vt = sVa + stage * kStageBytes;

    // S = Q K^T: rows = the 64 queries, columns = the BN keys
    wg::fence_operands(s);
    wg::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wg::wgmma_ss<BN, T>(s, wg::desc_kmajor<BM>(sQa, kk), wg::desc_kmajor<BN>(kt, kk), kk > 0);
    wg::wgmma_commit();
    wg::wgmma_wait<0>();
    wg::fence_operands(s);

    const bool full = j0 >= tk.lo_max && j0 + BN <= tk.hi_min && j0 + BN <= jend;
    fwd_softmax_fragment<D, BN>(s, acc[0], m[0], l[0], rr, full, j0, jend, t, sl2);

    // O += P V: A = P from the accumulators (n-tiles 2 kq, 2 kq + 1 = A columns 16 kq .. 16 kq +
    // 15, the m16n8k16 A-fragment packing of the mma.sync kernel), B = the V stage read MN-major
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kq = 0; kq < BN / 16; ++kq) {
      pa[kq][0] = Pack<T>::two(s[2 * kq][0], s[2 * kq][1]);
      pa[kq][1] = Pack<T>::two(s[2 * kq][2], s[2 * kq][3]);
      pa[kq][2] = Pack<T>::two(s[2 * kq + 1][0], s[2 * kq + 1][1]);
      pa[kq][3] = Pack<T>::two(s[2 * kq + 1][2], s[2 * kq + 1][3]);
    }
    // acc was rescaled (and, before the first block, filled by the chain fold) by ordinary code
    wg::fence_operands(pa);
    wg::fence_operands(acc[0]);
    wg::wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < BN / 16; ++kq) wg::wgmma_rs<D, T>(acc[0], pa[kq], wg::desc_mnmajor<BN>(vt, kq), 1);
    wg::wgmma_commit();
    // The next block's softmax rescales acc and overwrites s (and, after the barrier below, the
    // next copies overwrite this stage): wait for this batch, which reads pa and the stage.
    wg::wgmma_wait<0>();
    wg::fence_operands(acc[0]);
    wg::fence_operands(pa);
    cp_async_wait<0>();
    wg::fence_proxy_async_smem();
    __syncthreads();
  }

  // ---- epilogue
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[0][r]);
    const int row = wrow0 + g + 8 * r;
    if (row < qt.rows) fwd_store_row<D, T>(p, acc[0], r, m[0][r], lsum, rr[r].valid, qt.row0 + row, h, t, qld);
  }
#endif  // PEAGLE_WGMMA_DEVICE
}

// Launch of the wgmma forward (grid: query tiles of 64 rows x q heads), on `stream`.
template <int D, typename T>
cudaError_t launch_fwd_wgmma(const CodAttnParams& p, cudaStream_t stream) {
  constexpr int BN = 64;
  using Cfg = FwdWgmmaConfig<D, BN>;
  TileMap tm;
  const int ntiles = make_tile_map(p, Cfg::kBM, tm);
  if (ntiles == 0 || p.Hq == 0) return cudaSuccess;
  auto kernel = cod_attn_fwd_wgmma_kernel<D, T, BN>;
  const int smem = Cfg::kSmemBytes + Cfg::chain_bytes(p.K);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(ntiles, p.Hq), Cfg::kThreads, smem, stream>>>(p, tm);
  return cudaGetLastError();
}

}  // namespace peagle::attention::cuda
