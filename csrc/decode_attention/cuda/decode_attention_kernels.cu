// Decode attention in ONE kernel: a few query tokens (a verify round's K + 1, a drafter's rows)
// over a KV cache, each query reading only its own run of key rows. No torch includes.
//
// Why a kernel of its own: FlashAttention-2's variable-length forward does this in five
// launches per layer (its GQA decode path copies q into and out of its folded layout, then a
// split-KV kernel and a combine kernel), ~17 us a layer on the H200 for a round of 4 tokens
// over a short context, where a greedy step's one-token attention is one ~7 us kernel. Here one
// block per (query token, KV head) reads the run once for all the query heads of that KV head.
//
// Block: kThreads threads = kWarps warps. Warp w takes the keys w*32 + lane, stepping
// kThreads: for its 32 keys a lane computes the scores of ITS key for the group's heads (q in
// shared memory, fp32), the warp takes the max (online softmax in base 2), then the warp
// accumulates P V lane-per-dimension (each lane owns head_dim/32 output dims, the 32
// probabilities broadcast by shuffles). At the end the warps' (max, sum, acc) are combined in
// shared memory. fp32 throughout, one rounding to the output dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_math.cuh"
#include "decode_attention/decode_attention_kernels.h"

namespace peagle::decode_attention {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kGroup = static_cast<int>(kMaxGroup);
constexpr float kLog2e = 1.4426950408889634f;

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

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(const DecodeAttnParams p) {
  constexpr int kPerLane = D / 32;  // output dims a lane owns in P V
  constexpr int kChunks = D / 8;    // 16-byte loads per key row
  __shared__ float s_q[kGroup][D];
  __shared__ float s_m[kWarps][kGroup];
  __shared__ float s_l[kWarps][kGroup];
  __shared__ float s_acc[kWarps][kGroup][D];

  const int64_t t = blockIdx.x;
  const int64_t hk = blockIdx.y;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;

  const T* q = static_cast<const T*>(p.q) + t * p.q_stride_t + hk * group * p.q_stride_h;
  for (int i = threadIdx.x; i < group * D; i += kThreads) {
    const int g = i / D, d = i % D;
    s_q[g][d] = to_float(q[g * p.q_stride_h + d]) * p.scale * kLog2e;  // scores in base 2
  }
  // the run of key rows, clamped to the cache (inconsistent values are not checked here: that
  // would need a host sync; they read nothing out of bounds)
  const int64_t start = p.key_start[t];
  int64_t n = p.key_count[t];
  if (start < 0 || start >= p.num_key_rows || n < 0) n = 0;
  if (n > p.num_key_rows - start) n = p.num_key_rows - start;
  const T* kb = static_cast<const T*>(p.k) + (n > 0 ? start : 0) * p.k_stride_s + hk * p.k_stride_h;
  const T* vb = static_cast<const T*>(p.v) + (n > 0 ? start : 0) * p.v_stride_s + hk * p.v_stride_h;
  __syncthreads();

  float m[kGroup], l[kGroup], acc[kGroup][kPerLane];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[g][e] = 0.f;
  }

  for (int64_t base = static_cast<int64_t>(warp) * 32; base < n; base += kThreads) {
    const int64_t j = base + lane;
    float s[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) s[g] = 0.f;
    if (j < n) {
      const uint4* kr = reinterpret_cast<const uint4*>(kb + j * p.k_stride_s);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        Vec8<T> kv;
        kv.raw = __ldg(kr + c);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float kf = to_float(kv.h[e]);
#pragma unroll
          for (int g = 0; g < kGroup; ++g)
            if (g < group) s[g] = fmaf(s_q[g][c * 8 + e], kf, s[g]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (g >= group) continue;
      const float sg = j < n ? s[g] : -INFINITY;
      const float mn = fmaxf(m[g], warp_max(sg));  // finite: key `base` of this warp is valid
      const float alpha = exp2f(m[g] - mn);        // 0 while m is -inf
      const float pg = j < n ? exp2f(sg - mn) : 0.f;
      l[g] = l[g] * alpha + pg;  // this lane's share; summed over the warp at the end
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[g][e] *= alpha;
      m[g] = mn;
      s[g] = pg;
    }
    const int64_t keys = n - base < 32 ? n - base : 32;
#pragma unroll 4
    for (int i = 0; i < keys; ++i) {
      const T* vr = vb + (base + i) * p.v_stride_s + lane * kPerLane;
      float vf[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) vf[e] = to_float(vr[e]);
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (g >= group) continue;
        const float pi = __shfl_sync(0xffffffffu, s[g], i);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[g][e] = fmaf(pi, vf[e], acc[g][e]);
      }
    }
  }

#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (g >= group) continue;
    const float lg = warp_sum(l[g]);
    if (lane == 0) {
      s_m[warp][g] = m[g];
      s_l[warp][g] = lg;
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) s_acc[warp][g][lane * kPerLane + e] = acc[g][e];
  }
  __syncthreads();

  T* out = static_cast<T*>(p.out) + (t * p.num_heads + hk * group) * D;
  for (int i = threadIdx.x; i < group * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][g]);
    float num = 0.f, den = 0.f;
    if (mx > -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        if (s_m[w][g] == -INFINITY) continue;  // a warp that had no key
        const float f = exp2f(s_m[w][g] - mx);
        num = fmaf(s_acc[w][g][d], f, num);
        den = fmaf(s_l[w][g], f, den);
      }
    }
    out[g * D + d] = from_float<T>(den > 0.f ? num / den : 0.f);  // no key: 0
  }
}

template <typename T, int D>
int launch_with(const DecodeAttnParams& p, cudaStream_t stream) {
  if (p.num_queries == 0) return 0;
  if (p.num_queries > 0x7fffffffLL || p.num_kv_heads > 65535) return static_cast<int>(cudaErrorInvalidConfiguration);
  const dim3 grid(static_cast<unsigned>(p.num_queries), static_cast<unsigned>(p.num_kv_heads));
  decode_attention_kernel<T, D><<<grid, kThreads, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_dtype(const DecodeAttnParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return launch_with<T, 64>(p, stream);
    case 128:
      return launch_with<T, 128>(p, stream);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

int launch_decode_attention(const DecodeAttnParams& p, DecodeDType dtype, void* stream_ptr) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0 || p.num_heads / p.num_kv_heads > kMaxGroup)
    return static_cast<int>(cudaErrorInvalidValue);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  return dtype == DecodeDType::kHalf ? launch_dtype<__half>(p, stream) : launch_dtype<__nv_bfloat16>(p, stream);
}

}  // namespace peagle::decode_attention
