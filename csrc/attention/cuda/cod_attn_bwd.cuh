// COD attention backward, deterministic (no atomics): four launches on one stream.
//  1. delta[h, i] = rowsum(dO * O)                                   (one warp per row and head)
//  2. dQ, query-major: the forward's tiles and key blocks; P from the stored LSE,
//     dS = P * (dO V^T - delta), dQ += dS K; chain keys with CUDA-core dot products.
//  3. dK/dV of the range keys, key-major: CTA = (64 keys, kv head). For every q head of the GQA
//     group and every depth, the queries whose ranges touch the block are one or two contiguous
//     index runs (range bounds are monotone in the sorted anchors), found by binary search;
//     S^T = K Q^T is computed with keys as rows, so P^T and dS^T feed dV += P^T dO and
//     dK += dS^T Q straight from registers.
//  4. dK/dV of chain pairs: one warp per (layout row, kv head) over its reverse-chain queries;
//     adds to the range result on symmetric depth-0 rows, writes every other layout row.
// The Hopper backward (cod_attn_{dq,bwd}_wgmma.cuh) runs passes 2 and 3 on warpgroup MMAs and
// shares passes 1 and 4 (launch_bwd).
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention/cuda/cod_attn_tile.cuh"

namespace peagle::attention::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------- 1. delta
template <int D, typename T>
__global__ void __launch_bounds__(256) cod_attn_delta_kernel(const CodAttnParams p) {
  constexpr int EPL = D / 32;
  const int64_t idx = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (idx >= int64_t(p.T) * p.Hq) return;
  const int64_t i = idx / p.Hq;
  const int h = static_cast<int>(idx % p.Hq);
  const int64_t off = i * p.Hq * D + int64_t(h) * D + lane * EPL;
  float o[EPL], d[EPL];
  load_floats<EPL>(static_cast<const T*>(p.out) + off, o);
  load_floats<EPL>(static_cast<const T*>(p.dout) + off, d);
  float s = 0.f;
#pragma unroll
  for (int x = 0; x < EPL; ++x) s += o[x] * d[x];
  s = warp_sum(s);
  if (lane == 0) p.delta[int64_t(h) * p.T + i] = s;
}

// ---------------------------------------------------------------- 2. dQ
template <int D, int NWARPS, int BN>
struct DqConfig {
  static constexpr int kBM = NWARPS * 16;
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kTileBytes = (2 * kBM * D + 4 * BN * D) * 2;  // Q, dO + 2 stages of K, V
  static constexpr int kSmemBytes = kTileBytes + (7 * kBM + 8 * NWARPS) * 4;
  static constexpr int chain_bytes(int K) { return NWARPS * 16 * K * 8; }
};

