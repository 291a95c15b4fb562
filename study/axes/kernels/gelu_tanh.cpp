// GELU's tanh approximation (Hendrycks & Gimpel 2016; GPT-2's `gelu_new`), as F.gelu(x, approximate="tanh")
// computes it, one pass each way (activation.h). torch's own CPU kernel for this form ran 1.16-1.30x the time of its
// erf form in the FFN (bench/axis_cost.py, isolated, on three CPU kinds), a cost of the kernel, not of the idea.
// Built on first use by study/axes/cpu_kernels.py; study/axes/activation.py's GELUTanh calls `gelu_tanh`.
// gelu(x) = x (1 + t) / 2 with t = tanh(u), u = k (x + c x^3), k = sqrt(2 / pi), c = 0.044715;
// gelu'(x) = (1 + t) / 2 + x (1 - t^2) k (1 + 3 c x^2) / 2.
#include <torch/library.h>

#include "activation.h"
#include "vec_math.h"

#include <cmath>

namespace {

using study_kernels::exp_nonpositive;

constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kCubic = 0.044715;

// 1 + tanh(u) and 1 - tanh(u) without cancellation in either tail (gelu(x) for x << 0 is x (1 + t) / 2 with t near
// -1): with e = exp(-2 |u|) <= 1 (vectorisable, no overflow), 1 + t = 2 e / (1 + e) for u < 0 and 2 / (1 + e)
// otherwise, and 1 - t the other way round. `inline` matters: without it GCC 12 left this template a call inside
// activation.h's `omp simd` loops, which then ran scalar (5.5x torch's own GELU time; bench/README.md).
template <typename C>
inline void one_plus_minus_tanh(C u, C& plus, C& minus) {
  const C e = exp_nonpositive(C(-2) * (u < C(0) ? -u : u));
  const C small = C(2) * e / (C(1) + e), large = C(2) / (C(1) + e);
  plus = u < C(0) ? small : large;
  minus = u < C(0) ? large : small;
}

struct GeluTanh {
  template <typename C>
  static C value(C x) {
    C plus, minus;
    one_plus_minus_tanh(C(kSqrt2OverPi) * (x + C(kCubic) * x * x * x), plus, minus);
    return C(0.5) * x * plus;
  }

  template <typename C>
  static void value_slope(C x, C& value, C& slope) {
    const C x2 = x * x;
    C plus, minus;  // 1 + t, 1 - t
    one_plus_minus_tanh(C(kSqrt2OverPi) * (x + C(kCubic) * x2 * x), plus, minus);
    value = C(0.5) * x * plus;
    slope = C(0.5) * plus + C(0.5) * x * (plus * minus) * C(kSqrt2OverPi) * (C(1) + C(3 * kCubic) * x2);
  }
};

at::Tensor gelu_tanh_autograd(const at::Tensor& x) { return study_kernels::PointwiseNode<GeluTanh>::apply(x); }

}  // namespace

TORCH_LIBRARY(study_gelu_tanh, m) {
  m.def("gelu_tanh(Tensor x) -> Tensor");  // F.gelu(x, approximate="tanh"), differentiable in x
}

TORCH_LIBRARY_IMPL(study_gelu_tanh, Autograd, m) { m.impl("gelu_tanh", &gelu_tanh_autograd); }

TORCH_LIBRARY_IMPL(study_gelu_tanh, CPU, m) { m.impl("gelu_tanh", &study_kernels::pointwise_forward<GeluTanh>); }
