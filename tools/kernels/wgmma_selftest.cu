// Standalone check (no torch) of the wgmma building blocks of the Hopper COD attention kernels
// (csrc/attention/cuda/cod_attn_wgmma.cuh): the B128 tile loader (cp.async), the K-major and
// MN-major matrix descriptors, the SS and RS wgmma wrappers and the fences, each in isolation on
// random integer-valued 16-bit data (exact in fp32, so any layout error shows as a large error)
// against a CPU fp32 reference. Prints PASS / FAIL with the max error per case (and the first
// mismatches of a failing case); exit code 0 only when every case passes.
//   nvcc -std=c++17 -O2 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I csrc \
//        tools/kernels/wgmma_selftest.cu -o /tmp/wgmma_selftest && /tmp/wgmma_selftest
// Cases (T = bf16 and fp16):
//  (a) SS, C[64][N] = A[64][128] B[N][128]^T with A, B K-major (the kernel's S^T = K Q^T):
//      every single k-step kk = 0..7 on its own (the 32-byte descriptor advance inside a swizzle
//      atom, kk < 4, and the next 64-column panel, kk >= 4), then the whole K = 128 loop; N = 64
//      (the kernels' query block);
//  (b) RS, C[64][D] = P[64][BMQ] B[BMQ][D] with P in registers (packed from the accumulator-layout
//      fragments exactly as the kernel packs P^T) and B MN-major (imm-trans-b = 1, the kernel's
//      dV += P^T dO): each single k-step kq, then the whole loop; (D, BMQ) = (128, 64) (two
//      64-column panels LBO = 8192 apart) and (64, 64);
//  (c) the kernel's chain: S^T = K Q^T (SS; accumulators start with stale non-zero values, so the
//      first k-step's scale-d = 0 must overwrite them), its accumulators packed to A fragments,
//      then C = S^T dO (RS), for (D, BMQ) = (128, 64) and (64, 64);
//  (d) the wgmma dQ kernel's chain (cod_attn_dq_wgmma.cuh): S = Q K^T (SS, A = Q [64][D], B = K
//      [64 keys][D], stale accumulators), packed to A fragments, then C = S K (RS) with the SAME K
//      tile read MN-major (k = the 64 keys, n = D: LBO = 64 * 128), for D = 128 and 64, both dtypes
//      (fp16 at D = 128 reads 64-row MN-major panels nowhere else).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "attention/cuda/cod_attn_wgmma.cuh"

using namespace peagle::attention::cuda;

#define CHECK_CUDA(x)                                                                                                \
  do {                                                                                                               \
    cudaError_t e_ = (x);                                                                                            \
    if (e_ != cudaSuccess) {                                                                                         \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(3);                                                                                                  \
    }                                                                                                                \
  } while (0)

// 1024-byte aligned shared-memory base (B128 swizzle atoms; the launch adds 1024 bytes of slack)
__device__ __forceinline__ uint32_t aligned_smem_base(unsigned char* raw) { return (smem_u32(raw) + 1023u) & ~1023u; }

// accumulator fragment -> row-major C[64][N] (warp w: rows 16 w + g, + 8; columns 8 n + 2 t, + 1)
template <int N>
__device__ void store_acc(float* C, const float (&d)[N / 8][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) C[(16 * warp + g + 8 * (x >> 1)) * N + 8 * n + 2 * t + (x & 1)] = d[n][x];
}

// (a) C[64][N] = sum over k-steps [k_first, k_last) of A[:, 16 kk..] B[:, 16 kk..]^T
template <typename T, int N, int KD>
__global__ void __launch_bounds__(128) ss_kernel(const T* A, const T* B, float* C, int k_first, int k_last) {
#if PEAGLE_WGMMA_DEVICE
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const int tid = threadIdx.x;
  const uint32_t sA = aligned_smem_base(smem_raw), sB = sA + 64 * KD * 2;
  wg::load_tile_sw128<64, KD, 128>(sA, A, KD, 0, 64, tid);
  wg::load_tile_sw128<N, KD, 128>(sB, B, KD, 0, N, tid);
  cp_async_commit();
  cp_async_wait<0>();
  wg::fence_proxy_async_smem();
  __syncthreads();
  float d[N / 8][4];
#pragma unroll
  for (int n = 0; n < N / 8; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.f;
  wg::fence_operands(d);
  wg::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < KD / 16; ++kk)
    if (kk >= k_first && kk < k_last) wg::wgmma_ss<N, T>(d, wg::desc_kmajor<64>(sA, kk), wg::desc_kmajor<N>(sB, kk), 1);
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::fence_operands(d);
  store_acc<N>(C, d);
#endif
}

