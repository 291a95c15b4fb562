"""The feed-forward sublayer: a two-layer MLP or a gated linear unit, as the activation axis says (study.axes).

Gated variants (Shazeer 2020) compute act(x W_gate) * (x W_up); W_gate and W_up are stored as one fused matrix
(gate rows first) so one matmul serves both.
"""

from __future__ import annotations

import torch
from torch import nn

from study.axes import ACTIVATIONS


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
        h = self.w_in(x)  # (B, T, d_ff) or (B, T, 2 d_ff) for a gated unit: [gate; up]
        return self.w_out(self.activation.apply(h))  # (B, T, d_ff) -> (B, T, d_model)
