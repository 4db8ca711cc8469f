// COD sampling on the GPU (docs/design.md section 2), bit-identical to the CPU op.
//
// Draw: a "level" is one random selection. Level 0 is the max_anchors subsampling of the
// seeds (only when max_anchors >= 0), level d >= 1 is depth d. Candidate p of level L has
// the 64-bit key cod_key(seed, stream(L), depth(L), p) and the level keeps the k smallest
// keys of its pool (all of them if the pool is smaller), exactly like the CPU op.
//
// Selecting the k smallest of a pool spread over n positions, without asking the host:
//   step kernel  : every position computes its pool flag and adds its key's top `bin_bits`
//                  bits to a histogram; the last block to finish (ticket counter) scans the
//                  histogram and finds the bin b* holding the k-th smallest key. Keys are
//                  uniform, so b* holds ~16 keys.
//   gather kernel: (only when k ends inside b*) the keys of b* are appended to a buffer and
//                  the last block picks the exact rank inside it -> threshold key.
//   The next step kernel marks "selected = in pool and key < threshold" and, in the same
//   pass, builds the next depth's pool (the shifted selection, same document, loss mask 1).
// So a depth costs two launches and no host round trip. After the last depth, the last block
// turns per-tile selection counts into prefix sums and the depth offsets, which the host
// reads once (the op's only sync) to allocate the outputs; a write kernel then emits every
// depth's anchors in position order (= sorted) at its offset.
#include <cub/block/block_scan.cuh>
#include <cub/warp/warp_scan.cuh>

#include "common/philox.h"
#include "cod/cod_kernels.h"

