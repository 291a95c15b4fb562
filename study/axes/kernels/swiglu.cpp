// SwiGLU's gate (Shazeer 2020): out = silu(g) * u over h = [g; u], one pass each way (activation.h). The eager
// composite made the default sweep's SwiGLU step 1.14x ReLU's at equal FLOPs (bench/axis_cost.py), a cost of our code,
// not of the idea. Built on first use by study/axes/cpu_kernels.py; study/axes/activation.py's SwiGLU calls `swiglu`.
// silu(x) = x s with s = sigmoid(x); silu'(x) = s (1 + x (1 - s)).
#include <torch/library.h>

#include "activation.h"
#include "vec_math.h"

#include <cmath>

namespace {

using study_kernels::exp_nonpositive;

inline float sigmoid(float x) {
  const float e = exp_nonpositive(x < 0.0f ? x : -x);  // exp(-|x|): never overflows
  return x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct Silu {
  template <typename C>
  static C value(C x) {
    return x * sigmoid(x);
  }

  template <typename C>
  static void value_slope(C x, C& value, C& slope) {
    const C s = sigmoid(x);
    value = x * s;
    slope = s * (C(1) + x * (C(1) - s));
  }
};

at::Tensor swiglu_autograd(const at::Tensor& h) { return study_kernels::GluNode<Silu>::apply(h); }

}  // namespace

TORCH_LIBRARY(study_swiglu, m) {
  m.def("swiglu(Tensor h) -> Tensor");  // silu(h[..., :F]) * h[..., F:], differentiable in h
}

TORCH_LIBRARY_IMPL(study_swiglu, Autograd, m) { m.impl("swiglu", &swiglu_autograd); }

TORCH_LIBRARY_IMPL(study_swiglu, CPU, m) { m.impl("swiglu", &study_kernels::glu_forward<Silu>); }
