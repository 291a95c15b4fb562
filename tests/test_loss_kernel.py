"""The fused loss's C++ pass (study/axes/kernels/cross_entropy_grad.cpp) is cross-entropy and its logit gradient:

- per row, -log p[target] as F.cross_entropy gives it, and softmax - target_weight * one_hot written over the logits
  (rounded once to bfloat16 for bfloat16 logits); ignored rows give 0 and a zero row; a bad target is refused;
- a target whose probability underflows keeps its exact loss, and a NaN logit reaches the loss;
- its accumulate_ adds a bfloat16 tensor to a float32 one;
- linear_cross_entropy through the kernel equals it through eager ops (the path of a GPU or a machine without a
  compiler), which tests/test_loss.py holds to F.cross_entropy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import study.model.loss as loss_module
from study.axes.cpu_kernels import cpu_ops
from study.model.loss import linear_cross_entropy


@pytest.fixture(scope="module")
def ops():
    built = cpu_ops("cross_entropy_grad")
    assert built is not None  # a machine that runs the suite has a compiler
    return built


def _problem(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    return logits, targets


def _reference(logits: torch.Tensor, targets: torch.Tensor):
    """Per-row F.cross_entropy of the logits in float32, and the gradient of their sum by autograd."""
    z = logits.float().requires_grad_()
    nll = F.cross_entropy(z, targets, reduction="none")
    (grad,) = torch.autograd.grad(nll.sum(), z)
    return nll.detach(), grad


@pytest.mark.parametrize("rows, vocab", [(37, 8000), (5, 3), (64, 300)])
def test_float32_rows_are_cross_entropy_and_its_gradient(ops, rows, vocab):
    logits, targets = _problem(rows, vocab, torch.float32)
    want_nll, want_grad = _reference(logits, targets)
    z = logits.clone()
    nll = ops.forward_(z, targets, 1.0, -100)
    torch.testing.assert_close(nll, want_nll, atol=4e-6, rtol=1e-6)
    torch.testing.assert_close(z, want_grad, atol=1e-6, rtol=1e-5)


def test_bfloat16_rows_round_the_float32_gradient_once(ops):
    """The loss is taken from the bf16 logits in float32; the gradient is the float32 one rounded to bf16, within one
    bf16 ulp (exp's last bits may put a value on the other side of a rounding boundary)."""
    logits, targets = _problem(48, 8000, torch.bfloat16)
    want_nll, want_grad = _reference(logits, targets)
    z = logits.clone()
    nll = ops.forward_(z, targets, 1.0, -100)
    assert nll.dtype == torch.float32 and z.dtype == torch.bfloat16
    torch.testing.assert_close(nll, want_nll, atol=4e-6, rtol=1e-6)
    rounded = want_grad.to(torch.bfloat16).float()
    ulp = torch.finfo(torch.bfloat16).eps * rounded.abs().clamp(min=torch.finfo(torch.float32).tiny)
    assert ((z.float() - rounded).abs() <= ulp).all()
    assert (z.float() == rounded).float().mean() > 0.99  # nearly all rounded exactly as `.to(torch.bfloat16)`


def test_the_target_weight_is_label_smoothings_share_of_the_one_hot(ops):
    logits, targets = _problem(16, 50, torch.float32)
    z = logits.clone()
    ops.forward_(z, targets, 0.9, -100)
    want = torch.softmax(logits, dim=-1)
    want[torch.arange(16), targets] -= 0.9
    torch.testing.assert_close(z, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ignored_rows_give_no_loss_and_no_gradient(ops, dtype):
    logits, targets = _problem(10, 100, dtype)
    targets[[0, 4, 9]] = -1
    z = logits.clone()
    nll = ops.forward_(z, targets, 1.0, -1)
    assert (nll[[0, 4, 9]] == 0).all() and (z[[0, 4, 9]] == 0).all()
    kept = targets != -1
    want_nll, want_grad = _reference(logits[kept], targets[kept])
    torch.testing.assert_close(nll[kept], want_nll, atol=4e-6, rtol=1e-6)
    torch.testing.assert_close(z[kept].float(), want_grad, atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)


@pytest.mark.parametrize("bad", [100, -2])
def test_a_target_outside_the_vocabulary_is_refused_by_row(ops, bad):
    logits, targets = _problem(4, 100, torch.float32)
    targets[2] = bad
    with pytest.raises(RuntimeError, match=f"target {bad} of row 2 is out of bounds for 100 classes"):
        ops.forward_(logits, targets, 1.0, -100)


def test_an_underflowing_target_keeps_its_exact_loss_and_nan_reaches_the_loss(ops):
    """p[target] = e^-200 underflows float32 (a softmax's pick would be 0, its log -inf): logsumexp - x_t is 200."""
    logits = torch.tensor([[0.0, -200.0, 1.0], [0.0, float("nan"), 1.0]])
    nll = ops.forward_(logits.clone(), torch.tensor([1, 0]), 1.0, -100)
    want = torch.log(1 + torch.exp(torch.tensor(1.0))) + 200.0
    torch.testing.assert_close(nll[0], want)
    assert torch.isnan(nll[1])


def test_accumulate_adds_bfloat16_to_float32(ops):
    acc = torch.randn(300, 70)
    part = torch.randn(300, 70).to(torch.bfloat16)
    want = acc + part.float()
    ops.accumulate_(acc, part)
    assert torch.equal(acc, want)
    with pytest.raises(RuntimeError, match="bfloat16 tensor of the accumulator's shape"):
        ops.accumulate_(acc, part[:10])


def _loss_and_grads(h, w, b, t, chunk_size, eps):
    params = [h, w, b]
    loss = linear_cross_entropy(h, w, t, b, chunk_size=chunk_size, label_smoothing=eps)
    return [loss.detach(), *torch.autograd.grad(loss, params)]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [7, 64])
def test_the_fused_loss_through_the_kernel_equals_it_through_eager_ops(monkeypatch, autocast, eps, chunk_size):
    """Same loss and gradients with the C++ pass and without it (float32: to rounding; bf16 autocast: both round the
    same float32 gradient to bf16, so to a bf16 ulp of the logit gradient, summed). W's scale makes some targets'
    probabilities underflow, where the eager path's log_softmax takes over."""
    torch.manual_seed(0)
    h = torch.randn(50, 16, requires_grad=True)
    w = (4 * torch.randn(300, 16)).requires_grad_()
    b = torch.randn(300, requires_grad=True)
    t = torch.randint(0, 300, (50,))
    t[::5] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        kernel = _loss_and_grads(h, w, b, t, chunk_size, eps)
        monkeypatch.setattr(loss_module, "eager_cpu_ops", lambda name, x: None)
        eager = _loss_and_grads(h, w, b, t, chunk_size, eps)
    torch.testing.assert_close(kernel[0], eager[0], atol=0, rtol=1e-5)
    for got, want in zip(kernel[1:], eager[1:]):
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, atol=(1e-2 if autocast else 1e-6) * scale, rtol=0)
