"""Cost accounting from a config alone: parameters, FLOPs per token, KV-cache bytes.

Every formula is checked against the real module in tests/test_accounting.py
(parameter count against `sum(p.numel())`, FLOPs against torch's FlopCounterMode,
cache bytes against a filled `KVCache`).
"""

from __future__ import annotations

from study.axes import ACTIVATIONS, NORM_POSITIONS, NORMS, POSITIONS
from study.config.model import ModelConfig


def _norm_params(cfg: ModelConfig) -> int:
    return NORMS[cfg.norm].num_parameters(cfg.d_model, cfg.bias)


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _attention_params(cfg: ModelConfig, bias: bool) -> int:
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.resolved_head_dim, cfg.resolved_n_kv_heads * cfg.resolved_head_dim
    return _linear(d, q + 2 * kv, bias) + _linear(q, d, bias)


def _ffn_params(cfg: ModelConfig, bias: bool) -> int:
    """The FFN's weights (and biases when `bias`), as the activation declares them."""
    return ACTIVATIONS[cfg.activation].num_parameters(cfg if bias == cfg.bias else cfg.replace(bias=bias))


def _stack_params(cfg: ModelConfig, n_layers: int, cross: bool) -> int:
    """Every axis value states its own parameters: the norm position its norms, the position scheme its table."""
    residual = NORM_POSITIONS[cfg.norm_position]
    sublayers = 3 if cross else 2
    block = _attention_params(cfg, cfg.bias) * (2 if cross else 1) + _ffn_params(cfg, cfg.bias)
    block += residual.num_parameters(cfg, sublayers)
    n = n_layers * block
    n += cfg.type_vocab_size * cfg.d_model
    n += POSITIONS[cfg.position].num_parameters(cfg)
    if cfg.embedding_norm:
        n += _norm_params(cfg)
    if residual.needs_final_norm:
        n += _norm_params(cfg)
    return n


def parameter_count(cfg: ModelConfig) -> int:
    """Number of distinct trainable parameters (tied matrices counted once)."""
    d, v = cfg.d_model, cfg.vocab_size
    n = v * d  # token embedding
    untied_output = 0 if cfg.tie_embeddings else v * d
    if cfg.arch == "decoder":
        return n + _stack_params(cfg, cfg.n_layers, cross=False) + untied_output
    if cfg.arch == "encoder-decoder":
        n += 0 if cfg.tie_embeddings else v * d  # separate target embedding
        n += _stack_params(cfg, cfg.resolved_encoder_layers, cross=False)
        return n + _stack_params(cfg, cfg.n_layers, cross=True) + untied_output
    # encoder: pooler, MLM head (dense + norm + output bias), optional NSP; biases where cfg.bias
    n += _stack_params(cfg, cfg.n_layers, cross=False)
    n += 2 * _linear(d, d, cfg.bias) + _norm_params(cfg) + (v if cfg.bias else 0) + untied_output
    if cfg.nsp:
        n += _linear(d, 2, cfg.bias)
    return n


def _matmul_params(cfg: ModelConfig, predicted_fraction: float = 1.0) -> tuple[float, float]:
    """Weights multiplied per token (decoder side, encoder side), including the output
    projection (a real matmul even when tied) on the `predicted_fraction` of positions that
    compute it, and excluding embedding lookups and biases (an addition, not a multiply-accumulate)."""
    d, v = cfg.d_model, cfg.vocab_size
    cross_q_o = d * cfg.n_heads * cfg.resolved_head_dim * 2  # cross-attn q and o run per target token
    per_block = _attention_params(cfg, bias=False) + _ffn_params(cfg, bias=False)
    if cfg.arch == "encoder":
        head = (d * d + d * v) * predicted_fraction  # MLM transform + vocabulary projection
        return cfg.n_layers * per_block + head, 0
    decoder = cfg.n_layers * per_block + d * v * predicted_fraction
    if cfg.arch == "encoder-decoder":
        kv = 2 * d * cfg.resolved_n_kv_heads * cfg.resolved_head_dim  # memory K/V: once per source token
        return decoder + cfg.n_layers * cross_q_o, cfg.resolved_encoder_layers * per_block + cfg.n_layers * kv
    return decoder, 0


def _visible_keys(seq_len: int, causal: bool, window: int | None) -> float:
    """Mean number of keys a query attends to over a sequence of seq_len."""
    total = 0
    for i in range(seq_len):
        lo = 0 if window is None else max(0, i - window + 1)
        hi = i + 1 if causal else (seq_len if window is None else min(seq_len, i + window))
        total += hi - lo
    return total / seq_len


