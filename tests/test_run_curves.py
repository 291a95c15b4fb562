"""A run's training curves (logs/metrics.csv) survive a kill at any moment: the file is appended to or replaced in
one step, never deleted first or rewritten in place, as Lightning's CSV logger does (shown beside each case)."""

from __future__ import annotations

import csv

import pytest
from lightning.pytorch.loggers import CSVLogger

from study.run.curves import CurvesLogger


class Killed(BaseException):
    """Stands in for SIGKILL: nothing on the way up handles it."""


def rows(path):
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if v} for r in csv.DictReader(f)]


def logger(cls, tmp_path, **kwargs):
    return cls(tmp_path, name="logs", version="", **kwargs)


def killed_while_writing_rows(monkeypatch):
    def write_rows(self, rows):
        raise Killed()

    monkeypatch.setattr(csv.DictWriter, "writerows", write_rows)


@pytest.mark.parametrize("cls, kept", [(CurvesLogger, True), (CSVLogger, False)], ids=["ours", "lightning"])
def test_a_kill_while_a_new_column_is_added_keeps_the_rows_logged_before(tmp_path, monkeypatch, cls, kept):
    log = logger(cls, tmp_path)
    log.log_metrics({"train/loss": 2.5}, step=0)
    log.log_metrics({"train/loss": 2.0}, step=1)
    log.save()
    path = tmp_path / "logs" / "metrics.csv"
    log.log_metrics({"val/loss": 2.2}, step=1)  # the first validation: a new column, the file is rewritten
    with monkeypatch.context() as mp:
        killed_while_writing_rows(mp)
        with pytest.raises(Killed):
            log.save()
    before = [{"train/loss": "2.5", "step": "0"}, {"train/loss": "2.0", "step": "1"}]
    assert (rows(path) == before) is kept


def test_columns_that_stay_the_same_are_appended_and_a_new_one_gets_its_header(tmp_path):
    log = logger(CurvesLogger, tmp_path)
    log.log_metrics({"train/loss": 2.5}, step=0)
    log.save()
    log.log_metrics({"train/loss": 2.0}, step=1)
    log.log_metrics({"val/loss": 2.2}, step=1)
    log.save()
    log.log_metrics({"train/loss": 1.5}, step=2)
    log.save()
    path = tmp_path / "logs" / "metrics.csv"
    assert path.read_text().splitlines()[0] == "step,train/loss,val/loss"
    assert rows(path) == [{"step": "0", "train/loss": "2.5"}, {"step": "1", "train/loss": "2.0"},
                          {"step": "1", "val/loss": "2.2"}, {"step": "2", "train/loss": "1.5"}]


@pytest.mark.parametrize("cls", [CurvesLogger, CSVLogger], ids=["ours", "lightning"])
def test_a_resumed_run_killed_before_its_first_save_still_has_the_rows_before_its_checkpoint(tmp_path, cls):
    """Resuming, the file is at once the rows logged before the checkpoint (the rows after it are trained again);
    Lightning deletes the file when it starts, and writes nothing until its first save."""
    path = tmp_path / "logs" / "metrics.csv"
    path.parent.mkdir()
    path.write_text("step,train/loss\n0,2.5\n3,2.0\n6,1.8\n")  # an attempt killed after its step-4 checkpoint
    kept = [{"step": "0", "train/loss": "2.5"}, {"step": "3", "train/loss": "2.0"}]
    log = logger(cls, tmp_path, **({"kept": kept} if cls is CurvesLogger else {}))
    log.experiment  # the run starts; killed before its first save
    assert (rows(path) == kept) if cls is CurvesLogger else not path.exists()


def test_a_run_started_from_scratch_drops_an_abandoned_attempts_rows(tmp_path):
    path = tmp_path / "logs" / "metrics.csv"
    path.parent.mkdir()
    path.write_text("step,train/loss\n0,9.9\n")
    log = logger(CurvesLogger, tmp_path)
    log.experiment
    assert not path.exists()
    log.log_metrics({"train/loss": 2.5}, step=0)
    log.save()
    assert rows(path) == [{"step": "0", "train/loss": "2.5"}]
