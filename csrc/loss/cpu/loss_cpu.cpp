// Fused linear-KL / CE loss on the CPU: the target-statistics and draft row kernels handed to
// the shared chunk driver (loss_driver.cpp), and the op's CPU registration.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/row_math.h"
#include "loss/loss_driver.h"

namespace peagle::loss {
namespace {

// Rows are independent; a task gets at least ~64K logits so small chunks run inline.
int64_t row_grain(int64_t vocab) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(vocab, 1)); }

// max and first argmax of x[0..n), then log(sum(exp(x - max))) + max when with_lse. float64
// keeps this scalar path (the tight float64 tests); the other types take the float rows below.
template <typename scalar_t, typename opmath_t>
void softmax_stats(const scalar_t* x, int64_t n, bool with_lse, opmath_t& lse, int64_t& argmax) {
  opmath_t m = -std::numeric_limits<opmath_t>::infinity();
  int64_t id = 0;
  for (int64_t v = 0; v < n; ++v) {
    const opmath_t xv = static_cast<opmath_t>(x[v]);
    if (xv > m) m = xv, id = v;
  }
  argmax = id;
  lse = opmath_t(0);
  if (!with_lse) return;
  double s = 0.0;
  for (int64_t v = 0; v < n; ++v) s += std::exp(static_cast<opmath_t>(x[v]) - m);
  lse = m + static_cast<opmath_t>(std::log(s));
}

// A row as float in a per-thread buffer, its max and first argmax (the first index holding the
// max, as the scalar scan finds it; a NaN row gives index 0 like it).
template <typename scalar_t>
float load_row(const scalar_t* x, int64_t n, float* out, int64_t& argmax) {
  for (int64_t v = 0; v < n; ++v) out[v] = static_cast<float>(x[v]);
  const float m = cpu::span_max(out, n);
  argmax = 0;
  for (int64_t v = 0; v < n; ++v)
    if (out[v] == m) {
      argmax = v;
      break;
    }
  return m;
}

template <typename scalar_t>
void target_stats_typed(TargetChunk& c) {
  using opmath_t = at::opmath_type<scalar_t>;  // double for double, float otherwise
  const int64_t rows = c.logits.size(0);
  const int64_t vocab = c.logits.size(1);
  const scalar_t* x = c.logits.const_data_ptr<scalar_t>();
  opmath_t* lse = c.lse.data_ptr<opmath_t>();
  int32_t* argmax = c.argmax.data_ptr<int32_t>();
  const bool with_lse = !c.ce;  // ce needs only the argmax
  at::parallel_for(0, rows, row_grain(vocab), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(std::is_same_v<scalar_t, double> ? 0 : vocab);
    for (int64_t r = begin; r < end; ++r) {
      int64_t id = 0;
      if constexpr (std::is_same_v<scalar_t, double>) {
        softmax_stats(x + r * vocab, vocab, with_lse, lse[r], id);
      } else {
        const float m = load_row(x + r * vocab, vocab, buf.data(), id);
        lse[r] = 0.0f;
        if (with_lse) {
          cpu::exp_shifted(buf.data(), vocab, m);
          lse[r] = m + std::log(cpu::span_sum(buf.data(), vocab));
        }
      }
      argmax[r] = static_cast<int32_t>(id);
    }
  });
}

// Loss and w * dloss/dlogit of one draft row in place, float64: the scalar path.
template <typename opmath_t>
opmath_t draft_row_double(double* d, const double* t, int64_t vocab, opmath_t w, opmath_t lse_t, int64_t it, bool ce,
                          bool write_grad, int64_t& id) {
  opmath_t lse_d;
  softmax_stats(d, vocab, true, lse_d, id);
  double loss = 0.0;
  for (int64_t v = 0; v < vocab; ++v) {  // each element read before it is written
    const opmath_t lq = d[v] - lse_d;
    const opmath_t q = std::exp(lq);
    opmath_t g;
    if (ce) {
      const bool hit = v == it;
      if (hit) loss -= lq;
      g = q - (hit ? opmath_t(1) : opmath_t(0));
    } else {
      const opmath_t lp = t[v] - lse_t;
      const opmath_t p = std::exp(lp);
      loss += p * (lp - lq);
      g = q - p;
    }
    if (write_grad) d[v] = w * g;
  }
  return static_cast<opmath_t>(loss);
}

