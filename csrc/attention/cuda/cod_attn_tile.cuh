// Query-tile bookkeeping shared by the forward and the dQ kernels: which rows a CTA owns, their
// ranges (kept in shared memory), and the key blocks the tile visits.
#pragma once
#include <climits>

#include "attention/attention_kernels.h"
#include "attention/cuda/cod_attn_utils.cuh"

namespace peagle::attention::cuda {

// Kernels visit tiles in reverse (gridDim.x - 1 - blockIdx.x): within a depth the last tiles have
// the highest anchors and so the longest key ranges, and starting them first shortens the tail.
// Query tiles never straddle two depths (within a depth anchors are sorted, so a tile's key
// range is tight). tile_offsets[e] = first tile of depth e (host-computed from depth_offsets).
struct TileMap {
  int tile_offsets[kMaxChain + 1];
};

struct QTile {
  int row0;  // first layout row
  int rows;  // rows of this tile that exist (<= BM)
};

__device__ __forceinline__ QTile find_query_tile(const CodAttnParams& p, const TileMap& tm, int tile, int bm) {
  int e = 0;
  while (e + 1 < p.K && tm.tile_offsets[e + 1] <= tile) ++e;
  QTile q;
  q.row0 = p.depth_offsets[e] + (tile - tm.tile_offsets[e]) * bm;
  q.rows = min(bm, p.depth_offsets[e + 1] - q.row0);
  return q;
}

// Per-row ranges of a tile in shared memory (rows past the tile: invalid, empty ranges) and the
// tile-wide bounds: the hull of the sink ranges and the hull of the window ranges (merged when
// they touch), and lo_max / hi_min over valid rows, which make a key block "full" (allowed for
// every valid row, no per-element mask) when j0 >= lo_max and j0 + BN <= hi_min.
// A range bound clamped to [0, n]; a chain entry outside [0, t) read as -1 (no key). The kernels
// apply these to everything they index with, so no metadata value reads or writes out of bounds.
__device__ __forceinline__ int clamp_key(int x, int n) { return min(max(x, 0), n); }
__device__ __forceinline__ int chain_row(int c, int t) {
  return static_cast<unsigned>(c) < static_cast<unsigned>(t) ? c : -1;
}

struct TileKeys {
  int lo0, hi0, nb0;  // first span and its block count
  int lo1, hi1;       // second span (hi1 <= lo1 when none)
  int nblocks;        // total key blocks
  int lo_max, hi_min;
  int any_chain;
};

template <int BM, int NTHREADS, int BN>
__device__ TileKeys setup_query_tile(const CodAttnParams& p, const QTile& qt, int* s_meta, int* s_red, int tid) {
  constexpr int NWARPS = NTHREADS / 32;
  static_assert(BM <= NTHREADS || BM % NTHREADS == 0, "threads take tile rows tid, tid + NTHREADS, ...");
  const int lane = tid & 31, warp = tid >> 5;
  // identities of the reductions below (what a row past the tile contributes)
  int v[7] = {INT_MAX, INT_MIN, INT_MAX, INT_MIN, INT_MIN, INT_MAX, 0};
  for (int row = tid; row < BM; row += NTHREADS) {
    int lo = 0, hi = 0, slo = 0, shi = 0, valid = 0, chain_any = 0;
    if (row < qt.rows) {
      const int64_t i = qt.row0 + row;
      const int64_t T = p.T;
      // clamped to the N range keys: metadata of another layout or edited entries then read
      // nothing out of bounds (the key blocks are cut from these bounds)
      lo = clamp_key(p.ranges[kLo * T + i], p.N);
      hi = clamp_key(p.ranges[kHi * T + i], p.N);
      if (p.use_sink) {
        slo = clamp_key(p.ranges[kSinkLo * T + i], p.N);
        shi = clamp_key(p.ranges[kSinkHi * T + i], p.N);
      }
      valid = p.ranges[kValid * T + i] != 0;
      if (valid)
        for (int e = 0; e < p.K; ++e) chain_any |= chain_row(p.chain[i * p.K + e], p.T) >= 0;
    }
    s_meta[0 * BM + row] = lo;
    s_meta[1 * BM + row] = hi;
    s_meta[2 * BM + row] = slo;
    s_meta[3 * BM + row] = shi;
    s_meta[4 * BM + row] = valid;
    const bool has_w = valid && lo < hi, has_s = valid && slo < shi;
    v[0] = min(v[0], has_w ? lo : INT_MAX);
    v[1] = max(v[1], has_w ? hi : INT_MIN);
    v[2] = min(v[2], has_s ? slo : INT_MAX);
    v[3] = max(v[3], has_s ? shi : INT_MIN);
    v[4] = max(v[4], valid ? lo : INT_MIN);
    v[5] = min(v[5], valid ? hi : INT_MAX);
    v[6] = max(v[6], chain_any);
  }
  v[0] = warp_min(v[0]);
  v[1] = warp_max(v[1]);
  v[2] = warp_min(v[2]);
  v[3] = warp_max(v[3]);
  v[4] = warp_max(v[4]);
  v[5] = warp_min(v[5]);
  v[6] = warp_max(v[6]);
  if (lane == 0)
    for (int x = 0; x < 7; ++x) s_red[warp * 8 + x] = v[x];
  __syncthreads();
  int r[7];
  for (int x = 0; x < 7; ++x) r[x] = s_red[x];
  for (int w = 1; w < NWARPS; ++w) {
    r[0] = min(r[0], s_red[w * 8 + 0]);
    r[1] = max(r[1], s_red[w * 8 + 1]);
    r[2] = min(r[2], s_red[w * 8 + 2]);
    r[3] = max(r[3], s_red[w * 8 + 3]);
    r[4] = max(r[4], s_red[w * 8 + 4]);
    r[5] = min(r[5], s_red[w * 8 + 5]);
    r[6] = max(r[6], s_red[w * 8 + 6]);
  }
  TileKeys k;
  const bool tw = r[0] < r[1], ts = r[2] < r[3];
  k.lo1 = 0;
  k.hi1 = 0;
  if (tw && ts && r[2] <= r[1] && r[0] <= r[3]) {
    k.lo0 = min(r[0], r[2]);
    k.hi0 = max(r[1], r[3]);
  } else if (ts) {
    k.lo0 = r[2];
    k.hi0 = r[3];
    if (tw) {
      k.lo1 = r[0];
      k.hi1 = r[1];
    }
  } else if (tw) {
    k.lo0 = r[0];
    k.hi0 = r[1];
  } else {
    k.lo0 = 0;
    k.hi0 = 0;
  }
  k.nb0 = (k.hi0 - k.lo0 + BN - 1) / BN;
  k.nblocks = k.nb0 + (k.hi1 > k.lo1 ? (k.hi1 - k.lo1 + BN - 1) / BN : 0);
  k.lo_max = r[4];
  k.hi_min = r[5];
  k.any_chain = r[6];
  return k;
}

// Block b of the tile's key spans: keys [j0, j0 + BN) clipped to jend.
template <int BN>
__device__ __forceinline__ void key_block(const TileKeys& k, int b, int& j0, int& jend) {
  if (b < k.nb0) {
    j0 = k.lo0 + b * BN;
    jend = k.hi0;
  } else {
    j0 = k.lo1 + (b - k.nb0) * BN;
    jend = k.hi1;
  }
}

// One tile row's ranges in registers.
struct RowRanges {
  int lo, hi, slo, shi, valid;
  __host__ __device__ __forceinline__ bool allows(int j, int jend) const {
    return valid && j < jend && ((lo <= j && j < hi) || (slo <= j && j < shi));
  }
};

// RowRanges::allows for the keys of one block [j0, j0 + BN) as this thread sees them (key columns
// j = j0 + 2 t + jj with jj = 8 n + (x & 1) a compile-time constant of the unrolled fragment
// loops): both ranges clipped to the block and to jend once per block, so each element costs one
// add and one unsigned compare per range instead of RowRanges::allows' six compares. Same answer:
// for j in [j0, j0 + BN), lo <= j < min(hi, jend) <=> max(lo, j0) <= j < min(hi, jend, j0 + BN),
// and an invalid row or an empty clipped range gets length 0; every quantity stays within
// [j0 - 6, j0 + BN], so nothing overflows whatever the range values are.
struct BlockRowMask {
  int woff, wlen, soff, slen;  // range start - (j0 + 2 t), range length (0: nothing allowed)
  __host__ __device__ __forceinline__ BlockRowMask() : woff(0), wlen(0), soff(0), slen(0) {}  // allows nothing
  __host__ __device__ __forceinline__ BlockRowMask(const RowRanges& r, int j0, int jend, int bn, int t) {
    const int top = min(jend, j0 + bn);
    const int wa = min(max(r.lo, j0), top), wb = min(r.hi, top);
    const int sa = min(max(r.slo, j0), top), sb = min(r.shi, top);
    woff = wa - j0 - 2 * t;
    wlen = (r.valid && wb > wa) ? wb - wa : 0;
    soff = sa - j0 - 2 * t;
    slen = (r.valid && sb > sa) ? sb - sa : 0;
  }
  __host__ __device__ __forceinline__ bool allows(int jj) const {
    return static_cast<unsigned>(jj - woff) < static_cast<unsigned>(wlen) ||
           static_cast<unsigned>(jj - soff) < static_cast<unsigned>(slen);
  }
};

template <int BM>
__device__ __forceinline__ RowRanges row_ranges(const int* s_meta, int row) {
  return {s_meta[row], s_meta[BM + row], s_meta[2 * BM + row], s_meta[3 * BM + row], s_meta[4 * BM + row]};
}

// Host: tile offsets for tiles of `bm` rows per depth; returns the total tile count.
inline int make_tile_map(const CodAttnParams& p, int bm, TileMap& tm) {
  int n = 0;
  for (int e = 0; e < p.K; ++e) {
    tm.tile_offsets[e] = n;
    n += (p.depth_offsets[e + 1] - p.depth_offsets[e] + bm - 1) / bm;
  }
  tm.tile_offsets[p.K] = n;
  return n;
}

}  // namespace peagle::attention::cuda
