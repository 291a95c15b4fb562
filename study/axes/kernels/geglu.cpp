// GEGLU's gate (Shazeer 2020; T5 v1.1): out = gelu(g) * u over h = [g; u], GELU in its exact erf form (Hendrycks &
// Gimpel 2016), as F.gelu computes it, one pass each way (activation.h). Built on first use by
// study/axes/cpu_kernels.py; study/axes/activation.py's GEGLU calls `geglu`.
// gelu(x) = x Phi(x), gelu'(x) = Phi(x) + x phi(x), Phi the standard normal CDF and phi its density.
#include <torch/library.h>

#include "activation.h"
#include "vec_math.h"

#include <cmath>

namespace {

using study_kernels::exp_nonpositive;

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

// Phi(x) and phi(x) in float, vectorisable: Phi from erfc(|x| / sqrt 2) by Abramowitz & Stegun 7.1.26 (absolute
// error below 1.5e-7, the formula PyTorch's vectorised CPU erf uses), taken as erfc / 2 for x < 0 and 1 - erfc / 2
// otherwise, so that no 1 + erf cancels; exp(-x^2 / 2) serves both.
inline void normal_cdf_pdf(float x, float& cdf, float& pdf) {
  const float z = (x < 0.0f ? -x : x) * static_cast<float>(kInvSqrt2);
  const float t = 1.0f / (1.0f + 0.3275911f * z);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  const float e = exp_nonpositive(-z * z);  // exp(-x^2 / 2)
  const float half_erfc = 0.5f * poly * t * e;
  cdf = x < 0.0f ? half_erfc : 1.0f - half_erfc;
  pdf = static_cast<float>(kInvSqrt2Pi) * e;
}

inline void normal_cdf_pdf(double x, double& cdf, double& pdf) {
  cdf = 0.5 * std::erfc(-x * kInvSqrt2);
  pdf = kInvSqrt2Pi * std::exp(-0.5 * x * x);
}

struct Gelu {
  template <typename C>
  static C value(C x) {
    C cdf, pdf;
    normal_cdf_pdf(x, cdf, pdf);
    return x * cdf;
  }

  template <typename C>
  static void value_slope(C x, C& value, C& slope) {
    C cdf, pdf;
    normal_cdf_pdf(x, cdf, pdf);
    value = x * cdf;
    slope = cdf + x * pdf;
  }
};

at::Tensor geglu_autograd(const at::Tensor& h) { return study_kernels::GluNode<Gelu>::apply(h); }

}  // namespace

TORCH_LIBRARY(study_geglu, m) {
  m.def("geglu(Tensor h) -> Tensor");  // gelu(h[..., :F]) * h[..., F:] (erf form), differentiable in h
}

TORCH_LIBRARY_IMPL(study_geglu, Autograd, m) { m.impl("geglu", &geglu_autograd); }

TORCH_LIBRARY_IMPL(study_geglu, CPU, m) { m.impl("geglu", &study_kernels::glu_forward<Gelu>); }