// The same in float through per-thread row buffers (xd: the draft row, e: exp(xd - max), xt:
// the target row, g: the gradient), the row math vectorised (common/row_math.h).
template <typename scalar_t>
float draft_row_float(scalar_t* d, const scalar_t* t, int64_t vocab, float w, float lse_t, int64_t it, bool ce,
                      bool write_grad, int64_t& id, float* xd, float* e, float* xt, float* g) {
  const float m = load_row(d, vocab, xd, id);
  std::copy(xd, xd + vocab, e);
  cpu::exp_shifted(e, vocab, m);
  const float sum = cpu::span_sum(e, vocab);
  const float lse_d = m + std::log(sum);
  float loss;
  if (ce) {
    loss = lse_d - xd[it];
    for (int64_t v = 0; v < vocab; ++v) g[v] = e[v] / sum;
    g[it] -= 1.0f;
    for (int64_t v = 0; v < vocab; ++v) g[v] *= w;
  } else {
    for (int64_t v = 0; v < vocab; ++v) xt[v] = static_cast<float>(t[v]);
    loss = cpu::kl_row(xd, xt, e, vocab, lse_d, 1.0f / sum, lse_t, w, g);
  }
  if (write_grad)
    for (int64_t v = 0; v < vocab; ++v) d[v] = static_cast<scalar_t>(g[v]);
  return loss;
}

template <typename scalar_t>
void draft_rows_typed(DraftChunk& c) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr bool is_double = std::is_same_v<scalar_t, double>;
  const int64_t rows = c.draft_logits.size(0);
  const int64_t vocab = c.draft_logits.size(1);
  scalar_t* draft = c.draft_logits.data_ptr<scalar_t>();
  const scalar_t* target = c.target_logits.const_data_ptr<scalar_t>();
  const int64_t* slot = c.target_slot.const_data_ptr<int64_t>();
  const opmath_t* target_lse = c.target_lse.const_data_ptr<opmath_t>();
  const int32_t* target_argmax = c.target_argmax.const_data_ptr<int32_t>();
  const opmath_t* weight = c.weight.const_data_ptr<opmath_t>();
  const int32_t* depth = c.depth.const_data_ptr<int32_t>();
  opmath_t* row_loss = c.row_loss.data_ptr<opmath_t>();
  // -1: row not counted; else 1 when the two argmaxes agree. Counted serially below.
  std::vector<int8_t> agree(static_cast<size_t>(rows), -1);

  at::parallel_for(0, rows, row_grain(vocab), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(is_double ? 0 : 4 * vocab);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* d = draft + r * vocab;
      const int64_t s = slot[r] - c.target_base;
      const scalar_t* t = target + s * vocab;
      const opmath_t w = weight[r];
      const int64_t it = target_argmax[s];
      int64_t id = 0;
      opmath_t loss;
      if constexpr (is_double) {
        loss = draft_row_double<opmath_t>(d, t, vocab, w, target_lse[s], it, c.ce, c.write_grad, id);
      } else {
        float* b = buf.data();
        loss = draft_row_float(d, t, vocab, w, target_lse[s], it, c.ce, c.write_grad, id, b, b + vocab, b + 2 * vocab,
                               b + 3 * vocab);
      }
      row_loss[r] = w * loss;
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

void target_stats_cpu(TargetChunk& c) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.logits.scalar_type(), "fused_linear_kl_target_cpu",
                                  [&] { target_stats_typed<scalar_t>(c); });
}

void draft_rows_cpu(DraftChunk& c) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.draft_logits.scalar_type(), "fused_linear_kl_draft_cpu",
                                  [&] { draft_rows_typed<scalar_t>(c); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_kl_cpu(
    const at::Tensor& draft_hidden, const at::Tensor& draft_head, const at::Tensor& target_hidden,
    const at::Tensor& target_head, const at::Tensor& weight, const at::Tensor& depth,
    const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& target_index, int64_t num_depths,
    int64_t chunk_rows, c10::string_view kind, bool compute_grad_hidden, bool compute_grad_head) {
  return fused_linear_kl_driver(draft_hidden, draft_head, target_hidden, target_head, weight, depth, d2t, target_index,
                                num_depths, chunk_rows, kind, compute_grad_hidden, compute_grad_head,
                                RowKernels{target_stats_cpu, draft_rows_cpu});
}

}  // namespace
}  // namespace peagle::loss

TORCH_LIBRARY_IMPL(peagle, CPU, m) { m.impl("fused_linear_kl", &peagle::loss::fused_linear_kl_cpu); }