namespace peagle::cod {
namespace {

using u64 = unsigned long long;

constexpr int kThreads = 256;
constexpr int kItems = 4;  // consecutive positions per thread ("blocked": a tile is in order)
constexpr int kTile = kThreads * kItems;
constexpr int kSmallSelect = 1024;  // threshold bins up to this size are ranked in shared memory
constexpr int kMaxTickets = 2 * kMaxDepths + 4;

// How a level's selection is expressed once its threshold is known: selected = in pool and
// key < thr_excl. Keys are < 2^64 - 1 (their low word is a position < 2^31), so
// thr_excl = ~0 keeps the whole pool and 0 keeps nothing.
enum LevelMode : unsigned { kModeNone = 0, kModeAll = 1, kModeThreshold = 2, kModePartialBin = 3 };

struct LevelState {
  u64 thr_excl;
  long long pool_size;
  long long k;            // requested sample size
  long long rank_in_bin;  // partial-bin mode: 1-based rank of the threshold key inside bin b*
  unsigned bin;           // partial-bin mode: b*
  unsigned mode;
  unsigned gather_count;
  unsigned unused;
};

struct DeviceArgs {
  const int32_t* doc;
  const uint8_t* loss_mask;
  long long n;
  int num_depths;
  int tiles;
  int bin_bits;
  int depth0_all;
  long long max_anchors;
  u64 seed;
  double ratio[kMaxDepths];
  CodCudaResult* result;  // device copy; the host gets it with one memcpy
  LevelState* states;     // [levels]
  unsigned* tickets;      // one counter per launch that ends in a last-block step
  unsigned* hist;         // [levels][1 << bin_bits]
  unsigned* tile_counts;  // [K lists][tiles]: per-tile counts, then their exclusive prefix
  uint8_t* pool;          // [levels][n]
  uint8_t* sel;           // [levels][n]
  u64* gather;            // [n] keys of the threshold bin
};

// Rows of the per-level arrays: levels 0..K-1, and row 1 always exists because the selected
// seeds (pool of depth 1) also give depth 0's anchors in "anchors" mode, even when K == 1.
int level_rows(int num_depths) { return num_depths < 2 ? 2 : num_depths; }

struct ScratchLayout {
  size_t result, states, tickets, hist, header_end, tile_counts, pool, sel, gather, total;
};

size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

ScratchLayout scratch_layout(int64_t n, int num_depths, int bin_bits) {
  const size_t rows = static_cast<size_t>(level_rows(num_depths));
  const size_t tiles = static_cast<size_t>((n + kTile - 1) / kTile);
  ScratchLayout s{};
  size_t off = 0;
  s.result = off;
  off = align_up(off + sizeof(CodCudaResult));
  s.states = off;
  off = align_up(off + rows * sizeof(LevelState));
  s.tickets = off;
  off = align_up(off + kMaxTickets * sizeof(unsigned));
  s.hist = off;
  off = align_up(off + rows * (size_t(1) << bin_bits) * sizeof(unsigned));
  s.header_end = off;  // everything above starts zeroed
  s.tile_counts = off;
  off = align_up(off + static_cast<size_t>(num_depths) * tiles * sizeof(unsigned));
  s.pool = off;
  off = align_up(off + rows * static_cast<size_t>(n));
  s.sel = off;
  off = align_up(off + rows * static_cast<size_t>(n));
  s.gather = off;
  off = align_up(off + static_cast<size_t>(n) * sizeof(u64));
  s.total = off;
  return s;
}

// Selection histogram width for n positions: >= 64 positions per bin (few bins to scan), so the
// threshold bin holds ~64 keys or fewer and its exact rank is a small one-block job; capped at 16
// bits, so from n ~ 2^26 on a threshold bin can exceed kSmallSelect keys and takes the radix select.
int bin_bits_for(int64_t n) {
  int bits = 0;
  while (bits < 62 && (int64_t(1) << (bits + 1)) <= n) ++bits;  // floor(log2 n)
  bits -= 6;
  return bits < 4 ? 4 : (bits > 16 ? 16 : bits);
}

DeviceArgs make_args(const CodCudaProblem& pb, void* scratch) {
  const int bin_bits = bin_bits_for(pb.n);
  const ScratchLayout s = scratch_layout(pb.n, pb.num_depths, bin_bits);
  char* base = static_cast<char*>(scratch);
  DeviceArgs a{};
  a.doc = pb.document_ids;
  a.loss_mask = pb.loss_mask;
  a.n = pb.n;
  a.num_depths = pb.num_depths;
  a.tiles = static_cast<int>((pb.n + kTile - 1) / kTile);
  a.bin_bits = bin_bits;
  a.depth0_all = pb.depth0_all ? 1 : 0;
  a.max_anchors = pb.max_anchors;
  a.seed = pb.seed;
  for (int d = 0; d < kMaxDepths; ++d) a.ratio[d] = pb.ratio[d];
  a.result = reinterpret_cast<CodCudaResult*>(base + s.result);
  a.states = reinterpret_cast<LevelState*>(base + s.states);
  a.tickets = reinterpret_cast<unsigned*>(base + s.tickets);
  a.hist = reinterpret_cast<unsigned*>(base + s.hist);
  a.tile_counts = reinterpret_cast<unsigned*>(base + s.tile_counts);
  a.pool = reinterpret_cast<uint8_t*>(base + s.pool);
  a.sel = reinterpret_cast<uint8_t*>(base + s.sel);
  a.gather = reinterpret_cast<u64*>(base + s.gather);
  return a;
}

__device__ __forceinline__ u64 level_key(u64 seed, int level, long long q) {
  return level == 0 ? cod_key(seed, kCodStreamAnchors, 0u, static_cast<uint32_t>(q))
                    : cod_key(seed, kCodStreamDepth, static_cast<uint32_t>(level), static_cast<uint32_t>(q));
}

// speculators' sample size, computed exactly as cod::depth_sample_size on the host.
__device__ __forceinline__ long long sample_size(long long num_seeds, int d, double ratio) {
  const long long valid = num_seeds - d > 0 ? num_seeds - d : 0;
  return static_cast<long long>(floor(static_cast<double>(valid) * ratio));
}

// Threadfence-reduction pattern (CUDA programming guide, memory fence functions): every
// block publishes its global writes, then takes a ticket; the block with the last ticket
// sees all of them. Must be reached by every thread of every block.
__device__ __forceinline__ bool is_last_block(unsigned* ticket) {
  __shared__ unsigned s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = (atomicAdd(ticket, 1u) == gridDim.x * gridDim.y - 1) ? 1u : 0u;
  __syncthreads();
  const bool last = s_last != 0;
  if (last) __threadfence();
  return last;
}

// Last block of a step with a histogram: pool size, sample size k, and where the k-th
// smallest key lies. Reads other blocks' atomics with __ldcg (L2, never a stale L1 line).
__device__ void finish_histogram(const DeviceArgs& a, int level) {
  using Scan = cub::BlockScan<long long, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int bins = 1 << a.bin_bits;
  const unsigned* h = a.hist + static_cast<size_t>(level) * bins;
  const int per = (bins + kThreads - 1) / kThreads;
  const int lo = min(static_cast<int>(threadIdx.x) * per, bins);
  const int hi = min(lo + per, bins);
  long long mine = 0;
#pragma unroll 8
  for (int b = lo; b < hi; ++b) mine += __ldcg(h + b);
  long long before = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(mine, before, total);

  long long k;
  if (level == 0) {
    k = a.max_anchors;
  } else {
    const long long num_seeds = level == 1 ? total : __ldcg(&a.states[1].pool_size);
    k = sample_size(num_seeds, level, a.ratio[level]);
    // speculators stops at the first empty depth; every deeper depth stays empty.
    if (level >= 2 && __ldcg(&a.states[level - 1].k) <= 0) k = 0;
  }
  LevelState* st = a.states + level;
  if (threadIdx.x == 0) {
    st->pool_size = total;
    st->k = k;
  }
  if (k <= 0) {
    if (threadIdx.x == 0) {
      st->mode = kModeNone;
      st->thr_excl = 0ull;
    }
  } else if (k >= total) {
    if (threadIdx.x == 0) {
      st->mode = kModeAll;
      st->thr_excl = ~0ull;
    }
  } else if (before < k && k <= before + mine) {  // exactly one thread: the one whose bins hold rank k
    long long cum = before;
    for (int b = lo; b < hi; ++b) {
      const long long hb = __ldcg(h + b);
      if (cum + hb >= k) {
        const long long rank = k - cum;  // 1 <= rank <= hb
        if (rank == hb) {                // the whole bin is in: threshold = start of the next bin
          st->mode = kModeThreshold;
          st->thr_excl = (b + 1 == bins) ? ~0ull : (static_cast<u64>(b + 1) << (64 - a.bin_bits));
        } else {
          st->mode = kModePartialBin;
          st->bin = static_cast<unsigned>(b);
          st->rank_in_bin = rank;
        }
        break;
      }
      cum += hb;
    }
  }
}

// Last block of the final step: exclusive prefix of every list's per-tile counts (the write
// kernel's output offsets) and the depth offsets for the host. List 0 = depth 0 in anchors
// mode (the selected seeds), list d >= 1 = depth d. One warp per list, lists in parallel.
__device__ void finish_offsets(const DeviceArgs& a) {
  using WarpScan = cub::WarpScan<long long>;
  constexpr int kWarps = kThreads / 32;
  __shared__ typename WarpScan::TempStorage warp_storage[kWarps];
  __shared__ long long list_total[kMaxDepths];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  for (int j = warp; j < a.num_depths; j += kWarps) {
    unsigned* counts = a.tile_counts + static_cast<size_t>(j) * a.tiles;
    long long carry = 0;
    for (int t0 = 0; t0 < a.tiles; t0 += 32) {
      const int t = t0 + lane;
      const long long v = t < a.tiles ? static_cast<long long>(__ldcg(counts + t)) : 0;
      long long excl = 0, agg = 0;
      WarpScan(warp_storage[warp]).ExclusiveSum(v, excl, agg);
      __syncwarp();
      if (t < a.tiles) counts[t] = static_cast<unsigned>(carry + excl);
      carry += agg;
    }
    if (lane == 0) list_total[j] = carry;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    long long off = 0;
    a.result->offsets[0] = 0;
    for (int j = 0; j < a.num_depths; ++j) {
      off += (j == 0 && a.depth0_all) ? a.n : list_total[j];
      a.result->offsets[j + 1] = off;
    }
  }
}

// One pass over the positions: marks level `prev` (selected = in pool and key < threshold)
// and builds level `cur`'s pool from it, optionally histogramming cur's keys.
//   prev == -1        : cur's pool is the seeds (first level); also finds the smallest doc id
//   prev == 0         : cur == 1, pool = the anchor subsample itself (no shift)
//   prev >= 1         : pool of cur = {p+1 : p selected at prev, loss_mask, same document}
//   cur == -1         : nothing to build (final step)
// Exactly one of do_hist / is_final holds, and the last block finishes it.
__global__ void __launch_bounds__(kThreads)
    cod_step_kernel(const DeviceArgs a, int prev, int cur, int do_hist, int is_final, int ticket) {
  __shared__ unsigned s_count_prev, s_count_pool1;
  __shared__ int s_min_doc;
  if (threadIdx.x == 0) {
    s_count_prev = 0;
    s_count_pool1 = 0;
    s_min_doc = 0;
  }
  __syncthreads();

  const long long n = a.n;
  const long long base = static_cast<long long>(blockIdx.x) * kTile + static_cast<long long>(threadIdx.x) * kItems;
  // sel_prev[i + 1] = selected at level prev, position base + i; sel_prev[0] = at base - 1.
  bool sel_prev[kItems + 1];
#pragma unroll
  for (int i = 0; i <= kItems; ++i) sel_prev[i] = false;
  unsigned count_prev = 0, count_pool1 = 0;
  int min_doc = 0;

  if (prev >= 0) {
    const u64 thr = a.states[prev].thr_excl;
    const uint8_t* pool_prev = a.pool + static_cast<size_t>(prev) * n;
    uint8_t* sel_out = a.sel + static_cast<size_t>(prev) * n;
    if (prev >= 1 && cur >= 0 && base >= 1 && base - 1 < n) {
      const long long q = base - 1;  // owned by the previous thread; recomputed, not read
      sel_prev[0] = pool_prev[q] && level_key(a.seed, prev, q) < thr;
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const long long q = base + i;
      if (q < n) {
        const bool s = pool_prev[q] && level_key(a.seed, prev, q) < thr;
        sel_prev[i + 1] = s;
        sel_out[q] = s ? 1 : 0;
        count_prev += s ? 1u : 0u;
      }
    }
  }

  if (cur >= 0) {
    uint8_t* pool_cur = a.pool + static_cast<size_t>(cur) * n;
    unsigned* h = a.hist + (static_cast<size_t>(cur) << a.bin_bits);
    const int shift = 64 - a.bin_bits;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const long long q = base + i;
      if (q < n) {
        bool in_pool;
        if (prev < 0) {
          // seed: loss-masked, in a real document, and its predecessor (the anchor) too
          const int dq = a.doc[q];
          min_doc = min(min_doc, dq);
          in_pool = q >= 1 && a.loss_mask[q] != 0 && dq >= 0 && a.doc[q - 1] == dq;
        } else if (prev == 0) {
          in_pool = sel_prev[i + 1];
        } else {
          in_pool = sel_prev[i] && a.loss_mask[q] != 0 && a.doc[q] == a.doc[q - 1];
        }
        pool_cur[q] = in_pool ? 1 : 0;
        count_pool1 += in_pool ? 1u : 0u;
        if (do_hist && in_pool) atomicAdd(h + (level_key(a.seed, cur, q) >> shift), 1u);
      }
    }
  }

