// COD attention forward (flash-style, mma.sync m16n8k16, fp32 online softmax in the log2 domain).
//
// CTA = (query tile of BM = 16 * NWARPS consecutive rows of one depth, q head). Warp w owns tile
// rows 16 w .. 16 w + 15; its Q A-fragments stay in registers. The tile first folds its rows' chain
// keys (<= K per row, arbitrary rows of k/v) into the softmax state with CUDA-core dot products,
// then streams the key blocks of its spans (double-buffered cp.async K/V tiles), masking per element
// only on blocks that are not "full". LSE (natural log, +inf for rows without keys) is stored for
// the backward.
#pragma once
#include <cmath>
#include <type_traits>

#include "attention/cuda/cod_attn_tile.cuh"

namespace peagle::attention::cuda {

template <int D, int NWARPS, int BN>
struct FwdConfig {
  static constexpr int kBM = NWARPS * 16;
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kTileBytes = (kBM * D + 4 * BN * D) * 2;  // Q + 2 stages of K and V
  static constexpr int kSmemBytes = kTileBytes + (5 * kBM + 8 * NWARPS) * 4;
  // + chain scores and key rows: kBM * K floats and ints (K known at launch)
  static constexpr int chain_bytes(int K) { return kBM * K * 8; }
};

// ---- pieces of the forward for the sm_90a warpgroup kernel (cod_attn_fwd_wgmma.cuh), whose
// accumulator fragments have the same (row, column) map per warp as here (warp w: rows
// 16 w .. 16 w + 15). fwd_store_row is cod_attn_fwd_kernel's epilogue too. fwd_chain_keys and
// fwd_softmax_fragment are the same statements as cod_attn_fwd_kernel's chain fold and softmax,
// which keep their inline copies: routing the mma.sync kernel through them changed its register
// allocation (its SASS), which must stay as measured. Change both places together.

// Chain keys (<= K per row, arbitrary rows of k/v) of the warp's 16 rows, folded into the
// softmax state before the key blocks. Lanes take (row, slot) pairs of the warp's rows and compute
// whole dot products (independent 16-byte loads, no shuffles; qrow_dot(row, grow) = dot product
// of tile row `row` of Q in shared memory with the global row grow); then the quad owning a row
// starts its softmax state from that row's chain scores and accumulates p * v_c.
template <int D, typename T, typename QRowDot>
__device__ __forceinline__ void fwd_chain_keys(const CodAttnParams& p, const QTile& qt, int hk, int warp, int lane,
                                               int g, int t, int wrow0, int64_t kld, float sl2, float* s_chain_s,
                                               int* s_chain_c, QRowDot&& qrow_dot, float (&acc)[D / 8][4],
                                               float (&m)[2], float (&l)[2]) {
  const int K = p.K;
  float* cs = s_chain_s + warp * 16 * K;
  int* ci = s_chain_c + warp * 16 * K;
  const T* kb = static_cast<const T*>(p.k) + int64_t(hk) * D;
  const T* vb = static_cast<const T*>(p.v) + int64_t(hk) * D;
#pragma unroll 1
  for (int pi = lane; pi < 16 * K; pi += 32) {
    const int rl = pi / K, e = pi - rl * K;
    const int row = wrow0 + rl;
    const int c = row < qt.rows ? chain_row(p.chain[int64_t(qt.row0 + row) * K + e], p.T) : -1;
    cs[pi] = c >= 0 ? qrow_dot(row, kb + int64_t(c) * kld) * sl2 : -INFINITY;
    ci[pi] = c;
  }
  __syncwarp();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int rl = g + 8 * r;
    float mc = -INFINITY;
    // NaN-propagating max (fmaxf drops NaN): a row whose only chain key is NaN must come out
    // NaN, not skip the chain as if it had no keys (the block part propagates through exp2)
    for (int e = 0; e < K; ++e) {
      const float x = cs[rl * K + e];
      mc = (x > mc || x != x) ? x : mc;
    }
    if (mc == -INFINITY) continue;
    float lc = 0.f;
#pragma unroll 2
    for (int e = 0; e < K; ++e) {
      const int c = ci[rl * K + e];
      if (c < 0) continue;
      const float pv = fast_exp2(cs[rl * K + e] - mc);
      lc += pv;
      const T* vr = vb + int64_t(c) * kld + 2 * t;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const float2 vv = Pack<T>::unpack(__ldg(reinterpret_cast<const unsigned int*>(vr + 8 * n)));
        acc[n][2 * r] = fmaf(pv, vv.x, acc[n][2 * r]);
        acc[n][2 * r + 1] = fmaf(pv, vv.y, acc[n][2 * r + 1]);
      }
    }
    m[r] = mc;
    l[r] = t == 0 ? lc : 0.f;  // l is a per-thread partial, summed over the quad at the end
  }
}

