// Fused linear-KL / CE row kernels: one thread block per row of a chunk of logits (the GEMMs
// that produce them run in cuBLAS, see loss_glue.cpp).
//
// target_stats_kernel streams a target row once with 16-byte loads, keeping per thread an
// online softmax state (running max, sum of exp(x - max), first argmax) that the block merges:
// one pass per distinct target row, however many draft rows share it. draft_rows_kernel does
// the same for a draft row (pass 1), then streams it again with its target row (pass 2),
// accumulates the loss (KL or CE) and overwrites the draft row with weight * dloss/dlogit.
// Both are bandwidth bound: per draft logit 2 + 2 reads + 1 write of 2 bytes (bf16) and 2 exp,
// against 8 * H FLOPs of GEMM work per element around them.
//
// No torch include here: raw pointers and a launcher (loss_kernels.h).
#include "loss/loss_kernels.h"

#include "common/device_math.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>

namespace peagle::loss {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---- element and 16-byte vector conversions ---------------------------------------------
using device::from_float;
using device::to_float;

template <typename T>
struct VecWidth {
  static constexpr int value = 16 / static_cast<int>(sizeof(T));
};

// Target rows are never written by the kernel: read them through the read-only path.
// Draft rows are overwritten in pass 2, so they use ordinary loads.
template <bool kReadOnly>
__device__ __forceinline__ uint4 load16(const void* p) {
  if constexpr (kReadOnly) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    return *reinterpret_cast<const uint4*>(p);
  }
}

template <bool kReadOnly>
__device__ __forceinline__ void load_vec(const float* p, float (&o)[4]) {
  const uint4 v = load16<kReadOnly>(p);
  o[0] = __uint_as_float(v.x);
  o[1] = __uint_as_float(v.y);
  o[2] = __uint_as_float(v.z);
  o[3] = __uint_as_float(v.w);
}

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits. Element 2k sits in
// the low 16 bits of 32-bit word k (little endian).
template <bool kReadOnly>
__device__ __forceinline__ void load_vec(const __nv_bfloat16* p, float (&o)[8]) {
  const uint4 v = load16<kReadOnly>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    o[2 * k] = __uint_as_float(w[k] << 16);
    o[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}

template <bool kReadOnly>
__device__ __forceinline__ void load_vec(const __half* p, float (&o)[8]) {
  const uint4 v = load16<kReadOnly>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    o[2 * k] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] & 0xffffu)));
    o[2 * k + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] >> 16)));
  }
}

__device__ __forceinline__ void store_vec(float* p, const float (&x)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}

__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const float (&x)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(x[2 * k]));
    const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(x[2 * k + 1]));
    w[k] = lo | (hi << 16);
  }
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void store_vec(__half* p, const float (&x)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t lo = __half_as_ushort(__float2half_rn(x[2 * k]));
    const uint32_t hi = __half_as_ushort(__float2half_rn(x[2 * k + 1]));
    w[k] = lo | (hi << 16);
  }
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- online softmax state ----------------------------------------------------------------
// max: running max; sum: sum of exp(x - max) over the values seen (kSum only);
// idx: smallest vocab index holding max (torch.argmax's first-occurrence rule).
struct SoftmaxState {
  float max;
  float sum;
  int idx;
};

__device__ __forceinline__ SoftmaxState empty_state() { return {-INFINITY, 0.f, INT_MAX}; }

// Folds x[0..N) (vocab indices base..base+N-1) into s. One rescale per group, not per value.
// exp(-inf) = 0 makes the first fold (max = -inf, sum = 0) come out right without a branch.
template <int N, bool kSum>
__device__ __forceinline__ void fold(SoftmaxState& s, const float (&x)[N], int base) {
  float vmax = x[0];
  int vj = 0;
#pragma unroll
  for (int j = 1; j < N; ++j) {
    if (x[j] > vmax) {
      vmax = x[j];
      vj = j;
    }
  }
  if (vmax > s.max) {
    if constexpr (kSum) s.sum *= __expf(s.max - vmax);
    s.max = vmax;
    s.idx = base + vj;
  } else if (vmax == s.max && base + vj < s.idx) {
    s.idx = base + vj;
  }
  if constexpr (kSum) {
#pragma unroll
    for (int j = 0; j < N; ++j) s.sum += __expf(x[j] - s.max);
  }
}

