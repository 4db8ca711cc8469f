// COD attention backward, pass 3 (dK/dV of the range keys) for Hopper (the Hopper family of
// attention_dispatch.h). Same function and outputs as cod_attn_dkv_kernel (cod_attn_bwd.cuh): the same
// query-run enumeration (two spans per depth by binary search over the range bounds, `locate` /
// `issue`), the same P^T / dS^T elements (RowRanges mask or a `full` block, LSE, delta), the same
// dk (scaled) / dv writes for the range keys; the delta, dQ and chain passes are the default
// ones (launch_bwd). What differs is the matrix engine: one warpgroup (4 warps) per CTA of 64
// keys issues warpgroup MMAs (wgmma.mma_async, sm_90a) with Q / dO / K / V read by the tensor
// cores straight from shared memory through matrix descriptors, so each Q / dO tile is read once
// per warpgroup instead of once per warp through ldmatrix.
// Per query block of BMQ = 64 rows (layout and descriptors: cod_attn_wgmma.cuh):
//   S^T  = K Q^T   m64nBMQk16 x D/16, A = K, B = Q, both K-major in shared memory (SS)
//   dP^T = V dO^T  m64nBMQk16 x D/16, A = V, B = dO (SS)
//   P^T, dS^T elementwise in the accumulator fragments (warp w: keys 16 w .. 16 w + 15, as in the
//   mma.sync kernel), packed to 16-bit A fragments
//   dV  += P^T dO  m64nDk16 x BMQ/16, A = P^T from registers, B = dO MN-major (RS)
//   dK  += dS^T Q  m64nDk16 x BMQ/16, A = dS^T from registers, B = Q MN-major (RS)
// The query-block loop is software-pipelined, as far as the registers allow at each head dim
// (see the kernel).
#pragma once
#include <climits>
#include <cstdint>

#include "attention/attention_dispatch.h"
#include "attention/cuda/cod_attn_bwd.cuh"
#include "attention/cuda/cod_attn_wgmma.cuh"

namespace peagle::attention::cuda {

// Query rows per block: 64 (at D = 128: 255 registers, no spills, 101 KiB of shared memory; K / V
// are read once per 64 queries). STAGES: stages of Q, dO and row metadata: 2 at D = 128, 3 at
// D = 64, whose loop has three query blocks in use at once (MMA2 of block it, MMA1 of block it + 1,
// the copies of block it + 2).
template <int D>
struct DkvWgmmaConfig {
  static_assert(D == 64 || D == 128, "wgmma dK/dV tile shapes");
  static constexpr int BMQ = kHopperBlockQ;
  static constexpr int STAGES = D == 128 ? 2 : 3;
  static constexpr int kBN = kKeyBlock;  // keys per CTA: the m64 of the warpgroup MMA
  static constexpr int kThreads = 128;
  static constexpr int kStages = STAGES;
  static constexpr int kMetaFields = 7;  // lo, hi, slo, shi, valid, lse, delta (copied with cp.async)
  static constexpr int kKTileBytes = kBN * D * 2;
  static constexpr int kQTileBytes = BMQ * D * 2;                                // one stage of Q (or dO)
  static constexpr int kTileBytes = 2 * kKTileBytes + 2 * STAGES * kQTileBytes;  // K, V + the stages of Q, dO
  static_assert(kKTileBytes % 1024 == 0 && kQTileBytes % 1024 == 0, "tiles must keep 1024-byte alignment");
  // + 1024: the dynamic shared memory base is aligned up to 1024 bytes in the kernel
  static constexpr int kSmemBytes = 1024 + kTileBytes + (STAGES * kMetaFields * BMQ + 6 * kMaxChain + 1) * 4;
};

// ---- pieces of the loops (wgmma rules as in cod_attn_fwd_wgmma.cuh).

// S^T = K Q^T and dP^T = V dO^T over the D / 16 k-steps (the first overwrites: scale-d = 0), one group.
template <int D, typename T, int BMQ, int BN>
__device__ __forceinline__ void dkv_wgmma_issue_mma1(float (&st)[BMQ / 8][4], float (&dpt)[BMQ / 8][4], uint32_t sKa,
                                                     uint32_t sVa, uint32_t qt, uint32_t dot) {
  wg::fence_operands(st);
  wg::fence_operands(dpt);
  wg::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    wg::wgmma_ss<BMQ, T>(st, wg::desc_kmajor<BN>(sKa, kk), wg::desc_kmajor<BMQ>(qt, kk), kk > 0);
    wg::wgmma_ss<BMQ, T>(dpt, wg::desc_kmajor<BN>(sVa, kk), wg::desc_kmajor<BMQ>(dot, kk), kk > 0);
  }
  wg::wgmma_commit();
}

