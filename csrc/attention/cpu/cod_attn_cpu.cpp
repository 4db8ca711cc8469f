// COD attention on the CPU (docs/design.md section 3): metadata, forward, backward.
//
// The same iteration as the CUDA kernels, so the index logic the GPU relies on is exercised by
// the CPU tests: queries are processed in tiles of consecutive rows of one depth, each tile's
// depth-0/context keys are the blocks of at most two ranges (sink hull, window hull) masked per
// element by each row's own ranges, and the <= K chain keys of a row come from the chain table.
// A tile's block products (S = Q K^T, dP = dO V^T, P V, dS K, P^T dO, dS^T Q) are GEMMs through
// the BLAS torch is built with; the softmax between them runs row by row over the allowed keys
// (common/row_math.h). The backward is deterministic: a query-major dQ pass, a key-major dK/dV
// pass whose queries (per depth) are contiguous index ranges found by binary search, and a pass
// over chain keys. Memory is O(tile x block) per thread: nothing of size T x T exists. Math in
// float (double for float64).
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/attention_common.h"
#include "attention/attention_host.h"
#include "common/row_math.h"

namespace peagle::attention {
namespace {

using cpu::exp_shifted;
using cpu::grad_scores;
using cpu::span_max;
using cpu::span_sum;

// Block sizes of the GEMMs: S = Q K^T is [kTileQ, kBlockK] in the forward and the dQ pass; the
// key-major dK/dV pass takes kTileK keys per task (its unit of parallel work) against sub-tiles
// of kTileQB queries.
constexpr int64_t kTileQ = 64;    // query rows per tile (forward, dQ)
constexpr int64_t kBlockK = 256;  // keys per block (forward, dQ)
constexpr int64_t kTileK = 64;    // keys per task (dK/dV)
constexpr int64_t kTileQB = 128;  // query rows per sub-tile (dK/dV)

struct Ranges {
  const int32_t* lo;
  const int32_t* hi;
  const int32_t* slo;
  const int32_t* shi;
  const int32_t* valid;
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

// The keys of block [j0, j0 + nj) that query i attends through its ranges, as at most two runs
// in block coordinates [0, nj), the sink run first (the sink range lies below the window range).
inline Spans row_block_keys(const Ranges& R, int64_t i, int64_t j0, int64_t nj, bool use_sink) {
  if (!R.valid[i]) return Spans{};
  auto clip = [&](int64_t x) { return std::min(std::max(x - j0, int64_t(0)), nj); };
  return merge_spans(clip(R.lo[i]), clip(R.hi[i]), use_sink ? clip(R.slo[i]) : 0, use_sink ? clip(R.shi[i]) : 0);
}

// A row-major [rows, cols] view with leading dimension ld of memory the caller owns, for the
// block GEMMs (at::mm_out / at::addmm_out reach the BLAS torch is built with).
template <typename acc_t>
at::Tensor matrix(const acc_t* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<acc_t*>(p), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value));
}

// Per-thread scratch from torch's allocator (64-byte aligned, so the BLAS takes the same path
// every run).
template <typename acc_t>
at::Tensor scratch(int64_t n) {
  return at::empty({n}, at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value));
}

// The (row, head) vectors of a [rows, H, D] input that hold a non-finite value. A block GEMM
// would spread such a value through the zeros of a masked P or dS (0 * NaN = NaN) to rows that do
// not attend it; block_product treats blocks that contain one apart. Empty when every value is
// finite, the common case: then no block is checked.
struct NonFinite {
  at::Tensor flags;  // bool [rows, H], or undefined
  int64_t H = 0;
  bool any(int64_t r0, int64_t n, int64_t h) const {
    if (!flags.defined()) return false;
    const bool* f = flags.const_data_ptr<bool>();
    for (int64_t r = r0; r < r0 + n; ++r)
      if (f[r * H + h]) return true;
    return false;
  }
};

template <typename acc_t>
NonFinite non_finite_rows(const at::Tensor& x) {  // x: contiguous [rows, H, D] of acc_t
  NonFinite nf;
  nf.H = x.size(1);
  if (x.numel() == 0) return nf;
  at::Tensor flags = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kBool));
  if (cpu::non_finite_flags(x.const_data_ptr<acc_t>(), x.size(0) * x.size(1), x.size(2), flags.data_ptr<bool>()))
    nf.flags = flags;
  return nf;
}

