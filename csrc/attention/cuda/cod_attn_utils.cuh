// Tensor-core building blocks of the COD attention kernels (sm_80+): mma.sync m16n8k16 with
// fp32 accumulation, ldmatrix fragment loads from XOR-swizzled shared-memory tiles, cp.async
// copies with zero fill, and quad/warp reductions.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   A 16x16 (row): a0 (g, 2t..2t+1) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..)
//   B 16x8 (col):  b0 (k 2t..2t+1, n g) b1 (k 2t+8.., n g)
//   C 16x8:        c0,c1 (g, 2t..2t+1) c2,c3 (g+8, 2t..2t+1)
// Shared tiles hold rows of D halfwords as D/8 chunks of 16 bytes; chunk c of row r is stored at
// chunk c ^ (r & 7), so the 8 rows an ldmatrix phase reads hit 8 different bank groups.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_math.cuh"

namespace peagle::attention::cuda {

template <typename T>
struct Pack;
template <>
struct Pack<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t two(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float2 unpack(uint32_t x) {
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&x);
    return __bfloat1622float2(h);
  }
};
template <>
struct Pack<__half> {
  __device__ __forceinline__ static uint32_t two(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float2 unpack(uint32_t x) {
    __half2 h = *reinterpret_cast<__half2*>(&x);
    return __half22float2(h);
  }
};

// c += a * b (16x8x16), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte async copy; when !pred the destination is zero-filled and src is not read.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
// 4-byte async copy (zero-fill when !pred).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool pred) {
  const int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Byte offset of (row, chunk) in a swizzled tile with D halfwords per row.
template <int D>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>((row * D + ((chunk ^ (row & 7)) << 3)) * 2);
}

// Copies rows [0, ROWS) of a tile: global row `first + r` (of `limit` rows, stride `ld`
// halfwords) -> swizzled shared tile; rows outside [0, limit) become zeros.
template <int ROWS, int D, int NTHREADS, typename T>
__device__ __forceinline__ void load_tile(uint32_t smem, const T* base, int64_t ld, int64_t first, int64_t limit,
                                          int tid) {
  constexpr int kChunks = D / 8;
  constexpr int kTotal = ROWS * kChunks;
  static_assert(kTotal % NTHREADS == 0, "tile copy must divide evenly among threads");
#pragma unroll
  for (int it = 0; it < kTotal / NTHREADS; ++it) {
    const int idx = tid + it * NTHREADS;
    const int r = idx / kChunks, c = idx % kChunks;
    const int64_t g = first + r;
    const bool ok = g >= 0 && g < limit;
    const T* src = ok ? base + g * ld + c * 8 : base;
    cp_async16(smem + swz<D>(r, c), src, ok);
  }
}

// A fragment (16 rows from row0, k-step kk) of a row-major [rows][D] tile.
template <int D>
__device__ __forceinline__ void frag_a(uint32_t (&r)[4], uint32_t tile, int row0, int kk, int lane) {
  const int row = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int chunk = 2 * kk + (lane >> 4);
  ldmatrix_x4(r, tile + swz<D>(row, chunk));
}
// B fragments for the two n-tiles n0, n0+8 at k-step kk, from a [n][k] row-major tile
// (B = tile^T, e.g. K in S = Q K^T): r[0..1] -> n-tile n0, r[2..3] -> n-tile n0 + 8.
template <int D>
__device__ __forceinline__ void frag_b_nk(uint32_t (&r)[4], uint32_t tile, int n0, int kk, int lane) {
  const int row = n0 + (lane & 7) + (lane >> 4) * 8;
  const int chunk = 2 * kk + ((lane >> 3) & 1);
  ldmatrix_x4(r, tile + swz<D>(row, chunk));
}
// B fragments for the two n-tiles (columns n0, n0+8) at k-step kk from a [k][n] row-major tile
// (B = tile, e.g. V in O = P V): r[0..1] -> n-tile n0, r[2..3] -> n-tile n0 + 8.
template <int D>
__device__ __forceinline__ void frag_b_kn(uint32_t (&r)[4], uint32_t tile, int n0, int kk, int lane) {
  const int row = 16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int chunk = (n0 >> 3) + (lane >> 4);
  ldmatrix_x4_trans(r, tile + swz<D>(row, chunk));
}

// Element d (< D) of row `row` of a swizzled tile.
template <int D>
__device__ __forceinline__ int swz_elem(int row, int d) {
  return row * D + (((d >> 3) ^ (row & 7)) << 3) + (d & 7);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
using peagle::device::warp_sum;
__device__ __forceinline__ int warp_min(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = min(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ int warp_max(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// 2^x with the SFU (ex2.approx.ftz): 2^-inf = +0, which the masked-softmax code relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Loads `EPL` consecutive halfwords starting at p (EPL in {2, 4}) as floats.
template <int EPL, typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[EPL]) {
  if constexpr (EPL == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = Pack<T>::unpack(u.x), b = Pack<T>::unpack(u.y);
    out[0] = a.x;
    out[1] = a.y;
    out[2] = b.x;
    out[3] = b.y;
  } else {
    static_assert(EPL == 2, "EPL must be 2 or 4");
    const float2 a = Pack<T>::unpack(*reinterpret_cast<const uint32_t*>(p));
    out[0] = a.x;
    out[1] = a.y;
  }
}
template <int EPL, typename T>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[EPL]) {
  if constexpr (EPL == 4) {
    uint2 u;
    u.x = Pack<T>::two(in[0], in[1]);
    u.y = Pack<T>::two(in[2], in[3]);
    *reinterpret_cast<uint2*>(p) = u;
  } else {
    *reinterpret_cast<uint32_t*>(p) = Pack<T>::two(in[0], in[1]);
  }
}

}  // namespace peagle::attention::cuda

namespace peagle::attention::cuda {

// sum of the 8 products of two 16-byte vectors of halfwords.
template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const float2 a0 = Pack<T>::unpack(a.x), a1 = Pack<T>::unpack(a.y), a2 = Pack<T>::unpack(a.z),
               a3 = Pack<T>::unpack(a.w);
  const float2 b0 = Pack<T>::unpack(b.x), b1 = Pack<T>::unpack(b.y), b2 = Pack<T>::unpack(b.z),
               b3 = Pack<T>::unpack(b.w);
  float s = a0.x * b0.x;
  s = fmaf(a0.y, b0.y, s);
  s = fmaf(a1.x, b1.x, s);
  s = fmaf(a1.y, b1.y, s);
  s = fmaf(a2.x, b2.x, s);
  s = fmaf(a2.y, b2.y, s);
  s = fmaf(a3.x, b3.x, s);
  return fmaf(a3.y, b3.y, s);
}

// Dot product of row `row` of a swizzled shared tile with a global row (16-byte aligned).
template <int D, typename T>
__device__ __forceinline__ float dot_smem_global(const T* tile, int row, const T* grow) {
  const uint4* g = reinterpret_cast<const uint4*>(grow);
  float s = 0.f;
#pragma unroll
  for (int ch = 0; ch < D / 8; ++ch) {
    const uint4 gv = __ldg(g + ch);
    const uint4 sv = *reinterpret_cast<const uint4*>(tile + row * D + ((ch ^ (row & 7)) << 3));
    s += dot8<T>(sv, gv);
  }
  return s;
}

}  // namespace peagle::attention::cuda