// dV += P^T dO and dK += dS^T Q over the BMQ / 16 k-steps (B read MN-major), one group.
template <int D, typename T, int BMQ>
__device__ __forceinline__ void dkv_wgmma_issue_mma2(float (&dk)[D / 8][4], float (&dv)[D / 8][4],
                                                     uint32_t (&pa)[BMQ / 16][4], uint32_t (&sa)[BMQ / 16][4],
                                                     uint32_t qt, uint32_t dot) {
  wg::fence_operands(pa);
  wg::fence_operands(sa);
  wg::fence_operands(dv);
  wg::fence_operands(dk);
  wg::wgmma_fence();
#pragma unroll
  for (int kq = 0; kq < BMQ / 16; ++kq) {
    wg::wgmma_rs<D, T>(dv, pa[kq], wg::desc_mnmajor<BMQ>(dot, kq), 1);
    wg::wgmma_rs<D, T>(dk, sa[kq], wg::desc_mnmajor<BMQ>(qt, kq), 1);
  }
  wg::wgmma_commit();
}

// Whether key block [j0, j0 + BN) is "full" for this warp's query columns of the stage's row
// metadata m: every valid row's window range covers all BN keys (warp-uniform).
template <int BMQ, int BN>
__device__ __forceinline__ bool dkv_block_full(const int* m, int j0, int lane) {
  auto covers = [&](int r) { return !m[4 * BMQ + r] || (m[r] <= j0 && j0 + BN <= m[BMQ + r]); };
  bool cov = covers(lane);
  if (BMQ > 32) cov = cov && covers((lane + 32) % BMQ);
  return __all_sync(0xffffffffu, cov);
}

// P^T and dS^T of one element: query column qc of the stage's row metadata m, key j, scores st /
// dpt. MASKED: the key is tested against the row's ranges; otherwise the block is full. Callers
// branch on dkv_block_full and instantiate both: a per-element `ok = full; if (!ok) ...` was
// if-converted (the five range loads and the test on every block), see fwd_scale_mask_max.
template <int BMQ, bool MASKED>
__device__ __forceinline__ void dkv_p_ds(float st, float dpt, const int* m, int qc, int j, float sl2, float& pv,
                                         float& ds) {
  bool ok = true;
  if constexpr (MASKED) {
    const RowRanges r{m[qc], m[BMQ + qc], m[2 * BMQ + qc], m[3 * BMQ + qc], m[4 * BMQ + qc]};
    ok = r.allows(j, INT_MAX);
  }
  const bool valid = m[4 * BMQ + qc] != 0;
  const float l2 = valid ? __int_as_float(m[5 * BMQ + qc]) * kLog2e : INFINITY;
  const float dl = __int_as_float(m[6 * BMQ + qc]);
  pv = ok ? fast_exp2(st * sl2 - l2) : 0.f;
  ds = pv * (dpt - dl);
}

