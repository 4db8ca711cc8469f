// Torch-facing glue of the COD attention CUDA ops: checks, allocations, the current stream, and
// the launchers of csrc/attention/cuda/*.cu. No host synchronisation (CUDA-graph capturable).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention/attention_host.h"
#include "attention/attention_kernels.h"

namespace peagle::attention {
namespace {

void check_aligned(const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "cod_attention: ", name,
                    " must be 16-byte aligned on CUDA (pass a fresh contiguous tensor)");
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "cod_attention: ", what, " launch failed: ", cudaGetErrorString(err));
}

// Read per call (cheap), so a benchmark can compare the forward configurations in one process.
// PEAGLE_ATTN_FWD_WARPS: 4 or 8, anything else (or unset) = 0, the default of the chosen MF.
int fwd_warps_from_env() {
  const char* v = std::getenv("PEAGLE_ATTN_FWD_WARPS");
  if (v == nullptr) return 0;
  const int w = std::atoi(v);
  return (w == 4 || w == 8) ? w : 0;
}
// Kernel family choice, PEAGLE_ATTN_FWD and PEAGLE_ATTN_BWD (read per call): unset, empty or
// "auto" = the Hopper warpgroup-MMA kernels (sm_90a, cod_attn_{fwd,dq,bwd}_wgmma.cuh) where they
// run (cod_attn_wgmma_available: compute capability 9.0 and a build with 90), the mma.sync kernels
// elsewhere. On an H200 the wgmma kernels give the same outputs and gradients bit for bit at
// D = 128 (at D = 64 the mma.sync forward's 128-row tiles partition the keys otherwise: rounding
// differences) and are faster: forward 1.9-2.1x at D = 128 and 2.7-3.1x at 64, backward
// 1.7-2.1x (64-query blocks) at 128 and 1.6-2.1x at 64 (bench/RESULTS.md, run 29). "mma" forces the mma.sync kernels,
// "wgmma" forces the Hopper ones (an error where they cannot run), and PEAGLE_ATTN_BWD=atomic the
// FlashAttention-2-style backward.
enum class KernelChoice { kAuto, kMma, kWgmma, kAtomic };
KernelChoice kernel_choice_from_env(const char* var, bool allow_atomic) {
  const char* v = std::getenv(var);
  if (v == nullptr || v[0] == '\0' || std::strcmp(v, "auto") == 0) return KernelChoice::kAuto;
  if (std::strcmp(v, "mma") == 0) return KernelChoice::kMma;
  if (std::strcmp(v, "wgmma") == 0) return KernelChoice::kWgmma;
  if (allow_atomic && std::strcmp(v, "atomic") == 0) return KernelChoice::kAtomic;
  TORCH_CHECK_VALUE(false, "cod_attention: ", var, "=", v, " is not a kernel choice; use auto (or unset), mma, wgmma",
                    allow_atomic ? " or atomic" : "");
  return KernelChoice::kAuto;
}

// PEAGLE_ATTN_FWD_MF: 2 selects 32 query rows per warp; anything else (or unset) = 1. Setting it
// or PEAGLE_ATTN_FWD_WARPS (a CTA shape of the mma.sync forward) makes "auto" pick that forward.
// kFwdWgmma: the forward on Hopper warpgroup MMAs (cod_attn_fwd_wgmma.cuh).
int fwd_mf_from_env() {
  const KernelChoice c = kernel_choice_from_env("PEAGLE_ATTN_FWD", false);
  const char* mf = std::getenv("PEAGLE_ATTN_FWD_MF");
  const bool mma_shape = mf != nullptr || std::getenv("PEAGLE_ATTN_FWD_WARPS") != nullptr;
  if (c == KernelChoice::kWgmma || (c == KernelChoice::kAuto && !mma_shape && cod_attn_wgmma_available()))
    return kFwdWgmma;
  return (mf != nullptr && std::atoi(mf) == 2) ? 2 : 1;
}

// The backward variant (BwdVariant, see launch_bwd in cod_attn_bwd.cuh): "atomic" = dQ summed with
// fp32 atomics inside the key-major dK/dV pass (faster on mma.sync, dq not bitwise reproducible
// between runs); the wgmma backward = the deterministic one with its dQ and dK/dV passes on Hopper
// warpgroup MMAs (cod_attn_dq_wgmma.cuh, cod_attn_bwd_wgmma.cuh), whose dK/dV pass takes
// PEAGLE_ATTN_WGMMA_BMQ=32|64 query rows per block at D = 128 (64: 255 registers, 102 KiB of shared
// memory per CTA; the default under "auto", 32 under an explicit "wgmma"); "mma" or no wgmma here:
// the deterministic mma.sync backward.
int bwd_variant_from_env(int64_t D) {
  const KernelChoice c = kernel_choice_from_env("PEAGLE_ATTN_BWD", true);
  if (c == KernelChoice::kAtomic) return kBwdAtomic;
  if (c == KernelChoice::kMma || (c == KernelChoice::kAuto && !cod_attn_wgmma_available())) return kBwdDefault;
  const char* b = std::getenv("PEAGLE_ATTN_WGMMA_BMQ");
  const int bmq = b != nullptr ? std::atoi(b) : (c == KernelChoice::kAuto && D == 128 ? 64 : 32);
  return bmq == 64 ? kBwdWgmma64 : kBwdWgmma;
}

