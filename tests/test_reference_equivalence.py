"""Our model against reference implementations, with the same weights.

torch.nn's transformer layers and RMSNorm, and tiny random Hugging Face models (BERT,
GPT-2, Llama with GQA, Mistral with a sliding window; no downloads) are imported with
`study.interop` and must give the same outputs to 1e-5 in float32, eval mode. Also:
T5 relative-position buckets and ALiBi slopes/biases against transformers' own code, and
cached incremental decoding against the reference's full forward.

Every reference model has all its parameters perturbed away from their initial values
(LayerNorm weights away from 1, biases away from 0, larger matrices), so a weight copied to
the wrong place, a norm applied at the wrong point or a missing bias cannot hide.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.testing import assert_close  # noqa: E402

from study.axes.position import AlibiPosition, T5RelativeBias, alibi_slopes, t5_relative_bucket  # noqa: E402
from study.config.model import ModelConfig  # noqa: E402
from study.interop.hf import UnsupportedHFModel, config_from_hf, from_hf  # noqa: E402
from study.interop.torch_nn import block_from_torch, rmsnorm_from_torch, run_block  # noqa: E402
from study.model.attention import KVCache  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    with torch.no_grad():
        yield


def perturb(module: nn.Module, scale: float = 0.1, seed: int = 0) -> nn.Module:
    """Add N(0, scale^2) noise to every parameter (tied parameters once)."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)
    return module.eval()


def lengths_mask(lengths: list[int], t: int) -> torch.Tensor:
    """(B, T) True at real tokens, right padding."""
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


def future_mask(t: int) -> torch.Tensor:
    """torch's boolean attn_mask for causal attention: True where a query must not look."""
    return torch.triu(torch.ones(t, t, dtype=torch.bool), 1)


# torch.nn ---------------------------------------------------------------------------------

LAYER_SIZES = [(16, 2, 32, "relu"), (32, 4, 48, "gelu"), (24, 3, 40, "relu")]  # d_model, heads, d_ff, act
MASKS = ["none", "padding", "causal", "causal+padding"]


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("d,h,ff,act", LAYER_SIZES)
@pytest.mark.parametrize("mask", MASKS)
def test_torch_encoder_layer(norm_first, d, h, ff, act, mask):
    layer = perturb(
        nn.TransformerEncoderLayer(d, h, ff, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first)
    )
    block = block_from_torch(layer).eval()
    assert block.config.norm_position == ("pre" if norm_first else "post")
    b, t = 3, 9
    x = torch.randn(b, t, d)
    real = lengths_mask([9, 6, 2], t) if "padding" in mask else None
    causal = "causal" in mask
    ref = layer(
        x,
        src_mask=future_mask(t) if causal else None,
        src_key_padding_mask=~real if real is not None else None,
        is_causal=causal,
    )
    ours = run_block(block, x, causal=causal, padding_mask=real)
    assert_close(ours, ref, **TOL)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("d,h,ff,act", LAYER_SIZES)
@pytest.mark.parametrize("mask", MASKS)
def test_torch_decoder_layer(norm_first, d, h, ff, act, mask):
    layer = perturb(
        nn.TransformerDecoderLayer(d, h, ff, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first)
    )
    block = block_from_torch(layer).eval()
    assert block.cross_attn is not None
    b, t, s = 3, 7, 10
    x, memory = torch.randn(b, t, d), torch.randn(b, s, d)
    real = lengths_mask([7, 4, 2], t) if "padding" in mask else None
    mem_real = lengths_mask([10, 3, 8], s) if "padding" in mask else None
    causal = "causal" in mask
    ref = layer(
        x,
        memory,
        tgt_mask=future_mask(t) if causal else None,
        tgt_key_padding_mask=~real if real is not None else None,
        memory_key_padding_mask=~mem_real if mem_real is not None else None,
        tgt_is_causal=causal,
    )
    ours = run_block(block, x, causal=causal, padding_mask=real, memory=memory, memory_padding_mask=mem_real)
    assert_close(ours, ref, **TOL)


def test_torch_layer_without_bias():
    layer = perturb(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, bias=False))
    block = block_from_torch(layer).eval()
    assert not block.config.bias and block.ffn_residual.norm.bias is None
    x = torch.randn(2, 5, 16)
    assert_close(run_block(block, x), layer(x), **TOL)


