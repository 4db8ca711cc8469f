// COD attention forward (flash-style, mma.sync m16n8k16, fp32 online softmax in the log2 domain).
//
// CTA = (query tile of BM = 16 * NWARPS consecutive rows of one depth, q head). Warp w owns tile
// rows 16w..16w+15; Q fragments stay in registers. The tile first folds its rows' chain keys
// (<= K per row, arbitrary rows of k/v) into the softmax state with CUDA-core dot products, then
// streams the key blocks of its spans (double-buffered cp.async K/V tiles), masking per element
// only on blocks that are not "full". LSE (natural log, +inf for rows without keys) is stored
// for the backward.
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
  // + chain scores and key rows: NWARPS * 16 * K floats and ints (K known at launch)
  static constexpr int chain_bytes(int K) { return NWARPS * 16 * K * 8; }
};

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
  int* s_chain_c = reinterpret_cast<int*>(s_chain_s + NWARPS * 16 * p.K);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int h = blockIdx.y, hk = h / p.group;
  const QTile qt = find_query_tile(p, tm, gridDim.x - 1 - blockIdx.x, BM);
  const TileKeys tk = setup_query_tile<BM, NT, BN>(p, qt, s_meta, s_red, tid);

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
  for (int kk = 0; kk < D / 16; ++kk) frag_a<D>(qf[kk], sQa, 16 * warp, kk, lane);

  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const RowRanges rr[2] = {row_ranges<BM>(s_meta, 16 * warp + g), row_ranges<BM>(s_meta, 16 * warp + g + 8)};
  const float sl2 = p.scale_log2;

  // ---- chain keys (<= K per row, arbitrary rows of k/v). Lanes take (row, slot) pairs and
  // compute whole dot products (independent 16-byte loads, no shuffles); then the quad owning a
  // row starts its softmax state from that row's chain scores and accumulates p * v_c.
  if (tk.any_chain) {
    const int K = p.K;
    float* cs = s_chain_s + warp * 16 * K;
    int* ci = s_chain_c + warp * 16 * K;
    const T* kb = static_cast<const T*>(p.k) + int64_t(hk) * D;
    const T* vb = static_cast<const T*>(p.v) + int64_t(hk) * D;
#pragma unroll 1
    for (int pi = lane; pi < 16 * K; pi += 32) {
      const int rl = pi / K, e = pi - rl * K;
      const int row = 16 * warp + rl;
      const int c = row < qt.rows ? p.chain[int64_t(qt.row0 + row) * K + e] : -1;
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
  constexpr float kLn2 = 0.69314718055994530942f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    const int row = 16 * warp + g + 8 * r;
    if (row < qt.rows) {
      const int64_t i = qt.row0 + row;
      const bool ok = rr[r].valid && lsum > 0.f;
      const float inv = ok ? 1.f / lsum : 0.f;
      T* o = static_cast<T*>(p.out) + i * qld + int64_t(h) * D + 2 * t;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<uint32_t*>(o + 8 * n) = Pack<T>::two(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
      if (t == 0) p.lse[int64_t(h) * p.T + i] = ok ? (m[r] + log2f(lsum)) * kLn2 : INFINITY;
    }
  }
}

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
