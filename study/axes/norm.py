"""Norm type axis (`model.norm`): LayerNorm (Ba et al. 2016), RMSNorm (Zhang & Sennrich 2019), ScaleNorm (Nguyen &
Salazar 2019).

Every value is a `NormType`: an nn.Module built as `cls(dim, eps=..., bias=...)` that states how many parameters one
instance holds (`num_parameters`, which the cost accounting sums) and may add rules for the rest of the config
(`validate`).
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from study.axes.cpu_kernels import eager_cpu_ops
from study.axes.registry import AxisRegistry


class NormType(nn.Module, abc.ABC):
    """The contract of a `model.norm` value."""

    #: The C++ CPU kernel this value runs (study/axes/kernels/<name>.cpp), built before a CPU run trains; None: none.
    cpu_kernel: ClassVar[str | None] = None

    @staticmethod
    @abc.abstractmethod
    def num_parameters(dim: int, bias: bool) -> int:
        """Trainable parameters of one instance over `dim` features (`bias`: the config's model.bias)."""

    @classmethod
    def validate(cls, cfg, problems) -> None:
        """Add a problem for every field of `cfg` (a ModelConfig) this norm cannot work with."""


NORMS: AxisRegistry[type[NormType]] = AxisRegistry("norm", NormType)


@NORMS.register("layernorm", "LayerNorm: subtract the mean, divide by the std, scale and shift (Ba et al. 2016)")
class LayerNorm(NormType):
    @staticmethod
    def num_parameters(dim: int, bias: bool) -> int:
        return dim * (2 if bias else 1)

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


@NORMS.register("rmsnorm", "RMSNorm: divide by the root mean square, scale only (Zhang & Sennrich 2019)")
class RMSNorm(NormType):
    """y = x / sqrt(mean(x^2) + eps) * g, computed in float32 as Llama and T5 do; full-precision input (the residual
    stream, with or without autocast) takes `RMSNormFunction`, about 3x faster forward + backward on CPU than the
    plain formula (bench/axis_cost.py)."""

    cpu_kernel = "rms_norm"

    @staticmethod
    def num_parameters(dim: int, bias: bool) -> int:
        return dim

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False):
        super().__init__()
        del bias  # RMSNorm has no shift by definition
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.float64):
            return rms_norm(x, self.weight, self.eps)  # training's case, autocast or not
        return rms_norm_reference(x, self.weight, self.eps)  # half-precision tensors: round as Llama and T5 do


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's fast path for float32/float64 x and weight: on a CPU in eager mode the C++ kernel with its autograd
    node in C++ (study/axes/kernels/rms_norm.cpp), elsewhere `RMSNormFunction`'s analytic backward in eager ops."""
    kernel = _cpu_kernel(x)
    if kernel is not None:  # (autocast leaves an op it has no rule for alone)
        return kernel.rms_norm(x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * g in float32, the result rounded to x's dtype before the scale (Hugging Face
    Llama's and T5's order); five element-wise kernels forward and more backward."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm in few passes over memory, with its analytic backward (Zhang & Sennrich 2019).

    Eager PyTorch has no fused CPU RMSNorm (`F.rms_norm` runs the composite of `rms_norm_reference`), so every
    element-wise op is one pass over the activations and a new buffer; autograd of the composite saves and replays
    each. Here the forward is one reduction (`vector_norm`, no temporary) and two multiplications, and the backward
    is written out: with r = (mean(x^2) + eps)^(-1/2), y = g x r and u = g dy,

        dL/dx = r (u - x r^2 mean(u x)),     dL/dg = sum over rows of dy x r,

    computed from q = dy x r (one product, one in-place pass): its sum over rows is dL/dg, one matrix-vector
    product q g gives r sum_j u x per row, and dL/dx takes one product and two in-place passes. Only x (kept alive
    by autograd anyway) and r (one number per row) are saved. On a CPU in eager mode `rms_norm` runs the same
    formulas as one C++ kernel per direction instead (study/axes/kernels/rms_norm.cpp), each a single pass over a
    row's memory, the only way to LayerNorm's speed there. Equal to `rms_norm_reference` to float rounding (a few
    float32 ulps of the largest entry: sums are accumulated in another order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # autocast would run the backward's mv in bf16
            d = x.shape[-1]
            rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(d).add_(eps).rsqrt_()
            y = (x * rstd).mul_(weight)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        d = x.shape[-1]
        with torch.autocast(x.device.type, enabled=False):
            dy_xhat = (dy * x).mul_(rstd).reshape(-1, d)  # (rows, d): dy x r
            d_weight = dy_xhat.sum(0)  # a pairwise sum over rows, as autograd's reduction of the composite
            k = torch.mv(dy_xhat, weight).view(rstd.shape).mul_(rstd).div_(-d)  # -r^2 mean(u x) per row
            dx = (x * k).addcmul_(dy, weight).mul_(rstd)
        return dx, d_weight, None


def _cpu_kernel(x: torch.Tensor):
    """The C++ RMSNorm (study/axes/kernels/rms_norm.cpp: one pass over each row per direction, the same formulas) for
    a CPU tensor in eager mode, or None: on a GPU, under torch.compile (which traces the eager path) or where it
    cannot be built."""
    return eager_cpu_ops("rms_norm", x)


@NORMS.register("scalenorm", "ScaleNorm: g * x / ||x||, one learned scalar (Nguyen & Salazar 2019)")
class ScaleNorm(NormType):
    """y = g * x / max(||x||_2, eps) with a single learned scale g, initialised to sqrt(d) so that the output starts
    with unit root mean square as LayerNorm's does (Nguyen & Salazar 2019, "Transformers without Tears", eq. 5).
    The norm is computed in float32, as RMSNorm's is."""

    @staticmethod
    def num_parameters(dim: int, bias: bool) -> int:
        return 1

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        del bias  # one scale, no shift
        self.eps = eps
        self.scale = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 / x32.norm(dim=-1, keepdim=True).clamp(min=self.eps)
        return (self.scale * x32).to(x.dtype)


def make_norm(name: str, dim: int, eps: float, bias: bool) -> nn.Module:
    return NORMS[name](dim, eps=eps, bias=bias)
