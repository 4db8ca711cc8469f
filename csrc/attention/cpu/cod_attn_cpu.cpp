// COD attention on the CPU (docs/design.md section 3): metadata, forward, backward.
//
// The same algorithm as the CUDA kernels, so the index logic the GPU relies on is exercised by
// the CPU tests: queries are processed in tiles of consecutive rows of one depth, each tile's
// depth-0/context keys are the blocks of at most two ranges (sink hull, window hull) masked per
// element by each row's own ranges, and the <= K chain keys of a row come from the chain table.
// The backward is deterministic: a query-major dQ pass, a key-major dK/dV pass whose queries
// (per depth) are contiguous index ranges found by binary search, and a pass over chain keys.
// Memory is O(T * tile): nothing of size T x T exists. Math in float (double for float64).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/attention_common.h"
#include "attention/attention_host.h"

namespace peagle::attention {
namespace {

constexpr int64_t kTileQ = 32;   // query rows per tile (forward, dQ)
constexpr int64_t kTileK = 64;   // keys per block
constexpr int64_t kTileQB = 64;  // query rows per block in the key-major dK/dV pass

struct Ranges {
  const int32_t* lo;
  const int32_t* hi;
  const int32_t* slo;
  const int32_t* shi;
  const int32_t* valid;
  bool allowed(int64_t i, int64_t j) const {
    return valid[i] && ((lo[i] <= j && j < hi[i]) || (slo[i] <= j && j < shi[i]));
  }
};

Ranges ranges_view(const at::Tensor& ranges) {
  const int32_t* p = ranges.data_ptr<int32_t>();
  const int64_t t = ranges.size(1);
  return {p + kLo * t, p + kHi * t, p + kSinkLo * t, p + kSinkHi * t, p + kValid * t};
}

// A query tile: rows [r0, r1) of one depth segment.
struct QTile {
  int64_t r0, r1;
};

std::vector<QTile> query_tiles(const std::vector<int64_t>& offsets, int64_t tile) {
  std::vector<QTile> out;
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += tile) out.push_back({r, std::min(r + tile, offsets[e + 1])});
  return out;
}

// Up to two disjoint index ranges [lo, hi): a window range and a sink range, merged into one
// when they touch (so that no index is visited twice).
struct Spans {
  int64_t lo[2], hi[2];
  int n = 0;
};

inline Spans merge_spans(int64_t wlo, int64_t whi, int64_t slo, int64_t shi) {
  Spans s;
  const bool has_w = wlo < whi, has_s = slo < shi;
  if (has_w && has_s && slo <= whi && wlo <= shi) {
    s.lo[0] = std::min(slo, wlo);
    s.hi[0] = std::max(shi, whi);
    s.n = 1;
  } else {
    if (has_s) {
      s.lo[s.n] = slo;
      s.hi[s.n] = shi;
      ++s.n;
    }
    if (has_w) {
      s.lo[s.n] = wlo;
      s.hi[s.n] = whi;
      ++s.n;
    }
  }
  return s;
}

// The key ranges a tile visits: the hull of its rows' sink ranges and the hull of their window
// ranges, merged when they touch. Keys are visited once: a block of one range is clipped to it.
Spans tile_key_spans(const Ranges& R, int64_t r0, int64_t r1, bool use_sink) {
  int64_t wlo = std::numeric_limits<int64_t>::max(), whi = std::numeric_limits<int64_t>::min();
  int64_t slo = wlo, shi = whi;
  for (int64_t i = r0; i < r1; ++i) {
    if (!R.valid[i]) continue;
    if (R.lo[i] < R.hi[i]) {
      wlo = std::min<int64_t>(wlo, R.lo[i]);
      whi = std::max<int64_t>(whi, R.hi[i]);
    }
    if (use_sink && R.slo[i] < R.shi[i]) {
      slo = std::min<int64_t>(slo, R.slo[i]);
      shi = std::max<int64_t>(shi, R.shi[i]);
    }
  }
  return merge_spans(wlo, whi, slo, shi);
}

template <typename acc_t>
inline acc_t dot(const acc_t* a, const acc_t* b, int64_t n) {
  acc_t s = 0;
  for (int64_t x = 0; x < n; ++x) s += a[x] * b[x];
  return s;
}

// s[0..nj) += sum_d q[d] * kt[d * ld + jj]: the inner loop runs over keys (vectorises).
template <typename acc_t>
inline void row_times_block(const acc_t* q, const acc_t* kt, int64_t D, int64_t nj, int64_t ld, acc_t* s) {
  for (int64_t jj = 0; jj < nj; ++jj) s[jj] = 0;
  for (int64_t d = 0; d < D; ++d) {
    const acc_t qd = q[d];
    const acc_t* row = kt + d * ld;
    for (int64_t jj = 0; jj < nj; ++jj) s[jj] += qd * row[jj];
  }
}

// dst[d * ld + jj] = src[(j0 + jj) * stride + d]
template <typename acc_t>
inline void transpose_block(const acc_t* src, int64_t stride, int64_t j0, int64_t nj, int64_t D, int64_t ld,
                            acc_t* dst) {
  for (int64_t jj = 0; jj < nj; ++jj) {
    const acc_t* row = src + (j0 + jj) * stride;
    for (int64_t d = 0; d < D; ++d) dst[d * ld + jj] = row[d];
  }
}

// Inputs as the compute type, plus their geometry.
struct Geometry {
  int64_t T, N, Hq, Hkv, D, group;
  bool cross;
};

template <typename acc_t>
struct Inputs {
  const acc_t* q;  // [T, Hq, D]
  const acc_t* k;  // [T, Hkv, D] layout tokens
  const acc_t* v;
  const acc_t* rk;  // range keys: symmetric = k (rows 0..N-1), cross = context_k [N, Hkv, D]
  const acc_t* rv;
};

// ---------------------------------------------------------------- forward
template <typename acc_t>
void forward_impl(const Geometry& G, const Inputs<acc_t>& in, const Ranges& R, const int32_t* chain, int64_t K,
                  const std::vector<int64_t>& offsets, double scale_d, bool use_sink, acc_t* out, acc_t* lse) {
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t D = G.D;
  const int64_t qs = G.Hq * D, ks = G.Hkv * D;
  const std::vector<QTile> tiles = query_tiles(offsets, kTileQ);
  const int64_t ntiles = static_cast<int64_t>(tiles.size());
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, ntiles * G.Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> kt(D * kTileK), s(kTileK), acc(kTileQ * D), m(kTileQ), l(kTileQ);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / ntiles, hk = h / G.group;
      const QTile tile = tiles[task % ntiles];
      const int64_t rows = tile.r1 - tile.r0;
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::fill(m.begin(), m.end(), ninf);
      std::fill(l.begin(), l.end(), acc_t(0));
      auto update = [&](int64_t r, acc_t sv, const acc_t* vrow) {  // online softmax, one key
        acc_t* o = acc.data() + r * D;
        if (sv > m[r]) {
          const acc_t alpha = std::exp(m[r] - sv);  // m = -inf -> 0
          for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
          l[r] *= alpha;
          m[r] = sv;
        }
        const acc_t p = std::exp(sv - m[r]);
        l[r] += p;
        for (int64_t d = 0; d < D; ++d) o[d] += p * vrow[d];
      };
      // chain keys first (layout tokens of the row's own chain)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = tile.r0 + r;
        for (int64_t e = 0; e < K; ++e) {
          const int32_t c = chain[i * K + e];
          if (c < 0) continue;
          const acc_t sv = dot(in.q + i * qs + h * D, in.k + c * ks + hk * D, D) * scale;
          update(r, sv, in.v + c * ks + hk * D);
        }
      }
      const Spans spans = tile_key_spans(R, tile.r0, tile.r1, use_sink);
      for (int sp = 0; sp < spans.n; ++sp) {
        for (int64_t j0 = spans.lo[sp]; j0 < spans.hi[sp]; j0 += kTileK) {
          const int64_t nj = std::min(kTileK, spans.hi[sp] - j0);
          transpose_block(in.rk + hk * D, ks, j0, nj, D, kTileK, kt.data());
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = tile.r0 + r;
            if (!R.valid[i]) continue;
            row_times_block(in.q + i * qs + h * D, kt.data(), D, nj, kTileK, s.data());
            for (int64_t jj = 0; jj < nj; ++jj) {
              if (!R.allowed(i, j0 + jj)) continue;
              update(r, s[jj] * scale, in.rv + (j0 + jj) * ks + hk * D);
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = tile.r0 + r;
        acc_t* o = out + i * qs + h * D;
        if (!R.valid[i] || l[r] == acc_t(0)) {
          for (int64_t d = 0; d < D; ++d) o[d] = 0;
          lse[h * G.T + i] = std::numeric_limits<acc_t>::infinity();
          continue;
        }
        const acc_t inv = acc_t(1) / l[r];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
        lse[h * G.T + i] = m[r] + std::log(l[r]);
      }
    }
  });
}

