"""The training curves of a run (`logs/metrics.csv`), written so that a kill never loses the rows already logged.

Lightning's CSV logger is kept (its rows, its columns, its flushing every `log_every` steps); two of its moves are
not: it deletes an existing metrics.csv when it starts, and it rewrites the whole file in place whenever a new
column appears (the first validation, a new metric). A kill between the delete and the first save, or during a
rewrite, left a resumed run with curves that begin at its checkpoint, or none. Here the file is only ever appended
to or replaced whole (`study.io.atomic_write`).
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from study.io import atomic_write


def checkpoint_step(ckpt_path: Path) -> int:
    """The step a run resumed from this checkpoint trains next (Lightning's `global_step`: the steps done)."""
    return int(torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def rows_before(csv_path: Path, ckpt_path: Path) -> list[dict[str, str]]:
    """The rows of an interrupted attempt's CSV log for the steps before its last checkpoint. Rows of steps after
    it are dropped: the resumed run trains those steps again and logs them itself."""
    if not csv_path.is_file():
        return []
    step = checkpoint_step(ckpt_path)
    with open(csv_path, newline="") as f:
        text = f.read()
    if not text.endswith("\n"):  # an append a kill or a full disk cut short: its last row is a fragment
        text = text[: text.rfind("\n") + 1]
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    return [{k: v for k, v in row.items() if k and v not in ("", None)}
            for row in rows if row.get("step", "").isdigit() and int(row["step"]) < step]


class _Writer(ExperimentWriter):
    """Lightning's writer: appends while the columns stay, replaces the file atomically when they change."""

    def __init__(self, log_dir: str, kept: list[dict[str, Any]]) -> None:
        self._kept = kept  # read by _check_log_dir_exists, which the base __init__ calls
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        """Where Lightning deletes the old file: the rows kept (an earlier attempt's, before its checkpoint) take its
        place in one step; with none kept the old file goes, as Lightning's does (a run trained from scratch)."""
        if self._kept:
            self.metrics_keys = sorted(set().union(*self._kept))
            self._replace(self._kept)
        elif os.path.isfile(self.metrics_file_path):
            os.remove(self.metrics_file_path)

    def save(self) -> None:
        if not self.metrics:
            return
        new_keys = self._record_new_keys()
        if new_keys and os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self._replace([*csv.DictReader(f), *self.metrics])
        else:
            exists = os.path.isfile(self.metrics_file_path)
            with open(self.metrics_file_path, "a" if exists else "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                if not exists:
                    writer.writeheader()
                writer.writerows(self.metrics)
        self.metrics = []

    def _replace(self, rows: list[dict[str, Any]]) -> None:
        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(rows)

        atomic_write(self.metrics_file_path, write)


class CurvesLogger(CSVLogger):
    """Lightning's CSVLogger (logs/metrics.csv) with `_Writer`; `kept`: the rows an interrupted attempt logged
    before its checkpoint (`rows_before`), which the file starts with."""

    def __init__(self, *args: Any, kept: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept = kept or []

    @property
    @rank_zero_experiment
    def experiment(self) -> _Writer:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _Writer(self.log_dir, self._kept)
        return self._experiment
