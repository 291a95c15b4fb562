"""One training run: one Lightning fit of one experiment config, written to one run directory (`study.record`).

Every file is written atomically. Running the same config into the same directory resumes from the last
checkpoint; a finished run is not repeated, and a directory holding another config's run is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch

from study.config import ExperimentConfig
from study.io import atomic_write, atomic_write_json, atomic_write_text, file_sha256, read_json_or_none
from study.model.accounting import cost_summary
from study.record import COMPLETED, DIVERGED, RunDir, make_record, started_from_digests
from study.run.conflict import finished_run, handed_back, refuse_other_data
from study.run.environment import peak_memory_bytes, prepare_training_process, reset_peak_memory
from study.tasks import family

log = logging.getLogger(__name__)


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


def _step_checkpoint(run: RunDir, every: int, validates_every: int):
    """ModelCheckpoint every `every` steps, saved after the validation where the step validates. Lightning resumes
    from a checkpoint saved before a step's validation by skipping that validation (it counts it as done), so a run
    killed while validating lost that point of its validation curve; saved after it, a kill during the validation
    resumes from the checkpoint before, and the validation runs again."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from study.tasks.base import mid_step

    class StepCheckpoint(ModelCheckpoint):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if mid_step(trainer):  # (the step before was saved already)
                return
            if step % every == 0 and step % validates_every == 0 and trainer.enable_validation:
                self._defer_save_until_validation = True  # Lightning's own deferral, saved by on_validation_end
                return
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    return StepCheckpoint(dirpath=run.checkpoints, filename="last", save_top_k=1, enable_version_counter=False,
                          every_n_train_steps=every, save_on_train_epoch_end=False)


def readable_checkpoint(run: RunDir) -> Path | None:
    """The run's last checkpoint when it can be read, else None. Checkpoints are written atomically, so an unreadable
    one was damaged from outside (a disk, a copy, a hand): it is moved aside with a warning (never deleted) and the
    run starts from scratch, instead of failing the same way on every attempt. A read that fails for the disk or the
    memory (OSError, MemoryError: a network filesystem's hiccup) raises: the checkpoint is good, a retry resumes it."""
    path = run.last_checkpoint
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or "state_dict" not in state or "global_step" not in state:
            raise ValueError("not a Lightning checkpoint (no state_dict or global_step)")
    except (OSError, MemoryError):  # the disk or the memory failed, not the file: the attempt fails, the file stays
        raise
    except Exception as err:  # torch raises many kinds for a damaged file: each means the same here
        if launch_rank() == 0:
            aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
            os.replace(path, aside)
            log.warning("%s cannot be read (%s); moved to %s, training starts from scratch", path,
                        str(err).splitlines()[0] if str(err) else type(err).__name__, aside.name)
        return None
    return path


