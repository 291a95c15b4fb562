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
