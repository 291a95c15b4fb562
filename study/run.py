"""Run one experiment and write its run directory.

    <run_dir>/config.yaml      the resolved experiment (model with its vocabulary size)
    <run_dir>/env.json         code version, packages, device, precision, attention kernels
    <run_dir>/data.json        fingerprint of the data actually read
    <run_dir>/metrics.json     status, final metrics and cost (written last, atomically)
    <run_dir>/model.pt         final weights (a plain state dict: torch.load(weights_only=True))
    <run_dir>/checkpoints/     last.ckpt for resuming (model, optimizer, scheduler, RNG, data position)
    <run_dir>/logs/            CSV (and TensorBoard when installed) training curves

Every file is written atomically. Running the same config into the same directory
resumes from the last checkpoint; a finished run is not repeated.
"""

from __future__ import annotations

import csv
import datetime
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from study.config import ExperimentConfig
from study.io import atomic_write, atomic_write_json, atomic_write_text, read_json
from study.model.accounting import cost_summary
from study.model.precision import resolve_precision
from study.tasks import registry  # cheap: it imports a task family on first use

log = logging.getLogger(__name__)
FINISHED = ("completed", "diverged")
DATA_DECIDED_MODEL_FIELDS = ("vocab_size", "pad_token_id")  # what DataModule.model_overrides() sets


class RunDirConflict(RuntimeError):
    @classmethod
    def between(cls, run_dir: str | Path, stored: ExperimentConfig, cfg: ExperimentConfig) -> RunDirConflict:
        """The error for a run directory holding `stored` when `cfg` was asked for, naming the fields that differ
        (e.g. `train.precision` when a run started with `auto` meets a machine where it resolves otherwise)."""
        diff = "; ".join(f"{k}: {there!r} there, {here!r} here" for k, (there, here) in stored.differences(cfg).items())
        return cls(f"{run_dir} holds a run of a different config ({diff}); choose another directory or --force")


def _checkpoint_io():
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class AtomicCheckpointIO(TorchCheckpointIO):
        """Writes checkpoints to a temporary file and renames it, so a kill never leaves a
        truncated last.ckpt; loads with weights_only=True (no pickled code runs)."""

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            atomic_write(path, lambda tmp: torch.save(checkpoint, tmp))

        def load_checkpoint(self, path, map_location=None, weights_only=None):
            return torch.load(path, map_location=map_location or "cpu", weights_only=True)

    return AtomicCheckpointIO()


def _logged_rows_before(csv_path: Path, ckpt_path: Path) -> list[dict[str, str]]:
    """The rows of an interrupted attempt's CSV log for the steps before its last checkpoint.

    Lightning's CSV logger deletes an existing metrics.csv when it starts, so without these rows a
    resumed run's curves would begin at the checkpoint. Rows of steps after the checkpoint are
    dropped: the resumed run trains those steps again and logs them itself."""
    if not csv_path.is_file():
        return []
    step = int(torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: v for k, v in row.items() if k and v not in ("", None)}
            for row in rows if row.get("step", "").isdigit() and int(row["step"]) < step]


def _as_stored(cfg: ExperimentConfig, stored: ExperimentConfig) -> ExperimentConfig:
    """`cfg` as a run directory would record it, known before the data is loaded: the model fields the data
    decides (vocabulary size, padding id) are taken from the stored config."""
    decided = {k: getattr(stored.model, k) for k in DATA_DECIDED_MODEL_FIELDS}
    return cfg.replace(model=cfg.model.replace(**decided))


def _launch_rank() -> int:
    """The global rank Lightning's DDP launcher gives this process (0 when not launched)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def run_experiment(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Train and evaluate `cfg`, writing `run_dir`. Returns the metrics dict.

    A task family with a suite runner (GLUE: several tasks and seeds) hands the experiment to it; the runner
    calls `run_single` once per sub-run and writes the combined run directory.

    `train.precision: auto` is resolved here, once, for this machine; the run directory's config records what ran."""
    cfg = cfg.replace(train=cfg.train.replace(precision=resolve_precision(cfg.train.precision, cfg.train.accelerator)))
    runner = registry.suite_runner(cfg.task.name)
    if runner is not None:
        return runner(cfg, run_dir, data_dir=data_dir, cache_dir=cache_dir, force=force)
    return run_single(cfg, run_dir, data_dir=data_dir, cache_dir=cache_dir, force=force)


