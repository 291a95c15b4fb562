"""Before any training: every swept value reaches the trained model, the objective is a metric the task declares,
and the sweep's seeds reach its runs. A spec that fails any of these is refused, naming the axis and why.

A value can fail to reach the model in three ways, each declared by the task family (`study.tasks.contract`): the
task never reads the field (`unread_fields`: `task.beam_size` in language modelling), something else decides it
(`overridden_fields`: the model of a GLUE run that starts from a pretrained one, `model.nsp` where no next-sentence
head is trained), or resolving the config replaces it (`resolve`), which is checked by comparing the field before
and after resolution. A fourth is the model's own: a field only other position schemes read
(`ModelConfig.unread_fields`: `model.max_seq_len` sizes a learned table, and nothing under RoPE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from study.config import ExperimentConfig, PipelineConfig
from study.config.sweep import SweepConfig, route
from study.tasks import family
from study.tasks import resolved_stage as pipeline_stage


def stage_config(cfg: ExperimentConfig | PipelineConfig, stage: str | None) -> ExperimentConfig:
    return cfg.stages[stage] if isinstance(cfg, PipelineConfig) else cfg


def resolved_stage(cfg: ExperimentConfig | PipelineConfig, stage: str | None) -> ExperimentConfig:
    """The config stage `stage` of `cfg` will run, resolved by its task family before any data is read (a later
    stage of a pipeline: from the config of the stage it starts from)."""
    if isinstance(cfg, PipelineConfig):
        return pipeline_stage(cfg, stage)
    return family(cfg.task.name).resolve(cfg, pretrained=None)


def field_value(cfg: ExperimentConfig, path: str) -> Any:
    section, _, name = path.partition(".")
    return getattr(getattr(cfg, section), name)


def asked_and_run(cfg: ExperimentConfig | PipelineConfig, stage: str | None, path: str) -> tuple[Any, Any]:
    """The value `cfg` asks at `path` (`section.field`) of `stage`, and the value that runs once the task resolves
    the config (GLUE under init_from: the pretrained architecture); a ValueError where it cannot be resolved."""
    return field_value(stage_config(cfg, stage), path), field_value(resolved_stage(cfg, stage), path)


def value_problem(spec: SweepConfig, cfg: ExperimentConfig | PipelineConfig, path: str,
                  partly: bool = False) -> str | None:
    """Why the value `cfg` holds at axis path `path` would not reach the trained model, or None. `partly`: a value
    that reaches part of the experiment is enough (a `set` default that a suite's per-task settings override for
    some tasks); an axis value must reach all of it, or its label would not say what ran."""
    stage, field = route(path, spec.stage_names)
    exp = stage_config(cfg, stage)
    task = family(exp.task.name)
    unread = task.unread_fields(exp)
    if not partly:  # (a `set` of max_seq_len is kept for the points with a position table, as a config keeps it)
        unread |= task.overridden_fields(exp) | {
            f"model.{n}": f"{why} (vary it only where the position does: an axis with `when: {{position: ...}}`, or "
                          "state it in the base config or `set`)" for n, why in exp.model.unread_fields().items()}
        unread |= {f"train.{n}": why for n, why in exp.train.unread_fields().items()}
    why = unread.get(field)
    if why is not None:
        return f"{path} does not reach the trained model: {why}"
    try:
        asked, runs = asked_and_run(cfg, stage, field)
    except ValueError as err:
        return str(err)
    if asked != runs:
        return f"{path} is replaced when the config is resolved (asked {asked!r}, runs {runs!r})"
    return None


def part_problems(spec: SweepConfig, cfg: ExperimentConfig | PipelineConfig, assignments: dict[str, dict[str, Any]],
                  data_dir: str | Path | None) -> list[str]:
    """Problems of one point of a suite (a task family that runs parts, GLUE: one per task and seed): the family may
    set a training field per part from its data (GLUE's steps capped at task.epochs passes over each task's training
    set, its warm-up at a tenth of them), so an axis value of a `train.*` field (the seed aside) must be the value
    every part runs, or its label would not say what ran. Reads the data (the training sets' sizes); where none of
    a suite's tasks can be read, the run will refuse it for the data, and nothing is said here."""
    problems, parts_of = [], {}
    for where, fields in assignments.items():
        for path in fields:
            stage, field = route(path, spec.stage_names)
            if not field.startswith("train.") or field == "train.seed":
                continue
            if stage not in parts_of:  # (once per stage: the parts read the data)
                parts_of[stage] = _suite_parts(cfg, stage, data_dir)
            exp, parts = parts_of[stage]
            if exp is None:
                continue
            asked = field_value(exp, field)
            missed = {p.path.split("/")[0]: ran for p in parts
                      if p.config is not None and (ran := field_value(p.config, field)) != asked}
            if missed:
                problems.append(f"{where}: {path} does not reach every part of the suite (asked {asked!r}; runs "
                                + ", ".join(f"{task}: {ran!r}" for task, ran in missed.items()) + f"): "
                                f"{family(exp.task.name).part_settings} Choose values every part runs, or leave "
                                "out the tasks that cap them (task.glue_tasks)")
    return problems


def _suite_parts(cfg: ExperimentConfig | PipelineConfig, stage: str | None, data_dir: str | Path | None):
    """(the resolved config of `stage`, its family's parts: [] for a single run), or (None, []) where the config does
    not resolve (value_problem says why) or none of its data can be read (the run refuses it for that)."""
    from study.tasks.data import DatasetUnavailable

    try:
        exp = resolved_stage(cfg, stage)
        return exp, family(exp.task.name).sub_runs(exp, data_dir) or []
    except (ValueError, DatasetUnavailable):
        return None, []


def data_problems(configs: list[ExperimentConfig | PipelineConfig], data_dir: str | Path | None,
                  objective: str | None = None) -> list[str]:
    """What keeps the runs of `configs` (every stage of a pipeline) from reading their data, each dataset read once
    (by its task section: the same task settings read the same data): the DataError a trial would fail with, three
    times, after its process started; and the `objective` (a metric of the last stage) a run would not write for
    want of its data (TaskFamily.metric_without_data), after training."""
    from study.tasks.data import DataError

    problems, seen = [], set()
    for cfg in configs:
        stages = list(cfg.stages.values()) if isinstance(cfg, PipelineConfig) else [cfg]
        for exp in stages:
            if repr(exp.task) in seen:
                continue
            seen.add(repr(exp.task))
            try:
                family(exp.task.name).check_data(exp, data_dir)
                why = family(exp.task.name).metric_without_data(exp, objective, data_dir) if (
                    objective and exp is stages[-1]) else None
            except DataError as err:
                why = str(err)
            if why and why not in problems:
                problems.append(why)
    return problems


def reach_problems(spec: SweepConfig, cfg: ExperimentConfig | PipelineConfig,
                   assignments: dict[str, dict[str, Any]], stated: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Problems of one point: `assignments` maps each axis (and `tune`) to the fields it sets there; `stated` each
    `set` of the spec to the fields it sets, which must reach the model at least in part (a stage's `model.norm`
    under init_from, or a field the task never reads, would state a setting that never ran)."""
    problems = []
    for where, fields, partly in [*((a, f, False) for a, f in assignments.items()),
                                  *((a, f, True) for a, f in (stated or {}).items())]:
        for path in fields:
            problem = value_problem(spec, cfg, path, partly)
            if problem:
                problems.append(f"{where}: {problem}")
    named = {path for fields in [*assignments.values(), *(stated or {}).values()] for path in fields}
    for stage in spec.stage_names or [None]:  # what the base config itself sets (an axis or `set`: said above)
        exp, where = stage_config(cfg, stage), f"{stage}." if stage else ""
        problems += [f"base: {where}{p}" for p in family(exp.task.name).unread_settings(exp)
                     if f"{where}{p.partition(':')[0]}" not in named]
    first = stage_config(cfg, spec.stage_names[0] if spec.stage_names else None)
    if not family(first.task.name).reads_train_seed(first):
        where = f"the {spec.stage_names[0]} stage's " if spec.stage_names else ""
        problems.append(f"seeds: the sweep's seeds set {where}train.seed, which task {first.task.name!r} does not "
                        "read here (task.finetune_seeds gives its seeds): every seed would run the same; drop "
                        "task.finetune_seeds (the sweep's seeds are then the fine-tuning seeds) or make this a "
                        "later stage of a study in stages")
    return problems


def objective_stage(metric: str, stages: list[str]) -> str | None:
    """The stage whose run writes the objective in a study in stages (`STAGE.metric`: an earlier stage's; otherwise
    the last stage's); None for a plain sweep."""
    if not stages:
        return None
    head, dot, _ = metric.partition(".")
    return head if dot and head in stages[:-1] else stages[-1]


def stage_metric(metric: str, stages: list[str]) -> tuple[str | None, str]:
    """(the stage whose run writes `metric`, the metric's name in that run's record): `STAGE.metric` names an earlier
    stage's, any other name the last stage's (None, the name itself: a plain sweep)."""
    stage = objective_stage(metric, stages)
    return stage, metric.split(".", 1)[1] if stage in stages[:-1] else metric


def objective(spec: SweepConfig, cfg: ExperimentConfig | PipelineConfig) -> tuple[dict[str, Any], str | None]:
    """The sweep's objective resolved against the declarations of the task that writes it ({metric, direction,
    scale, task}), and what is wrong with it (None when nothing is). In a study in stages the objective is the
    last stage's metric, or `STAGE.metric` for an earlier stage's."""
    metric, direction = spec.objective.get("metric"), spec.objective.get("direction")
    stages = spec.stage_names
    stage, name = stage_metric(metric or "", stages)
    task = family(stage_config(cfg, stage).task.name)
    if metric is None:  # no metric given: the task's default
        name = task.default_objective
        metric = name
    problem = task.objective_problem(name, direction) or task.unwritten_metric(stage_config(cfg, stage), name)
    if problem is not None:
        return {"metric": metric, "direction": direction or "minimize", "task": task.name}, f"objective: {problem}"
    declared = task.metric(name)
    return {"metric": metric, "direction": declared.direction, "scale": declared.scale, "task": task.name}, None


def objective_definition(spec: SweepConfig, cfg: ExperimentConfig | PipelineConfig, metric: str) -> dict[str, Any]:
    """The values at this point of the fields that decide what the objective `metric` measures (its declared
    `defined_by`): points that differ in them measure different things under one name."""
    stage, name = stage_metric(metric, spec.stage_names)
    exp = stage_config(cfg, stage)  # (as asked: resolving decides model fields, never these task fields)
    declared = family(exp.task.name).metric(name)
    # (a `metric.*` entry is known only once the run has written it: the report compares those)
    return {path: field_value(exp, path) for path in (declared.defined_by if declared else ())
            if not path.startswith("metric.")}


def contracts(cfg: ExperimentConfig | PipelineConfig) -> dict[str, dict[str, Any]]:
    """The declarations of every task family a point runs, as plan.json records them for the report."""
    stages = cfg.stages.values() if isinstance(cfg, PipelineConfig) else [cfg]
    out = {}
    for exp in stages:
        task = family(exp.task.name)
        out[task.name] = {"metrics": task.declared(), "default_objective": task.default_objective,
                          "curves": dict(task.curves)}
    return out