// acc *= alpha per fragment row (the online-softmax rescale, which the pipelined wgmma forward
// applies once the previous block's P V is complete: see fwd_softmax_fragment). Skipped when alpha
// is 1 for every row of the warp, which is most blocks once a row's running max has settled: x * 1.0f == x for
// every float (NaN, inf and -0 included), so skipping changes no bit; the test is warp-uniform so
// the warp does not diverge. Used by the wgmma forward only (the mma.sync kernel keeps its copy).
template <int D>
__device__ __forceinline__ void fwd_rescale_acc(float (&acc)[D / 8][4], const float (&alpha)[2]) {
  if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      acc[n][2 * r] *= alpha[r];
      acc[n][2 * r + 1] *= alpha[r];
    }
  }
}

// s *= sl2 (scores to the log2 domain), keys the row may not see -> -inf (MASKED only), row maxima
// into mx. The caller branches on `full` (uniform over the CTA) and instantiates both: a single loop
// with `full ||` per score was if-converted by ptxas into the whole mask test (2 IADD3, 3 ISETP,
// PLOP3, FSEL per score) on EVERY block, the forward's busiest pipe (ALU 59% in Nsight Compute), while 91-98%
// of the blocks are full on the bench layouts. Same float operations either way (bitwise the same).
template <int BN, bool MASKED>
__device__ __forceinline__ void fwd_scale_mask_max(float (&s)[BN / 8][4], float (&mx)[2], const RowRanges (&rf)[2],
                                                   int j0, int jend, int t, float sl2) {
  BlockRowMask bm[2] = {BlockRowMask(), BlockRowMask()};
  if constexpr (MASKED) {
    bm[0] = BlockRowMask(rf[0], j0, jend, BN, t);
    bm[1] = BlockRowMask(rf[1], j0, jend, BN, t);
  }
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      float v = s[n][x] * sl2;
      if (MASKED && !bm[x >> 1].allows(8 * n + (x & 1))) v = -INFINITY;  // key j0 + 2 t + 8 n + (x & 1)
      s[n][x] = v;
      mx[x >> 1] = fmaxf(mx[x >> 1], v);
    }
  }
}

// Online softmax of one 16-row fragment over key block [j0, j0 + BN) (clipped to jend) for the
// pipelined wgmma forward: scores s (m16 x BN accumulator fragments) -> masked, scaled to the log2
// domain, running max m / sum l (per-thread partial) updated, s replaced by the unnormalized
// probabilities. The rescale of acc is returned as alpha[r] for fwd_rescale_acc: acc is still being
// accumulated by the previous block's P V when this runs. Per element the same statements in the
// same order as cod_attn_fwd_kernel's softmax (including l *= alpha before the first l += pv), so
// the two forwards give the same bits where their tiles agree. Change both together.
template <int BN>
__device__ __forceinline__ void fwd_softmax_fragment(float (&s)[BN / 8][4], float (&m)[2], float (&l)[2],
                                                     const RowRanges (&rr)[2], bool full, int j0, int jend, int t,
                                                     float sl2, float (&alpha)[2]) {
  float mx[2] = {-INFINITY, -INFINITY};
  if (full)
    fwd_scale_mask_max<BN, false>(s, mx, rr, j0, jend, t, sl2);
  else
    fwd_scale_mask_max<BN, true>(s, mx, rr, j0, jend, t, sl2);
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m[r], quad_max(mx[r]));
    base[r] = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = fast_exp2(m[r] - base[r]);
    m[r] = m_new;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const float pv = fast_exp2(s[n][x] - base[x >> 1]);
      s[n][x] = pv;
      l[x >> 1] += pv;
    }
  }
}

