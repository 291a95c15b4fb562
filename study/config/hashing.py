"""Content hashes of experiments: the same experiment is the same run directory, in every sweep, and trains once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from study.config.base import Config


def content_hash(cfg: Config) -> str:
    """Content hash of everything that defines an experiment (or a pipeline of them): the model, task and training
    config without the experiment's name and its seed (a pipeline: without the first stage's seed, which is the
    trial's).

    Fields at their declared default are left out, so a release that adds a field (whose default keeps the old
    behaviour, as a new field's must) leaves every existing point's hash, and so its run directory, unchanged: a
    sweep resumed after an upgrade neither repeats its finished trials nor orphans them. The other side of that
    bargain: changing an existing field's default changes what those points mean, and needs a new field instead."""
    return _digest(cfg, resolved=False)


def same_run_hash(cfg: Config) -> str:
    """A hash under which two experiments that run the same are equal however their fields are spelled: each unset
    field the config derives (`n_kv_heads: null` -> n_heads; `Config.resolved`) counts as its resolved value. The
    plan finds duplicate points by it. Never a run directory's name: content_hash is, and must not move when a
    derivation rule is added."""
    return _digest(cfg, resolved=True)


def _digest(cfg: Config, resolved: bool) -> str:
    from study.config.pipeline import PipelineConfig

    if isinstance(cfg, PipelineConfig):
        stages = [_identity(stage, drop_seed=i == 0, resolved=resolved) for i, stage in enumerate(cfg.stages.values())]
        data: Any = {"stages": dict(zip(cfg.stages, stages))}
    else:
        data = _identity(cfg, drop_seed=True, resolved=resolved)
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _identity(cfg: Config, drop_seed: bool, resolved: bool) -> dict[str, Any]:
    data = without_defaults(cfg, resolved)
    data.pop("name", None)
    if drop_seed:
        data.get("train", {}).pop("seed", None)
    model = getattr(cfg, "model", None)
    if resolved and model is not None and getattr(model, "window", None) is not None:
        _built_pattern(model, data)
    if resolved and "task" in data:
        _suite_as_run(data["task"])
    return data


def _suite_as_run(task: dict[str, Any]) -> None:
    """A GLUE suite as it runs: `glue_tasks` as the set of tasks (however spelled, in any order; all nine listed is
    none listed), and `per_task` numbers as values (3 and 3.0 set one value: it is coerced where it is applied)."""
    from study.config.task import GLUE_DATASETS, glue_task_key

    if "glue_tasks" in task:
        keys = sorted({glue_task_key(t) for t in task["glue_tasks"]})
        if keys == sorted(GLUE_DATASETS):
            del task["glue_tasks"]
        else:
            task["glue_tasks"] = keys
    if "per_task" in task:
        task["per_task"] = {name: {k: int(v) if isinstance(v, float) and v.is_integer() else v
                                   for k, v in settings.items()} for name, settings in task["per_task"].items()}


def _built_pattern(model: Any, data: dict[str, Any]) -> None:
    """window_pattern as the layers it builds: the pattern restarts in each stack, cut to its depth and repeated, so
    'LGGG' and 'LG' over two layers build one model, and an all-local pattern the model of none."""
    spans = model.stack_spans()
    section = data.setdefault("model", {})
    section.pop("window_pattern", None)
    if "global" in spans:
        section["window_pattern"] = "".join("L" if s == "local" else "G" for s in spans)


def without_defaults(section: Config, resolved: bool = False) -> dict[str, Any]:
    """The fields of `section` (recursively) whose value differs from the declared default (`resolved`: each unset
    field read as the value the config derives for it)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = section.resolved(f.name) if resolved else getattr(section, f.name)
        if isinstance(value, Config):
            out[f.name] = without_defaults(value, resolved)
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if value != default:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
