"""Position scheme axis (`model.position`).

A scheme may do any of three things, and the rest of the model only ever calls
these three hooks:

- `embed(positions)`          -> (T, d) added to the token embeddings, or None
- `rotary(positions)`         -> (cos, sin) used to rotate q and k, or None
- `bias(q_positions, k_positions)` -> (H, Tq, Tk) added to attention scores, or None

One instance per stack (encoder and decoder have their own, as in T5). The
`causal` flag tells bias schemes whether the stack can see the future.

Every value is a `PositionScheme` that states its parameter count per stack, its rules for the rest of the config
(`validate`: RoPE's even head dimension lives on RoPE), how far it can address (`max_positions`: a learned table
stops at max_seq_len) and the config fields only it reads (`reads`: RoPE's base), which reach no module under
another scheme.
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import torch
from torch import nn

from study.axes.cpu_kernels import cpu_ops, eager_cpu_ops
from study.axes.registry import AxisRegistry


class PositionScheme(nn.Module, abc.ABC):
    """The contract of a `model.position` value."""

    #: False for schemes with a fixed table that cannot go past `max_seq_len`.
    extrapolates: ClassVar[bool] = True
    #: ModelConfig fields this scheme reads and nothing outside the position schemes does (RoPE's `rope_theta`).
    reads: ClassVar[tuple[str, ...]] = ()
    #: The C++ CPU kernel this value runs (study/axes/kernels/<name>.cpp), built before a CPU run trains; None: none.
    cpu_kernel: ClassVar[str | None] = None
    #: True where a parameter row belongs to each absolute position: rows past the longest sequence a run trained
    #: stay at their initial values, so a model fine-tuned on longer sequences reads untrained rows there.
    learns_each_position: ClassVar[bool] = False

    def __init__(self, cfg, causal: bool):
        super().__init__()
        self.causal = causal
        self.limit = type(self).max_positions(cfg)  # checked from Python ints (check_length), never from a tensor

    @staticmethod
    @abc.abstractmethod
    def num_parameters(cfg) -> int:
        """Trainable parameters one stack's instance holds (for the accounting formulas); 0 is a statement too."""

    @classmethod
    def validate(cls, cfg, problems) -> None:
        """Add a problem for every field of `cfg` (a ModelConfig) this scheme cannot work with."""

    @classmethod
    def max_positions(cls, cfg) -> int | None:
        """The longest sequence the scheme can address (a position table's size), or None when unbounded."""
        return None

    def init_beside_scaled_tokens(self, d_model: int) -> None:
        """Initialise what this scheme adds to the token embeddings for a model whose tokens `embed_scale` brings to
        unit scale (the model calls it after its own init); a scheme that adds nothing, or adds sinusoids already at
        that scale, does nothing."""

    def check_length(self, end: int) -> None:
        """Refuse positions 0..end-1 when the scheme cannot address them (a position table of max_seq_len rows)."""
        if self.limit is not None and end > self.limit:
            name = next(n for n, c in POSITIONS.items() if c is type(self))
            raise ValueError(
                f"position {end - 1} is beyond max_seq_len={self.limit}: {name} position embeddings cannot "
                f"extrapolate; raise max_seq_len or use position in {sorted(n for n in POSITIONS if n != name)}")

    def embed(self, positions: torch.Tensor) -> torch.Tensor | None:
        return None

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor | None:
        return None


POSITIONS: AxisRegistry[type[PositionScheme]] = AxisRegistry("position", PositionScheme)


@POSITIONS.register("none", "no position information (NoPE; Kazemnejad et al. 2023): a decoder orders tokens by "
                    "causal masking alone; an encoder is order-blind")
class NoPosition(PositionScheme):
    @staticmethod
    def num_parameters(cfg) -> int:
        return 0


