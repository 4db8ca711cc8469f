// Fused linear-KL / CE loss: the chunk loop shared by both back ends (fused_linear_kl_driver)
// and the CPU row kernel. The CUDA op (cuda/loss_glue.cpp) calls the same driver with its own
// row kernel, so both back ends run the same GEMMs, chunking and gradient accumulation.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "loss/loss_driver.h"

namespace peagle::loss {
namespace {

constexpr int64_t kMaxVocab = int64_t(1) << 30;  // the CUDA kernel indexes a row with int

bool is_low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// -1: not tried yet, 0: this torch refuses an fp32 `self` in addmm.dtype_out, 1: it accepts.
std::atomic<int> g_addmm_fp32_self{-1};

// acc[Vd, H] (fp32) += g_t[Vd, rows] @ x[rows, H] (fp16/bf16 operands, fp32 result).
// On CUDA, cuBLAS does it in one GEMM with an fp32 C (aten::addmm.dtype_out) where this torch
// allows an fp32 `self`. Otherwise the product goes out in column blocks of at most
// `block_cols` columns through a low-precision temporary that is added into acc: every block
// is rounded once (relative error of the chunk's own contribution, not of the running sum),
// and the temporary is no bigger than one logit chunk.
void accumulate_fp32(at::Tensor& acc, const at::Tensor& g_t, const at::Tensor& x, int64_t block_cols) {
  if (acc.is_cuda() && g_addmm_fp32_self.load() != 0) {
    try {
      at::_ops::addmm_dtype_out::call(acc, g_t, x, at::kFloat, 1, 1, acc);
      g_addmm_fp32_self.store(1);
      return;
    } catch (const c10::Error&) {
      if (g_addmm_fp32_self.load() == 1) throw;  // it worked before: a real error
      g_addmm_fp32_self.store(0);
    }
  }
  const int64_t h = x.size(1);
  for (int64_t c0 = 0; c0 < h; c0 += block_cols) {
    const int64_t cols = std::min(block_cols, h - c0);
    acc.narrow(1, c0, cols).add_(at::mm(g_t, x.narrow(1, c0, cols)));
  }
}

void check_inputs(const at::Tensor& draft_hidden, const at::Tensor& draft_head, const at::Tensor& target_hidden,
                  const at::Tensor& target_head, const at::Tensor& weight, const at::Tensor& depth,
                  const std::optional<at::Tensor>& d2t, int64_t num_depths, int64_t chunk_rows, c10::string_view kind) {
  TORCH_CHECK_VALUE(kind == "kl" || kind == "ce", "fused_linear_kl: kind must be 'kl' or 'ce', got '", kind, "'");
  TORCH_CHECK_VALUE(draft_hidden.dim() == 2, "fused_linear_kl: draft_hidden must be 2-D [T, H], got shape ",
                    draft_hidden.sizes());
  TORCH_CHECK_VALUE(draft_head.dim() == 2, "fused_linear_kl: draft_head must be 2-D [Vd, H], got shape ",
                    draft_head.sizes());
  TORCH_CHECK_VALUE(target_hidden.dim() == 2, "fused_linear_kl: target_hidden must be 2-D [T, H], got shape ",
                    target_hidden.sizes());
  TORCH_CHECK_VALUE(target_head.dim() == 2, "fused_linear_kl: target_head must be 2-D [V, H], got shape ",
                    target_head.sizes());
  const int64_t t = draft_hidden.size(0);
  TORCH_CHECK_VALUE(target_hidden.size(0) == t, "fused_linear_kl: target_hidden must have T = ", t,
                    " rows like draft_hidden, got shape ", target_hidden.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == t, "fused_linear_kl: weight must have shape [", t, "], got ",
                    weight.sizes());
  TORCH_CHECK_VALUE(depth.dim() == 1 && depth.size(0) == t, "fused_linear_kl: depth must have shape [", t, "], got ",
                    depth.sizes());
  TORCH_CHECK_VALUE(draft_head.size(1) == draft_hidden.size(1),
                    "fused_linear_kl: draft_head [Vd, H] must have H = ", draft_hidden.size(1),
                    " (draft_hidden's), got shape ", draft_head.sizes());
  TORCH_CHECK_VALUE(target_head.size(1) == target_hidden.size(1),
                    "fused_linear_kl: target_head [V, H] must have H = ", target_hidden.size(1),
                    " (target_hidden's), got shape ", target_head.sizes());
  const int64_t vd = draft_head.size(0);
  const int64_t v = target_head.size(0);
  TORCH_CHECK_VALUE(vd >= 1 && vd <= kMaxVocab, "fused_linear_kl: draft vocab size must be in [1, ", kMaxVocab,
                    "], got ", vd);
  TORCH_CHECK_VALUE(vd <= v, "fused_linear_kl: draft vocab (", vd, ") must not exceed the target vocab (", v, ")");

  const auto dtype = draft_hidden.scalar_type();
  TORCH_CHECK_TYPE(at::isFloatingType(dtype), "fused_linear_kl: draft_hidden must be floating point, got ", dtype);
  TORCH_CHECK_TYPE(
      draft_head.scalar_type() == dtype && target_hidden.scalar_type() == dtype && target_head.scalar_type() == dtype,
      "fused_linear_kl: draft_hidden, draft_head, target_hidden and target_head must share one dtype, "
      "got ",
      dtype, ", ", draft_head.scalar_type(), ", ", target_hidden.scalar_type(), ", ", target_head.scalar_type());
  const auto acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK_TYPE(weight.scalar_type() == acc, "fused_linear_kl: weight must be ", acc, " for ", dtype,
                   " inputs, got ", weight.scalar_type());
  TORCH_CHECK_TYPE(depth.scalar_type() == at::kInt, "fused_linear_kl: depth must be int32, got ", depth.scalar_type());
  TORCH_CHECK_VALUE(num_depths >= 1, "fused_linear_kl: num_depths must be >= 1, got ", num_depths);
  TORCH_CHECK_VALUE(chunk_rows >= 1, "fused_linear_kl: chunk_rows must be >= 1, got ", chunk_rows);

  const auto dev = draft_hidden.device();
  for (const at::Tensor* x : {&draft_head, &target_hidden, &target_head, &weight, &depth})
    TORCH_CHECK_VALUE(x->device() == dev, "fused_linear_kl: every tensor must be on ", dev, ", got one on ",
                      x->device());
  for (const at::Tensor* x : {&draft_hidden, &draft_head, &target_hidden, &target_head, &weight, &depth})
    TORCH_CHECK_VALUE(x->is_contiguous(), "fused_linear_kl: inputs must be contiguous");
  if (d2t.has_value()) {
    TORCH_CHECK_TYPE(d2t->scalar_type() == at::kLong, "fused_linear_kl: d2t must be int64, got ", d2t->scalar_type());
    TORCH_CHECK_VALUE(d2t->dim() == 1 && d2t->size(0) == vd, "fused_linear_kl: d2t must have shape [", vd,
                      "] (the draft vocab), got ", d2t->sizes());
    TORCH_CHECK_VALUE(d2t->device() == dev, "fused_linear_kl: d2t must be on ", dev, ", got ", d2t->device());
  } else {
    TORCH_CHECK_VALUE(vd == v, "fused_linear_kl: draft vocab (", vd, ") differs from the target vocab (", v,
                      "): pass d2t (draft id i -> target id i + d2t[i])");
  }
}

// ---- CPU row kernel -----------------------------------------------------------------------
template <typename scalar_t>
void rows_cpu_typed(RowsChunk& c) {
  using opmath_t = at::opmath_type<scalar_t>;  // double for double, float otherwise
  const int64_t rows = c.draft_logits.size(0);
  const int64_t vocab = c.draft_logits.size(1);
  scalar_t* draft = c.draft_logits.data_ptr<scalar_t>();
  const scalar_t* target = c.target_logits.const_data_ptr<scalar_t>();
  const opmath_t* weight = c.weight.const_data_ptr<opmath_t>();
  const int32_t* depth = c.depth.const_data_ptr<int32_t>();
  opmath_t* row_loss = c.row_loss.data_ptr<opmath_t>();
  const bool ce = c.ce;
  const bool write_grad = c.write_grad;
  // -1: row not counted; else 1 when the two argmaxes agree. Counted serially below.
  std::vector<int8_t> agree(static_cast<size_t>(rows), -1);

  // Rows are independent; a task gets at least ~64K logits so small chunks run inline.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* d = draft + r * vocab;
      const scalar_t* t = target + r * vocab;
      const opmath_t w = weight[r];
      if (w == opmath_t(0)) {
        if (write_grad) std::fill(d, d + vocab, scalar_t(0));
        row_loss[r] = 0;
        continue;
      }
      // pass 1: max, first argmax and sum of exp of both rows
      opmath_t md = -std::numeric_limits<opmath_t>::infinity(), mt = md;
      int64_t id = 0, it = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        const opmath_t xd = static_cast<opmath_t>(d[v]);
        const opmath_t xt = static_cast<opmath_t>(t[v]);
        if (xd > md) md = xd, id = v;
        if (xt > mt) mt = xt, it = v;
      }
      double sd = 0.0, st = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        sd += std::exp(static_cast<opmath_t>(d[v]) - md);
        if (!ce) st += std::exp(static_cast<opmath_t>(t[v]) - mt);
      }
      const opmath_t lse_d = md + static_cast<opmath_t>(std::log(sd));
      const opmath_t lse_t = ce ? opmath_t(0) : mt + static_cast<opmath_t>(std::log(st));
      // pass 2: loss and w * dloss/dlogit in place (each element read before it is written)
      double loss = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        const opmath_t lq = static_cast<opmath_t>(d[v]) - lse_d;
        const opmath_t q = std::exp(lq);
        opmath_t g;
        if (ce) {
          const bool hit = v == it;
          if (hit) loss -= lq;
          g = q - (hit ? opmath_t(1) : opmath_t(0));
        } else {
          const opmath_t lp = static_cast<opmath_t>(t[v]) - lse_t;
          const opmath_t p = std::exp(lp);
          loss += p * (lp - lq);
          g = q - p;
        }
        if (write_grad) d[v] = static_cast<scalar_t>(w * g);
      }
      row_loss[r] = w * static_cast<opmath_t>(loss);
      const int32_t dep = depth[r];
      if (w > opmath_t(0) && dep >= 0 && dep < c.num_depths) agree[r] = id == it ? 1 : 0;
    }
  });
  int64_t* correct = c.correct.data_ptr<int64_t>();
  int64_t* total = c.total.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    if (agree[r] < 0) continue;
    total[depth[r]] += 1;
    correct[depth[r]] += agree[r];
  }
}

