"""Norm type axis (`model.norm`): LayerNorm (Ba et al. 2016), RMSNorm (Zhang & Sennrich 2019), ScaleNorm (Nguyen &
Salazar 2019).

Every value is a `NormType`: an nn.Module built as `cls(dim, eps=..., bias=...)` that states how many parameters one
instance holds (`num_parameters`, which the cost accounting sums) and may add rules for the rest of the config
(`validate`).
"""

from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F
from torch import nn

from study.axes.registry import AxisRegistry


class NormType(nn.Module, abc.ABC):
    """The contract of a `model.norm` value."""

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
    """y = x / sqrt(mean(x^2) + eps) * g, computed in float32 as Llama and T5 do."""

    @staticmethod
    def num_parameters(dim: int, bias: bool) -> int:
        return dim

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False):
        super().__init__()
        del bias  # RMSNorm has no shift by definition
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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
