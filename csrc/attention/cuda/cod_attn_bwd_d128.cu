// Instantiations of the COD attention bwd kernels for head dim 128 (bf16 and fp16), one
// file per (pass, head dim) so they compile in parallel.
#include "attention/cuda/cod_attn_configs.cuh"

namespace peagle::attention::cuda {
template cudaError_t run_bwd<128, __nv_bfloat16>(const CodAttnParams&, bool, cudaStream_t);
template cudaError_t run_bwd<128, __half>(const CodAttnParams&, bool, cudaStream_t);
}  // namespace peagle::attention::cuda