void rows_cpu(RowsChunk& c) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.draft_logits.scalar_type(), "fused_linear_kl_cpu",
                                  [&] { rows_cpu_typed<scalar_t>(c); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_kl_cpu(
    const at::Tensor& draft_hidden, const at::Tensor& draft_head, const at::Tensor& target_hidden,
    const at::Tensor& target_head, const at::Tensor& weight, const at::Tensor& depth,
    const std::optional<at::Tensor>& d2t, int64_t num_depths, int64_t chunk_rows, c10::string_view kind,
    bool compute_grad_hidden, bool compute_grad_head) {
  return fused_linear_kl_driver(draft_hidden, draft_head, target_hidden, target_head, weight, depth, d2t, num_depths,
                                chunk_rows, kind, compute_grad_hidden, compute_grad_head, rows_cpu);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_kl_driver(
    const at::Tensor& draft_hidden, const at::Tensor& draft_head, const at::Tensor& target_hidden,
    const at::Tensor& target_head, const at::Tensor& weight, const at::Tensor& depth,
    const std::optional<at::Tensor>& d2t, int64_t num_depths, int64_t chunk_rows, c10::string_view kind,
    bool compute_grad_hidden, bool compute_grad_head, const RowsFn& rows_fn) {
  check_inputs(draft_hidden, draft_head, target_hidden, target_head, weight, depth, d2t, num_depths, chunk_rows, kind);
  const int64_t t = draft_hidden.size(0);
  const int64_t vd = draft_head.size(0);
  const int64_t v = target_head.size(0);
  const auto dtype = draft_hidden.scalar_type();
  const auto long_opts = depth.options().dtype(at::kLong);

  // The target distribution lives on the draft vocab: row i of the target head used here is the
  // verifier's row i + d2t[i]. Gathering the Vd rows once makes the target GEMM Vd wide, not V.
  at::Tensor target_rows = target_head;
  if (d2t.has_value()) {
    const at::Tensor ids = at::arange(vd, long_opts).add(*d2t);
    const at::Tensor range = at::stack({ids.min(), ids.max()}).cpu();  // one host sync
    const int64_t lo = range[0].item<int64_t>();
    const int64_t hi = range[1].item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0 && hi < v, "fused_linear_kl: d2t maps draft ids outside the target vocab [0, ", v,
                      "): i + d2t[i] ranges over [", lo, ", ", hi, "]");
    target_rows = target_head.index_select(0, ids);
  }

  const at::Tensor wsum = weight.sum();
  // 1 / sum(weight), or 0 when the weights sum to 0 (then every row has weight 0: loss 0).
  const at::Tensor inv_wsum = at::where(wsum.gt(0), wsum.reciprocal(), at::zeros_like(wsum));
  at::Tensor row_loss = at::zeros({t}, weight.options());
  at::Tensor correct = at::zeros({num_depths}, long_opts);
  at::Tensor total = at::zeros({num_depths}, long_opts);
  at::Tensor grad_hidden = compute_grad_hidden ? at::empty_like(draft_hidden) : at::empty({0}, draft_hidden.options());
  at::Tensor grad_head;

  const int64_t rows_per_chunk = std::max<int64_t>(1, std::min(chunk_rows, t));
  const int64_t num_chunks = t == 0 ? 0 : (t + rows_per_chunk - 1) / rows_per_chunk;
  // fp16/bf16 head gradients summed over several chunks accumulate in fp32 (one rounding at
  // the end instead of one per chunk); a single chunk is one GEMM in the input dtype.
  const bool head_acc_fp32 = compute_grad_head && is_low_precision(dtype) && num_chunks > 1;
  at::Tensor head_acc;
  if (compute_grad_head) {
    if (head_acc_fp32)
      head_acc = at::zeros(draft_head.sizes(), draft_head.options().dtype(at::kFloat));
    else if (num_chunks == 0)
      head_acc = at::zeros_like(draft_head);
    else
      head_acc = at::empty_like(draft_head);
  }

  const bool write_grad = compute_grad_hidden || compute_grad_head;
  {
    // The two [rows, Vd] logit buffers: the only vocab-sized memory of the op.
    at::Tensor draft_buf = at::empty({rows_per_chunk, vd}, draft_hidden.options());
    at::Tensor target_buf = at::empty({rows_per_chunk, vd}, draft_hidden.options());
    const at::Tensor draft_head_t = draft_head.t();
    const at::Tensor target_rows_t = target_rows.t();
    RowsChunk chunk;
    chunk.correct = correct;
    chunk.total = total;
    chunk.num_depths = num_depths;
    chunk.ce = kind == "ce";
    chunk.write_grad = write_grad;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t r0 = c * rows_per_chunk;
      const int64_t rows = std::min(rows_per_chunk, t - r0);
      const at::Tensor xd = draft_hidden.narrow(0, r0, rows);
      at::Tensor dl = draft_buf.narrow(0, 0, rows);
      at::Tensor tl = target_buf.narrow(0, 0, rows);
      at::mm_out(dl, xd, draft_head_t);
      at::mm_out(tl, target_hidden.narrow(0, r0, rows), target_rows_t);
      chunk.draft_logits = dl;
      chunk.target_logits = tl;
      chunk.weight = weight.narrow(0, r0, rows);
      chunk.depth = depth.narrow(0, r0, rows);
      chunk.row_loss = row_loss.narrow(0, r0, rows);
      rows_fn(chunk);
      // dl now holds weight * dloss/dlogits of these rows.
      if (compute_grad_hidden) {
        at::Tensor gx = grad_hidden.narrow(0, r0, rows);
        at::mm_out(gx, dl, draft_head);
      }
      if (compute_grad_head) {
        if (head_acc_fp32)
          accumulate_fp32(head_acc, dl.t(), xd, std::max<int64_t>(rows_per_chunk, 256));
        else if (c == 0)
          at::mm_out(head_acc, dl.t(), xd);
        else
          head_acc.addmm_(dl.t(), xd);
      }
    }
  }  // logit buffers (and the gathered target rows below) are released before the final scaling
  target_rows = at::Tensor();

  if (compute_grad_hidden) grad_hidden.mul_(inv_wsum);
  if (compute_grad_head) {
    if (head_acc_fp32) {
      grad_head = at::empty_like(draft_head);
      at::mul_out(grad_head, head_acc, inv_wsum);
      head_acc = at::Tensor();
    } else {
      grad_head = head_acc.mul_(inv_wsum);
    }
  } else {
    grad_head = at::empty({0}, draft_head.options());
  }
  at::Tensor loss = row_loss.sum().mul(inv_wsum);
  return {loss, correct, total, grad_hidden, grad_head};
}

}  // namespace peagle::loss

TORCH_LIBRARY_IMPL(peagle, CPU, m) { m.impl("fused_linear_kl", &peagle::loss::fused_linear_kl_cpu); }