// Merges state (m, sm, i) into a. Threads that saw no value carry max = -inf and sum = 0;
// every branch keeps such states from producing inf - inf.
template <bool kSum>
__device__ __forceinline__ void merge(SoftmaxState& a, float m, float sm, int i) {
  if (m > a.max) {
    if constexpr (kSum) a.sum = a.sum * __expf(a.max - m) + sm;
    a.max = m;
    a.idx = i;
  } else if (m == a.max) {
    if constexpr (kSum) a.sum += sm;
    a.idx = min(a.idx, i);
  } else {
    if constexpr (kSum) a.sum += sm * __expf(m - a.max);
  }
}

template <bool kSum>
__device__ __forceinline__ void warp_merge(SoftmaxState& s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m = __shfl_xor_sync(kFullMask, s.max, off);
    const float sm = __shfl_xor_sync(kFullMask, s.sum, off);
    const int i = __shfl_xor_sync(kFullMask, s.idx, off);
    merge<kSum>(s, m, sm, i);
  }
}

using device::warp_sum;

// Merges the block's per-thread states; every thread returns the same merged state (all merge
// the warp results in the same order). `sh` holds kWarps entries per field.
struct StateSmem {
  float max[kWarps];
  float sum[kWarps];
  int idx[kWarps];
};

template <bool kSum>
__device__ __forceinline__ SoftmaxState block_merge(SoftmaxState s, StateSmem& sh) {
  warp_merge<kSum>(s);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) {
    sh.max[warp] = s.max;
    sh.sum[warp] = s.sum;
    sh.idx[warp] = s.idx;
  }
  __syncthreads();
  SoftmaxState b = {sh.max[0], sh.sum[0], sh.idx[0]};
#pragma unroll
  for (int k = 1; k < kWarps; ++k) merge<kSum>(b, sh.max[k], sh.sum[k], sh.idx[k]);
  return b;
}

// Elements of `row` before its first 16-byte boundary go one by one (rows of an odd vocab
// start misaligned); the caching allocator aligns every buffer, so a row is always aligned to
// its element size.
template <typename T>
__device__ __forceinline__ int misaligned_head(const T* row, int vocab) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(row);
  const int head = static_cast<int>(((16u - (a & 15u)) & 15u) / sizeof(T));
  return head > vocab ? vocab : head;
}

// Folds one row into s: scalar head, 16-byte vectors (two in flight per thread), scalar tail.
template <typename T, bool kSum, bool kReadOnly>
__device__ __forceinline__ void fold_row(SoftmaxState& s, const T* row, int vocab) {
  constexpr int N = VecWidth<T>::value;
  const int tid = threadIdx.x;
  const int head = misaligned_head(row, vocab);
  const int nvec = (vocab - head) / N;
  const int tail = head + nvec * N;
  for (int i = tid; i < head; i += kThreads) {
    const float x[1] = {to_float(row[i])};
    fold<1, kSum>(s, x, i);
  }
  int v = tid;
  for (; v + kThreads < nvec; v += 2 * kThreads) {
    const int b0 = head + v * N;
    const int b1 = b0 + kThreads * N;
    float x0[N], x1[N];
    load_vec<kReadOnly>(row + b0, x0);
    load_vec<kReadOnly>(row + b1, x1);
    fold<N, kSum>(s, x0, b0);
    fold<N, kSum>(s, x1, b1);
  }
  if (v < nvec) {
    const int b0 = head + v * N;
    float x0[N];
    load_vec<kReadOnly>(row + b0, x0);
    fold<N, kSum>(s, x0, b0);
  }
  for (int i = tail + tid; i < vocab; i += kThreads) {
    const float x[1] = {to_float(row[i])};
    fold<1, kSum>(s, x, i);
  }
}

