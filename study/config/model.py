"""`ModelConfig`: one flat, frozen, validated description of a transformer.

Every design axis is one field. The registry-backed axes (norm, norm_position, position, activation) are validated
by asking their registries (`study.axes`): the valid values are the registered classes, so the error a user sees
lists exactly what exists, and each value's own rules for the rest of the config (RoPE's even head dimension) live on
its class. `study.axes` imports nothing from `study`, so the dependency points one way; it is imported when a config
is first validated, not when `study.config` is imported (which stays free of torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from study.config.base import Config, Problems

ARCHS = ("encoder", "decoder", "encoder-decoder")
# objective -> the architecture it trains
OBJECTIVES = {"clm": "decoder", "mlm": "encoder", "seq2seq": "encoder-decoder"}
DEFAULT_OBJECTIVE = {arch: obj for obj, arch in OBJECTIVES.items()}
# The context length a preset was published with (Llama-2's 4096) is stated even where no module reads it: only a
# position table does, yet a config keeps it under any scheme (a sweep still refuses it as an axis there).
CONTEXT_FIELDS = ("max_seq_len",)


def axis_choices() -> dict[str, list[str]]:
    """Valid values of every enumerated axis: the architectures and objectives, and the registered axis values."""
    # Imported here, not at the top: `import study.config` stays light (no torch). The dependency still points
    # down: study.axes imports nothing from study.config.
    from study.axes import AXES

    return {"arch": list(ARCHS), "objective": list(OBJECTIVES), **{k: r.names() for k, r in AXES.items()}}


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

    def replace(self, **changes: Any) -> "ModelConfig":
        """Config.replace, except that a new arch gets its own default objective where this config has its old
        arch's default (stored resolved, it would otherwise be carried over and refused: clm on an encoder)."""
        if "arch" in changes and "objective" not in changes and self.objective == DEFAULT_OBJECTIVE.get(self.arch):
            changes["objective"] = None
        return super().replace(**changes)

    @property
    def resolved_n_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        from study.axes import ACTIVATIONS, default_d_ff  # lazily, as in axis_choices: study.config stays torch-free

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

    def stack_spans(self) -> list[str]:
        """`layer_spans` of every stack the arch builds (an encoder-decoder's decoder, then its encoder): the pattern
        restarts in each stack."""
        depths = [self.n_layers] + ([self.resolved_encoder_layers] if self.arch == "encoder-decoder" else [])
        return [span for depth in depths for span in self.layer_spans(depth)]

    # validation ---------------------------------------------------------------
    def _validate(self, p: Problems) -> None:
        self._validate_values(p)
        self._validate_heads(p)
        self._validate_axes(p)
        self._validate_position_fields(p)
        self._validate_span(p)
        self._validate_objective(p)

    def _validate_values(self, p: Problems) -> None:
        p.choice("arch", self.arch, ARCHS)
        if self.objective is not None or self.arch in ARCHS:  # unset, it is the arch's: said once, as the arch
            p.choice("objective", self.objective, OBJECTIVES)
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
        # the inputs carry segment ids 0 and 1 (BERT's sentence pairs): one row would be indexed out of range by the
        # first pair, rows past two would be parameters nothing reads
        p.check(self.type_vocab_size in (0, 2), "type_vocab_size", "0 (no segment embeddings) or 2 (segment ids 0/1 "
                f"of BERT's sentence pairs), got {self.type_vocab_size}")

    def _validate_heads(self, p: Problems) -> None:
        if self.n_heads < 1:
            return
        kv = self.resolved_n_kv_heads
        p.check(kv >= 1 and self.n_heads % kv == 0, "n_kv_heads",
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv} "
                f"(valid: {[k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]})")
        if self.head_dim is None:
            p.check(self.d_model % self.n_heads == 0, "n_heads",
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim or change n_heads")

    def _validate_axes(self, p: Problems) -> None:
        """Each registry-backed axis: a registered value, and that value's own rules for the rest of the config."""
        from study.axes import AXES  # lazily, as in axis_choices: study.config stays torch-free

        for name, registry in AXES.items():
            value = getattr(self, name)
            if p.choice(name, value, registry.names()):
                registry[value].validate(self, p)

    def _validate_span(self, p: Problems) -> None:
        if self.window is not None:
            p.check(self.window >= 1, "window", f"must be >= 1 (or null for global attention), got {self.window}")
            self._validate_window_reach(p)
        if self.window_pattern is None:
            return
        pattern_ok = p.check(
            len(self.window_pattern) >= 1 and set(self.window_pattern) <= {"L", "G"}, "window_pattern",
            f"must be a string of L (local) and G (global), e.g. 'LLLG'; got {self.window_pattern!r}")
        p.check(self.window is not None, "window_pattern", "needs window to be set (the span of the L layers)")
        if pattern_ok and self.window is not None:
            p.check("L" in self.window_pattern, "window_pattern", "has no L layer, so window would be unused")
            self._validate_pattern_depth(p)

    def _validate_pattern_depth(self, p: Problems) -> None:
        """The pattern is cut to each stack's depth: the layers it names must exist, or its L (window) or its G
        would reach no layer while the config still states it."""
        if self.n_layers < 1:
            return
        spans, pattern = self.stack_spans(), self.window_pattern
        depth = f"n_layers={self.n_layers}" + (
            f" and n_encoder_layers={self.resolved_encoder_layers}" if self.arch == "encoder-decoder" else "")
        if "L" in pattern:
            p.check("local" in spans, "window_pattern",
                    f"{pattern!r} over {depth} builds no local layer, so window would be unused; put an L within "
                    f"the first {max(self.n_layers, self.resolved_encoder_layers)} letters")
        if "G" in pattern and "L" in pattern:
            p.check("global" in spans, "window_pattern",
                    f"{pattern!r} over {depth} builds no global layer, the same model as window_pattern=null; "
                    "put a G within the layers built, or leave window_pattern null")

    def _validate_window_reach(self, p: Problems) -> None:
        """A window as long as every sequence the position scheme can address (a learned table of max_seq_len rows)
        masks no key: the layers it names would be global."""
        from study.axes import POSITIONS  # lazily, as in axis_choices: study.config stays torch-free

        if self.window is None or self.window < 1 or self.position not in POSITIONS:
            return
        limit = POSITIONS[self.position].max_positions(self)
        if limit is not None:
            p.check(self.window < limit, "window",
                    f"{self.window} is not shorter than the {limit} positions {self.position!r} positions can "
                    f"address (max_seq_len), so it would mask nothing; valid: 1 to {limit - 1}, or null")

    def _validate_position_fields(self, p: Problems) -> None:
        """A field only other position schemes read stays at its default: set under this scheme, it would reach no
        module while the results table still lists it (the context length excepted, CONTEXT_FIELDS)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, why in self.unread_fields().items():
            value = getattr(self, name)
            p.check(name in CONTEXT_FIELDS or value == defaults[name], name,
                    f"got {value}, but {why}; leave it at its default {defaults[name]} or change position")

    def unread_fields(self) -> dict[str, str]:
        """Field -> why, for each field some position scheme reads (`PositionScheme.reads`) and this config's does
        not: its value reaches no module. Empty while the position is unknown (validation names it)."""
        from study.axes import POSITIONS  # lazily, as in axis_choices: study.config stays torch-free

        if self.position not in POSITIONS:
            return {}
        readers: dict[str, list[str]] = {}
        fields = {f.name for f in dataclasses.fields(self)}
        for name, scheme in POSITIONS.items():
            if unknown := [f for f in scheme.reads if f not in fields]:
                raise TypeError(f"position {name!r} ({scheme.__name__}) reads {unknown}: not ModelConfig fields")
            for field in scheme.reads:
                readers.setdefault(field, []).append(name)
        return {field: f"only position {' or '.join(map(repr, names))} reads it, not {self.position!r}"
                for field, names in readers.items() if self.position not in names}

    def _validate_objective(self, p: Problems) -> None:
        """The objective trains its architecture; the heads it needs are there."""
        if self.arch in ARCHS and self.objective in OBJECTIVES:
            p.check(OBJECTIVES[self.objective] == self.arch, "objective",
                    f"{self.objective!r} trains arch={OBJECTIVES[self.objective]!r}, not arch={self.arch!r}")
        if self.nsp:
            p.check(self.arch == "encoder" and self.objective == "mlm", "nsp",
                    f"next-sentence prediction needs arch='encoder' with objective='mlm', got arch={self.arch!r}")
            p.check(self.type_vocab_size == 2, "type_vocab_size", "nsp needs segment embeddings: type_vocab_size: 2")
        if self.type_vocab_size:
            p.check(self.arch == "encoder", "type_vocab_size",
                    f"segment embeddings are only read by arch='encoder' (sentence pairs), got arch={self.arch!r}")
        if self.n_encoder_layers is not None:
            p.check(self.arch == "encoder-decoder", "n_encoder_layers", "only applies to arch='encoder-decoder'")
