// Decode attention in one kernel: a few query tokens (a verify round's K + 1, a drafter's rows)
// over a KV cache, each query reading only its own run of key rows. No torch includes.
//
// Why a kernel of its own: FlashAttention-2's variable-length forward does this in five
// launches per layer (its GQA decode path copies q into and out of its folded layout, then a
// split-KV kernel and a combine kernel), and SDPA reads the whole cache under a mask.
//
// Work split (flash decoding): a round has few (token, KV head) pairs (4 x 3 for SmolLM2 at
// K = 3), far fewer than the multiprocessors, and each pair's work is a chain of memory reads.
// So the run is cut into splits of whole 64-key tiles (plan_decode_attention sizes them to fill
// the device), one block per (token, KV head, split). A block reads its keys once for the whole
// group of query heads that share the KV head.
//
// Per tile, a block issues all its loads before using any: each key row is read by D / 8 lanes,
// 16 bytes each (the row's K and V chunks into registers), so a tile costs one memory round trip.
// The lanes of a row reduce their partial q.k by shuffles; the tile's scores go to shared
// memory, one warp per query head takes their max and sum (online softmax in base 2, fp32), and
// every thread accumulates p * v for its chunk of dims over its rows. The block's rows are then
// summed through shuffles and shared memory.
//
// With one split the block writes the output. With more, each block that holds keys leaves its
// (max, sum, weighted values) in the workspace; the last block of a (token, KV head) to arrive
// (a counter per pair, zeroed by the launch) combines the splits and writes the output, so the
// whole op is one memset and one kernel, and reads the runs on the device (CUDA-graph safe).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/device_math.cuh"
#include "decode_attention/decode_attention_kernels.h"

namespace peagle::decode_attention {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = static_cast<int>(kKeyTile);
constexpr int kBlocksPerSm = 2;      // blocks the planner aims at per multiprocessor
constexpr int64_t kMaxSplits = 128;  // bounds the workspace and the combine's loop
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kTile == 64, "the tile softmax gives each lane two of a tile's keys");

using device::from_float;
using device::to_float;
using device::warp_max;
using device::warp_sum;

// 8 elements of a 16-byte load.
template <typename T>
union Vec8 {
  uint4 raw;
  T h[8];
};

// The 8 elements of a 16-byte load, in float.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4 raw, float (&out)[8]) {
  Vec8<T> v;
  v.raw = raw;
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = to_float(v.h[e]);
}

