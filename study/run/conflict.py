"""A run directory belongs to one config: finished runs are handed back, other configs' runs are refused."""

from __future__ import annotations

import logging
from typing import Any

from study.config import Config
from study.record import RunDir

log = logging.getLogger(__name__)


class RunDirConflict(RuntimeError):
    @classmethod
    def between(cls, run_dir, stored: Config, cfg: Config) -> "RunDirConflict":
        """The error for a run directory holding `stored` when `cfg` was asked for, naming the fields that differ
        (e.g. `train.precision` when a run started with `auto` meets a machine where it resolves otherwise)."""
        diff = "; ".join(f"{k}: {there!r} there, {here!r} here" for k, (there, here) in stored.differences(cfg).items())
        return cls(f"{run_dir} holds a run of a different config ({diff}); choose another directory or --force")


def stored_config(run: RunDir, kind: type[Config]) -> Config | None:
    return kind.from_yaml(run.config.read_text()) if run.config.is_file() else None


def finished_run(run: RunDir, cfg: Config, force: bool, data_decided: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The metrics.json record of a finished run of `cfg` in `run`, or None when the run has not finished (or
    `force` asks for a rerun). Raises RunDirConflict when `run` holds a run of another config: a finished run is
    never handed back as another config's result, and an unfinished one is never resumed as one.

    `data_decided`: model fields the data decides (vocabulary size, padding id), not known before the data is read;
    they are taken from the stored config for the comparison."""
    if force:
        return None
    stored = stored_config(run, type(cfg))
    if stored is not None:
        wanted = cfg  # as the directory would record it: the fields the data decides are not known yet
        if data_decided:
            wanted = cfg.replace(model=cfg.model.replace(**{k: getattr(stored.model, k) for k in data_decided}))
        if stored != wanted:
            raise RunDirConflict.between(run.path, stored, wanted)
    record = run.finished()
    if record is not None:
        log.info("%s already finished (%s); nothing to do", run.path, record["status"])
    return record
