"""What training steps leave on the device until a logging step reads it, and the divergence rule read from it.

A training step never waits for the device: its loss and token count stay tensors in a ledger, and the ledger is read
once per logging step (and at checkpoints and the end). On a GPU every `.item()`, `bool()`, `.tolist()` or `.cpu()`
of a device tensor stalls the CPU until all queued kernels have run, so a per-step check (e.g. `bool(isfinite(loss))`)
would serialise the host with the device on every step.

The divergence rule (docs/experiments.md): a run has diverged when a step's training loss is not finite, or when the
mean training loss of the steps between two reads exceeds `train.divergence_factor` times the initial loss (the first
step's, before any update: a mean over later steps would already hold a fast blow-up). A blow-up that stays finite
(lr 10 without clipping: a loss of hundreds against an initial ~4) is then recorded as `diverged` with its step instead of being averaged into a variant's
interval as a completed run. A healthy run's loss stays below its initial value (the initial loss is about that of a
uniform prediction), so the factor only has to be large enough for the noise of one read's steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

@dataclass
class Read:
    """One read of the ledger: each step's index, loss and token count, in order."""

    steps: list[int]
    losses: list[float]
    tokens: list[int]


@dataclass
class Divergence:
    step: int
    reason: str


@dataclass
class StepLedger:
    """The (step, loss, tokens) of each training step since the last read; losses and counts stay on the device."""

    factor: float | None  # train.divergence_factor; None: only a non-finite loss is a divergence
    pending: list[tuple[int, torch.Tensor, Any]] = field(default_factory=list)
    initial: float | None = None  # the first step's loss (this rank's): the model as initialised, before any update

    def add(self, step: int, loss: torch.Tensor, tokens: int | torch.Tensor) -> None:
        self.pending.append((step, loss.detach(), tokens))

    def read(self, reduce_tokens=None) -> Read | None:
        """The pending steps, read from the device in one transfer (None when nothing is pending). `reduce_tokens`
        sums a tensor of per-step token counts over DDP ranks (every rank reads at the same steps)."""
        if not self.pending:
            return None
        steps = [s for s, _, _ in self.pending]
        device = self.pending[0][1].device
        counts = torch.stack([torch.as_tensor(t, device=device).float() for _, _, t in self.pending])
        if reduce_tokens is not None:
            counts = reduce_tokens(counts)
        losses = torch.stack([loss.float() for _, loss, _ in self.pending])
        values = torch.stack([losses, counts]).tolist()  # the one host sync of this read
        self.pending = []
        return Read(steps, values[0], [int(round(t)) for t in values[1]])

    def divergence(self, read: Read) -> Divergence | None:
        """The first divergence in `read` by the rule above, else None."""
        for step, loss in zip(read.steps, read.losses):
            if not math.isfinite(loss):
                return Divergence(step, f"training loss {loss} at step {step}")
        if self.initial is None:  # the first read sets it, and is judged against it too
            self.initial = read.losses[0]
        if self.factor is None:
            return None
        mean = sum(read.losses) / len(read.losses)
        if mean > self.factor * self.initial:
            return Divergence(read.steps[-1], f"mean training loss {mean:.4g} over steps {read.steps[0]}-"
                                              f"{read.steps[-1]} above {self.factor:g} x the initial {self.initial:.4g}")
        return None