template <int BMQ, typename T, bool MASKED>
__device__ __forceinline__ void dkv_wgmma_elementwise_as(const float (&st)[BMQ / 8][4], const float (&dpt)[BMQ / 8][4],
                                                         const int* m, const int (&key_row)[2], int t, float sl2,
                                                         uint32_t (&pa)[BMQ / 16][4], uint32_t (&sa)[BMQ / 16][4]) {
#pragma unroll
  for (int kq = 0; kq < BMQ / 16; ++kq) {
    float pv[2][4], ds[2][4];  // accumulator n-tiles 2 kq, 2 kq + 1
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = 2 * kq + h;
#pragma unroll
      for (int x = 0; x < 4; ++x)
        dkv_p_ds<BMQ, MASKED>(st[n][x], dpt[n][x], m, 8 * n + 2 * t + (x & 1), key_row[x >> 1], sl2, pv[h][x],
                              ds[h][x]);
    }
    pa[kq][0] = Pack<T>::two(pv[0][0], pv[0][1]);
    pa[kq][1] = Pack<T>::two(pv[0][2], pv[0][3]);
    pa[kq][2] = Pack<T>::two(pv[1][0], pv[1][1]);
    pa[kq][3] = Pack<T>::two(pv[1][2], pv[1][3]);
    sa[kq][0] = Pack<T>::two(ds[0][0], ds[0][1]);
    sa[kq][1] = Pack<T>::two(ds[0][2], ds[0][3]);
    sa[kq][2] = Pack<T>::two(ds[1][0], ds[1][1]);
    sa[kq][3] = Pack<T>::two(ds[1][2], ds[1][3]);
  }
}

// P^T and dS^T of one query block from st / dpt (row metadata m = one stage of s_meta), packed into
// the RS A fragments pa / sa: the same float operations as cod_attn_dkv_kernel (pv, then
// pv * (dP - delta), each rounded once by the pack), but st / dpt are only read, never written:
// ptxas serializes the wgmmas of a loop that leaves a group pending across its back edge if
// ordinary code writes any wgmma accumulator in it (C7515), as the in-place P^T / dS^T would.
template <int BMQ, int BN, int MF, typename T>
__device__ __forceinline__ void dkv_wgmma_elementwise(const float (&st)[BMQ / 8][4], const float (&dpt)[BMQ / 8][4],
                                                      const int* m, int j0, const int (&key_row)[2], int lane, int t,
                                                      float sl2, uint32_t (&pa)[BMQ / 16][4],
                                                      uint32_t (&sa)[BMQ / 16][4]) {
  if (dkv_block_full<BMQ, BN>(m, j0, lane))
    dkv_wgmma_elementwise_as<BMQ, T, false>(st, dpt, m, key_row, t, sl2, pa, sa);
  else
    dkv_wgmma_elementwise_as<BMQ, T, true>(st, dpt, m, key_row, t, sl2, pa, sa);
}

template <int BMQ, bool MASKED>
__device__ __forceinline__ void dkv_p_ds_inplace_as(float (&st)[BMQ / 8][4], float (&dpt)[BMQ / 8][4], const int* m,
                                                    const int (&key_row)[2], int t, float sl2) {
#pragma unroll
  for (int n = 0; n < BMQ / 8; ++n) {
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      float pv, ds;
      dkv_p_ds<BMQ, MASKED>(st[n][x], dpt[n][x], m, 8 * n + 2 * t + (x & 1), key_row[x >> 1], sl2, pv, ds);
      st[n][x] = pv;
      dpt[n][x] = ds;
    }
  }
}