// G: query heads per KV head the accumulators are sized for (the group is at most G).
template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(const DecodeAttnParams p) {
  constexpr int kLanesPerRow = D / 8;                    // lanes that read one key row, 16 bytes each
  constexpr int kRowsPerPass = kThreads / kLanesPerRow;  // key rows the block reads side by side
  constexpr int kRowsPerThread = kTile / kRowsPerPass;
  static_assert(32 % kLanesPerRow == 0 && kTile % kRowsPerPass == 0, "a key row's lanes sit in one warp");
  __shared__ __align__(16) float s_q[G][D];
  __shared__ float s_p[G][kTile];  // the tile's scores, then its probabilities
  __shared__ float s_alpha[G];     // how much the tile's new max scales the accumulators
  __shared__ float s_m[G];         // running max (base 2) and sum of this block's keys
  __shared__ float s_l[G];
  __shared__ float s_acc[kWarps][G][D];
  __shared__ int s_last;

  const int64_t t = blockIdx.x;
  const int64_t hk = blockIdx.y;
  const int64_t split = blockIdx.z;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int slot = tid / kLanesPerRow;   // which of the pass's rows this thread reads
  const int chunk = tid % kLanesPerRow;  // which 8 dims of it

  const T* q = static_cast<const T*>(p.q) + t * p.q_stride_t + hk * group * p.q_stride_h;
  for (int i = tid; i < group * D; i += kThreads) {
    const int g = i / D, d = i % D;
    s_q[g][d] = to_float(q[g * p.q_stride_h + d]) * p.scale * kLog2e;  // scores in base 2
  }
  if (tid < G) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.f;
  }
  // the run of key rows, clamped to the cache (inconsistent values are not checked here: that
  // would need a host sync; they read nothing out of bounds)
  const int64_t start = p.key_start[t];
  int64_t n = p.key_count[t];
  if (start < 0 || start >= p.num_key_rows || n < 0) n = 0;
  if (n > p.num_key_rows - start) n = p.num_key_rows - start;
  const int64_t lo = split * p.keys_per_split;
  const int64_t hi = n < lo + p.keys_per_split ? n : lo + p.keys_per_split;
  const T* kb = static_cast<const T*>(p.k) + (n > 0 ? start : 0) * p.k_stride_s + hk * p.k_stride_h + chunk * 8;
  const T* vb = static_cast<const T*>(p.v) + (n > 0 ? start : 0) * p.v_stride_s + hk * p.v_stride_h + chunk * 8;

  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  __syncthreads();

  for (int64_t base = lo; base < hi; base += kTile) {
    uint4 kr[kRowsPerThread], vr[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t j = base + slot + i * kRowsPerPass;
      if (j < hi) {
        kr[i] = __ldg(reinterpret_cast<const uint4*>(kb + j * p.k_stride_s));
        vr[i] = __ldg(reinterpret_cast<const uint4*>(vb + j * p.v_stride_s));
      } else {
        kr[i] = vr[i] = make_uint4(0u, 0u, 0u, 0u);  // past the run: score -inf, value 0
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      float kf[8];
      unpack8<T>(kr[i], kf);
      const int row = slot + i * kRowsPerPass;
      const bool valid = base + row < hi;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (g >= group) continue;
        const float4 qa = *reinterpret_cast<const float4*>(&s_q[g][chunk * 8]);
        const float4 qb = *reinterpret_cast<const float4*>(&s_q[g][chunk * 8 + 4]);
        float s = qa.x * kf[0];
        s = fmaf(qa.y, kf[1], s);
        s = fmaf(qa.z, kf[2], s);
        s = fmaf(qa.w, kf[3], s);
        s = fmaf(qb.x, kf[4], s);
        s = fmaf(qb.y, kf[5], s);
        s = fmaf(qb.z, kf[6], s);
        s = fmaf(qb.w, kf[7], s);
#pragma unroll
        for (int o = kLanesPerRow / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (chunk == 0) s_p[g][row] = valid ? s : -INFINITY;
      }
    }
    __syncthreads();
    for (int g = warp; g < group; g += kWarps) {
      const float a = s_p[g][lane], b = s_p[g][lane + 32];
      const float m_old = s_m[g];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(a, b)));  // finite: row `base` is in the run
      const float pa = exp2f(a - m_new), pb = exp2f(b - m_new);
      s_p[g][lane] = pa;
      s_p[g][lane + 32] = pb;
      const float sum = warp_sum(pa + pb);
      __syncwarp();  // every lane has read s_m[g] before lane 0 moves it on
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);  // 0 while m_old is -inf
        s_alpha[g] = alpha;
        s_l[g] = s_l[g] * alpha + sum;
        s_m[g] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= group) continue;
      const float alpha = s_alpha[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      float vf[8];
      unpack8<T>(vr[i], vf);
      const int row = slot + i * kRowsPerPass;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (g >= group) continue;
        const float pr = s_p[g][row];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(pr, vf[e], acc[g][e]);
      }
    }
    __syncthreads();  // the next tile rewrites s_p
  }

  // the block's rows: first the warp's (lanes of one chunk), then the warps' through shared memory
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e)
#pragma unroll
      for (int o = kLanesPerRow; o < 32; o <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
  if (lane < kLanesPerRow) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= group) continue;