// ---------------------------------------------------------------- backward
template <typename acc_t>
struct BwdInputs {
  const acc_t* dout;   // [T, Hq, D]
  const acc_t* lse;    // [Hq, T] (float64 for float64 inputs, else float32)
  const acc_t* delta;  // [Hq, T]: rowsum(dO * O)
};

// dQ: query-major, same iteration as the forward.
template <typename acc_t>
void dq_impl(const Geometry& G, const Inputs<acc_t>& in, const BwdInputs<acc_t>& bw, const Ranges& R,
             const int32_t* chain, int64_t K, const std::vector<int64_t>& offsets, double scale_d, bool use_sink,
             acc_t* dq) {
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t D = G.D;
  const int64_t qs = G.Hq * D, ks = G.Hkv * D;
  const std::vector<QTile> tiles = query_tiles(offsets, kTileQ);
  const int64_t ntiles = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, ntiles * G.Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> kt(D * kTileK), vt(D * kTileK), s(kTileK), dp(kTileK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / ntiles, hk = h / G.group;
      const QTile tile = tiles[task % ntiles];
      for (int64_t i = tile.r0; i < tile.r1; ++i) {
        acc_t* g = dq + i * qs + h * D;
        for (int64_t d = 0; d < D; ++d) g[d] = 0;
      }
      for (int64_t i = tile.r0; i < tile.r1; ++i) {
        if (!R.valid[i]) continue;
        const acc_t* qi = in.q + i * qs + h * D;
        const acc_t* doi = bw.dout + i * qs + h * D;
        const acc_t lse = bw.lse[h * G.T + i], delta = bw.delta[h * G.T + i];
        acc_t* g = dq + i * qs + h * D;
        for (int64_t e = 0; e < K; ++e) {
          const int32_t c = chain[i * K + e];
          if (c < 0) continue;
          const acc_t* kc = in.k + c * ks + hk * D;
          const acc_t p = std::exp(dot(qi, kc, D) * scale - lse);
          const acc_t ds = p * (dot(doi, in.v + c * ks + hk * D, D) - delta);
          for (int64_t d = 0; d < D; ++d) g[d] += ds * kc[d];
        }
      }
      const Spans spans = tile_key_spans(R, tile.r0, tile.r1, use_sink);
      for (int sp = 0; sp < spans.n; ++sp) {
        for (int64_t j0 = spans.lo[sp]; j0 < spans.hi[sp]; j0 += kTileK) {
          const int64_t nj = std::min(kTileK, spans.hi[sp] - j0);
          transpose_block(in.rk + hk * D, ks, j0, nj, D, kTileK, kt.data());
          transpose_block(in.rv + hk * D, ks, j0, nj, D, kTileK, vt.data());
          for (int64_t i = tile.r0; i < tile.r1; ++i) {
            if (!R.valid[i]) continue;
            const acc_t lse = bw.lse[h * G.T + i], delta = bw.delta[h * G.T + i];
            row_times_block(in.q + i * qs + h * D, kt.data(), D, nj, kTileK, s.data());
            row_times_block(bw.dout + i * qs + h * D, vt.data(), D, nj, kTileK, dp.data());
            acc_t* g = dq + i * qs + h * D;
            for (int64_t jj = 0; jj < nj; ++jj) {
              if (!R.allowed(i, j0 + jj)) continue;
              const acc_t ds = std::exp(s[jj] * scale - lse) * (dp[jj] - delta);
              const acc_t* kj = in.rk + (j0 + jj) * ks + hk * D;
              for (int64_t d = 0; d < D; ++d) g[d] += ds * kj[d];
            }
          }
        }
      }
      for (int64_t i = tile.r0; i < tile.r1; ++i) {
        acc_t* g = dq + i * qs + h * D;
        for (int64_t d = 0; d < D; ++d) g[d] *= scale;
      }
    }
  });
}

