// Torch-facing glue of the COD attention CUDA ops: checks, allocations, the current stream, and
// the launchers of csrc/attention/cuda/*.cu. No host synchronisation (CUDA-graph capturable).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>

#include "attention/attention_host.h"
#include "attention/attention_kernels.h"
#include "common/cuda_kernel_image.h"

namespace peagle::attention {
namespace {

void check_aligned(const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "cod_attention: ", name,
                    " must be 16-byte aligned on CUDA (pass a fresh contiguous tensor)");
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "cod_attention: ", what, " launch failed: ", cudaGetErrorString(err));
}

// The kernel family for head dim D on the current device (attention_dispatch.h). The override
// PEAGLE_ATTN_KERNEL is read per call (one getenv), so a test can compare the families in one process.
AttnKernelFamily kernel_family(int64_t D) {
  check_kernel_image("cod_attention");
  const char* env = std::getenv(kAttnKernelEnv);
  AttnKernelOverride choice = AttnKernelOverride::kAuto;
  TORCH_CHECK_VALUE(parse_attn_kernel_override(env, choice), "cod_attention: ", kAttnKernelEnv, "=", env,
                    " is not a kernel choice; use auto (or unset) or portable");
  int dev = 0, major = 0, minor = 0;
  TORCH_CHECK(cudaGetDevice(&dev) == cudaSuccess &&
                  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess,
              "cod_attention: cannot read the device's compute capability");
  const AttnKernelConfig c = choose_attn_kernel(major, minor, static_cast<int>(D), cod_attn_hopper_built(), choice);
  TORCH_CHECK(c.family != AttnKernelFamily::kUnsupported, "cod_attention: no CUDA kernel for head dim ", D,
              " on compute capability ", major, ".", minor, " (the kernels need 8.0 or newer, head dim 64 or 128)");
  return c.family;
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
  check_kernel_image("cod_attention_metadata");
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
  check_launch(cod_attn_fwd_launch(p, attn_dtype(q), kernel_family(s.D), c10::cuda::getCurrentCUDAStream()), "forward");
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
  check_launch(cod_attn_bwd_launch(p, attn_dtype(q), kernel_family(s.D), c10::cuda::getCurrentCUDAStream()),
               "backward");
  return {dq, dk, dv, dck, dcv};
}

}  // namespace peagle::attention

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("cod_attention_metadata", &peagle::attention::cod_attention_metadata_cuda);
  m.impl("cod_attention_fwd", &peagle::attention::cod_attention_fwd_cuda);
  m.impl("cod_attention_bwd", &peagle::attention::cod_attention_bwd_cuda);
}
