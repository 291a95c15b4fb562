// RMSNorm forward and backward for CPU tensors (float32, float64), one pass over each row's memory per direction
// (Zhang & Sennrich 2019). Eager PyTorch has no fused CPU RMSNorm (`F.rms_norm` is a composite of five element-wise
// kernels there); LayerNorm's CPU kernel is fused, so without this an ablation would time our composite, not the
// idea. Built on first use by study/axes/cpu_kernels.py; study/axes/norm.py's `rms_norm` calls `rms_norm`, whose
// autograd node (below) runs the two directions.
//
// With r = (mean(x^2) + eps)^(-1/2) per row:  y = (x r) g,
//   dx = (x k + dy g) r  with  k = -r^2 mean(g dy x),   dg = sum over rows of dy x r.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

template <typename T>
void forward_rows(const T* x, const T* g, T* y, T* rstd, int64_t rows, int64_t d, T eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    T squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t j = 0; j < d; ++j) squares += xr[j] * xr[j];
    const T rs = T(1) / std::sqrt(squares / T(d) + eps);
    rstd[r] = rs;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) yr[j] = (xr[j] * rs) * g[j];
  }
}

// Rows are split into one contiguous block per thread. dg sums each block's rows in T over runs of kFlush rows (a
// vectorised add per element), then adds each run's sum to a float64 total: close to a float64 sum over the rows,
// at a 32nd of its float64 additions.
constexpr int64_t kFlush = 32;

template <typename T>
void backward_rows(const T* dy, const T* x, const T* rstd, const T* g, T* dx, T* dg, int64_t rows, int64_t d,
                   int threads) {
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(threads, rows));
  std::vector<double> partial(blocks * d, 0.0);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    double* pg = partial.data() + b * d;
    std::vector<T> run(d, T(0));
    T* rg = run.data();
    const int64_t begin = rows * b / blocks, end = rows * (b + 1) / blocks;
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      const T* dyr = dy + r * d;
      T* dxr = dx + r * d;
      const T rs = rstd[r];
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < d; ++j) dot += dyr[j] * xr[j] * g[j];
      const T k = -(rs * rs) * dot / T(d);
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) {
        dxr[j] = (xr[j] * k + dyr[j] * g[j]) * rs;
        rg[j] += dyr[j] * xr[j] * rs;
      }
      if ((r - begin) % kFlush == kFlush - 1 || r == end - 1) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) {
          pg[j] += static_cast<double>(rg[j]);
          rg[j] = T(0);
        }
      }
    }
  }
  for (int64_t j = 0; j < d; ++j) {
    double total = 0;
    for (int64_t b = 0; b < blocks; ++b) total += partial[b * d + j];
    dg[j] = static_cast<T>(total);
  }
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.numel() && weight.dim() == 1, "rms_norm: weight must be (d,)");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x_, const at::Tensor& weight_, double eps) {
  check(x_, weight_);
  const at::Tensor x = x_.contiguous(), weight = weight_.contiguous();
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = 1;
  at::Tensor rstd = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_forward", [&] {
    forward_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                           rstd.data_ptr<scalar_t>(), rows, d, static_cast<scalar_t>(eps), at::get_num_threads());
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy_, const at::Tensor& x_,
                                                     const at::Tensor& rstd_, const at::Tensor& weight_) {
  check(x_, weight_);
  TORCH_CHECK(dy_.sizes() == x_.sizes() && dy_.scalar_type() == x_.scalar_type(), "rms_norm: dy must match x");
  const at::Tensor dy = dy_.contiguous(), x = x_.contiguous(), rstd = rstd_.contiguous(), weight = weight_.contiguous();
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dweight = at::empty_like(weight);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_backward", [&] {
    backward_rows<scalar_t>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), rstd.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), dweight.data_ptr<scalar_t>(), rows,
                            d, at::get_num_threads());
  });
  return {dx, dweight};
}

// The autograd node in C++, as LayerNorm's is: a Python autograd.Function costs about as much in calls per direction
// as the kernel itself at the default sweep's sizes on one thread (bench/axis_cost.py).
class RMSNormNode : public torch::autograd::Function<RMSNormNode> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    auto [y, rstd] = rms_norm_forward(x, weight, eps);
    ctx->save_for_backward({x, rstd, weight});
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dweight] = rms_norm_backward(grads[0], saved[0], saved[1], saved[2]);
    return {dx, dweight, at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RMSNormNode::apply(x, weight, eps);
}

at::Tensor rms_norm_no_grad(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(rms_norm_forward(x, weight, eps));
}

}  // namespace

TORCH_LIBRARY(study_rms_norm, m) {
  m.def("forward(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)", &rms_norm_forward);
  m.def("backward(Tensor dy, Tensor x, Tensor rstd, Tensor weight) -> (Tensor, Tensor)", &rms_norm_backward);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");  // y, differentiable in x and weight
}

TORCH_LIBRARY_IMPL(study_rms_norm, Autograd, m) { m.impl("rms_norm", &rms_norm_autograd); }

TORCH_LIBRARY_IMPL(study_rms_norm, CPU, m) { m.impl("rms_norm", &rms_norm_no_grad); }
