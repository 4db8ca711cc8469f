// Host-side check (no GPU needed: nvcc compiles it, the CPU runs it) that BlockRowMask, the
// per-block precomputed mask of the wgmma forward and dQ kernels (csrc/attention/cuda/
// cod_attn_tile.cuh), answers exactly as RowRanges::allows for every key of a block, on random
// and adversarial range values (empty, inverted, negative, INT_MIN / INT_MAX, invalid rows,
// ranges past jend or around the block edges).
//   nvcc -std=c++17 -I csrc tools/kernels/check_block_row_mask.cu -o /tmp/cbrm && /tmp/cbrm
#include <climits>
#include <cstdio>
#include <random>

#include "attention/cuda/cod_attn_tile.cuh"

using peagle::attention::cuda::BlockRowMask;
using peagle::attention::cuda::RowRanges;

int main() {
  std::mt19937 rng(12345);
  const int special[] = {INT_MIN, INT_MIN + 1, -1000, -7,  -1,  0,    1,           5,      63,
                         64,      65,          127,   128, 129, 1000, INT_MAX - 1, INT_MAX};
  auto pick = [&](int j0, int bn) -> int {
    switch (rng() % 4) {
      case 0:
        return special[rng() % (sizeof(special) / sizeof(int))];
      case 1:
        return j0 + static_cast<int>(rng() % (3 * bn)) - bn;  // around the block
      case 2:
        return j0 + static_cast<int>(rng() % (bn + 1));  // inside / on the edges
      default:
        return static_cast<int>(rng() % 5000);
    }
  };
  long long checked = 0, bad = 0;
  for (int it = 0; it < 400000; ++it) {
    const int bn = (rng() & 1) ? 64 : 128;
    const int j0 = bn * static_cast<int>(rng() % 64);
    const int jend = (rng() % 3 == 0) ? INT_MAX : j0 + static_cast<int>(rng() % (2 * bn + 2)) - 1;
    const RowRanges r{pick(j0, bn), pick(j0, bn), pick(j0, bn), pick(j0, bn), static_cast<int>(rng() % 4 != 0)};
    for (int t = 0; t < 4; ++t) {
      const BlockRowMask m(r, j0, jend, bn, t);
      for (int n = 0; n < bn / 8; ++n)
        for (int x = 0; x < 2; ++x) {
          const int jj = 8 * n + x;
          const bool want = r.allows(j0 + 2 * t + jj, jend), got = m.allows(jj);
          ++checked;
          if (want != got && ++bad <= 10)
            std::printf(
                "MISMATCH j0=%d bn=%d jend=%d t=%d jj=%d ranges lo=%d hi=%d slo=%d shi=%d valid=%d: "
                "allows=%d mask=%d\n",
                j0, bn, jend, t, jj, r.lo, r.hi, r.slo, r.shi, r.valid, want, got);
        }
    }
  }
  std::printf("%s: %lld keys checked, %lld mismatches\n", bad ? "FAIL" : "PASS", checked, bad);
  return bad ? 1 : 0;
}
