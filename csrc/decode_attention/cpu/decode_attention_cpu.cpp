// decode_attention on the CPU, plus the checks shared with the CUDA glue. Query t, head h:
// softmax(scale * q[t, h] . k[s, h / G]) over its run s = key_start[t] .. + key_count[t] - 1,
// times v, accumulated in float (double for float64 inputs); a run of no keys gives 0. The CPU
// op also checks the runs' VALUES against the key rows (free here; the CUDA op cannot without a
// host sync and clamps them instead).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode_attention/decode_attention.h"

namespace peagle::decode_attention {
namespace {

constexpr const char* kOp = "decode_attention: ";

void check_index(const at::Tensor& t, const char* name, int64_t n, const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, kOp, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, kOp, name, " must have shape [", n,
                    "] (one entry per query token), got ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), kOp, name, " must be contiguous");
  TORCH_CHECK_VALUE(t.device() == device, kOp, name, " must be on ", device, " (the device of q), got ", t.device());
}

}  // namespace

void check_decode_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& key_start, const at::Tensor& key_count, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3, kOp, "q must be [tokens, heads, head_dim], got shape ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 3, kOp, "k must be [key rows, kv heads, head_dim], got shape ", k.sizes());
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), kOp, "v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), kOp,
                   "q, k and v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
                   v.scalar_type());
  TORCH_CHECK_TYPE(at::isFloatingType(q.scalar_type()), kOp, "q must be floating point, got ", q.scalar_type());
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), kOp, "k and v must be on ", q.device(),
                    " (the device of q), got ", k.device(), " and ", v.device());
  const int64_t heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TORCH_CHECK_VALUE(k.size(2) == d, kOp, "k's head_dim ", k.size(2), " must equal q's ", d);
  TORCH_CHECK_VALUE(kv_heads > 0 && heads % kv_heads == 0, kOp, "q's heads (", heads,
                    ") must be a multiple of k's kv heads (", kv_heads, ")");
  TORCH_CHECK_VALUE(d > 0, kOp, "head_dim must be > 0");
  TORCH_CHECK_VALUE(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, kOp,
                    "q, k and v must each have contiguous rows (stride 1 in the last dim)");
  TORCH_CHECK_VALUE(std::isfinite(scale), kOp, "scale must be finite, got ", scale);
  check_index(key_start, "key_start", q.size(0), q.device());
  check_index(key_count, "key_count", q.size(0), q.device());
  if (q.is_cuda()) {
    TORCH_CHECK_TYPE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, kOp,
                     "on CUDA q, k and v must be float16 or bfloat16, got ", q.scalar_type());
    TORCH_CHECK_VALUE(cuda_head_dim_supported(d), kOp, "on CUDA head_dim must be 64 or 128, got ", d);
    TORCH_CHECK_VALUE(heads / kv_heads <= kMaxGroup, kOp, "on CUDA at most ", kMaxGroup,
                      " query heads may share a kv head, got ", heads / kv_heads);
    TORCH_CHECK_VALUE(k.size(1) <= 65535, kOp, "at most 65535 kv heads on CUDA");
    // the kernel reads k and v in 16-byte units
    const auto aligned = [](const at::Tensor& t) {
      return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0;
    };
    TORCH_CHECK_VALUE(aligned(k), kOp, "k must be 16-byte aligned, with row and head strides multiples of 8");
    TORCH_CHECK_VALUE(aligned(v), kOp, "v must be 16-byte aligned, with row and head strides multiples of 8");
  }
}

DecodeAttnParams make_decode_attention_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& key_start, const at::Tensor& key_count, double scale,
                                              at::Tensor& out) {
  DecodeAttnParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.key_start = key_start.data_ptr<int32_t>();
  p.key_count = key_count.data_ptr<int32_t>();
  p.num_queries = q.size(0);
  p.num_heads = q.size(1);
  p.num_kv_heads = k.size(1);
  p.head_dim = q.size(2);
  p.num_key_rows = k.size(0);
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_stride_s = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.v_stride_s = v.stride(0);
  p.v_stride_h = v.stride(1);
  p.scale = static_cast<float>(scale);
  return p;
}

namespace {

// scale as given (double): the params' float copy is the CUDA kernel's
template <typename T>
void decode_attention_rows(const DecodeAttnParams& p, double scale) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const auto* q = static_cast<const T*>(p.q);
  const auto* k = static_cast<const T*>(p.k);
  const auto* v = static_cast<const T*>(p.v);
  auto* out = static_cast<T*>(p.out);
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim;
  std::vector<Acc> score, acc(static_cast<size_t>(d));
  for (const auto t : c10::irange(p.num_queries)) {
    const int64_t start = p.key_start[t], n = p.key_count[t];
    score.assign(static_cast<size_t>(n), Acc(0));
    for (const auto h : c10::irange(p.num_heads)) {
      const T* qh = q + t * p.q_stride_t + h * p.q_stride_h;
      const int64_t hk = h / group;
      Acc mx = -std::numeric_limits<Acc>::infinity();
      for (const auto j : c10::irange(n)) {
        const T* kr = k + (start + j) * p.k_stride_s + hk * p.k_stride_h;
        Acc s = 0;
        for (const auto e : c10::irange(d)) s += static_cast<Acc>(qh[e]) * static_cast<Acc>(kr[e]);
        score[j] = s * static_cast<Acc>(scale);
        mx = std::max(mx, score[j]);
      }
      std::fill(acc.begin(), acc.end(), Acc(0));
      Acc den = 0;
      for (const auto j : c10::irange(n)) {
        const Acc w = std::exp(score[j] - mx);
        den += w;
        const T* vr = v + (start + j) * p.v_stride_s + hk * p.v_stride_h;
        for (const auto e : c10::irange(d)) acc[e] += w * static_cast<Acc>(vr[e]);
      }
      T* o = out + (t * p.num_heads + h) * d;
      for (const auto e : c10::irange(d)) o[e] = static_cast<T>(den > 0 ? acc[e] / den : Acc(0));
    }
  }
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& key_start, const at::Tensor& key_count, double scale) {
  TORCH_CHECK_VALUE(q.device().is_cpu(), kOp, "the CPU op got q on ", q.device());
  check_decode_attention_inputs(q, k, v, key_start, key_count, scale);
  const int64_t rows = k.size(0);
  const int32_t* st = key_start.data_ptr<int32_t>();
  const int32_t* ct = key_count.data_ptr<int32_t>();
  for (const auto t : c10::irange(q.size(0))) {
    TORCH_CHECK_VALUE(st[t] >= 0 && ct[t] >= 0 && static_cast<int64_t>(st[t]) + ct[t] <= rows, kOp, "query ", t,
                      " reads key rows [", st[t], ", ", static_cast<int64_t>(st[t]) + ct[t],
                      ") (key_start, key_count), outside the ", rows, " rows of k");
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const DecodeAttnParams p = make_decode_attention_params(q, k, v, key_start, key_count, scale, out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "decode_attention_cpu",
                                  [&] { decode_attention_rows<scalar_t>(p, scale); });
  return out;
}

}  // namespace
}  // namespace peagle::decode_attention

TORCH_LIBRARY_IMPL(peagle, CPU, m) { m.impl("decode_attention", &peagle::decode_attention::decode_attention_cpu); }
