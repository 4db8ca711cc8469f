// Torch-facing pieces shared by the CPU op and the CUDA glue of decode_attention: argument
// checks (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE -> ValueError / TypeError) and the raw-pointer
// parameter block the kernel takes. Defined in cpu/decode_attention_cpu.cpp, which every build
// compiles.
#pragma once
#include <ATen/core/Tensor.h>

#include "decode_attention/decode_attention_kernels.h"

namespace peagle::decode_attention {

// Ranks, shapes, dtypes, devices, strides and the scale. No tensor values are read (the CUDA
// path must not sync).
void check_decode_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& key_start, const at::Tensor& key_count, double scale);

DecodeAttnParams make_decode_attention_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& key_start, const at::Tensor& key_count, double scale,
                                              at::Tensor& out);

}  // namespace peagle::decode_attention
