"""RMSNorm's fast path (`rms_norm`, an analytic backward) computes the same function as the plain formula
(`rms_norm_reference`, Hugging Face Llama's and T5's order), in value and in gradient, wherever the model calls it:
through the C++ CPU kernel and its C++ autograd node (study/axes/kernels/rms_norm.cpp) and through the eager path
(`RMSNormFunction`) a GPU, torch.compile and a machine without a compiler take."""

from __future__ import annotations

import pytest
import torch

import study.axes.norm as norm_module
from study.axes.cpu_kernels import cpu_ops
from study.axes.norm import NORMS, RMSNorm, rms_norm, rms_norm_reference

FP32 = dict(atol=2e-6, rtol=2e-6)


@pytest.fixture(autouse=True, params=["cpp", "eager"])
def kernel_path(request, monkeypatch):
    """Every test below runs once through the C++ kernel and once through the eager path."""
    if request.param == "eager":
        monkeypatch.setattr(norm_module, "_cpu_kernel", lambda x: None)
    return request.param


def test_on_a_cpu_the_compiled_kernel_is_built_and_runs(kernel_path):
    if kernel_path == "eager":
        pytest.skip("about the C++ path")
    assert cpu_ops("rms_norm") is not None  # a machine that runs the suite has a compiler: the build must succeed
    x = torch.randn(4, 8, requires_grad=True)
    with torch.profiler.profile() as prof:
        _norm(8)(x).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert "study_rms_norm::rms_norm" in names, names


def assert_equal_to_float32_rounding(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Within a few float32 ulps (8 x 1.2e-7) of the largest entry: what summing in another order can change."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert (ours - ref).abs().max() <= 1e-6 * ref.abs().max(), (ours - ref).abs().max() / ref.abs().max()


def _norm(dim: int, eps: float = 1e-6, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(dim, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)))  # not all ones
    return norm


def _value_and_grads(fn, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor):
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    y = fn(x, weight)
    dx, dw = torch.autograd.grad(y, (x, weight), dy)
    return y.detach(), dx, dw


@pytest.mark.parametrize("shape", [(16, 128, 128), (8, 256, 512), (3, 7, 5), (1, 1, 3), (2, 3, 4, 33)])
def test_fast_path_equals_the_plain_formula_in_float32(shape):
    torch.manual_seed(0)
    x, dy = torch.randn(shape) * 3, torch.randn(shape)
    norm = _norm(shape[-1])
    fast = _value_and_grads(lambda x, w: rms_norm(x, w, norm.eps), x, norm.weight, dy)
    plain = _value_and_grads(lambda x, w: rms_norm_reference(x, w, norm.eps), x, norm.weight, dy)
    for ours, ref in zip(fast, plain):
        assert_equal_to_float32_rounding(ours, ref)


def test_the_module_takes_the_fast_path_for_float32_input(kernel_path):
    norm = _norm(8)
    y = norm(torch.randn(4, 8, requires_grad=True))
    want = "RMSNormNode" if kernel_path == "cpp" else "RMSNormFunctionBackward"  # the C++ or the Python node
    assert want in y.grad_fn.name()


def test_gradients_are_exact_in_float64():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, weight))


def test_gradients_are_exact_where_eps_dominates():
    x = (1e-4 * torch.randn(2, 4, 6, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, weight))


def test_non_contiguous_input_and_gradient():
    torch.manual_seed(2)
    x = torch.randn(8, 32, 16).transpose(0, 1)  # (32, 8, 16), strides not row-major
    dy = torch.randn(16, 8, 32).permute(2, 1, 0)
    assert not x.is_contiguous() and not dy.is_contiguous()
    norm = _norm(16)
    fast = _value_and_grads(lambda x, w: rms_norm(x, w, norm.eps), x, norm.weight, dy)
    plain = _value_and_grads(lambda x, w: rms_norm_reference(x, w, norm.eps), x.contiguous(), norm.weight, dy)
    for ours, ref in zip(fast, plain):
        assert_equal_to_float32_rounding(ours, ref)


def test_under_bf16_autocast_it_stays_float32_and_equal():
    """The residual stream is float32 under autocast; the norm must not let autocast run its products in bf16."""
    torch.manual_seed(3)
    x, dy = torch.randn(4, 16, 64), torch.randn(4, 16, 64)
    norm = _norm(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = _value_and_grads(lambda x, w: rms_norm(x, w, norm.eps), x, norm.weight, dy)
    plain = _value_and_grads(lambda x, w: rms_norm_reference(x, w, norm.eps), x, norm.weight, dy)
    assert fast[0].dtype == torch.float32
    for ours, ref in zip(fast, plain):
        assert_equal_to_float32_rounding(ours, ref)


def test_bf16_input_keeps_the_llama_rounding():
    """A bf16 tensor (a model cast to bf16) takes the plain formula: normalised in float32, rounded, then scaled."""
    torch.manual_seed(4)
    norm = _norm(32).to(torch.bfloat16)
    x = torch.randn(5, 32).to(torch.bfloat16)
    assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, norm.eps))


def test_bf16_input_with_float32_weight_is_close_to_float32():
    torch.manual_seed(5)
    norm = _norm(32)
    x = torch.randn(5, 32)
    torch.testing.assert_close(norm(x.to(torch.bfloat16)), norm(x), atol=3e-2, rtol=1e-2)


def test_state_dict_keys_are_unchanged():
    assert list(_norm(8).state_dict()) == ["weight"]
    assert NORMS["rmsnorm"] is RMSNorm


def test_compiles_with_torch_compile():
    pytest.importorskip("torch._dynamo")
    norm = _norm(16)
    x = torch.randn(2, 3, 16, requires_grad=True)
    compiled = torch.compile(norm, backend="eager")  # dynamo must trace the custom function (train.compile)
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, rms_norm_reference(x, norm.weight, norm.eps), **FP32)