@POSITIONS.register("learned", "learned absolute position embeddings (BERT, GPT-2); cannot exceed max_seq_len")
class LearnedPosition(PositionScheme):
    extrapolates = False
    reads = ("max_seq_len",)
    learns_each_position = True

    @staticmethod
    def num_parameters(cfg) -> int:
        return cfg.max_seq_len * cfg.d_model

    @classmethod
    def max_positions(cls, cfg) -> int | None:
        return cfg.max_seq_len

    def __init__(self, cfg, causal: bool):
        super().__init__(cfg, causal)
        self.max_seq_len = cfg.max_seq_len
        self.table = nn.Embedding(cfg.max_seq_len, cfg.d_model)

    def embed(self, positions: torch.Tensor) -> torch.Tensor:
        # (the stack checks the positions against max_positions before this lookup, from Python ints: reading the
        # last position here would make every forward wait for the device)
        return self.table(positions)

    def init_beside_scaled_tokens(self, d_model: int) -> None:
        # std d^-1/2, as fairseq's Transformer initialises learned positions beside its sqrt(d)-scaled tokens
        # (fairseq/modules/positional_embedding.py): init_std (0.02) would start them sqrt(d)/50 times weaker
        nn.init.normal_(self.table.weight, 0.0, d_model**-0.5)


def sinusoid_table(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(...)  (Vaswani et al. 2017, sec. 3.5)."""
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    table = torch.zeros(positions.numel(), dim, device=positions.device)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return table


@POSITIONS.register("sinusoidal", "fixed sinusoidal absolute embeddings (Vaswani et al. 2017)")
class SinusoidalPosition(PositionScheme):
    """Vaswani et al. add unit-amplitude sinusoids (RMS 1/sqrt(2) per dimension) to token embeddings
    that `embed_scale` brings to unit variance, so neither drowns the other. Without embed_scale
    (GPT-2/Llama-style init, token embeddings of std `init_std`), unit sinusoids would outweigh the
    tokens ~50:1 at init; they are scaled to the same RMS as the tokens instead (`amplitude`), so
    that this axis changes the position scheme, not the signal-to-noise of the input."""

    @staticmethod
    def num_parameters(cfg) -> int:
        return 0

    @classmethod
    def validate(cls, cfg, problems) -> None:
        problems.check(cfg.d_model % 2 == 0, "position", f"sinusoidal needs an even d_model (sine and cosine "
                       f"pairs), got d_model={cfg.d_model}")

    def __init__(self, cfg, causal: bool):
        super().__init__(cfg, causal)
        self.dim = cfg.d_model
        self.amplitude = 1.0 if cfg.embed_scale else cfg.init_std * math.sqrt(2.0)

    def embed(self, positions: torch.Tensor) -> torch.Tensor:
        table = sinusoid_table(positions, self.dim)
        return table if self.amplitude == 1.0 else table * self.amplitude


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of each head by position-dependent angles (the half-split
    layout used by GPT-NeoX and Hugging Face Llama; equivalent to Su et al.'s interleaved pairs
    up to a fixed permutation of the head dimensions). x: (B, nh, T, hs), cos and sin: (T, hs)."""
    kernel = _rotary_kernel(x, cos, sin)
    if kernel is not None:
        return rotary_cpu(x, cos, sin, kernel)
    return apply_rotary_reference(x, cos, sin)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The eager formula: five element-wise kernels and a concatenation (a GPU, torch.compile, no compiler)."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def _rotary_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The C++ rotation (study/axes/kernels/rotary.cpp: one pass, the same formula) for CPU tensors of the layout
    attention passes in eager mode, or None."""
    if x.dim() != 4 or x.stride(-1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        return None
    if cos.shape != x.shape[-2:] or sin.shape != cos.shape or cos.dtype != torch.float32 or sin.dtype != cos.dtype:
        return None
    return eager_cpu_ops("rotary", x)


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel=None) -> torch.Tensor:
    """`apply_rotary_reference` in one C++ pass each way (study/axes/kernels/rotary.cpp), its autograd node in C++:
    the backward applies the rotation's transpose (cos and sin come from positions, not parameters: they take no
    gradient)."""
    return (kernel or cpu_ops("rotary")).rotary(x, cos, sin)


@POSITIONS.register("rope", "rotary position embedding on q and k (Su et al. 2021, RoFormer; Llama)")
class RotaryPosition(PositionScheme):
    cpu_kernel = "rotary"
    reads = ("rope_theta",)

    @staticmethod
    def num_parameters(cfg) -> int:
        return 0

    @classmethod
    def validate(cls, cfg, problems) -> None:
        if cfg.n_heads >= 1 and (cfg.head_dim is not None or cfg.d_model % cfg.n_heads == 0):
            given = f"head_dim={cfg.head_dim}" if cfg.head_dim is not None else \
                f"d_model / n_heads = {cfg.d_model} / {cfg.n_heads}"
            problems.check(cfg.resolved_head_dim % 2 == 0, "position", "rope rotates pairs of dimensions and needs "
                           f"an even head dimension, got {cfg.resolved_head_dim} ({given})")

    def __init__(self, cfg, causal: bool):
        super().__init__(cfg, causal)
        self.dim, self.theta = cfg.resolved_head_dim, cfg.rope_theta

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # computed here in float32 (not a buffer) so bf16-true training cannot round the frequencies
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=positions.device) / self.dim))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def alibi_slopes(n_heads: int) -> list[float]:
    """Head slopes of Press et al. 2022 (ALiBi), their reference code: a geometric sequence
    starting at 2^(-8/n); for a head count that is not a power of two, the slopes of the
    closest lower power of two followed by every other slope of the next one."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_two(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: n_heads - closest]