def _attention_flops(cfg: ModelConfig, n_layers: int, seq_len: int, causal: bool, dense: bool) -> float:
    """Forward FLOPs per token of QK^T and AV: 4 * heads * head_dim per visible key."""
    width = cfg.n_heads * cfg.resolved_head_dim
    total = 0.0
    for span in cfg.layer_spans(n_layers):
        window = cfg.window if span == "local" else None
        keys = seq_len if dense else _visible_keys(seq_len, causal, window)
        total += 4 * width * keys
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True, dense_attention: bool = False,
                    predicted_fraction: float = 1.0) -> float:
    """FLOPs per token: forward = 2 * (matmul weights) + attention scores; training = 3x forward
    (backward costs twice the forward; Kaplan et al. 2020, sec. 2.1; Chowdhery et al. 2022, app. B).

    Attention counts the keys each query really sees (causal: half the square, sliding window:
    at most `window`). `dense_attention=True` counts the full T x T square instead, which is what
    a kernel without causal/window skipping executes. For encoder-decoder the cost is per target
    token with a source of the same length (encoder and cross-attention included).
    `predicted_fraction` is the share of positions whose output head runs: MLM pretraining computes
    it on the masked positions only (`task.mlm_probability`), so the 8k-vocabulary projection of an
    encoder costs 15% of what it would on every token.
    """
    dec_weights, enc_weights = _matmul_params(cfg, predicted_fraction)
    fwd = 2 * (dec_weights + enc_weights)
    if cfg.arch == "encoder":
        fwd += _attention_flops(cfg, cfg.n_layers, seq_len, causal=False, dense=dense_attention)
    else:
        fwd += _attention_flops(cfg, cfg.n_layers, seq_len, causal=True, dense=dense_attention)
    if cfg.arch == "encoder-decoder":
        fwd += _attention_flops(cfg, cfg.resolved_encoder_layers, seq_len, causal=False, dense=dense_attention)
        fwd += cfg.n_layers * 4 * cfg.n_heads * cfg.resolved_head_dim * seq_len  # cross-attention sees the whole source
    return 3 * fwd if training else fwd


def inference_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """FLOPs to generate one token with a KV cache holding `context` past tokens (for
    encoder-decoder, also a source of `context` tokens whose K/V are cached)."""
    if cfg.arch == "encoder":
        raise ValueError("encoders do not generate; use flops_per_token(cfg, seq_len, training=False)")
    dec_weights, _ = _matmul_params(cfg)  # the memory K/V are cached with the encoder output
    width = cfg.n_heads * cfg.resolved_head_dim
    attn = sum(
        4 * width * (min(context + 1, cfg.window) if span == "local" else context + 1)
        for span in cfg.layer_spans(cfg.n_layers)
    )
    if cfg.arch == "encoder-decoder":
        attn += cfg.n_layers * 4 * width * context  # cross-attention over a source of `context` tokens
    return 2 * dec_weights + attn


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """Bytes the self-attention KV cache grows by per generated token once the context is longer
    than any window: K and V, n_kv_heads heads of head_dim, in every global decoder layer.
    MQA/GQA divide it by n_heads / n_kv_heads (Shazeer 2019; Ainslie et al. 2023); sliding-window
    layers keep a rolling cache of window - 1 positions and stop growing (Jiang et al. 2023).
    Encoders keep no cache (0)."""
    if cfg.arch == "encoder":
        return 0
    global_layers = cfg.layer_spans(cfg.n_layers).count("global")
    return 2 * global_layers * cfg.resolved_n_kv_heads * cfg.resolved_head_dim * bytes_per_element


def kv_cache_bytes(cfg: ModelConfig, context: int, bytes_per_element: int = 2, source_len: int | None = None) -> int:
    """Bytes of the KV cache after `context` tokens (per sequence): global layers hold every position,
    sliding-window layers the window - 1 most recent. An encoder-decoder also holds each decoder layer's
    cross-attention K/V of its source (`source_len` tokens, default `context`), computed once and kept for the
    whole decode, so it adds to the total and not to `kv_cache_bytes_per_token`."""
    if cfg.arch == "encoder":
        return 0
    per_position = 2 * cfg.resolved_n_kv_heads * cfg.resolved_head_dim * bytes_per_element
    held = sum(context if span == "global" else min(context, cfg.window - 1) for span in cfg.layer_spans(cfg.n_layers))
    if cfg.arch == "encoder-decoder":
        held += cfg.n_layers * (context if source_len is None else source_len)
    return per_position * held


def cost_summary(cfg: ModelConfig, seq_len: int, bytes_per_element: int = 2,
                 predicted_fraction: float = 1.0) -> dict[str, float]:
    """`predicted_fraction`: the share of positions whose output head the task computes in training (see
    flops_per_token); inference FLOPs count the head on every position."""
    return {
        "parameters": parameter_count(cfg),
        "d_ff": cfg.resolved_d_ff,
        "train_flops_per_token": flops_per_token(cfg, seq_len, training=True, predicted_fraction=predicted_fraction),
        "train_flops_per_token_dense": flops_per_token(cfg, seq_len, training=True, dense_attention=True,
                                                       predicted_fraction=predicted_fraction),
        "inference_flops_per_token": flops_per_token(cfg, seq_len, training=False),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg, bytes_per_element),
        "kv_cache_bytes_at_seq_len": kv_cache_bytes(cfg, seq_len, bytes_per_element),
    }