@pytest.mark.parametrize("dim,eps", [(8, 1e-6), (32, 1e-5), (50, None)])
def test_rmsnorm_matches_torch(dim, eps):
    ref = perturb(nn.RMSNorm(dim, eps=eps))
    ours = rmsnorm_from_torch(ref)
    x = torch.randn(4, 7, dim) * 3
    assert_close(ours(x), ref(x), **TOL)


# Hugging Face: BERT ----------------------------------------------------------------------

BERT_SIZES = [(32, 4, 64, "gelu"), (48, 6, 80, "gelu_new"), (24, 2, 40, "relu")]


def bert_config(d, h, ff, act, attn="sdpa"):
    return transformers.BertConfig(
        vocab_size=97, hidden_size=d, num_hidden_layers=2, num_attention_heads=h, intermediate_size=ff,
        hidden_act=act, max_position_embeddings=24, type_vocab_size=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation=attn,
    )  # fmt: skip


def bert_inputs(b=3, t=12):
    ids = torch.randint(1, 97, (b, t))
    types = (torch.arange(t) >= t // 2).long().expand(b, t)
    mask = lengths_mask([t, t - 3, 5], t)
    ids = ids.masked_fill(~mask, 0)
    return ids, types, mask


@pytest.mark.parametrize("d,h,ff,act", BERT_SIZES)
def test_bert_model(d, h, ff, act):
    hf = perturb(transformers.BertModel(bert_config(d, h, ff, act)))
    ours = from_hf(hf).eval()
    assert set(ours.hf_missing) == {
        "mlm_head.dense.weight", "mlm_head.dense.bias", "mlm_head.norm.weight", "mlm_head.norm.bias",
        "mlm_head.decoder.proj.bias",
    }  # fmt: skip
    ids, types, mask = bert_inputs()
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask.long())
    hidden = ours(ids, token_type_ids=types, padding_mask=mask)
    assert_close(hidden, ref.last_hidden_state, **TOL)
    assert_close(ours.pooled(hidden), ref.pooler_output, **TOL)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("d,h,ff,act", BERT_SIZES)
def test_bert_for_pretraining(d, h, ff, act, attn):
    hf = perturb(transformers.BertForPreTraining(bert_config(d, h, ff, act, attn)))
    assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight  # tied in HF too
    ours = from_hf(hf).eval()
    assert ours.config.nsp and ours.config.norm_position == "post" and ours.config.embedding_norm
    assert ours.hf_missing == []
    ids, types, mask = bert_inputs()
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask.long())
    hidden = ours(ids, token_type_ids=types, padding_mask=mask)
    assert_close(ours.mlm_logits(hidden), ref.prediction_logits, **TOL)
    assert_close(ours.nsp_logits(hidden), ref.seq_relationship_logits, **TOL)


# Hugging Face: GPT-2 ---------------------------------------------------------------------


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("d,h,act,tied", [(32, 4, "gelu_new", True), (48, 3, "gelu", True), (24, 6, "relu", False)])
def test_gpt2_lm_head_model(d, h, act, tied, padding):
    cfg = transformers.GPT2Config(
        vocab_size=101, n_positions=32, n_embd=d, n_layer=2, n_head=h, activation_function=act,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied,
    )  # fmt: skip
    hf = perturb(transformers.GPT2LMHeadModel(cfg))
    ours = from_hf(hf).eval()
    assert ours.hf_missing == [] and ours.config.tie_embeddings == tied
    ids = torch.randint(0, 101, (3, 14))
    mask = lengths_mask([14, 9, 4], 14) if padding else None
    ref = hf(input_ids=ids, attention_mask=mask.long() if padding else None).logits
    assert_close(ours(ids, padding_mask=mask), ref, **TOL)


# Hugging Face: Llama and Mistral ---------------------------------------------------------

# d_model, heads, kv heads, head_dim (None -> d/h), d_ff, tied
LLAMA_SIZES = [(32, 4, 2, None, 64, False), (48, 6, 2, None, 80, True), (32, 4, 1, 16, 48, False), (64, 8, 4, None, 96, False)]


def llama_config(d, h, kv, hd, ff, tied, **kw):
    return transformers.LlamaConfig(
        vocab_size=113, hidden_size=d, intermediate_size=ff, num_hidden_layers=2, num_attention_heads=h,
        num_key_value_heads=kv, head_dim=hd, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=tied, **kw,
    )  # fmt: skip