// The same P^T / dS^T as dkv_wgmma_elementwise, written in place into st / dpt (for the D = 64
// loop, which computes them while the previous block's MMA2 still reads pa / sa).
template <int BMQ, int BN, int MF>
__device__ __forceinline__ void dkv_wgmma_p_ds_inplace(float (&st)[BMQ / 8][4], float (&dpt)[BMQ / 8][4], const int* m,
                                                       int j0, const int (&key_row)[2], int lane, int t, float sl2) {
  if (dkv_block_full<BMQ, BN>(m, j0, lane))
    dkv_p_ds_inplace_as<BMQ, false>(st, dpt, m, key_row, t, sl2);
  else
    dkv_p_ds_inplace_as<BMQ, true>(st, dpt, m, key_row, t, sl2);
}
// P^T and dS^T as the A fragments of dV += P^T dO and dK += dS^T Q: wg::pack_acc_as_a of both,
// interleaved per k-step (two pack_acc_as_a calls give the same values in another instruction
// order).
template <int BMQ, typename T>
__device__ __forceinline__ void dkv_wgmma_pack(const float (&st)[BMQ / 8][4], const float (&dpt)[BMQ / 8][4],
                                               uint32_t (&pa)[BMQ / 16][4], uint32_t (&sa)[BMQ / 16][4]) {
#pragma unroll
  for (int kq = 0; kq < BMQ / 16; ++kq) {
    pa[kq][0] = Pack<T>::two(st[2 * kq][0], st[2 * kq][1]);
    pa[kq][1] = Pack<T>::two(st[2 * kq][2], st[2 * kq][3]);
    pa[kq][2] = Pack<T>::two(st[2 * kq + 1][0], st[2 * kq + 1][1]);
    pa[kq][3] = Pack<T>::two(st[2 * kq + 1][2], st[2 * kq + 1][3]);
    sa[kq][0] = Pack<T>::two(dpt[2 * kq][0], dpt[2 * kq][1]);
    sa[kq][1] = Pack<T>::two(dpt[2 * kq][2], dpt[2 * kq][3]);
    sa[kq][2] = Pack<T>::two(dpt[2 * kq + 1][0], dpt[2 * kq + 1][1]);
    sa[kq][3] = Pack<T>::two(dpt[2 * kq + 1][2], dpt[2 * kq + 1][3]);
  }
}

// Two loops: at D = 64, MMA1(it + 1) issued before MMA2(it), the elementwise of it + 1 overlapping
// MMA2(it) (FlashAttention-3 style, three stages); at D = 128, where the registers do not allow
// that, MMA2(it) left in flight over the copies' wait and the barrier. See the loops.
template <int D, typename T>
__global__ void __launch_bounds__(128, 1) cod_attn_dkv_wgmma_kernel(const CodAttnParams p) {
#if PEAGLE_WGMMA_DEVICE
  using Cfg = DkvWgmmaConfig<D>;
  constexpr int BN = Cfg::kBN, NT = Cfg::kThreads, MF = Cfg::kMetaFields, BMQ = Cfg::BMQ;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // B128 swizzle atoms must start on 1024-byte shared-memory boundaries (descriptor base offset 0)
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sKa = base, sVa = base + Cfg::kKTileBytes;
  const uint32_t sQa = base + 2 * Cfg::kKTileBytes;              // [stages] B128 tiles [BMQ][D]
  const uint32_t sdOa = sQa + Cfg::kStages * Cfg::kQTileBytes;   // [stages]
  int* s_meta = reinterpret_cast<int*>(smem + Cfg::kTileBytes);  // [stages][MF][BMQ]
  int* s_span_lo = s_meta + Cfg::kStages * MF * BMQ;             // [2K]
  int* s_span_hi = s_span_lo + 2 * kMaxChain;                    // [2K]
  int* s_blk_off = s_span_hi + 2 * kMaxChain;                    // [2K + 1]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  // 1-D grid, key-block major (dkv_grid in cod_attn_bwd.cuh)
  const int hk = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.Hkv));
  const int j0 = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.Hkv)) * BN;
  const int j1 = min(j0 + BN, p.N);
  const int64_t T_ = p.T;

  // Query runs per depth that touch keys [j0, j1).
  const int total_blocks = dkv_query_spans<BMQ>(p, j0, j1, tid, s_span_lo, s_span_hi, s_blk_off);
  const int n_iters = total_blocks * p.group;

  const int64_t qld = int64_t(p.Hq) * D, kld = int64_t(p.Hkv) * D;
  constexpr uint32_t kStageBytes = Cfg::kQTileBytes;

  // Iteration `it`: q head h, query rows [i0, min(i0 + BMQ, iend)) of one run.
  auto locate = [&](int it, int& h, int& i0, int& iend) {
    dkv_locate<BMQ>(it, total_blocks, hk * p.group, s_span_lo, s_span_hi, s_blk_off, h, i0, iend);
  };
  // Issues the async copies of iteration `it` (Q, dO, row metadata) into `stage`.
  auto issue = [&](int it, int stage) {
    int h, i0, iend;
    locate(it, h, i0, iend);
    wg::load_tile_sw128<BMQ, D, NT>(sQa + stage * kStageBytes, static_cast<const T*>(p.q) + int64_t(h) * D, qld, i0,
                                    iend, tid);
    wg::load_tile_sw128<BMQ, D, NT>(sdOa + stage * kStageBytes, static_cast<const T*>(p.dout) + int64_t(h) * D, qld, i0,
                                    iend, tid);
    // rows past the run are zero-filled, i.e. invalid (and never read as valid)
    const uint32_t m = smem_u32(s_meta + stage * MF * BMQ);
    for (int x = tid; x < MF * BMQ; x += NT) {
      const int field = x / BMQ, r = x - field * BMQ;
      const int64_t i = int64_t(i0) + r;
      bool ok = i < iend && (p.use_sink || (field != kSinkLo && field != kSinkHi));
      const void* src;
      if (field < kNumRangeFields)
        src = p.ranges + field * T_ + (ok ? i : 0);
      else if (field == 5)
        src = p.lse + int64_t(h) * T_ + (ok ? i : 0);
      else
        src = p.delta + int64_t(h) * T_ + (ok ? i : 0);
      cp_async4(m + x * 4, src, ok);
    }
  };

  wg::load_tile_sw128<BN, D, NT>(sKa, static_cast<const T*>(p.rk) + int64_t(hk) * D, kld, j0, p.N, tid);
  wg::load_tile_sw128<BN, D, NT>(sVa, static_cast<const T*>(p.rv) + int64_t(hk) * D, kld, j0, p.N, tid);
  if (n_iters > 0) issue(0, 0);
  cp_async_commit();
  cp_async_wait<0>();
  wg::fence_proxy_async_smem();  // the cp.async data is read by wgmma (async proxy)
  __syncthreads();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) dk[n][x] = dv[n][x] = 0.f;
  float st[BMQ / 8][4], dpt[BMQ / 8][4];
