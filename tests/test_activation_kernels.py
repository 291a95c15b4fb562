"""The FFN activations' C++ CPU kernels (study/axes/kernels/activation.h, with swiglu.cpp, geglu.cpp and gelu_tanh.cpp)
compute the eager formula, act(h) or act(gate) * up, in value and in gradient, for what the FFN passes them: float32,
bf16 (the input projection's output under autocast) and float64; the eager path stays for a GPU, torch.compile and a
machine without a compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import study.axes.cpu_kernels as cpu_kernels
from study.axes import ACTIVATIONS
from study.config import preset
from study.model import build_model

WITH_KERNELS = [name for name, act in ACTIVATIONS.items() if act.cpu_kernel]


def _h(shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, generator=g)).to(dtype)


def _value_and_grad(fn, h: torch.Tensor, dy: torch.Tensor):
    h = h.detach().requires_grad_()
    y = fn(h)
    (dh,) = torch.autograd.grad(y, h, dy)
    return y.detach(), dh


@pytest.mark.parametrize("name", WITH_KERNELS)
@pytest.mark.parametrize("shape", [(4, 33, 2 * 70), (2, 3, 5, 8), (1, 2)])
def test_float32_equals_the_eager_formula_in_value_and_gradient(name, shape):
    act = ACTIVATIONS[name]
    h = _h(shape)
    dy = torch.randn(*shape[:-1], shape[-1] // 2 if act.gated else shape[-1])
    ours, want = _value_and_grad(act.apply, h, dy), _value_and_grad(act.eager, h, dy)
    for got, ref in zip(ours, want):
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("name", WITH_KERNELS)
def test_float32_is_within_1e_6_of_float64_far_into_the_tails(name):
    """Across the input's range (in float32 the kernels approximate erf and tanh, within 1e-6 of float64)."""
    act = ACTIVATIONS[name]
    g = torch.linspace(-12, 12, 4801)
    h = torch.cat([g, torch.full_like(g, 1.5)]) if act.gated else g
    ours = _value_and_grad(act.apply, h, torch.ones(4801))
    exact = _value_and_grad(act.eager, h.double(), torch.ones(4801).double())
    for got, ref in zip(ours, exact):
        torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", WITH_KERNELS)
def test_bf16_is_computed_in_float32_and_rounded_once(name):
    """Within a bf16 ulp of the float64 value (eager bf16 rounds act(gate) before the product, so it may be an ulp
    further), in value and gradient."""
    act = ACTIVATIONS[name]
    h, dy = _h((8, 16, 2 * 40), torch.bfloat16), torch.randn(8, 16, 40 * (1 if act.gated else 2)).to(torch.bfloat16)
    ours = _value_and_grad(act.apply, h, dy)
    exact = _value_and_grad(act.eager, h.double(), dy.double())
    for got, ref in zip(ours, exact):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=2 ** -8)


@pytest.mark.parametrize("name", WITH_KERNELS)
def test_gradients_are_exact_in_float64(name):
    h = _h((3, 4, 10), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(ACTIVATIONS[name].apply, (h,))


@pytest.mark.parametrize("name", WITH_KERNELS)
def test_a_model_computes_the_same_loss_and_gradients_through_both_paths(name, monkeypatch):
    torch.manual_seed(0)
    model = build_model(preset("llama2", vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               activation=name))
    x = torch.randint(0, 50, (2, 9))

    def loss_and_grads():
        model.zero_grad()
        loss = F.cross_entropy(model(x).view(-1, 50), x.view(-1))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ours = loss_and_grads()
    monkeypatch.setattr(cpu_kernels, "_loaded", {**cpu_kernels._loaded, ACTIVATIONS[name].cpu_kernel: None})
    plain = loss_and_grads()
    torch.testing.assert_close(ours[0], plain[0], atol=1e-6, rtol=1e-6)
    for got, want in zip(ours[1], plain[1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
