"""Training machinery shared by every task family.

`StudyModule` is the LightningModule base: AdamW with a decay/no-decay split,
warm-up schedules (decaying with the time budget when that runs out before the
steps), per-layer gradient norms, clean divergence handling, exact
resume (RNG state in the checkpoint; data position from the step counter), and
optional `torch.compile` that leaves checkpoints unchanged. Task modules only
implement `training_loss` and `validation_loss`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from typing import Any, Callable, ClassVar, Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Timer, WeightAveraging
from torch import nn

from study.config import ExperimentConfig, TrainConfig
from study.model import build_model
from study.model.precision import trains_on_cuda
from study.tasks.ledger import Divergence, StepLedger


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Learning-rate multiplier at optimizer step `step` (0-based) for the configured schedule."""
    warm = cfg.warmup_steps
    if cfg.schedule == "inverse_sqrt":  # Vaswani et al. 2017, eq. 3 (peak lr reached at warmup_steps)
        s = step + 1
        return min(s / warm, math.sqrt(warm / s))
    if warm and step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warm) / max(1, cfg.max_steps - warm))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":  # Loshchilov & Hutter 2017, without restarts
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * (1 - progress)  # linear


class TimeAwareSchedule:
    """`lr_multiplier` for a run that may stop on its time budget: with `train.max_time_s`, the decay after warm-up
    follows whichever runs out first, the steps or the time, so a run stopped by the clock ends with its learning
    rate decayed as a step-limited run would (a schedule that assumed max_steps would stop mid-decay).

    Both measure from the end of warm-up: the decay's share of the time is what the budget leaves after warm-up, so
    the rate goes on from its peak where warm-up ends (measured from time zero, a warm-up that took a third of the
    budget would drop the rate from 1.0 to 0.78 of its peak, cosine, in one step). The time is read, not kept (a
    resumed run's Timer restores the elapsed time); when warm-up ended is kept (`warmup_end_s`, in the checkpoint)."""

    def __init__(self, cfg: TrainConfig, training_seconds: Callable[[], float]):
        self.cfg, self.training_seconds = cfg, training_seconds
        self.warmup_end_s: float | None = None  # training seconds when the first step after warm-up was scheduled

    def __call__(self, step: int) -> float:
        cfg = self.cfg
        if not cfg.max_time_s or step < cfg.warmup_steps or cfg.schedule in ("constant", "inverse_sqrt"):
            return lr_multiplier(step, cfg)
        now = self.training_seconds()
        if self.warmup_end_s is None:
            self.warmup_end_s = now
        by_steps = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        left = cfg.max_time_s - self.warmup_end_s
        by_time = (now - self.warmup_end_s) / left if left > 0 else 1.0
        progress = min(1.0, max(by_steps, by_time))
        return lr_multiplier(round(cfg.warmup_steps + progress * (cfg.max_steps - cfg.warmup_steps)), cfg)


def mid_step(trainer) -> bool:
    """This batch is a micro-batch before its optimizer step's last (train.accumulate): global_step still names the
    step before, whose hooks already ran. The one place this project reads Lightning's private `_should_accumulate`."""
    return trainer.fit_loop._should_accumulate()


def is_logging_step(trainer) -> bool:
    """The optimizer step just taken is one Lightning writes logs at (every `train.log_every` steps); a run's last
    step is written too (the module checks that: a stop decided in this step's callbacks)."""
    every = trainer.log_every_n_steps
    return every > 0 and trainer.global_step % every == 0