#pragma unroll
  for (int n = 0; n < BMQ / 8; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) st[n][x] = dpt[n][x] = 0.f;
  const float sl2 = p.scale_log2;
  const int key_row[2] = {j0 + 16 * warp + g, j0 + 16 * warp + g + 8};

  if constexpr (D == 64) {
    // ---- D = 64: FlashAttention-3's intra-warpgroup overlap (not at D = 128, whose registers do
    // not allow it, see below): MMA1 of block it + 1 is issued BEFORE MMA2 of block
    // it, so wait<1> returns with S^T / dP^T of block it + 1 while MMA2(it) may still run, and the
    // elementwise P^T / dS^T of block it + 1 (in place in st / dpt) runs during MMA2(it); only the
    // pack into pa / sa waits for MMA2(it), which reads them. Three stages of Q / dO / metadata
    // (stage(x) = x % 3): iteration it reads stage(it) (MMA2(it)) and stage(it + 1) (MMA1(it + 1)
    // and the elementwise) while the copies of block it + 2 fill stage(it + 2) = stage(it - 1), whose
    // readers (MMA1(it - 1), MMA2(it - 1), the elementwise of it - 1) completed before the barrier
    // ending iteration it - 1. Iteration it:
    //   copies of block it + 2 -> stage(it + 2)
    //   MMA1(it + 1) issue                 writes st / dpt (block it is packed in pa / sa)
    //   MMA2(it) issue                     reads pa / sa, stage(it); accumulates dk / dv
    //   wait<1>                            MMA1(it + 1) complete (committed first)
    //   P^T / dS^T of block it + 1 in st / dpt (metadata stage(it + 1))
    //   wait<0>                            MMA2(it) complete: pa / sa free; pack
    //   cp.async wait, proxy fence, barrier    block it + 2 visible; every warp past MMA1(it + 1), MMA2(it)
    // Prologue: copies of block 1, MMA1(0), its P^T / dS^T and pack, barrier; the last MMA2 is
    // peeled off: no wgmma group is pending across the back edge and every wgmma issue / wait in
    // the loop is unconditional, otherwise ptxas serializes the wgmmas (-Xptxas -v warnings C7514 /
    // C7515). 72 KiB of shared memory: two CTAs per SM, which the registers limit to two. Per
    // block the values of an unpipelined loop: the same wgmma sequences on the same operands in the
    // same order, the same P^T / dS^T arithmetic.
    uint32_t pa[BMQ / 16][4], sa[BMQ / 16][4];
    if (n_iters > 0) {
      if (n_iters > 1) issue(1, 1);
      cp_async_commit();
      dkv_wgmma_issue_mma1<D, T, BMQ, BN>(st, dpt, sKa, sVa, sQa, sdOa);
      wg::wgmma_wait<0>();
      wg::fence_operands(st);
      wg::fence_operands(dpt);
      dkv_wgmma_p_ds_inplace<BMQ, BN, MF>(st, dpt, s_meta, j0, key_row, lane, t, sl2);
      dkv_wgmma_pack<BMQ, T>(st, dpt, pa, sa);
      // block 1 visible; every warp's MMA1(0) complete
      cp_async_wait<0>();
      wg::fence_proxy_async_smem();
      __syncthreads();
      uint32_t cur = 0, nxt = 1, nn = 2;  // stage(it), stage(it + 1), stage(it + 2)
#pragma unroll 1
      for (int it = 0; it + 1 < n_iters; ++it) {
        if (it + 2 < n_iters) issue(it + 2, nn);
        cp_async_commit();
        dkv_wgmma_issue_mma1<D, T, BMQ, BN>(st, dpt, sKa, sVa, sQa + nxt * kStageBytes, sdOa + nxt * kStageBytes);
        dkv_wgmma_issue_mma2<D, T, BMQ>(dk, dv, pa, sa, sQa + cur * kStageBytes, sdOa + cur * kStageBytes);
        wg::wgmma_wait<1>();  // MMA1(it + 1) complete; MMA2(it) may run on (dk, dv, pa, sa, stage(it) only)
        wg::fence_operands(st);
        wg::fence_operands(dpt);
        dkv_wgmma_p_ds_inplace<BMQ, BN, MF>(st, dpt, s_meta + nxt * MF * BMQ, j0, key_row, lane, t, sl2);
        wg::wgmma_wait<0>();  // MMA2(it) complete
        wg::fence_operands(dv);
        wg::fence_operands(dk);
        wg::fence_operands(pa);
        wg::fence_operands(sa);
        dkv_wgmma_pack<BMQ, T>(st, dpt, pa, sa);
        cp_async_wait<0>();
        wg::fence_proxy_async_smem();
        __syncthreads();
        const uint32_t done = cur;
        cur = nxt;
        nxt = nn;
        nn = done;
      }
      dkv_wgmma_issue_mma2<D, T, BMQ>(dk, dv, pa, sa, sQa + cur * kStageBytes, sdOa + cur * kStageBytes);
      wg::wgmma_wait<0>();
      wg::fence_operands(dv);
      wg::fence_operands(dk);
      wg::fence_operands(pa);
      wg::fence_operands(sa);
    }
  } else {
    // ---- D = 128, where an unpipelined loop already takes all 255 registers: the overlapped loop
    // above (MMA1(it + 1) issued while MMA2(it) runs) ties st / dpt, dk / dv and pa / sa (224
    // registers) to in-flight wgmmas at once and spills (240 bytes, inside the loop; also with MMA1
    // issued after MMA2's wait: 132 bytes). This loop only leaves MMA2(it) (dV += P^T dO, dK += dS^T Q) in flight over
    // the copies' wait and the barrier that end iteration it, and waits for it at the top of iteration it + 1, followed
    // by a proxy fence and a second barrier before the copies of block it + 2 overwrite MMA2(it)'s stage:
    //   wait<0>                            MMA2(it - 1) complete (this warp): dk, dv, pa, sa free
    //   proxy fence, barrier               ... every warp: stage(it - 1) = stage(it + 1) free
    //   copies of block it + 1 -> stage(it + 1)
    //   MMA1(it) issue, wait<0>            (it reads stage(it), visible since the end of it - 1)
    //   elementwise + pack of block it     (pa, sa free: MMA2(it - 1) complete)
    //   MMA2(it) issue, NO wait
    //   cp.async wait, proxy fence, barrier    block it + 1 visible to every thread's wgmma
    // A wgmma group is pending across the back edge here, which ptxas accepts as long as no
    // ordinary instruction writes dk / dv in the loop (none does; checked: no C751x warning).
    // Register use as an unpipelined loop; the same values (same instructions, same order per block).
    uint32_t pa[BMQ / 16][4] = {}, sa[BMQ / 16][4] = {};
    // Pins the zero-filled dk / dv here: otherwise the compiler sinks a second copy of the zero
    // fill into the n_iters == 0 path, which it lays out between the loop's last MMA2 issue and the
    // wait after the loop, and ptxas then serializes the wgmmas (C7515: non-wgmma instructions
    // defining accumulator registers within the stage).
    wg::fence_operands(dk);
    wg::fence_operands(dv);
#pragma unroll 1
    for (int it = 0; it < n_iters; ++it) {
      const uint32_t stage = it & 1;
      wg::wgmma_wait<0>();  // MMA2(it - 1) complete (it = 0: nothing pending)
      wg::fence_operands(dv);
      wg::fence_operands(dk);
      wg::fence_operands(pa);
      wg::fence_operands(sa);
      wg::fence_proxy_async_smem();
      __syncthreads();
      if (it + 1 < n_iters) issue(it + 1, stage ^ 1);
      cp_async_commit();
      const uint32_t qt = sQa + stage * kStageBytes, dot = sdOa + stage * kStageBytes;
      dkv_wgmma_issue_mma1<D, T, BMQ, BN>(st, dpt, sKa, sVa, qt, dot);
      wg::wgmma_wait<0>();
      wg::fence_operands(st);
      wg::fence_operands(dpt);
      dkv_wgmma_elementwise<BMQ, BN, MF, T>(st, dpt, s_meta + stage * MF * BMQ, j0, key_row, lane, t, sl2, pa, sa);
      dkv_wgmma_issue_mma2<D, T, BMQ>(dk, dv, pa, sa, qt, dot);
      cp_async_wait<0>();
      wg::fence_proxy_async_smem();
      __syncthreads();
    }
    wg::wgmma_wait<0>();  // the last MMA2 before the epilogue reads dk, dv
    wg::fence_operands(dv);
    wg::fence_operands(dk);
    wg::fence_operands(pa);
    wg::fence_operands(sa);
  }

  const float scale = p.scale;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key_row[r];
    if (j < p.N) {
      const int64_t off = int64_t(j) * kld + int64_t(hk) * D + 2 * t;
      T* ok = static_cast<T*>(p.drk) + off;
      T* ov = static_cast<T*>(p.drv) + off;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<uint32_t*>(ok + 8 * n) = Pack<T>::two(dk[n][2 * r] * scale, dk[n][2 * r + 1] * scale);
        *reinterpret_cast<uint32_t*>(ov + 8 * n) = Pack<T>::two(dv[n][2 * r], dv[n][2 * r + 1]);
      }
    }
  }
#endif  // PEAGLE_WGMMA_DEVICE
}

// Launch of the wgmma dK/dV pass (grid: key blocks x kv heads), on `stream`.
template <int D, typename T>
cudaError_t launch_dkv_wgmma(const CodAttnParams& p, cudaStream_t stream) {
  using Cfg = DkvWgmmaConfig<D>;
  auto kernel = cod_attn_dkv_wgmma_kernel<D, T>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  kernel<<<dkv_grid(p, Cfg::kBN), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace peagle::attention::cuda
