// COD attention forward for Hopper (sm_90a warpgroup MMAs; attention_dispatch.h picks it).
// Same function and outputs as cod_attn_fwd_kernel (cod_attn_fwd.cuh) up to fp32 summation
// order: the same query tiles (TileMap / find_query_tile, tiles of 64 rows), the same per-tile
// key spans and blocks of 64 keys (setup_query_tile / key_block, `full` blocks unmasked), the
// same chain-key fold, online softmax and epilogue (fwd_chain_keys / fwd_softmax_fragment /
// fwd_store_row, shared with that kernel's statements: LSE natural log, +inf and zero output for rows without
// keys, NaN propagation). What differs is the matrix engine: CTA = one warpgroup (4 warps) over
// 64 query rows of one q head; per key block (layout and descriptors: cod_attn_wgmma.cuh)
//   S  = Q K^T  m64nBNk16 x D/16, A = Q [64][D], B = K [BN][D], both K-major B128 tiles (SS)
//   P  = online softmax of S in the accumulators; warp w holds rows 16 w .. 16 w + 15 in the
//        mma.sync C-fragment layout, i.e. exactly the MF = 1 fragments of cod_attn_fwd_kernel
//   O += P V    m64nDk16 x BN/16, A = P packed from the accumulators (RS), B = V [BN][D] read
//        MN-major (the reduction runs over the tile's rows), as dV += P^T dO in the wgmma dK/dV
// so Q / K / V are read by the tensor cores straight from shared memory (no ldmatrix, no Q
// fragments in registers). K / V are double-buffered with cp.async as in the mma.sync kernel.
// The key-block loop is software-pipelined as FlashAttention-3's intra-warpgroup overlap
// (fwd_wgmma_key_blocks below).
#pragma once
#include <cmath>
#include <cstdint>

#include "attention/cuda/cod_attn_fwd.cuh"
#include "attention/cuda/cod_attn_wgmma.cuh"

