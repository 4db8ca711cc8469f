// The one place where every peagle op's schema is declared (TORCH_LIBRARY). Kernels register
// their implementations next to their code with TORCH_LIBRARY_IMPL(peagle, CPU|CUDA, m);
// fake (meta) implementations live in the Python wrappers (torch.library.register_fake), so
// torch.compile and FSDP see every op as an op.
//
// Conventions: Python wrappers validate and convert inputs first (clear ValueError/TypeError
// naming the argument); the C++ ops check again with TORCH_CHECK_VALUE / TORCH_CHECK_TYPE,
// which surface in Python as ValueError / TypeError. Optional ints use -1 for "none".
#include <torch/library.h>

TORCH_LIBRARY(peagle, m) {
  // ---- COD sampling (csrc/cod) -------------------------------------------------------
  // document_ids int32[N] (-1 = padding), loss_mask bool[N]; returns anchor int32[T],
  // depth int32[T] (depth-major, anchors sorted within a depth) and depth_offsets int64[K+1]
  // on the CPU (the one host sync: it sizes T).
  m.def(
      "cod_sample(Tensor document_ids, Tensor loss_mask, int num_depths, float down_sample_ratio, "
      "float down_sample_ratio_min, int max_anchors, bool depth0_all, int seed) "
      "-> (Tensor anchor, Tensor depth, Tensor depth_offsets)");

  // ---- COD attention (csrc/attention) -----------------------------------------------
  // [attention schemas]

  // ---- fused linear KL / CE loss (csrc/loss) ------------------------------------------
  // [loss schemas]

  // ---- vLLM parallel-drafting batch step (csrc/vllm) ----------------------------------
  // [vllm schemas]
}
