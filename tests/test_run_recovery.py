"""A run directory survives damage done from outside: an unreadable last.ckpt (garbage, truncated) is moved aside
with a warning, never deleted, and the run trains from scratch to the same result as a fresh run; files written
atomically get the mode the umask gives, so a results folder shared by a team can be read by it."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from study.io import atomic_write_text
from tests.test_lm_task import corpus, kill_during_step_9, main_run, run  # noqa: F401  (fixtures)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_checkpoint_is_moved_aside_and_the_run_starts_again(main_run, corpus, monkeypatch, caplog,
                                                                          damage):
    cfg, name = main_run["cfg"], f"damaged-{damage}"
    d = corpus["root"] / name
    kill_during_step_9(corpus, cfg, name, monkeypatch)
    ckpt = d / "checkpoints" / "last.ckpt"
    good = ckpt.read_bytes()
    ckpt.write_bytes(b"\x00garbage" * 100 if damage == "garbage" else good[: len(good) // 2])
    damaged = ckpt.read_bytes()
    with caplog.at_level(logging.WARNING, logger="study.run.single"):
        m = run(corpus, cfg, name)
    assert "cannot be read" in caplog.text and "from scratch" in caplog.text
    aside = list((d / "checkpoints").glob("last.ckpt.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == damaged  # kept, as it was
    assert m["status"] == "completed" and m["steps"] == 12
    assert m["metrics"] == main_run["metrics"]["metrics"]  # from scratch: the same run as an uninterrupted one
    a = torch.load(main_run["dir"] / "model.pt", weights_only=True)
    b = torch.load(d / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_atomic_writes_respect_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "metrics.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "metrics.json").stat().st_mode) == 0o666 & ~umask


def test_a_sweeps_storage_record_respects_the_umask_too(tmp_path):
    from study.sweep.layout import SweepLayout, record_storage

    layout = SweepLayout(tmp_path / "sweep")
    old = os.umask(0o022)
    try:
        record_storage(layout, f"sqlite:///{tmp_path / 'q.db'}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(layout.storage_path.stat().st_mode) == 0o644
    assert [p.name for p in layout.sweep_dir.iterdir()] == ["storage.json"]  # no temporary file left


def test_a_checkpoint_the_disk_fails_to_read_is_kept_where_it_is_and_the_attempt_fails(main_run, corpus, monkeypatch):
    """An I/O error (a network filesystem's hiccup) or a MemoryError says nothing about the file: moved aside, a good
    checkpoint would cost the whole run; the attempt fails instead and the next one resumes it."""
    import errno
    import shutil

    from study.record import RunDir
    from study.run import single

    d = corpus["root"] / "flaky-disk"
    kill_during_step_9(corpus, main_run["cfg"], "flaky-disk", monkeypatch)
    for error in (OSError(errno.EIO, "Input/output error"), MemoryError()):
        with monkeypatch.context() as mp:
            mp.setattr(single.torch, "load", lambda *a, **k: (_ for _ in ()).throw(error))
            with pytest.raises(type(error)):
                single.readable_checkpoint(RunDir(d))
        assert [p.name for p in (d / "checkpoints").iterdir()] == ["last.ckpt"]
    assert single.readable_checkpoint(RunDir(d)) == d / "checkpoints" / "last.ckpt"
    shutil.rmtree(d)


def test_a_log_row_an_append_cut_short_is_not_kept_on_resume(tmp_path, main_run):
    """A kill or a full disk in the middle of an append leaves a fragment (step 1049 cut to `10`): resumed, it would
    be a row of step 10 with the values cut off."""
    from study.run.curves import rows_before

    log = tmp_path / "metrics.csv"
    log.write_text("epoch,step,train/loss\n0,2,2.5\n0,5,2.4\n0,10")
    assert rows_before(log, main_run["dir"] / "checkpoints" / "last.ckpt") == [
        {"epoch": "0", "step": "2", "train/loss": "2.5"}, {"epoch": "0", "step": "5", "train/loss": "2.4"}]


def test_temporary_files_a_kill_left_in_any_folder_of_a_run_are_removed(tmp_path):
    """A kill during the replacement of the curves log (logs/), or a prediction or translation file, leaves its
    temporary file there as it does beside the record."""
    from study.record import RunDir

    run = RunDir(tmp_path / "run")
    old = [run.path / ".model.pt.a1.tmp", run.path / "logs" / ".metrics.csv.b2.tmp",
           run.path / "predictions" / ".SST-2.tsv.c3.tmp"]
    fresh = run.path / "logs" / ".metrics.csv.d4.tmp"
    for p in [*old, fresh]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
        os.utime(p, (1e9, 1e9) if p != fresh else None)
    assert sorted(run.remove_stale_temp_files()) == sorted(old) and fresh.exists()


def test_a_forced_rerun_removes_the_outputs_the_old_run_wrote_beside_its_record(tmp_path):
    """GLUE's test predictions and classifier, translation's hypotheses: left beside a forced rerun's config, an old
    prediction file the new run does not write (a test split gone from the data) would be submitted as its own."""
    from study.record import RunDir
    from study.run.single import discard_result
    from study.tasks.glue.module import GlueModule
    from study.tasks.translation import TranslationModule

    run = RunDir(tmp_path / "run")
    for name in ("metrics.json", "model.pt", "classifier.pt", "predictions/AX.tsv", "hypotheses/test.en",
                 "tokenizer.json", "config.yaml"):
        (run.path / name).parent.mkdir(parents=True, exist_ok=True)
        (run.path / name).write_text("old")
    discard_result(run, GlueModule.output_paths + TranslationModule.output_paths)
    assert sorted(p.name for p in run.path.iterdir()) == ["config.yaml", "tokenizer.json"]


def test_two_spellings_of_one_run_directory_take_one_lock(tmp_path):
    """`study run --out runs/x` with runs/x a symlink to a sweep's trial directory: both must hold the same lock, or
    two processes would train into one directory."""
    from study.run.pipeline import run_dir_lock

    real = tmp_path / "results" / "x"
    real.mkdir(parents=True)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "x").symlink_to(real)

    def taken() -> None:
        raise RuntimeError("held")

    with run_dir_lock(real):
        with pytest.raises(RuntimeError, match="held"):
            with run_dir_lock(tmp_path / "runs" / "x", on_wait=taken):
                pass


def test_an_error_after_the_inputs_were_checked_is_the_runs_failure_not_bad_input(main_run, corpus, monkeypatch):
    """`study run` answers bad input (a ValueError) in one line; a ValueError raised while training or scoring (a
    bug, numpy's shapes) is the run's failure and keeps its traceback: it is raised as a RuntimeError."""
    from study.tasks.lm import LMModule

    def broken(self, dm):
        raise ValueError("operands could not be broadcast together")

    monkeypatch.setattr(LMModule, "final_metrics", broken)
    with pytest.raises(RuntimeError, match="failed: ValueError: operands could not") as err:
        run(corpus, main_run["cfg"], "broken-scoring")
    assert isinstance(err.value.__cause__, ValueError)