// ---- target rows: softmax statistics once per distinct target row ---------------------------
template <typename T, bool kCE>
__global__ void __launch_bounds__(kThreads)
    target_stats_kernel(const T* __restrict__ logits, int vocab, float* __restrict__ lse, int* __restrict__ argmax) {
  __shared__ StateSmem sh;
  const T* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  SoftmaxState s = empty_state();
  fold_row<T, !kCE, true>(s, row, vocab);  // ce needs only the argmax
  const SoftmaxState b = block_merge<!kCE>(s, sh);
  if (threadIdx.x == 0) {
    lse[blockIdx.x] = kCE ? 0.f : b.max + logf(b.sum);
    argmax[blockIdx.x] = b.idx;
  }
}

// ---- draft rows: softmax, loss, argmax agreement and the in-place logit gradient -----------
template <typename T, bool kCE>
__global__ void __launch_bounds__(kThreads)
    draft_rows_kernel(T* __restrict__ draft, const T* __restrict__ target, int vocab,
                      const int64_t* __restrict__ target_slot, int64_t target_base,
                      const float* __restrict__ target_lse, const int* __restrict__ target_argmax,
                      const float* __restrict__ weight, const int32_t* __restrict__ depth, float* __restrict__ row_loss,
                      unsigned long long* __restrict__ correct, unsigned long long* __restrict__ total, int num_depths,
                      bool write_grad) {
  constexpr int N = VecWidth<T>::value;
  __shared__ StateSmem sh;
  __shared__ float sh_acc[kWarps];

  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t slot = target_slot[row] - target_base;
  T* d_row = draft + row * static_cast<int64_t>(vocab);
  const T* t_row = target + slot * static_cast<int64_t>(vocab);
  const float w = weight[row];

  // ---- pass 1: softmax statistics and argmax of the draft row -----------------------------
  SoftmaxState sd = empty_state();
  fold_row<T, true, false>(sd, d_row, vocab);
  const SoftmaxState bd = block_merge<true>(sd, sh);
  const float lse_d = bd.max + logf(bd.sum);
  const float lse_t = target_lse[slot];
  const int target_idx = target_argmax[slot];

  // ---- pass 2: loss and in-place gradient ---------------------------------------------------
  float acc = 0.f;
  // grad_v = w * (q_v - p_v) (KL) or w * (q_v - [v == target_idx]) (CE)
  auto element = [&](float xd, float xt, int i) -> float {
    const float lq = xd - lse_d;
    const float q = __expf(lq);
    if constexpr (kCE) {
      const bool hit = (i == target_idx);
      if (hit) acc -= lq;
      return w * (q - (hit ? 1.f : 0.f));
    } else {
      const float lp = xt - lse_t;
      const float p = __expf(lp);
      acc += p * (lp - lq);
      return w * (q - p);
    }
  };
  // The draft row and its target row are vectorised together when they share their offset from
  // a 16-byte boundary (always for vocab sizes that are a multiple of 8; else scalar).
  int head = misaligned_head(d_row, vocab);
  if (!kCE && head != misaligned_head(t_row, vocab)) head = vocab;
  const int nvec = (vocab - head) / N;
  const int tail = head + nvec * N;
  for (int i = tid; i < head; i += kThreads) {
    const float g = element(to_float(d_row[i]), kCE ? 0.f : to_float(t_row[i]), i);
    if (write_grad) d_row[i] = from_float<T>(g);
  }
  {
    int v = tid;
    for (; v + kThreads < nvec; v += 2 * kThreads) {
      const int b0 = head + v * N;
      const int b1 = b0 + kThreads * N;
      float xd0[N], xt0[N], xd1[N], xt1[N], g[N];
      load_vec<false>(d_row + b0, xd0);
      load_vec<false>(d_row + b1, xd1);
      if constexpr (!kCE) {
        load_vec<true>(t_row + b0, xt0);
        load_vec<true>(t_row + b1, xt1);
      }
#pragma unroll
      for (int j = 0; j < N; ++j) g[j] = element(xd0[j], kCE ? 0.f : xt0[j], b0 + j);
      if (write_grad) store_vec(d_row + b0, g);
#pragma unroll
      for (int j = 0; j < N; ++j) g[j] = element(xd1[j], kCE ? 0.f : xt1[j], b1 + j);
      if (write_grad) store_vec(d_row + b1, g);
    }
    if (v < nvec) {
      const int b0 = head + v * N;
      float xd0[N], xt0[N], g[N];
      load_vec<false>(d_row + b0, xd0);
      if constexpr (!kCE) load_vec<true>(t_row + b0, xt0);
#pragma unroll
      for (int j = 0; j < N; ++j) g[j] = element(xd0[j], kCE ? 0.f : xt0[j], b0 + j);
      if (write_grad) store_vec(d_row + b0, g);
    }
  }
  for (int i = tail + tid; i < vocab; i += kThreads) {
    const float g = element(to_float(d_row[i]), kCE ? 0.f : to_float(t_row[i]), i);
    if (write_grad) d_row[i] = from_float<T>(g);
  }

  acc = warp_sum(acc);
  if ((tid & 31) == 0) sh_acc[tid >> 5] = acc;
  __syncthreads();
  if (tid == 0) {
    float loss = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) loss += sh_acc[k];
    row_loss[row] = w * loss;
    const int d = depth[row];
    if (w > 0.f && d >= 0 && d < num_depths) {
      atomicAdd(total + d, 1ull);
      if (bd.idx == target_idx) atomicAdd(correct + d, 1ull);
    }
  }
}

