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
  // Chunked fused linear-KL (kind "kl") / cross-entropy-to-target-argmax (kind "ce") loss over
  // draft logits draft_hidden[T, H] @ draft_head[Vd, H].T and target logits target_hidden[M, Ht]
  // @ target_head[V, Ht].T restricted to the draft vocab through d2t (draft id i -> target id
  // i + d2t[i]; d2t None needs Vd == V). Draft row t is compared with target row
  // target_index[t] (int64 [T] in [0, M); None: target row t, M == T); the target side is
  // computed once per distinct target row of a weighted draft row, and rows of weight 0 are not
  // computed at all. loss = sum_t weight[t] * loss_t / sum_t weight[t] (0 when the weights sum
  // to 0); correct/total int64[num_depths] count, per depth, the tokens with weight > 0 and
  // those whose draft and target argmax agree. weight is fp64 for fp64 inputs, fp32 otherwise;
  // depth int32. grad_hidden/grad_head are d loss / d draft_hidden and d loss / d draft_head
  // (empty [0] when not requested). At most chunk_rows rows of logits per side exist at any time.
  m.def(
      "fused_linear_kl(Tensor draft_hidden, Tensor draft_head, Tensor target_hidden, Tensor target_head, "
      "Tensor weight, Tensor depth, Tensor? d2t, Tensor? target_index, int num_depths, int chunk_rows, str kind, "
      "bool compute_grad_hidden, bool compute_grad_head) "
      "-> (Tensor loss, Tensor correct, Tensor total, Tensor grad_hidden, Tensor grad_head)");

  // ---- decode attention over a KV cache (csrc/decode_attention) ----------------------------
  // q [T, Hq, D] (rows contiguous, any token/head strides), k/v [S, Hkv, D] (rows contiguous):
  // query t, head h attends key rows key_start[t] .. key_start[t] + key_count[t] - 1 (int32 [T])
  // of kv head h / (Hq / Hkv), scores scaled by `scale`; a run of no keys gives 0. -> out
  // [T, Hq, D] contiguous, q's dtype. CUDA: float16/bfloat16, D 64 or 128, Hq / Hkv <= 8.
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor key_start, Tensor key_count, float scale) -> Tensor");

  // ---- vLLM parallel-drafting batch step (csrc/vllm) ----------------------------------
  // [vllm schemas]
  // docs/design.md section 6: vLLM's parallel-drafting input step in one op. num_rejected_tokens
  // None = no rejected tokens. Returns (input_ids int32[T_out], positions int64[T_out],
  // hidden [T_out, H], is_rejected bool[T_out], is_masked bool[T_out], token_indices_to_sample
  // int32[B*K], hidden_state_mapping int32[T_in], slot_mapping int64[T_out], query_start_loc
  // int32[B+1]) with T_out = T_in + (K-1)*B. The _out form writes preallocated tensors (CUDA
  // graph capture); it mutates exactly its keyword-only arguments.
  m.def(
      "prepare_parallel_draft_inputs(Tensor target_token_ids, Tensor target_positions, Tensor next_token_ids, "
      "Tensor query_start_loc, Tensor? num_rejected_tokens, Tensor target_hidden, Tensor mask_hidden, "
      "Tensor block_table, int num_spec_tokens, int mask_token_id, int block_size, int max_model_len) "
      "-> (Tensor input_ids, Tensor positions, Tensor hidden, Tensor is_rejected, Tensor is_masked, "
      "Tensor token_indices_to_sample, Tensor hidden_state_mapping, Tensor slot_mapping, Tensor new_query_start_loc)");
  m.def(
      "prepare_parallel_draft_inputs_out(Tensor target_token_ids, Tensor target_positions, Tensor next_token_ids, "
      "Tensor query_start_loc, Tensor? num_rejected_tokens, Tensor target_hidden, Tensor mask_hidden, "
      "Tensor block_table, int num_spec_tokens, int mask_token_id, int block_size, int max_model_len, *, "
      "Tensor(a!) input_ids, Tensor(b!) positions, Tensor(c!) hidden, Tensor(d!) is_rejected, Tensor(e!) is_masked, "
      "Tensor(f!) token_indices_to_sample, Tensor(g!) hidden_state_mapping, Tensor(h!) slot_mapping, "
      "Tensor(i!) new_query_start_loc) -> ()");
  // Test-only, CPU: the CUDA kernel's launch plan and block phases run on the CPU
  // (csrc/vllm/cpu/parallel_draft_emulation.cpp); vec_bytes 0 = the launcher's choice.
  m.def(
      "_parallel_draft_kernel_emulation(Tensor target_token_ids, Tensor target_positions, Tensor next_token_ids, "
      "Tensor query_start_loc, Tensor? num_rejected_tokens, Tensor target_hidden, Tensor mask_hidden, "
      "Tensor block_table, int num_spec_tokens, int mask_token_id, int block_size, int max_model_len, "
      "int vec_bytes) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}