class SyncedTimer(Timer):
    """Lightning's Timer (the `train.max_time_s` budget; a resumed run restores its elapsed time) with one clock for
    every rank. Lightning's broadcasts rank zero's stop decision after every step, a host sync in each step under
    DDP, while each rank reading its own clock for the learning-rate schedule (time_aware_multiplier) gives the
    replicas different learning rates. Under DDP this one broadcasts rank zero's elapsed time at the start and at
    logging steps only, so a run may overshoot its budget by up to log_every steps; one process checks every step."""

    synced_seconds = 0.0

    @property
    def state_key(self) -> str:
        return "Timer"  # the key Lightning's own Timer saved under: checkpoints written before this class resume

    def on_train_start(self, trainer, *args: Any, **kwargs: Any) -> None:
        super().on_train_start(trainer, *args, **kwargs)
        if trainer.world_size > 1:
            self._sync(trainer)

    def on_train_batch_end(self, trainer, *args: Any, **kwargs: Any) -> None:
        if mid_step(trainer):  # a stop between micro-batches would drop their gradients
            return
        if trainer.world_size == 1:
            super().on_train_batch_end(trainer, *args, **kwargs)
        elif self._duration is not None and (trainer.log_every_n_steps <= 0 or is_logging_step(trainer)):
            self._sync(trainer)
            trainer.should_stop = trainer.should_stop or self.synced_seconds >= self._duration

    def _sync(self, trainer) -> None:
        self.synced_seconds = float(trainer.strategy.broadcast(self.time_elapsed("train")))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (linear weights and embeddings); not biases or norm gains (as nanoGPT and GPT-3)."""
    seen: set[int] = set()
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def freeze_unused(model: nn.Module, prefixes: Sequence[str]) -> None:
    """Stop the gradient of the parameters only `prefixes` hold (a head the task's loss never reaches). Under DDP a
    parameter that requires a gradient must get one in every step, or Lightning stops on the second step
    (find_unused_parameters would search the graph every step instead); the optimizer skips them either way. A
    parameter shared with the rest of the model (the MLM decoder's weight, tied to the token embedding) keeps it."""
    names: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    for p, held_as in names.values():
        if prefixes and all(name.startswith(tuple(prefixes)) for name in held_as):
            p.requires_grad_(False)


_LAYER = re.compile(r"(encoder|decoder)\.blocks\.(\d+)\.")


def layer_grad_norms(model: nn.Module) -> dict[str, float]:
    """L2 norm of the gradient of each block's parameters, keyed 'decoder.03' etc. (zero-padded so they sort).

    One `torch._foreach_norm` over every gradient and one transfer of the per-layer norms: a float() per parameter
    would wait for the device once per parameter (hundreds of host syncs on a GPU)."""
    keys, grads = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        m = _LAYER.search(name)
        keys.append(f"{m.group(1)}.{int(m.group(2)):02d}" if m else "other")
        grads.append(p.grad.detach())
    if not grads:
        return {}
    layers = sorted(set(keys))
    squares = torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2)  # (n_params,)
    index = torch.tensor([layers.index(k) for k in keys], device=squares.device)
    per_layer = torch.zeros(len(layers), device=squares.device).index_add_(0, index, squares).sqrt()
    return dict(zip(layers, per_layer.tolist()))


class StudyModule(L.LightningModule):
    # what `save_outputs(run_dir)` writes beside the record (files or folders, relative to the run directory): a
    # forced rerun removes them with the old result (study.run.single.discard_result)
    output_paths: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: ExperimentConfig):
        super().__init__()
        self.cfg = cfg
        self.model = build_model(cfg.model)
        freeze_unused(self.model, self.unused_heads())
        # compiled forward kept outside the module tree, so state_dict keys never change
        object.__setattr__(self, "_compiled", torch.compile(self.model) if cfg.train.compile else None)
        self.diverged_at: int | None = None
        self.divergence: Divergence | None = None  # the rule that stopped the run, and where (study.tasks.ledger)
        self.train_tokens = 0  # up to the last read of the ledger (every logging step, checkpoint and the end)
        self.ledger = StepLedger(cfg.train.divergence_factor)
        self.schedule = TimeAwareSchedule(cfg.train, self.training_seconds)  # the learning rate's multiplier
        self._step_started: float | None = None
        self._checkpoint_started: float | None = None  # a checkpoint written in this step began then
        self.step_times: list[float] = []
        self.step_tokens: list[int] = []
        # fit seconds of the earlier attempts of a resumed run, up to the checkpoint it resumed from (in the
        # checkpoint), and when this attempt's fit began: a preempted run's cost is the whole run's, not its last part's
        self.fit_seconds_before, self._fit_started = 0.0, time.time()
        self.measured_before: tuple[int, float] = (0, 0.0)  # (tokens, seconds) timed by the attempts resumed
        self.step_logs: dict[str, Any] = {}  # this step's training values, logged in on_train_batch_end
        self._step_means: dict[str, Any] = {}  # the optimizer step's values so far, over its micro-batches
        self._rng_restored = False  # this rank's random stream came from a checkpoint (on_load_checkpoint)

    @property
    def forward_model(self) -> nn.Module:
        """What a training or evaluation step calls: the model's torch.compile'd forward with train.compile, else
        the model itself (the two share weights; checkpoints hold only `self.model`'s)."""
        return self._compiled if self._compiled is not None else self.model

    def precision_context(self) -> contextlib.AbstractContextManager:
        """The trainer's precision context (autocast under mixed precision) for evaluation and decoding outside
        Lightning's own loops; nullcontext without a trainer. Take a fresh one for each `with`: Lightning's
        mixed-precision context is a one-shot generator and cannot be entered twice."""
        return self.trainer.precision_plugin.forward_context() if self._trainer is not None else contextlib.nullcontext()

    # --- to implement ---------------------------------------------------------------
    def unused_heads(self) -> tuple[str, ...]:
        """Prefixes of the model's parameters this task's loss never reaches (frozen: see freeze_unused)."""
        return ()

    def training_loss(self, batch: Any) -> tuple[torch.Tensor, int | torch.Tensor]:
        """(mean loss, number of target tokens) for one batch; a count that needs the batch's values stays a tensor
        (reading it here would make every step wait for the device)."""
        raise NotImplementedError

    def validation_loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        return self.training_loss(batch)

    # --- optimisation ---------------------------------------------------------------
    def configure_optimizers(self):
        t = self.cfg.train
        kwargs = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps)
        groups = parameter_groups(self, t.weight_decay)  # the LightningModule's: task heads outside the model too
        # The fused kernel is 3-4x faster than foreach on CPU (6 against 28 ms a step for the 7.6M Multi30k model)
        # and exists for CPU and CUDA in recent torch. Not under fp16 loss scaling: a fused step unscales inside
        # itself, and the GradScaler must unscale before gradients are clipped.
        optimizer = None
        if t.precision != "16-mixed":
            try:
                optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
            except (RuntimeError, TypeError, ValueError):
                pass
        if optimizer is None:
            optimizer = torch.optim.AdamW(groups, **kwargs)
        # a function for LambdaLR, which would otherwise save the schedule object's attributes (this module among
        # them) in its state; when warm-up ended goes into the checkpoint's `study` entry instead
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.schedule(step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # bf16 autocast has no loss scaler, so the gradients are at their true scale and are clipped here. Lightning's
        # mixed-precision plugin refuses to clip whenever the optimizer unscales in its own step (the fused AdamW),
        # a rule that only fp16's GradScaler needs.
        if gradient_clip_val and self.trainer.precision == "bf16-mixed":
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def training_seconds(self) -> float:
        """Wall time of training so far, from Lightning's Timer (which a resumed run restores); 0 without one. Under
        DDP rank zero's, as of the last logging step (SyncedTimer): every replica takes the same learning rate."""
        trainer = self._trainer
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None) if trainer is not None else None
        if timer is None:
            return 0.0
        if isinstance(timer, SyncedTimer) and trainer.world_size > 1:
            return timer.synced_seconds
        return timer.time_elapsed("train")

    def on_before_optimizer_step(self, optimizer) -> None:
        every = self.cfg.train.grad_norm_every
        if every and self.global_step % every == 0:
            norms = layer_grad_norms(self.model)
            if norms:
                # Straight to the loggers under this step. A value given to `self.log` stays in
                # Lightning's step results for the rest of the epoch (here: the whole run) and is
                # re-written, stale, under every later logged step that does not log it again.
                metrics = {f"grad_norm/{k}": v for k, v in norms.items()}
                for logger in self.loggers:
                    logger.log_metrics(metrics, step=self.global_step)

    # --- steps ----------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_started, self._checkpoint_started = time.perf_counter(), None

    def training_step(self, batch: Any, batch_idx: int):
        # Nothing here reads a device tensor: the loss and token count go to the ledger, read at logging steps.
        loss, n_tokens = self.training_loss(batch)
        self.step_logs["train/loss"] = loss.detach()
        self.step_logs["train/lr"] = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.ledger.add(int(self.global_step), loss, n_tokens)
        return loss

    def on_train_batch_end(self, outputs, batch: Any, batch_idx: int) -> None:
        # `self.log` only on the steps Lightning writes (every log_every steps, and the last one): each call costs
        # ~0.6 ms on CPU, 2-4% of a small model's step if made every step. A value logged on some other step
        # would be written, stale, under the next written step; this hook runs after the callbacks' (a Timer
        # that ends the run sets should_stop there), so the last step is never missed.
        trainer = self.trainer
        if self.diverged_at is not None:  # found by a checkpoint's read in this step: a stop, this step's values
            trainer.should_stop = True    # written (left for Lightning's stop, they would be an earlier step's)
        last = trainer.should_stop or (trainer.max_steps > 0 and self.global_step >= trainer.max_steps)
        # between micro-batches of an optimizer step (train.accumulate) nothing is written: global_step still names
        # the step before, whose values were written at its own last micro-batch
        accumulating = mid_step(trainer)
        written = not accumulating and (last or is_logging_step(trainer))
        if written:
            self.settle()  # before the step's time is taken: on a GPU the read waits for the queued steps
        if self._step_started is not None:  # the step's time, up to a checkpoint written in it (not training)
            self.step_times.append((self._checkpoint_started or time.perf_counter()) - self._step_started)
        self._add_to_step_means(trainer.accumulate_grad_batches)
        if self._step_means and written and (is_logging_step(trainer) or trainer.should_stop):
            for name, value in self._step_means.items():
                self.log(name, value, prog_bar=name == "train/loss", on_step=True, on_epoch=False)
        elif self._step_means and written:  # the last step (max_steps) between logging steps: Lightning writes
            # only at logging steps and at a stop it was told of (should_stop), so to the loggers directly, under
            # the step index Lightning gives the steps it writes (the optimizer steps taken before this one)
            values = {k: float(v) for k, v in self._step_means.items()}
            for logger in self.loggers:
                logger.log_metrics(values, step=self.global_step - 1)
        if not accumulating:
            self._step_means = {}
        if self.diverged_at is not None:  # a diverged run is a result: stop cleanly, its step recorded
            trainer.should_stop = True

    def _add_to_step_means(self, accumulate: int) -> None:
        """A step's logged values are the means over its micro-batches (train.accumulate; one micro-batch alone is a
        sample of batch_size), kept on the device; a plain number (the learning rate) is the step's own."""
        for name, value in self.step_logs.items():
            mean = self._step_means.get(name, 0.0) + value / accumulate if torch.is_tensor(value) else value
            self._step_means[name] = mean
        self.step_logs = {}

    def settle(self) -> None:
        """Read the ledger (one host sync): count the tokens of the steps read, and apply the divergence rule."""
        reduce = None
        if self.trainer.world_size > 1:  # every rank reads at the same steps; throughput is the whole job's
            reduce = lambda counts: self.trainer.strategy.reduce(counts, reduce_op="sum")  # noqa: E731
        read = self.ledger.read(reduce)
        if read is None:
            return
        found = self.ledger.divergence(read) if self.diverged_at is None else None
        diverged = found is not None
        if self.trainer.world_size > 1:  # every rank must stop together, or DDP hangs
            diverged = self.trainer.strategy.reduce_boolean_decision(diverged, all=False)
        if diverged and self.diverged_at is None:
            self.divergence = found or Divergence(read.steps[-1], "another rank's training loss diverged")
            self.diverged_at = self.divergence.step
        counted = [t for s, t in zip(read.steps, read.tokens) if self.diverged_at is None or s < self.diverged_at]
        self.step_tokens += counted
        self.train_tokens += sum(counted)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, n_tokens = self.validation_loss(batch)
        self.log("val/loss", loss, prog_bar=True, batch_size=max(1, n_tokens), sync_dist=True)

    # --- random streams and exact resume -------------------------------------------
    def on_train_start(self) -> None:
        # Under DDP every rank was seeded alike (one model initialisation; DDP broadcasts rank zero's anyway), so
        # rank r's examples would draw rank zero's dropout masks at the same positions: correlated noise a single
        # process training the same global batch never has. Each rank > 0 takes a stream of its own (nanoGPT offsets
        # its seed by rank); rank zero keeps the seed's, as one process would. A resumed run took its own rank's
        # saved stream in on_load_checkpoint, unless it saved under another world size: then a fresh one.
        rank = self.trainer.global_rank
        if self.trainer.world_size > 1 and rank > 0 and not self._rng_restored:
            torch.manual_seed(rank_stream_seed(self.cfg.train.seed, rank, self.global_step))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.settle()  # the ledger's steps up to this checkpoint are counted in it
        for logger in self.loggers:  # rows logged to the loggers directly (gradient norms) are on disk before the
            logger.save()            # checkpoint: a run killed after it resumes past them and never logs them again
        # Lightning's checkpoint callback writes in the step's end hooks, before this module's: the write (about
        # 0.1-0.5 s of torch.save for model and AdamW state) is not the step's training time (throughput)
        self._checkpoint_started = time.perf_counter()
        # the device this rank trains on; *_all would open a context on every visible GPU, and give a rank the state
        # of a device it never used. A CPU run on a GPU machine saves none: it never drew from that stream, and asking
        # initialises CUDA in the process (no context: 4 MiB of the GPU, bench/results/gpu-2026-11-28)
        on_cuda = self.trainer.strategy.root_device.type == "cuda"
        streams = (torch.get_rng_state(), [torch.cuda.get_rng_state()] if on_cuda else [])
        by_rank = [streams]
        if self.trainer.world_size > 1:  # every rank saves (a collective in Lightning), rank zero writes
            by_rank = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(by_rank, streams)
        checkpoint["study"] = {
            "torch_rng": streams[0], "cuda_rng": streams[1],  # rank zero's (and the only ones, before by_rank)
            "rng_by_rank": by_rank,
            "train_tokens": self.train_tokens,
            "diverged_at": self.diverged_at,
            "divergence": dataclasses.asdict(self.divergence) if self.divergence else None,
            "initial_loss": self.ledger.initial,
            "warmup_end_s": self.schedule.warmup_end_s,
            "fit_seconds": self.fit_seconds(),
            "throughput_measured": self._measured(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("study", {})
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self._trainer is not None else (0, 1)
        by_rank = state.get("rng_by_rank") or ([(state["torch_rng"], state.get("cuda_rng", []))]
                                               if "torch_rng" in state else [])
        if by_rank and (len(by_rank) == world or rank == 0):
            torch_rng, cuda_rng = by_rank[rank if len(by_rank) == world else 0]
            torch.set_rng_state(torch_rng)
            if cuda_rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(cuda_rng[0])  # (a checkpoint of every device's: the first, as it ran)
            self._rng_restored = True
        self.train_tokens = state.get("train_tokens", 0)
        self.diverged_at = state.get("diverged_at")
        self.divergence = Divergence(**state["divergence"]) if state.get("divergence") else None
        self.ledger.initial = state.get("initial_loss")
        # (a checkpoint written before the key existed decayed by time from time zero: it goes on doing so)
        self.schedule.warmup_end_s = state.get("warmup_end_s", 0.0)
        self.fit_seconds_before = state.get("fit_seconds", 0.0)  # (0 for a checkpoint written before the key)
        self.measured_before = tuple(state.get("throughput_measured", (0, 0.0)))

    def on_train_end(self) -> None:
        self.settle()  # the steps after the last logging step (a run stopped between them)

    # --- measurements ---------------------------------------------------------------
    def on_fit_start(self) -> None:
        self._fit_started = time.time()

    def fit_seconds(self) -> float:
        """Seconds of training (Lightning's fit) this run has cost up to now, over every attempt of a resumed run:
        the earlier attempts' up to the checkpoint it resumed from, and this attempt's. (Work an attempt did after
        its last checkpoint was done again, so it is not counted twice.)"""
        return self.fit_seconds_before + (time.time() - self._fit_started)

    def _measured(self, skip: int = 5) -> tuple[int, float]:
        """(tokens, seconds) of the timed steps, skipping warm-up steps (all of them where there are no more), with
        those of the attempts this one resumed (up to its checkpoint; the steps after it are trained again)."""
        counted = min(len(self.step_tokens), len(self.step_times))  # the steps before a divergence, and timed
        times, tokens = self.step_times[skip:counted], self.step_tokens[skip:counted]
        if not times:
            times, tokens = self.step_times[:counted], self.step_tokens[:counted]
        return self.measured_before[0] + int(sum(tokens)), self.measured_before[1] + float(sum(times))

    def throughput(self, skip: int = 5) -> float | None:
        """Training tokens per second over the timed steps of every attempt, skipping each attempt's warm-up steps:
        a run resumed after its last checkpoint (killed while it evaluated) trains no step now and keeps its rate."""
        tokens, seconds = self._measured(skip)
        return tokens / seconds if seconds > 0 else None


def spread_order(batches: list) -> list:
    """Validation batches of a length-sorted split in one fixed random order (the same for every run and seed):
    `train.eval_batches` then evaluates a sample of the whole split, where the first batches in length order would
    hold only its shortest sentences."""
    return [batches[i] for i in torch.randperm(len(batches), generator=torch.Generator().manual_seed(0)).tolist()]


def rank_stream_seed(seed: int, rank: int, step: int) -> int:
    """The seed of DDP rank `rank`'s random stream (dropout), started at optimizer step `step`: well mixed and
    distinct for each (seed, rank, step), the same in every process and Python session."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0] >> 1)


def seeded_generator(seed: int, index: int) -> torch.Generator:
    """A generator that depends only on (seed, index)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class ExponentialMovingAverage(WeightAveraging):
    """Lightning's weight averaging with an exponential moving average whose decay warms up as
    min(decay, (1 + n) / (10 + n)) after n updates (as timm's ModelEmaV2 and TensorFlow's ExponentialMovingAverage
    with num_updates): early on the average follows the weights, so no start step needs choosing, and later it
    averages over about 1 / (1 - decay) steps. Validation and the final model (metrics, model.pt) use the average;
    checkpoints hold both, so a resumed run continues the same average."""

    def __init__(self, decay: float):
        self.decay = decay
        self._average_in_model = False
        super().__init__(use_buffers=False)  # buffers are constants (no batch norm here)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._average_in_model = True

    def on_fit_end(self, trainer, pl_module) -> None:
        # A run resumed from its checkpoint at max_steps (killed while its final metrics were computed) skips the
        # training loop, and with it on_train_end: Lightning left the raw weights in the model, and the final
        # metrics and model.pt would be of those.
        if not self._average_in_model and self._average_model is not None:
            self._copy_average_to_current(pl_module)
            self._average_in_model = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # Lightning's own update goes through torch's AveragedModel.update_parameters, which reads its update count
        # on the host twice per step (a GPU sync each); this one keeps the count on the device. Same schedule of
        # updates as WeightAveraging's (once per optimizer step).
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=trainer.global_step - 1):
            self._update(pl_module)
            self._latest_update_step = trainer.global_step

    @torch.no_grad()
    def _update(self, pl_module) -> None:
        """average <- lerp(average, weights, 1 - min(decay, (1 + n) / (10 + n))) after n updates; the first copies."""
        model = self._average_model
        averaged = [p.detach() for p in model.module.parameters()]
        current = [p.detach().to(a.device) for p, a in zip(pl_module.parameters(), averaged)]
        n = model.n_averaged.to(device=averaged[0].device, dtype=averaged[0].dtype)
        weight = torch.where(n == 0, torch.ones_like(n), 1.0 - ((1.0 + n) / (10.0 + n)).clamp(max=self.decay))
        # one weight tensor per parameter (expanded views): the overload with a single 0-d weight reads it on the host
        torch._foreach_lerp_(averaged, current, [weight.expand_as(a) for a in averaged])
        model.n_averaged += 1


def length_grouped_batches(lengths: Sequence[int], batch_size: int, generator: torch.Generator,
                           megabatch: int = 50) -> list[list[int]]:
    """One epoch of batches of similar-length examples, in random order.

    Shuffle, cut into megabatches of `megabatch` batches, sort each megabatch by length, split it into batches, and
    shuffle the batches: padding to the longest example of a batch then costs little, while which examples share a
    batch still changes from epoch to epoch (Hugging Face Trainer's `group_by_length` uses megabatches of 50 too).
    Every example appears exactly once; only the last batch may be short."""
    perm = torch.randperm(len(lengths), generator=generator).tolist()
    span = batch_size * megabatch
    batches: list[list[int]] = []
    for k in range(0, len(perm), span):
        chunk = sorted(perm[k : k + span], key=lambda j: lengths[j])  # stable: ties keep their random order
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[b] for b in torch.randperm(len(batches), generator=generator).tolist()]


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class StepIndexedBatches(torch.utils.data.IterableDataset):
    """An endless stream of training batches where batch i depends only on (seed, i).

    Resuming at optimizer step s restarts the stream at local batch s * accumulate, so a
    resumed run sees exactly the batches an uninterrupted one would (the data position is the
    step counter). Under DDP, rank r of w takes global batches r, r + w, r + 2w, ... so ranks
    never train on the same batch; DataLoader workers split a rank's stream the same way.
    `make_batch(i)` builds global batch i, drawing any randomness from
    `seeded_generator(seed, i)` or a permutation seeded by the epoch.
    """

    def __init__(self, make_batch):
        super().__init__()
        self.make_batch = make_batch
        self.start = 0
        self.rank_and_world: tuple[int, int] | None = None  # set in the training process: a loader worker has no group

    def __iter__(self):
        rank, world = self.rank_and_world or _rank_and_world()
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        local = self.start + worker
        while True:
            yield self.make_batch(local * world + rank)
            local += n_workers


