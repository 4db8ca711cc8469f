// CUDA COD sampler: raw-pointer launchers (no torch), implemented in cuda/cod_kernels.cu and
// called by cuda/cod_glue.cpp. Two phases around the op's one host sync:
//   1. cod_cuda_sample: samples every depth on the device into `scratch` and copies a
//      CodCudaResult (depth offsets + smallest document id) to pinned host memory.
//   2. (host reads T = offsets[K], allocates anchor/depth) cod_cuda_write fills them.
// The draw is the CPU op's: position p of depth d gets key cod_key(seed, stream, d, p) and a
// depth keeps the `size` smallest keys of its candidate pool, so both back ends agree exactly.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cod/cod_common.h"

namespace peagle::cod {

struct CodCudaProblem {
  const int32_t* document_ids = nullptr;  // [n], -1 = padding
  const uint8_t* loss_mask = nullptr;     // [n], bool storage (0 / 1)
  int64_t n = 0;                          // >= 1
  int num_depths = 1;                     // K in [1, kMaxDepths]
  double ratio[kMaxDepths] = {};          // depth_ratios(K, r, r_min), computed on the host
  int64_t max_anchors = -1;               // -1 = no anchor subsampling
  bool depth0_all = true;
  uint64_t seed = 0;
};

// What phase 1 hands to the host: depth_offsets[0..K] and the smallest document id seen
// (so the op can reject ids < -1 without a second sync).
struct CodCudaResult {
  int64_t offsets[kMaxDepths + 1];
  int32_t min_document_id;
  int32_t unused;
};

// Device scratch bytes phase 1 and 2 need (one allocation, carved up inside).
size_t cod_cuda_scratch_bytes(int64_t n, int num_depths);

// Phase 1. `result_host` must be pinned; it is valid after the stream is synchronized.
cudaError_t cod_cuda_sample(const CodCudaProblem& problem, void* scratch, CodCudaResult* result_host,
                            cudaStream_t stream);

// Phase 2 (same problem and scratch, after phase 1): anchor/depth hold offsets[K] entries.
cudaError_t cod_cuda_write(const CodCudaProblem& problem, void* scratch, int32_t* anchor, int32_t* depth,
                           cudaStream_t stream);

}  // namespace peagle::cod
