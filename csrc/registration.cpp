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
  // Metadata of a CodLayout (csrc/attention/attention_common.h): ranges int32 [5, T] (window
  // range lo/hi, sink range lo/hi, valid), chains int32 [2, T, K]: [0] own-chain key rows of each
  // query (-1 none), [1] the reverse map. window -1 = none. O(T) + O(T K log T), no host sync.
  m.def(
      "cod_attention_metadata(Tensor anchor, Tensor depth, Tensor document_ids, int[] depth_offsets, "
      "bool cross, int window, int sink) -> (Tensor ranges, Tensor chains)");
  // q [T, Hq, D], k/v [T, Hkv, D], context_k/v [N, Hkv, D] (cross mode) -> out [T, Hq, D] and
  // lse [Hq, T] (float32; float64 for float64 inputs; natural log; +inf on rows without keys).
  m.def(
      "cod_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? context_k, Tensor? context_v, Tensor ranges, "
      "Tensor chains, int[] depth_offsets, float scale, bool use_sink) -> (Tensor out, Tensor lse)");
  // -> dq, dk, dv, dcontext_k, dcontext_v (the last two [0, Hkv, D] in symmetric mode). Deterministic.
  m.def(
      "cod_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? context_k, Tensor? context_v, "
      "Tensor out, Tensor lse, Tensor ranges, Tensor chains, int[] depth_offsets, float scale, "
      "bool use_sink) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dcontext_k, Tensor dcontext_v)");

  // ---- fused linear KL / CE loss (csrc/loss) ------------------------------------------
  // [loss schemas]

  // ---- vLLM parallel-drafting batch step (csrc/vllm) ----------------------------------
  // [vllm schemas]
}
