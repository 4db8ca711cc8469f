// Torch-facing glue of the CUDA COD sampler: checks, allocations, the op's one host sync.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "cod/cod_checks.h"
#include "cod/cod_common.h"
#include "cod/cod_kernels.h"
#include "common/cuda_kernel_image.h"

namespace peagle::cod {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> cod_sample_cuda(const at::Tensor& document_ids,
                                                               const at::Tensor& loss_mask, int64_t num_depths,
                                                               double r, double r_min, int64_t max_anchors,
                                                               bool depth0_all, int64_t seed) {
  check_cod_inputs(document_ids, loss_mask, num_depths, r, r_min, max_anchors);
  TORCH_CHECK_VALUE(document_ids.is_cuda() && loss_mask.is_cuda(),
                    "cod_sample: document_ids and loss_mask must both be CUDA tensors here, got ",
                    document_ids.device(), " and ", loss_mask.device());
  const c10::cuda::CUDAGuard guard(document_ids.device());
  check_kernel_image("cod_sample");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(document_ids.device().index()).stream();
  const int64_t n = document_ids.size(0);
  const int K = static_cast<int>(num_depths);

  at::Tensor offsets = at::empty({num_depths + 1}, at::TensorOptions().dtype(at::kLong));  // host, as on CPU
  if (n == 0) {  // nothing to sample, nothing to check
    std::memset(offsets.data_ptr<int64_t>(), 0, sizeof(int64_t) * (K + 1));
    return {at::empty({0}, document_ids.options()), at::empty({0}, document_ids.options()), offsets};
  }

  CodCudaProblem problem;
  problem.document_ids = document_ids.data_ptr<int32_t>();
  problem.loss_mask = reinterpret_cast<const uint8_t*>(loss_mask.data_ptr<bool>());
  problem.n = n;
  problem.num_depths = K;
  const std::vector<double> ratio = depth_ratios(K, r, r_min);  // the CPU op's numbers, bit for bit
  for (int d = 0; d < K; ++d) problem.ratio[d] = ratio[d];
  problem.max_anchors = max_anchors;
  problem.depth0_all = depth0_all;
  problem.seed = static_cast<uint64_t>(seed);

  at::Tensor scratch =
      at::empty({static_cast<int64_t>(cod_cuda_scratch_bytes(n, K))}, document_ids.options().dtype(at::kByte));
  at::Tensor result_host = at::empty({static_cast<int64_t>(sizeof(CodCudaResult))},
                                     at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* result = reinterpret_cast<CodCudaResult*>(result_host.data_ptr<uint8_t>());
  C10_CUDA_CHECK(cod_cuda_sample(problem, scratch.data_ptr(), result, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));  // the one host sync: sizes T

  TORCH_CHECK_VALUE(result->min_document_id >= -1, "cod_sample: document_ids must be >= -1 (-1 = padding), got ",
                    result->min_document_id);
  std::memcpy(offsets.data_ptr<int64_t>(), result->offsets, sizeof(int64_t) * (K + 1));
  const int64_t total = result->offsets[K];
  at::Tensor anchor = at::empty({total}, document_ids.options());
  at::Tensor depth = at::empty({total}, document_ids.options());
  if (total > 0)
    C10_CUDA_CHECK(
        cod_cuda_write(problem, scratch.data_ptr(), anchor.data_ptr<int32_t>(), depth.data_ptr<int32_t>(), stream));
  return {anchor, depth, offsets};
}

}  // namespace
}  // namespace peagle::cod

TORCH_LIBRARY_IMPL(peagle, CUDA, m) { m.impl("cod_sample", &peagle::cod::cod_sample_cuda); }
