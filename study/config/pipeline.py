"""`PipelineConfig`: an experiment in stages, each a full `ExperimentConfig`, later stages starting from earlier ones.

    name: nsp-glue
    stages:
      pretrain: {model: {...}, task: {name: pretrain, ...}, train: {...}}
      glue:     {model: {dropout: 0.1}, task: {name: glue, init_from: "stage:pretrain", ...}, train: {...}}

A later stage names the stage it starts from with `task.init_from: stage:<name>`; the run layer puts that stage's
run directory there when it runs. The pipeline's seed is the first stage's `train.seed` (the pretraining seed: the
unit that varies between trials); later stages keep their own seeds (GLUE: `task.finetune_seeds`).

Every stage but the last is content-hashed like any sweep point and trained once: pipelines that differ only in a
later stage share it (`study.run.pipeline`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from study.config.base import Config, ConfigError, Problems
from study.config.experiment import ExperimentConfig

STAGE_REF = "stage:"


def stage_ref(init_from: str | None) -> str | None:
    """The stage an `init_from` value names (`stage:pretrain` -> 'pretrain'), or None for a path or null."""
    return init_from[len(STAGE_REF):] if isinstance(init_from, str) and init_from.startswith(STAGE_REF) else None


@dataclass(frozen=True)
class PipelineConfig(Config):
    name: str = "pipeline"
    stages: dict = field(default_factory=dict)  # stage name -> ExperimentConfig, in the order they run

    def _validate(self, p: Problems) -> None:
        p.check(bool(re.fullmatch(r"(?!\.+$)[A-Za-z0-9_.=+-]+", self.name)), "name",
                f"{self.name!r}: use letters, digits and _ . = + - only, not dots alone (it names a directory)")
        names = list(self.stages)
        p.check(len(names) >= 2, "stages", f"a pipeline has at least two stages, got {names}")
        for i, (name, stage) in enumerate(self.stages.items()):
            p.check(bool(re.fullmatch(r"[A-Za-z0-9_]+", name)) and name not in ("model", "task", "train"),
                    f"stages.{name}", "a stage name uses letters, digits and _ and is not model, task or train")
            if not isinstance(stage, ExperimentConfig):
                p.add(f"stages.{name}", "must be an experiment {model, task, train}")
                continue
            ref = stage_ref(stage.task.init_from)
            if i == 0:
                p.check(ref is None, f"stages.{name}.task.init_from", "the first stage cannot start from a stage")
            else:
                p.check(ref in names[:i], f"stages.{name}.task.init_from",
                        f"a later stage starts from an earlier one: {STAGE_REF}<one of {names[:i]}>, got "
                        f"{stage.task.init_from!r}")

    @property
    def first(self) -> ExperimentConfig:
        return next(iter(self.stages.values()))

    @property
    def seed(self) -> int:
        return self.first.train.seed

    def with_seed(self, seed: int) -> "PipelineConfig":
        """The pipeline with `seed` as its first stage's (the pretraining) seed."""
        first = next(iter(self.stages))
        stages = dict(self.stages)
        stages[first] = self.first.with_seed(seed)
        return PipelineConfig(name=self.name, stages=stages)

    def differences(self, other: Config) -> dict[str, tuple[Any, Any]]:
        if not isinstance(other, PipelineConfig):
            return super().differences(other)
        out: dict[str, tuple[Any, Any]] = {}
        for name in dict.fromkeys([*self.stages, *other.stages]):
            mine, theirs = self.stages.get(name), other.stages.get(name)
            if mine is None or theirs is None:
                out[f"stages.{name}"] = (mine is not None, theirs is not None)
            else:
                out.update({f"stages.{name}.{k}": v for k, v in mine.differences(theirs).items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "stages": {k: v.to_dict() for k, v in self.stages.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "PipelineConfig":
        data = dict(data or {})
        unknown = sorted(set(data) - {"name", "stages"})
        if unknown:
            raise ConfigError(cls.__name__, [f"{k}: unknown field; a pipeline has name and stages" for k in unknown])
        raw = data.get("stages")
        if not isinstance(raw, dict):
            raise ConfigError(cls.__name__, [f"stages: must map stage names to experiments, got {raw!r}"])
        stages, problems = {}, []
        for name, stage in raw.items():  # build every stage before failing: one error lists them all
            try:
                stages[str(name)] = stage if isinstance(stage, ExperimentConfig) else ExperimentConfig.from_dict(stage)
            except ConfigError as err:
                problems += [f"stages.{name}.{p}" for p in err.problems]
        if problems:
            raise ConfigError(cls.__name__, problems)
        return cls(name=data.get("name", "pipeline"), stages=stages)


def experiment_from_dict(data: dict[str, Any]) -> ExperimentConfig | PipelineConfig:
    """An experiment mapping as the config it describes: a pipeline when it has `stages`."""
    return PipelineConfig.from_dict(data) if isinstance(data, dict) and "stages" in data else \
        ExperimentConfig.from_dict(data)


def apply_stage_overrides(data: dict[str, Any], assignments: dict[str, Any]) -> dict[str, Any]:
    """A copy of the pipeline mapping `data` with `{"stage.section.field": value}` assignments applied."""
    from study.config.experiment import set_fields

    given = data.get("stages") or {}
    bad = [f"stages.{k}" for k, v in given.items() if v is not None and not isinstance(v, dict)] \
        if isinstance(given, dict) else ["stages"]
    if bad:
        raise ConfigError("PipelineConfig", [f"{where}: must be a mapping of sections (model, task, train)"
                                             + ("" if where != "stages" else " by stage name") for where in bad])
    stages = {k: dict(v or {}) for k, v in given.items()}
    for key, value in assignments.items():
        if key == "name":
            continue
        stage, _, rest = key.partition(".")
        if stage not in stages or "." not in rest:
            raise ConfigError("PipelineConfig", [f"{key}: pipeline overrides look like STAGE.SECTION.FIELD with "
                                                 f"STAGE one of {list(stages)}"])
        stages[stage] = set_fields(stages[stage], {rest: value})
    out = {**data, "stages": stages}
    if "name" in assignments:
        out["name"] = assignments["name"]
    return out


def is_experiment_mapping(data: Any) -> bool:
    """Whether a YAML mapping is an experiment (sections model, task, train) or a pipeline of them (stages holding
    those sections) rather than a sweep spec, which names the axes it varies: what `study sweep` and `study status`
    tell a user who gave them an experiment."""
    if not isinstance(data, dict) or "axes" in data:
        return False
    stages = data.get("stages") if isinstance(data.get("stages"), dict) else {}
    sections = [set(data), *(set(v) for v in stages.values() if isinstance(v, dict))]
    return any({"model", "task", "train"} & keys for keys in sections)


def load_experiment(path, overrides=()) -> ExperimentConfig | PipelineConfig:
    """An experiment YAML (one experiment, or a pipeline with `stages`) with `--set` overrides applied."""
    from pathlib import Path

    import yaml

    from study.config.base import parse_overrides
    from study.config.experiment import apply_overrides
    from study.io import load_yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment config {path} does not exist")
    try:
        data = load_yaml(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError("ExperimentConfig", [f"{path}: not valid YAML: {err}"]) from None
    if isinstance(data, dict) and "axes" in data:
        raise ConfigError("ExperimentConfig", [f"{path} is a sweep spec: run it with `study sweep {path}`"])
    if not isinstance(data, dict) or not (data.get("task") or data.get("stages")):
        got = type(data).__name__ if not isinstance(data, dict) else "no task" if data else "an empty file"
        raise ConfigError("ExperimentConfig", [f"{path}: an experiment is a mapping with sections model, task (its "
                                               f"name and dataset at least) and train; got {got}"])
    if "stages" in data:
        return PipelineConfig.from_dict(apply_stage_overrides(data, parse_overrides(overrides)))
    return ExperimentConfig.from_dict(apply_overrides(data, overrides))
