"""Properties that fail if a design axis is silently ignored."""

import math

import pytest
import torch

from study.axes import POSITIONS as POSITION_REGISTRY
from study.axes.position import LearnedPosition, RotaryPosition, alibi_slopes, apply_rotary
from study.config import ConfigError, ModelConfig, axis_choices
from study.model import KVCache, build_model
from study.model.attention import attention_bias

V = 50
POSITIONS = POSITION_REGISTRY.names()


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64)
    base.update(overrides)
    return ModelConfig(**base)


def run(model, x, **kw):
    cfg = model.config
    if cfg.arch == "encoder":
        return model(x, **kw)
    if cfg.arch == "encoder-decoder":
        return model(torch.randint(1, V, (x.shape[0], 7), generator=torch.Generator().manual_seed(1)), x)
    return model(x, **kw)


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("window", [None, 3])
def test_causal_models_never_see_the_future(arch, position, window):
    model = build_model(tiny(arch=arch, position=position, window=window)).eval()
    x = torch.randint(1, V, (2, 12))
    t = 6
    y = x.clone()
    y[:, t:] = torch.randint(1, V, (2, 12 - t))
    with torch.no_grad():
        a, b = run(model, x), run(model, y)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("position", POSITIONS)
def test_tokens_outside_the_window_have_no_influence(causal, position):
    window = 3
    arch = "decoder" if causal else "encoder"
    model = build_model(tiny(arch=arch, n_layers=1, window=window, position=position)).eval()
    x = torch.randint(1, V, (1, 16))
    j = 4  # perturb one token
    y = x.clone()
    y[0, j] = (x[0, j] % (V - 1)) + 1
    with torch.no_grad():
        diff = (run(model, x) - run(model, y)).abs().amax(-1)[0]
    for i in range(16):
        visible = (0 <= i - j < window) if causal else abs(i - j) < window
        assert (diff[i] > 1e-6) == visible, f"query {i}, perturbed key {j}, diff {diff[i]}"


def test_global_layers_of_a_local_global_pattern_see_everything():
    # one local and one global layer: the global layer lets the last token see the first
    cfg = tiny(n_layers=2, window=2, window_pattern="LG", position="rope")
    model = build_model(cfg).eval()
    x = torch.randint(1, V, (1, 12))
    y = x.clone()
    y[0, 0] = (x[0, 0] % (V - 1)) + 1
    with torch.no_grad():
        assert (model(x)[0, -1] - model(y)[0, -1]).abs().max() > 1e-6
    local_only = build_model(tiny(n_layers=2, window=2, position="rope")).eval()
    with torch.no_grad():  # two local layers of span 2 reach back 2 tokens only
        torch.testing.assert_close(local_only(x)[0, -1], local_only(y)[0, -1])


