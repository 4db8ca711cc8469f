// The no-kernel-image check of the CUDA glue (cuda_archs.h): before an op's first launch on a
// device, a GPU this build has no SASS or PTX for is told so, by arch and with the rebuild line.
// Needs PEAGLE_CUDA_SASS_ARCHS / PEAGLE_CUDA_PTX_ARCHS, which CMake defines for the module.
#pragma once
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "common/cuda_archs.h"

namespace peagle {

inline void check_kernel_image(const char* op) {
  static std::atomic<int> checked[64] = {};  // 1: this device has an image (checked once)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return;  // the launch reports the error
  const bool cacheable = dev >= 0 && dev < 64;
  if (cacheable && checked[dev].load(std::memory_order_relaxed) == 1) return;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return;
  const std::string msg = missing_kernel_image_message(op, major, minor, PEAGLE_CUDA_SASS_ARCHS, PEAGLE_CUDA_PTX_ARCHS);
  TORCH_CHECK(msg.empty(), msg);
  if (cacheable) checked[dev].store(1, std::memory_order_relaxed);
}

}  // namespace peagle
