"""Half-precision attention on the CPU: SDPA's fused kernel forward, our own backward (study.model.attention).

The kernel's bf16 backward is several times slower than its float32 backward at short lengths, and both are slower
than batched GEMMs around two C++ passes over the scores (bench/README.md, `axis_cost.py --attention`); a
half-precision CPU training step therefore keeps the kernel's forward and runs `_CpuShortAttention`'s backward: the
C++ one in bf16, the kernel's float32 backward in fp16 or without a compiler. These tests hold the outputs to SDPA's,
the gradients of both backwards to a float64 reference, and the rule to the calls it is for.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from study.config import preset
from study.axes.cpu_kernels import cpu_ops
from study.model import attention
from study.model.attention import _CpuShortAttention, _short_backward_pays, _sdpa
from study.model.transformer import build_model

pytestmark = pytest.mark.skipif(attention._cpu_flash_backward is None, reason="this torch has no CPU flash kernel")


def _inputs(b=3, nh=4, nkv=4, t=11, tk=11, hs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, length, hs, generator=g) for n, length in ((nh, t), (nkv, tk), (nkv, tk)))
    return q, k, v, torch.randn(b, nh, t, hs, generator=g)


def _padding_bias(b, tk, seed=1):
    keep = torch.rand(b, 1, 1, tk, generator=torch.Generator().manual_seed(seed)) > 0.3
    keep[..., 0] = True
    return torch.where(keep, 0.0, attention.MASKED)


def _grads(fn, tensors, grad_out, dtype):
    leaves = [x.to(dtype).requires_grad_() for x in tensors]
    out = fn(*leaves)
    out.backward(grad_out.to(dtype))
    return out, [x.grad for x in leaves]


def _rel_err(ref, got):
    return ((ref - got.double()).abs().max() / ref.abs().max()).item()


def _per_head_bias(nh, t, tk):
    """ALiBi's shape: one (T, Tk) bias per head, shared by the batch (a stride-0 batch dimension)."""
    distance = (torch.arange(t)[:, None] - torch.arange(tk)[None, :]).abs()
    return -torch.linspace(0.25, 1.0, nh)[None, :, None, None] * distance


CASES = {
    "causal": dict(kw=dict(), causal=True, bias=None),
    "padding": dict(kw=dict(), causal=False, bias=_padding_bias),
    "gqa causal": dict(kw=dict(nkv=2), causal=True, bias=None),
    "cross-attention": dict(kw=dict(t=7, tk=13), causal=False, bias=_padding_bias),
    "gqa per-head bias": dict(kw=dict(nkv=2), causal=False, bias=lambda b, tk: _per_head_bias(4, 11, tk)),
}


@pytest.fixture(params=["c++", "float32 flash"])
def backward_path(request, monkeypatch):
    """Each test below runs through the C++ backward and through the float32 fallback (no compiler, or fp16)."""
    if request.param == "c++":
        if cpu_ops("attention_grad") is None:
            pytest.skip("the C++ kernel could not be built here")
        calls = []
        real = attention.eager_cpu_ops
        monkeypatch.setattr(attention, "eager_cpu_ops", lambda *a: calls.append(a[0]) or real(*a))
        return calls
    monkeypatch.setattr(attention, "eager_cpu_ops", lambda *a: None)
    return None


@pytest.mark.parametrize("case", CASES)
def test_output_is_sdpa_and_gradients_match_float64(case, backward_path):
    spec = CASES[case]
    q, k, v, grad_out = _inputs(**spec["kw"])
    bias = spec["bias"](q.shape[0], k.shape[2]) if spec["bias"] else None
    gqa = q.shape[1] != k.shape[1]

    def sdpa(bias_dtype):
        b = None if bias is None else bias.to(bias_dtype)
        return lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=b, is_causal=spec["causal"],
                                                                 enable_gqa=gqa)

    ref_out, ref_grads = _grads(sdpa(torch.float64), (q, k, v), grad_out, torch.float64)
    sdpa_out, sdpa_grads = _grads(sdpa(torch.bfloat16), (q, k, v), grad_out, torch.bfloat16)
    b16 = None if bias is None else bias.bfloat16()
    ours_out, ours_grads = _grads(lambda q_, k_, v_: _CpuShortAttention.apply(q_, k_, v_, b16, spec["causal"]),
                                  (q, k, v), grad_out, torch.bfloat16)

    assert torch.equal(ours_out, sdpa_out)  # the same kernel forward
    for ref, ours, theirs in zip(ref_grads, ours_grads, sdpa_grads):
        assert ours.dtype == torch.bfloat16
        assert _rel_err(ref, ours) < 2e-2
        # no worse than SDPA's own bf16 backward (float32 scores and dP keep ours, if anything, closer)
        assert _rel_err(ref, ours) <= 1.5 * _rel_err(ref, theirs) + 1e-3
    assert backward_path is None or backward_path == ["attention_grad"]  # the path under test ran


