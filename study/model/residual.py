"""Norm position axis: how a residual branch wraps any sublayer.

- post: x = Norm(x + F(x))           (Vaswani et al. 2017; BERT)
- pre:  x = x + F(Norm(x))           (Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture"; GPT-2, Llama)
- sandwich: x = x + Norm(F(Norm(x))) (Ding et al. 2021, CogView)

Pre and sandwich stacks end with a final norm; post stacks do not need one (each
sublayer output is already normalised). `needs_final_norm` says which.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from study.model.norms import make_norm
from study.model.registry import Registry

RESIDUALS: Registry[type[nn.Module]] = Registry("norm_position")

Sublayer = Callable[[torch.Tensor], torch.Tensor]


class Residual(nn.Module):
    needs_final_norm = True
    norms_per_sublayer = 1

    def __init__(self, norm: str, dim: int, eps: float, bias: bool, dropout: float):
        super().__init__()
        self.norm = make_norm(norm, dim, eps, bias)
        self.dropout = nn.Dropout(dropout)


@RESIDUALS.register("post", "Norm(x + F(x)) - Vaswani et al. 2017, BERT")
class PostNorm(Residual):
    needs_final_norm = False

    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return self.norm(x + self.dropout(sublayer(x)))


@RESIDUALS.register("pre", "x + F(Norm(x)) - Xiong et al. 2020, GPT-2, Llama")
class PreNorm(Residual):
    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return x + self.dropout(sublayer(self.norm(x)))


@RESIDUALS.register("sandwich", "x + Norm(F(Norm(x))) - Ding et al. 2021 (CogView)")
class SandwichNorm(Residual):
    norms_per_sublayer = 2

    def __init__(self, norm: str, dim: int, eps: float, bias: bool, dropout: float):
        super().__init__(norm, dim, eps, bias, dropout)
        self.out_norm = make_norm(norm, dim, eps, bias)

    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return x + self.dropout(self.out_norm(sublayer(self.norm(x))))
