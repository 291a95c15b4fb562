"""FFN activation axis (`model.activation`): plain two-layer MLPs and gated linear units.

Gated variants (Shazeer 2020, "GLU Variants Improve Transformer") compute act(x W_gate) * (x W_up); the model stores
W_gate and W_up as one fused matrix (gate rows first) so one matmul serves both (`study.model.ffn.FeedForward`).
Every value is an `Activation` class: its function, whether it gates, and so the parameter count of the FFN it
implies, which the cost accounting sums.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch
import torch.nn.functional as F

from study.axes.cpu_kernels import eager_cpu_ops
from study.axes.registry import AxisRegistry


def default_d_ff(d_model: int, gated: bool) -> int:
    """4d for a plain MLP; for a gated one, 2/3 of that so the parameter count matches
    (Shazeer 2020), rounded up to a multiple of min(256, d_model / 16): Llama's 256 at
    d_model 4096 (-> 11008), while small models stay within a few percent of the plain MLP's
    size so an activation ablation does not also change the model size."""
    if not gated:
        return 4 * d_model
    multiple = max(1, min(256, d_model // 16))
    return multiple * -(-(8 * d_model // 3) // multiple)


class Activation(abc.ABC):
    """The contract of a `model.activation` value."""

    gated: ClassVar[bool]  # a gated linear unit: the input projection is twice as wide
    #: The C++ CPU kernel this value runs (study/axes/kernels/<name>.cpp), built before a CPU run trains; None: none.
    cpu_kernel: ClassVar[str | None] = None
    required_attributes = ("gated",)

    @staticmethod
    @abc.abstractmethod
    def fn(x: torch.Tensor) -> torch.Tensor:
        """The elementwise function (of the gate, for a gated unit)."""

    @classmethod
    def apply(cls, h: torch.Tensor) -> torch.Tensor:
        """The FFN's hidden activation from its input projection h: fn(h), or fn(gate) * up for a gated unit, whose
        h (..., 2 d_ff) holds [gate; up]. On a CPU in eager mode through the value's C++ kernel where it declares one
        (`torch.ops.study_<cpu_kernel>.<cpu_kernel>(h)`, the same function in one pass each way)."""
        if cls.cpu_kernel is not None and h.dtype in (torch.float32, torch.bfloat16, torch.float64):
            kernel = eager_cpu_ops(cls.cpu_kernel, h)
            if kernel is not None:
                return getattr(kernel, cls.cpu_kernel)(h)
        return cls.eager(h)

    @classmethod
    def eager(cls, h: torch.Tensor) -> torch.Tensor:
        """`apply` in PyTorch operations: a GPU's path, torch.compile's, and the kernels' specification."""
        if cls.gated:
            gate, up = h.chunk(2, dim=-1)
            return cls.fn(gate) * up
        return cls.fn(h)

    @classmethod
    def num_parameters(cls, cfg) -> int:
        """Weights and biases of the FFN this activation implies: d_model -> d_ff (twice as wide when gated, the
        gate and the up projection) -> d_model."""
        d, ff = cfg.d_model, cfg.resolved_d_ff
        width = ff * (2 if cls.gated else 1)
        return d * width + (width if cfg.bias else 0) + ff * d + (d if cfg.bias else 0)

    @classmethod
    def validate(cls, cfg, problems) -> None:
        """Add a problem for every field of `cfg` (a ModelConfig) this activation cannot work with."""


ACTIVATIONS: AxisRegistry[type[Activation]] = AxisRegistry("activation", Activation)


@ACTIVATIONS.register("relu", "ReLU MLP (Vaswani et al. 2017, T5 v1.0)")
class ReLU(Activation):
    gated = False
    fn = staticmethod(F.relu)


@ACTIVATIONS.register("gelu", "GELU, exact erf form (Hendrycks & Gimpel 2016; BERT)")
class GELU(Activation):
    gated = False
    fn = staticmethod(F.gelu)


@ACTIVATIONS.register("gelu_tanh", "GELU, tanh approximation (GPT-2)")
class GELUTanh(Activation):
    """On a CPU in eager mode one C++ pass each way (study/axes/kernels/gelu_tanh.cpp): torch's own kernel for the
    tanh form ran 1.16-1.30x the time of its erf form in the FFN on three CPU kinds (bench/README.md), which an
    ablation would report as this form's cost."""

    gated = False
    cpu_kernel = "gelu_tanh"

    @staticmethod
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


@ACTIVATIONS.register("silu", "SiLU/Swish MLP (Ramachandran et al. 2017)")
class SiLU(Activation):
    gated = False
    fn = staticmethod(F.silu)


@ACTIVATIONS.register("swiglu", "SiLU-gated linear unit (Shazeer 2020; Llama)")
class SwiGLU(Activation):
    """On a CPU in eager mode, silu(gate) * up runs as one C++ pass each way (study/axes/kernels/swiglu.cpp): the
    eager chunk, silu, product and the backward's concatenation took 2.7x its time (Llama 20M's FFN, bench/README.md),
    which an activation ablation would otherwise report as SwiGLU's cost."""

    gated = True
    fn = staticmethod(F.silu)
    cpu_kernel = "swiglu"


@ACTIVATIONS.register("geglu", "GELU-gated linear unit, exact GELU (Shazeer 2020; T5 v1.1 gates with the tanh GELU)")
class GEGLU(Activation):
    """On a CPU in eager mode, gelu(gate) * up runs as one C++ pass each way (study/axes/kernels/geglu.cpp), for the
    reason SwiGLU's does."""

    gated = True
    fn = staticmethod(F.gelu)
    cpu_kernel = "geglu"