@POSITIONS.register("alibi", "linear distance penalty on attention scores (Press et al. 2022, ALiBi)")
class AlibiPosition(PositionScheme):
    @staticmethod
    def num_parameters(cfg) -> int:
        return 0

    def __init__(self, cfg, causal: bool):
        super().__init__(cfg, causal)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(cfg.n_heads)), persistent=False)

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        # -m * (i - j) for keys j <= i; bidirectional stacks penalise |i - j| symmetrically.
        distance = (q_positions[:, None] - k_positions[None, :]).abs().float()
        return -self.slopes[:, None, None] * distance[None]


def t5_relative_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket of (key - query) offsets, Raffel et al. 2020 (T5): exact buckets for small
    offsets, logarithmic ones up to max_distance; half the buckets per direction when
    bidirectional."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (
        torch.log(relative_position.float().clamp(min=1) / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, large)


@POSITIONS.register("t5_bias", "learned bucketed relative bias per head, shared across layers (Raffel et al. 2020, T5)")
class T5RelativeBias(PositionScheme):
    reads = ("rel_buckets", "rel_max_distance")

    @staticmethod
    def num_parameters(cfg) -> int:
        return cfg.rel_buckets * cfg.n_heads

    @classmethod
    def validate(cls, cfg, problems) -> None:
        problems.check(cfg.rel_buckets >= 4, "rel_buckets", f"t5_bias needs rel_buckets >= 4, got {cfg.rel_buckets}")
        # a bidirectional stack (an encoder's) gives each direction half the buckets (T5's num_buckets //= 2): an
        # odd count would train a bucket no offset ever reaches; a causal stack uses every one
        problems.check(cfg.arch == "decoder" or cfg.rel_buckets % 2 == 0, "rel_buckets",
                       f"t5_bias in arch={cfg.arch!r} (a bidirectional encoder) needs an even rel_buckets, got "
                       f"{cfg.rel_buckets}")
        # the log-spaced buckets start past the exact-offset ones: rel_buckets // 2 in a causal stack, and // 4 in a
        # bidirectional one (half the buckets per direction), so only an encoder-only model gets the lower bound
        exact = cfg.rel_buckets // 4 if cfg.arch == "encoder" else cfg.rel_buckets // 2
        problems.check(cfg.rel_max_distance > exact, "rel_max_distance",
                       f"must exceed {exact} (the exact-offset buckets of rel_buckets={cfg.rel_buckets} in "
                       f"arch={cfg.arch!r}), got {cfg.rel_max_distance}")

    def __init__(self, cfg, causal: bool):
        super().__init__(cfg, causal)
        self.num_buckets = cfg.rel_buckets
        self.max_distance = cfg.rel_max_distance
        self.table = nn.Embedding(cfg.rel_buckets, cfg.n_heads)

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        relative = k_positions[None, :] - q_positions[:, None]
        buckets = t5_relative_bucket(relative, not self.causal, self.num_buckets, self.max_distance)
        return self.table(buckets).permute(2, 0, 1)


def make_position(cfg, causal: bool) -> PositionScheme:
    return POSITIONS[cfg.position](cfg, causal)
