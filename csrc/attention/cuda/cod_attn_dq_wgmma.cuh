// COD attention backward, pass 2 (dQ) for Hopper: the Hopper family (attention_dispatch.h) runs
// this kernel instead of cod_attn_dq_kernel<D, T, 4, 64> (cod_attn_bwd.cuh), with the wgmma dK/dV
// pass (cod_attn_bwd_wgmma.cuh). Same function and outputs: the same query tiles (TileMap,
// find_query_tile, setup_query_tile with 64 rows), the same key blocks of 64 (key_block), the same
// P / dS elements (RowRanges mask or a `full` block, LSE, delta), the same chain keys
// (dq_chain_keys_sw128, a copy of its code for the B128 tiles) and the same dq write (scaled).
// Deterministic: no atomics, every dq element is summed by one thread in a fixed order. Not
// bitwise equal to the default: S, dP and dQ are summed by the tensor cores in another order.
// What differs is the matrix engine: one warpgroup (4 warps) per CTA of 64 query rows of one q
// head issues warpgroup MMAs (wgmma.mma_async, sm_90a) with Q / dO / K / V read by the tensor cores
// straight from shared memory through matrix descriptors (layout: cod_attn_wgmma.cuh), so no
// ldmatrix fragments occupy registers or issue slots (the mma.sync kernel: 255 registers,
// latency-bound). Per key block of BN = 64 keys:
//   S  = Q K^T    m64n64k16 x D/16, A = Q [64 q][D], B = K [64 keys][D], both K-major (SS)
//   dP = dO V^T   m64n64k16 x D/16, A = dO, B = V (SS)
//   P, dS elementwise in the accumulator fragments (warp w: query rows 16 w .. 16 w + 15, the
//   m16n8 C layout of the mma.sync kernel, so that code is unchanged), packed to 16-bit A fragments
//   dQ += dS K    m64nDk16 x 64/16, A = dS from registers, B = K [keys][D] read MN-major (RS),
//   the same form as the dK/dV kernel's dV += P^T dO.
// The key-block loop is software-pipelined (dQ += dS K left in flight; see the kernel).
#pragma once
#include <cstdint>

#include "attention/cuda/cod_attn_bwd.cuh"
#include "attention/cuda/cod_attn_wgmma.cuh"