// Query index ranges of depth segment [b, e) whose ranges touch key block [j0, j1):
// window: hi > j0 and lo < j1; sink: shi > j0 and slo < j1 (each a contiguous run because the
// bounds are nondecreasing within a depth). Overlapping runs are merged so no query is visited
// twice for the same key block.
inline Spans key_block_queries(const Ranges& R, int64_t b, int64_t e, int64_t j0, int64_t j1, bool use_sink) {
  const int64_t wb = lower_bound_i32(R.hi, b, e, j0 + 1), we = lower_bound_i32(R.lo, b, e, j1);
  int64_t sb = 0, se = 0;
  if (use_sink) {
    sb = lower_bound_i32(R.shi, b, e, j0 + 1);
    se = lower_bound_i32(R.slo, b, e, j1);
  }
  return merge_spans(wb, we, sb, se);
}

// dK/dV of the range keys (symmetric: rows 0..N-1 of k/v; cross: context rows), key-major.
template <typename acc_t>
void dkv_range_impl(const Geometry& G, const Inputs<acc_t>& in, const BwdInputs<acc_t>& bw, const Ranges& R,
                    const std::vector<int64_t>& offsets, double scale_d, bool use_sink, acc_t* dk, acc_t* dv) {
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t D = G.D;
  const int64_t qs = G.Hq * D, ks = G.Hkv * D;
  const int64_t nkeys = G.N, nblocks = (nkeys + kTileK - 1) / kTileK;
  const int64_t ndepths = static_cast<int64_t>(offsets.size()) - 1;
  at::parallel_for(0, nblocks * G.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> qt(D * kTileQB), dot_(D * kTileQB), s(kTileQB), dp(kTileQB);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t hk = task / nblocks, j0 = (task % nblocks) * kTileK, j1 = std::min(j0 + kTileK, nkeys);
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t d = 0; d < D; ++d) dk[j * ks + hk * D + d] = dv[j * ks + hk * D + d] = 0;
      for (int64_t e = 0; e < ndepths; ++e) {
        const Spans qsp = key_block_queries(R, offsets[e], offsets[e + 1], j0, j1, use_sink);
        for (int sp = 0; sp < qsp.n; ++sp) {
          for (int64_t i0 = qsp.lo[sp]; i0 < qsp.hi[sp]; i0 += kTileQB) {
            const int64_t ni = std::min(kTileQB, qsp.hi[sp] - i0);
            for (int64_t h = hk * G.group; h < (hk + 1) * G.group; ++h) {
              transpose_block(in.q + h * D, qs, i0, ni, D, kTileQB, qt.data());
              transpose_block(bw.dout + h * D, qs, i0, ni, D, kTileQB, dot_.data());
              for (int64_t j = j0; j < j1; ++j) {
                row_times_block(in.rk + j * ks + hk * D, qt.data(), D, ni, kTileQB, s.data());
                row_times_block(in.rv + j * ks + hk * D, dot_.data(), D, ni, kTileQB, dp.data());
                acc_t* gk = dk + j * ks + hk * D;
                acc_t* gv = dv + j * ks + hk * D;
                for (int64_t ii = 0; ii < ni; ++ii) {
                  const int64_t i = i0 + ii;
                  if (!R.allowed(i, j)) continue;
                  const acc_t p = std::exp(s[ii] * scale - bw.lse[h * G.T + i]);
                  const acc_t ds = p * (dp[ii] - bw.delta[h * G.T + i]);
                  const acc_t* qi = in.q + i * qs + h * D;
                  const acc_t* doi = bw.dout + i * qs + h * D;
                  for (int64_t d = 0; d < D; ++d) {
                    gv[d] += p * doi[d];
                    gk[d] += ds * qi[d];
                  }
                }
              }
            }
          }
        }
      }
    }
  });
}

