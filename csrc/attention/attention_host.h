// Argument checks of the COD attention ops, shared by the CPU implementation and the CUDA glue.
// The Python wrapper validates first with messages naming the user's arguments; these are the
// second line for direct op calls (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE -> ValueError / TypeError).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "attention/attention_common.h"

namespace peagle::attention {

struct AttnShapes {
  int64_t T, N, Hq, Hkv, D, K;
  bool cross;
};

inline void check_metadata_inputs(const at::Tensor& anchor, const at::Tensor& depth, const at::Tensor& document_ids,
                                  at::IntArrayRef depth_offsets, bool cross, int64_t window, int64_t sink) {
  TORCH_CHECK_TYPE(
      anchor.scalar_type() == at::kInt && depth.scalar_type() == at::kInt && document_ids.scalar_type() == at::kInt,
      "cod_attention_metadata: anchor, depth and document_ids must be int32");
  TORCH_CHECK_VALUE(anchor.dim() == 1 && depth.dim() == 1 && anchor.size(0) == depth.size(0),
                    "cod_attention_metadata: anchor and depth must be 1-D of the same length, got ", anchor.sizes(),
                    " and ", depth.sizes());
  TORCH_CHECK_VALUE(document_ids.dim() == 1, "cod_attention_metadata: document_ids must be 1-D, got ",
                    document_ids.sizes());
  TORCH_CHECK_VALUE(anchor.is_contiguous() && depth.is_contiguous() && document_ids.is_contiguous(),
                    "cod_attention_metadata: anchor, depth and document_ids must be contiguous");
  TORCH_CHECK_VALUE(anchor.device() == depth.device() && anchor.device() == document_ids.device(),
                    "cod_attention_metadata: anchor, depth and document_ids must be on one device");
  const int64_t K = static_cast<int64_t>(depth_offsets.size()) - 1;
  TORCH_CHECK_VALUE(K >= 1 && K <= kMaxChain,
                    "cod_attention_metadata: depth_offsets must hold K+1 entries with 1 <= K <= ", kMaxChain, ", got ",
                    depth_offsets.size());
  TORCH_CHECK_VALUE(depth_offsets[0] == 0 && depth_offsets[K] == anchor.size(0),
                    "cod_attention_metadata: depth_offsets must run from 0 to T=", anchor.size(0));
  for (int64_t e = 0; e < K; ++e)
    TORCH_CHECK_VALUE(depth_offsets[e] <= depth_offsets[e + 1],
                      "cod_attention_metadata: depth_offsets must be nondecreasing");
  TORCH_CHECK_VALUE(cross || depth_offsets[1] == document_ids.size(0),
                    "cod_attention_metadata: symmetric mode needs the first N=", document_ids.size(0),
                    " layout tokens to be depth 0 (cod_sample depth0='all'), got ", depth_offsets[1]);
  TORCH_CHECK_VALUE(anchor.size(0) == 0 || document_ids.size(0) > 0,
                    "cod_attention_metadata: a layout with tokens needs N >= 1 positions");
  TORCH_CHECK_VALUE(window == -1 || window >= 1, "cod_attention_metadata: window must be >= 1 (or -1 for none), got ",
                    window);
  TORCH_CHECK_VALUE(sink >= 0, "cod_attention_metadata: sink must be >= 0, got ", sink);
  TORCH_CHECK_VALUE(document_ids.size(0) < (int64_t(1) << 31) - 2 && anchor.size(0) < (int64_t(1) << 31) - 2,
                    "cod_attention_metadata: N and T must fit in int32");
}

inline AttnShapes check_attention_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const std::optional<at::Tensor>& context_k,
                                         const std::optional<at::Tensor>& context_v, const at::Tensor& ranges,
                                         const at::Tensor& chains, at::IntArrayRef depth_offsets, bool cuda) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op, ": q, k, v must be 3-D [T, H, D]");
  AttnShapes s;
  s.T = q.size(0);
  s.Hq = q.size(1);
  s.D = q.size(2);
  s.Hkv = k.size(1);
  s.K = static_cast<int64_t>(depth_offsets.size()) - 1;
  s.cross = context_k.has_value();
  TORCH_CHECK_VALUE(context_k.has_value() == context_v.has_value(), op,
                    ": give both context_k and context_v or neither");
  TORCH_CHECK_VALUE(k.size(0) == s.T && v.size(0) == s.T, op, ": k and v must have T=", s.T, " rows");
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), op, ": v must have the shape of k ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK_VALUE(k.size(2) == s.D, op, ": k must have head dim ", s.D, ", got ", k.size(2));
  TORCH_CHECK_VALUE(s.Hkv >= 1 && s.Hq % s.Hkv == 0, op, ": q heads (", s.Hq, ") must be a multiple of kv heads (",
                    s.Hkv, ")");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                   ": q, k, v must have one dtype");
  TORCH_CHECK_VALUE(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), op, ": q, k, v must be contiguous");
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device() && ranges.device() == q.device() &&
                        chains.device() == q.device(),
                    op, ": all tensors must be on one device");
  TORCH_CHECK_VALUE(s.K >= 1 && s.K <= kMaxChain, op,
                    ": depth_offsets must hold K+1 entries with 1 <= K <= ", kMaxChain, ", got ", depth_offsets.size());
  TORCH_CHECK_VALUE(depth_offsets[0] == 0 && depth_offsets[s.K] == s.T, op,
                    ": depth_offsets must run from 0 to T=", s.T);
  for (int64_t e = 0; e < s.K; ++e)
    TORCH_CHECK_VALUE(depth_offsets[e] <= depth_offsets[e + 1], op, ": depth_offsets must be nondecreasing");
  TORCH_CHECK_VALUE(ranges.scalar_type() == at::kInt && ranges.dim() == 2 && ranges.size(0) == kNumRangeFields &&
                        ranges.size(1) == s.T && ranges.is_contiguous(),
                    op, ": ranges must be int32 [", int(kNumRangeFields), ", T] from cod_attention_metadata");
  TORCH_CHECK_VALUE(chains.scalar_type() == at::kInt && chains.dim() == 3 && chains.size(0) == 2 &&
                        chains.size(1) == s.T && chains.size(2) == s.K && chains.is_contiguous(),
                    op, ": chains must be int32 [2, T, K] from cod_attention_metadata");
  if (s.cross) {
    const at::Tensor& ck = *context_k;
    const at::Tensor& cv = *context_v;
    TORCH_CHECK_VALUE(ck.dim() == 3 && ck.size(1) == s.Hkv && ck.size(2) == s.D && cv.sizes() == ck.sizes(), op,
                      ": context_k/context_v must be [N, Hkv=", s.Hkv, ", D=", s.D, "]");
    TORCH_CHECK_TYPE(ck.scalar_type() == q.scalar_type() && cv.scalar_type() == q.scalar_type(), op,
                     ": context_k/context_v must have q's dtype");
    TORCH_CHECK_VALUE(ck.is_contiguous() && cv.is_contiguous(), op, ": context_k/context_v must be contiguous");
    TORCH_CHECK_VALUE(ck.device() == q.device() && cv.device() == q.device(), op,
                      ": context_k/context_v must be on q's device");
    s.N = ck.size(0);
  } else {
    s.N = depth_offsets[1];
  }
  if (cuda) {
    TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, op,
                     ": CUDA supports bfloat16 and float16, got ", q.scalar_type());
    TORCH_CHECK_VALUE(s.D == 64 || s.D == 128, op, ": CUDA supports head dim 64 and 128, got ", s.D);
  } else {
    TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble ||
                         q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                     op, ": CPU supports float32, float64, bfloat16 and float16, got ", q.scalar_type());
    TORCH_CHECK_VALUE(s.D >= 1, op, ": head dim must be >= 1");
  }
  return s;
}