namespace peagle::attention::cuda {

template <int D>
struct DqWgmmaConfig {
  static_assert(D % 64 == 0, "B128 tiles are made of 64-column panels");
  static constexpr int kBM = 64;  // query rows per CTA: the m64 of the warpgroup MMA (= cod_attn_dq_kernel's 4 x 16)
  static constexpr int kBN = 64;  // keys per block: as cod_attn_dq_kernel
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 128;
  static constexpr int kQTileBytes = kBM * D * 2;
  static constexpr int kKTileBytes = kBN * D * 2;                       // one stage of K (or V)
  static constexpr int kTileBytes = 2 * kQTileBytes + 4 * kKTileBytes;  // Q, dO + 2 stages of K, V
  static_assert(kQTileBytes % 1024 == 0 && kKTileBytes % 1024 == 0, "tiles must keep 1024-byte alignment");
  // + 1024: the dynamic shared memory base is aligned up to 1024 bytes in the kernel;
  // s_meta [5][BM], s_lse2 [BM], s_delta [BM], s_red [8 per warp]
  static constexpr int kSmemBytes = 1024 + kTileBytes + (7 * kBM + 8 * kWarps) * 4;
  // chain scratch: ds (float) and key index (int) per (row, slot)
  static constexpr int chain_bytes(int K) { return kBM * K * 8; }
};

// Dot product of row `row` of a B128 tile of ROWS rows in shared memory (cod_attn_wgmma.cuh)
// with a global row (16-byte aligned): dot_smem_global for this layout.
template <int D, typename T, int ROWS>
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

// The chain keys' dQ (<= K per query row, CUDA cores), added to the warp's dq fragments: a COPY of
// the chain block of cod_attn_dq_kernel (cod_attn_bwd.cuh) with the Q / dO rows read from the B128
// tiles. Not shared through a common function: inlining one into cod_attn_dq_kernel changed that
// kernel's PTX address arithmetic (and SASS), and the default path must stay byte-identical.
// Lanes take (row, slot) pairs: ds = p * (dO.v_c - delta), then the quad owning a row adds
// ds * k_c to its dQ columns (warp w: rows 16 w + g, + 8, columns 8 n + 2 t, + 1).
template <int D, typename T, int BM>
__device__ __forceinline__ void dq_chain_keys_sw128(const CodAttnParams& p, const QTile& qt, int hk, int64_t kld,
                                                    float sl2, const unsigned char* sQ, const unsigned char* sdO,
                                                    float* s_chain_s, int* s_chain_c, const float* s_lse2,
                                                    const float* s_delta, int lane, int warp, float (&dq)[D / 8][4]) {
  const int g = lane >> 2, t = lane & 3;
  const int K = p.K;
  float* cs = s_chain_s + warp * 16 * K;
  int* ci = s_chain_c + warp * 16 * K;
  const T* kb = static_cast<const T*>(p.k) + int64_t(hk) * D;
  const T* vb = static_cast<const T*>(p.v) + int64_t(hk) * D;
#pragma unroll 1
  for (int pi = lane; pi < 16 * K; pi += 32) {
    const int rl = pi / K, e = pi - rl * K;
    const int row = 16 * warp + rl;
    const int c = row < qt.rows ? chain_row(p.chain[int64_t(qt.row0 + row) * K + e], p.T) : -1;
    float ds = 0.f;
    if (c >= 0) {
      const float sv = dot_sw128_global<D, T, BM>(sQ, row, kb + int64_t(c) * kld);
      const float dp = dot_sw128_global<D, T, BM>(sdO, row, vb + int64_t(c) * kld);
      ds = fast_exp2(sv * sl2 - s_lse2[row]) * (dp - s_delta[row]);
    }
    cs[pi] = ds;
    ci[pi] = c;
  }
  __syncwarp();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int rl = g + 8 * r;
#pragma unroll 2
    for (int e = 0; e < K; ++e) {
      const int c = ci[rl * K + e];
      if (c < 0) continue;
      const float ds = cs[rl * K + e];
      const T* kr = kb + int64_t(c) * kld + 2 * t;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const float2 kv = Pack<T>::unpack(__ldg(reinterpret_cast<const unsigned int*>(kr + 8 * n)));
        dq[n][2 * r] = fmaf(ds, kv.x, dq[n][2 * r]);
        dq[n][2 * r + 1] = fmaf(ds, kv.y, dq[n][2 * r + 1]);
      }
    }
  }
}

// ---- pieces of the loop (wgmma rules as in cod_attn_fwd_wgmma.cuh).

// S = Q K^T and dP = dO V^T over the D / 16 k-steps (the first overwrites: scale-d = 0), one group.
template <int D, typename T, int BM, int BN>
__device__ __forceinline__ void dq_wgmma_issue_mma1(float (&s)[BN / 8][4], float (&dpv)[BN / 8][4], uint32_t sQa,
                                                    uint32_t sdOa, uint32_t kt, uint32_t vt) {
  wg::fence_operands(s);
  wg::fence_operands(dpv);
  wg::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    wg::wgmma_ss<BN, T>(s, wg::desc_kmajor<BM>(sQa, kk), wg::desc_kmajor<BN>(kt, kk), kk > 0);
    wg::wgmma_ss<BN, T>(dpv, wg::desc_kmajor<BM>(sdOa, kk), wg::desc_kmajor<BN>(vt, kk), kk > 0);
  }
  wg::wgmma_commit();
}

// dQ += dS K over the BN / 16 k-steps (B = the K tile read MN-major), one group.
template <int D, typename T, int BN>
__device__ __forceinline__ void dq_wgmma_issue_mma2(float (&dq)[D / 8][4], uint32_t (&a)[BN / 16][4], uint32_t kt) {
  wg::fence_operands(a);
  wg::fence_operands(dq);
  wg::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) wg::wgmma_rs<D, T>(dq, a[kk], wg::desc_mnmajor<BN>(kt, kk), 1);
  wg::wgmma_commit();
}

// dS = P (dP - delta) of one 16-key slice (accumulator n-tile n) of a key block into ds (MASKED:
// keys the row may not see give P = 0; otherwise the block is full). The same float operations as
// cod_attn_dq_kernel. Callers branch on `full` and instantiate both (see fwd_scale_mask_max: a
// per-score `full ||` is if-converted into the whole mask test on every block).
template <int BN, bool MASKED>
__device__ __forceinline__ void dq_wgmma_ds_ntile(const float (&s)[BN / 8][4], const float (&dpv)[BN / 8][4],
                                                  const BlockRowMask (&bm)[2], int n, float sl2, const float (&lse2)[2],
                                                  const float (&dlt)[2], float (&ds)[4]) {
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int r = x >> 1;
    const bool ok = !MASKED || bm[r].allows(8 * n + (x & 1));  // key j0 + 2 t + 8 n + (x & 1)
    const float pv = ok ? fast_exp2(s[n][x] * sl2 - lse2[r]) : 0.f;
    ds[x] = pv * (dpv[n][x] - dlt[r]);
  }
}