// PEAGLE_ATTN_WGMMA_PIPE: software-pipelining level of the sm_90a warpgroup kernels (forward, dQ,
// dK/dV; see CodAttnParams::wgmma_pipe): 0 = unpipelined, 1, or 2 (unset, empty or "auto": 2, the
// fastest on an H200 by 1-4% of fwd+bwd, bitwise the same results: bench/RESULTS.md run 21).
// Ignored by the mma.sync kernels.
int wgmma_pipe_from_env() {
  const char* v = std::getenv("PEAGLE_ATTN_WGMMA_PIPE");
  if (v == nullptr || v[0] == '\0' || std::strcmp(v, "auto") == 0) return 2;
  if (std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0 || std::strcmp(v, "2") == 0) return v[0] - '0';
  TORCH_CHECK_VALUE(false, "cod_attention: PEAGLE_ATTN_WGMMA_PIPE=", v,
                    " is not a pipelining level; use 0, 1, 2 or auto");
  return 2;
}

// A forced wgmma kernel (PEAGLE_ATTN_FWD / PEAGLE_ATTN_BWD = wgmma) where it cannot run: an error
// naming the device's compute capability and the build's archs, instead of a launch failure.
// `what` is a literal so the sentence stays greppable in the built library (bench/attn_wgmma.sh
// looks for it).
void require_wgmma(const char* what) {
  if (cod_attn_wgmma_available()) return;
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  TORCH_CHECK(false, what, " (compute capability 9.0; this one is ", major, ".", minor,
              ") and a build with 90 in PEAGLE_CUDA_ARCHS (this one: " PEAGLE_CUDA_ARCHS ")");
}

CodAttnParams base_params(const AttnShapes& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& context_k, const std::optional<at::Tensor>& context_v,
                          const at::Tensor& ranges, const at::Tensor& chains, at::IntArrayRef depth_offsets,
                          double scale, bool use_sink) {
  TORCH_CHECK_VALUE(s.T < (int64_t(1) << 31) - 1 && s.N < (int64_t(1) << 31) - 1, "cod_attention: T, N must fit int32");
  check_aligned("q", q);
  check_aligned("k", k);
  check_aligned("v", v);
  CodAttnParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  if (s.cross) {
    check_aligned("context_k", *context_k);
    check_aligned("context_v", *context_v);
    p.rk = context_k->data_ptr();
    p.rv = context_v->data_ptr();
  } else {
    p.rk = p.k;
    p.rv = p.v;
  }
  p.ranges = ranges.data_ptr<int32_t>();
  p.chain = chains.data_ptr<int32_t>();
  p.rchain = p.chain + s.T * s.K;
  p.T = static_cast<int>(s.T);
  p.N = static_cast<int>(s.N);
  p.Hq = static_cast<int>(s.Hq);
  p.Hkv = static_cast<int>(s.Hkv);
  p.D = static_cast<int>(s.D);
  p.K = static_cast<int>(s.K);
  p.group = static_cast<int>(s.Hq / s.Hkv);
  p.symmetric = s.cross ? 0 : 1;
  p.use_sink = use_sink ? 1 : 0;
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  for (int64_t e = 0; e <= s.K; ++e) p.depth_offsets[e] = static_cast<int>(depth_offsets[e]);
  p.fwd_warps = fwd_warps_from_env();
  p.fwd_mf = fwd_mf_from_env();
  p.wgmma_pipe = wgmma_pipe_from_env();
  return p;
}

AttnDtype attn_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kBFloat16 ? AttnDtype::kBF16 : AttnDtype::kFP16;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cod_attention_metadata_cuda(const at::Tensor& anchor, const at::Tensor& depth,
                                                               const at::Tensor& document_ids,
                                                               at::IntArrayRef depth_offsets, bool cross,
                                                               int64_t window, int64_t sink) {
  check_metadata_inputs(anchor, depth, document_ids, depth_offsets, cross, window, sink);
  const c10::cuda::CUDAGuard guard(anchor.device());
  const int64_t T = anchor.size(0), N = document_ids.size(0), K = static_cast<int64_t>(depth_offsets.size()) - 1;
  at::Tensor ranges = at::empty({kNumRangeFields, T}, anchor.options());
  at::Tensor chains = at::empty({2, T, K}, anchor.options());
  if (T == 0) return {ranges, chains};
  const size_t ws_bytes = cod_attn_metadata_workspace(static_cast<int>(N));
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes) + 1}, anchor.options().dtype(at::kByte));
  cod_attn_metadata_launch(anchor.data_ptr<int32_t>(), depth.data_ptr<int32_t>(), document_ids.data_ptr<int32_t>(),
                           static_cast<int>(T), static_cast<int>(N), depth_offsets.data(), static_cast<int>(K), cross,
                           window, sink, ranges.data_ptr<int32_t>(), chains.data_ptr<int32_t>(), ws.data_ptr(),
                           ws_bytes, c10::cuda::getCurrentCUDAStream());
  check_launch(cudaGetLastError(), "metadata");
  return {ranges, chains};
}

