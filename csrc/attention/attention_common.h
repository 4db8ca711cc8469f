// COD attention metadata rules shared by the CPU and CUDA implementations (plain C++, no torch),
// so both back ends derive exactly the same key sets from a layout (docs/design.md section 3).
//
// For query token i (anchor a, depth d, doc start ds = first position of a's document run):
//   window range  [lo, hi)  = [max(ds, a + d - window + 1), a + 1)        (no window: [ds, a + 1))
//   sink range    [slo, shi) = [ds, max(ds, min(ds + sink, lo, hi)))      (only with window and sink)
// in key-position space (symmetric: rows 0..N-1 of k/v, the depth-0 tokens; cross: context rows).
// The two ranges are disjoint. Every one of lo, hi, slo, shi is nondecreasing in the anchor, so
// within one depth segment (anchors sorted) the queries that touch a key block form a
// contiguous index range, found by binary search (the key-major backward pass uses this).
// Chain keys (row indices into k/v): chain[i][e] = the layout token (a, e) for e <= d, except
// that in symmetric mode the depth-0 token a is listed only when no range already covers it.
// rchain[c][d] = i is the reverse map (i lists c in its chain), used by the dK/dV chain pass.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define PEAGLE_ATTN_HD __host__ __device__ __forceinline__
#else
#define PEAGLE_ATTN_HD inline
#endif

namespace peagle::attention {

constexpr int kMaxChain = 64;  // = cod kMaxDepths: chain slots per query

// Row order of the int32 [kNumRangeFields, T] range tensor.
enum RangeField : int { kLo = 0, kHi = 1, kSinkLo = 2, kSinkHi = 3, kValid = 4, kNumRangeFields = 5 };

struct TokenRanges {
  int32_t lo, hi, slo, shi, valid;
};

// window < 0: no window. sink only counts with a window (without one every key is in range).
PEAGLE_ATTN_HD TokenRanges token_ranges(int32_t anchor, int32_t depth, int32_t doc_of_anchor, int32_t doc_start,
                                        int64_t window, int64_t sink) {
  TokenRanges r;
  const int64_t a = anchor, ds = doc_start;
  int64_t lo = ds;
  if (window >= 0) {
    const int64_t w = a + depth - window + 1;
    lo = w > ds ? w : ds;
  }
  const int64_t hi = a + 1;
  int64_t slo = ds, shi = ds;
  if (window >= 0 && sink > 0) {
    // min(ds + sink, lo, hi) without forming ds + sink, which overflows for sink near 2^63
    int64_t e = lo < hi ? lo : hi;
    if (sink < e - ds) e = ds + sink;
    shi = e > ds ? e : ds;
  }
  // lo can exceed hi (window <= depth): an empty window range; keep the value (monotone).
  r.lo = static_cast<int32_t>(lo > 0x7fffffff ? 0x7fffffff : lo);
  r.hi = static_cast<int32_t>(hi);
  r.slo = static_cast<int32_t>(slo);
  r.shi = static_cast<int32_t>(shi);
  r.valid = doc_of_anchor != -1 ? 1 : 0;
  return r;
}

PEAGLE_ATTN_HD bool ranges_cover(const TokenRanges& r, int32_t key) {
  return (r.lo <= key && key < r.hi) || (r.slo <= key && key < r.shi);
}

// First index in [begin, end) of a sorted int32 array with value >= x (end if none).
PEAGLE_ATTN_HD int64_t lower_bound_i32(const int32_t* v, int64_t begin, int64_t end, int64_t x) {
  while (begin < end) {
    const int64_t mid = begin + (end - begin) / 2;
    if (v[mid] < x)
      begin = mid + 1;
    else
      end = mid;
  }
  return begin;
}

// Chain slot e of query i: the row of layout token (anchor, e), or -1.
// anchors: layout anchors; seg_begin/seg_end: depth-e segment of the layout.
PEAGLE_ATTN_HD int32_t chain_key(const int32_t* anchors, int64_t seg_begin, int64_t seg_end, int32_t anchor,
                                 int32_t depth, int e, bool symmetric, const TokenRanges& r) {
  if (!r.valid || e > depth) return -1;
  if (symmetric && e == 0) return ranges_cover(r, anchor) ? -1 : anchor;  // depth-0 rows = positions
  const int64_t j = lower_bound_i32(anchors, seg_begin, seg_end, anchor);
  return (j < seg_end && anchors[j] == anchor) ? static_cast<int32_t>(j) : -1;
}

}  // namespace peagle::attention
