// The float row math of row_math.h. Every loop is free of calls and branches, and reductions run
// over a fixed number of partial lanes, so GCC vectorises them and the summation order is the same
// at every SIMD width (results are deterministic on a given CPU). On x86-64 with GCC each function
// is also built for AVX2 and AVX-512, and the CPU picks the widest it supports when the library
// loads.
#include "common/row_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PEAGLE_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PEAGLE_SIMD_CLONES
#endif

namespace peagle::cpu {
namespace {

constexpr int kLanes = 16;

// exp(t): t = k ln2 + r with |r| <= ln2/2, e^r by Cephes' expf polynomial, 2^k from exponent
// bits. Relative error below 2 ulp where the result is a normal float; 0 below that
// (t < -87.33), +inf above 88.72, NaN for NaN. The polynomial runs on t clamped to [-87.5, 88]
// (NaN to -87.5), so the integer conversion of k is always defined; selects fix the ends.
inline float exp_lane(float t) {
  const float tc = t > -87.5f ? (t < 88.0f ? t : 88.0f) : -87.5f;
  const float k = (tc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(tc / ln2)
  const float r = (tc - k * 0.693359375f) + k * 2.12194440e-4f;             // ln2 in two parts
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float pow2k;
  std::memcpy(&pow2k, &bits, sizeof(float));
  const float e = t < -87.33f ? 0.0f : (t > 88.72f ? std::numeric_limits<float>::infinity() : y * pow2k);
  return t != t ? t : e;
}

}  // namespace

PEAGLE_SIMD_CLONES void exp_shifted(float* x, int64_t n, float b) {
  for (int64_t j = 0; j < n; ++j) x[j] = exp_lane(x[j] - b);
}

PEAGLE_SIMD_CLONES float span_max(const float* x, int64_t n) {
  float part[kLanes];
  for (int u = 0; u < kLanes; ++u) part[u] = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) part[u] = std::max(part[u], x[j + u]);
  for (; j < n; ++j) part[0] = std::max(part[0], x[j]);
  float m = part[0];
  for (int u = 1; u < kLanes; ++u) m = std::max(m, part[u]);
  return m;
}

PEAGLE_SIMD_CLONES float span_sum(const float* x, int64_t n) {
  float part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) part[u] += x[j + u];
  for (; j < n; ++j) part[0] += x[j];
  float s = 0.0f;
  for (int u = 0; u < kLanes; ++u) s += part[u];
  return s;
}

PEAGLE_SIMD_CLONES void grad_scores(const float* p, float* dp, int64_t n, float delta) {
  for (int64_t j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - delta);
}

PEAGLE_SIMD_CLONES float kl_row(const float* xd, const float* xt, const float* e, int64_t n, float lse_d, float inv_sum,
                                float lse_t, float w, float* g) {
  float part[kLanes] = {};
  auto lane = [&](int64_t j, int u) {
    const float lp = xt[j] - lse_t;
    const float p = exp_lane(lp);
    part[u] += p * (lp - (xd[j] - lse_d));
    g[j] = w * (e[j] * inv_sum - p);
  };
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) lane(j + u, u);
  for (; j < n; ++j) lane(j, 0);
  float s = 0.0f;
  for (int u = 0; u < kLanes; ++u) s += part[u];
  return s;
}

// |x| <= max is false for NaN and for +-inf; the flags OR together as integers (vectorisable)
template <typename T>
inline bool non_finite_flags_impl(const T* x, int64_t n, int64_t len, bool* flags) {
  int any = 0;
  for (int64_t i = 0; i < n; ++i) {
    int bad = 0;
    const T* v = x + i * len;
    for (int64_t d = 0; d < len; ++d) bad |= !(std::fabs(v[d]) <= std::numeric_limits<T>::max());
    flags[i] = bad != 0;
    any |= bad;
  }
  return any != 0;
}

PEAGLE_SIMD_CLONES bool non_finite_flags(const float* x, int64_t n, int64_t len, bool* flags) {
  return non_finite_flags_impl(x, n, len, flags);
}

bool non_finite_flags(const double* x, int64_t n, int64_t len, bool* flags) {
  return non_finite_flags_impl(x, n, len, flags);
}

void exp_shifted(double* x, int64_t n, double b) {
  for (int64_t j = 0; j < n; ++j) x[j] = std::exp(x[j] - b);
}

double span_max(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

double span_sum(const double* x, int64_t n) {
  double s = 0.0;
  for (int64_t j = 0; j < n; ++j) s += x[j];
  return s;
}

void grad_scores(const double* p, double* dp, int64_t n, double delta) {
  for (int64_t j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - delta);
}

}  // namespace peagle::cpu