// The contents of ranges / chains (CPU ops; on CUDA the kernels clamp instead, as checking costs a
// host sync): for every valid row the window range and (use_sink) the sink range inside [0, N],
// their bounds nondecreasing within each depth segment (the key-major backward binary-searches
// them), and every chain / reverse-chain entry -1 or a layout row in [0, T).
inline void check_metadata_contents(const char* op, const AttnShapes& s, const at::Tensor& ranges,
                                    const at::Tensor& chains, at::IntArrayRef depth_offsets, bool use_sink) {
  const int32_t* r = ranges.data_ptr<int32_t>();
  const int64_t T = s.T, N = s.N;
  const int32_t *lo = r + kLo * T, *hi = r + kHi * T, *slo = r + kSinkLo * T, *shi = r + kSinkHi * T;
  const int32_t* valid = r + kValid * T;
  for (int64_t e = 0; e < s.K; ++e) {
    for (int64_t i = depth_offsets[e]; i < depth_offsets[e + 1]; ++i) {
      if (valid[i]) {
        TORCH_CHECK_VALUE(lo[i] >= hi[i] || (lo[i] >= 0 && hi[i] <= N), op, ": ranges: window range [", lo[i], ", ",
                          hi[i], ") of row ", i, " is outside the N=", N, " keys (metadata of another layout?)");
        TORCH_CHECK_VALUE(!use_sink || slo[i] >= shi[i] || (slo[i] >= 0 && shi[i] <= N), op, ": ranges: sink range [",
                          slo[i], ", ", shi[i], ") of row ", i, " is outside the N=", N,
                          " keys (metadata of another layout?)");
      }
      if (i > depth_offsets[e])
        TORCH_CHECK_VALUE(lo[i] >= lo[i - 1] && hi[i] >= hi[i - 1] && slo[i] >= slo[i - 1] && shi[i] >= shi[i - 1], op,
                          ": ranges: bounds must be nondecreasing within a depth (row ", i,
                          "); build them with cod_attention_metadata");
    }
  }
  const int32_t* c = chains.data_ptr<int32_t>();
  for (int64_t x = 0; x < 2 * T * s.K; ++x)
    TORCH_CHECK_VALUE(c[x] >= -1 && c[x] < T, op, ": chains: entry ", c[x], " at ", (x < T * s.K ? "[0, " : "[1, "),
                      (x % (T * s.K)) / s.K, ", ", x % s.K, "] is outside [-1, T=", T, ")");
}

inline void check_backward_inputs(const AttnShapes& s, const at::Tensor& dout, const at::Tensor& out,
                                  const at::Tensor& lse) {
  TORCH_CHECK_VALUE(dout.dim() == 3 && dout.size(0) == s.T && dout.size(1) == s.Hq && dout.size(2) == s.D,
                    "cod_attention_bwd: grad_out must be [T, Hq, D]");
  TORCH_CHECK_VALUE(out.sizes() == dout.sizes(), "cod_attention_bwd: out must be [T, Hq, D]");
  TORCH_CHECK_VALUE((lse.scalar_type() == at::kFloat || lse.scalar_type() == at::kDouble) && lse.dim() == 2 &&
                        lse.size(0) == s.Hq && lse.size(1) == s.T,
                    "cod_attention_bwd: lse must be float32 (float64 for float64 inputs) [Hq, T]");
}

}  // namespace peagle::attention
