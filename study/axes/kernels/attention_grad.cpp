// The element-wise half of a bf16 attention backward at short lengths, for study/model/attention.py. There the
// backward is five batched GEMMs (torch.bmm; oneDNN, AMX or AVX-512 BF16) around these two passes over the (B, H, Tq,
// Tk) scores, which stay small below 256 keys. Why by hand: SDPA's fused CPU kernel (torch <= 2.13) runs its bf16
// backward several times slower than its float32 backward at these lengths, and its float32 backward pays casts of
// q, k, v, out and the output gradient both ways; eager PyTorch would take some seven passes over the scores where
// these take two. On a Xeon with AMX (2 threads), forward + backward at (B, H, T, hs) = (32, 8, 128, 64), GQA 2,
// took 0.30x the time of SDPA's own bf16 call, against 0.48x with the float32 backward (bench/axis_cost.py
// --attention; bench/README.md, "Attention's backward in bf16").
//
// The formulas are the flash-attention backward's (Dao 2023, Algorithm 2), with P recomputed from the forward's
// log-sum-exp L rather than stored:
//   probs_:      P_ij = exp(S_ij * scale + bias_ij - L_i), 0 where a causal query i must not see key j (j > i, SDPA's
//                top-left alignment) or where L_i = -inf (a query that saw no key);
//                S (float32) is overwritten by P; P rounded to bf16 is returned for dV = P^T dO.
//   score_grad_: dS_ij = P_ij * (dP_ij - D_i) * scale,   D_i = sum_d dO_id * O_id,   dP = dO V^T (float32),
//                written over the bf16 copy of P (dead once dV is computed) for dQ = dS K and dK = dS^T Q.
// S, dP and D are float32: rounding dP to bf16 before the subtraction raised dQ's error by 40% (bench/README.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

namespace {

using study_kernels::exp_nonpositive;
using study_kernels::load;
using study_kernels::store;

void check_scores(const at::Tensor& s, const char* name) {
  TORCH_CHECK(s.device().is_cpu() && s.dim() == 4 && s.is_contiguous() && s.scalar_type() == at::kFloat,
              "attention_grad: ", name, " must be contiguous (B, H, Tq, Tk) float32 on the CPU");
}

// One query row: P over its first `visible` keys into s (float32, in place) and p16 (bf16), zeros beyond.
inline void row_probs(float* s, at::BFloat16* p16, const float* bias, int64_t visible, int64_t Tk, float lse,
                      float scale) {
  if (lse == -std::numeric_limits<float>::infinity()) visible = 0;
  if (bias) {
#pragma omp simd
    for (int64_t j = 0; j < visible; ++j) s[j] = exp_nonpositive(s[j] * scale + bias[j] - lse);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < visible; ++j) s[j] = exp_nonpositive(s[j] * scale - lse);
  }
#pragma omp simd
  for (int64_t j = visible; j < Tk; ++j) s[j] = 0.0f;
#pragma omp simd
  for (int64_t j = 0; j < Tk; ++j) store(p16, j, s[j]);
}

at::Tensor probs_(at::Tensor& scores, const at::Tensor& lse, const std::optional<at::Tensor>& bias, bool causal,
                  double scale) {
  check_scores(scores, "scores");
  const int64_t B = scores.size(0), H = scores.size(1), Tq = scores.size(2), Tk = scores.size(3);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.sizes() == at::IntArrayRef({B, H, Tq}),
              "attention_grad: lse must be (B, H, Tq) float32");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).expand({B, H, Tq, Tk});
    if (b.stride(3) != 1) b = b.contiguous();  // a bias broadcast over keys: rare, materialised
    TORCH_CHECK(b.device().is_cpu(), "attention_grad: the bias must be on the CPU");
  }
  at::Tensor p16 = at::empty_like(scores, scores.options().dtype(at::kBFloat16));
  float* s = scores.data_ptr<float>();
  at::BFloat16* p = p16.data_ptr<at::BFloat16>();
  const float* l = lse.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float sc = static_cast<float>(scale);
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static) collapse(3)
  for (int64_t bi = 0; bi < B; ++bi) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < Tq; ++i) {
        const int64_t row = ((bi * H + h) * Tq + i) * Tk;
        const float* brow = bp ? bp + bi * b.stride(0) + h * b.stride(1) + i * b.stride(2) : nullptr;
        const float li = l[bi * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2)];
        row_probs(s + row, p + row, brow, causal ? std::min(i + 1, Tk) : Tk, Tk, li, sc);
      }
    }
  }
  return p16;
}

// D_i = sum_d dO_id * O_id for one query row of (B, H, Tq, hs) tensors in any layout with unit last stride.
template <typename T>
inline float row_dot(const T* a, const T* o, int64_t hs) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < hs; ++d) sum += load(a, d) * load(o, d);
  return sum;
}

void score_grad_(at::Tensor& ds, const at::Tensor& dp, const at::Tensor& probs, const at::Tensor& grad_out,
                 const at::Tensor& out, double scale) {
  check_scores(dp, "dp");
  check_scores(probs, "probs");
  TORCH_CHECK(ds.scalar_type() == at::kBFloat16 && ds.is_contiguous() && ds.sizes() == dp.sizes() &&
                  probs.sizes() == dp.sizes(),
              "attention_grad: ds (bf16), dp and probs must be contiguous and of one shape");
  const int64_t B = dp.size(0), H = dp.size(1), Tq = dp.size(2), Tk = dp.size(3);
  TORCH_CHECK(grad_out.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  grad_out.dim() == 4 && grad_out.sizes() == out.sizes() && grad_out.size(0) == B &&
                  grad_out.size(1) == H && grad_out.size(2) == Tq && grad_out.stride(3) == 1 && out.stride(3) == 1,
              "attention_grad: grad_out and out must be bf16 (B, H, Tq, hs) with unit last stride");
  const int64_t hs = out.size(3);
  const at::BFloat16* go = grad_out.data_ptr<at::BFloat16>();
  const at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const float* dpp = dp.data_ptr<float>();
  const float* pp = probs.data_ptr<float>();
  at::BFloat16* dsp = ds.data_ptr<at::BFloat16>();
  const float sc = static_cast<float>(scale);
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static) collapse(3)
  for (int64_t bi = 0; bi < B; ++bi) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < Tq; ++i) {
        const float d = row_dot(go + bi * grad_out.stride(0) + h * grad_out.stride(1) + i * grad_out.stride(2),
                                o + bi * out.stride(0) + h * out.stride(1) + i * out.stride(2), hs);
        const int64_t row = ((bi * H + h) * Tq + i) * Tk;
#pragma omp simd
        for (int64_t j = 0; j < Tk; ++j) store(dsp + row, j, pp[row + j] * (dpp[row + j] - d) * sc);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY(study_attention_grad, m) {
  m.def("probs_(Tensor(a!) scores, Tensor lse, Tensor? bias, bool causal, float scale) -> Tensor", &probs_);
  m.def("score_grad_(Tensor(a!) ds, Tensor dp, Tensor probs, Tensor grad_out, Tensor out, float scale) -> ()",
        &score_grad_);
}