class StudyDataModule(L.LightningDataModule):
    """Base DataModule: loads and tokenizes in `prepare()` (called before the model is
    built, so bad data fails before training) and tracks the training-stream position."""

    def __init__(self, cfg: ExperimentConfig):
        super().__init__()
        self.cfg = cfg
        self.train_stream: StepIndexedBatches | None = None

    def check(self) -> None:
        """What would stop `prepare` that can be found cheaply, for a suite to call on every part before its first
        part trains (a part that cannot run is then refused before the parts before it spend their training).
        Default: nothing; `prepare` finds every problem when the run starts."""

    # The data position is the optimizer step; Lightning stores this in every checkpoint.
    def state_dict(self) -> dict[str, Any]:
        step = self.trainer.global_step if self.trainer is not None else 0
        return {"train_batches": step * self.cfg.train.accumulate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_batches = int(state.get("train_batches", 0))

    def _loader(self, dataset, **kwargs) -> torch.utils.data.DataLoader:
        # A private generator: creating iterators must not draw from the global RNG,
        # or a resumed run's dropout masks would differ from an uninterrupted run's.
        # Pinned host memory lets a CUDA copy run asynchronously (Lightning moves batches with non_blocking=True).
        on_cuda = trains_on_cuda(self.cfg.train.accelerator)
        workers = self.cfg.train.num_workers
        # Workers forked, as on Linux before Python 3.14: forkserver and spawn pickle the dataset, whose batches are
        # the DataModule's bound methods (and through it the trainer), which cannot be pickled. They build CPU
        # batches only, so a CUDA context in the parent does not matter to them.
        fork = "fork" if workers and "fork" in torch.multiprocessing.get_all_start_methods() else None
        return torch.utils.data.DataLoader(
            dataset, generator=torch.Generator().manual_seed(self.cfg.train.seed), num_workers=workers,
            pin_memory=on_cuda, multiprocessing_context=fork, **kwargs,
        )

    def train_dataloader(self):
        assert self.train_stream is not None, "prepare() must build self.train_stream"
        self.train_stream.start = getattr(self, "_resume_batches", 0)
        self.train_stream.rank_and_world = _rank_and_world()
        return self._loader(self.train_stream, batch_size=None)
