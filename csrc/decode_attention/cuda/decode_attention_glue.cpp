// CUDA glue of decode_attention: checks (no tensor values: no host sync), the split plan, the
// output and workspace, and the launch on the current stream. Works under CUDA graph capture
// (both buffers come from the caching allocator; the runs are read on the device at every
// replay).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "decode_attention/decode_attention.h"
#include "decode_attention/decode_attention_kernels.h"

namespace peagle::decode_attention {
namespace {

at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& key_start, const at::Tensor& key_count, double scale) {
  TORCH_CHECK_VALUE(q.is_cuda(), "decode_attention: the CUDA op got q on ", q.device());
  check_decode_attention_inputs(q, k, v, key_start, key_count, scale);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  DecodeAttnParams p = make_decode_attention_params(q, k, v, key_start, key_count, scale, out);
  int sm_count = 0;
  const cudaError_t attr_err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, q.get_device());
  TORCH_CHECK(attr_err == cudaSuccess,
              "decode_attention: cannot read the multiprocessor count: ", cudaGetErrorString(attr_err));
  const int64_t workspace_bytes = plan_decode_attention(p, sm_count);
  at::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = at::empty({workspace_bytes}, q.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
  }
  const DecodeDType dt = q.scalar_type() == at::kHalf ? DecodeDType::kHalf : DecodeDType::kBFloat16;
  const int err = launch_decode_attention(p, dt, c10::cuda::getCurrentCUDAStream(q.get_device()).stream());
  TORCH_CHECK(err == 0, "decode_attention: CUDA launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
  return out;
}

}  // namespace
}  // namespace peagle::decode_attention

TORCH_LIBRARY_IMPL(peagle, CUDA, m) { m.impl("decode_attention", &peagle::decode_attention::decode_attention_cuda); }