def test_rope_scores_depend_only_on_relative_position():
    cfg = tiny(position="rope")
    rope = RotaryPosition(cfg, causal=True)
    q, k = torch.randn(1, 1, 1, cfg.resolved_head_dim), torch.randn(1, 1, 1, cfg.resolved_head_dim)

    def score(m, n):
        cq, sq = rope.rotary(torch.tensor([m]))
        ck, sk = rope.rotary(torch.tensor([n]))
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    for m, n, shift in [(5, 2, 7), (0, 9, 30), (13, 13, 100)]:
        torch.testing.assert_close(score(m, n), score(m + shift, n + shift), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_alibi_slopes_follow_press_et_al():
    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    assert alibi_slopes(4) == [2.0 ** -(2 * (i + 1)) for i in range(4)]
    # 6 heads: the 4-head slopes, then every other slope of the 8-head sequence
    assert alibi_slopes(6) == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    assert len(alibi_slopes(12)) == 12 and len(set(alibi_slopes(12))) == 12


def _copy_shared_weights(src, dst):
    dst_state = dst.state_dict()
    for k, v in src.state_dict().items():
        if k in dst_state and dst_state[k].shape == v.shape:
            dst_state[k] = v
    dst.load_state_dict(dst_state)


def test_gqa_with_repeated_kv_heads_equals_mha():
    gqa = build_model(tiny(n_heads=4, n_kv_heads=2, position="rope")).eval()
    mha = build_model(tiny(n_heads=4, n_kv_heads=4, position="rope")).eval()
    _copy_shared_weights(gqa, mha)
    hd, d = 8, 32
    for g, m in zip(gqa.decoder.blocks, mha.decoder.blocks):
        q, k, v = g.self_attn.qkv_proj.weight.split([4 * hd, 2 * hd, 2 * hd])
        # query head h uses K/V head h // (n_heads / n_kv_heads)
        rep = lambda w: w.view(2, 1, hd, d).expand(2, 2, hd, d).reshape(4 * hd, d)  # noqa: E731
        with torch.no_grad():
            m.self_attn.qkv_proj.weight.copy_(torch.cat([q, rep(k), rep(v)]))
    x = torch.randint(1, V, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)
    assert ModelConfig(n_heads=4, n_kv_heads=4) == ModelConfig(n_heads=4, n_kv_heads=4)


def _incremental(model, x, src=None):
    cache = KVCache()
    outs = []
    if model.config.arch == "encoder-decoder":
        memory = model.encode(src)
        for t in range(x.shape[1]):
            outs.append(model.decode(x[:, t : t + 1], memory, cache=cache))
    else:
        outs.append(model(x[:, :3], cache=cache))  # a prompt, then one token at a time
        for t in range(3, x.shape[1]):
            outs.append(model(x[:, t : t + 1], cache=cache))
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("span", [dict(), dict(window=3), dict(window=3, window_pattern="LG")])
@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_cached_decoding_equals_the_full_forward(position, span, arch):
    cfg = tiny(arch=arch, position=position, n_kv_heads=2, **span)
    model = build_model(cfg).eval()
    x = torch.randint(1, V, (2, 11))
    src = torch.randint(1, V, (2, 7))
    with torch.no_grad():
        full = model(src, x) if arch == "encoder-decoder" else model(x)
        step, cache = _incremental(model, x, src)
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
    for layer, span in enumerate(cfg.layer_spans()):
        k, _ = cache.held(layer)
        held = 11 if span == "global" else cfg.window - 1  # a sliding-window layer's rolling cache
        assert k.shape == (2, 2, held, cfg.resolved_head_dim)  # n_kv_heads heads are stored, not n_heads


def test_encoder_padding_does_not_change_real_tokens():
    model = build_model(tiny(arch="encoder", position="alibi")).eval()
    x = torch.randint(1, V, (1, 6))
    padded = torch.cat([x, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.tensor([[True] * 6 + [False] * 4])
    with torch.no_grad():
        torch.testing.assert_close(model(padded, padding_mask=mask)[:, :6], model(x), atol=1e-5, rtol=1e-5)


def test_cross_attention_ignores_padded_source_tokens():
    model = build_model(tiny(arch="encoder-decoder", position="sinusoidal")).eval()
    src, tgt = torch.randint(1, V, (1, 5)), torch.randint(1, V, (1, 4))
    padded = torch.cat([src, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    with torch.no_grad():
        torch.testing.assert_close(model(padded, tgt, src_padding_mask=mask), model(src, tgt), atol=1e-5, rtol=1e-5)


# Each axis and a value different from the base; weights are copied wherever the
# parameter exists in both models, so a difference comes from the axis itself.
BASE = dict(arch="decoder", norm="layernorm", norm_position="pre", position="rope", activation="gelu",
            n_kv_heads=4, window=None)
AXIS_CHANGES = (
    [("norm", v) for v in axis_choices()["norm"] if v != BASE["norm"]]
    + [("norm_position", v) for v in axis_choices()["norm_position"] if v != BASE["norm_position"]]
    + [("position", v) for v in axis_choices()["position"] if v != BASE["position"]]
    + [("activation", v) for v in axis_choices()["activation"] if v != BASE["activation"]]
    + [("n_kv_heads", 2), ("n_kv_heads", 1), ("window", 2), ("embed_scale", True), ("bias", False),
       ("embedding_norm", True), ("norm_eps", 1e-1)]
)


@pytest.mark.parametrize("field,value", AXIS_CHANGES, ids=[f"{f}={v}" for f, v in AXIS_CHANGES])
def test_changing_any_single_axis_changes_the_output(field, value):
    base = build_model(tiny(**BASE)).eval()
    variant = build_model(tiny(**{**BASE, field: value})).eval()
    _copy_shared_weights(base, variant)
    with torch.no_grad():  # make norm weights/biases non-trivial so every parameter matters
        for m in (base, variant):
            for name, p in m.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        _copy_shared_weights(base, variant)
    x = torch.randint(1, V, (2, 12))
    with torch.no_grad():
        # deterministic: an ignored axis gives bit-identical outputs
        assert not torch.equal(base(x), variant(x)), f"{field}={value} did not change the output"


def test_untied_embeddings_are_separate_parameters():
    tied, untied = build_model(tiny()), build_model(tiny(tie_embeddings=False))
    assert tied.lm_head.proj.weight is tied.token_embedding.weight
    assert untied.lm_head.proj.weight is not untied.token_embedding.weight
    assert untied.num_parameters() == tied.num_parameters() + V * 32


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
def test_a_model_without_biases_has_none_anywhere_not_even_in_its_heads(arch):
    """bias: false is the model without biases (PaLM's): BERT's pooler, MLM transform, vocabulary projection and NSP
    head lose theirs too, or the swept value would reach only part of the model."""
    extra = {"objective": "mlm", "nsp": True, "type_vocab_size": 2} if arch == "encoder" else {}
    model = build_model(tiny(arch=arch, bias=False, norm="rmsnorm", **extra))
    assert [n for n, _ in model.named_parameters() if n.endswith("bias")] == []
    with_bias = build_model(tiny(arch=arch, **extra))
    assert any(n.endswith("bias") for n, _ in with_bias.named_parameters())


def test_learned_positions_refuse_longer_sequences_with_a_clear_error():
    model = build_model(tiny(position="learned", max_seq_len=8)).eval()
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.randint(1, V, (1, 9)))


def test_invalid_config_fails_before_any_weights_are_built(monkeypatch):
    built = []
    monkeypatch.setattr(torch.nn.Linear, "__init__", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError):
        build_model(ModelConfig(n_heads=4, n_kv_heads=3))
    assert built == []


def test_plain_causal_attention_uses_the_causal_kernel_without_a_mask():
    pos = torch.arange(8)
    assert attention_bias(pos, pos, causal=True) == (None, True)
    bias, is_causal = attention_bias(pos, pos, causal=True, window=2)
    assert not is_causal and bias.shape == (1, 1, 8, 8)
    assert bias[0, 0, 5, 3] < -1e8 and bias[0, 0, 5, 4] == 0 and bias[0, 0, 5, 6] < -1e8


def test_bf16_autocast_forward_and_backward_run():
    model = build_model(tiny(position="alibi", window=4, n_kv_heads=2))
    x = torch.randint(1, V, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten())
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None for p in model.parameters())


def test_masked_positions_stay_finite_in_float16():
    from study.model.transformer import _to_compute_dtype

    pos = torch.arange(6)
    bias, _ = attention_bias(pos, pos, causal=True, window=2)
    half = _to_compute_dtype(bias, torch.float16)
    assert torch.isfinite(half).all() and half.min() == torch.finfo(torch.float16).min


def test_embed_scale_initialises_every_token_embedding_at_unit_scaled_variance():
    model = build_model(tiny(arch="encoder-decoder", d_model=64, position="sinusoidal", embed_scale=True,
                             tie_embeddings=False, vocab_size=2000))
    for stack in (model.encoder, model.decoder):
        assert abs(stack.token_embedding.weight.std().item() * 64**0.5 - 1) < 0.05


@pytest.mark.parametrize("embed_scale", [True, False])
def test_a_learned_position_table_starts_at_the_reference_scale_beside_the_tokens(embed_scale):
    """Beside sqrt(d)-scaled tokens (embed_scale) a learned table starts at std d^-1/2, as fairseq's does, not at
    init_std: a learned-vs-sinusoidal ablation from the vaswani preset would otherwise start the learned table
    sqrt(d)/50 times weaker than the reference. Without embed_scale it starts at init_std, as GPT-2's."""
    model = build_model(tiny(d_model=256, position="learned", embed_scale=embed_scale, max_seq_len=512))
    (table,) = [m.table for m in model.modules() if isinstance(m, LearnedPosition)]
    assert table.weight.std().item() == pytest.approx(256**-0.5 if embed_scale else 0.02, rel=0.05)


@pytest.mark.parametrize("embed_scale", [True, False])
def test_sinusoidal_positions_start_at_the_scale_of_the_token_embeddings(embed_scale):
    cfg = tiny(arch="decoder", d_model=64, position="sinusoidal", embed_scale=embed_scale, vocab_size=2000)
    model = build_model(cfg)
    stack = model.decoder
    tokens = stack.token_embedding.weight * (64**0.5 if embed_scale else 1.0)
    positions = stack.position.embed(torch.arange(128))
    ratio = positions.pow(2).mean().sqrt() / tokens.pow(2).mean().sqrt()
    assert 0.6 < ratio.item() < 1.6  # neither drowns the other (unscaled sinusoids would be ~50x the tokens)


def test_shared_kv_heads_give_the_same_attention_in_the_kernel_and_as_expanded_copies(monkeypatch):
    """GQA with a bias: SDPA's own K/V sharing (CPU) and expanded K/V (what CUDA gets, so that the memory-efficient
    kernel can take the bias) are the same attention."""
    import study.model.attention as attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    bias = torch.randn(2, 1, 5, 5)
    shared = attention._sdpa(q, k, v, bias, False, 0.0, 2)
    monkeypatch.setattr(attention, "share_kv_in_kernel", lambda bias, device, dtype: False)
    copies = attention._sdpa(q, k, v, bias, False, 0.0, 2)
    assert torch.allclose(shared, copies, atol=1e-6)


def test_on_cuda_a_bias_or_float32_means_expanded_kv_and_16_bit_without_bias_means_the_kernel_shares_them():
    from study.model.attention import _SDPA_HAS_GQA, share_kv_in_kernel

    cuda, cpu, bias = torch.device("cuda"), torch.device("cpu"), torch.zeros(1)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert not share_kv_in_kernel(bias, cuda, bf16)  # flash takes no bias; memory-efficient takes no enable_gqa
    assert not share_kv_in_kernel(None, cuda, fp32)  # flash and cuDNN take 16-bit inputs only
    assert share_kv_in_kernel(None, cuda, bf16) == _SDPA_HAS_GQA  # flash / cuDNN share them themselves
    assert share_kv_in_kernel(bias, cpu, fp32) == _SDPA_HAS_GQA
