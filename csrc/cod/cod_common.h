// Shared by the CPU and CUDA COD samplers (plain C++, no torch).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace peagle::cod {

constexpr int kMaxDepths = 64;

// Per-depth keep ratio max(r^d, r_min), computed once on the host in double precision so
// that both back ends size every depth identically: sample_size = floor((S - d) * ratio[d]).
inline std::vector<double> depth_ratios(int num_depths, double r, double r_min) {
  std::vector<double> out(num_depths, 1.0);
  for (int d = 1; d < num_depths; ++d) out[d] = std::max(std::pow(r, d), r_min);
  return out;
}

// speculators: valid_length = max(0, S - d); sample_size = int(valid_length * ratio).
inline int64_t depth_sample_size(int64_t num_seeds, int d, double ratio) {
  const int64_t valid = std::max<int64_t>(0, num_seeds - d);
  return static_cast<int64_t>(std::floor(static_cast<double>(valid) * ratio));
}

}  // namespace peagle::cod
