"""RoPE's C++ CPU rotation (`rotary_cpu`, study/axes/kernels/rotary.cpp) computes the eager formula
(`apply_rotary_reference`), in value and in gradient, for the tensors attention passes it: float32, bf16 (q and k
under autocast) and float64, strided as the head split leaves them; the eager path stays for the rest."""

from __future__ import annotations

import pytest
import torch

import study.axes.position as position
from study.axes.position import apply_rotary, apply_rotary_reference, rotary_cpu
from study.config import preset
from study.model import build_model


def _angles(length: int, dim: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rope = position.POSITIONS["rope"](preset("llama2", d_model=4 * dim, n_heads=4, n_kv_heads=4), causal=True)
    return rope.rotary(torch.arange(offset, offset + length))


def _heads(b: int, h: int, t: int, d: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """(B, H, T, D) as attention makes it: a view of (B, T, H, D), so not contiguous."""
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(b, t, h, d, generator=g)).to(dtype).transpose(1, 2)


def _value_and_grad(fn, x: torch.Tensor, cos, sin, dy: torch.Tensor):
    x = x.detach().requires_grad_()
    y = fn(x, cos, sin)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y.detach(), dx


@pytest.mark.parametrize("shape", [(2, 4, 16, 32), (3, 2, 5, 6), (1, 1, 1, 2)])
def test_float32_equals_the_eager_formula_in_value_and_gradient(shape):
    b, h, t, d = shape
    x, cos_sin = _heads(b, h, t, d), _angles(t, d, offset=3)
    assert not x.is_contiguous() or b * h * t == 1
    dy = torch.randn(b, h, t, d)
    ours = _value_and_grad(rotary_cpu, x, *cos_sin, dy)
    eager = _value_and_grad(apply_rotary_reference, x, *cos_sin, dy)
    for got, want in zip(ours, eager):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_bf16_input_is_computed_in_float32_and_rounded_once():
    """The result and the gradient are the float64 values rounded once to bf16 (half an ulp); the eager formula
    rounds its two gradient terms separately, so the two paths may differ by an ulp."""
    x, (cos, sin) = _heads(2, 4, 9, 16, dtype=torch.bfloat16), _angles(9, 16)
    dy = torch.randn(2, 4, 9, 16).to(torch.bfloat16)
    ours = _value_and_grad(rotary_cpu, x, cos, sin, dy)
    exact = _value_and_grad(apply_rotary_reference, x.double(), cos.double(), sin.double(), dy.double())
    eager = _value_and_grad(apply_rotary_reference, x, cos, sin, dy)
    for got, want, other in zip(ours, exact, eager):
        assert got.dtype == torch.bfloat16
        assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-6).all()
        assert ((got.double() - other.double()).abs() <= 2 ** -7 * other.double().abs().max()).all()


def test_gradients_are_exact_in_float64():
    x = _heads(2, 2, 3, 4, dtype=torch.float64).detach().requires_grad_()
    cos, sin = _angles(3, 4)
    assert torch.autograd.gradcheck(lambda x: rotary_cpu(x, cos, sin), (x,))


def test_the_transpose_holds_for_any_cos_and_sin():
    """The backward is the rotation's transpose for arbitrary (T, D) tables, not only RoPE's repeated halves."""
    x = _heads(1, 2, 4, 6, dtype=torch.float64).detach().requires_grad_()
    cos, sin = torch.randn(4, 6), torch.randn(4, 6)
    assert torch.autograd.gradcheck(lambda x: rotary_cpu(x, cos, sin), (x,))


def test_a_model_trains_the_same_through_the_kernel_and_the_eager_path(monkeypatch):
    torch.manual_seed(0)
    model = build_model(preset("llama2", vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2))
    ids = torch.randint(0, 50, (3, 11))
    results = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(position, "_rotary_kernel", lambda x, cos, sin: None)
        model.zero_grad()
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-6)
    for got, want in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_other_layouts_and_dtypes_take_the_eager_path():
    cos, sin = _angles(5, 8)
    others = [torch.randn(5, 8),  # not (B, H, T, D)
              _heads(1, 2, 5, 8, dtype=torch.float16),  # no half-precision kernel but bf16
              torch.randn(8, 5, 2, 1).permute(3, 2, 1, 0)]  # last dim not dense
    for x in others:
        assert position._rotary_kernel(x, cos, sin) is None
        torch.testing.assert_close(apply_rotary(x, cos, sin), apply_rotary_reference(x, cos, sin))
    x = _heads(2, 2, 5, 8)
    per_row = (cos.expand(2, 5, 8), sin.expand(2, 5, 8))  # angles per batch row
    assert position._rotary_kernel(x, *per_row) is None