// dK/dV contributions of chain pairs: key row c of the layout gets them from rchain[c][*].
// `accumulate`: add to what is there (symmetric depth-0 rows already hold their range part).
template <typename acc_t>
void dkv_chain_impl(const Geometry& G, const Inputs<acc_t>& in, const BwdInputs<acc_t>& bw, const int32_t* rchain,
                    int64_t K, double scale_d, acc_t* dk, acc_t* dv, int64_t accumulate_below) {
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t D = G.D;
  const int64_t qs = G.Hq * D, ks = G.Hkv * D;
  at::parallel_for(0, G.T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t hk = 0; hk < G.Hkv; ++hk) {
        acc_t* gk = dk + c * ks + hk * D;
        acc_t* gv = dv + c * ks + hk * D;
        if (c >= accumulate_below)
          for (int64_t d = 0; d < D; ++d) gk[d] = gv[d] = 0;
        const acc_t* kc = in.k + c * ks + hk * D;
        const acc_t* vc = in.v + c * ks + hk * D;
        for (int64_t e = 0; e < K; ++e) {
          const int32_t i = rchain[c * K + e];
          if (i < 0) continue;
          for (int64_t h = hk * G.group; h < (hk + 1) * G.group; ++h) {
            const acc_t* qi = in.q + i * qs + h * D;
            const acc_t* doi = bw.dout + i * qs + h * D;
            const acc_t p = std::exp(dot(qi, kc, D) * scale - bw.lse[h * G.T + i]);
            const acc_t ds = p * (dot(doi, vc, D) - bw.delta[h * G.T + i]);
            for (int64_t d = 0; d < D; ++d) {
              gv[d] += p * doi[d];
              gk[d] += ds * qi[d];
            }
          }
        }
      }
    }
  });
}

