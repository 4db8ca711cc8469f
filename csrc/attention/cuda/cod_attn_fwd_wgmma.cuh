// COD attention forward for Hopper: PEAGLE_ATTN_FWD=wgmma (sm_90a warpgroup MMAs).
// Same function and outputs as cod_attn_fwd_kernel (cod_attn_fwd.cuh) up to fp32 summation
// order: the same query tiles (TileMap / find_query_tile, tiles of 64 rows), the same per-tile
// key spans and blocks of 64 keys (setup_query_tile / key_block, `full` blocks unmasked), the
// same chain-key fold, online softmax and epilogue (fwd_chain_keys / fwd_softmax_fragment /
// fwd_store_row, shared with that kernel: LSE natural log, +inf and zero output for rows without
// keys, NaN propagation). What differs is the matrix engine: CTA = one warpgroup (4 warps) over
// 64 query rows of one q head; per key block (layout and descriptors: cod_attn_wgmma.cuh)
//   S  = Q K^T  m64nBNk16 x D/16, A = Q [64][D], B = K [BN][D], both K-major B128 tiles (SS)
//   P  = online softmax of S in the accumulators; warp w holds rows 16 w .. 16 w + 15 in the
//        mma.sync C-fragment layout, i.e. exactly the MF = 1 fragments of cod_attn_fwd_kernel
//   O += P V    m64nDk16 x BN/16, A = P packed from the accumulators (RS), B = V [BN][D] read
//        MN-major (the reduction runs over the tile's rows), as dV += P^T dO in the wgmma dK/dV
// so Q / K / V are read by the tensor cores straight from shared memory (no ldmatrix, no Q
// fragments in registers). K / V are double-buffered with cp.async as in the mma.sync kernel.
// PEAGLE_ATTN_WGMMA_PIPE (CodAttnParams::wgmma_pipe) selects software-pipelined key-block loops
// (fwd_wgmma_blocks_pipe1 / _pipe2 below) with bitwise the same results.
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

// ---- pieces of the key-block loops (every PIPE level issues its MMAs through them): the same
// wgmma instructions on the same operands at every level, so every value is bitwise the same; only
// the points where the warps wait for them move. Hardware rules used below (PTX ISA, wgmma):
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

// Both loops below keep two properties that ptxas needs to leave the wgmma asynchronous (else it
// serializes them, warnings C7514 / C7515 with -Xptxas -v): no wgmma group is pending across the
// loop's back edge, and every wgmma issue / wait in the loop is unconditional (the last block is
// peeled off instead of `if (b + 1 < nb)` around the next block's S). Checked for every
// instantiation: -Xptxas -v prints no C751x warning for this file.

