// An FFN activation's CPU kernels, one pass over the input each way with the autograd node in C++: a plain one,
// y = act(x), and a gated linear unit's (Shazeer 2020), out = act(g) * u over h = [g; u] (the FFN's fused input
// projection, gate columns first). Eager PyTorch runs a gated unit as a chunk, the activation and a product forward,
// and the activation's backward, two products and a concatenation of the two halves' gradients backward, each a pass
// over (tokens, d_ff). A kernel file (swiglu.cpp, geglu.cpp, gelu_tanh.cpp) supplies the activation as a struct with,
// for float and double,
//   value(x)              act(x)
//   value_slope(x, v, s)  v = act(x), s = act'(x)
// and registers `GluNode<Act>::apply` and `glu_forward<Act>` (gated) or `PointwiseNode<Act>::apply` and
// `pointwise_forward<Act>` (plain).
//
// Inputs: a contiguous last dimension's rows (2F wide for a gated unit); float32, bfloat16 or float64. Computed in
// float32 (float64 for float64), rounded once to the input's dtype; eager bf16 rounds act(g) before the product, so
// bf16 results may differ from it by an ulp. Backward: dg = dy u act'(g), du = dy act(g); plain: dx = dy act'(x).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "vec_math.h"

#include <cstdint>
#include <vector>

namespace study_kernels {

template <typename Act, typename T>
void glu_forward_rows(const T* h, T* out, int64_t rows, int64_t F, int threads) {
  using C = at::opmath_type<T>;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = h + r * 2 * F;
    const T* u = g + F;
    T* o = out + r * F;
#pragma omp simd
    for (int64_t j = 0; j < F; ++j) {
      store(o, j, Act::value(C(load(g, j))) * load(u, j));
    }
  }
}

template <typename Act, typename T>
void glu_backward_rows(const T* dy, const T* h, T* dh, int64_t rows, int64_t F, int threads) {
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
      C value, slope;
      Act::value_slope(C(load(g, j)), value, slope);
      const C grad = load(d, j);
      store(du, j, grad * value);
      store(dg, j, grad * load(u, j) * slope);
    }
  }
}

template <typename Act>
at::Tensor glu_forward(const at::Tensor& h_) {
  TORCH_CHECK(h_.device().is_cpu() && h_.dim() >= 1 && h_.size(-1) % 2 == 0, "gated unit: CPU h of even last size");
  const at::Tensor h = h_.contiguous();
  const int64_t F = h.size(-1) / 2, rows = F == 0 ? 0 : h.numel() / (2 * F);
  std::vector<int64_t> shape = h.sizes().vec();
  shape.back() = F;
  at::Tensor out = at::empty(shape, h.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "glu_forward", [&] {
    glu_forward_rows<Act, scalar_t>(h.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, F,
                                     at::get_num_threads());
  });
  return out;
}

template <typename Act>
at::Tensor glu_backward(const at::Tensor& dy_, const at::Tensor& h) {
  const at::Tensor dy = dy_.contiguous().to(h.scalar_type());
  const int64_t F = h.size(-1) / 2, rows = F == 0 ? 0 : h.numel() / (2 * F);
  at::Tensor dh = at::empty(h.sizes(), h.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "glu_backward", [&] {
    glu_backward_rows<Act, scalar_t>(dy.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), dh.data_ptr<scalar_t>(), rows,
                                      F, at::get_num_threads());
  });
  return dh;
}

template <typename Act, typename T>
void pointwise_rows(const T* x, const T* dy, T* out, int64_t n, int threads) {
  using C = at::opmath_type<T>;
  const int64_t chunk = 16384;  // elements per OpenMP iteration (64 KB of float32): enough to amortise the loop
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t end = start + chunk < n ? start + chunk : n;
    if (dy == nullptr) {
#pragma omp simd
      for (int64_t j = start; j < end; ++j) store(out, j, Act::value(C(load(x, j))));
    } else {
#pragma omp simd
      for (int64_t j = start; j < end; ++j) {
        C value, slope;
        Act::value_slope(C(load(x, j)), value, slope);
        store(out, j, C(load(dy, j)) * slope);
      }
    }
  }
}

// y = act(x) (dy undefined) or dx = dy act'(x), in x's dtype and shape.
template <typename Act>
at::Tensor pointwise(const at::Tensor& x_, const at::Tensor& dy_) {
  TORCH_CHECK(x_.device().is_cpu(), "activation kernel: a CPU tensor");
  const at::Tensor x = x_.contiguous();
  const at::Tensor dy = dy_.defined() ? dy_.contiguous().to(x.scalar_type()) : dy_;
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "pointwise_activation", [&] {
    pointwise_rows<Act, scalar_t>(x.data_ptr<scalar_t>(), dy.defined() ? dy.data_ptr<scalar_t>() : nullptr,
                                  out.data_ptr<scalar_t>(), x.numel(), at::get_num_threads());
  });
  return out;
}

template <typename Act>
at::Tensor pointwise_forward(const at::Tensor& x) { return pointwise<Act>(x, at::Tensor()); }

template <typename Act>
at::Tensor pointwise_backward(const at::Tensor& dy, const at::Tensor& x) { return pointwise<Act>(x, dy); }

// An autograd node that saves its input alone (the eager gated unit saves the gate, its activation and up) and
// computes Forward(x), and Backward(dy, x) for the gradient.
template <at::Tensor (*Forward)(const at::Tensor&), at::Tensor (*Backward)(const at::Tensor&, const at::Tensor&)>
class SavedInputNode : public torch::autograd::Function<SavedInputNode<Forward, Backward>> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_) {
    const at::Tensor x = x_.contiguous();
    ctx->save_for_backward({x});
    return Forward(x);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    return {Backward(grads[0], ctx->get_saved_variables()[0])};
  }
};

template <typename Act>
using GluNode = SavedInputNode<glu_forward<Act>, glu_backward<Act>>;

template <typename Act>
using PointwiseNode = SavedInputNode<pointwise_forward<Act>, pointwise_backward<Act>>;

}  // namespace study_kernels
