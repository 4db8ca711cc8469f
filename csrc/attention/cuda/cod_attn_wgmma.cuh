// Hopper (sm_90a) warpgroup MMA building blocks of the COD attention wgmma backward
// (cod_attn_{fwd,dq,bwd}_wgmma.cuh) and of tools/wgmma_selftest.cu:
// the shared-memory tile layout, matrix descriptors, wgmma.mma_async wrappers and the fences.
// wgmma exists only for sm_90a: the asm bodies compile only when nvcc targets
// arch=compute_90a (__CUDA_ARCH_FEAT_SM90_ALL); for any other target they are empty and the
// kernels that use them guard their whole body the same way (their launcher refuses to run).
//
// ---- Shared-memory tile layout: 128-byte swizzle ("B128"), 64-element panels
// A [ROWS][D] tile of 16-bit values (D a multiple of 64) is stored as D/64 panels, panel p =
// columns [64 p, 64 p + 64), each [ROWS][64] with 128-byte rows; panel p starts at p * ROWS * 128
// bytes, row r of a panel at r * 128, and its 16-byte chunk c (columns 8 c .. 8 c + 7 of the
// panel) at chunk c ^ (r & 7). Every panel starts on a 1024-byte boundary (ROWS % 8 == 0 and a
// 1024-aligned tile base), so the XOR equals the hardware's 128-byte swizzle, which XORs address
// bits [4, 7) with bits [7, 10) (CuTe Swizzle<3,4,3>) on the absolute shared-memory address.
// Why this layout: one physical layout serves both ways the backward reads Q and dO:
//  * K-major (S^T = K Q^T: reduction over the head dim, which is contiguous): 8-row groups of
//    128-byte rows = the canonical K-major B128 layout, SBO = 1024 (next 8 rows), LBO unused;
//    the k-step kk (16 columns = 32 bytes) starts at panel kk / 4, byte 32 (kk % 4) of row 0.
//  * MN-major (dV += P^T dO: reduction over the query rows, the head dim is the N dimension):
//    each 128-byte row is 64 contiguous N-elements and 8 consecutive rows (K) form one 1024-byte
//    swizzle atom = the canonical MN-major B128 layout; SBO = 1024 (next 8 K-rows), LBO =
//    ROWS * 128 (next 64 N-columns = next panel); the k-step kq (16 rows) starts at 2048 kq.
//  * cp.async writes 16-byte chunks, which the swizzle keeps whole; bank-conflict-free reads.
// (The no-swizzle "interleave" layout would need 8x8 core matrices stored contiguously, i.e. a
// different layout for the K-major and the MN-major reads, and conflicts on the 16-byte writes.)
//
// ---- Fragments (PTX ISA, wgmma m64nNk16, warp w = 0..3 of the warpgroup, g = lane / 4, t = lane % 4)
// Accumulator D (f32, N / 2 registers): register 4 n + x = row 16 w + g + 8 (x >> 1), column
// 8 n + 2 t + (x & 1), i.e. warp w holds rows 16 w .. 16 w + 15 as N / 8 mma.sync m16n8 C fragments;
// stored here as float d[N / 8][4]. A from registers (the "RS" form; 4 x 32-bit, two 16-bit values
// each): the mma.sync m16n8k16 A fragment of rows 16 w .. 16 w + 15: a0 (g, 2t..2t+1) a1 (g+8, 2t..)
// a2 (g, 2t+8..) a3 (g+8, 2t+8..).
//
// ---- Ordering rules (PTX ISA, wgmma):
//  * wgmma_fence() (wgmma.fence) before the first wgmma.mma_async of a batch whose registers
//    (accumulators, A fragments) were written by ordinary instructions;
//  * fence_proxy_async_smem() (fence.proxy.async.shared::cta) by every thread after its shared
//    memory writes (st.shared, cp.async once waited for) that a wgmma will read, then a barrier;
//  * wgmma_commit() + wgmma_wait<0>() before any ordinary access to the accumulators (and before
//    shared memory the batch reads is overwritten); fence_operands() after the wait and before the
//    fence pins the compiler's reads / writes of those registers to the right side of the asm.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/cuda/cod_attn_utils.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PEAGLE_WGMMA_DEVICE 1
#else
#define PEAGLE_WGMMA_DEVICE 0
#endif