namespace peagle::attention::cuda {

template <int D, int BN>
struct FwdWgmmaConfig {
  static_assert(D % 64 == 0 && BN == 64, "wgmma forward tile shapes (wgmma_ss<64> for S, wgmma_rs<D> for O)");
  static constexpr int kBM = 64;  // query rows per CTA: the m64 of the warpgroup MMA
  static constexpr int kThreads = 128;
  static constexpr int kQTileBytes = kBM * D * 2;
  static constexpr int kKVTileBytes = BN * D * 2;                    // one stage of K (or V)
  static constexpr int kTileBytes = kQTileBytes + 4 * kKVTileBytes;  // Q + 2 stages of K and V
  static_assert(kQTileBytes % 1024 == 0 && kKVTileBytes % 1024 == 0, "tiles must keep 1024-byte alignment");
  // + 1024: the dynamic shared memory base is aligned up to 1024 bytes in the kernel;
  // 5 kBM ints of row ranges, 8 per warp of setup_query_tile's reduction
  static constexpr int kSmemBytes = 1024 + kTileBytes + (5 * kBM + 8 * 4) * 4;
  // + chain scores and key rows: kBM * K floats and ints (K known at launch)
  static constexpr int chain_bytes(int K) { return kBM * K * 8; }
};

// Dot product of row `row` of a [ROWS][D] B128 tile (cod_attn_wgmma.cuh layout; generic shared
// pointer `tile`) with a global row (16-byte aligned).
template <int ROWS, int D, typename T>
__device__ __forceinline__ float dot_sw128_global(const unsigned char* tile, int row, const T* grow) {
  const uint4* g = reinterpret_cast<const uint4*>(grow);
  float s = 0.f;
#pragma unroll
  for (int ch = 0; ch < D / 8; ++ch) {
    const uint4 gv = __ldg(g + ch);
    const uint4 sv = *reinterpret_cast<const uint4*>(tile + wg::sw128_offset<ROWS>(row, ch));
    s += dot8<T>(sv, gv);
  }
  return s;
}

// ---- pieces of the key-block loop. Hardware rules used below (PTX ISA, wgmma):
//  * wgmma.commit_group closes a group of this warp's wgmma.mma_async; groups complete in commit
//    order, and wgmma.wait_group N returns once at most N of them are pending, so after committing
//    groups G1 then G2, wait<1> means G1 is complete (G2 may run on).
//  * until the wait that covers a wgmma, ordinary code must neither read nor write its accumulators
//    and must not write its register A fragments; its shared-memory operands must not be
//    overwritten (by any thread: the barrier after every warp's wait) until it is complete.
//  * wgmma_fence (wgmma.fence) before a wgmma whose accumulators / A fragments ordinary code
//    wrote; wg::fence_operands pins the compiler's accesses to the registers on the right side of
//    the (volatile) fence / wait asm.

// S = Q K^T over the D / 16 k-steps (the first overwrites s: scale-d = 0) as one wgmma group.
template <int D, typename T, int BN, int BM>
__device__ __forceinline__ void fwd_wgmma_issue_s(float (&s)[BN / 8][4], uint32_t sQa, uint32_t kt) {
  wg::fence_operands(s);
  wg::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wg::wgmma_ss<BN, T>(s, wg::desc_kmajor<BM>(sQa, kk), wg::desc_kmajor<BN>(kt, kk), kk > 0);
  wg::wgmma_commit();
}

// O += P V over the BN / 16 k-steps (A = pa, B = the V tile read MN-major) as one wgmma group.
template <int D, typename T, int BN>
__device__ __forceinline__ void fwd_wgmma_issue_pv(float (&acc)[D / 8][4], uint32_t (&pa)[BN / 16][4], uint32_t vt) {
  wg::fence_operands(pa);
  wg::fence_operands(acc);
  wg::wgmma_fence();
#pragma unroll
  for (int kq = 0; kq < BN / 16; ++kq) wg::wgmma_rs<D, T>(acc, pa[kq], wg::desc_mnmajor<BN>(vt, kq), 1);
  wg::wgmma_commit();
}

// The key-block loop (FlashAttention-3's intra-warpgroup overlap): S(b + 1) = Q K(b + 1)^T is
// issued BEFORE O += P(b) V(b), so wait<1> returns with S(b + 1) complete while PV(b) may still run, and the
// softmax of block b + 1 (row max, alpha, P, l) runs on the CUDA cores during PV(b). The rescale
// acc *= alpha(b + 1) is deferred to the next iteration, between the issue of S(b + 2) and that of
// PV(b + 1) (acc is free then: PV(b) was waited for; it overlaps S(b + 2)), and pa(b + 1) is packed
// after PV(b)'s wait (PV(b) reads pa). Loop iteration b (K copied two blocks ahead, V one block
// ahead; K stage(x) = V stage(x) = x & 1):
//   copies K(b + 2) -> K stage(b), V(b + 1) -> V stage(b + 1)
//   S(b + 1) issue                     reads Q, K stage(b + 1); writes s (P(b) is already in pa)
//   acc *= alpha(b)                    no wgmma on acc is pending (PV(b - 1) was waited for)
//   PV(b) issue                        reads pa, V stage(b); accumulates acc
//   wait<1>                            S(b + 1) complete (committed first); PV(b) may run on
//   softmax(b + 1) without the rescale -> P(b + 1) in s, alpha(b + 1)
//   wait<0>                            PV(b) complete: pa free; pack pa = P(b + 1)
//   cp.async wait, proxy fence, barrier    K(b + 2), V(b + 1) visible to every thread's wgmma, and
//                                      every warp's S(b + 1), PV(b) complete before iteration
//                                      b + 1's copies overwrite K stage(b + 1) and V stage(b)
// The copies at the top of iteration b overwrite K stage(b) (last read by S(b): complete before
// the barrier that ended iteration b - 1, or the prologue's) and V stage(b + 1) (last read by
// PV(b - 1): complete before that same barrier): two stages each, two CTAs per SM. The prologue
// copies K(1) and runs S(0) and its softmax; the peeled last block is acc *= alpha(nb - 1),
// PV(nb - 1), wait<0>. Per block the values are those of an unpipelined loop: the same S (the same
// wgmma sequence on the same tiles; the first k-step overwrites), the same softmax statements in
// the same order on s, m and l, and acc goes through the same operations in the same order: chain
// fold, then per block acc *= alpha(b), acc += P(b) V(b) (the same RS wgmma chain on pa and V).
// The loop keeps two properties that ptxas needs to leave the wgmma asynchronous (else it
// serializes them, warnings C7514 / C7515 with -Xptxas -v): no wgmma group is pending across the
// loop's back edge, and every wgmma issue / wait in the loop is unconditional (the last block is
// peeled off instead of `if (b + 1 < nb)` around the next block's S). Checked for every
// instantiation: -Xptxas -v prints no C751x warning for this file.
template <int D, typename T, int BN, int BM, int NT>
__device__ __forceinline__ void fwd_wgmma_key_blocks(const TileKeys& tk, uint32_t sQa, uint32_t sKa, uint32_t sVa,
                                                     const T* rkbase, const T* rvbase, int64_t kld, int tid, int t,
                                                     const RowRanges (&rr)[2], float sl2, float (&s)[BN / 8][4],
                                                     float (&acc)[D / 8][4], float (&m)[2], float (&l)[2]) {
  constexpr uint32_t kStageBytes = BN * D * 2;
  const int nb = tk.nblocks;
  if (nb == 0) return;
  auto copy_tile = [&](uint32_t tile, const T* gbase, int blk) {
    int j0, jend;
    key_block<BN>(tk, blk, j0, jend);
    wg::load_tile_sw128<BN, D, NT>(tile, gbase, kld, j0, jend, tid);
  };
  float alpha[2];  // the rescale of acc for the block whose P is in pa
  auto softmax = [&](int blk) {
    int j0, jend;
    key_block<BN>(tk, blk, j0, jend);
    const bool full = j0 >= tk.lo_max && j0 + BN <= tk.hi_min && j0 + BN <= jend;
    fwd_softmax_fragment<BN>(s, m, l, rr, full, j0, jend, t, sl2, alpha);
  };
  uint32_t pa[BN / 16][4];  // P(b): read by PV(b) until its wait
  // ---- prologue: K(1) into K stage 1 (nothing read it yet); S(0) (Q, K(0), V(0) made visible by
  // the kernel's prologue barrier) and its softmax
  if (nb > 1) copy_tile(sKa + kStageBytes, rkbase, 1);
  cp_async_commit();
  fwd_wgmma_issue_s<D, T, BN, BM>(s, sQa, sKa);
  wg::wgmma_wait<0>();
  wg::fence_operands(s);
  softmax(0);
  wg::pack_acc_as_a<T, BN>(s, pa);
  // K(1) visible; every warp's S(0) complete before iteration 0's copies overwrite K stage 0
  cp_async_wait<0>();
  wg::fence_proxy_async_smem();
  __syncthreads();
  // ---- blocks 0 .. nb - 2; at the top of iteration b: pa = P(b), alpha = alpha(b) (acc not yet
  // rescaled for b), no wgmma pending, K(b + 1) and V(b) visible, every warp past S(b) and PV(b - 1)
#pragma unroll 1
  for (int b = 0; b + 1 < nb; ++b) {
    const uint32_t stage = b & 1, nstage = stage ^ 1;
    if (b + 2 < nb) copy_tile(sKa + stage * kStageBytes, rkbase, b + 2);
    copy_tile(sVa + nstage * kStageBytes, rvbase, b + 1);
    cp_async_commit();
    fwd_wgmma_issue_s<D, T, BN, BM>(s, sQa, sKa + nstage * kStageBytes);
    fwd_rescale_acc<D>(acc, alpha);  // acc: no pending wgmma; S(b + 1) does not touch it
    fwd_wgmma_issue_pv<D, T, BN>(acc, pa, sVa + stage * kStageBytes);
    wg::wgmma_wait<1>();  // S(b + 1) complete; PV(b) may run on (it touches only acc, pa, V stage(b))
    wg::fence_operands(s);
    softmax(b + 1);       // s, m, l, alpha only
    wg::wgmma_wait<0>();  // PV(b) complete: acc and pa free
    wg::fence_operands(acc);
    wg::fence_operands(pa);
    wg::pack_acc_as_a<T, BN>(s, pa);
    cp_async_wait<0>();
    wg::fence_proxy_async_smem();
    __syncthreads();
  }
  // ---- the last block (its V visible: the last barrier, or the kernel's prologue's if nb == 1)
  fwd_rescale_acc<D>(acc, alpha);
  fwd_wgmma_issue_pv<D, T, BN>(acc, pa, sVa + ((nb - 1) & 1) * kStageBytes);
  wg::wgmma_wait<0>();
  wg::fence_operands(acc);
  wg::fence_operands(pa);
}

template <int D, typename T, int BN>
__global__ void __launch_bounds__(128, 1) cod_attn_fwd_wgmma_kernel(const CodAttnParams p, const TileMap tm) {
#if PEAGLE_WGMMA_DEVICE
  using Cfg = FwdWgmmaConfig<D, BN>;
  constexpr int BM = Cfg::kBM, NT = Cfg::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // B128 swizzle atoms must start on 1024-byte shared-memory boundaries (descriptor base offset 0)
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQa = base;                                     // B128 tile [BM][D]
  const uint32_t sKa = base + Cfg::kQTileBytes;                  // [2 stages] B128 tiles [BN][D]
  const uint32_t sVa = sKa + 2 * Cfg::kKVTileBytes;              // [2 stages]
  int* s_meta = reinterpret_cast<int*>(smem + Cfg::kTileBytes);  // [5][BM]
  int* s_red = s_meta + 5 * BM;                                  // [4 warps][8]
  float* s_chain_s = reinterpret_cast<float*>(s_red + 8 * 4);
  int* s_chain_c = reinterpret_cast<int*>(s_chain_s + BM * p.K);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int h = blockIdx.y, hk = h / p.group;
  const QTile qt = find_query_tile(p, tm, gridDim.x - 1 - blockIdx.x, BM);
  const TileKeys tk = setup_query_tile<BM, NT, BN>(p, qt, s_meta, s_red, tid);
  // warp w owns tile rows [16 w, 16 w + 16) of every accumulator (the wgmma m64 fragment layout);
  // this thread holds rows wrow0 + g (r = 0) and wrow0 + g + 8 (r = 1).
  const int wrow0 = 16 * warp;

  const int64_t qld = int64_t(p.Hq) * D, kld = int64_t(p.Hkv) * D;
  const T* qbase = static_cast<const T*>(p.q) + int64_t(h) * D;
  const T* rkbase = static_cast<const T*>(p.rk) + int64_t(hk) * D;
  const T* rvbase = static_cast<const T*>(p.rv) + int64_t(hk) * D;

  wg::load_tile_sw128<BM, D, NT>(sQa, qbase, qld, qt.row0, int64_t(qt.row0) + qt.rows, tid);
  if (tk.nblocks > 0) {
    int j0, jend;
    key_block<BN>(tk, 0, j0, jend);
    wg::load_tile_sw128<BN, D, NT>(sKa, rkbase, kld, j0, jend, tid);
    wg::load_tile_sw128<BN, D, NT>(sVa, rvbase, kld, j0, jend, tid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  wg::fence_proxy_async_smem();  // the cp.async data is read by wgmma (async proxy)
  __syncthreads();

  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const RowRanges rr[2] = {row_ranges<BM>(s_meta, wrow0 + g), row_ranges<BM>(s_meta, wrow0 + g + 8)};
  const float sl2 = p.scale_log2;

  // ---- chain keys (Q rows read from the B128 tile with ordinary shared loads)
  if (tk.any_chain)
    fwd_chain_keys<D, T>(
        p, qt, hk, warp, lane, g, t, wrow0, kld, sl2, s_chain_s, s_chain_c,
        [&](int row, const T* grow) { return dot_sw128_global<BM, D, T>(smem, row, grow); }, acc, m, l);

  // S accumulators: the first k-step of each block overwrites them (scale-d = 0)
  float s[BN / 8][4];
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;

  // ---- key blocks
  fwd_wgmma_key_blocks<D, T, BN, BM, NT>(tk, sQa, sKa, sVa, rkbase, rvbase, kld, tid, t, rr, sl2, s, acc, m, l);

  // ---- epilogue
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    const int row = wrow0 + g + 8 * r;
    if (row < qt.rows) fwd_store_row<D, T>(p, acc, r, m[r], lsum, rr[r].valid, qt.row0 + row, h, t, qld);
  }
#endif  // PEAGLE_WGMMA_DEVICE
}

// Launch of the wgmma forward (grid: query tiles of 64 rows x q heads), on `stream`.
template <int D, typename T>
cudaError_t launch_fwd_wgmma(const CodAttnParams& p, cudaStream_t stream) {
  constexpr int BN = 64;
  using Cfg = FwdWgmmaConfig<D, BN>;
  TileMap tm;
  const int ntiles = make_tile_map(p, Cfg::kBM, tm);
  if (ntiles == 0 || p.Hq == 0) return cudaSuccess;
  auto kernel = cod_attn_fwd_wgmma_kernel<D, T, BN>;
  const int smem = Cfg::kSmemBytes + Cfg::chain_bytes(p.K);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(ntiles, p.Hq), Cfg::kThreads, smem, stream>>>(p, tm);
  return cudaGetLastError();
}

}  // namespace peagle::attention::cuda
