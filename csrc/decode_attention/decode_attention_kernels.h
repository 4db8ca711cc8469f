// Decode attention over a KV cache: one query token per row, each row attending its own run of
// key rows (serving/cache_attention.py: a verify round's tokens, the drafter's rows). The
// planner and launcher of the CUDA kernel and what it supports. Plain C++, no torch: the .cu
// file includes this and is compiled by nvcc without any torch header.
#pragma once
#include <cstdint>

namespace peagle::decode_attention {

// Query heads that share one KV head, at most, in the CUDA kernel (their queries sit in shared
// memory and their accumulators in registers).
constexpr int64_t kMaxGroup = 8;

// Key rows one block reads per step (its loads are all issued before any is used).
constexpr int64_t kKeyTile = 64;

// Query t, head h reads key rows key_start[t] .. key_start[t] + key_count[t] - 1 of KV head
// h / (num_heads / num_kv_heads). Strides in elements; every row's head_dim elements are
// contiguous. out is [num_queries, num_heads, head_dim], contiguous.
struct DecodeAttnParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int32_t* key_start;
  const int32_t* key_count;
  int64_t num_queries;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t num_key_rows;  // rows of k and v: the kernel clamps every run to them
  int64_t q_stride_t, q_stride_h;
  int64_t k_stride_s, k_stride_h;
  int64_t v_stride_s, v_stride_h;
  float scale;
  // Set by plan_decode_attention: a run is cut into num_splits pieces of keys_per_split rows,
  // one block each. With num_splits > 1 each block leaves fp32 partials (max, sum, weighted
  // values) in `workspace` and the last block of a (token, KV head) to finish combines them.
  int64_t num_splits;
  int64_t keys_per_split;
  void* workspace;  // plan_decode_attention's bytes, 16-byte aligned; null when it says 0
};

enum class DecodeDType { kHalf, kBFloat16 };

// The head dims the CUDA kernel is instantiated for.
inline bool cuda_head_dim_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

// Splits the key rows so that the grid fills `sm_count` multiprocessors a few blocks deep; sets
// num_splits and keys_per_split and returns the workspace bytes the launch needs (0: none).
int64_t plan_decode_attention(DecodeAttnParams& p, int sm_count);

// Returns a cudaError_t value (0 = success). p is planned (plan_decode_attention) and has its
// workspace.
int launch_decode_attention(const DecodeAttnParams& p, DecodeDType dtype, void* stream);

}  // namespace peagle::decode_attention