// Calls f(double{}) for float64 compute, f(float{}) otherwise.
template <typename F>
void dispatch_compute(at::ScalarType t, F&& f) {
  if (t == at::kDouble)
    f(double{});
  else
    f(float{});
}

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor as_compute(const at::Tensor& t) { return t.to(compute_type(t.scalar_type())).contiguous(); }

}  // namespace

// ---------------------------------------------------------------- ops
std::tuple<at::Tensor, at::Tensor> cod_attention_metadata_cpu(const at::Tensor& anchor, const at::Tensor& depth,
                                                              const at::Tensor& document_ids,
                                                              at::IntArrayRef depth_offsets, bool cross, int64_t window,
                                                              int64_t sink) {
  check_metadata_inputs(anchor, depth, document_ids, depth_offsets, cross, window, sink);
  const int64_t T = anchor.size(0), N = document_ids.size(0), K = static_cast<int64_t>(depth_offsets.size()) - 1;
  const int32_t* a = anchor.data_ptr<int32_t>();
  const int32_t* dep = depth.data_ptr<int32_t>();
  const int32_t* doc = document_ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < T; ++i) {
    TORCH_CHECK_VALUE(a[i] >= 0 && a[i] < N, "cod_attention: layout anchor ", a[i], " at token ", i,
                      " is outside [0, N=", N, ")");
    TORCH_CHECK_VALUE(dep[i] >= 0 && dep[i] < K, "cod_attention: layout depth ", dep[i], " at token ", i,
                      " is outside [0, K=", K, ")");
  }
  for (int64_t e = 0; e < K; ++e)
    for (int64_t i = depth_offsets[e]; i < depth_offsets[e + 1]; ++i) {
      TORCH_CHECK_VALUE(dep[i] == e, "cod_attention: token ", i, " has depth ", dep[i], " but sits in the depth-", e,
                        " segment of depth_offsets");
      TORCH_CHECK_VALUE(i == depth_offsets[e] || a[i - 1] < a[i],
                        "cod_attention: anchors must be strictly increasing within a depth (token ", i, ")");
    }
  if (!cross)
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK_VALUE(a[i] == i,
                        "cod_attention: symmetric mode needs depth 0 = every position 0..N-1 "
                        "(cod_sample depth0='all'); token ",
                        i, " has anchor ", a[i]);
  std::vector<int32_t> start(N);
  for (int64_t p = 0; p < N; ++p) start[p] = (p > 0 && doc[p] == doc[p - 1]) ? start[p - 1] : static_cast<int32_t>(p);
  at::Tensor ranges = at::empty({kNumRangeFields, T}, anchor.options());
  at::Tensor chains = at::full({2, T, K}, -1, anchor.options());
  int32_t* rg = ranges.data_ptr<int32_t>();
  int32_t* ch = chains.data_ptr<int32_t>();
  int32_t* rc = ch + T * K;
  for (int64_t i = 0; i < T; ++i) {
    const TokenRanges r = token_ranges(a[i], dep[i], doc[a[i]], start[a[i]], window, sink);
    rg[kLo * T + i] = r.lo;
    rg[kHi * T + i] = r.hi;
    rg[kSinkLo * T + i] = r.slo;
    rg[kSinkHi * T + i] = r.shi;
    rg[kValid * T + i] = r.valid;
    for (int64_t e = 0; e < K; ++e) {
      const int32_t c =
          chain_key(a, depth_offsets[e], depth_offsets[e + 1], a[i], dep[i], static_cast<int>(e), !cross, r);
      ch[i * K + e] = c;
      if (c >= 0) rc[static_cast<int64_t>(c) * K + dep[i]] = static_cast<int32_t>(i);
    }
  }
  return {ranges, chains};
}

