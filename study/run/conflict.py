"""A run directory belongs to one config: finished runs are handed back, other configs' runs are refused."""

from __future__ import annotations

import logging
import re
from pathlib import Path
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
        wanted = _with_stored_init_from(stored, wanted).replace(name=stored.name)  # a label, not what runs: a
        # content-addressed directory is reached under several names (a sweep's point-<hash>, a pipeline's stage)
        if stored != wanted:
            raise RunDirConflict.between(run.path, stored, wanted)
    return run.finished()


def handed_back(run: RunDir, record: dict[str, Any]) -> dict[str, Any]:
    """`record`, the finished run in `run` that a caller hands back untrained, saying so. (Logged by the caller once
    it has decided: a finished run it must run again, e.g. fine-tuned from a since-replaced model, is not one.)"""
    log.info("%s already finished (%s); nothing to do", run.path, record["status"])
    return record


# A fingerprint's keys that say where the data came from (study.tasks.data.sources): a local copy and the hub's
# name and digest one benchmark differently (another file format), so across sources only what was read is compared.
_SOURCE_KEYS = {"source", "dataset", "config", "files", "revision", "tokenizer", "vocab_sha256", "unavailable_splits"}
_SPELLING_KEYS = {"init_from"}  # a path, however spelled: the pretrained weights' digest (model_sha256) decides
# keys a fingerprint has held only since they were added: a data.json written before has none, which says nothing
_ADDED_KEYS = {"vocab_sha256"}


def data_differences(stored: Any, read: Any, where: str = "") -> list[str]:
    """Where the data a run directory trained on (its data.json) and the data read now are known to differ: two
    copies from the same source (local files' digests, hub revisions, the tokenizer trained on them), or, across
    sources, what was read from them (example and token counts, the pretrained weights' digest)."""
    if isinstance(stored, dict) and isinstance(read, dict):
        skip = set(_SPELLING_KEYS) | {k for k in _ADDED_KEYS if k not in stored}
        if "source" in stored and "source" in read and stored["source"] != read["source"]:
            skip |= _SOURCE_KEYS
        if stored.get("vocab_sha256") is not None and stored.get("vocab_sha256") == read.get("vocab_sha256"):
            skip.add("tokenizer")  # its key names how it was trained (a cache format included); one id map, one data
        return [d for key in sorted(set(stored) | set(read), key=str) if key not in skip
                for d in data_differences(stored.get(key), read.get(key), f"{where}.{key}" if where else str(key))]
    return [] if stored == read else [f"{where or 'data'}: {_short(stored)} there, {_short(read)} here"]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def refuse_other_data(run: RunDir, read: dict[str, Any]) -> None:
    """Raise RunDirConflict when `run` was trained on other data than `read` (see data_differences): resuming its
    checkpoint would continue a model on data its data.json no longer names."""
    import json

    from study.io import read_json_or_none

    stored = read_json_or_none(run.data)
    if stored is None:
        return
    diffs = data_differences(stored, json.loads(json.dumps(read, default=str)))  # as data.json would hold it
    if diffs:
        more = f"; and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        vocab = any(d.startswith("vocab_sha256") for d in diffs)
        hint = (" (the tokenizer trained now maps tokens to other ids: WordPiece training is not deterministic from "
                "one process to the next; resume with the cache folder the run started with, STUDY_CACHE_DIR)"
                if vocab else "")
        raise RunDirConflict(f"{run.path} holds a run trained on other data ({'; '.join(diffs[:3])}{more}){hint}; "
                             "choose another directory or --force")


def _pretrained_run(init_from: str) -> tuple[str, ...]:
    """What identifies the run a `task.init_from` names. A content-hashed stage directory (`<hash>/seed-<k>`,
    study.run.pipeline.stage_dir): its hash and seed, which say what was trained wherever the results folder is
    mounted, so a folder moved wholesale (another machine, another mount) still resumes; any other run: its
    resolved path (a relative spelling resolves against the working directory, as the run itself reads it)."""
    path = Path(init_from).resolve()
    if re.fullmatch(r"[0-9a-f]{12}", path.parent.name) and re.fullmatch(r"seed-\d+", path.name):
        return path.parent.name, path.name
    return (str(path),)


def _with_stored_init_from(stored: Config, cfg: Config) -> Config:
    """`cfg` with the stored `task.init_from` where both name the same pretrained run however spelled (an absolute
    path, another working directory, a moved results folder): the spelling is not part of the config."""
    there, here = (getattr(getattr(c, "task", None), "init_from", None) for c in (stored, cfg))
    if there and here and there != here and _pretrained_run(there) == _pretrained_run(here):
        return cfg.replace(task=cfg.task.replace(init_from=there))
    return cfg