def discard_result(run: RunDir, outputs: tuple[str, ...] = ()) -> None:
    """What a forced rerun replaces, removed before its config.yaml is written: the checkpoint (it may be of another
    config), and the old result (metrics.json, model.pt, and the task's `outputs`: its module's `output_paths`, such
    as GLUE's test predictions). Left in place, a forced rerun killed before its end would leave the old record
    beside the new config.yaml, and the next run of that config would hand it back, finished, as its own result; an
    old prediction file the new run does not write (a test split gone from the data) would be submitted as its own."""
    if launch_rank() == 0:
        for path in (run.metrics, run.weights, run.last_checkpoint, *(run.path / p for p in outputs)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def replaced_start(run: RunDir, init_from: str | Path | None) -> str | None:
    """Why the result in `run` is not one of the model now in `init_from` (the run it started from), or None.

    A run that starts from another records the digest of the model.pt it started from in its data.json
    (`study.record.started_from`; a suite's data.json holds each part's). When the model.pt there now is another (that run
    was forced anew, e.g. by another pipeline sharing the stage) or is gone, the result is of a model no longer on
    disk: handed back, it would be reported as the new model's, and its checkpoint would go on fine-tuning the old
    one. None where nothing was recorded (a run that starts from nothing, or has not yet read its data)."""
    recorded = started_from_digests(read_json_or_none(run.data)) if init_from else set()
    if not recorded:
        return None
    weights = RunDir(init_from).weights
    now = file_sha256(weights) if weights.is_file() else None
    if recorded == {now}:
        return None
    there = ", ".join(sorted(f"{d[:12]}..." for d in recorded - {now}))
    return (f"{run.path} was fine-tuned from another model than {weights} (sha256 {there}), "
            + (f"which now holds {now[:12]}..." if now else "which is gone"))


def launch_rank() -> int:
    """The global rank Lightning's DDP launcher gives this process (0 when not launched)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def default_cache_dir(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else Path(os.environ.get("STUDY_CACHE_DIR", ".cache/study"))


def data_module(cfg: ExperimentConfig, data_dir, cache_dir):
    """The task's DataModule for `cfg`, not yet prepared (tokenizers cached under the cache folder's tokenizers/)."""
    DataModule, _ = family(cfg.task.name).implementation()
    return DataModule(cfg, data_dir=data_dir, cache_dir=default_cache_dir(cache_dir) / "tokenizers")


def _prepare_data(cfg: ExperimentConfig, data_dir, cache_dir):
    """The task's DataModule, prepared (data and tokenizer errors surface here, before any model is built), and
    the config with the model fields the data decides (vocabulary size, padding id) filled in."""
    dm = data_module(cfg, data_dir, cache_dir)
    dm.prepare()
    return dm, cfg.replace(model=cfg.model.replace(**dm.model_overrides()))


def _write_inputs(run: RunDir, cfg: ExperimentConfig, dm, resumes: bool) -> None:
    """config.yaml (what runs), env.json (`resumes`: beside the environments of the attempts it continues), data.json
    and the task's artifacts (e.g. its tokenizer), on rank zero: under DDP every rank runs this function and one
    writes the files."""
    from study.run.environment import cpu_kernels, snapshot

    if launch_rank() != 0:
        return
    run.remove_stale_temp_files()
    atomic_write_text(run.config, cfg.to_yaml())
    kernels = cpu_kernels(cfg.model, cfg.train.accelerator, cfg.train.precision)
    run.write_env(snapshot(cfg.train.precision, cfg.train.accelerator) | {"cpu_kernels": kernels}, continues=resumes)
    atomic_write_json(run.data, dm.fingerprint)
    if hasattr(dm, "save_artifacts"):
        dm.save_artifacts(run.path)


def _loggers(run: RunDir, cfg: ExperimentConfig, resume_from: Path | None) -> list:
    """The CSV logger (flushed at every logged step, so a killed run's rows up to its checkpoint are on disk, and
    given back the rows before the checkpoint when resuming), and TensorBoard's when it is installed."""
    from study.run.curves import CurvesLogger, checkpoint_step, rows_before

    kept = rows_before(run.curves, resume_from) if resume_from else []
    csv_logger = CurvesLogger(run.path, name="logs", version="", flush_logs_every_n_steps=cfg.train.log_every,
                              kept=kept)
    csv_logger.experiment  # (rank zero) the file starts as the rows kept, replaced in one step
    loggers = [csv_logger]
    try:
        import tensorboard  # noqa: F401
        from lightning.pytorch.loggers import TensorBoardLogger

        # Each attempt adds an event file: SummaryWriter's purge_step hides the earlier attempts' events from the
        # step this one trains first (its checkpoint's; 0 from scratch), as the CSV drops those rows; without it
        # TensorBoard draws the steps trained again twice.
        first_step = checkpoint_step(resume_from) if resume_from else 0
        loggers.append(TensorBoardLogger(run.path, name="logs", version="tb", purge_step=first_step))
    except ImportError:
        pass
    return loggers


def _no_tips(record: logging.LogRecord) -> bool:
    """Lightning advertises its cloud products (litlogger, litmodels) at every Trainer it builds: a line in every
    run's output, and in every part of a suite."""
    return not str(record.msg).startswith("💡 Tip")


def _trainer(run: RunDir, cfg: ExperimentConfig, loggers: list):
    import lightning as L

    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_tips)

    from study.tasks.base import ExponentialMovingAverage, SyncedTimer

    t = cfg.train
    callbacks: list = [_step_checkpoint(run, t.checkpoint_every or t.eval_every, t.eval_every)]
    from study.run.progress import StepLines, StepProgressBar, run_name

    # a bar on a terminal; plain lines where the output is a log file (a sweep's trial.log)
    callbacks.append(StepProgressBar(run_name(cfg)) if t.progress_bar else StepLines(run_name(cfg)))
    if t.ema_decay is not None:
        callbacks.append(ExponentialMovingAverage(t.ema_decay))
    if t.max_time_s:  # Trainer(max_time=...)'s Timer, made the same on every rank
        callbacks.append(SyncedTimer(duration=datetime.timedelta(seconds=t.max_time_s), interval="step"))
    return L.Trainer(
        max_steps=t.max_steps,
        accelerator=t.accelerator, devices=t.devices, strategy=t.strategy, precision=t.precision,
        gradient_clip_val=t.grad_clip, accumulate_grad_batches=t.accumulate,
        val_check_interval=t.eval_every * t.accumulate, check_val_every_n_epoch=None,
        limit_val_batches=t.eval_batches if t.eval_batches is not None else 1.0,
        num_sanity_val_steps=0, logger=loggers, callbacks=callbacks, plugins=[_checkpoint_io()],
        # every rank evaluates the same eval_batches (the batches one process would), not a padded shard of them
        use_distributed_sampler=False,
        enable_progress_bar=t.progress_bar, enable_model_summary=False, log_every_n_steps=t.log_every,
        default_root_dir=run.path,
    )