template <int D, typename T, int NWARPS, int BN>
__global__ void __launch_bounds__(NWARPS * 32, 1) cod_attn_dq_kernel(const CodAttnParams p, const TileMap tm) {
  using Cfg = DqConfig<D, NWARPS, BN>;
  constexpr int BM = Cfg::kBM, NT = Cfg::kThreads;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + BM * D;
  T* sK = sdO + BM * D;     // [2][BN][D]
  T* sV = sK + 2 * BN * D;  // [2][BN][D]
  int* s_meta = reinterpret_cast<int*>(smem + Cfg::kTileBytes);
  float* s_lse2 = reinterpret_cast<float*>(s_meta + 5 * BM);
  float* s_delta = s_lse2 + BM;
  int* s_red = reinterpret_cast<int*>(s_delta + BM);
  float* s_chain_s = reinterpret_cast<float*>(s_red + 8 * NWARPS);
  int* s_chain_c = reinterpret_cast<int*>(s_chain_s + NWARPS * 16 * p.K);

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
  const uint32_t sQa = smem_u32(sQ), sdOa = smem_u32(sdO), sKa = smem_u32(sK), sVa = smem_u32(sV);
  constexpr uint32_t kStageBytes = BN * D * 2;

  load_tile<BM, D, NT>(sQa, qbase, qld, qt.row0, int64_t(qt.row0) + qt.rows, tid);
  load_tile<BM, D, NT>(sdOa, dobase, qld, qt.row0, int64_t(qt.row0) + qt.rows, tid);
  if (tk.nblocks > 0) {
    int j0, jend;
    key_block<BN>(tk, 0, j0, jend);
    load_tile<BN, D, NT>(sKa, rkbase, kld, j0, jend, tid);
    load_tile<BN, D, NT>(sVa, rvbase, kld, j0, jend, tid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // Q and dO fragments are re-read from shared memory per key block (registers go to dQ, S, dP).
  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
  const RowRanges rr[2] = {row_ranges<BM>(s_meta, 16 * warp + g), row_ranges<BM>(s_meta, 16 * warp + g + 8)};
  const float lse2[2] = {s_lse2[16 * warp + g], s_lse2[16 * warp + g + 8]};
  const float dlt[2] = {s_delta[16 * warp + g], s_delta[16 * warp + g + 8]};
  const float sl2 = p.scale_log2;

  // ---- chain keys: lanes take (row, slot) pairs: ds = p * (dO.v_c - delta), then the quad
  // owning a row adds ds * k_c to its dQ columns.
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
      const int c = row < qt.rows ? chain_row(p.chain[int64_t(qt.row0 + row) * K + e], p.T) : -1;
      float ds = 0.f;
      if (c >= 0) {
        const float sv = dot_smem_global<D, T>(sQ, row, kb + int64_t(c) * kld);
        const float dp = dot_smem_global<D, T>(sdO, row, vb + int64_t(c) * kld);
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

    float s[BN / 8][4], dpv[BN / 8][4];
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
      for (int x = 0; x < 4; ++x) s[n][x] = dpv[n][x] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qfk[4], dof[4];
      frag_a<D>(qfk, sQa, 16 * warp, kk, lane);
      frag_a<D>(dof, sdOa, 16 * warp, kk, lane);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bf[4];
        frag_b_nk<D>(bf, kt, 16 * np, kk, lane);
        mma16816<T>(s[2 * np], qfk, bf[0], bf[1]);
        mma16816<T>(s[2 * np + 1], qfk, bf[2], bf[3]);
        frag_b_nk<D>(bf, vt, 16 * np, kk, lane);
        mma16816<T>(dpv[2 * np], dof, bf[0], bf[1]);
        mma16816<T>(dpv[2 * np + 1], dof, bf[2], bf[3]);
      }
    }
    const bool full = j0 >= tk.lo_max && j0 + BN <= tk.hi_min && j0 + BN <= jend;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int j = j0 + 8 * n + 2 * t + (x & 1);
        const int r = x >> 1;
        const bool ok = full || rr[r].allows(j, jend);
        const float pv = ok ? fast_exp2(s[n][x] * sl2 - lse2[r]) : 0.f;
        s[n][x] = pv * (dpv[n][x] - dlt[r]);  // dS
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
        frag_b_kn<D>(bf, kt, 16 * dp, kk, lane);
        mma16816<T>(dq[2 * dp], a, bf[0], bf[1]);
        mma16816<T>(dq[2 * dp + 1], a, bf[2], bf[3]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
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
}

// ---------------------------------------------------------------- 3. dK/dV, range keys
template <int D, int BMQ>
struct DkvConfig {
  static constexpr int kBN = 64;  // keys per CTA (16 per warp)
  static constexpr int kThreads = 128;
  static constexpr int kMetaFields = 7;  // lo, hi, slo, shi, valid, lse, delta (copied with cp.async)
  static constexpr int kTileBytes = (2 * kBN * D + 4 * BMQ * D) * 2;  // K, V + 2 stages of Q, dO
  static constexpr int kSmemBytes = kTileBytes + (2 * kMetaFields * BMQ + 4 * kMaxChain + 2 * kMaxChain + 1) * 4;
};

// Grid of the dK/dV passes (this one and cod_attn_dkv_wgmma_kernel): one CTA per (key block of BN
// range keys, kv head), 1-D and key-block major: blockIdx.x = block * Hkv + head. With causal
// ranges the work of a key block falls with its position (key j is seen by every later query), so
// this order starts the heaviest blocks of every head first; head-major order started the last
// heads' heaviest blocks in the final wave (a greedy-schedule model puts that tail at 1.2-1.5x of
// the ideal at N = 4K-8K on 132 SMs, against 1.01x for this order).
inline dim3 dkv_grid(const CodAttnParams& p, int bn) {
  return dim3(static_cast<unsigned>((p.N + bn - 1) / bn) * static_cast<unsigned>(p.Hkv));
}

// The query runs that touch keys [j0, j1), for both dK/dV passes (this one and
// cod_attn_dkv_wgmma_kernel): per depth e, the rows whose window range and (use_sink) sink range
// reach the keys, as two spans (one when they overlap) in s_span_lo / s_span_hi [2K]; s_blk_off
// [2K + 1] = the prefix counts of BMQ-row blocks over the spans. Called by every thread of the CTA
// (two barriers); returns the total block count.
template <int BMQ>
__device__ __forceinline__ int dkv_query_spans(const CodAttnParams& p, int j0, int j1, int tid, int* s_span_lo,
                                               int* s_span_hi, int* s_blk_off) {
  const int64_t T_ = p.T;
  if (tid < p.K) {
    const int e = tid;
    const int64_t b = p.depth_offsets[e], en = p.depth_offsets[e + 1];
    const int32_t* lo = p.ranges + kLo * T_;
    const int32_t* hi = p.ranges + kHi * T_;
    const int64_t wb = lower_bound_i32(hi, b, en, int64_t(j0) + 1), we = lower_bound_i32(lo, b, en, j1);
    int64_t sb = 0, se = 0;
    if (p.use_sink) {
      sb = lower_bound_i32(p.ranges + kSinkHi * T_, b, en, int64_t(j0) + 1);
      se = lower_bound_i32(p.ranges + kSinkLo * T_, b, en, j1);
    }
    int lo0 = 0, hi0 = 0, lo1 = 0, hi1 = 0;
    const bool hw = wb < we, hs = sb < se;
    if (hw && hs && sb <= we && wb <= se) {
      lo0 = static_cast<int>(min(wb, sb));
      hi0 = static_cast<int>(max(we, se));
    } else {
      if (hs) {
        lo0 = static_cast<int>(sb);
        hi0 = static_cast<int>(se);
      }
      if (hw) {
        lo1 = static_cast<int>(wb);
        hi1 = static_cast<int>(we);
      }
    }
    s_span_lo[2 * e] = lo0;
    s_span_hi[2 * e] = hi0;
    s_span_lo[2 * e + 1] = lo1;
    s_span_hi[2 * e + 1] = hi1;
  }
  __syncthreads();
  const int nspans = 2 * p.K;
  if (tid == 0) {
    int acc = 0;
    for (int sp = 0; sp < nspans; ++sp) {
      s_blk_off[sp] = acc;
      acc += (s_span_hi[sp] - s_span_lo[sp] + BMQ - 1) / BMQ;
    }
    s_blk_off[nspans] = acc;
  }
  __syncthreads();
  return s_blk_off[nspans];
}

// Iteration `it` of a dK/dV pass over the spans of dkv_query_spans (total_blocks blocks per q head,
// the group's heads one after the other from h0): q head h, query rows [i0, min(i0 + BMQ, iend)) of
// one run.
template <int BMQ>
__device__ __forceinline__ void dkv_locate(int it, int total_blocks, int h0, const int* s_span_lo, const int* s_span_hi,
                                           const int* s_blk_off, int& h, int& i0, int& iend) {
  h = h0 + it / total_blocks;
  const int rem = it % total_blocks;
  int sp = 0;
  while (s_blk_off[sp + 1] <= rem) ++sp;
  i0 = s_span_lo[sp] + (rem - s_blk_off[sp]) * BMQ;
  iend = s_span_hi[sp];
}

template <int D, typename T, int BMQ>
__global__ void __launch_bounds__(128, 1) cod_attn_dkv_kernel(const CodAttnParams p) {
  using Cfg = DkvConfig<D, BMQ>;
  constexpr int BN = Cfg::kBN, NT = Cfg::kThreads, MF = Cfg::kMetaFields;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + BN * D;
  T* sQ = sV + BN * D;                                           // [2][BMQ][D]
  T* sdO = sQ + 2 * BMQ * D;                                     // [2][BMQ][D]
  int* s_meta = reinterpret_cast<int*>(smem + Cfg::kTileBytes);  // [2][MF][BMQ]
  int* s_span_lo = s_meta + 2 * MF * BMQ;                        // [2K]
  int* s_span_hi = s_span_lo + 2 * kMaxChain;                    // [2K]
  int* s_blk_off = s_span_hi + 2 * kMaxChain;                    // [2K + 1]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  // 1-D grid, key-block major (dkv_grid)
  const int hk = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.Hkv));
  const int j0 = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.Hkv)) * BN;
  const int j1 = min(j0 + BN, p.N);
  const int64_t T_ = p.T;

  // Query runs per depth that touch keys [j0, j1).
  const int total_blocks = dkv_query_spans<BMQ>(p, j0, j1, tid, s_span_lo, s_span_hi, s_blk_off);
  const int n_iters = total_blocks * p.group;

  const int64_t qld = int64_t(p.Hq) * D, kld = int64_t(p.Hkv) * D;
  const uint32_t sKa = smem_u32(sK), sVa = smem_u32(sV), sQa = smem_u32(sQ), sdOa = smem_u32(sdO);
  constexpr uint32_t kStageBytes = BMQ * D * 2;

  // Iteration `it`: q head h, query rows [i0, min(i0 + BMQ, iend)) of one run.
  auto locate = [&](int it, int& h, int& i0, int& iend) {
    dkv_locate<BMQ>(it, total_blocks, hk * p.group, s_span_lo, s_span_hi, s_blk_off, h, i0, iend);
  };
  // Issues the async copies of iteration `it` (Q, dO, row metadata) into `stage`.
  auto issue = [&](int it, int stage) {
    int h, i0, iend;
    locate(it, h, i0, iend);
    load_tile<BMQ, D, NT>(sQa + stage * kStageBytes, static_cast<const T*>(p.q) + int64_t(h) * D, qld, i0, iend, tid);
    load_tile<BMQ, D, NT>(sdOa + stage * kStageBytes, static_cast<const T*>(p.dout) + int64_t(h) * D, qld, i0, iend,
                          tid);
    // Row metadata by 4-byte cp.async as well, so no warp stalls on global loads here; rows
    // past the run are zero-filled, i.e. invalid (and never read as valid).
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

  load_tile<BN, D, NT>(sKa, static_cast<const T*>(p.rk) + int64_t(hk) * D, kld, j0, p.N, tid);
  load_tile<BN, D, NT>(sVa, static_cast<const T*>(p.rv) + int64_t(hk) * D, kld, j0, p.N, tid);
  if (n_iters > 0) issue(0, 0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) dk[n][x] = dv[n][x] = 0.f;
  const float sl2 = p.scale_log2;
  const int key_row[2] = {j0 + 16 * warp + g, j0 + 16 * warp + g + 8};

#pragma unroll 1
  for (int it = 0; it < n_iters; ++it) {
    const int stage = it & 1;
    if (it + 1 < n_iters) issue(it + 1, stage ^ 1);
    cp_async_commit();
    const uint32_t qt = sQa + stage * kStageBytes, dot = sdOa + stage * kStageBytes;
    const int* m = s_meta + stage * MF * BMQ;

    // S^T = K Q^T and dP^T = V dO^T: rows = this warp's 16 keys, columns = BMQ queries
    float st[BMQ / 8][4], dpt[BMQ / 8][4];
#pragma unroll
    for (int n = 0; n < BMQ / 8; ++n)
#pragma unroll
      for (int x = 0; x < 4; ++x) st[n][x] = dpt[n][x] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      frag_a<D>(ka, sKa, 16 * warp, kk, lane);
      frag_a<D>(va, sVa, 16 * warp, kk, lane);
#pragma unroll
      for (int np = 0; np < BMQ / 16; ++np) {
        uint32_t bf[4];
        frag_b_nk<D>(bf, qt, 16 * np, kk, lane);
        mma16816<T>(st[2 * np], ka, bf[0], bf[1]);
        mma16816<T>(st[2 * np + 1], ka, bf[2], bf[3]);
        frag_b_nk<D>(bf, dot, 16 * np, kk, lane);
        mma16816<T>(dpt[2 * np], va, bf[0], bf[1]);
        mma16816<T>(dpt[2 * np + 1], va, bf[2], bf[3]);
      }
    }
    // the block is "full" when every valid query row's window range covers all 64 keys
    auto covers = [&](int r) { return !m[4 * BMQ + r] || (m[r] <= j0 && j0 + BN <= m[BMQ + r]); };
    bool cov = covers(lane);
    if (BMQ > 32) cov = cov && covers((lane + 32) % BMQ);
    const bool full = __all_sync(0xffffffffu, cov);
    // P^T (stored in st) and dS^T (stored in dpt)
#pragma unroll
    for (int n = 0; n < BMQ / 8; ++n) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int qc = 8 * n + 2 * t + (x & 1);
        const int j = key_row[x >> 1];
        bool ok = full;
        if (!ok) {
          const RowRanges r{m[qc], m[BMQ + qc], m[2 * BMQ + qc], m[3 * BMQ + qc], m[4 * BMQ + qc]};
          ok = r.allows(j, INT_MAX);
        }
        const bool valid = m[4 * BMQ + qc] != 0;
        const float l2 = valid ? __int_as_float(m[5 * BMQ + qc]) * kLog2e : INFINITY;
        const float dl = __int_as_float(m[6 * BMQ + qc]);
        const float pv = ok ? fast_exp2(st[n][x] * sl2 - l2) : 0.f;
        st[n][x] = pv;
        dpt[n][x] = pv * (dpt[n][x] - dl);
      }
    }
    // dV += P^T dO, dK += dS^T Q (k-dim = queries)
