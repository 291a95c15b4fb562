"""Review of the shared training loop and the run layer: what a run records of itself is true after a kill, a stop
and a resume.

`kill PID` during `study run` exited 0 with no record; a later run in one process (a pipeline stage, a suite part)
recorded an earlier run's peak memory on the CPU; a divergence found by a checkpoint's read wrote the step before's
loss under the diverged step; gradient-norm rows logged before a checkpoint could be lost by a kill after it; a run
resumed after its last checkpoint recorded no throughput; with accumulation every validation wrote a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from study.interrupts import Terminated
from study.run.environment import CPU_MALLOC, peak_memory_bytes, reset_peak_memory, reuse_freed_memory
from study.tasks.lm import LanguageModelling, LMDataModule, LMModule
from tests.test_lm_task import Killed, corpus, make_cfg, read_csv, run  # noqa: F401  (fixture)


def test_lightnings_sigterm_exit_is_a_terminated_run_not_a_success():
    """Lightning's SIGTERM handler ends fit with a SystemExit of no code, which exits 0: a scheduler or a shell's
    `&&` took the killed run for a finished one."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from study.run.single import _fit

    class Trainer:
        def fit(self, *args, **kwargs):
            raise SIGTERMException()

    with pytest.raises(Terminated) as exit_:
        _fit(Trainer(), None, None, None)
    assert exit_.value.code == 143


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_a_runs_peak_memory_on_the_cpu_leaves_out_what_an_earlier_run_freed():
    reuse_freed_memory("cpu")  # as every CPU training process runs: freed memory stays in the heap
    assert CPU_MALLOC
    reset_peak_memory("cpu")
    before = peak_memory_bytes("cpu")
    big = torch.ones(300 * 2**20 // 4)  # an earlier run's 300 MiB, freed
    del big
    reset_peak_memory("cpu")  # this run starts
    small = torch.ones(4 * 2**20 // 4)
    peak = peak_memory_bytes("cpu")
    del small
    assert peak < before + 100 * 2**20  # the 300 MiB freed before this run began are not its peak


class NaNAtStep5(LMModule):
    def training_loss(self, batch):
        loss, n = super().training_loss(batch)
        return (loss * float("nan"), n) if self.global_step == 5 else (loss, n)


def test_a_divergence_found_by_a_checkpoints_read_logs_its_own_step(corpus, monkeypatch):
    """Checkpoint at step 6 (a non-logging step), NaN at step 5: the checkpoint's read finds it, and the curve's row
    at the diverged step is that step's (non-finite), not step 3's values written again."""
    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, NaNAtStep5))
    m = run(corpus, make_cfg(train={"log_every": 4, "checkpoint_every": 6, "eval_every": 50, "grad_norm_every": 0}),
            "div-at-checkpoint")
    assert m["status"] == "diverged" and m["diverged_at_step"] == 5
    train = [r for r in read_csv(corpus["root"] / "div-at-checkpoint" / "logs" / "metrics.csv") if r.get("train/loss")]
    step3 = next(r for r in train if r["step"] == "3")
    assert all(r["train/loss"] != step3["train/loss"] for r in train if r["step"] != "3")
    assert not math.isfinite(float(train[-1]["train/loss"]))


def test_gradient_norms_logged_before_a_checkpoint_are_on_disk_when_it_is_written(corpus, monkeypatch):
    """They go to the loggers directly, which buffer them: a SIGKILL after the checkpoint lost them for good (the
    resumed run starts past their step). Read from disk at the moment the step-6 checkpoint has been taken."""
    on_disk = {}
    original = LMModule.on_save_checkpoint

    def read_at_checkpoint(self, checkpoint):
        original(self, checkpoint)
        path = corpus["root"] / "grad-norms" / "logs" / "metrics.csv"
        on_disk[int(self.global_step)] = [r["step"] for r in read_csv(path) if r.get("grad_norm/other")]

    monkeypatch.setattr(LMModule, "on_save_checkpoint", read_at_checkpoint)
    run(corpus, make_cfg(train={"max_steps": 12, "log_every": 4, "grad_norm_every": 5, "checkpoint_every": 6,
                                "eval_every": 12}), "grad-norms")
    assert "5" in on_disk[6]