def incremental_logits(model, ids: torch.Tensor, prompt: int, chunk: int) -> torch.Tensor:
    """Logits of `ids` computed by a prompt pass and then `chunk` tokens at a time through a KV cache."""
    cache = KVCache()
    out = [model(ids[:, :prompt], cache=cache)]
    for start in range(prompt, ids.shape[1], chunk):
        out.append(model(ids[:, start : start + chunk], cache=cache))
    assert cache.length == ids.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("d,h,kv,hd,ff,tied", LLAMA_SIZES)
def test_llama_for_causal_lm(d, h, kv, hd, ff, tied, padding):
    hf = perturb(transformers.LlamaForCausalLM(llama_config(d, h, kv, hd, ff, tied)))
    ours = from_hf(hf).eval()
    c = ours.config
    assert ours.hf_missing == [] and c.attention_kind in ("gqa", "mqa") and c.rope_theta == 500.0
    assert c.resolved_head_dim == (hd or d // h)
    ids = torch.randint(0, 113, (2, 15))
    mask = lengths_mask([15, 8], 15) if padding else None
    ref = hf(input_ids=ids, attention_mask=mask.long() if padding else None).logits
    assert_close(ours(ids, padding_mask=mask), ref, **TOL)


def test_llama_with_biases():
    """attention_bias=mlp_bias=True is our bias=True (q/k/v/o and gate/up/down all get biases)."""
    hf = perturb(transformers.LlamaForCausalLM(llama_config(32, 4, 2, None, 48, False, attention_bias=True, mlp_bias=True)))
    ours = from_hf(hf).eval()
    assert ours.config.bias and ours.hf_missing == []
    ids = torch.randint(0, 113, (2, 9))
    assert_close(ours(ids), hf(input_ids=ids).logits, **TOL)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("d,h,kv,hd,ff,tied", LLAMA_SIZES[:3])
def test_llama_cached_decoding_matches_full_forward(d, h, kv, hd, ff, tied, chunk):
    hf = perturb(transformers.LlamaForCausalLM(llama_config(d, h, kv, hd, ff, tied)))
    ours = from_hf(hf).eval()
    ids = torch.randint(0, 113, (2, 13))
    ref = hf(input_ids=ids).logits
    assert_close(incremental_logits(ours, ids, prompt=4, chunk=chunk), ref, **TOL)


MISTRAL_SIZES = [(32, 4, 2, 64, 4), (48, 6, 3, 80, 6), (64, 8, 2, 96, 3)]  # d, heads, kv heads, d_ff, window


def mistral_pair(d, h, kv, ff, window, attn):
    """A windowed Mistral and the same weights without the window (to show the window matters)."""
    kw = dict(
        vocab_size=89, hidden_size=d, intermediate_size=ff, num_hidden_layers=2, num_attention_heads=h,
        num_key_value_heads=kv, max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation=attn,
    )  # fmt: skip
    hf = perturb(transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=window, **kw)))
    full = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **kw)).eval()
    full.load_state_dict(hf.state_dict())
    return hf, full


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("d,h,kv,ff,window", MISTRAL_SIZES)
def test_mistral_sliding_window(d, h, kv, ff, window, attn):
    hf, full = mistral_pair(d, h, kv, ff, window, attn)
    ours = from_hf(hf).eval()
    assert ours.config.window == window and ours.hf_missing == []
    t = 16
    assert t > 2 * window
    ids = torch.randint(0, 89, (2, t))
    ref = hf(input_ids=ids).logits
    # not vacuous: Hugging Face really applied the window (positions >= window change) ...
    unwindowed = full(input_ids=ids).logits
    assert_close(unwindowed[:, :window], ref[:, :window], **TOL)
    assert (unwindowed[:, window:] - ref[:, window:]).abs().amax() > 1e-2
    # ... and we match the windowed model, not the unwindowed one.
    assert_close(ours(ids), ref, **TOL)
    assert_close(incremental_logits(ours, ids, prompt=5, chunk=1), ref, **TOL)
    assert_close(incremental_logits(ours, ids, prompt=2, chunk=4), ref, **TOL)


