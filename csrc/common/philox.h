// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11), usable on host and
// device. COD sampling draws one key per (seed, depth, position) from this, so the CPU and
// CUDA implementations pick exactly the same tokens for a given seed, and a GPU thread needs
// no state: it hashes its own coordinates.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define PEAGLE_HD __host__ __device__ __forceinline__
#else
#define PEAGLE_HD inline
#endif

namespace peagle {

PEAGLE_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// Returns the first 32-bit word of Philox4x32-10(counter = (c0, c1, c2, c3), key = seed).
PEAGLE_HD uint32_t philox_u32(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  uint32_t x0 = c0, x1 = c1, x2 = c2, x3 = c3;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, x0, hi0, lo0);
    philox_mulhilo(0xCD9E8D57u, x2, hi1, lo1);
    const uint32_t n0 = hi1 ^ x1 ^ k0;
    const uint32_t n2 = hi0 ^ x3 ^ k1;
    x0 = n0;
    x1 = lo1;
    x2 = n2;
    x3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return x0;
}

// Stream ids inside the counter, so the max_anchors draw and the per-depth draws never reuse
// a random number.
constexpr uint32_t kCodStreamAnchors = 0x41u;
constexpr uint32_t kCodStreamDepth = 0x44u;

// Selection key of position p in the draw `stream`/`depth`: random high word, position low
// word, so keys are unique and "the k smallest keys" is a uniform k-subset.
PEAGLE_HD uint64_t cod_key(uint64_t seed, uint32_t stream, uint32_t depth, uint32_t p) {
  const uint64_t r = philox_u32(seed, p, depth, stream, 0x50454147u /* "PEAG" */);
  return (r << 32) | static_cast<uint64_t>(p);
}

}  // namespace peagle