  if (count_prev) atomicAdd(&s_count_prev, count_prev);
  if (cur == 1 && count_pool1) atomicAdd(&s_count_pool1, count_pool1);
  if (min_doc < 0) atomicMin(&s_min_doc, min_doc);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (prev >= 1) a.tile_counts[static_cast<size_t>(prev) * a.tiles + blockIdx.x] = s_count_prev;
    if (cur == 1) a.tile_counts[blockIdx.x] = s_count_pool1;
    if (s_min_doc < 0) atomicMin(&a.result->min_document_id, s_min_doc);
  }

  if (!is_last_block(a.tickets + ticket)) return;
  if (do_hist) finish_histogram(a, cur);
  if (is_final) finish_offsets(a);
}

// The m-th smallest (1-based) of c distinct keys in global memory, by one block.
__device__ u64 block_kth_smallest(const u64* keys, unsigned c, long long m) {
  __shared__ u64 s_keys[kSmallSelect];
  __shared__ unsigned s_digit_hist[256];
  __shared__ u64 s_result;
  __shared__ long long s_rank;
  if (c <= static_cast<unsigned>(kSmallSelect)) {
    // rank of each key = how many keys are smaller (keys are distinct)
    for (unsigned i = threadIdx.x; i < c; i += kThreads) s_keys[i] = __ldcg(keys + i);
    __syncthreads();
    for (unsigned i = threadIdx.x; i < c; i += kThreads) {
      const u64 ki = s_keys[i];
      long long smaller = 0;
      for (unsigned j = 0; j < c; ++j) smaller += s_keys[j] < ki ? 1 : 0;
      if (smaller == m - 1) s_result = ki;
    }
    __syncthreads();
    return s_result;
  }
  // Large bin (from n ~ 2^26 positions on, where the histogram stays at 16 bits): radix select,
  // 8 bits at a time from the top, over the keys that match the digits found so far.
  u64 prefix = 0, known_mask = 0;
  long long rank = m;
  for (int shift = 56; shift >= 0; shift -= 8) {
    s_digit_hist[threadIdx.x] = 0;  // kThreads == 256
    __syncthreads();
    for (unsigned i = threadIdx.x; i < c; i += kThreads) {
      const u64 key = __ldcg(keys + i);
      if ((key & known_mask) == prefix) atomicAdd(&s_digit_hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      long long cum = 0;
      for (int digit = 0; digit < 256; ++digit) {
        const long long hd = s_digit_hist[digit];
        if (cum + hd >= rank) {
          s_result = prefix | (static_cast<u64>(digit) << shift);
          s_rank = rank - cum;
          break;
        }
        cum += hd;
      }
    }
    __syncthreads();
    prefix = s_result;
    rank = s_rank;
    known_mask |= static_cast<u64>(255) << shift;
    __syncthreads();
  }
  return prefix;
}

// Level `level` ends inside bin b*: collect that bin's keys, and the last block turns the
// rank inside the bin into the exact threshold.
__global__ void __launch_bounds__(kThreads) cod_gather_kernel(const DeviceArgs a, int level, int ticket) {
  LevelState* st = a.states + level;
  if (st->mode != kModePartialBin) return;  // same answer for every block
  const long long n = a.n;
  const u64 bin = st->bin;
  const int shift = 64 - a.bin_bits;
  const uint8_t* pool = a.pool + static_cast<size_t>(level) * n;
  const long long base = static_cast<long long>(blockIdx.x) * kTile + static_cast<long long>(threadIdx.x) * kItems;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const long long q = base + i;
    if (q < n && pool[q]) {
      const u64 key = level_key(a.seed, level, q);
      if ((key >> shift) == bin) a.gather[atomicAdd(&st->gather_count, 1u)] = key;
    }
  }
  if (!is_last_block(a.tickets + ticket)) return;
  const unsigned c = __ldcg(&st->gather_count);
  const u64 threshold = block_kth_smallest(a.gather, c, st->rank_in_bin);
  if (threadIdx.x == 0) st->thr_excl = threshold + 1;  // threshold < 2^64 - 1: no wrap
}