std::tuple<at::Tensor, at::Tensor> cod_attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const std::optional<at::Tensor>& context_k,
                                                          const std::optional<at::Tensor>& context_v,
                                                          const at::Tensor& ranges, const at::Tensor& chains,
                                                          at::IntArrayRef depth_offsets, double scale, bool use_sink) {
  const AttnShapes s = check_attention_inputs("cod_attention_fwd", q, k, v, context_k, context_v, ranges, chains,
                                              depth_offsets, /*cuda=*/true);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({s.Hq, s.T}, q.options().dtype(at::kFloat));
  if (s.T == 0) return {out, lse};
  CodAttnParams p = base_params(s, q, k, v, context_k, context_v, ranges, chains, depth_offsets, scale, use_sink);
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  if (p.fwd_mf == kFwdWgmma) require_wgmma("cod_attention: PEAGLE_ATTN_FWD=wgmma needs an sm_90 GPU");
  check_launch(cod_attn_fwd_launch(p, attn_dtype(q), c10::cuda::getCurrentCUDAStream()), "forward");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> cod_attention_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& context_k, const std::optional<at::Tensor>& context_v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& ranges, const at::Tensor& chains, at::IntArrayRef depth_offsets,
    double scale, bool use_sink) {
  const AttnShapes s = check_attention_inputs("cod_attention_bwd", q, k, v, context_k, context_v, ranges, chains,
                                              depth_offsets, /*cuda=*/true);
  check_backward_inputs(s, dout, out, lse);
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "cod_attention_bwd: lse must be float32 on CUDA");
  TORCH_CHECK_TYPE(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                   "cod_attention_bwd: grad_out and out must have q's dtype");
  TORCH_CHECK_VALUE(dout.is_contiguous() && out.is_contiguous() && lse.is_contiguous(),
                    "cod_attention_bwd: grad_out, out and lse must be contiguous");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor dck = s.cross ? at::empty(context_k->sizes(), q.options()) : at::empty({0, s.Hkv, s.D}, q.options());
  at::Tensor dcv = s.cross ? at::empty(context_v->sizes(), q.options()) : at::empty({0, s.Hkv, s.D}, q.options());
  if (s.T == 0) {
    if (s.cross) {
      dck.zero_();
      dcv.zero_();
    }
    return {dq, dk, dv, dck, dcv};
  }
  check_aligned("grad_out", dout);
  check_aligned("out", out);
  at::Tensor delta = at::empty({s.Hq, s.T}, q.options().dtype(at::kFloat));
  CodAttnParams p = base_params(s, q, k, v, context_k, context_v, ranges, chains, depth_offsets, scale, use_sink);
  p.out = const_cast<void*>(out.data_ptr());
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.dout = dout.data_ptr();
  p.delta = delta.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.drk = s.cross ? dck.data_ptr() : dk.data_ptr();
  p.drv = s.cross ? dcv.data_ptr() : dv.data_ptr();
  p.bwd_variant = bwd_variant_from_env(s.D);
  if (p.bwd_variant == kBwdWgmma || p.bwd_variant == kBwdWgmma64)
    require_wgmma("cod_attention: PEAGLE_ATTN_BWD=wgmma needs an sm_90 GPU");
  at::Tensor dq_accum;  // fp32 [T, Hq, D] workspace of the atomic variant (zeroed by the launcher)
  if (p.bwd_variant == kBwdAtomic) {
    dq_accum = at::empty({s.T, s.Hq, s.D}, q.options().dtype(at::kFloat));
    check_aligned("dq workspace", dq_accum);
    p.dq_accum = dq_accum.data_ptr<float>();
  }
  check_launch(cod_attn_bwd_launch(p, attn_dtype(q), c10::cuda::getCurrentCUDAStream()), "backward");
  return {dq, dk, dv, dck, dcv};
}

}  // namespace peagle::attention

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("cod_attention_metadata", &peagle::attention::cod_attention_metadata_cuda);
  m.impl("cod_attention_fwd", &peagle::attention::cod_attention_fwd_cuda);
  m.impl("cod_attention_bwd", &peagle::attention::cod_attention_bwd_cuda);
}