// PIPE = 1: O += P(b) V(b) runs while the warps wait for block b + 1's copies, pass the barrier and
// issue S(b + 1) = Q K(b + 1)^T; it is waited for (wait<1>: groups complete in commit order, so
// this leaves only S(b + 1) pending) before block b + 2's copies overwrite its V stage and before
// the softmax of b + 1 rescales acc and pa is repacked. Loop iteration b (stage(x) = x & 1 holds
// K(x) and V(x)):
//   PV(b) issue                        reads pa, V stage(b); accumulates acc
//   cp.async wait, proxy fence, barrier    K(b + 1), V(b + 1) (stage(b + 1)) visible to all wgmma
//   S(b + 1) issue                     reads Q, K stage(b + 1); writes s (its P(b) was packed into pa)
//   wait<1>                            PV(b) complete: acc, pa, V stage(b) free for this warp
//   proxy fence, barrier               ... for every warp; K stage(b) is free too: its reader S(b)
//                                      completed before every warp's previous softmax
//   copies of b + 2 -> stage(b)
//   wait<0>                            S(b + 1) complete
//   softmax(b + 1) (rescales acc), pack pa
// The prologue runs S(0) and its softmax (with the copies of block 1 into the unused stage 1 in
// flight); the peeled last block is PV(nb - 1) + wait<0>. Two stages suffice (see the copies),
// so shared memory and occupancy are PIPE = 0's. The values are bitwise PIPE = 0's: the same
// wgmma sequences on the same operands and the same fwd_softmax_fragment, in the same order per
// block (softmax(b) -> rescale acc -> PV(b) -> softmax(b + 1) ...).
template <int D, typename T, int BN, int BM, int NT>
__device__ __forceinline__ void fwd_wgmma_blocks_pipe1(const TileKeys& tk, uint32_t sQa, uint32_t sKa, uint32_t sVa,
                                                       const T* rkbase, const T* rvbase, int64_t kld, int tid, int t,
                                                       const RowRanges (&rr)[2], float sl2, float (&s)[BN / 8][4],
                                                       float (&acc)[D / 8][4], float (&m)[2], float (&l)[2]) {
  constexpr uint32_t kStageBytes = BN * D * 2;
  const int nb = tk.nblocks;
  if (nb == 0) return;
  auto copy_block = [&](int blk, uint32_t stage) {
    int j0, jend;
    key_block<BN>(tk, blk, j0, jend);
    wg::load_tile_sw128<BN, D, NT>(sKa + stage * kStageBytes, rkbase, kld, j0, jend, tid);
    wg::load_tile_sw128<BN, D, NT>(sVa + stage * kStageBytes, rvbase, kld, j0, jend, tid);
  };
  auto softmax = [&](int blk) {
    int j0, jend;
    key_block<BN>(tk, blk, j0, jend);
    const bool full = j0 >= tk.lo_max && j0 + BN <= tk.hi_min && j0 + BN <= jend;
    fwd_softmax_fragment<D, BN>(s, acc, m, l, rr, full, j0, jend, t, sl2);
  };
  uint32_t pa[BN / 16][4];  // P(b): read by PV(b) until its wait
  // ---- prologue: copies of block 1 into stage 1 (nothing read it yet); S(0) (Q, K(0), V(0) made
  // visible by the kernel's prologue barrier) and its softmax (acc: only the chain fold wrote it)
  if (nb > 1) copy_block(1, 1);
  cp_async_commit();
  fwd_wgmma_issue_s<D, T, BN, BM>(s, sQa, sKa);
  wg::wgmma_wait<0>();
  wg::fence_operands(s);
  softmax(0);
  wg::pack_acc_as_a<T, BN>(s, pa);
  // ---- blocks 0 .. nb - 2; at the top of block b: pa = P(b), acc rescaled for b, no wgmma pending,
  // K(b + 1) / V(b + 1) copies committed (the last cp.async group)
#pragma unroll 1
  for (int b = 0; b + 1 < nb; ++b) {
    const uint32_t stage = b & 1, nstage = stage ^ 1;
    fwd_wgmma_issue_pv<D, T, BN>(acc, pa, sVa + stage * kStageBytes);
    cp_async_wait<0>();
    wg::fence_proxy_async_smem();
    __syncthreads();
    fwd_wgmma_issue_s<D, T, BN, BM>(s, sQa, sKa + nstage * kStageBytes);
    wg::wgmma_wait<1>();  // PV(b) complete (committed before S(b + 1)); S(b + 1) may run on
    wg::fence_operands(acc);
    wg::fence_operands(pa);
    // Every warp's PV(b) reads of V stage(b) are complete before any thread's copies overwrite it
    // (the proxy fence keeps PIPE = 0's order at this async-proxy read -> generic write reuse:
    // wgmma completion, fence.proxy.async, barrier, cp.async).
    wg::fence_proxy_async_smem();
    __syncthreads();
    if (b + 2 < nb) copy_block(b + 2, stage);
    cp_async_commit();
    wg::wgmma_wait<0>();  // S(b + 1) complete
    wg::fence_operands(s);
    softmax(b + 1);                   // rescales acc: PV(b) is complete
    wg::pack_acc_as_a<T, BN>(s, pa);  // PV(b), the last reader of pa, is complete
  }
  // ---- the last block: its V was made visible by the last barrier (or the kernel's prologue's)
  fwd_wgmma_issue_pv<D, T, BN>(acc, pa, sVa + ((nb - 1) & 1) * kStageBytes);
  wg::wgmma_wait<0>();
  wg::fence_operands(acc);
  wg::fence_operands(pa);
  cp_async_wait<0>();  // (an empty group: no copies are left in flight at the epilogue)
}

