// COD sampling on the CPU. Same draw as the CUDA kernel: every candidate position gets the
// key cod_key(seed, stream, depth, p) and a depth keeps the `size` smallest keys, so both
// back ends return the identical layout for a seed (the tests compare them exactly).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/philox.h"
#include "cod/cod_checks.h"
#include "cod/cod_common.h"

namespace peagle::cod {
namespace {

// Keeps the `k` candidates with the smallest keys, returned in ascending position order.
std::vector<int32_t> keep_smallest_keys(const std::vector<int32_t>& cand, int64_t k, uint64_t seed, uint32_t stream,
                                        uint32_t depth) {
  if (static_cast<int64_t>(cand.size()) <= k) return cand;
  std::vector<uint64_t> keys(cand.size());
  for (size_t i = 0; i < cand.size(); ++i) keys[i] = cod_key(seed, stream, depth, cand[i]);
  std::nth_element(keys.begin(), keys.begin() + k, keys.end());
  std::vector<int32_t> out(k);
  for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int32_t>(keys[i] & 0xffffffffu);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> cod_sample_cpu(const at::Tensor& document_ids,
                                                              const at::Tensor& loss_mask, int64_t num_depths, double r,
                                                              double r_min, int64_t max_anchors, bool depth0_all,
                                                              int64_t seed) {
  check_cod_inputs(document_ids, loss_mask, num_depths, r, r_min, max_anchors);
  const int64_t n = document_ids.size(0);
  const int32_t* doc = document_ids.data_ptr<int32_t>();
  const bool* lm = loss_mask.data_ptr<bool>();
  const uint64_t useed = static_cast<uint64_t>(seed);
  for (int64_t p = 0; p < n; ++p)
    TORCH_CHECK_VALUE(doc[p] >= -1, "cod_sample: document_ids must be >= -1 (-1 = padding), got ", doc[p],
                      " at position ", p);

  // Seeds: loss-masked positions whose predecessor is in the same (real) document, so the
  // chain's anchor p-1 is never -1 and never in another document.
  std::vector<int32_t> seeds;
  for (int64_t p = 1; p < n; ++p)
    if (lm[p] && doc[p] >= 0 && doc[p - 1] == doc[p]) seeds.push_back(static_cast<int32_t>(p));
  if (max_anchors >= 0) seeds = keep_smallest_keys(seeds, max_anchors, useed, kCodStreamAnchors, 0);
  const int64_t num_seeds = static_cast<int64_t>(seeds.size());

  std::vector<std::vector<int32_t>> anchors_per_depth(num_depths);
  if (depth0_all) {
    anchors_per_depth[0].resize(n);
    for (int64_t p = 0; p < n; ++p) anchors_per_depth[0][p] = static_cast<int32_t>(p);
  } else {
    anchors_per_depth[0].reserve(seeds.size());
    for (int32_t s : seeds) anchors_per_depth[0].push_back(s - 1);
  }

  const std::vector<double> ratio = depth_ratios(static_cast<int>(num_depths), r, r_min);
  std::vector<int32_t> pool = seeds;
  for (int d = 1; d < num_depths; ++d) {
    const int64_t size = depth_sample_size(num_seeds, d, ratio[d]);
    if (size <= 0) break;  // speculators stops here: deeper depths are empty
    std::vector<int32_t> sampled = keep_smallest_keys(pool, size, useed, kCodStreamDepth, d);
    auto& anchors = anchors_per_depth[d];
    anchors.reserve(sampled.size());
    std::vector<int32_t> next;
    next.reserve(sampled.size());
    for (int32_t p : sampled) {
      anchors.push_back(p - d);
      const int64_t q = static_cast<int64_t>(p) + 1;
      if (q < n && lm[q] && doc[q] == doc[p]) next.push_back(static_cast<int32_t>(q));
    }
    pool.swap(next);
  }

  at::Tensor offsets = at::empty({num_depths + 1}, document_ids.options().dtype(at::kLong));
  int64_t* off = offsets.data_ptr<int64_t>();
  off[0] = 0;
  for (int d = 0; d < num_depths; ++d) off[d + 1] = off[d] + static_cast<int64_t>(anchors_per_depth[d].size());
  const int64_t total = off[num_depths];
  at::Tensor anchor = at::empty({total}, document_ids.options());
  at::Tensor depth = at::empty({total}, document_ids.options());
  int32_t* a = anchor.data_ptr<int32_t>();
  int32_t* dd = depth.data_ptr<int32_t>();
  for (int d = 0; d < num_depths; ++d) {
    std::copy(anchors_per_depth[d].begin(), anchors_per_depth[d].end(), a + off[d]);
    std::fill(dd + off[d], dd + off[d + 1], d);
  }
  return {anchor, depth, offsets};
}

}  // namespace peagle::cod

TORCH_LIBRARY_IMPL(peagle, CPU, m) { m.impl("cod_sample", &peagle::cod::cod_sample_cpu); }