// grid (tiles, K): list j of tile x. Anchors come out in position order within a depth.
__global__ void __launch_bounds__(kThreads)
    cod_write_kernel(const DeviceArgs a, int32_t* __restrict__ anchor, int32_t* __restrict__ depth) {
  const int j = static_cast<int>(blockIdx.y);
  const long long n = a.n;
  const long long base = static_cast<long long>(blockIdx.x) * kTile + static_cast<long long>(threadIdx.x) * kItems;
  if (j == 0 && a.depth0_all) {  // depth 0 = every position, offsets[0] == 0
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const long long q = base + i;
      if (q < n) {
        anchor[q] = static_cast<int32_t>(q);
        depth[q] = 0;
      }
    }
    return;
  }
  // list 0 (anchors mode): selected seeds s give anchor s - 1; list d: positions p give p - d
  const uint8_t* flags = j == 0 ? a.pool + n : a.sel + static_cast<size_t>(j) * n;
  const int shift = j == 0 ? 1 : j;
  bool f[kItems];
  unsigned mine = 0;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const long long q = base + i;
    f[i] = q < n && flags[q] != 0;
    mine += f[i] ? 1u : 0u;
  }
  using Scan = cub::BlockScan<unsigned, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  unsigned excl = 0;
  Scan(scan_storage).ExclusiveSum(mine, excl);
  long long out = a.result->offsets[j] + a.tile_counts[static_cast<size_t>(j) * a.tiles + blockIdx.x] + excl;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    if (f[i]) {
      anchor[out] = static_cast<int32_t>(base + i - shift);
      depth[out] = j;
      ++out;
    }
  }
}

}  // namespace