// PIPE = 2 (FlashAttention-3's intra-warpgroup overlap): S(b + 1) = Q K(b + 1)^T is issued BEFORE
// O += P(b) V(b), so wait<1> returns with S(b + 1) complete while PV(b) may still run, and the
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
// PV(b - 1): complete before that same barrier): two stages each, shared memory and occupancy as
// PIPE = 0. The prologue copies K(1) and runs S(0) and its softmax; the peeled last block is
// acc *= alpha(nb - 1), PV(nb - 1), wait<0>.
// Bitwise equal to PIPE = 0: per block the same S (the same wgmma sequence on the same tiles; the
// first k-step overwrites), the same softmax statements in the same order on s, m and l
// (fwd_softmax_fragment_alpha = fwd_softmax_fragment minus the acc rescale, which is the same
// multiplication by the same alpha, fwd_rescale_acc), and acc goes through exactly PIPE = 0's
// operations in the same order: chain fold, then per block acc *= alpha(b), acc += P(b) V(b)
// (the same RS wgmma chain on the same pa and V tile).
template <int D, typename T, int BN, int BM, int NT>
__device__ __forceinline__ void fwd_wgmma_blocks_pipe2(const TileKeys& tk, uint32_t sQa, uint32_t sKa, uint32_t sVa,
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
    fwd_softmax_fragment_alpha<BN>(s, m, l, rr, full, j0, jend, t, sl2, alpha);
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

// PIPE (CodAttnParams::wgmma_pipe): 0 = every wgmma group waited for before the next step (the
// first verified form); 1 = O += P V left in flight over the next block's S = Q K^T issue and the
// barrier; 2 = S(b + 1) issued before O += P(b) V(b), its softmax overlapping P V (FlashAttention-3
// intra-warpgroup pipelining). The PIPE = 0 loop's SASS is unchanged since it was first verified.
template <int D, typename T, int BN, int PIPE>
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
  constexpr uint32_t kStageBytes = Cfg::kKVTileBytes;

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

  // MF = 1 shaped state, so the helpers shared with cod_attn_fwd_kernel apply unchanged
  float acc[1][D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[0][n][0] = acc[0][n][1] = acc[0][n][2] = acc[0][n][3] = 0.f;
  float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.f, 0.f}};
  const RowRanges rr[2] = {row_ranges<BM>(s_meta, wrow0 + g), row_ranges<BM>(s_meta, wrow0 + g + 8)};
  const float sl2 = p.scale_log2;

  // ---- chain keys (Q rows read from the B128 tile with ordinary shared loads)
  if (tk.any_chain)
    fwd_chain_keys<D, T, 1>(
        p, qt, hk, warp, lane, g, t, wrow0, kld, sl2, s_chain_s, s_chain_c,
        [&](int row, const T* grow) { return dot_sw128_global<BM, D, T>(smem, row, grow); }, acc, m, l);

  // S accumulators: the first k-step of each block overwrites them (scale-d = 0)
  float s[BN / 8][4];
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;

  // ---- key blocks
  if constexpr (PIPE == 0) {
#pragma unroll 1
    for (int b = 0; b < tk.nblocks; ++b) {
      const int stage = b & 1;
      if (b + 1 < tk.nblocks) {
        int nj0, njend;
        key_block<BN>(tk, b + 1, nj0, njend);
        wg::load_tile_sw128<BN, D, NT>(sKa + (stage ^ 1) * kStageBytes, rkbase, kld, nj0, njend, tid);
        wg::load_tile_sw128<BN, D, NT>(sVa + (stage ^ 1) * kStageBytes, rvbase, kld, nj0, njend, tid);
      }
      cp_async_commit();
      int j0, jend;
      key_block<BN>(tk, b, j0, jend);
      const uint32_t kt = sKa + stage * kStageBytes, vt = sVa + stage * kStageBytes;

      // S = Q K^T: rows = the 64 queries, columns = the BN keys
      fwd_wgmma_issue_s<D, T, BN, BM>(s, sQa, kt);
      wg::wgmma_wait<0>();
      wg::fence_operands(s);

      const bool full = j0 >= tk.lo_max && j0 + BN <= tk.hi_min && j0 + BN <= jend;
      fwd_softmax_fragment<D, BN>(s, acc[0], m[0], l[0], rr, full, j0, jend, t, sl2);

      // O += P V: A = P from the accumulators (n-tiles 2 kq, 2 kq + 1 = A columns 16 kq .. 16 kq +
      // 15, the m16n8k16 A-fragment packing of the mma.sync kernel), B = the V stage read MN-major
      uint32_t pa[BN / 16][4];
      wg::pack_acc_as_a<T, BN>(s, pa);
      // acc was rescaled (and, before the first block, filled by the chain fold) by ordinary code:
      // fwd_wgmma_issue_pv fences it
      fwd_wgmma_issue_pv<D, T, BN>(acc[0], pa, vt);
      // The next block's softmax rescales acc and overwrites s (and, after the barrier below, the
      // next copies overwrite this stage): wait for this batch, which reads pa and the stage.
      wg::wgmma_wait<0>();
      wg::fence_operands(acc[0]);
      wg::fence_operands(pa);
      cp_async_wait<0>();
      wg::fence_proxy_async_smem();
      __syncthreads();
    }
  } else if constexpr (PIPE == 1) {
    fwd_wgmma_blocks_pipe1<D, T, BN, BM, NT>(tk, sQa, sKa, sVa, rkbase, rvbase, kld, tid, t, rr, sl2, s, acc[0], m[0],
                                             l[0]);
  } else {
    fwd_wgmma_blocks_pipe2<D, T, BN, BM, NT>(tk, sQa, sKa, sVa, rkbase, rvbase, kld, tid, t, rr, sl2, s, acc[0], m[0],
                                             l[0]);
  }

  // ---- epilogue
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[0][r]);
    const int row = wrow0 + g + 8 * r;
    if (row < qt.rows) fwd_store_row<D, T>(p, acc[0], r, m[0][r], lsum, rr[r].valid, qt.row0 + row, h, t, qld);
  }
#endif  // PEAGLE_WGMMA_DEVICE
}

// Launch of the wgmma forward (grid: query tiles of 64 rows x q heads), on `stream`.
// PIPE: CodAttnParams::wgmma_pipe (the instantiation is chosen by the dispatch).
template <int D, typename T, int PIPE>
cudaError_t launch_fwd_wgmma(const CodAttnParams& p, cudaStream_t stream) {
  constexpr int BN = 64;
  using Cfg = FwdWgmmaConfig<D, BN>;
  TileMap tm;
  const int ntiles = make_tile_map(p, Cfg::kBM, tm);
  if (ntiles == 0 || p.Hq == 0) return cudaSuccess;
  auto kernel = cod_attn_fwd_wgmma_kernel<D, T, BN, PIPE>;
  const int smem = Cfg::kSmemBytes + Cfg::chain_bytes(p.K);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(ntiles, p.Hq), Cfg::kThreads, smem, stream>>>(p, tm);
  return cudaGetLastError();
}

}  // namespace peagle::attention::cuda