#pragma unroll
      for (int e = 0; e < 8; ++e) s_acc[warp][g][chunk * 8 + e] = acc[g][e];
    }
  }
  __syncthreads();

  const int64_t head0 = t * p.num_heads + hk * group;  // this block's first query head, of T x Hq
  T* out = static_cast<T*>(p.out) + head0 * D;
  if (p.num_splits == 1) {
    for (int i = tid; i < group * D; i += kThreads) {
      const int g = i / D, d = i % D;
      float a = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) a += s_acc[w][g][d];
      const float l = s_l[g];
      out[i] = from_float<T>(l > 0.f ? a / l : 0.f);  // no key: 0
    }
    return;
  }

  const int64_t splits = p.num_splits;
  float* part_acc = static_cast<float*>(p.workspace);                                          // [T, Hq, splits, D]
  float* part_ml = part_acc + p.num_queries * p.num_heads * splits * D;                        // [T, Hq, splits, 2]
  int* arrivals = reinterpret_cast<int*>(part_ml + p.num_queries * p.num_heads * splits * 2);  // [T, Hkv]
  if (lo < n) {  // a block past the run leaves nothing: the combine reads only the splits with keys
    for (int i = tid; i < group * D; i += kThreads) {
      const int g = i / D, d = i % D;
      float a = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) a += s_acc[w][g][d];
      part_acc[((head0 + g) * splits + split) * D + d] = a;
    }
    if (tid < group) {
      part_ml[((head0 + tid) * splits + split) * 2] = s_m[tid];
      part_ml[((head0 + tid) * splits + split) * 2 + 1] = s_l[tid];
    }
  }
  __threadfence();  // the partials are visible before the arrival is counted
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&arrivals[t * p.num_kv_heads + hk], 1) == static_cast<int>(splits - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();

  const int64_t used = (n + p.keys_per_split - 1) / p.keys_per_split;  // splits that hold keys
  for (int i = tid; i < group * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float m = -INFINITY, num = 0.f, den = 0.f;
    for (int64_t s = 0; s < used; ++s) {
      const int64_t at = (head0 + g) * splits + s;
      const float ms = __ldcg(part_ml + at * 2), ls = __ldcg(part_ml + at * 2 + 1);
      const float as = __ldcg(part_acc + at * D + d);
      const float mn = fmaxf(m, ms);  // finite: every used split holds a key
      const float f_old = exp2f(m - mn), f_new = exp2f(ms - mn);
      num = num * f_old + as * f_new;
      den = den * f_old + ls * f_new;
      m = mn;
    }
    out[i] = from_float<T>(den > 0.f ? num / den : 0.f);  // no key: 0
  }
}

template <typename T, int D, int G>
int launch_with(const DecodeAttnParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_queries), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(p.num_splits));
  decode_attention_kernel<T, D, G><<<grid, kThreads, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int D>
int launch_group(const DecodeAttnParams& p, cudaStream_t stream) {
  // accumulators for 4 heads where the group fits (SmolLM2's 3, Qwen3-8B's 4): half the registers
  return p.num_heads / p.num_kv_heads <= 4 ? launch_with<T, D, 4>(p, stream) : launch_with<T, D, 8>(p, stream);
}

template <typename T>
int launch_dtype(const DecodeAttnParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return launch_group<T, 64>(p, stream);
    case 128:
      return launch_group<T, 128>(p, stream);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

int64_t plan_decode_attention(DecodeAttnParams& p, int sm_count) {
  const int64_t tiles = std::max<int64_t>(1, (p.num_key_rows + kTile - 1) / kTile);
  const int64_t pairs = std::max<int64_t>(1, p.num_queries * p.num_kv_heads);
  const int64_t wanted = (static_cast<int64_t>(kBlocksPerSm) * std::max(sm_count, 1) + pairs - 1) / pairs;
  int64_t splits = std::min({tiles, wanted, kMaxSplits});
  const int64_t tiles_per_split = (tiles + splits - 1) / splits;
  splits = (tiles + tiles_per_split - 1) / tiles_per_split;  // none left without a tile
  p.num_splits = splits;
  p.keys_per_split = tiles_per_split * kTile;
  if (splits == 1) return 0;
  const int64_t floats = p.num_queries * p.num_heads * splits * (p.head_dim + 2);
  return floats * static_cast<int64_t>(sizeof(float)) + pairs * static_cast<int64_t>(sizeof(int));
}

int launch_decode_attention(const DecodeAttnParams& p, DecodeDType dtype, void* stream_ptr) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0 || p.num_heads / p.num_kv_heads > kMaxGroup)
    return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_splits < 1 || p.num_splits > kMaxSplits || p.keys_per_split < 1 ||
      (p.num_splits > 1 && p.workspace == nullptr))
    return static_cast<int>(cudaErrorInvalidValue);  // not planned
  if (p.num_queries == 0) return 0;
  if (p.num_queries > 0x7fffffffLL || p.num_kv_heads > 65535) return static_cast<int>(cudaErrorInvalidConfiguration);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.num_splits > 1) {
    const int64_t partial_floats = p.num_queries * p.num_heads * p.num_splits * (p.head_dim + 2);
    const cudaError_t err = cudaMemsetAsync(static_cast<float*>(p.workspace) + partial_floats, 0,
                                            p.num_queries * p.num_kv_heads * sizeof(int), stream);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return dtype == DecodeDType::kHalf ? launch_dtype<__half>(p, stream) : launch_dtype<__nv_bfloat16>(p, stream);
}

}  // namespace peagle::decode_attention
