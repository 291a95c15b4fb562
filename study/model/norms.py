"""Norm type axis: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from study.model.registry import Registry

NORMS: Registry[type[nn.Module]] = Registry("norm")


@NORMS.register("layernorm", "LayerNorm: subtract the mean, divide by the std, scale and shift (Ba et al. 2016)")
class LayerNorm(nn.Module):
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
class RMSNorm(nn.Module):
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


def make_norm(name: str, dim: int, eps: float, bias: bool) -> nn.Module:
    return NORMS[name](dim, eps=eps, bias=bias)
