// Fused linear-KL / CE loss: the argument checks, the row plan and the chunk loop shared by both
// back ends (loss_driver.h). The CPU op (loss_cpu.cpp) and the CUDA op (cuda/loss_glue.cpp)
// call fused_linear_kl_driver with their own row kernels, so both run the same GEMMs, chunking
// and gradient accumulation.
#include "loss/loss_driver.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

namespace peagle::loss {
namespace {

constexpr int64_t kMaxVocab = int64_t(1) << 30;  // the CUDA kernels index a row with int
constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();

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
                  const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& target_index,
                  int64_t num_depths, int64_t chunk_rows, c10::string_view kind) {
  TORCH_CHECK_VALUE(kind == "kl" || kind == "ce", "fused_linear_kl: kind must be 'kl' or 'ce', got '", kind, "'");
  TORCH_CHECK_VALUE(draft_hidden.dim() == 2, "fused_linear_kl: draft_hidden must be 2-D [T, H], got shape ",
                    draft_hidden.sizes());
  TORCH_CHECK_VALUE(draft_head.dim() == 2, "fused_linear_kl: draft_head must be 2-D [Vd, H], got shape ",
                    draft_head.sizes());
  TORCH_CHECK_VALUE(target_hidden.dim() == 2, "fused_linear_kl: target_hidden must be 2-D [M, H], got shape ",
                    target_hidden.sizes());
  TORCH_CHECK_VALUE(target_head.dim() == 2, "fused_linear_kl: target_head must be 2-D [V, H], got shape ",
                    target_head.sizes());
  const int64_t t = draft_hidden.size(0);
  TORCH_CHECK_VALUE(t <= kMaxRows && target_hidden.size(0) <= kMaxRows, "fused_linear_kl: at most ", kMaxRows,
                    " rows per side, got ", t, " draft and ", target_hidden.size(0), " target rows");
  if (target_index.has_value()) {
    TORCH_CHECK_TYPE(target_index->scalar_type() == at::kLong, "fused_linear_kl: target_index must be int64, got ",
                     target_index->scalar_type());
    TORCH_CHECK_VALUE(target_index->dim() == 1 && target_index->size(0) == t,
                      "fused_linear_kl: target_index must have shape [", t, "] (T of draft_hidden), got ",
                      target_index->sizes());
  } else {
    TORCH_CHECK_VALUE(target_hidden.size(0) == t, "fused_linear_kl: target_hidden must have T = ", t,
                      " rows like draft_hidden when no target_index is given, got shape ", target_hidden.sizes());
  }
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
  if (target_index.has_value()) {
    TORCH_CHECK_VALUE(target_index->device() == dev, "fused_linear_kl: target_index must be on ", dev, ", got ",
                      target_index->device());
  }
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

// A chunk: target rows [m0, m1) of the plan's distinct target rows and grouped draft rows
// [s0, s1); draft_first / target_first: the first original row when the chunk's rows are
// consecutive rows of the input (then the GEMMs read the input in place), else -1.
struct Chunk {
  int64_t m0, m1, s0, s1;
  int64_t draft_first, target_first;
};

// Which rows the op computes and in which order: the rows of weight > 0, grouped by target row
// (stable: a group keeps the input order), and the distinct target rows they use, ascending.
struct Plan {
  int64_t num_rows = 0;     // grouped draft rows (weight > 0)
  int64_t num_targets = 0;  // distinct target rows they use
  at::Tensor order;         // [num_rows] int64: input row of each grouped row
  at::Tensor slot;          // [num_rows] int64: index of its target row among the distinct ones
  at::Tensor target_rows;   // [num_targets] int64: input target row of each distinct one
  bool identity = false;    // order is 0..T-1
  int64_t max_draft_rows = 0;
  int64_t max_target_rows = 0;
  bool gather_draft = false;  // some chunk's draft rows are not consecutive input rows
  bool gather_target = false;
  std::vector<Chunk> chunks;
};

int64_t consecutive_from(const int64_t* ids, int64_t n) {
  for (int64_t i = 1; i < n; ++i)
    if (ids[i] != ids[0] + i) return -1;
  return n ? ids[0] : -1;
}

// One device-to-host copy of the row keys (the op's only host sync besides the d2t check), a
// stable counting sort by target row on the host, and the chunk cut: a chunk holds at most
// `rows` target rows and `rows` draft rows; a target row with more than `rows` draft rows gets
// chunks of its own that share its logits.
//
// The device idles from the sync until the first chunk's kernels are queued, so the host work in
// between is kept short. Fresh buffers of a few megabytes would cost first-touch page faults,
// about twice the sort's own loops at 83K rows, so the keys and the plan go through pinned memory
// from the caching host allocator, which reuses its blocks (and the plan's upload is queued, not
// waited for), and the scratch arrays are thread-local and reused between calls.
Plan make_plan(const at::Tensor& weight, const std::optional<at::Tensor>& target_index, int64_t num_targets,
               int64_t rows) {
  const int64_t t = weight.size(0);
  const bool on_host = weight.is_cpu();
  const auto long_opts = weight.options().dtype(at::kLong);
  const at::Tensor active = weight.gt(0);
  at::Tensor key;
  if (target_index.has_value()) {
    const at::Tensor& ti = *target_index;
    const at::Tensor in_range = ti.ge(0).logical_and(ti.lt(num_targets));
    key = at::where(active, at::where(in_range, ti, -2), -1);
  } else {
    key = at::where(active, at::arange(t, long_opts), -1);
  }
  const auto host_opts = [&](at::ScalarType dtype) { return at::TensorOptions().dtype(dtype).pinned_memory(!on_host); };
  at::Tensor key_h = key.to(at::kInt);
  if (!on_host) key_h = at::empty({t}, host_opts(at::kInt)).copy_(key_h);
  key_h = key_h.contiguous();
  const int32_t* k = key_h.const_data_ptr<int32_t>();

  thread_local std::vector<int64_t> count, rank, targets, start, fill;
  count.assign(static_cast<size_t>(num_targets), 0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK_VALUE(k[i] != -2, "fused_linear_kl: target_index[", i, "] is outside [0, ", num_targets,
                      ") (the rows of target_hidden) at a row of weight > 0");
    if (k[i] >= 0) ++count[static_cast<size_t>(k[i])];
  }
  rank.assign(static_cast<size_t>(num_targets), -1);
  targets.resize(static_cast<size_t>(num_targets));
  start.resize(static_cast<size_t>(num_targets) + 1);
  int64_t nt = 0;
  start[0] = 0;
  for (int64_t m = 0; m < num_targets; ++m) {
    if (count[m] == 0) continue;
    rank[m] = nt;
    targets[nt] = m;
    start[nt + 1] = start[nt] + count[m];
    ++nt;
  }
  Plan p;
  p.num_targets = nt;
  p.num_rows = start[nt];
  // host layout of the plan: order [num_rows], slot [num_rows], target rows [num_targets]
  at::Tensor plan_h = at::empty({2 * p.num_rows + p.num_targets}, host_opts(at::kLong));
  int64_t* order = plan_h.data_ptr<int64_t>();
  int64_t* slot = order + p.num_rows;
  std::copy(targets.begin(), targets.begin() + nt, slot + p.num_rows);
  fill.assign(start.begin(), start.begin() + nt);
  for (int64_t i = 0; i < t; ++i) {
    if (k[i] < 0) continue;
    const int64_t r = rank[static_cast<size_t>(k[i])];
    const int64_t j = fill[static_cast<size_t>(r)]++;
    order[j] = i;
    slot[j] = r;
  }
  p.identity = p.num_rows == t && consecutive_from(order, t) == 0;

  auto add = [&](int64_t m0, int64_t m1, int64_t s0, int64_t s1) {
    const int64_t df = consecutive_from(order + s0, s1 - s0);
    const int64_t tf = consecutive_from(targets.data() + m0, m1 - m0);
    p.chunks.push_back({m0, m1, s0, s1, df, tf});
    p.max_draft_rows = std::max(p.max_draft_rows, s1 - s0);
    p.max_target_rows = std::max(p.max_target_rows, m1 - m0);
    p.gather_draft |= df < 0;
    p.gather_target |= tf < 0;
  };
  for (int64_t i = 0; i < p.num_targets;) {
    if (start[i + 1] - start[i] > rows) {
      for (int64_t s = start[i]; s < start[i + 1]; s += rows) add(i, i + 1, s, std::min(s + rows, start[i + 1]));
      ++i;
      continue;
    }
    int64_t j = i;
    while (j < p.num_targets && j - i < rows && start[j + 1] - start[i] <= rows) ++j;
    add(i, j, start[i], start[j]);
    i = j;
  }

  // pinned source: the copy is queued on the stream and the caching host allocator keeps the
  // buffer until it has run
  const at::Tensor plan_d =
      on_host ? plan_h : plan_h.to(at::TensorOptions().dtype(at::kLong).device(weight.device()), /*non_blocking=*/true);
  p.order = plan_d.narrow(0, 0, p.num_rows);
  p.slot = plan_d.narrow(0, p.num_rows, p.num_rows);
  p.target_rows = plan_d.narrow(0, 2 * p.num_rows, p.num_targets);
  return p;
}

// rows [first, first + n) of x when the chunk's rows are consecutive, else x[ids] gathered
// into buf.
at::Tensor chunk_rows_of(const at::Tensor& x, int64_t first, const at::Tensor& ids, at::Tensor& buf) {
  const int64_t n = ids.size(0);
  if (first >= 0) return x.narrow(0, first, n);
  at::Tensor out = buf.narrow(0, 0, n);
  at::index_select_out(out, x, 0, ids);
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_kl_driver(
    const at::Tensor& draft_hidden, const at::Tensor& draft_head, const at::Tensor& target_hidden,
    const at::Tensor& target_head, const at::Tensor& weight, const at::Tensor& depth,
    const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& target_index, int64_t num_depths,
    int64_t chunk_rows, c10::string_view kind, bool compute_grad_hidden, bool compute_grad_head,
    const RowKernels& kernels) {
  check_inputs(draft_hidden, draft_head, target_hidden, target_head, weight, depth, d2t, target_index, num_depths,
               chunk_rows, kind);
  const int64_t t = draft_hidden.size(0);
  const int64_t vd = draft_head.size(0);
  const int64_t v = target_head.size(0);
  const auto dtype = draft_hidden.scalar_type();
  const auto long_opts = depth.options().dtype(at::kLong);

  // The target distribution lives on the draft vocab: row i of the target head used here is the
  // verifier's row i + d2t[i]. Gathering the Vd rows once makes the target GEMM Vd wide, not V.
  at::Tensor target_head_rows = target_head;
  if (d2t.has_value()) {
    const at::Tensor ids = at::arange(vd, long_opts).add(*d2t);
    const at::Tensor range = at::stack({ids.min(), ids.max()}).cpu();  // one host sync
    const int64_t lo = range[0].item<int64_t>();
    const int64_t hi = range[1].item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0 && hi < v, "fused_linear_kl: d2t maps draft ids outside the target vocab [0, ", v,
                      "): i + d2t[i] ranges over [", lo, ", ", hi, "]");
    target_head_rows = target_head.index_select(0, ids);
  }

  const int64_t rows_per_chunk = std::max<int64_t>(1, std::min(chunk_rows, t));
  Plan plan = make_plan(weight, target_index, target_hidden.size(0), rows_per_chunk);
  const int64_t num_chunks = static_cast<int64_t>(plan.chunks.size());

  const at::Tensor wsum = weight.sum();
  // 1 / sum(weight), or 0 when the weights sum to 0 (then no row is planned: loss 0).
  const at::Tensor inv_wsum = at::where(wsum.gt(0), wsum.reciprocal(), at::zeros_like(wsum));
  // weight, depth and loss of the grouped rows
  const at::Tensor w_rows = plan.identity ? weight : weight.index_select(0, plan.order);
  const at::Tensor d_rows = plan.identity ? depth : depth.index_select(0, plan.order);
  at::Tensor row_loss = at::zeros({plan.num_rows}, weight.options());
  at::Tensor correct = at::zeros({num_depths}, long_opts);
  at::Tensor total = at::zeros({num_depths}, long_opts);
  // rows of weight 0 are never computed: their gradient is 0
  at::Tensor grad_hidden = !compute_grad_hidden ? at::empty({0}, draft_hidden.options())
                           : plan.num_rows == t ? at::empty_like(draft_hidden)
                                                : at::zeros_like(draft_hidden);
  at::Tensor grad_head;

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
    // The two logit buffers: the only vocab-sized memory of the op.
    const int64_t dr = plan.max_draft_rows;
    const int64_t tr = plan.max_target_rows;
    at::Tensor draft_buf = at::empty({dr, vd}, draft_hidden.options());
    at::Tensor target_buf = at::empty({tr, vd}, draft_hidden.options());
    at::Tensor target_lse = at::empty({tr}, weight.options());
    at::Tensor target_argmax = at::empty({tr}, depth.options());
    // gathered rows of chunks whose rows are not consecutive input rows
    at::Tensor xd_buf =
        plan.gather_draft ? at::empty({dr, draft_hidden.size(1)}, draft_hidden.options()) : at::Tensor();
    at::Tensor gx_buf = plan.gather_draft && compute_grad_hidden ? at::empty_like(xd_buf) : at::Tensor();
    at::Tensor xt_buf =
        plan.gather_target ? at::empty({tr, target_hidden.size(1)}, target_hidden.options()) : at::Tensor();
    const at::Tensor draft_head_t = draft_head.t();
    const at::Tensor target_head_t = target_head_rows.t();
    TargetChunk tc;
    tc.ce = kind == "ce";
    DraftChunk dc;
    dc.correct = correct;
    dc.total = total;
    dc.num_depths = num_depths;
    dc.ce = tc.ce;
    dc.write_grad = write_grad;
    int64_t held_m0 = -1, held_m1 = -1;  // the target rows whose logits target_buf holds
    for (int64_t c = 0; c < num_chunks; ++c) {
      const Chunk& ch = plan.chunks[c];
      const int64_t rows = ch.s1 - ch.s0;
      const int64_t trows = ch.m1 - ch.m0;
      if (ch.m0 != held_m0 || ch.m1 != held_m1) {
        const at::Tensor xt =
            chunk_rows_of(target_hidden, ch.target_first, plan.target_rows.narrow(0, ch.m0, trows), xt_buf);
        tc.logits = target_buf.narrow(0, 0, trows);
        at::mm_out(tc.logits, xt, target_head_t);
        tc.lse = target_lse.narrow(0, 0, trows);
        tc.argmax = target_argmax.narrow(0, 0, trows);
        kernels.target_stats(tc);
        held_m0 = ch.m0;
        held_m1 = ch.m1;
      }
      const at::Tensor ids = plan.order.narrow(0, ch.s0, rows);
      const at::Tensor xd = chunk_rows_of(draft_hidden, ch.draft_first, ids, xd_buf);
      at::Tensor dl = draft_buf.narrow(0, 0, rows);
      at::mm_out(dl, xd, draft_head_t);
      dc.draft_logits = dl;
      dc.target_logits = tc.logits;
      dc.target_slot = plan.slot.narrow(0, ch.s0, rows);
      dc.target_base = ch.m0;
      dc.target_lse = tc.lse;
      dc.target_argmax = tc.argmax;
      dc.weight = w_rows.narrow(0, ch.s0, rows);
      dc.depth = d_rows.narrow(0, ch.s0, rows);
      dc.row_loss = row_loss.narrow(0, ch.s0, rows);
      kernels.draft_rows(dc);
      // dl now holds weight * dloss/dlogits of these rows.
      if (compute_grad_hidden) {
        if (ch.draft_first >= 0) {
          at::Tensor gx = grad_hidden.narrow(0, ch.draft_first, rows);
          at::mm_out(gx, dl, draft_head);
        } else {
          at::Tensor gx = gx_buf.narrow(0, 0, rows);
          at::mm_out(gx, dl, draft_head);
          grad_hidden.index_copy_(0, ids, gx);  // distinct rows: no accumulation
        }
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
  }  // logit buffers (and the gathered target head rows below) are released before the final scaling
  target_head_rows = at::Tensor();

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