#pragma unroll
    for (int kq = 0; kq < BMQ / 16; ++kq) {
      uint32_t pa[4], sa[4];
      pa[0] = Pack<T>::two(st[2 * kq][0], st[2 * kq][1]);
      pa[1] = Pack<T>::two(st[2 * kq][2], st[2 * kq][3]);
      pa[2] = Pack<T>::two(st[2 * kq + 1][0], st[2 * kq + 1][1]);
      pa[3] = Pack<T>::two(st[2 * kq + 1][2], st[2 * kq + 1][3]);
      sa[0] = Pack<T>::two(dpt[2 * kq][0], dpt[2 * kq][1]);
      sa[1] = Pack<T>::two(dpt[2 * kq][2], dpt[2 * kq][3]);
      sa[2] = Pack<T>::two(dpt[2 * kq + 1][0], dpt[2 * kq + 1][1]);
      sa[3] = Pack<T>::two(dpt[2 * kq + 1][2], dpt[2 * kq + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bf[4];
        frag_b_kn<D>(bf, dot, 16 * dp, kq, lane);
        mma16816<T>(dv[2 * dp], pa, bf[0], bf[1]);
        mma16816<T>(dv[2 * dp + 1], pa, bf[2], bf[3]);
        frag_b_kn<D>(bf, qt, 16 * dp, kq, lane);
        mma16816<T>(dk[2 * dp], sa, bf[0], bf[1]);
        mma16816<T>(dk[2 * dp + 1], sa, bf[2], bf[3]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
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
}

// ---------------------------------------------------------------- 4. dK/dV, chain pairs
template <int D, typename T>
__global__ void __launch_bounds__(128) cod_attn_dkv_chain_kernel(const CodAttnParams p) {
  constexpr int EPL = D / 32;
  const int64_t idx = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (idx >= int64_t(p.T) * p.Hkv) return;
  const int64_t c = idx / p.Hkv;
  const int hk = static_cast<int>(idx % p.Hkv);
  const int32_t* rc = p.rchain + c * p.K;
  const bool add_to_range = p.symmetric && c < p.N;  // the range pass wrote this row already
  if (add_to_range) {
    bool any = false;
    for (int e = 0; e < p.K; ++e) any |= rc[e] >= 0;
    if (!any) return;
  }
  const int64_t kld = int64_t(p.Hkv) * D, qld = int64_t(p.Hq) * D;
  const int64_t off = c * kld + int64_t(hk) * D + lane * EPL;
  float kv[EPL], vv[EPL], dk[EPL], dv[EPL];
  load_floats<EPL>(static_cast<const T*>(p.k) + off, kv);
  load_floats<EPL>(static_cast<const T*>(p.v) + off, vv);
#pragma unroll
  for (int x = 0; x < EPL; ++x) dk[x] = dv[x] = 0.f;
  const float sl2 = p.scale_log2;
  for (int e = 0; e < p.K; ++e) {
    const int64_t i = chain_row(rc[e], p.T);  // a layout row, or -1
    if (i < 0) continue;
    for (int h = hk * p.group; h < (hk + 1) * p.group; ++h) {
      float qv[EPL], dov[EPL];
      const int64_t qoff = i * qld + int64_t(h) * D + lane * EPL;
      load_floats<EPL>(static_cast<const T*>(p.q) + qoff, qv);
      load_floats<EPL>(static_cast<const T*>(p.dout) + qoff, dov);
      float s = 0.f, dp = 0.f;
#pragma unroll
      for (int x = 0; x < EPL; ++x) {
        s += qv[x] * kv[x];
        dp += dov[x] * vv[x];
      }
      s = warp_sum(s);
      dp = warp_sum(dp);
      const float pv = fast_exp2(s * sl2 - p.lse[int64_t(h) * p.T + i] * kLog2e);
      const float ds = pv * (dp - p.delta[int64_t(h) * p.T + i]);
#pragma unroll
      for (int x = 0; x < EPL; ++x) {
        dv[x] += pv * dov[x];
        dk[x] += ds * qv[x];
      }
    }
  }
#pragma unroll
  for (int x = 0; x < EPL; ++x) dk[x] *= p.scale;
  T* okp = static_cast<T*>(p.dk) + off;
  T* ovp = static_cast<T*>(p.dv) + off;
  if (add_to_range) {
    float ek[EPL], ev[EPL];
    load_floats<EPL>(okp, ek);
    load_floats<EPL>(ovp, ev);
#pragma unroll
    for (int x = 0; x < EPL; ++x) {
      dk[x] += ek[x];
      dv[x] += ev[x];
    }
  }
  store_floats<EPL>(okp, dk);
  store_floats<EPL>(ovp, dv);
}

// ---------------------------------------------------------------- launch
// The Hopper dQ (cod_attn_dq_wgmma.cuh) and dK/dV (cod_attn_bwd_wgmma.cuh) passes. Defined in
// cod_attn_{dq,bwd}_wgmma_sm90a.cu (compiled for sm_90a alone), or, in builds without them, in
// cod_attn_launch.cu as "not supported".
cudaError_t cod_attn_dq_wgmma_launch(const CodAttnParams& p, AttnDtype dtype, cudaStream_t stream);
cudaError_t cod_attn_dkv_wgmma_launch(const CodAttnParams& p, AttnDtype dtype, cudaStream_t stream);

// delta, dQ (query-major), dK/dV (key-major), chain dK/dV, all on `stream`, no host sync
// (graph-capturable). hopper: passes 2 and 3 on warpgroup MMAs (the caller checked that they run).
template <int D, typename T, int DQ_WARPS, int DKV_BMQ>
cudaError_t launch_bwd(const CodAttnParams& p, bool hopper, cudaStream_t stream) {
  if (p.T == 0 || p.Hq == 0) return cudaSuccess;
  constexpr AttnDtype kDtype = std::is_same<T, __half>::value ? AttnDtype::kFP16 : AttnDtype::kBF16;
  cudaError_t err;
  {
    const int64_t rows = int64_t(p.T) * p.Hq;
    cod_attn_delta_kernel<D, T><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(p);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (hopper) {
    if ((err = cod_attn_dq_wgmma_launch(p, kDtype, stream)) != cudaSuccess) return err;
  } else {
    using Cfg = DqConfig<D, DQ_WARPS, 64>;
    TileMap tm;
    const int ntiles = make_tile_map(p, Cfg::kBM, tm);
    auto kernel = cod_attn_dq_kernel<D, T, DQ_WARPS, 64>;
    const int smem = Cfg::kSmemBytes + Cfg::chain_bytes(p.K);
    if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) != cudaSuccess)
      return err;
    kernel<<<dim3(ntiles, p.Hq), Cfg::kThreads, smem, stream>>>(p, tm);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.N > 0) {
    if (hopper) {
      err = cod_attn_dkv_wgmma_launch(p, kDtype, stream);
    } else {
      using Cfg = DkvConfig<D, DKV_BMQ>;
      auto kernel = cod_attn_dkv_kernel<D, T, DKV_BMQ>;
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      if (err == cudaSuccess) {
        kernel<<<dkv_grid(p, Cfg::kBN), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
        err = cudaGetLastError();
      }
    }
    if (err != cudaSuccess) return err;
  }
  {
    const int64_t rows = int64_t(p.T) * p.Hkv;
    cod_attn_dkv_chain_kernel<D, T><<<static_cast<unsigned>((rows + 3) / 4), 128, 0, stream>>>(p);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace peagle::attention::cuda