class KilledInFinalEvaluation(LMModule):
    def on_train_end(self):
        super().on_train_end()
        raise Killed()


def test_a_run_resumed_after_its_last_checkpoint_keeps_its_throughput(corpus, monkeypatch):
    """Killed while it evaluated its final model (after the checkpoint at max_steps), the rerun trains no step: its
    tokens/s is the earlier attempt's, not null."""
    cfg = make_cfg(train={"max_steps": 12, "checkpoint_every": 6, "eval_every": 6})
    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, KilledInFinalEvaluation))
    with pytest.raises(Killed):
        run(corpus, cfg, "throughput-resumed")
    ckpt = corpus["root"] / "throughput-resumed" / "checkpoints" / "last.ckpt"
    tokens, seconds = torch.load(ckpt, weights_only=True)["study"]["throughput_measured"]
    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, LMModule))
    m = run(corpus, cfg, "throughput-resumed")
    assert m["steps"] == 12 and tokens > 0
    assert m["cost"]["train_tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-6)  # what the checkpoint timed


def test_with_accumulation_checkpoints_are_written_every_checkpoint_every_steps(corpus, monkeypatch):
    saved = []
    original = LMModule.on_save_checkpoint

    def record(self, checkpoint):
        saved.append(int(self.global_step))
        original(self, checkpoint)

    monkeypatch.setattr(LMModule, "on_save_checkpoint", record)
    run(corpus, make_cfg(train={"max_steps": 12, "accumulate": 2, "eval_every": 3, "checkpoint_every": 6}),
        "accumulate-checkpoints")
    assert saved == [6, 12]


def test_a_cpu_run_never_asks_for_the_cuda_generator_where_torch_sees_a_gpu(corpus, monkeypatch):
    """On a GPU machine a CPU run (a sweep trial told `accelerator: cpu`, say) saved the CUDA stream in every
    checkpoint, a stream it never drew from, initialising CUDA to read it. tests/test_gpu.py checks on a GPU that
    such a run takes no GPU memory."""
    asked = []

    def get_rng_state(*args, **kwargs):
        asked.append(args)
        return torch.zeros(16, dtype=torch.uint8)

    def get_rng_state_all():  # called by study's code: Lightning's own call around its sanity check is not ours
        import traceback

        caller = traceback.extract_stack()[-2].filename
        if "/study/" in caller and "site-packages" not in caller:
            asked.append("all")
        return []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    for module in (torch.cuda, torch.cuda.random):  # every spelling a caller could reach the CUDA stream by
        monkeypatch.setattr(module, "get_rng_state", get_rng_state)
        monkeypatch.setattr(module, "get_rng_state_all", get_rng_state_all)
    m = run(corpus, make_cfg(train={"accelerator": "cpu", "max_steps": 12, "checkpoint_every": 6, "eval_every": 6}),
            "cpu-run-on-a-gpu-machine")
    assert m["status"] == "completed" and asked == []


@pytest.mark.parametrize("native", [False, True])
def test_a_bf16_run_on_a_cpu_that_emulates_bf16_says_so_before_it_trains(corpus, monkeypatch, native):
    import warnings

    import study.model.precision as precision

    monkeypatch.setattr(precision, "native_bf16", lambda accelerator="auto": native)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run(corpus, make_cfg(train={"precision": "bf16-mixed", "max_steps": 2, "eval_every": 2}), f"bf16-{native}")
    said = [str(w.message) for w in seen if "emulates bf16" in str(w.message)]
    assert len(said) == (0 if native else 1), said
    assert native or "train.precision bf16-mixed" in said[0] and "32-true" in said[0]


def test_a_run_prints_no_lightning_advertisement(corpus):
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(str(record.msg))
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        run(corpus, make_cfg(train={"max_steps": 2, "eval_every": 2}), "no-tips")
    finally:
        logger.removeHandler(handler)
    assert seen and not any("Tip" in m for m in seen), seen  # (its other lines still reach the handler)
