"""SwiGLU's C++ CPU gate (study/axes/kernels/swiglu.cpp) computes the eager formula silu(gate) * up, in value and in
gradient, for what the FFN passes it: float32, bf16 (the input projection's output under autocast) and float64; the
eager path stays for a GPU, torch.compile and a machine without a compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import study.axes.cpu_kernels as cpu_kernels
from study.axes import ACTIVATIONS
from study.axes.activation import Activation
from study.config import preset
from study.model import build_model

SwiGLU = ACTIVATIONS["swiglu"]


def _h(shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, generator=g)).to(dtype)


def _value_and_grad(fn, h: torch.Tensor, dy: torch.Tensor):
    h = h.detach().requires_grad_()
    y = fn(h)
    (dh,) = torch.autograd.grad(y, h, dy)
    return y.detach(), dh


def eager(h: torch.Tensor) -> torch.Tensor:
    return Activation.apply.__func__(SwiGLU, h)  # the contract's default: chunk, silu, product


@pytest.mark.parametrize("shape", [(4, 33, 2 * 70), (2, 3, 5, 8), (1, 2)])
def test_float32_equals_the_eager_formula_in_value_and_gradient(shape):
    h, dy = _h(shape), torch.randn(*shape[:-1], shape[-1] // 2)
    ours, want = _value_and_grad(SwiGLU.apply, h, dy), _value_and_grad(eager, h, dy)
    for got, ref in zip(ours, want):
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)


def test_bf16_is_computed_in_float32_and_rounded_once():
    """Within a bf16 ulp of the float64 value (eager bf16 rounds silu(gate) before the product, so it may be an ulp
    further), in value and gradient."""
    h, dy = _h((8, 16, 2 * 40), torch.bfloat16), torch.randn(8, 16, 40).to(torch.bfloat16)
    ours = _value_and_grad(SwiGLU.apply, h, dy)
    exact = _value_and_grad(eager, h.double(), dy.double())
    for got, ref in zip(ours, exact):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=2 ** -8)


def test_gradients_are_exact_in_float64():
    h = _h((3, 4, 10), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(SwiGLU.apply, (h,))


def test_a_model_computes_the_same_loss_and_gradients_through_both_paths(monkeypatch):
    torch.manual_seed(0)
    model = build_model(preset("llama2", vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2))
    x = torch.randint(0, 50, (2, 9))

    def loss_and_grads():
        model.zero_grad()
        loss = F.cross_entropy(model(x).view(-1, 50), x.view(-1))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ours = loss_and_grads()
    monkeypatch.setattr(cpu_kernels, "_loaded", {**cpu_kernels._loaded, "swiglu": None})
    plain = loss_and_grads()
    torch.testing.assert_close(ours[0], plain[0], atol=1e-6, rtol=1e-6)
    for got, want in zip(ours[1], plain[1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
