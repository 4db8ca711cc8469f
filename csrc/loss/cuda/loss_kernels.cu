// Fused linear-KL / CE row kernel: one thread block per row of a [rows, vocab] chunk of draft
// and target logits (the GEMMs that produce them run in cuBLAS, see loss_glue.cpp).
//
// Pass 1 streams both rows once with 16-byte loads and keeps, per thread and per side, an
// online softmax state (running max, sum of exp(x - max), first argmax); the block merges
// the states. Pass 2 streams the rows again, accumulates the loss (KL or CE) and overwrites
// the draft row with weight * dloss/dlogit. Both passes are bandwidth bound: per logit
// element 2 * 2 reads + 1 write of 2 bytes (bf16) and 4 exp, against 8 * H FLOPs of GEMM
// work per element around it, so the kernel is a few percent of the whole op.
//
// No torch include here: raw pointers and a launcher (loss_kernels.h).
#include "loss/loss_kernels.h"

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
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

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

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// ---- the kernel -----------------------------------------------------------------------------
template <typename T, bool kCE>
__global__ void __launch_bounds__(kThreads)
    fused_kl_rows_kernel(T* __restrict__ draft, const T* __restrict__ target, int vocab,
                         const float* __restrict__ weight, const int32_t* __restrict__ depth,
                         float* __restrict__ row_loss, unsigned long long* __restrict__ correct,
                         unsigned long long* __restrict__ total, int num_depths, bool write_grad) {
  constexpr int N = VecWidth<T>::value;
  __shared__ float sh_max[2][kWarps];
  __shared__ float sh_sum[2][kWarps];
  __shared__ int sh_idx[2][kWarps];
  __shared__ float sh_acc[kWarps];

  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  T* d_row = draft + row * static_cast<int64_t>(vocab);
  const T* t_row = target + row * static_cast<int64_t>(vocab);
  const float w = weight[row];

  // Elements before the first 16-byte boundary and after the last full vector go one by one.
  // Both buffers come from the caching allocator with the same row length, so their rows share
  // the same misalignment; if not (never in practice), everything goes the scalar way.
  const uintptr_t da = reinterpret_cast<uintptr_t>(d_row);
  const uintptr_t ta = reinterpret_cast<uintptr_t>(t_row);
  int head = static_cast<int>(((16u - (da & 15u)) & 15u) / sizeof(T));
  if ((da & 15u) != (ta & 15u) || head > vocab) head = vocab;
  const int nvec = (vocab - head) / N;
  const int tail = head + nvec * N;

  if (w == 0.f) {
    // Out of the loss: zero gradient row, zero loss, not counted.
    if (write_grad) {
      const T zero = from_float<T>(0.f);
      for (int i = tid; i < head; i += kThreads) d_row[i] = zero;
      float z[N];
#pragma unroll
      for (int j = 0; j < N; ++j) z[j] = 0.f;
      for (int v = tid; v < nvec; v += kThreads) store_vec(d_row + head + v * N, z);
      for (int i = tail + tid; i < vocab; i += kThreads) d_row[i] = zero;
    }
    if (tid == 0) row_loss[row] = 0.f;
    return;
  }

  // ---- pass 1: softmax statistics and argmax of both rows --------------------------------
  constexpr bool kTargetSum = !kCE;  // CE needs only the target argmax
  SoftmaxState sd = empty_state();
  SoftmaxState st = empty_state();
  for (int i = tid; i < head; i += kThreads) {
    const float xd[1] = {to_float(d_row[i])};
    const float xt[1] = {to_float(t_row[i])};
    fold<1, true>(sd, xd, i);
    fold<1, kTargetSum>(st, xt, i);
  }
  {
    int v = tid;
    // two vectors per side in flight per thread before any of them is consumed
    for (; v + kThreads < nvec; v += 2 * kThreads) {
      const int b0 = head + v * N;
      const int b1 = b0 + kThreads * N;
      float xd0[N], xt0[N], xd1[N], xt1[N];
      load_vec<false>(d_row + b0, xd0);
      load_vec<true>(t_row + b0, xt0);
      load_vec<false>(d_row + b1, xd1);
      load_vec<true>(t_row + b1, xt1);
      fold<N, true>(sd, xd0, b0);
      fold<N, kTargetSum>(st, xt0, b0);
      fold<N, true>(sd, xd1, b1);
      fold<N, kTargetSum>(st, xt1, b1);
    }
    if (v < nvec) {
      const int b0 = head + v * N;
      float xd0[N], xt0[N];
      load_vec<false>(d_row + b0, xd0);
      load_vec<true>(t_row + b0, xt0);
      fold<N, true>(sd, xd0, b0);
      fold<N, kTargetSum>(st, xt0, b0);
    }
  }
  for (int i = tail + tid; i < vocab; i += kThreads) {
    const float xd[1] = {to_float(d_row[i])};
    const float xt[1] = {to_float(t_row[i])};
    fold<1, true>(sd, xd, i);
    fold<1, kTargetSum>(st, xt, i);
  }

  warp_merge<true>(sd);
  warp_merge<kTargetSum>(st);
  if (lane == 0) {
    sh_max[0][warp] = sd.max;
    sh_sum[0][warp] = sd.sum;
    sh_idx[0][warp] = sd.idx;
    sh_max[1][warp] = st.max;
    sh_sum[1][warp] = st.sum;
    sh_idx[1][warp] = st.idx;
  }
  __syncthreads();
  // Every thread merges the warp results in the same order, so all hold identical values.
  SoftmaxState bd = {sh_max[0][0], sh_sum[0][0], sh_idx[0][0]};
  SoftmaxState bt = {sh_max[1][0], sh_sum[1][0], sh_idx[1][0]};
#pragma unroll
  for (int k = 1; k < kWarps; ++k) {
    merge<true>(bd, sh_max[0][k], sh_sum[0][k], sh_idx[0][k]);
    merge<kTargetSum>(bt, sh_max[1][k], sh_sum[1][k], sh_idx[1][k]);
  }
  const float lse_d = bd.max + logf(bd.sum);
  const float lse_t = kCE ? 0.f : bt.max + logf(bt.sum);
  const int target_idx = bt.idx;

  // ---- pass 2: loss and in-place gradient ----------------------------------------------------
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
  if (lane == 0) sh_acc[warp] = acc;
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

template <typename T>
cudaError_t launch_typed(const FusedKlRowsArgs& a, cudaStream_t stream) {
  T* draft = static_cast<T*>(a.draft_logits);
  const T* target = static_cast<const T*>(a.target_logits);
  auto* correct = reinterpret_cast<unsigned long long*>(a.correct);
  auto* total = reinterpret_cast<unsigned long long*>(a.total);
  const dim3 grid(static_cast<unsigned>(a.rows));
  const int vocab = static_cast<int>(a.vocab);
  if (a.kind == LossKind::kCE) {
    fused_kl_rows_kernel<T, true><<<grid, kThreads, 0, stream>>>(draft, target, vocab, a.weight, a.depth, a.row_loss,
                                                                 correct, total, a.num_depths, a.write_grad);
  } else {
    fused_kl_rows_kernel<T, false><<<grid, kThreads, 0, stream>>>(draft, target, vocab, a.weight, a.depth, a.row_loss,
                                                                  correct, total, a.num_depths, a.write_grad);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fused_kl_rows(const FusedKlRowsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0) return cudaSuccess;
  if (args.rows > INT_MAX || args.vocab <= 0 || args.vocab > INT_MAX / 2) return cudaErrorInvalidValue;
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "int64 counters are updated as u64");
  switch (args.dtype) {
    case LogitDtype::kFloat32:
      return launch_typed<float>(args, stream);
    case LogitDtype::kFloat16:
      return launch_typed<__half>(args, stream);
    case LogitDtype::kBFloat16:
      return launch_typed<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace peagle::loss
