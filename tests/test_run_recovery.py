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
