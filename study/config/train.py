"""`TrainConfig`: the optimisation recipe and budget shared by every task."""

from __future__ import annotations

from dataclasses import dataclass

from study.config.base import Config, Problems

SCHEDULES = ("constant", "cosine", "linear", "inverse_sqrt")
# auto: bf16-mixed where the device multiplies bf16 natively (a CUDA GPU of compute capability 8.0+, a CPU with
# AVX-512 BF16 or AMX), else 32-true; a run resolves it once and records what it ran
# (study.model.precision.resolve_precision).
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true")


@dataclass(frozen=True)
class TrainConfig(Config):
    max_steps: int = 1000
    max_time_s: float | None = None  # wall-clock training budget; stops cleanly when spent
    batch_size: int = 32  # per device: sequences (lm, pretrain, glue) or sentence pairs (translation)
    accumulate: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # floor of cosine/linear decay, as a fraction of lr
    warmup_steps: int = 100
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float | None = 1.0
    # A run has diverged when a step's training loss is not finite, or when the mean training loss between two
    # logging steps exceeds this factor times the initial loss (the first step's, before any update); None: only a
    # non-finite loss counts. A diverged run is a result, recorded with its step (study.tasks.ledger).
    divergence_factor: float | None = 4.0
    # Evaluate and save an exponential moving average of the weights instead of the last ones (Polyak & Juditsky
    # 1992; the averaged checkpoints of Vaswani et al. 2017); None -> off. 0.999 averages over ~1,000 steps.
    ema_decay: float | None = None
    label_smoothing: float = 0.0
    precision: str = "32-true"  # Lightning precision, or auto (see PRECISIONS)
    compile: bool = False
    seed: int = 0
    eval_every: int = 250
    eval_batches: int | None = 20  # batches per in-training evaluation; None -> the whole split
    log_every: int = 10
    grad_norm_every: int = 50  # per-layer gradient norms (Xiong et al. 2020's picture); 0 -> off
    checkpoint_every: int | None = None  # None -> eval_every
    accelerator: str = "auto"
    devices: int = 1
    strategy: str = "auto"  # 'ddp' for several GPUs (each rank draws its own batches)
    num_workers: int = 0
    progress_bar: bool = True

    def _validate(self, p: Problems) -> None:
        p.choice("schedule", self.schedule, SCHEDULES)
        p.choice("precision", self.precision, PRECISIONS)
        p.choice("accelerator", self.accelerator, ("auto", "cpu", "gpu", "cuda", "mps"))
        # ddp_spawn would leave the run's measurements in the workers; fsdp shards what rank 0 evaluates
        p.choice("strategy", self.strategy, ("auto", "ddp"))
        for name in ("max_steps", "batch_size", "accumulate", "eval_every", "log_every", "devices"):
            p.check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "grad_norm_every", "num_workers", "seed"):
            p.check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        p.check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        p.check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        p.check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            p.check(0 <= getattr(self, name) < 1, name, f"must be in [0, 1), got {getattr(self, name)}")
        p.check(0 <= self.label_smoothing < 1, "label_smoothing", f"must be in [0, 1), got {self.label_smoothing}")
        p.check(self.grad_clip is None or self.grad_clip > 0, "grad_clip", "must be > 0 or null")
        p.check(self.divergence_factor is None or self.divergence_factor > 1, "divergence_factor",
                f"must be > 1 or null, got {self.divergence_factor}")
        p.check(self.ema_decay is None or 0 < self.ema_decay < 1, "ema_decay", f"must be in (0, 1) or null, got {self.ema_decay}")
        # the average is kept in the parameters' dtype: in bf16 an update of 1 - 0.999 of a step rounds away
        p.check(self.ema_decay is None or self.precision != "bf16-true", "ema_decay",
                "cannot average weights kept in bf16 (precision bf16-true): use bf16-mixed, or ema_decay null")
        p.check(self.max_time_s is None or self.max_time_s > 0, "max_time_s", "must be > 0 or null")
        p.check(self.eval_batches is None or self.eval_batches >= 1, "eval_batches", "must be >= 1 or null")
        p.check(self.checkpoint_every is None or self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1 or null")
        if self.schedule == "inverse_sqrt":
            p.check(self.warmup_steps >= 1, "warmup_steps", "inverse_sqrt needs warmup_steps >= 1")
        # only a decaying schedule has a floor (study.tasks.base.lr_multiplier): elsewhere the value would be unread
        if self.schedule in ("constant", "inverse_sqrt"):
            default = type(self).__dataclass_fields__["min_lr_ratio"].default
            p.check(self.min_lr_ratio == default, "min_lr_ratio",
                    f"only applies to schedule cosine or linear (a floor of their decay), got {self.min_lr_ratio} with "
                    f"schedule={self.schedule!r}; leave it at its default {default}")
        p.check(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")

    def unread_fields(self) -> dict[str, str]:
        """Field -> why, for each field whose value never reaches the trained model: the progress bar, and under a
        warm-up as long as training the schedule after it (every schedule warms up alike: lr_multiplier)."""
        # how a run reports its progress, never what it trains (a sweep's trials write lines to their trial.log)
        out = {"progress_bar": "it changes how a run reports its progress, not what it trains"}
        if self.warmup_steps < self.max_steps - 1:
            return out
        why = (f"warm-up (warmup_steps={self.warmup_steps}) lasts max_steps={self.max_steps} steps, so no step runs "
               "the schedule after it below the peak rate")
        return out | {"schedule": why, "min_lr_ratio": why}