// dS of one key block packed into the RS A fragments a (MASKED as dq_wgmma_ds_ntile); s / dpv only read.
template <int BN, typename T, bool MASKED>
__device__ __forceinline__ void dq_wgmma_ds_pack_as(const float (&s)[BN / 8][4], const float (&dpv)[BN / 8][4],
                                                    const BlockRowMask (&bm)[2], float sl2, const float (&lse2)[2],
                                                    const float (&dlt)[2], uint32_t (&a)[BN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    float ds[2][4];  // accumulator n-tiles 2 kk, 2 kk + 1
    dq_wgmma_ds_ntile<BN, MASKED>(s, dpv, bm, 2 * kk, sl2, lse2, dlt, ds[0]);
    dq_wgmma_ds_ntile<BN, MASKED>(s, dpv, bm, 2 * kk + 1, sl2, lse2, dlt, ds[1]);
    a[kk][0] = Pack<T>::two(ds[0][0], ds[0][1]);
    a[kk][1] = Pack<T>::two(ds[0][2], ds[0][3]);
    a[kk][2] = Pack<T>::two(ds[1][0], ds[1][1]);
    a[kk][3] = Pack<T>::two(ds[1][2], ds[1][3]);
  }
}

// dS = P (dP - delta) of one key block packed into the RS A fragments a: the same float operations
// as cod_attn_dq_kernel (P, then P (dP - delta), rounded once by the pack); s / dpv only read:
// ptxas serializes the wgmmas of a loop that leaves a group pending across its back edge if
// ordinary code writes any wgmma accumulator in it (C7515).
template <int BN, typename T>
__device__ __forceinline__ void dq_wgmma_ds_pack(const float (&s)[BN / 8][4], const float (&dpv)[BN / 8][4],
                                                 const RowRanges (&rr)[2], bool full, int j0, int jend, int t,
                                                 float sl2, const float (&lse2)[2], const float (&dlt)[2],
                                                 uint32_t (&a)[BN / 16][4]) {
  if (full) {
    const BlockRowMask none[2] = {BlockRowMask(), BlockRowMask()};  // unread
    dq_wgmma_ds_pack_as<BN, T, false>(s, dpv, none, sl2, lse2, dlt, a);
  } else {
    const BlockRowMask bm[2] = {BlockRowMask(rr[0], j0, jend, BN, t), BlockRowMask(rr[1], j0, jend, BN, t)};
    dq_wgmma_ds_pack_as<BN, T, true>(s, dpv, bm, sl2, lse2, dlt, a);
  }
}

