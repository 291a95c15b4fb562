// Beam search's candidate selection in one pass over each row of logits: the k largest log-probabilities of a row
// (log_softmax's formula, (x - max) - log(sum(exp(x - max))), in float32) and their token ids, without writing the
// (rows, vocab) log-probabilities. Eager PyTorch needs a float32 copy of the logits, log_softmax, the add of the beam
// scores and a top-k over (sentences, beams * vocab), four passes over 4M values a Multi30k step that took more time
// than the decoder itself (bench/decode_speed.py). Built on first use by study/axes/cpu_kernels.py;
// study/model/generate.py calls it on CPU tensors (the eager path elsewhere: log_softmax and a row-wise top-k).
//
// logits: (R, V) float32, bfloat16 or float16, contiguous rows. Returns values (R, k) float32 in descending order
// (ties: the smaller token id first; -inf where k > V), indices (R, k) int64, and each row's max and log-sum (R,)
// float32 so that the caller can form any other token's log-probability with the same formula. exp is a
// vectorisable polynomial (Cody-Waite reduction, degree-6 Taylor on |r| <= ln2/2: about 2 ulp), so the sum may differ
// from torch's log_softmax in its last bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using study_kernels::exp_nonpositive;

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = study_kernels::load(src, j);
}

// Insert (v, id) into the descending list vals/ids of `count` entries (at most k), after entries equal to v.
inline void insert(float* vals, int64_t* ids, int64_t& count, int64_t k, float v, int64_t id) {
  int64_t pos = count < k ? count : k - 1;
  while (pos > 0 && vals[pos - 1] < v) {
    if (pos < k) {
      vals[pos] = vals[pos - 1];
      ids[pos] = ids[pos - 1];
    }
    --pos;
  }
  vals[pos] = v;
  ids[pos] = id;
  if (count < k) ++count;
}

// The k largest of x[0, V) into vals/ids, skipping 64-value blocks whose max cannot enter a full list.
void top_k(const float* x, int64_t V, int64_t k, float* vals, int64_t* ids) {
  constexpr int64_t kBlock = 64;
  int64_t count = 0;
  for (int64_t start = 0; start < V; start += kBlock) {
    const int64_t end = start + kBlock < V ? start + kBlock : V;
    float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
    for (int64_t j = start; j < end; ++j) block_max = x[j] > block_max ? x[j] : block_max;
    if (count == k && !(block_max > vals[k - 1])) continue;
    for (int64_t j = start; j < end; ++j) {
      if (count < k || x[j] > vals[k - 1]) insert(vals, ids, count, k, x[j], j);
    }
  }
  for (int64_t i = count; i < k; ++i) {
    vals[i] = kNegInf;
    ids[i] = 0;
  }
}

template <typename T>
void rows_top_k(const T* logits, int64_t R, int64_t V, int64_t k, float* vals, int64_t* ids, float* row_max,
                float* row_logsum, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buffer(V);
    float* x = buffer.data();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      to_float(logits + r * V, x, V);
      float mx = kNegInf;
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < V; ++j) mx = x[j] > mx ? x[j] : mx;
      const float sum = study_kernels::lane_sum(V, [&](int64_t j) { return exp_nonpositive(x[j] - mx); });
      const float logsum = std::log(sum);
      float* v = vals + r * k;
      top_k(x, V, k, v, ids + r * k);
      for (int64_t i = 0; i < k; ++i) v[i] = v[i] == kNegInf ? kNegInf : (v[i] - mx) - logsum;
      row_max[r] = mx;
      row_logsum[r] = logsum;
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> log_softmax_topk(const at::Tensor& logits_, int64_t k) {
  TORCH_CHECK(logits_.device().is_cpu() && logits_.dim() == 2, "log_softmax_topk: a 2-D CPU tensor of logits");
  TORCH_CHECK(k >= 1, "log_softmax_topk: k must be at least 1");
  const at::Tensor logits = logits_.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1, "log_softmax_topk: an empty vocabulary");
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor vals = at::empty({R, k}, f32), row_max = at::empty({R}, f32), row_logsum = at::empty({R}, f32);
  at::Tensor ids = at::empty({R, k}, logits.options().dtype(at::kLong));
  const int threads = at::get_num_threads();
  float* v = vals.data_ptr<float>();
  int64_t* i = ids.data_ptr<int64_t>();
  switch (logits.scalar_type()) {
    case at::kFloat:
      rows_top_k(logits.data_ptr<float>(), R, V, k, v, i, row_max.data_ptr<float>(), row_logsum.data_ptr<float>(),
                 threads);
      break;
    case at::kBFloat16:
      rows_top_k(logits.data_ptr<at::BFloat16>(), R, V, k, v, i, row_max.data_ptr<float>(),
                 row_logsum.data_ptr<float>(), threads);
      break;
    case at::kHalf:
      rows_top_k(logits.data_ptr<at::Half>(), R, V, k, v, i, row_max.data_ptr<float>(),
                 row_logsum.data_ptr<float>(), threads);
      break;
    default:
      TORCH_CHECK(false, "log_softmax_topk: float32, bfloat16 or float16 logits, not ", logits.scalar_type());
  }
  return {vals, ids, row_max, row_logsum};
}

}  // namespace

TORCH_LIBRARY(study_log_softmax_topk, m) {
  m.def("forward(Tensor logits, int k) -> (Tensor, Tensor, Tensor, Tensor)", &log_softmax_topk);
}