// Y += M X (key_rows_out = false: X holds the block's key rows, Y its query rows) or Y += M^T X
// (true: X holds query rows, Y key rows), M = P or dS [rows, nj] of query rows [r0, r0 + rows)
// against keys [j0, j0 + nj), as one GEMM. When rows of X hold a non-finite value (bad_x.any over
// x0..x0+nx of head h), the GEMM reads a copy of X whose such rows are 0, so a row of Y that meets
// them only through zeros of M is bitwise what it is without them, and the allowed pairs with
// such a row are added after: the rows that attend a NaN get NaN, the others do not.
template <typename acc_t>
void block_product(const Ranges& R, int64_t r0, int64_t rows, int64_t j0, int64_t nj, bool use_sink, const acc_t* M,
                   const acc_t* X, int64_t ldx, const NonFinite& bad_x, int64_t x0, int64_t h, at::Tensor& xbuf,
                   acc_t* Y, int64_t D, bool key_rows_out) {
  const int64_t ny = key_rows_out ? nj : rows, nx = key_rows_out ? rows : nj;
  at::Tensor y = matrix(Y, ny, D, D);
  const at::Tensor m = matrix(M, rows, nj, nj);
  if (!bad_x.any(x0, nx, h)) {
    at::addmm_out(y, y, key_rows_out ? m.t() : m, matrix(X, nx, D, ldx));
    return;
  }
  if (!xbuf.defined()) xbuf = scratch<acc_t>(std::max(kBlockK, kTileQB) * D);
  acc_t* xc = xbuf.data_ptr<acc_t>();
  const bool* flag = bad_x.flags.const_data_ptr<bool>();
  auto flagged = [&](int64_t x) { return flag[(x0 + x) * bad_x.H + h]; };
  for (int64_t x = 0; x < nx; ++x)
    for (int64_t d = 0; d < D; ++d) xc[x * D + d] = flagged(x) ? acc_t(0) : X[x * ldx + d];
  at::addmm_out(y, y, key_rows_out ? m.t() : m, matrix(xc, nx, D, D));
  for (int64_t r = 0; r < rows; ++r) {
    const Spans ks = row_block_keys(R, r0 + r, j0, nj, use_sink);
    for (int sp = 0; sp < ks.n; ++sp)
      for (int64_t jj = ks.lo[sp]; jj < ks.hi[sp]; ++jj) {
        const int64_t xr = key_rows_out ? r : jj;
        if (!flagged(xr)) continue;
        const acc_t mv = M[r * nj + jj];
        const acc_t* xv = X + xr * ldx;
        acc_t* yv = Y + (key_rows_out ? jj : r) * D;
        for (int64_t d = 0; d < D; ++d) yv[d] += mv * xv[d];
      }
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
// Online softmax over one key block, per row: S (already scaled) becomes P = exp(S - m_new) on
// the row's allowed keys and 0 elsewhere, ready for the P V GEMM; m, l and the row of O follow.
template <typename acc_t>
void softmax_block(const Ranges& R, int64_t r0, int64_t rows, int64_t j0, int64_t nj, bool use_sink, acc_t* s,
                   acc_t* acc, int64_t D, acc_t* m, acc_t* l) {
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* srow = s + r * nj;
    const Spans ks = row_block_keys(R, r0 + r, j0, nj, use_sink);
    acc_t bm = -std::numeric_limits<acc_t>::infinity();
    for (int sp = 0; sp < ks.n; ++sp) bm = std::max(bm, span_max(srow + ks.lo[sp], ks.hi[sp] - ks.lo[sp]));
    if (ks.n > 0 && bm > m[r]) {
      const acc_t alpha = std::exp(m[r] - bm);  // m = -inf -> 0
      acc_t* o = acc + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
      l[r] *= alpha;
      m[r] = bm;
    }
    int64_t cursor = 0;
    for (int sp = 0; sp < ks.n; ++sp) {
      std::fill(srow + cursor, srow + ks.lo[sp], acc_t(0));
      exp_shifted(srow + ks.lo[sp], ks.hi[sp] - ks.lo[sp], m[r]);
      l[r] += span_sum(srow + ks.lo[sp], ks.hi[sp] - ks.lo[sp]);
      cursor = ks.hi[sp];
    }
    std::fill(srow + cursor, srow + nj, acc_t(0));
  }
}

// Per (query tile, head): chain keys one by one, then the tile's key spans in blocks of kBlockK:
// S = Q K^T and O += P V as GEMMs, the online softmax between them row by row.
template <typename acc_t>
void forward_impl(const Geometry& G, const Inputs<acc_t>& in, const Ranges& R, const int32_t* chain, int64_t K,
                  const std::vector<int64_t>& offsets, double scale_d, bool use_sink, const NonFinite& bad_rv,
                  acc_t* out, acc_t* lse) {
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t D = G.D;
  const int64_t qs = G.Hq * D, ks = G.Hkv * D;
  const std::vector<QTile> tiles = query_tiles(offsets, kTileQ);
  const int64_t ntiles = static_cast<int64_t>(tiles.size());
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, ntiles * G.Hq, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor sbuf = scratch<acc_t>(kTileQ * kBlockK), accbuf = scratch<acc_t>(kTileQ * D), xbuf;
    acc_t* s = sbuf.data_ptr<acc_t>();
    acc_t* acc = accbuf.data_ptr<acc_t>();
    std::vector<acc_t> m(kTileQ), l(kTileQ);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / ntiles, hk = h / G.group;
      const QTile tile = tiles[task % ntiles];
      const int64_t rows = tile.r1 - tile.r0;
      std::fill(acc, acc + rows * D, acc_t(0));
      std::fill(m.begin(), m.end(), ninf);
      std::fill(l.begin(), l.end(), acc_t(0));
      // chain keys first (layout tokens of the row's own chain), one by one
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = tile.r0 + r;
        acc_t* o = acc + r * D;
        for (int64_t e = 0; e < K; ++e) {
          const int32_t c = chain[i * K + e];
          if (c < 0) continue;
          const acc_t sv = dot(in.q + i * qs + h * D, in.k + c * ks + hk * D, D) * scale;
          if (sv > m[r]) {
            const acc_t alpha = std::exp(m[r] - sv);
            for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
            l[r] *= alpha;
            m[r] = sv;
          }
          const acc_t p = std::exp(sv - m[r]);
          l[r] += p;
          const acc_t* vc = in.v + c * ks + hk * D;
          for (int64_t d = 0; d < D; ++d) o[d] += p * vc[d];
        }
      }
      const at::Tensor qt = matrix(in.q + tile.r0 * qs + h * D, rows, D, qs);
      const Spans spans = tile_key_spans(R, tile.r0, tile.r1, use_sink);
      for (int sp = 0; sp < spans.n; ++sp) {
        for (int64_t j0 = spans.lo[sp]; j0 < spans.hi[sp]; j0 += kBlockK) {
          const int64_t nj = std::min(kBlockK, spans.hi[sp] - j0);
          at::Tensor st = matrix(s, rows, nj, nj);
          at::addmm_out(st, st, qt, matrix(in.rk + j0 * ks + hk * D, nj, D, ks).t(), /*beta=*/0, /*alpha=*/scale);
          softmax_block(R, tile.r0, rows, j0, nj, use_sink, s, acc, D, m.data(), l.data());
          block_product(R, tile.r0, rows, j0, nj, use_sink, s, in.rv + j0 * ks + hk * D, ks, bad_rv, j0, hk, xbuf, acc,
                        D, /*key_rows_out=*/false);
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

// Given S = scale Q K^T and dP = dO V^T of rows [r0, r0 + rows) against keys [j0, j0 + nj), row
// by row: P = exp(S - lse) and dS = P (dP - delta) on the row's allowed keys, 0 elsewhere. P
// overwrites S and dS overwrites dP.
template <typename acc_t>
void probs_block(const Ranges& R, const BwdInputs<acc_t>& bw, int64_t T, int64_t h, int64_t r0, int64_t rows,
                 int64_t j0, int64_t nj, bool use_sink, acc_t* s, acc_t* dp) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r0 + r;
    acc_t* srow = s + r * nj;
    acc_t* dprow = dp + r * nj;
    const Spans ks = row_block_keys(R, i, j0, nj, use_sink);
    const acc_t lse = bw.lse[h * T + i], delta = bw.delta[h * T + i];
    int64_t cursor = 0;
    for (int sp = 0; sp < ks.n; ++sp) {
      std::fill(srow + cursor, srow + ks.lo[sp], acc_t(0));
      std::fill(dprow + cursor, dprow + ks.lo[sp], acc_t(0));
      const int64_t len = ks.hi[sp] - ks.lo[sp];
      exp_shifted(srow + ks.lo[sp], len, lse);
      grad_scores(srow + ks.lo[sp], dprow + ks.lo[sp], len, delta);
      cursor = ks.hi[sp];
    }
    std::fill(srow + cursor, srow + nj, acc_t(0));
    std::fill(dprow + cursor, dprow + nj, acc_t(0));
  }
}

// dQ: query-major, the forward's iteration. dQ_tile += dS K_block as a GEMM per key block.
template <typename acc_t>
void dq_impl(const Geometry& G, const Inputs<acc_t>& in, const BwdInputs<acc_t>& bw, const Ranges& R,
             const int32_t* chain, int64_t K, const std::vector<int64_t>& offsets, double scale_d, bool use_sink,
             const NonFinite& bad_rk, acc_t* dq) {
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t D = G.D;
  const int64_t qs = G.Hq * D, ks = G.Hkv * D;
  const std::vector<QTile> tiles = query_tiles(offsets, kTileQ);
  const int64_t ntiles = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, ntiles * G.Hq, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor sbuf = scratch<acc_t>(kTileQ * kBlockK), dpbuf = scratch<acc_t>(kTileQ * kBlockK);
    at::Tensor gbuf = scratch<acc_t>(kTileQ * D), xbuf;
    acc_t* s = sbuf.data_ptr<acc_t>();
    acc_t* dp = dpbuf.data_ptr<acc_t>();
    acc_t* gacc = gbuf.data_ptr<acc_t>();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / ntiles, hk = h / G.group;
      const QTile tile = tiles[task % ntiles];
      const int64_t rows = tile.r1 - tile.r0;
      std::fill(gacc, gacc + rows * D, acc_t(0));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = tile.r0 + r;
        if (!R.valid[i]) continue;
        const acc_t* qi = in.q + i * qs + h * D;
        const acc_t* doi = bw.dout + i * qs + h * D;
        const acc_t lse = bw.lse[h * G.T + i], delta = bw.delta[h * G.T + i];
        acc_t* g = gacc + r * D;
        for (int64_t e = 0; e < K; ++e) {
          const int32_t c = chain[i * K + e];
          if (c < 0) continue;
          const acc_t* kc = in.k + c * ks + hk * D;
          const acc_t p = std::exp(dot(qi, kc, D) * scale - lse);
          const acc_t ds = p * (dot(doi, in.v + c * ks + hk * D, D) - delta);
          for (int64_t d = 0; d < D; ++d) g[d] += ds * kc[d];
        }
      }
      const at::Tensor qt = matrix(in.q + tile.r0 * qs + h * D, rows, D, qs);
      const at::Tensor dot_ = matrix(bw.dout + tile.r0 * qs + h * D, rows, D, qs);
      const Spans spans = tile_key_spans(R, tile.r0, tile.r1, use_sink);
      for (int sp = 0; sp < spans.n; ++sp) {
        for (int64_t j0 = spans.lo[sp]; j0 < spans.hi[sp]; j0 += kBlockK) {
          const int64_t nj = std::min(kBlockK, spans.hi[sp] - j0);
          const at::Tensor kb = matrix(in.rk + j0 * ks + hk * D, nj, D, ks);
          at::Tensor st = matrix(s, rows, nj, nj), dpt = matrix(dp, rows, nj, nj);
          at::addmm_out(st, st, qt, kb.t(), /*beta=*/0, /*alpha=*/scale);
          at::mm_out(dpt, dot_, matrix(in.rv + j0 * ks + hk * D, nj, D, ks).t());
          probs_block(R, bw, G.T, h, tile.r0, rows, j0, nj, use_sink, s, dp);
          block_product(R, tile.r0, rows, j0, nj, use_sink, dp, in.rk + j0 * ks + hk * D, ks, bad_rk, j0, hk, xbuf,
                        gacc, D, /*key_rows_out=*/false);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        acc_t* g = dq + (tile.r0 + r) * qs + h * D;
        for (int64_t d = 0; d < D; ++d) g[d] = gacc[r * D + d] * scale;
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

// dK/dV of the range keys (symmetric: rows 0..N-1 of k/v; cross: context rows), key-major: per
// (key block, kv head), the queries of every depth that touch the block, in sub-tiles of kTileQB,
// for each q head of the group: S, dP as GEMMs, then dV += P^T dO and dK += dS^T Q.
template <typename acc_t>
void dkv_range_impl(const Geometry& G, const Inputs<acc_t>& in, const BwdInputs<acc_t>& bw, const Ranges& R,
                    const std::vector<int64_t>& offsets, double scale_d, bool use_sink, const NonFinite& bad_q,
                    const NonFinite& bad_dout, acc_t* dk, acc_t* dv) {
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t D = G.D;
  const int64_t qs = G.Hq * D, ks = G.Hkv * D;
  const int64_t nkeys = G.N, nblocks = (nkeys + kTileK - 1) / kTileK;
  const int64_t ndepths = static_cast<int64_t>(offsets.size()) - 1;
  at::parallel_for(0, nblocks * G.Hkv, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor sbuf = scratch<acc_t>(kTileQB * kTileK), dpbuf = scratch<acc_t>(kTileQB * kTileK);
    at::Tensor kbuf = scratch<acc_t>(kTileK * D), vbuf = scratch<acc_t>(kTileK * D), xbuf;
    acc_t* s = sbuf.data_ptr<acc_t>();
    acc_t* dp = dpbuf.data_ptr<acc_t>();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t hk = task / nblocks, j0 = (task % nblocks) * kTileK, j1 = std::min(j0 + kTileK, nkeys);
      const int64_t nj = j1 - j0;
      const at::Tensor kb = matrix(in.rk + j0 * ks + hk * D, nj, D, ks);
      const at::Tensor vb = matrix(in.rv + j0 * ks + hk * D, nj, D, ks);
      kbuf.zero_();
      vbuf.zero_();
      for (int64_t e = 0; e < ndepths; ++e) {
        const Spans qsp = key_block_queries(R, offsets[e], offsets[e + 1], j0, j1, use_sink);
        for (int sp = 0; sp < qsp.n; ++sp) {
          for (int64_t i0 = qsp.lo[sp]; i0 < qsp.hi[sp]; i0 += kTileQB) {
            const int64_t ni = std::min(kTileQB, qsp.hi[sp] - i0);
            at::Tensor st = matrix(s, ni, nj, nj), dpt = matrix(dp, ni, nj, nj);
            for (int64_t h = hk * G.group; h < (hk + 1) * G.group; ++h) {
              const at::Tensor qt = matrix(in.q + i0 * qs + h * D, ni, D, qs);
              const at::Tensor dot_ = matrix(bw.dout + i0 * qs + h * D, ni, D, qs);
              at::addmm_out(st, st, qt, kb.t(), /*beta=*/0, /*alpha=*/scale);
              at::mm_out(dpt, dot_, vb.t());
              probs_block(R, bw, G.T, h, i0, ni, j0, nj, use_sink, s, dp);
              block_product(R, i0, ni, j0, nj, use_sink, s, bw.dout + i0 * qs + h * D, qs, bad_dout, i0, h, xbuf,
                            vbuf.data_ptr<acc_t>(), D, /*key_rows_out=*/true);
              block_product(R, i0, ni, j0, nj, use_sink, dp, in.q + i0 * qs + h * D, qs, bad_q, i0, h, xbuf,
                            kbuf.data_ptr<acc_t>(), D, /*key_rows_out=*/true);
            }
          }
        }
      }
      const acc_t* kacc = kbuf.data_ptr<acc_t>();
      const acc_t* vacc = vbuf.data_ptr<acc_t>();
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t d = 0; d < D; ++d) {
          dk[j * ks + hk * D + d] = kacc[(j - j0) * D + d];
          dv[j * ks + hk * D + d] = vacc[(j - j0) * D + d];
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
                           non_finite_rows<scalar_t>(cvc), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
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
    dq_impl<scalar_t>(G, in, bw, R, chain, S.K, offsets, scale, use_sink, non_finite_rows<scalar_t>(ckc),
                      dq.data_ptr<scalar_t>());
    scalar_t* rdk = S.cross ? dck.data_ptr<scalar_t>() : dk.data_ptr<scalar_t>();
    scalar_t* rdv = S.cross ? dcv.data_ptr<scalar_t>() : dv.data_ptr<scalar_t>();
    if (G.N > 0)
      dkv_range_impl<scalar_t>(G, in, bw, R, offsets, scale, use_sink, non_finite_rows<scalar_t>(qc),
                               non_finite_rows<scalar_t>(doc), rdk, rdv);
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