// (b) C[64][D] = sum over k-steps [kq_first, kq_last) of P[:, 16 kq..] B[16 kq.., :]
template <typename T, int BMQ, int D>
__global__ void __launch_bounds__(128) rs_kernel(const float* P, const T* B, float* C, int kq_first, int kq_last) {
#if PEAGLE_WGMMA_DEVICE
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const uint32_t sB = aligned_smem_base(smem_raw);
  wg::load_tile_sw128<BMQ, D, 128>(sB, B, D, 0, BMQ, tid);
  cp_async_commit();
  float st[BMQ / 8][4];
#pragma unroll
  for (int n = 0; n < BMQ / 8; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) st[n][x] = P[(16 * warp + g + 8 * (x >> 1)) * BMQ + 8 * n + 2 * t + (x & 1)];
  uint32_t pa[BMQ / 16][4];
  wg::pack_acc_as_a<T, BMQ>(st, pa);
  cp_async_wait<0>();
  wg::fence_proxy_async_smem();
  __syncthreads();
  float d[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.f;
  wg::fence_operands(pa);
  wg::fence_operands(d);
  wg::wgmma_fence();
#pragma unroll
  for (int kq = 0; kq < BMQ / 16; ++kq)
    if (kq >= kq_first && kq < kq_last) wg::wgmma_rs<D, T>(d, pa[kq], wg::desc_mnmajor<BMQ>(sB, kq), 1);
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::fence_operands(d);
  store_acc<D>(C, d);
#endif
}

// (c) St = K Q^T (SS, first k-step with scale-d = 0 as in the kernel), then C = bf16(St) dO (RS)
template <typename T, int BMQ, int D>
__global__ void __launch_bounds__(128) chain_kernel(const T* K, const T* Q, const T* dO, float* C) {
#if PEAGLE_WGMMA_DEVICE
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const int tid = threadIdx.x;
  const uint32_t sK = aligned_smem_base(smem_raw), sQ = sK + 64 * D * 2, sdO = sQ + BMQ * D * 2;
  wg::load_tile_sw128<64, D, 128>(sK, K, D, 0, 64, tid);
  wg::load_tile_sw128<BMQ, D, 128>(sQ, Q, D, 0, BMQ, tid);
  wg::load_tile_sw128<BMQ, D, 128>(sdO, dO, D, 0, BMQ, tid);
  cp_async_commit();
  cp_async_wait<0>();
  wg::fence_proxy_async_smem();
  __syncthreads();
  // Stale values, as the kernel's accumulators hold the previous query block's P^T / dS^T: the
  // first k-step (scale-d = 0) must overwrite them, so a scale-d that is ignored fails this case.
  float st[BMQ / 8][4];
#pragma unroll
  for (int n = 0; n < BMQ / 8; ++n) st[n][0] = st[n][1] = st[n][2] = st[n][3] = 1000.f + n;
  wg::fence_operands(st);
  wg::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wg::wgmma_ss<BMQ, T>(st, wg::desc_kmajor<64>(sK, kk), wg::desc_kmajor<BMQ>(sQ, kk), kk > 0);
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::fence_operands(st);
  uint32_t pa[BMQ / 16][4];
  wg::pack_acc_as_a<T, BMQ>(st, pa);
  float d[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.f;
  wg::fence_operands(pa);
  wg::fence_operands(d);
  wg::wgmma_fence();
#pragma unroll
  for (int kq = 0; kq < BMQ / 16; ++kq) wg::wgmma_rs<D, T>(d, pa[kq], wg::desc_mnmajor<BMQ>(sdO, kq), 1);
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::fence_operands(d);
  store_acc<D>(C, d);
#endif
}

// (d) S = Q K^T (SS, stale accumulators as in the dQ kernel), then C = bf16(S) K with the same K
// tile read MN-major (RS), as cod_attn_dq_wgmma_kernel computes dQ += dS K
template <typename T, int D>
__global__ void __launch_bounds__(128) dq_chain_kernel(const T* Q, const T* K, float* C) {
#if PEAGLE_WGMMA_DEVICE
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const int tid = threadIdx.x;
  const uint32_t sQ = aligned_smem_base(smem_raw), sK = sQ + 64 * D * 2;
  wg::load_tile_sw128<64, D, 128>(sQ, Q, D, 0, 64, tid);
  wg::load_tile_sw128<64, D, 128>(sK, K, D, 0, 64, tid);
  cp_async_commit();
  cp_async_wait<0>();
  wg::fence_proxy_async_smem();
  __syncthreads();
  float s[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = -1000.f - n;
  wg::fence_operands(s);
  wg::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wg::wgmma_ss<64, T>(s, wg::desc_kmajor<64>(sQ, kk), wg::desc_kmajor<64>(sK, kk), kk > 0);
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::fence_operands(s);
  uint32_t a[4][4];
  wg::pack_acc_as_a<T, 64>(s, a);
  float d[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.f;
  wg::fence_operands(a);
  wg::fence_operands(d);
  wg::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wg::wgmma_rs<D, T>(d, a[kk], wg::desc_mnmajor<64>(sK, kk), 1);
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::fence_operands(d);
  store_acc<D>(C, d);
#endif
}

// ---------------------------------------------------------------- host
template <typename T>
T to16(float x);
template <>
__nv_bfloat16 to16<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__half to16<__half>(float x) {
  return __float2half(x);
}

template <typename T>
const char* tname();
template <>
const char* tname<__nv_bfloat16>() {
  return "bf16";
}
template <>
const char* tname<__half>() {
  return "fp16";
}

std::mt19937 rng(1234);
// integer values in [-r, r]: exact in 16 bits and every sum here exact in fp32
std::vector<float> rand_int(int n, int r) {
  std::uniform_int_distribution<int> u(-r, r);
  std::vector<float> v(n);
  for (auto& x : v) x = float(u(rng));
  return v;
}

template <typename T>
T* to_device16(const std::vector<float>& v) {
  std::vector<T> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = to16<T>(v[i]);
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, h.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
float* to_device32(const std::vector<float>& v) {
  float* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, v.size() * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

int failures = 0, cases = 0;

// compares C (device, [rows][cols]) with ref; prints one line (+ the first mismatches on failure)
void report(const std::string& name, const float* dC, const std::vector<float>& ref, int rows, int cols) {
  std::vector<float> got(ref.size());
  CHECK_CUDA(cudaMemcpy(got.data(), dC, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double max_err = 0, max_ref = 0;
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_ref = std::fmax(max_ref, std::fabs(ref[i]));
    max_err = std::fmax(max_err, std::isfinite(got[i]) ? std::fabs(double(got[i]) - ref[i]) : INFINITY);
  }
  // integer data: the exact result; 1e-5 relative leaves room only for fp32 summation order
  const double tol = 1e-5 * std::fmax(max_ref, 1.0);
  const bool ok = max_err <= tol && max_ref > 0;
  ++cases;
  if (!ok) ++failures;
  std::printf("%s %-34s max_err=%.3g max|ref|=%.3g\n", ok ? "PASS" : "FAIL", name.c_str(), max_err, max_ref);
  if (!ok)
    for (int r = 0; r < rows && bad < 8; ++r)
      for (int c = 0; c < cols && bad < 8; ++c)
        if (!(std::fabs(double(got[r * cols + c]) - ref[r * cols + c]) <= tol)) {
          std::printf("    C[%d][%d] = %g, want %g\n", r, c, got[r * cols + c], ref[r * cols + c]);
          ++bad;
        }
}

template <typename T, int N>
void case_ss() {
  constexpr int KD = 128;
  const auto a = rand_int(64 * KD, 3), b = rand_int(N * KD, 3);
  T* dA = to_device16<T>(a);
  T* dB = to_device16<T>(b);
  float* dC = nullptr;
  CHECK_CUDA(cudaMalloc(&dC, 64 * N * sizeof(float)));
  const int smem = 1024 + (64 + N) * KD * 2;
  auto kernel = ss_kernel<T, N, KD>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  auto run = [&](int k0, int k1, const std::string& name) {
    std::vector<float> ref(64 * N, 0.f);
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < N; ++n) {
        float s = 0.f;
        for (int k = 16 * k0; k < 16 * k1; ++k) s += a[m * KD + k] * b[n * KD + k];
        ref[m * N + n] = s;
      }
    CHECK_CUDA(cudaMemset(dC, 0xff, 64 * N * sizeof(float)));  // NaN: unwritten outputs fail
    kernel<<<1, 128, smem>>>(dA, dB, dC, k0, k1);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    report(name, dC, ref, 64, N);
  };
  for (int kk = 0; kk < KD / 16; ++kk)
    run(kk, kk + 1, std::string("ss_") + tname<T>() + "_m64n" + std::to_string(N) + "k16_kk" + std::to_string(kk));
  run(0, KD / 16, std::string("ss_") + tname<T>() + "_m64n" + std::to_string(N) + "_K128");
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dC);
}

template <typename T, int BMQ, int D>
void case_rs() {
  const auto pm = rand_int(64 * BMQ, 3), b = rand_int(BMQ * D, 3);
  float* dP = to_device32(pm);
  T* dB = to_device16<T>(b);
  float* dC = nullptr;
  CHECK_CUDA(cudaMalloc(&dC, 64 * D * sizeof(float)));
  const int smem = 1024 + BMQ * D * 2;
  auto kernel = rs_kernel<T, BMQ, D>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  auto run = [&](int k0, int k1, const std::string& name) {
    std::vector<float> ref(64 * D, 0.f);
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < D; ++n) {
        float s = 0.f;
        for (int k = 16 * k0; k < 16 * k1; ++k) s += pm[m * BMQ + k] * b[k * D + n];
        ref[m * D + n] = s;
      }
    CHECK_CUDA(cudaMemset(dC, 0xff, 64 * D * sizeof(float)));
    kernel<<<1, 128, smem>>>(dP, dB, dC, k0, k1);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    report(name, dC, ref, 64, D);
  };
  const std::string base = std::string("rs_") + tname<T>() + "_m64n" + std::to_string(D) + "_bmq" + std::to_string(BMQ);
  for (int kq = 0; kq < BMQ / 16; ++kq) run(kq, kq + 1, base + "_kq" + std::to_string(kq));
  run(0, BMQ / 16, base + "_all");
  cudaFree(dP);
  cudaFree(dB);
  cudaFree(dC);
}

template <typename T, int BMQ, int D>
void case_chain() {
  // |S| <= D: integers exact in 16 bits (<= 256 for bf16, 2048 for fp16)
  const auto k = rand_int(64 * D, 1), q = rand_int(BMQ * D, 1), dout = rand_int(BMQ * D, 3);
  T* dK = to_device16<T>(k);
  T* dQ = to_device16<T>(q);
  T* ddO = to_device16<T>(dout);
  float* dC = nullptr;
  CHECK_CUDA(cudaMalloc(&dC, 64 * D * sizeof(float)));
  CHECK_CUDA(cudaMemset(dC, 0xff, 64 * D * sizeof(float)));
  const int smem = 1024 + (64 + 2 * BMQ) * D * 2;
  auto kernel = chain_kernel<T, BMQ, D>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<float> s(64 * BMQ), ref(64 * D, 0.f);
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < BMQ; ++n) {
      float x = 0.f;
      for (int j = 0; j < D; ++j) x += k[m * D + j] * q[n * D + j];
      s[m * BMQ + n] = x;
    }
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < D; ++n) {
      float x = 0.f;
      for (int j = 0; j < BMQ; ++j) x += s[m * BMQ + j] * dout[j * D + n];
      ref[m * D + n] = x;
    }
  kernel<<<1, 128, smem>>>(dK, dQ, ddO, dC);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  report(std::string("chain_") + tname<T>() + "_d" + std::to_string(D) + "_bmq" + std::to_string(BMQ), dC, ref, 64, D);
  cudaFree(dK);
  cudaFree(dQ);
  cudaFree(ddO);
  cudaFree(dC);
}

template <typename T, int D>
void case_dq_chain() {
  // |S| <= D: integers exact in 16 bits; |C| <= 64 D exact in fp32
  const auto q = rand_int(64 * D, 1), k = rand_int(64 * D, 1);
  T* dQ = to_device16<T>(q);
  T* dK = to_device16<T>(k);
  float* dC = nullptr;
  CHECK_CUDA(cudaMalloc(&dC, 64 * D * sizeof(float)));
  CHECK_CUDA(cudaMemset(dC, 0xff, 64 * D * sizeof(float)));
  const int smem = 1024 + 2 * 64 * D * 2;
  auto kernel = dq_chain_kernel<T, D>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<float> s(64 * 64), ref(64 * D, 0.f);
  for (int m = 0; m < 64; ++m)
    for (int j = 0; j < 64; ++j) {
      float x = 0.f;
      for (int c = 0; c < D; ++c) x += q[m * D + c] * k[j * D + c];
      s[m * 64 + j] = x;
    }
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < D; ++n) {
      float x = 0.f;
      for (int j = 0; j < 64; ++j) x += s[m * 64 + j] * k[j * D + n];
      ref[m * D + n] = x;
    }
  kernel<<<1, 128, smem>>>(dQ, dK, dC);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  report(std::string("dq_chain_") + tname<T>() + "_d" + std::to_string(D), dC, ref, 64, D);
  cudaFree(dQ);
  cudaFree(dK);
  cudaFree(dC);
}

int main() {
  int dev = 0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("SKIP: wgmma (sm_90a) needs compute capability 9.0\n");
    return 2;
  }
  // every wgmma wrapper specialization the kernel instantiates, in each configuration
  case_ss<__nv_bfloat16, 64>();
  case_ss<__half, 64>();
  case_rs<__nv_bfloat16, 64, 128>();
  case_rs<__nv_bfloat16, 64, 64>();
  case_rs<__half, 64, 64>();
  case_chain<__nv_bfloat16, 64, 128>();
  case_chain<__nv_bfloat16, 64, 64>();
  case_chain<__half, 64, 64>();
  case_dq_chain<__nv_bfloat16, 128>();
  case_dq_chain<__nv_bfloat16, 64>();
  case_dq_chain<__half, 128>();
  case_dq_chain<__half, 64>();
  std::printf("%s: %d of %d cases passed\n", failures ? "FAIL" : "PASS", cases - failures, cases);
  return failures ? 1 : 0;
}
