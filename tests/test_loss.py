"""The fused output-projection + cross-entropy equals the plain computation."""

import pytest
import torch
import torch.nn.functional as F

from study.config import ModelConfig
from study.model import build_model
from study.model.loss import linear_cross_entropy


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [7, 64, None])
def test_loss_and_gradients_equal_the_plain_path(bias, chunk_size):
    torch.manual_seed(0)
    n, d, v = 50, 16, 300
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    b = torch.randn(v, requires_grad=True) if bias else None
    t = torch.randint(0, v, (n,))
    t[::5] = -100  # ignored targets
    fused = linear_cross_entropy(h, w, t, b, chunk_size=chunk_size)
    grads = torch.autograd.grad(fused, [h, w] + ([b] if bias else []))
    plain = F.cross_entropy(F.linear(h, w, b), t, ignore_index=-100)
    expected = torch.autograd.grad(plain, [h, w] + ([b] if bias else []))
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-5)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_decoder_loss_equals_cross_entropy_of_its_logits():
    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16))
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    torch.testing.assert_close(model.loss(x, y), F.cross_entropy(model(x).flatten(0, 1), y.flatten()),
                               atol=1e-6, rtol=1e-5)


def test_the_loss_is_scaled_by_the_incoming_gradient():
    h = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(10, 4)
    t = torch.randint(0, 10, (8,))
    (g_fused,) = torch.autograd.grad(3 * linear_cross_entropy(h, w, t), [h])
    (g_plain,) = torch.autograd.grad(3 * F.cross_entropy(h @ w.t(), t), [h])
    torch.testing.assert_close(g_fused, g_plain, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# Label smoothing: PyTorch's F.cross_entropy(..., label_smoothing=eps), a (1 - eps) one-hot + eps uniform target


def smoothed_problem(bias: bool, scale: float = 1.0):
    """h (50, 16), W (300, 16) [, b], and targets with every fifth one ignored; `scale` > 1 makes some logits so large
    that the softmax's pick of a target underflows."""
    torch.manual_seed(0)
    n, d, v = 50, 16, 300
    h = torch.randn(n, d, requires_grad=True)
    w = (torch.randn(v, d) * scale).requires_grad_()
    b = torch.randn(v, requires_grad=True) if bias else None
    t = torch.randint(0, v, (n,))
    t[::5] = -100
    return h, w, b, t


def loss_and_grads(loss_fn, h, w, b):
    params = [h, w] + ([b] if b is not None else [])
    loss = loss_fn()
    return [loss.detach(), *torch.autograd.grad(loss, params)]


def plain_smoothed(h, w, b, t, eps):
    return F.cross_entropy(F.linear(h, w, b).float(), t, ignore_index=-100, label_smoothing=eps)


@pytest.mark.parametrize("eps", [0.1, 0.3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [7, None])
def test_label_smoothing_equals_pytorchs_in_loss_and_gradients(eps, bias, chunk_size):
    h, w, b, t = smoothed_problem(bias)
    fused = loss_and_grads(lambda: linear_cross_entropy(h, w, t, b, chunk_size=chunk_size, label_smoothing=eps),
                           h, w, b)
    plain = loss_and_grads(lambda: plain_smoothed(h, w, b, t, eps), h, w, b)
    for got, expected in zip(fused, plain):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_label_smoothing_under_bf16_autocast_agrees_with_the_plain_path_to_bf16_precision(eps):
    # Both paths multiply in bf16 and take the softmax in float32; they round the logits' gradient differently (the
    # fused path adds the uniform -eps/V in float32 after the matmuls), so they agree to bf16's ~4e-3, not bit for bit.
    h, w, b, t = smoothed_problem(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = loss_and_grads(lambda: linear_cross_entropy(h, w, t, b, chunk_size=7, label_smoothing=eps), h, w, b)
        plain = loss_and_grads(lambda: plain_smoothed(h, w, b, t, eps), h, w, b)
    torch.testing.assert_close(fused[0], plain[0], atol=0.0, rtol=4e-3)
    for got, expected in zip(fused[1:], plain[1:]):
        assert got.dtype == expected.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=2e-2 * float(expected.abs().max()), rtol=0.0)


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_label_smoothing_on_the_device_path_equals_pytorchs(monkeypatch, eps):
    # The path a GPU takes (no host reads, eager ops, not the CPU's C++ pass): every row masked, every underflowing
    # pick corrected without asking.
    monkeypatch.setattr("study.model.loss.host_reads_are_free", lambda device: False)
    monkeypatch.setattr("study.model.loss.eager_cpu_ops", lambda name, x: None)
    h, w, b, t = smoothed_problem(bias=True, scale=4.0)
    fused = loss_and_grads(lambda: linear_cross_entropy(h, w, t, b, chunk_size=16, label_smoothing=eps), h, w, b)
    plain = loss_and_grads(lambda: plain_smoothed(h, w, b, t, eps), h, w, b)
    for got, expected in zip(fused, plain):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_label_smoothing_applies_when_nothing_needs_a_gradient():
    h, w, b, t = smoothed_problem(bias=True)
    h, w, b = h.detach(), w.detach(), b.detach()
    torch.testing.assert_close(linear_cross_entropy(h, w, t, b, label_smoothing=0.1), plain_smoothed(h, w, b, t, 0.1))


def test_the_encoder_decoder_loss_equals_smoothed_cross_entropy_of_its_logits():
    model = build_model(ModelConfig(arch="encoder-decoder", vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                    max_seq_len=16))
    src, tgt, y = torch.randint(0, 64, (3, 12)), torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    src_mask = torch.ones(3, 12, dtype=torch.bool)
    src_mask[0, 8:] = False  # a padded source
    y[1, 10:] = -100  # a padded target
    fused = model.loss(src, tgt, y, src_mask, label_smoothing=0.1)
    plain = F.cross_entropy(model(src, tgt, src_mask).flatten(0, 1), y.flatten(), ignore_index=-100,
                            label_smoothing=0.1)
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-5)