size_t cod_cuda_scratch_bytes(int64_t n, int num_depths) {
  return scratch_layout(n, num_depths, bin_bits_for(n)).total;
}

cudaError_t cod_cuda_sample(const CodCudaProblem& pb, void* scratch, CodCudaResult* result_host, cudaStream_t stream) {
  if (pb.n < 1 || pb.num_depths < 1 || pb.num_depths > kMaxDepths) return cudaErrorInvalidValue;
  const ScratchLayout layout = scratch_layout(pb.n, pb.num_depths, bin_bits_for(pb.n));
  const DeviceArgs a = make_args(pb, scratch);
  cudaError_t err = cudaMemsetAsync(scratch, 0, layout.header_end, stream);
  if (err != cudaSuccess) return err;

  const int K = pb.num_depths;
  const dim3 grid(static_cast<unsigned>(a.tiles));
  int ticket = 0;
  auto step = [&](int prev, int cur, bool do_hist, bool is_final) {
    cod_step_kernel<<<grid, kThreads, 0, stream>>>(a, prev, cur, do_hist ? 1 : 0, is_final ? 1 : 0, ticket++);
    return cudaGetLastError();
  };
  auto gather = [&](int level) {
    cod_gather_kernel<<<grid, kThreads, 0, stream>>>(a, level, ticket++);
    return cudaGetLastError();
  };

  // Seeds (optionally subsampled to max_anchors) become the pool of depth 1.
  if (pb.max_anchors >= 0) {
    if ((err = step(-1, 0, true, false)) != cudaSuccess) return err;
    if ((err = gather(0)) != cudaSuccess) return err;
    if ((err = step(0, 1, K > 1, K == 1)) != cudaSuccess) return err;
  } else {
    if ((err = step(-1, 1, K > 1, K == 1)) != cudaSuccess) return err;
  }
  for (int d = 1; d < K; ++d) {
    const int next = d + 1 < K ? d + 1 : -1;
    if ((err = gather(d)) != cudaSuccess) return err;
    if ((err = step(d, next, next >= 0, next < 0)) != cudaSuccess) return err;
  }
  return cudaMemcpyAsync(result_host, a.result, sizeof(CodCudaResult), cudaMemcpyDeviceToHost, stream);
}

cudaError_t cod_cuda_write(const CodCudaProblem& pb, void* scratch, int32_t* anchor, int32_t* depth,
                           cudaStream_t stream) {
  if (pb.n < 1 || pb.num_depths < 1 || pb.num_depths > kMaxDepths) return cudaErrorInvalidValue;
  const DeviceArgs a = make_args(pb, scratch);
  const dim3 grid(static_cast<unsigned>(a.tiles), static_cast<unsigned>(pb.num_depths));
  cod_write_kernel<<<grid, kThreads, 0, stream>>>(a, anchor, depth);
  return cudaGetLastError();
}

}  // namespace peagle::cod
