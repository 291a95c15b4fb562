// Rotary position embedding (Su et al. 2021) applied to q or k on CPU tensors in one pass: out = x cos + rot(x) sin
// with rot(x) = (-x2, x1) over the halves of each head (GPT-NeoX / Hugging Face Llama layout), and its transpose for
// the backward. Eager PyTorch runs this as five element-wise kernels and a concatenation, each a pass over q or k,
// which made RoPE's training step 15-18% slower than the other position schemes' on a 2-core CPU
// (bench/axis_cost.py): an ablation would time our code, not the idea. Built on first use by
// study/axes/cpu_kernels.py; study/axes/position.py's `rotary_cpu` calls `rotary`, whose autograd node (below)
// runs both directions.
//
// x: (B, H, T, D) with a contiguous last dimension (any other strides); cos, sin: (T, D) float32. The result is
// contiguous, in x's dtype, computed in float32 (float64 for float64 x) as the eager formula is under autocast.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace {

template <typename T>
void rotate_rows(const at::Tensor& x, const float* cos, const float* sin, T* out, bool transpose, int threads) {
  using C = at::opmath_type<T>;
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3), half = D / 2;
  const int64_t sb = x.stride(0), sh = x.stride(1), sl = x.stride(2);
  const T* base = x.data_ptr<T>();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t t = 0; t < L; ++t) {
      const T* xr = base + b * sb + h * sh + t * sl;
      T* o = out + (bh * L + t) * D;
      const float* c = cos + t * D;
      const float* s = sin + t * D;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const C x1 = static_cast<C>(xr[i]), x2 = static_cast<C>(xr[i + half]);
        if (transpose) {  // the Jacobian's transpose: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
          o[i] = static_cast<T>(x1 * C(c[i]) + x2 * C(s[i + half]));
          o[i + half] = static_cast<T>(x2 * C(c[i + half]) - x1 * C(s[i]));
        } else {  // out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2
          o[i] = static_cast<T>(x1 * C(c[i]) - x2 * C(s[i]));
          o[i + half] = static_cast<T>(x2 * C(c[i + half]) + x1 * C(s[i + half]));
        }
      }
    }
  }
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos_, const at::Tensor& sin_, bool transpose) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.stride(3) == 1, "rotary: (B, H, T, D) CPU x, last dim dense");
  TORCH_CHECK(x.size(3) % 2 == 0, "rotary: the head dimension must be even");
  TORCH_CHECK(cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat, "rotary: float32 cos and sin");
  TORCH_CHECK(cos_.dim() == 2 && cos_.size(0) == x.size(2) && cos_.size(1) == x.size(3) &&
                  sin_.sizes() == cos_.sizes(), "rotary: cos and sin must be (T, D)");
  const at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rotary", [&] {
    rotate_rows<scalar_t>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<scalar_t>(), transpose,
                          at::get_num_threads());
  });
  return out;
}

// The autograd node in C++ (as RMSNorm's): a Python autograd.Function's calls cost a visible share of a small
// model's step, twice per layer each way.
class RotaryNode : public torch::autograd::Function<RotaryNode> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotate(x, cos, sin, false);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor dy = grads[0].stride(3) == 1 ? grads[0] : grads[0].contiguous();
    return {rotate(dy, saved[0], saved[1], true), at::Tensor(), at::Tensor()};
  }
};

at::Tensor rotary_autograd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return RotaryNode::apply(x, cos, sin);
}

at::Tensor rotary_no_grad(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotate(x, cos, sin, false);
}

}  // namespace

TORCH_LIBRARY(study_rotary, m) {
  m.def("rotate(Tensor x, Tensor cos, Tensor sin, bool transpose) -> Tensor", &rotate);
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");  // rotate(x), differentiable in x
}

TORCH_LIBRARY_IMPL(study_rotary, Autograd, m) { m.impl("rotary", &rotary_autograd); }

TORCH_LIBRARY_IMPL(study_rotary, CPU, m) { m.impl("rotary", &rotary_no_grad); }