template <int D, typename T>
__global__ void __launch_bounds__(128, D == 64 ? 3 : 1)
    cod_attn_dq_wgmma_kernel(const CodAttnParams p, const TileMap tm) {
#if PEAGLE_WGMMA_DEVICE
  using Cfg = DqWgmmaConfig<D>;
  constexpr int BM = Cfg::kBM, BN = Cfg::kBN, NT = Cfg::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // B128 swizzle atoms must start on 1024-byte shared-memory boundaries (descriptor base offset 0)
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQa = base, sdOa = base + Cfg::kQTileBytes;  // B128 tiles [BM][D]
  const uint32_t sKa = base + 2 * Cfg::kQTileBytes;           // [2 stages] B128 tiles [BN][D]
  const uint32_t sVa = sKa + 2 * Cfg::kKTileBytes;            // [2 stages]
  const unsigned char* sQ = smem;                             // generic views (the chain keys' dot products)
  const unsigned char* sdO = smem + Cfg::kQTileBytes;
  int* s_meta = reinterpret_cast<int*>(smem + Cfg::kTileBytes);
  float* s_lse2 = reinterpret_cast<float*>(s_meta + 5 * BM);
  float* s_delta = s_lse2 + BM;
  int* s_red = reinterpret_cast<int*>(s_delta + BM);
  float* s_chain_s = reinterpret_cast<float*>(s_red + 8 * Cfg::kWarps);
  int* s_chain_c = reinterpret_cast<int*>(s_chain_s + BM * p.K);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int h = blockIdx.y, hk = h / p.group;
  const QTile qt = find_query_tile(p, tm, gridDim.x - 1 - blockIdx.x, BM);
  const TileKeys tk = setup_query_tile<BM, NT, BN>(p, qt, s_meta, s_red, tid);
  if (tid < BM) {
    const bool in = tid < qt.rows;
    const int64_t i = qt.row0 + tid;
    const bool valid = in && s_meta[4 * BM + tid];
    s_lse2[tid] = valid ? p.lse[int64_t(h) * p.T + i] * kLog2e : INFINITY;
    s_delta[tid] = valid ? p.delta[int64_t(h) * p.T + i] : 0.f;
  }

  const int64_t qld = int64_t(p.Hq) * D, kld = int64_t(p.Hkv) * D;
  const T* qbase = static_cast<const T*>(p.q) + int64_t(h) * D;
  const T* dobase = static_cast<const T*>(p.dout) + int64_t(h) * D;
  const T* rkbase = static_cast<const T*>(p.rk) + int64_t(hk) * D;
  const T* rvbase = static_cast<const T*>(p.rv) + int64_t(hk) * D;
  constexpr uint32_t kStageBytes = Cfg::kKTileBytes;

  wg::load_tile_sw128<BM, D, NT>(sQa, qbase, qld, qt.row0, int64_t(qt.row0) + qt.rows, tid);
  wg::load_tile_sw128<BM, D, NT>(sdOa, dobase, qld, qt.row0, int64_t(qt.row0) + qt.rows, tid);
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

  // dq: the m64nD accumulators of dQ += dS K (warp w: rows 16 w + g, + 8, columns 8 n + 2 t, + 1)
  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
  const RowRanges rr[2] = {row_ranges<BM>(s_meta, 16 * warp + g), row_ranges<BM>(s_meta, 16 * warp + g + 8)};
  const float lse2[2] = {s_lse2[16 * warp + g], s_lse2[16 * warp + g + 8]};
  const float dlt[2] = {s_delta[16 * warp + g], s_delta[16 * warp + g + 8]};
  const float sl2 = p.scale_log2;

  // ---- chain keys (CUDA cores, before the key blocks; the Q / dO rows from the B128 tiles)
  if (tk.any_chain)
    dq_chain_keys_sw128<D, T, BM>(p, qt, hk, kld, sl2, sQ, sdO, s_chain_s, s_chain_c, s_lse2, s_delta, lane, warp, dq);

  float s[BN / 8][4], dpv[BN / 8][4];
#pragma unroll
  for (int n = 0; n < BN / 8; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) s[n][x] = dpv[n][x] = 0.f;

  // ---- key blocks, pipelined
  {
    // Iteration b (stage(x) = x & 1 holds key block x's K and V):
    //   MMA2(b) issue                      dQ += dS(b) K(b): reads a, K stage(b); accumulates dq
    //   cp.async wait, proxy fence, barrier    block b + 1 (stage(b + 1)) visible to every thread
    //   MMA1(b + 1) issue                  S, dP of block b + 1: writes s, dpv (block b's dS was
    //                                      packed into a before MMA2(b) was issued)
    //   wait<1>                            MMA2(b) complete (groups complete in commit order; only
    //                                      MMA1(b + 1) may still run): dq, a free
    //   proxy fence, barrier               every warp's MMA2(b) complete, so stage(b) may be
    //                                      overwritten (its MMA1(b) reads completed before every
    //                                      warp's elementwise of b, before the previous barrier)
    //   copies of block b + 2 -> stage(b)
    //   wait<0>                            MMA1(b + 1) complete
    //   dS of block b + 1 packed into a
    // The prologue copies block 1 into stage 1 (unused so far) and runs MMA1(0) and its dS; the
    // last block's MMA2 is peeled off and waited for before the epilogue. No wgmma group is pending
    // across the loop's back edge and every wgmma issue / wait in the loop is unconditional:
    // otherwise ptxas serializes the wgmmas (-Xptxas -v warnings C7514 / C7515). Two stages. Per
    // block the values of an unpipelined loop: the same wgmma sequences on the same operands in the
    // same order, the same dS arithmetic.
    const int nb = tk.nblocks;
    auto copy_block = [&](int blk, uint32_t stage) {
      int j0, jend;
      key_block<BN>(tk, blk, j0, jend);
      wg::load_tile_sw128<BN, D, NT>(sKa + stage * kStageBytes, rkbase, kld, j0, jend, tid);
      wg::load_tile_sw128<BN, D, NT>(sVa + stage * kStageBytes, rvbase, kld, j0, jend, tid);
    };
    auto ds_pack = [&](int blk, uint32_t (&a)[BN / 16][4]) {
      int j0, jend;
      key_block<BN>(tk, blk, j0, jend);
      const bool full = j0 >= tk.lo_max && j0 + BN <= tk.hi_min && j0 + BN <= jend;
      dq_wgmma_ds_pack<BN, T>(s, dpv, rr, full, j0, jend, t, sl2, lse2, dlt, a);
    };
    uint32_t a[BN / 16][4];
    if (nb > 0) {
      if (nb > 1) copy_block(1, 1);
      cp_async_commit();
      dq_wgmma_issue_mma1<D, T, BM, BN>(s, dpv, sQa, sdOa, sKa, sVa);  // stage 0: the prologue barrier
      wg::wgmma_wait<0>();
      wg::fence_operands(s);
      wg::fence_operands(dpv);
      ds_pack(0, a);
#pragma unroll 1
      for (int b = 0; b + 1 < nb; ++b) {
        const uint32_t stage = b & 1, nstage = stage ^ 1;
        dq_wgmma_issue_mma2<D, T, BN>(dq, a, sKa + stage * kStageBytes);
        cp_async_wait<0>();
        wg::fence_proxy_async_smem();
        __syncthreads();
        dq_wgmma_issue_mma1<D, T, BM, BN>(s, dpv, sQa, sdOa, sKa + nstage * kStageBytes, sVa + nstage * kStageBytes);
        wg::wgmma_wait<1>();  // MMA2(b) complete; MMA1(b + 1) may run on
        wg::fence_operands(dq);
        wg::fence_operands(a);
        // every warp's MMA2(b) reads of K stage(b) complete before the copies overwrite it (in the
        // order wgmma completion, fence.proxy.async, barrier, cp.async)
        wg::fence_proxy_async_smem();
        __syncthreads();
        if (b + 2 < nb) copy_block(b + 2, stage);
        cp_async_commit();
        wg::wgmma_wait<0>();  // MMA1(b + 1) complete
        wg::fence_operands(s);
        wg::fence_operands(dpv);
        ds_pack(b + 1, a);
      }
      dq_wgmma_issue_mma2<D, T, BN>(dq, a, sKa + ((nb - 1) & 1) * kStageBytes);
      wg::wgmma_wait<0>();
      wg::fence_operands(dq);
      wg::fence_operands(a);
      cp_async_wait<0>();  // an empty group: nothing in flight at the epilogue
    }
  }

  const float scale = p.scale;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 16 * warp + g + 8 * r;
    if (row < qt.rows) {
      const int64_t i = qt.row0 + row;
      T* o = static_cast<T*>(p.dq) + i * qld + int64_t(h) * D + 2 * t;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<uint32_t*>(o + 8 * n) = Pack<T>::two(dq[n][2 * r] * scale, dq[n][2 * r + 1] * scale);
    }
  }
#endif  // PEAGLE_WGMMA_DEVICE
}

// Launch of the wgmma dQ pass (grid: query tiles x q heads, the tiles visited in reverse as in
// cod_attn_dq_kernel), on `stream`.
template <int D, typename T>
cudaError_t launch_dq_wgmma(const CodAttnParams& p, cudaStream_t stream) {
  using Cfg = DqWgmmaConfig<D>;
  TileMap tm;
  const int ntiles = make_tile_map(p, Cfg::kBM, tm);
  if (ntiles == 0) return cudaSuccess;
  // (no FlashAttention-3-style overlap of MMA1(b + 1) with MMA2(b) here: it needs a third K stage,
  // 112 KiB of tiles at D = 128, one CTA per SM instead of two)
  auto kernel = cod_attn_dq_wgmma_kernel<D, T>;
  const int smem = Cfg::kSmemBytes + Cfg::chain_bytes(p.K);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  kernel<<<dim3(ntiles, p.Hq), Cfg::kThreads, smem, stream>>>(p, tm);
  return cudaGetLastError();
}

}  // namespace peagle::attention::cuda