namespace peagle::attention::cuda::wg {

// Byte offset of 16-byte chunk `chunk` (columns 8 chunk .. 8 chunk + 7, chunk < D / 8) of row
// `row` in a B128 tile of ROWS rows (see the layout above).
template <int ROWS>
__host__ __device__ __forceinline__ constexpr uint32_t sw128_offset(int row, int chunk) {
  static_assert(ROWS % 8 == 0, "B128 panels are made of whole 8-row swizzle atoms");
  return static_cast<uint32_t>((chunk >> 3) * ROWS * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Copies rows [0, ROWS) of a [ROWS][D] tile: global row `first + r` (of `limit` rows, stride `ld`
// elements) -> B128 tile at shared address `smem` (1024-byte aligned); rows outside [0, limit)
// become zeros (cp.async zero fill). first >= 0 (every caller: a block or tile start).
// Thread tid copies 16-byte chunk c = tid % (D / 8) of rows r0 + p * kRowsPerPass, r0 = tid / (D / 8):
// with kRowsPerPass a multiple of 8 every pass has the same swizzle phase (row & 7), so the shared
// address is one per-thread base plus a compile-time step, and the global address one base plus
// a per-pass stride. Written out rather than recomputed per chunk from the flat index: the kernels
// issue these copies every key / query block, and the general form cost ~22 instructions per
// 16-byte copy in the forward's loop (sm_90a SASS: 64-bit multiplies, divisions, two compares).
template <int ROWS, int D, int NTHREADS, typename T>
__device__ __forceinline__ void load_tile_sw128(uint32_t smem, const T* base, int64_t ld, int64_t first, int64_t limit,
                                                int tid) {
  static_assert(D % 64 == 0, "B128 tiles are made of 64-column panels");
  constexpr int kChunks = D / 8;
  constexpr int kTotal = ROWS * kChunks;
  static_assert(kTotal % NTHREADS == 0, "tile copy must divide evenly among threads");
  static_assert(NTHREADS % kChunks == 0 && (NTHREADS / kChunks) % 8 == 0,
                "each pass must cover whole 8-row swizzle atoms");
  constexpr int kRowsPerPass = NTHREADS / kChunks;
  const unsigned utid = static_cast<unsigned>(tid);
  const int c = static_cast<int>(utid % kChunks), r0 = static_cast<int>(utid / kChunks);
  const uint32_t s0 = smem + sw128_offset<ROWS>(r0, c);
  // rows of the tile that exist, 0 .. ROWS (a 32-bit compare per pass against r0 + it kRowsPerPass)
  const int nvalid = static_cast<int>(limit - first < 0 ? 0 : (limit - first > ROWS ? ROWS : limit - first));
  const T* src0 = base + (first + r0) * ld + c * 8;
  const int64_t step = int64_t(kRowsPerPass) * ld;
#pragma unroll
  for (int it = 0; it < kTotal / NTHREADS; ++it) {
    const bool ok = r0 + it * kRowsPerPass < nvalid;
    const T* src = ok ? src0 + it * step : base;
    cp_async16(s0 + it * kRowsPerPass * 128, src, ok);
  }
}

// Matrix descriptor (PTX ISA "matrix descriptor format"): bits 0-13 start address >> 4, 16-29
// leading dimension byte offset >> 4, 32-45 stride dimension byte offset >> 4, 49-51 base offset
// (0: every swizzle atom starts on a 1024-byte boundary), 62-63 swizzle mode (1 = 128-byte).
__host__ __device__ __forceinline__ constexpr uint64_t make_desc_b128(uint32_t smem_addr, uint32_t lbo_bytes,
                                                                      uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo_bytes & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3FFFFu) >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// K-major operand (A of m64 or B of nN with N = ROWS), k-step kk (columns 16 kk .. 16 kk + 15):
// rows are the M / N index, 8-row groups 1024 bytes apart (SBO), the 16 K-columns are 32
// contiguous (pre-swizzle) bytes of each row. LBO is not used by swizzled K-major layouts (the
// ISA: "assumed to be 1"): 16 bytes, i.e. 1 after encoding.
template <int ROWS>
__host__ __device__ __forceinline__ constexpr uint64_t desc_kmajor(uint32_t tile, int kk) {
  return make_desc_b128(tile + static_cast<uint32_t>((kk >> 2) * ROWS * 128 + (kk & 3) * 32), 16u, 1024u);
}

// MN-major operand (B of an m64nNk16 with N = the tile's columns, imm-trans-b = 1), k-step kq
// (tile rows 16 kq .. 16 kq + 15 = the K index): two 8-row atoms 1024 bytes apart (SBO), the
// N-columns in 64-column panels ROWS * 128 bytes apart (LBO).
template <int ROWS>
__host__ __device__ __forceinline__ constexpr uint64_t desc_mnmajor(uint32_t tile, int kq) {
  return make_desc_b128(tile + static_cast<uint32_t>(kq * 2048), static_cast<uint32_t>(ROWS * 128), 1024u);
}

__device__ __forceinline__ void wgmma_fence() {
#if PEAGLE_WGMMA_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if PEAGLE_WGMMA_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if PEAGLE_WGMMA_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Makes the generic-proxy writes of this thread to shared memory (st.shared, completed cp.async)
// visible to the async proxy, which wgmma reads its shared-memory operands through.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if PEAGLE_WGMMA_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Compiler-level pins: an empty volatile asm that "reads and writes" the registers, so ordinary
// code that uses them cannot be moved across the (volatile, ordered) wgmma fence / wait asm.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) asm volatile("" : "+f"(d[n][x])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) asm volatile("" : "+r"(a[n][x])::"memory");
}

// d[N/8][4] (+)= A B for one m64nNk16 step, f32 accumulators; scale_d == 0: d = A B.
// SS: A (m64 x k16) and B (k16 x nN) both K-major in shared memory (imm-trans-a = imm-trans-b = 0).
template <int N, typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, int scale_d);
// RS: A from registers (the m16n8k16-style fragment above), B MN-major in shared memory
// (imm-trans-b = 1: B[k][n] at the tile's row k, column n).
template <int N, typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d);

// ---- specializations (operand lists spelled out: the asm needs one operand per register)
template <>
__device__ __forceinline__ void wgmma_ss<64, __nv_bfloat16>(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b,
                                                            int scale_d) {
#if PEAGLE_WGMMA_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, "
      "1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<64, __nv_bfloat16>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                            int scale_d) {
#if PEAGLE_WGMMA_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, "
      "%35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<128, __nv_bfloat16>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                             int scale_d) {
#if PEAGLE_WGMMA_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, "
      "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "
      "%57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]),
        "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]),
        "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_ss<64, __half>(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if PEAGLE_WGMMA_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
      "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, "
      "0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<64, __half>(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                     int scale_d) {
#if PEAGLE_WGMMA_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
      "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, "
      "%35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_rs<128, __half>(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                      int scale_d) {
#if PEAGLE_WGMMA_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, "
      "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "
      "%57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]),
        "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]),
        "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
#endif
}

// A 64 x N accumulator (rounded to T) as the register A fragments of a following RS wgmma whose
// k-dim is those N columns: accumulator n-tiles 2 k, 2 k + 1 = A columns 16 k .. 16 k + 15 (the
// m16n8k16 A-fragment packing). P -> O += P V, P^T / dS^T -> dV / dK, dS -> dQ.
template <typename T, int N>
__device__ __forceinline__ void pack_acc_as_a(const float (&acc)[N / 8][4], uint32_t (&a)[N / 16][4]) {
#pragma unroll
  for (int k = 0; k < N / 16; ++k) {
    a[k][0] = Pack<T>::two(acc[2 * k][0], acc[2 * k][1]);
    a[k][1] = Pack<T>::two(acc[2 * k][2], acc[2 * k][3]);
    a[k][2] = Pack<T>::two(acc[2 * k + 1][0], acc[2 * k + 1][1]);
    a[k][3] = Pack<T>::two(acc[2 * k + 1][2], acc[2 * k + 1][3]);
  }
}

}  // namespace peagle::attention::cuda::wg