def test_probabilities_are_zero_where_a_query_sees_no_key_and_beyond_the_causal_diagonal():
    ops = cpu_ops("attention_grad")
    if ops is None:
        pytest.skip("the C++ kernel could not be built here")
    scores = torch.randn(1, 2, 3, 3)
    lse = torch.logsumexp(scores.tril() + torch.full((3, 3), float("-inf")).triu(1), dim=-1)
    lse[0, 1, 2] = float("-inf")  # a query that saw no key
    p = scores.clone()
    p16 = ops.probs_(p, lse, None, True, 1.0)
    expected = torch.softmax(scores.masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
    expected[0, 1, 2] = 0.0
    torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(p16, p.bfloat16())
    key_bias = torch.tensor([0.0, -1.0, 2.0]).view(1, 1, 3, 1).expand(1, 2, 3, 3)  # one value per query: stride 0
    p = scores.clone()
    ops.probs_(p, lse, key_bias, False, 0.5)
    expected = torch.exp(scores * 0.5 + key_bias - lse[..., None])
    expected[0, 1, 2] = 0.0
    torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7)


def test_backward_called_inside_autocast_gives_what_it_gives_outside(backward_path):
    """Autocast around a backward would cast the backward's float32 GEMMs to bf16: both paths turn it off."""
    q, k, v, grad_out = _inputs(nkv=2)

    def grads(autocast):
        leaves = [x.bfloat16().requires_grad_() for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _CpuShortAttention.apply(*leaves, None, True).backward(grad_out.bfloat16())
        return [x.grad for x in leaves]

    for inside, outside in zip(grads(True), grads(False)):
        assert torch.equal(inside, outside)


def test_fp16_backward_is_the_float32_kernel_inside_autocast(monkeypatch):
    seen = []
    real = attention._cpu_flash_backward

    def spy(grad_out, q, *args, **kwargs):
        seen.append((grad_out.dtype, q.dtype))
        return real(grad_out, q, *args, **kwargs)

    monkeypatch.setattr(attention, "_cpu_flash_backward", spy)
    q, k, v, grad_out = (x.half().requires_grad_() for x in _inputs())
    with torch.autocast("cpu", dtype=torch.float16):
        out = _CpuShortAttention.apply(q, k, v, None, True)
        out.backward(grad_out.detach())
    assert seen == [(torch.float32, torch.float32)]


def test_rule_takes_only_short_half_precision_cpu_training_calls():
    q, k, v, _ = (x.bfloat16() for x in _inputs())
    trained = [x.requires_grad_() for x in (q.clone(), k.clone(), v.clone())]
    assert _short_backward_pays(*trained, None, 0.0)
    assert _short_backward_pays(*trained, _padding_bias(3, 11).bfloat16(), 0.0)  # a fixed bias (padding, ALiBi)
    assert not _short_backward_pays(q, k, v, None, 0.0)  # evaluation: nothing needs a gradient
    with torch.no_grad():
        assert not _short_backward_pays(*trained, None, 0.0)
    assert not _short_backward_pays(*trained, None, 0.1)  # attention dropout: SDPA's own path
    learned = torch.zeros(1, 4, 11, 11, dtype=torch.bfloat16, requires_grad=True)  # T5's bias needs its gradient
    assert not _short_backward_pays(*trained, learned, 0.0)
    f32 = [x.float().detach().requires_grad_() for x in trained]
    assert not _short_backward_pays(*f32, None, 0.0)  # float32 runs SDPA as it is
    long_q, long_k, long_v, _ = _inputs(t=256, tk=256)
    long = [x.bfloat16().requires_grad_() for x in (long_q, long_k, long_v)]
    assert not _short_backward_pays(*long, None, 0.0)  # from 256 keys the bf16 backward is as fast or faster


def test_sdpa_dispatches_through_the_rule(monkeypatch):
    calls = []
    monkeypatch.setattr(_CpuShortAttention, "apply", lambda *a: calls.append(a) or a[0])
    q, k, v, _ = (x.bfloat16().requires_grad_() for x in _inputs())
    _sdpa(q, k, v, None, True, 0.0, 1)
    assert len(calls) == 1
    _sdpa(q.detach(), k.detach(), v.detach(), None, True, 0.0, 1)
    assert len(calls) == 1


@pytest.mark.parametrize("position", ["rope", "alibi", "t5_bias"])
def test_a_bf16_training_step_matches_sdpa_everywhere(position, monkeypatch):
    """A whole decoder's bf16 gradients with the rule on equal those with it off up to bf16 rounding, for a position
    scheme without a bias, with a fixed bias, and with T5's learned bias (which must still get its gradient)."""
    cfg = preset("llama2", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=50, max_seq_len=32,
                 position=position)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 50, (4, 24), generator=torch.Generator().manual_seed(2))

    def grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours = grads()
    monkeypatch.setattr(attention, "_cpu_flash_backward", None)
    theirs = grads()
    assert ours.keys() == theirs.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for name in ours:
        scale = theirs[name].abs().max().clamp(min=1e-6)
        assert ((ours[name] - theirs[name]).abs().max() / scale).item() < 5e-2, name
