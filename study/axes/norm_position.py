"""Norm position axis (`model.norm_position`): how a residual branch wraps any sublayer.

- post: x = Norm(x + F(x))           (Vaswani et al. 2017; BERT)
- pre:  x = x + F(Norm(x))           (Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture"; GPT-2, Llama)
- sandwich: x = x + Norm(F(Norm(x))) (Ding et al. 2021, CogView)

Every value is a `ResidualRecipe`: it says how many norms it holds per sublayer, whether its stack needs a final
norm (pre and sandwich stacks do; a post stack's sublayer outputs are already normalised) and its parameter count,
which the cost accounting sums.
"""

from __future__ import annotations

import abc
from typing import Callable, ClassVar

import torch
from torch import nn

from study.axes.norm import NORMS, make_norm
from study.axes.registry import AxisRegistry

Sublayer = Callable[[torch.Tensor], torch.Tensor]


class ResidualRecipe(nn.Module, abc.ABC):
    """The contract of a `model.norm_position` value: wraps one sublayer, `forward(x, sublayer)`."""

    needs_final_norm: ClassVar[bool] = True
    norms_per_sublayer: ClassVar[int] = 1

    def __init__(self, norm: str, dim: int, eps: float, bias: bool, dropout: float):
        super().__init__()
        self.norm = make_norm(norm, dim, eps, bias)
        self.dropout = nn.Dropout(dropout)

    @classmethod
    @abc.abstractmethod
    def num_parameters(cls, cfg, sublayers: int) -> int:
        """Trainable parameters this recipe holds around `sublayers` sublayers (the stack's final norm not included):
        its norms, and anything else it learns (a ReZero-style residual gate, Bachlechner et al. 2020, would add one
        scalar per sublayer), so every recipe states it."""

    @staticmethod
    def norm_parameters(cfg) -> int:
        """Parameters of one `cfg.norm` over d_model features, as the norm type declares them."""
        return NORMS[cfg.norm].num_parameters(cfg.d_model, cfg.bias)

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        """x after the residual branch around `sublayer`."""

    @classmethod
    def validate(cls, cfg, problems) -> None:
        """Add a problem for every field of `cfg` (a ModelConfig) this recipe cannot work with."""


NORM_POSITIONS: AxisRegistry[type[ResidualRecipe]] = AxisRegistry("norm_position", ResidualRecipe)


@NORM_POSITIONS.register("post", "Norm(x + F(x)) - Vaswani et al. 2017, BERT")
class PostNorm(ResidualRecipe):
    needs_final_norm = False

    @classmethod
    def num_parameters(cls, cfg, sublayers: int) -> int:
        return sublayers * cls.norms_per_sublayer * cls.norm_parameters(cfg)

    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return self.norm(x + self.dropout(sublayer(x)))


@NORM_POSITIONS.register("pre", "x + F(Norm(x)) - Xiong et al. 2020, GPT-2, Llama")
class PreNorm(ResidualRecipe):
    @classmethod
    def num_parameters(cls, cfg, sublayers: int) -> int:
        return sublayers * cls.norms_per_sublayer * cls.norm_parameters(cfg)

    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return x + self.dropout(sublayer(self.norm(x)))


@NORM_POSITIONS.register("sandwich", "x + Norm(F(Norm(x))) - Ding et al. 2021 (CogView)")
class SandwichNorm(ResidualRecipe):
    norms_per_sublayer = 2  # one norm on the way in, one on the way out

    @classmethod
    def num_parameters(cls, cfg, sublayers: int) -> int:
        return sublayers * cls.norms_per_sublayer * cls.norm_parameters(cfg)

    def __init__(self, norm: str, dim: int, eps: float, bias: bool, dropout: float):
        super().__init__(norm, dim, eps, bias, dropout)
        self.out_norm = make_norm(norm, dim, eps, bias)

    def forward(self, x: torch.Tensor, sublayer: Sublayer) -> torch.Tensor:
        return x + self.dropout(self.out_norm(sublayer(self.norm(x))))
