// vLLM parallel-drafting batch step (docs/design.md section 6): the launcher of the one CUDA
// kernel, and the per-row rule shared by the CPU and CUDA implementations. Plain C++, no
// torch: the .cu file includes this and is compiled by nvcc without any torch header.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define PEAGLE_HD __host__ __device__ __forceinline__
#else
#define PEAGLE_HD inline
#endif

namespace peagle::vllm {

// vLLM's PADDING_SLOT_ID: slots that must not be written to the KV cache.
constexpr int64_t kPaddingSlotId = -1;
// vLLM passes padding_token_id=0 to copy_and_expand_eagle_inputs_kernel for rejected slots.
constexpr int32_t kPaddingTokenId = 0;
// Source of an output hidden row: a target row index >= 0, or one of these.
constexpr int32_t kHiddenFromMask = -1;
constexpr int32_t kHiddenZero = -2;

// Everything that one output row needs, derived from its request. Both back ends call
// this, so they agree by construction; the tests check it against a reference written
// independently from vLLM's code.
struct DraftRow {
  int32_t input_id;
  int64_t position;
  bool is_rejected;
  bool is_masked;
  int64_t slot;
  int32_t sample_index;   // index into token_indices_to_sample, or -1 when not sampled
  int32_t mapped_input;   // the target row i whose hidden_state_mapping[i] is this row, or -1
  int32_t hidden_source;  // target row, kHiddenFromMask or kHiddenZero
};

// Output row `o` of request `r`. qs/qe: the request's input rows [qs, qe) (qe - qs >= 1);
// num_rejected in [0, qe - qs - 1]; out_start = qs + r * (K - 1). Input reads are guarded so
// that inconsistent metadata (unchecked on CUDA) never reads out of bounds.
template <typename LoadTokenFn, typename LoadBlockFn>
PEAGLE_HD DraftRow draft_row(int64_t o, int64_t r, int64_t qs, int64_t qe, int64_t num_rejected, int64_t start_position,
                             int32_t next_token, int64_t K, int64_t num_input_tokens, int32_t mask_token_id,
                             int64_t block_size, int64_t max_model_len, int64_t max_blocks, LoadTokenFn load_token,
                             LoadBlockFn load_block) {
  const int64_t len = qe - qs;
  const int64_t num_valid = len - 1 - num_rejected;  // shifted tokens copied from the input
  const int64_t j = o - (qs + r * (K - 1));          // offset inside the request's output
  DraftRow row;
  row.is_rejected = j >= num_valid + K;
  row.is_masked = j > num_valid && j < num_valid + K;
  const bool is_bonus = j == num_valid;

  // Token ids: shift by one (input j+1 at output j), then the bonus token, K-1 MASK tokens,
  // and padding token 0 in the rejected tail.
  if (j < num_valid) {
    const int64_t src = qs + 1 + j;
    row.input_id = (src >= 0 && src < num_input_tokens) ? load_token(src) : kPaddingTokenId;
  } else if (is_bonus) {
    row.input_id = next_token;
  } else if (row.is_masked) {
    row.input_id = mask_token_id;
  } else {
    row.input_id = kPaddingTokenId;
  }

  // Positions are not shifted: start_position + j; rejected slots are don't-care -> 0.
  row.position = row.is_rejected ? 0 : start_position + j;

  // Slot mapping as vLLM's compute_new_slot_mapping: block table lookup at the position
  // clamped to max_model_len - 1; PADDING_SLOT_ID for rejected slots and positions at or
  // past max_model_len. (A negative position only comes from bad input: padding too.)
  if (row.is_rejected || row.position >= max_model_len || row.position < 0) {
    row.slot = kPaddingSlotId;
  } else {
    int64_t block = row.position / block_size;        // position < max_model_len: clamp is a no-op
    if (block >= max_blocks) block = max_blocks - 1;  // guarded by a host check; memory safety
    row.slot = static_cast<int64_t>(load_block(r, block)) * block_size + row.position % block_size;
  }

  // Bonus + MASK slots are sampled: token_indices_to_sample[r*K + (j - num_valid)] = o.
  row.sample_index = (j >= num_valid && j < num_valid + K) ? static_cast<int32_t>(r * K + (j - num_valid)) : -1;

  // Hidden states are not shifted: target row qs+j -> output row o for every j < len
  // (rejected input rows included, as vLLM scatters all of them); MASK slots then get
  // mask_hidden. Output rows without a source (the rejected tail beyond len) are zero.
  const int64_t in_row = qs + j;
  const bool has_input = j < len && in_row >= 0 && in_row < num_input_tokens;
  row.mapped_input = has_input ? static_cast<int32_t>(in_row) : -1;
  row.hidden_source = row.is_masked ? kHiddenFromMask : (has_input ? static_cast<int32_t>(in_row) : kHiddenZero);
  return row;
}

// Largest r in [0, B-1] with out_start(r) = query_start_loc[r] + r*(K-1) <= o (binary search;
// stays in range whatever the contents).
template <typename LoadQslFn>
PEAGLE_HD int64_t find_request(int64_t o, int64_t B, int64_t K, LoadQslFn load_qsl) {
  int64_t lo = 0, hi = B - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (static_cast<int64_t>(load_qsl(mid)) + mid * (K - 1) <= o)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

struct ParallelDraftParams {
  // inputs
  const int32_t* target_token_ids;  // [T_in]
  const int64_t* target_positions;  // [T_in]
  const int32_t* next_token_ids;    // [B]
  const int32_t* query_start_loc;   // [B+1]
  const int32_t* num_rejected;      // [B] or nullptr (= all zero)
  const void* target_hidden;        // [T_in, H]
  const void* mask_hidden;          // [H]
  const int32_t* block_table;       // [>= B, max_blocks], row stride block_table_stride
  // outputs
  int32_t* input_ids;                // [T_out]
  int64_t* positions;                // [T_out]
  void* hidden;                      // [T_out, H]
  bool* is_rejected;                 // [T_out]
  bool* is_masked;                   // [T_out]
  int32_t* token_indices_to_sample;  // [B*K]
  int32_t* hidden_state_mapping;     // [T_in]
  int64_t* slot_mapping;             // [T_out]
  int32_t* out_query_start_loc;      // [B+1]
  // sizes
  int64_t num_input_tokens;    // T_in
  int64_t num_output_tokens;   // T_out = T_in + (K-1)*B
  int64_t batch_size;          // B
  int64_t num_spec_tokens;     // K >= 1
  int64_t hidden_row_bytes;    // H * element size
  int64_t block_table_stride;  // elements between block_table rows
  int64_t max_blocks;
  int64_t block_size;
  int64_t max_model_len;
  int32_t mask_token_id;
};

// The widest copy unit (16, 8, 4 or 2 bytes) that divides a hidden row and aligns the three
// hidden pointers; 0 if none (cannot happen for 2- and 4-byte element types).
inline int copy_unit_bytes(const ParallelDraftParams& p) {
  const int units[] = {16, 8, 4, 2};
  for (int w : units) {
    const bool ok = p.hidden_row_bytes % w == 0 && reinterpret_cast<uintptr_t>(p.target_hidden) % w == 0 &&
                    reinterpret_cast<uintptr_t>(p.mask_hidden) % w == 0 &&
                    reinterpret_cast<uintptr_t>(p.hidden) % w == 0;
    if (ok) return w;
  }
  return 0;
}

// One launch on `stream` (a cudaStream_t passed as void* so this header needs no CUDA
// include). Returns the cudaError_t of the launch as int (0 = success).
int launch_parallel_draft(const ParallelDraftParams& p, void* stream);

}  // namespace peagle::vllm