# T5 relative position buckets ------------------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (8, 20), (64, 256), (12, 30)])
def test_t5_relative_bucket(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-400, 401)[None, :] + torch.arange(0, 3)[:, None]
    ref = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    ours = t5_relative_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, ref)
    assert int(ours.max()) == num_buckets - 1 or not bidirectional


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20)])
def test_t5_relative_bias_matches_hf_compute_bias(causal, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    hf_cfg = transformers.T5Config(
        d_model=32, d_kv=8, num_heads=4, relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance, is_decoder=causal,
    )  # fmt: skip
    attn = perturb(T5Attention(hf_cfg, has_relative_attention_bias=True, layer_idx=0))
    cfg = ModelConfig(d_model=32, n_heads=4, position="t5_bias", rel_buckets=num_buckets, rel_max_distance=max_distance)
    ours = T5RelativeBias(cfg, causal=causal)
    ours.table.weight.copy_(attn.relative_attention_bias.weight)
    q, k = 30, 45
    ref = attn.compute_bias(q, k)[0]
    assert_close(ours.bias(torch.arange(q), torch.arange(k)), ref, **TOL)


# ALiBi -----------------------------------------------------------------------------------

ALIBI_HEADS = [1, 2, 4, 8, 16, 32, 3, 5, 6, 12, 20, 24]  # powers of two, then not


@pytest.mark.parametrize("n_heads", ALIBI_HEADS)
def test_alibi_slopes_match_bloom(n_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 3, dtype=torch.long), n_heads, torch.float32)  # (H, 1, T): slope * j
    assert_close(torch.tensor(alibi_slopes(n_heads), dtype=torch.float32), alibi[:, 0, 1], **TOL)


@pytest.mark.parametrize("n_heads", [4, 6, 12])
def test_alibi_bias_gives_bloom_attention_for_causal_rows(n_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    t = 11
    pos = torch.arange(t)
    scores = torch.randn(n_heads, t, t) * 2
    future = future_mask(t)
    # bloom adds +m * j; by softmax's shift invariance per row this equals -m * (i - j)
    bloom = build_alibi_tensor(torch.ones(1, t, dtype=torch.long), n_heads, torch.float32).view(n_heads, 1, t)
    ref = torch.softmax((scores + bloom).masked_fill(future, float("-inf")), dim=-1)
    ours_bias = AlibiPosition(ModelConfig(n_heads=n_heads, d_model=8 * n_heads, position="alibi"), causal=True).bias(pos, pos)
    ours = torch.softmax((scores + ours_bias).masked_fill(future, float("-inf")), dim=-1)
    assert_close(ours, ref, **TOL)
    assert (ours_bias.diagonal(dim1=-2, dim2=-1) == 0).all()


# unsupported inputs fail loudly ----------------------------------------------------------


def test_unsupported_models_and_features_raise():
    with pytest.raises(UnsupportedHFModel, match="model_type 't5'"):
        config_from_hf(transformers.T5Config())
    scaled = llama_config(32, 4, 2, None, 64, False, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(UnsupportedHFModel, match="rope"):
        config_from_hf(scaled)
    with pytest.raises(UnsupportedHFModel, match="activation"):
        config_from_hf(transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, activation_function="tanh"))
    with pytest.raises(UnsupportedHFModel, match="scale_attn_by_inverse_layer_idx"):
        config_from_hf(transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(UnsupportedHFModel, match="BertForTokenClassification"):
        from_hf(transformers.BertForTokenClassification(bert_config(32, 4, 64, "gelu")))
    two_layers = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=64))
    with pytest.raises(UnsupportedHFModel, match="2 layers and ours 1"):  # never the first layer alone, silently
        from_hf(two_layers, n_layers=1)


@pytest.mark.parametrize("name, hf_config", [
    ("gpt2", lambda t: t.GPT2Config()),
    ("bert", lambda t: t.BertConfig()),
    # the published checkpoints' values where Hugging Face's class defaults differ (Llama 2 7B and Mistral 7B v0.1:
    # RMSNorm eps 1e-5, contexts of 4,096 and 32,768 tokens)
    ("llama2", lambda t: t.LlamaConfig(rms_norm_eps=1e-5, max_position_embeddings=4096)),
    ("mistral", lambda t: t.MistralConfig(rms_norm_eps=1e-5, max_position_embeddings=32768)),
])
def test_a_preset_is_the_architecture_of_the_model_it_is_named_after(name, hf_config):
    """Field by field, each unset field read as what it resolves to (d_ff's rule, n_kv_heads = n_heads), the preset
    equals the config our importer reads from the reference's own config class: the weight-equivalence tests above
    then cover the preset's architecture, not only small random ones."""
    import dataclasses

    import transformers

    from study.config import preset

    def resolved(cfg: ModelConfig) -> dict:
        return {f.name: cfg.resolved(f.name) for f in dataclasses.fields(cfg)}

    imported = config_from_hf(hf_config(transformers), **({"nsp": True} if name == "bert" else {}))
    assert resolved(preset(name)) == resolved(imported)