// Epilogue of one query row i (fragment row half r of acc): out = acc / l (zeros for rows that
// are invalid or have no keys) and LSE (natural log; +inf for rows without keys, the backward's
// convention). lsum = the quad-summed l.
template <int D, typename T>
__device__ __forceinline__ void fwd_store_row(const CodAttnParams& p, const float (&acc)[D / 8][4], int r, float m,
                                              float lsum, int valid, int64_t i, int h, int t, int64_t qld) {
  constexpr float kLn2 = 0.69314718055994530942f;
  const bool ok = valid && lsum > 0.f;
  const float inv = ok ? 1.f / lsum : 0.f;
  T* o = static_cast<T*>(p.out) + i * qld + int64_t(h) * D + 2 * t;
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
    *reinterpret_cast<uint32_t*>(o + 8 * n) = Pack<T>::two(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
  if (t == 0) p.lse[int64_t(h) * p.T + i] = ok ? (m + log2f(lsum)) * kLn2 : INFINITY;
}

template <int D, typename T, int NWARPS, int BN>
__global__ void __launch_bounds__(NWARPS * 32, 1) cod_attn_fwd_kernel(const CodAttnParams p, const TileMap tm) {
  using Cfg = FwdConfig<D, NWARPS, BN>;
  constexpr int BM = Cfg::kBM, NT = Cfg::kThreads;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + BM * D;      // [2][BN][D]
  T* sV = sK + 2 * BN * D;  // [2][BN][D]
  int* s_meta = reinterpret_cast<int*>(smem + Cfg::kTileBytes);
  int* s_red = s_meta + 5 * BM;
  float* s_chain_s = reinterpret_cast<float*>(s_red + 8 * NWARPS);
  int* s_chain_c = reinterpret_cast<int*>(s_chain_s + BM * p.K);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int h = blockIdx.y, hk = h / p.group;
  const QTile qt = find_query_tile(p, tm, gridDim.x - 1 - blockIdx.x, BM);
  const TileKeys tk = setup_query_tile<BM, NT, BN>(p, qt, s_meta, s_red, tid);
  // warp w owns tile rows [16 w, 16 w + 16): this thread holds rows wrow0 + g (r = 0) and
  // wrow0 + g + 8 (r = 1).
  const int wrow0 = 16 * warp;

  const int64_t qld = int64_t(p.Hq) * D, kld = int64_t(p.Hkv) * D;
  const T* qbase = static_cast<const T*>(p.q) + int64_t(h) * D;
  const T* rkbase = static_cast<const T*>(p.rk) + int64_t(hk) * D;
  const T* rvbase = static_cast<const T*>(p.rv) + int64_t(hk) * D;
  const uint32_t sQa = smem_u32(sQ), sKa = smem_u32(sK), sVa = smem_u32(sV);
  constexpr uint32_t kStageBytes = BN * D * 2;

  load_tile<BM, D, NT>(sQa, qbase, qld, qt.row0, int64_t(qt.row0) + qt.rows, tid);
  if (tk.nblocks > 0) {
    int j0, jend;
    key_block<BN>(tk, 0, j0, jend);
    load_tile<BN, D, NT>(sKa, rkbase, kld, j0, jend, tid);
    load_tile<BN, D, NT>(sVa, rvbase, kld, j0, jend, tid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) frag_a<D>(qf[kk], sQa, wrow0, kk, lane);

  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const RowRanges rr[2] = {row_ranges<BM>(s_meta, wrow0 + g), row_ranges<BM>(s_meta, wrow0 + g + 8)};
  const float sl2 = p.scale_log2;

  // ---- chain keys (<= K per row, arbitrary rows of k/v). Lanes take (row, slot) pairs of the
  // warp's 16 rows and compute whole dot products (independent 16-byte loads, no shuffles); then
  // the quad owning a row starts its softmax state from that row's chain scores and accumulates
  // p * v_c.
  if (tk.any_chain) {
    const int K = p.K;
    float* cs = s_chain_s + warp * 16 * K;
    int* ci = s_chain_c + warp * 16 * K;
    const T* kb = static_cast<const T*>(p.k) + int64_t(hk) * D;
    const T* vb = static_cast<const T*>(p.v) + int64_t(hk) * D;
#pragma unroll 1
    for (int pi = lane; pi < 16 * K; pi += 32) {
      const int rl = pi / K, e = pi - rl * K;
      const int row = wrow0 + rl;
      const int c = row < qt.rows ? chain_row(p.chain[int64_t(qt.row0 + row) * K + e], p.T) : -1;
      cs[pi] = c >= 0 ? dot_smem_global<D, T>(sQ, row, kb + int64_t(c) * kld) * sl2 : -INFINITY;
      ci[pi] = c;
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int rl = g + 8 * r;
      float mc = -INFINITY;
      // NaN-propagating max (fmaxf drops NaN): a row whose only chain key is NaN must come out
      // NaN, not skip the chain as if it had no keys (the block part propagates through exp2)
      for (int e = 0; e < K; ++e) {
        const float x = cs[rl * K + e];
        mc = (x > mc || x != x) ? x : mc;
      }
      if (mc == -INFINITY) continue;
      float lc = 0.f;
#pragma unroll 2
      for (int e = 0; e < K; ++e) {
        const int c = ci[rl * K + e];
        if (c < 0) continue;
        const float pv = fast_exp2(cs[rl * K + e] - mc);
        lc += pv;
        const T* vr = vb + int64_t(c) * kld + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          const float2 vv = Pack<T>::unpack(__ldg(reinterpret_cast<const unsigned int*>(vr + 8 * n)));
          acc[n][2 * r] = fmaf(pv, vv.x, acc[n][2 * r]);
          acc[n][2 * r + 1] = fmaf(pv, vv.y, acc[n][2 * r + 1]);
        }
      }
      m[r] = mc;
      l[r] = t == 0 ? lc : 0.f;  // l is a per-thread partial, summed over the quad at the end
    }
  }

  // ---- key blocks
#pragma unroll 1
  for (int b = 0; b < tk.nblocks; ++b) {
    const int stage = b & 1;
    if (b + 1 < tk.nblocks) {
      int nj0, njend;
      key_block<BN>(tk, b + 1, nj0, njend);
      load_tile<BN, D, NT>(sKa + (stage ^ 1) * kStageBytes, rkbase, kld, nj0, njend, tid);
      load_tile<BN, D, NT>(sVa + (stage ^ 1) * kStageBytes, rvbase, kld, nj0, njend, tid);
    }
    cp_async_commit();
    int j0, jend;
    key_block<BN>(tk, b, j0, jend);
    const uint32_t kt = sKa + stage * kStageBytes, vt = sVa + stage * kStageBytes;

    // S = Q K^T: kk outer, each K B-fragment holds two n-tiles
    float s[BN / 8][4];
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bf[4];
        frag_b_nk<D>(bf, kt, 16 * np, kk, lane);
        mma16816<T>(s[2 * np], qf[kk], bf[0], bf[1]);
        mma16816<T>(s[2 * np + 1], qf[kk], bf[2], bf[3]);
      }
    }
    const bool full = j0 >= tk.lo_max && j0 + BN <= tk.hi_min && j0 + BN <= jend;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int j = j0 + 8 * n + 2 * t + (x & 1);
        float v = s[n][x] * sl2;
        if (!full && !rr[x >> 1].allows(j, jend)) v = -INFINITY;
        s[n][x] = v;
        mx[x >> 1] = fmaxf(mx[x >> 1], v);
      }
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], quad_max(mx[r]));
      base[r] = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = fast_exp2(m[r] - base[r]);
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][2 * r] *= alpha;
        acc[n][2 * r + 1] *= alpha;
      }
    }
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const float pv = fast_exp2(s[n][x] - base[x >> 1]);
        s[n][x] = pv;
        l[x >> 1] += pv;
      }
    }
    // O += P V: P stays in registers as the A operand
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      a[0] = Pack<T>::two(s[2 * kk][0], s[2 * kk][1]);
      a[1] = Pack<T>::two(s[2 * kk][2], s[2 * kk][3]);
      a[2] = Pack<T>::two(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = Pack<T>::two(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bf[4];
        frag_b_kn<D>(bf, vt, 16 * dp, kk, lane);
        mma16816<T>(acc[2 * dp], a, bf[0], bf[1]);
        mma16816<T>(acc[2 * dp + 1], a, bf[2], bf[3]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
  }

  // ---- epilogue
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    const int row = wrow0 + g + 8 * r;
    if (row < qt.rows) fwd_store_row<D, T>(p, acc, r, m[r], lsum, rr[r].valid, qt.row0 + row, h, t, qld);
  }
}

// The Hopper forward (cod_attn_fwd_wgmma.cuh), chosen by cod_attn_fwd_launch. Defined in
// cod_attn_fwd_wgmma_sm90a.cu (compiled for sm_90a alone), or, in builds without it, in
// cod_attn_launch.cu as "not supported".
cudaError_t cod_attn_fwd_wgmma_launch(const CodAttnParams& p, AttnDtype dtype, cudaStream_t stream);

template <int D, typename T, int NWARPS, int BN>
cudaError_t launch_fwd(const CodAttnParams& p, cudaStream_t stream) {
  using Cfg = FwdConfig<D, NWARPS, BN>;
  TileMap tm;
  const int ntiles = make_tile_map(p, Cfg::kBM, tm);
  if (ntiles == 0 || p.Hq == 0) return cudaSuccess;
  auto kernel = cod_attn_fwd_kernel<D, T, NWARPS, BN>;
  const int smem = Cfg::kSmemBytes + Cfg::chain_bytes(p.K);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(ntiles, p.Hq), Cfg::kThreads, smem, stream>>>(p, tm);
  return cudaGetLastError();
}

}  // namespace peagle::attention::cuda
