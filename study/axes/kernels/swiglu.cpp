// SwiGLU's gate (Shazeer 2020): out = silu(g) * u over h = [g; u] (the FFN's fused input projection, gate columns
// first), one pass over h forward and one backward, with its autograd node in C++. Eager PyTorch runs it as a
// chunk, silu and a product forward, and silu_backward, two products and a concatenation of the two halves' gradients
// backward, each a pass over (tokens, d_ff): the default sweep's SwiGLU step took 1.14x ReLU's at equal FLOPs
// (bench/axis_cost.py), a cost of our code, not of the idea. Built on first use by study/axes/cpu_kernels.py;
// study/axes/activation.py's SwiGLU calls `swiglu`.
//
// h: (..., 2F) with a contiguous last dimension's rows; float32, bfloat16 or float64. Computed in float32 (float64
// for float64), rounded once to h's dtype; eager bf16 rounds silu(g) before the product, so bf16 results may differ
// from it by an ulp. With s = sigmoid(g):  dg = dy u s (1 + g (1 - s)),  du = dy g s.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cmath>
#include <cstdint>

namespace {

using study_kernels::exp_nonpositive;

inline float sigmoid(float x) {
  const float e = exp_nonpositive(x < 0.0f ? x : -x);  // exp(-|x|): never overflows
  return x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Loads and stores by bit operations, so that `omp simd` vectorises the bf16 loops (c10::BFloat16's conversions do
// not vectorise: the bf16 kernel ran 2.4x slower than eager PyTorch with them). bf16 is float's upper half; a store
// rounds to nearest even, as c10 does, NaN kept NaN.
inline float load(const float* p, int64_t j) { return p[j]; }
inline double load(const double* p, int64_t j) { return p[j]; }
inline float load(const at::BFloat16* p, int64_t j) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[j]) << 16);
}
inline void store(float* p, int64_t j, float v) { p[j] = v; }
inline void store(double* p, int64_t j, double v) { p[j] = v; }
inline void store(at::BFloat16* p, int64_t j, float v) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, v);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  reinterpret_cast<uint16_t*>(p)[j] = static_cast<uint16_t>(v != v ? 0x7FC0u : rounded);
}

template <typename T>
void forward_rows(const T* h, T* out, int64_t rows, int64_t F, int threads) {
  using C = at::opmath_type<T>;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = h + r * 2 * F;
    const T* u = g + F;
    T* o = out + r * F;
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) {
      const C x = load(g, j);
      store(o, j, x * sigmoid(x) * load(u, j));
    }
  }
}

template <typename T>
void backward_rows(const T* dy, const T* h, T* dh, int64_t rows, int64_t F, int threads) {
  using C = at::opmath_type<T>;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = h + r * 2 * F;
    const T* u = g + F;
    const T* d = dy + r * F;
    T* dg = dh + r * 2 * F;
    T* du = dg + F;
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) {
      const C x = load(g, j), s = sigmoid(x), grad = load(d, j);
      store(du, j, grad * x * s);
      store(dg, j, grad * load(u, j) * s * (C(1) + x * (C(1) - s)));
    }
  }
}

at::Tensor swiglu_forward(const at::Tensor& h_) {
  TORCH_CHECK(h_.device().is_cpu() && h_.dim() >= 1 && h_.size(-1) % 2 == 0, "swiglu: CPU h of even last size");
  const at::Tensor h = h_.contiguous();
  const int64_t F = h.size(-1) / 2, rows = F == 0 ? 0 : h.numel() / (2 * F);
  std::vector<int64_t> shape = h.sizes().vec();
  shape.back() = F;
  at::Tensor out = at::empty(shape, h.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "swiglu_forward", [&] {
    forward_rows<scalar_t>(h.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, F, at::get_num_threads());
  });
  return out;
}

at::Tensor swiglu_backward(const at::Tensor& dy_, const at::Tensor& h) {
  const at::Tensor dy = dy_.contiguous().to(h.scalar_type());
  const int64_t F = h.size(-1) / 2, rows = F == 0 ? 0 : h.numel() / (2 * F);
  at::Tensor dh = at::empty(h.sizes(), h.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "swiglu_backward", [&] {
    backward_rows<scalar_t>(dy.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), dh.data_ptr<scalar_t>(), rows, F,
                            at::get_num_threads());
  });
  return dh;
}

class SwiGLUNode : public torch::autograd::Function<SwiGLUNode> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h_) {
    const at::Tensor h = h_.contiguous();
    ctx->save_for_backward({h});
    return swiglu_forward(h);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    return {swiglu_backward(grads[0], ctx->get_saved_variables()[0])};
  }
};

at::Tensor swiglu_autograd(const at::Tensor& h) { return SwiGLUNode::apply(h); }

}  // namespace

TORCH_LIBRARY(study_swiglu, m) {
  m.def("swiglu(Tensor h) -> Tensor");  // silu(h[..., :F]) * h[..., F:], differentiable in h
}

TORCH_LIBRARY_IMPL(study_swiglu, Autograd, m) { m.impl("swiglu", &swiglu_autograd); }

TORCH_LIBRARY_IMPL(study_swiglu, CPU, m) { m.impl("swiglu", &swiglu_forward); }
