"""The terminal's view of one run: a progress bar in optimizer steps of `train.max_steps`, named after the run.

Lightning's bar counts batches of an epoch ('Epoch 0/-2' for a step-budgeted run, whose epochs are endless); these
runs are budgeted in steps, so the bar says `glue/SST-2 seed 1 step 120/400` and keeps the step across epochs and
resumes."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.callbacks import Callback, TQDMProgressBar

from study.tasks.base import mid_step


class StepProgressBar(TQDMProgressBar):
    def __init__(self, name: str, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)
        self.name = name

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None)
        bar.n = trainer.global_step  # a resumed run starts where it stopped
        bar.set_description(f"{self.name} step")
        bar.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if mid_step(trainer):
            return
        if bar is not None and self._should_update(step, bar.total):
            bar.n = step
            every = trainer.log_every_n_steps
            if every > 0 and step % every == 0 or step == bar.total:  # the metrics read tensors: only when written
                bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()


def run_name(cfg) -> str:
    """'lm/tinyshakespeare seed 0', 'glue/SST-2 seed 1': the task, its dataset (a GLUE run: its task) and the
    seed, so a suite's or a pipeline's runs can be told apart in the terminal."""
    return f"{cfg.task.name}/{cfg.task.dataset} seed {cfg.train.seed}"


class StepLines(Callback):
    """The progress of a run without a progress bar (a sweep's trial, whose output goes to trial.log): one plain line
    `glue/SST-2 seed 1 step 120/400 train/loss=0.52 (8.1 steps/s)` at a written step at most every `every_s` seconds,
    and at the last step. It reads only what the step already logged, so it adds no host sync."""

    def __init__(self, name: str, every_s: float = 10.0):
        self.name, self.every_s = name, every_s
        self._last: tuple[float, int] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._last = (time.monotonic(), trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step, now = trainer.global_step, time.monotonic()
        if mid_step(trainer):  # its step_logs are not the step's
            return
        every = trainer.log_every_n_steps
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if self._last is None or not (last or (every > 0 and step % every == 0 and now - self._last[0] >= self.every_s)):
            return
        rate = (step - self._last[1]) / max(now - self._last[0], 1e-9)
        logs = getattr(pl_module, "step_logs", None) or trainer.logged_metrics  # this step's values (read: a written step)
        metrics = {k: v for k, v in logs.items() if k.startswith("train/") and k != "train/lr"}
        shown = " ".join(f"{k}={float(v):.4g}" for k, v in sorted(metrics.items()))
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "?"
        print(f"{self.name} step {step}/{total} {shown} ({rate:.2f} steps/s)", flush=True)
        self._last = (now, step)
