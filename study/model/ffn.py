"""FFN activation axis: plain two-layer MLPs and gated linear units.

Gated variants (Shazeer 2020, "GLU Variants Improve Transformer") compute
act(x W_gate) * (x W_up); W_gate and W_up are stored as one fused matrix
(gate rows first) so one matmul serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from study.model.registry import Registry


@dataclass(frozen=True)
class Activation:
    fn: Callable[[torch.Tensor], torch.Tensor]
    gated: bool


ACTIVATIONS: Registry[Activation] = Registry("activation")
ACTIVATIONS.add("relu", Activation(F.relu, gated=False), "ReLU MLP (Vaswani et al. 2017, T5 v1.0)")
ACTIVATIONS.add("gelu", Activation(F.gelu, gated=False), "GELU, exact erf form (Hendrycks & Gimpel 2016; BERT)")
ACTIVATIONS.add(
    "gelu_tanh", Activation(lambda x: F.gelu(x, approximate="tanh"), gated=False), "GELU, tanh approximation (GPT-2)"
)
ACTIVATIONS.add("silu", Activation(F.silu, gated=False), "SiLU/Swish MLP (Ramachandran et al. 2017)")
ACTIVATIONS.add("swiglu", Activation(F.silu, gated=True), "SiLU-gated linear unit (Shazeer 2020; Llama)")
ACTIVATIONS.add("geglu", Activation(F.gelu, gated=True), "GELU-gated linear unit (Shazeer 2020; T5 v1.1)")


def default_d_ff(d_model: int, gated: bool) -> int:
    """4d for a plain MLP; for a gated one, 2/3 of that so the parameter count matches
    (Shazeer 2020), rounded up to a multiple of min(256, d_model / 16): Llama's 256 at
    d_model 4096 (-> 11008), while small models stay within a few percent of the plain MLP's
    size so an activation ablation does not also change the model size."""
    if not gated:
        return 4 * d_model
    multiple = max(1, min(256, d_model // 16))
    return multiple * -(-(8 * d_model // 3) // multiple)


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.activation = ACTIVATIONS[cfg.activation]
        d_ff = cfg.resolved_d_ff
        self.w_in = nn.Linear(cfg.d_model, d_ff * (2 if self.activation.gated else 1), bias=cfg.bias)
        self.w_out = nn.Linear(d_ff, cfg.d_model, bias=cfg.bias)
        # No dropout inside: BERT, GPT-2 and Vaswani et al. drop the sublayer output only,
        # which the residual recipe does.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_in(x)
        if self.activation.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.activation.fn(gate) * up
        else:
            h = self.activation.fn(h)
        return self.w_out(h)
