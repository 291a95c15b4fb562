"""Real architectures as points in the design space.

Each preset is the published model's recipe at its published size (the base
size where a family has several); sweeps override sizes. Differences we do not
model are noted beside the preset.
"""

from __future__ import annotations

from typing import Any

from study.config.model import ModelConfig

# An encoder-decoder preset leaves n_encoder_layers to its rule (None: as many as n_layers; both published models
# have equal depths), so that overriding n_layers deepens both stacks and arch stays overridable.
PRESETS: dict[str, dict[str, Any]] = {
    # Vaswani et al. 2017, "Attention Is All You Need", base model (Table 3). Dropout is residual only (§5.4: on
    # each sublayer's output and on the embedding sums), none on the attention weights (tensor2tensor's
    # transformer_base_v1: attention_dropout 0.0).
    "vaswani": dict(
        arch="encoder-decoder", norm_position="post", norm="layernorm", norm_eps=1e-5, position="sinusoidal",
        activation="relu", d_model=512, n_layers=6, n_heads=8, dropout=0.1, attention_dropout=0.0,
        embed_scale=True, tie_embeddings=True, bias=True, vocab_size=37000, max_seq_len=1024,
    ),
    # Devlin et al. 2018, BERT-base: post-LN, learned positions, segments, embedding LayerNorm, MLM + NSP.
    "bert": dict(
        arch="encoder", objective="mlm", nsp=True, norm_position="post", norm="layernorm", norm_eps=1e-12,
        position="learned", activation="gelu", d_model=768, n_layers=12, n_heads=12, dropout=0.1,
        type_vocab_size=2, embedding_norm=True, tie_embeddings=True, bias=True, vocab_size=30522, max_seq_len=512,
    ),
    # Radford et al. 2019, GPT-2 small: pre-LN with a final LayerNorm, learned positions, tanh-GELU.
    "gpt2": dict(
        arch="decoder", norm_position="pre", norm="layernorm", norm_eps=1e-5, position="learned",
        activation="gelu_tanh", d_model=768, n_layers=12, n_heads=12, dropout=0.1,
        tie_embeddings=True, bias=True, vocab_size=50257, max_seq_len=1024,
    ),
    # Raffel et al. 2020, T5-base (v1.0): pre-RMSNorm without bias, shared relative position buckets, ReLU.
    # Not modelled: T5 does not scale attention scores by 1/sqrt(d_head) (it folds that into its
    # initialisation) and rescales tied output logits by d_model^-1/2.
    "t5": dict(
        arch="encoder-decoder", norm_position="pre", norm="rmsnorm", norm_eps=1e-6, position="t5_bias",
        rel_buckets=32, rel_max_distance=128, activation="relu", d_model=768, n_layers=12, n_heads=12,
        dropout=0.1, bias=False, tie_embeddings=True, vocab_size=32128, max_seq_len=512,
    ),
    # d_ff is left to the rule (4 d_model, or 8/3 d_model rounded up to 256 for gated FFNs), so it
    # scales when a sweep overrides d_model; Mistral's 14,336 (3.5 d_model) is not that rule and is set.
    # Touvron et al. 2023, Llama 2 7B: pre-RMSNorm, RoPE, SwiGLU, no biases, untied output, multi-head attention
    # (only the 34B and 70B models use grouped-query attention: sweep model.n_kv_heads for it).
    "llama2": dict(
        arch="decoder", norm_position="pre", norm="rmsnorm", norm_eps=1e-5, position="rope", rope_theta=10000.0,
        activation="swiglu", d_model=4096, n_layers=32, n_heads=32, dropout=0.0,
        bias=False, tie_embeddings=False, vocab_size=32000, max_seq_len=4096,
    ),
    # Jiang et al. 2023, Mistral 7B: Llama 2 plus a 4,096-token sliding window on every layer.
    "mistral": dict(
        arch="decoder", norm_position="pre", norm="rmsnorm", norm_eps=1e-5, position="rope", rope_theta=10000.0,
        activation="swiglu", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, dropout=0.0,
        bias=False, tie_embeddings=False, vocab_size=32000, max_seq_len=32768, window=4096,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset's config with any fields overridden, validated as a whole."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; valid presets: {sorted(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})
