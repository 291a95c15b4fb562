// Cross-entropy's loss and logit gradient in one pass over each row of a chunk of logits, written over the logits:
// what study/model/loss.py's fused output projection runs per chunk on the CPU. Eager PyTorch needs a float32 copy of
// bfloat16 logits, a softmax, a gather and log of the target's probability, a scatter-add of the one-hot and a cast
// back to bfloat16: six passes over the chunk where this makes one (read the row into a float32 scratch row that
// stays in cache, write the gradient back). `accumulate_` adds W's bfloat16 share of a chunk's gradient to its float32
// sum, where torch's mixed-dtype add_ first copies it to a fresh float32 block. On a Xeon with AMX (2 threads) the
// fused loss's forward + backward at 4,096 rows, d 512, vocabulary 8,000 in bf16 went from 0.50x to 0.39x the plain
// loss's time (bench/axis_cost.py --loss; bench/README.md, "The loss at its best kernel").
//
// logits: (R, V) float32 or bfloat16, contiguous rows, overwritten. targets: (R,) int64. Per row with target t:
//   nll = logsumexp(x) - x_t = (m + log s) - x_t,   m = max_j x_j,   s = sum_j exp(x_j - m)
//   x_j <- p_j - w [j == t],   p_j = exp(x_j - m) / s,   w = target_weight (1 - label smoothing)
// computed in float32 and rounded once to the logits' dtype (round to nearest even, as `.to(torch.bfloat16)` does).
// A row whose target is ignore_index gets nll = 0 and a zero gradient. The loss takes the log-sum-exp form, so a
// target whose probability underflows float32 keeps its exact log-probability. exp is vec_math.h's polynomial
// (about 2 ulp), so values may differ from torch's softmax in their last bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using study_kernels::exp_nonpositive;
using study_kernels::load;
using study_kernels::store;

// One row: nll returned, the row's gradient left in x (float32 scratch).
inline float row_loss_and_grad(float* x, int64_t V, int64_t t, float target_weight) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < V; ++j) mx = x[j] > mx ? x[j] : mx;
  const float target = x[t];
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) x[j] = exp_nonpositive(x[j] - mx);
  const float sum = study_kernels::lane_sum(V, [&](int64_t j) { return x[j]; });  // the row is still in cache
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) x[j] *= inv;
  x[t] -= target_weight;
  return (mx + std::log(sum)) - target;
}

template <typename T>
int64_t rows_loss_and_grad(T* logits, const int64_t* targets, int64_t R, int64_t V, float target_weight,
                           int64_t ignore_index, float* nll, int threads) {
  std::atomic<int64_t> bad_row{-1};
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buffer(std::is_same_v<T, float> ? 0 : V);
    float* x = buffer.data();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      T* row = logits + r * V;
      const int64_t t = targets[r];
      if (t == ignore_index) {
        nll[r] = 0.0f;
        std::memset(static_cast<void*>(row), 0, V * sizeof(T));
        continue;
      }
      if (t < 0 || t >= V) {
        bad_row.store(r);
        continue;
      }
      if constexpr (std::is_same_v<T, float>) {  // float32 rows are their own scratch
        nll[r] = row_loss_and_grad(row, V, t, target_weight);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) x[j] = load(row, j);
        nll[r] = row_loss_and_grad(x, V, t, target_weight);
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) store(row, j, x[j]);
      }
    }
  }
  return bad_row.load();
}

at::Tensor loss_and_grad_(at::Tensor& logits, const at::Tensor& targets, double target_weight, int64_t ignore_index) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "cross_entropy_grad: contiguous 2-D CPU logits");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "cross_entropy_grad: int64 targets, one per row of logits");
  const at::Tensor t = targets.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor nll = at::empty({R}, logits.options().dtype(at::kFloat));
  const int threads = at::get_num_threads();
  const float w = static_cast<float>(target_weight);
  int64_t bad = -1;
  if (logits.scalar_type() == at::kFloat) {
    bad = rows_loss_and_grad(logits.data_ptr<float>(), t.data_ptr<int64_t>(), R, V, w, ignore_index,
                             nll.data_ptr<float>(), threads);
  } else if (logits.scalar_type() == at::kBFloat16) {
    bad = rows_loss_and_grad(logits.data_ptr<at::BFloat16>(), t.data_ptr<int64_t>(), R, V, w, ignore_index,
                             nll.data_ptr<float>(), threads);
  } else {
    TORCH_CHECK(false, "cross_entropy_grad: float32 or bfloat16 logits, not ", logits.scalar_type());
  }
  TORCH_CHECK(bad < 0, "cross_entropy_grad: target ", t[bad].item<int64_t>(), " of row ", bad,
              " is out of bounds for ", V, " classes");
  return nll;
}

// acc += src for a float32 acc and a bfloat16 src of the same shape, without the float32 copy of src that torch's
// mixed-dtype add_ makes (a fresh (V, d) block per chunk: the fused loss's weight gradient adds one per chunk).
void accumulate_(at::Tensor& acc, const at::Tensor& src) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kFloat && acc.is_contiguous(),
              "accumulate_: a contiguous float32 CPU accumulator");
  TORCH_CHECK(src.scalar_type() == at::kBFloat16 && src.is_contiguous() && src.sizes() == acc.sizes(),
              "accumulate_: a contiguous bfloat16 tensor of the accumulator's shape");
  float* a = acc.data_ptr<float>();
  const at::BFloat16* s = src.data_ptr<at::BFloat16>();
  const int64_t n = acc.numel();
#pragma omp parallel for simd num_threads(at::get_num_threads()) schedule(static)
  for (int64_t j = 0; j < n; ++j) a[j] += load(s, j);
}

}  // namespace

TORCH_LIBRARY(study_cross_entropy_grad, m) {
  m.def("forward_(Tensor(a!) logits, Tensor targets, float target_weight, int ignore_index) -> Tensor",
        &loss_and_grad_);
  m.def("accumulate_(Tensor(a!) acc, Tensor src) -> ()", &accumulate_);
}
