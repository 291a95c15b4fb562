"""`ModelConfig`: one flat, frozen, validated description of a transformer.

Every design axis is one field. Valid values for the registry-backed axes
(norm, norm_position, position, activation) come from the registries in
`study.model`, so the error a user sees lists exactly what exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from study.config.base import Config, Problems

ARCHS = ("encoder", "decoder", "encoder-decoder")
# objective -> the architecture it trains
OBJECTIVES = {"clm": "decoder", "mlm": "encoder", "seq2seq": "encoder-decoder"}
DEFAULT_OBJECTIVE = {arch: obj for obj, arch in OBJECTIVES.items()}


def axis_choices() -> dict[str, list[str]]:
    """Valid values of every enumerated axis, read from the model registries."""
    from study.model import ACTIVATIONS, NORMS, POSITIONS, RESIDUALS

    return {
        "arch": list(ARCHS),
        "objective": list(OBJECTIVES),
        "norm": NORMS.names(),
        "norm_position": RESIDUALS.names(),
        "position": POSITIONS.names(),
        "activation": ACTIVATIONS.names(),
    }


@dataclass(frozen=True)
class ModelConfig(Config):
    # shape of the model
    arch: str = "decoder"
    objective: str | None = None  # clm | mlm | seq2seq; None -> the one the arch trains
    nsp: bool = False  # next-sentence prediction head beside MLM (Devlin et al. 2018)
    vocab_size: int = 8000
    d_model: int = 256
    n_layers: int = 4  # decoder layers (encoder layers for arch=encoder)
    n_encoder_layers: int | None = None  # encoder-decoder only; None -> n_layers
    n_heads: int = 4
    n_kv_heads: int | None = None  # None -> n_heads (MHA); 1 -> MQA; between -> GQA
    head_dim: int | None = None  # None -> d_model // n_heads
    d_ff: int | None = None  # None -> 4 d_model, or 8/3 d_model rounded for gated FFNs
    max_seq_len: int = 512
    # axes
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_position: str = "pre"
    embedding_norm: bool = False  # norm after the embedding sum (BERT)
    position: str = "learned"
    rope_theta: float = 10000.0
    rel_buckets: int = 32  # T5 relative bias buckets
    rel_max_distance: int = 128
    window: int | None = None  # sliding-window span; None -> every layer global
    window_pattern: str | None = None  # per-layer L(ocal)/G(lobal) pattern repeated over depth; None -> all L
    activation: str = "gelu"
    # everything else
    dropout: float = 0.0
    attention_dropout: float | None = None  # None -> dropout
    bias: bool = True
    tie_embeddings: bool = True
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model) (Vaswani et al. 2017, 3.4)
    type_vocab_size: int = 0  # segment (token-type) embeddings; 2 for BERT sentence pairs
    pad_token_id: int = 0
    init_std: float = 0.02

    # derived values -----------------------------------------------------------
    def _resolve_defaults(self) -> None:
        if self.objective is None and self.arch in DEFAULT_OBJECTIVE:
            object.__setattr__(self, "objective", DEFAULT_OBJECTIVE[self.arch])

    @property
    def resolved_n_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        from study.model.ffn import ACTIVATIONS, default_d_ff

        return self.d_ff if self.d_ff is not None else default_d_ff(self.d_model, ACTIVATIONS[self.activation].gated)

    @property
    def resolved_attention_dropout(self) -> float:
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def resolved_encoder_layers(self) -> int:
        return self.n_layers if self.n_encoder_layers is None else self.n_encoder_layers

    @property
    def attention_kind(self) -> str:
        kv = self.resolved_n_kv_heads
        return "mha" if kv == self.n_heads else "mqa" if kv == 1 else "gqa"

    def layer_spans(self, n_layers: int | None = None) -> list[str]:
        """'local' or 'global' for each layer, from window and window_pattern."""
        n = self.n_layers if n_layers is None else n_layers
        if self.window is None:
            return ["global"] * n
        pattern = self.window_pattern or "L"
        return ["local" if pattern[i % len(pattern)] == "L" else "global" for i in range(n)]

    # validation ---------------------------------------------------------------
    def _validate(self, p: Problems) -> None:
        choices = axis_choices()
        for name in ("arch", "objective", "norm", "norm_position", "position", "activation"):
            p.choice(name, getattr(self, name), choices[name])
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "rel_buckets", "rel_max_distance"):
            p.check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("n_encoder_layers", "n_kv_heads", "head_dim", "d_ff"):
            v = getattr(self, name)
            p.check(v is None or v >= 1, name, f"must be >= 1 or null, got {v}")
        p.check(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        p.check(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        p.check(self.init_std > 0, "init_std", f"must be > 0, got {self.init_std}")
        for name in ("dropout", "attention_dropout"):
            v = getattr(self, name)
            p.check(v is None or 0.0 <= v < 1.0, name, f"must be in [0, 1), got {v}")
        p.check(0 <= self.pad_token_id < self.vocab_size, "pad_token_id", f"must be in [0, vocab_size={self.vocab_size})")
        p.check(self.type_vocab_size >= 0, "type_vocab_size", f"must be >= 0, got {self.type_vocab_size}")

        if self.n_heads >= 1:
            kv = self.resolved_n_kv_heads
            p.check(
                kv >= 1 and self.n_heads % kv == 0,
                "n_kv_heads",
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv} "
                f"(valid: {[k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]})",
            )
            if self.head_dim is None:
                p.check(
                    self.d_model % self.n_heads == 0,
                    "n_heads",
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim or change n_heads",
                )
            if self.position == "rope":
                p.check(
                    self.resolved_head_dim % 2 == 0,
                    "position",
                    f"rope rotates pairs of dimensions and needs an even head dimension, got {self.resolved_head_dim}",
                )
        if self.position == "sinusoidal":
            p.check(self.d_model % 2 == 0, "position", f"sinusoidal needs an even d_model, got {self.d_model}")
        if self.position == "t5_bias":
            p.check(self.rel_buckets >= 4, "rel_buckets", f"t5_bias needs rel_buckets >= 4, got {self.rel_buckets}")
            p.check(
                self.rel_max_distance > self.rel_buckets // 2,
                "rel_max_distance",
                f"must exceed rel_buckets // 2 = {self.rel_buckets // 2} (the exact-offset buckets), got {self.rel_max_distance}",
            )

        # attention span
        if self.window is not None:
            p.check(self.window >= 1, "window", f"must be >= 1 (or null for global attention), got {self.window}")
        if self.window_pattern is not None:
            pattern_ok = p.check(
                len(self.window_pattern) >= 1 and set(self.window_pattern) <= {"L", "G"},
                "window_pattern",
                f"must be a string of L (local) and G (global), e.g. 'LLLG'; got {self.window_pattern!r}",
            )
            p.check(self.window is not None, "window_pattern", "needs window to be set (the span of the L layers)")
            if pattern_ok and self.window is not None:
                p.check("L" in self.window_pattern, "window_pattern", "has no L layer, so window would be unused")

        # objective and heads
        if self.arch in ARCHS and self.objective in OBJECTIVES:
            p.check(
                OBJECTIVES[self.objective] == self.arch,
                "objective",
                f"{self.objective!r} trains arch={OBJECTIVES[self.objective]!r}, not arch={self.arch!r}",
            )
        if self.nsp:
            p.check(
                self.arch == "encoder" and self.objective == "mlm",
                "nsp",
                f"next-sentence prediction needs arch='encoder' with objective='mlm', got arch={self.arch!r}",
            )
            p.check(self.type_vocab_size >= 2, "type_vocab_size", "nsp needs segment embeddings: type_vocab_size >= 2")
        if self.type_vocab_size:
            p.check(self.arch == "encoder", "type_vocab_size",
                    f"segment embeddings are only read by arch='encoder' (sentence pairs), got arch={self.arch!r}")
        if self.n_encoder_layers is not None:
            p.check(self.arch == "encoder-decoder", "n_encoder_layers", "only applies to arch='encoder-decoder'")