def _fit(trainer, module, dm, resume_from: Path | None) -> None:
    """trainer.fit, with Ctrl-C raised as the KeyboardInterrupt it was. Lightning answers Ctrl-C by shutting down,
    ignoring SIGINT from then on and calling sys.exit(1): a caller could not tell an interrupt from an error, and a
    process that goes on (a library caller, a test) could no longer be interrupted."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from study.interrupts import Terminated

    handler = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=str(resume_from) if resume_from else None)
    except SIGTERMException:  # Lightning's own SIGTERM handler (where none of ours ran first) exits with no code: 0
        raise Terminated() from None
    except SystemExit as exit_:
        if not isinstance(exit_.__context__, KeyboardInterrupt):  # another exit (a SIGTERM handler's) stays one
            raise
        if handler is not None:
            with contextlib.suppress(ValueError):  # (only the main thread may set it; Lightning did there)
                signal.signal(signal.SIGINT, handler)
        raise KeyboardInterrupt from None


def _record(cfg: ExperimentConfig, trainer, module, final: dict[str, Any], timing: dict[str, float],
            declared: dict[str, dict] | None) -> dict:
    """The run's metrics.json record (study.record's schema)."""
    t, task = cfg.train, family(cfg.task.name)
    status = DIVERGED if module.diverged_at is not None else COMPLETED
    stopped_by_time = t.max_time_s and trainer.global_step < t.max_steps and status == COMPLETED
    bytes_per_element = 2 if "16" in t.precision else 4
    cost = {**cost_summary(cfg.model, cfg.task.seq_len, bytes_per_element, task.predicted_fraction(cfg)),
            "train_tokens_per_s": module.throughput(), "peak_memory_bytes": peak_memory_bytes(t.accelerator), **timing}
    return make_record(status, final, cost, steps=int(trainer.global_step), train_tokens=module.train_tokens,
                       diverged_at_step=module.diverged_at, stopped_by="time" if stopped_by_time else None,
                       declared=task.declared() if declared is None else declared,
                       **({"divergence": dataclasses.asdict(module.divergence)} if module.divergence else {}))


def run_single(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
    declared: dict[str, dict] | None = None,
) -> dict[str, Any]:
    """One training run of `cfg` (one Lightning fit), writing `run_dir`. Returns the metrics.json record.

    `declared`: the metric declarations the record carries (default: the task family's; a suite's part: its
    family's part metrics).
    Optional hooks: `DataModule.save_artifacts(run_dir)` (e.g. the tokenizer) and `Module.save_outputs(run_dir)`
    (e.g. test-set predictions) are called on rank zero, after the config and after the final metrics."""
    run = RunDir(run_dir)
    family_ = family(cfg.task.name)
    decided = family_.data_decided_model_fields
    done = finished_run(run, cfg, force, data_decided=decided)
    if (replaced := None if force else replaced_start(run, cfg.task.init_from)) is not None:
        log.warning("%s; it runs again, from scratch, from the model there now", replaced)
    elif done is not None:
        return handed_back(run, done)
    started = time.time()
    dm, cfg = _prepare_data(cfg, data_dir, cache_dir)
    finished_run(run, cfg, force, data_decided=())  # a directory holding another config's (unfinished) run
    module_cls = family_.implementation()[1]
    if force or replaced:
        discard_result(run, module_cls.output_paths)
    if (resume_from := readable_checkpoint(run)) is not None:
        refuse_other_data(run, dm.fingerprint)  # before data.json is rewritten with what was read now
    prepare_training_process(cfg.train.accelerator)  # before env.json records it
    _write_inputs(run, cfg, dm, resumes=resume_from is not None)
    try:
        return _train(run, cfg, dm, module_cls, resume_from, started, declared)
    except ValueError as err:  # the inputs were checked above: now a ValueError is the run's failure, not bad input
        raise RuntimeError(f"the run in {run.path} failed: {type(err).__name__}: {err}") from err


def _train(run: RunDir, cfg: ExperimentConfig, dm, module_cls: type, resume_from: Path | None, started: float,
           declared: dict[str, dict] | None) -> dict[str, Any]:
    """Fit, score and record the run whose inputs were written (run_single)."""
    import lightning as L

    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    module = module_cls(cfg)
    reset_peak_memory(cfg.train.accelerator)  # this run's peak, not an earlier part's or stage's in this process
    trainer = _trainer(run, cfg, _loggers(run, cfg, resume_from))
    _fit(trainer, module, dm, resume_from)
    fit_seconds = module.fit_seconds()  # a resumed run's earlier attempts included (up to its checkpoint)

    final: dict[str, Any] = {}
    eval_started = time.time()
    if module.diverged_at is None and trainer.is_global_zero:
        module.to(trainer.strategy.root_device)  # fit's teardown moved it to the CPU
        final = module.final_metrics(dm)
        if hasattr(module, "save_outputs"):
            module.save_outputs(run.path)
    if trainer.is_global_zero:
        atomic_write(run.weights, lambda p: torch.save(module.model.state_dict(), p))
    timing = {"fit_seconds": fit_seconds, "final_eval_seconds": time.time() - eval_started,
              "wall_seconds": time.time() - started + module.fit_seconds_before}
    record = _record(cfg, trainer, module, final, timing, declared)
    if trainer.is_global_zero:
        run.write(record)
    # under DDP the other ranks return once rank zero has written the run (a pipeline's next stage reads its
    # model.pt), and return what it wrote: final metrics are computed on rank zero only
    trainer.strategy.barrier("run-written")
    return record if trainer.is_global_zero else (run.read() or record)