def run_single(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """One training run of `cfg` (one Lightning fit), writing `run_dir`. Returns the metrics dict.

    Optional hooks: `DataModule.save_artifacts(run_dir)` (e.g. the tokenizer) and `Module.save_outputs(run_dir)`
    (e.g. test-set predictions) are called on rank zero, after the config and after the final metrics."""
    import lightning as L
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter as _CSVWriter
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from study.environment import snapshot
    from study.tasks.base import ExponentialMovingAverage

    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.json"
    config_path = run_dir / "config.yaml"
    if metrics_path.exists() and not force:
        metrics = read_json(metrics_path)
        if metrics.get("status") in FINISHED:
            # never hand back another config's results as this one's
            if config_path.exists():
                stored = ExperimentConfig.from_yaml(config_path.read_text())
                if stored != (asked := _as_stored(cfg, stored)):
                    raise RunDirConflict.between(run_dir, stored, asked)
            log.info("%s already finished (%s); nothing to do", run_dir, metrics["status"])
            return metrics

    started = time.time()
    DataModule, Module = registry.task_family(cfg.task.name)
    cache_dir = Path(cache_dir) if cache_dir is not None else Path(os.environ.get("STUDY_CACHE_DIR", ".cache/study"))
    dm = DataModule(cfg, data_dir=data_dir, cache_dir=cache_dir / "tokenizers")
    dm.prepare()  # data and tokenizer errors surface here, before any model is built
    cfg = cfg.replace(model=cfg.model.replace(**dm.model_overrides()))

    if config_path.exists() and not force:
        previous = ExperimentConfig.from_yaml(config_path.read_text())
        if previous != cfg:
            raise RunDirConflict.between(run_dir, previous, cfg)
    if _launch_rank() == 0:  # under DDP every rank runs this function; one writes the files
        atomic_write_text(config_path, cfg.to_yaml())
        atomic_write_json(run_dir / "env.json", snapshot(cfg.train.precision))
        atomic_write_json(run_dir / "data.json", dm.fingerprint)
        if hasattr(dm, "save_artifacts"):
            dm.save_artifacts(run_dir)

    t = cfg.train
    L.seed_everything(t.seed, workers=True, verbose=False)
    module = Module(cfg)
    ckpt_dir = run_dir / "checkpoints"
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, filename="last", save_top_k=1, enable_version_counter=False,
        every_n_train_steps=t.checkpoint_every or t.eval_every, save_on_train_epoch_end=False,
    )
    last = ckpt_dir / "last.ckpt"
    if force:  # a rerun starts from scratch: the checkpoint there may be of another config
        last.unlink(missing_ok=True)
    resume_from = last if last.exists() else None
    # flushed at every logged step, so a killed run's rows up to its checkpoint are on disk
    csv_logger = CSVLogger(run_dir, name="logs", version="", flush_logs_every_n_steps=t.log_every)
    earlier_rows = _logged_rows_before(Path(csv_logger.log_dir) / "metrics.csv", resume_from) if resume_from else []
    writer = csv_logger.experiment  # (rank zero) replaces any old metrics.csv: write back the rows kept
    if earlier_rows and isinstance(writer, _CSVWriter):
        writer.metrics[:0] = earlier_rows
        writer.save()
    loggers = [csv_logger]
    try:
        from lightning.pytorch.loggers import TensorBoardLogger
        import tensorboard  # noqa: F401

        loggers.append(TensorBoardLogger(run_dir, name="logs", version="tb"))
    except ImportError:
        pass
    callbacks: list = [checkpoint]
    if t.ema_decay is not None:
        callbacks.append(ExponentialMovingAverage(t.ema_decay))
    trainer = L.Trainer(
        max_steps=t.max_steps,
        max_time=datetime.timedelta(seconds=t.max_time_s) if t.max_time_s else None,
        accelerator=t.accelerator, devices=t.devices, strategy=t.strategy, precision=t.precision,
        gradient_clip_val=t.grad_clip, accumulate_grad_batches=t.accumulate,
        val_check_interval=t.eval_every * t.accumulate, check_val_every_n_epoch=None,
        limit_val_batches=t.eval_batches if t.eval_batches is not None else 1.0,
        num_sanity_val_steps=0, logger=loggers, callbacks=callbacks, plugins=[_checkpoint_io()],
        enable_progress_bar=t.progress_bar, enable_model_summary=False, log_every_n_steps=t.log_every,
        default_root_dir=run_dir,
    )
    fit_started = time.time()
    trainer.fit(module, datamodule=dm, ckpt_path=str(resume_from) if resume_from else None)
    fit_seconds = time.time() - fit_started

    status = "diverged" if module.diverged_at is not None else "completed"
    final: dict[str, Any] = {}
    if status == "completed" and trainer.is_global_zero:
        module.to(trainer.strategy.root_device)  # fit's teardown moved it to the CPU
        final = module.final_metrics(dm)
        if hasattr(module, "save_outputs"):
            module.save_outputs(run_dir)
    if trainer.is_global_zero:
        atomic_write(run_dir / "model.pt", lambda p: torch.save(module.model.state_dict(), p))
    seq_len = cfg.task.seq_len
    bytes_per_element = 2 if "16" in t.precision else 4
    metrics = {
        "status": status,
        "diverged_at_step": module.diverged_at,
        "steps": int(trainer.global_step),
        "stopped_by": "time" if t.max_time_s and trainer.global_step < t.max_steps and status == "completed" else None,
        "train_tokens": module.train_tokens,
        "metrics": final,
        "cost": {
            **cost_summary(cfg.model, seq_len, bytes_per_element, registry.predicted_fraction(cfg)),
            "train_tokens_per_s": module.throughput(),
            "peak_memory_bytes": peak_memory_bytes(),
            "fit_seconds": fit_seconds,
            "wall_seconds": time.time() - started,
        },
    }
    if trainer.is_global_zero:
        atomic_write_json(metrics_path, metrics)
    return metrics


def load_model(run_dir: str | Path):
    """The trained model of a run directory, loaded without executing pickled code."""
    from study.model import build_model

    run_dir = Path(run_dir)
    cfg = ExperimentConfig.from_yaml(run_dir.joinpath("config.yaml").read_text())
    model = build_model(cfg.model)
    model.load_state_dict(torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True))
    return model.eval(), cfg