bool bad_shape(int64_t rows, int64_t vocab) { return rows > INT_MAX || vocab <= 0 || vocab > INT_MAX / 2; }

template <typename T>
cudaError_t launch_stats_typed(const TargetStatsArgs& a, cudaStream_t stream) {
  const T* logits = static_cast<const T*>(a.logits);
  const dim3 grid(static_cast<unsigned>(a.rows));
  const int vocab = static_cast<int>(a.vocab);
  if (a.kind == LossKind::kCE) {
    target_stats_kernel<T, true><<<grid, kThreads, 0, stream>>>(logits, vocab, a.lse, a.argmax);
  } else {
    target_stats_kernel<T, false><<<grid, kThreads, 0, stream>>>(logits, vocab, a.lse, a.argmax);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rows_typed(const DraftRowsArgs& a, cudaStream_t stream) {
  T* draft = static_cast<T*>(a.draft_logits);
  const T* target = static_cast<const T*>(a.target_logits);
  auto* correct = reinterpret_cast<unsigned long long*>(a.correct);
  auto* total = reinterpret_cast<unsigned long long*>(a.total);
  const dim3 grid(static_cast<unsigned>(a.rows));
  const int vocab = static_cast<int>(a.vocab);
  if (a.kind == LossKind::kCE) {
    draft_rows_kernel<T, true><<<grid, kThreads, 0, stream>>>(draft, target, vocab, a.target_slot, a.target_base,
                                                              a.target_lse, a.target_argmax, a.weight, a.depth,
                                                              a.row_loss, correct, total, a.num_depths, a.write_grad);
  } else {
    draft_rows_kernel<T, false><<<grid, kThreads, 0, stream>>>(draft, target, vocab, a.target_slot, a.target_base,
                                                               a.target_lse, a.target_argmax, a.weight, a.depth,
                                                               a.row_loss, correct, total, a.num_depths, a.write_grad);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_target_stats(const TargetStatsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0) return cudaSuccess;
  if (bad_shape(args.rows, args.vocab)) return cudaErrorInvalidValue;
  switch (args.dtype) {
    case LogitDtype::kFloat32:
      return launch_stats_typed<float>(args, stream);
    case LogitDtype::kFloat16:
      return launch_stats_typed<__half>(args, stream);
    case LogitDtype::kBFloat16:
      return launch_stats_typed<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_draft_rows(const DraftRowsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0) return cudaSuccess;
  if (bad_shape(args.rows, args.vocab)) return cudaErrorInvalidValue;
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "int64 counters are updated as u64");
  switch (args.dtype) {
    case LogitDtype::kFloat32:
      return launch_rows_typed<float>(args, stream);
    case LogitDtype::kFloat16:
      return launch_rows_typed<__half>(args, stream);
    case LogitDtype::kBFloat16:
      return launch_rows_typed<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace peagle::loss