std::tuple<at::Tensor, at::Tensor> cod_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const std::optional<at::Tensor>& context_k,
                                                         const std::optional<at::Tensor>& context_v,
                                                         const at::Tensor& ranges, const at::Tensor& chains,
                                                         at::IntArrayRef depth_offsets, double scale, bool use_sink) {
  const AttnShapes S = check_attention_inputs("cod_attention_fwd", q, k, v, context_k, context_v, ranges, chains,
                                              depth_offsets, /*cuda=*/false);
  check_metadata_contents("cod_attention_fwd", S, ranges, chains, depth_offsets, use_sink);
  const at::Tensor qc = as_compute(q), kc = as_compute(k), vc = as_compute(v);
  const at::Tensor ckc = S.cross ? as_compute(*context_k) : kc, cvc = S.cross ? as_compute(*context_v) : vc;
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  at::Tensor lse = at::empty({S.Hq, S.T}, qc.options());
  const Geometry G{S.T, S.N, S.Hq, S.Hkv, S.D, S.Hq / std::max<int64_t>(S.Hkv, 1), S.cross};
  const std::vector<int64_t> offsets(depth_offsets.begin(), depth_offsets.end());
  const Ranges R = ranges_view(ranges);
  dispatch_compute(qc.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    const Inputs<scalar_t> in{qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                              ckc.data_ptr<scalar_t>(), cvc.data_ptr<scalar_t>()};
    forward_impl<scalar_t>(G, in, R, chains.data_ptr<int32_t>(), S.K, offsets, scale, use_sink,
                           out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
  });
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> cod_attention_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& context_k, const std::optional<at::Tensor>& context_v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& ranges, const at::Tensor& chains, at::IntArrayRef depth_offsets,
    double scale, bool use_sink) {
  const AttnShapes S = check_attention_inputs("cod_attention_bwd", q, k, v, context_k, context_v, ranges, chains,
                                              depth_offsets, /*cuda=*/false);
  check_backward_inputs(S, dout, out, lse);
  check_metadata_contents("cod_attention_bwd", S, ranges, chains, depth_offsets, use_sink);
  const int32_t* chain = chains.data_ptr<int32_t>();
  const int32_t* rchain = chain + S.T * S.K;
  const at::Tensor qc = as_compute(q), kc = as_compute(k), vc = as_compute(v);
  const at::Tensor ckc = S.cross ? as_compute(*context_k) : kc, cvc = S.cross ? as_compute(*context_v) : vc;
  const at::Tensor doc = dout.to(qc.scalar_type()).contiguous(), oc = out.to(qc.scalar_type()).contiguous();
  const at::Tensor lsec = lse.to(qc.scalar_type()).contiguous();
  // delta[h, i] = rowsum(dO * O), in the compute type
  const at::Tensor delta = doc.mul(oc).sum(-1).transpose(0, 1).contiguous();
  at::Tensor dq = at::empty(qc.sizes(), qc.options());
  at::Tensor dk = at::empty(kc.sizes(), kc.options());
  at::Tensor dv = at::empty(vc.sizes(), vc.options());
  at::Tensor dck = S.cross ? at::empty(ckc.sizes(), ckc.options()) : at::empty({0, S.Hkv, S.D}, qc.options());
  at::Tensor dcv = S.cross ? at::empty(cvc.sizes(), cvc.options()) : at::empty({0, S.Hkv, S.D}, qc.options());
  const Geometry G{S.T, S.N, S.Hq, S.Hkv, S.D, S.Hq / std::max<int64_t>(S.Hkv, 1), S.cross};
  const std::vector<int64_t> offsets(depth_offsets.begin(), depth_offsets.end());
  const Ranges R = ranges_view(ranges);
  dispatch_compute(qc.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    const Inputs<scalar_t> in{qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                              ckc.data_ptr<scalar_t>(), cvc.data_ptr<scalar_t>()};
    const BwdInputs<scalar_t> bw{doc.data_ptr<scalar_t>(), lsec.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>()};
    dq_impl<scalar_t>(G, in, bw, R, chain, S.K, offsets, scale, use_sink, dq.data_ptr<scalar_t>());
    scalar_t* rdk = S.cross ? dck.data_ptr<scalar_t>() : dk.data_ptr<scalar_t>();
    scalar_t* rdv = S.cross ? dcv.data_ptr<scalar_t>() : dv.data_ptr<scalar_t>();
    if (G.N > 0) dkv_range_impl<scalar_t>(G, in, bw, R, offsets, scale, use_sink, rdk, rdv);
    // the range pass wrote rows 0..N-1 of dk/dv in symmetric mode: the chain pass adds there
    dkv_chain_impl<scalar_t>(G, in, bw, rchain, S.K, scale, dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
                             S.cross ? 0 : G.N);
    // dK = scale * sum dS q
    dk.mul_(scale);
    if (S.cross) dck.mul_(scale);
  });
  const auto dt = q.scalar_type();
  return {dq.to(dt), dk.to(dt), dv.to(dt), dck.to(dt), dcv.to(dt)};
}

}  // namespace peagle::attention

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("cod_attention_metadata", &peagle::attention::cod_attention_metadata_cpu);
  m.impl("cod_attention_fwd", &peagle::attention::cod_attention_fwd_cpu);
  m.impl("cod_attention_bwd", &peagle::attention::cod_attention_bwd_cpu);
}
