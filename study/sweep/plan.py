"""Expand a sweep spec into points and validate every point before anything runs.

A *point* is one complete experiment config (minus the seed; a study in stages: a pipeline of them); a *trial* is a
(point, seed) pair. Every point gets a content hash of its complete config, so the same point in two sweeps is the
same run directory (`results/runs/<hash>/seed-<k>`) and is trained once. Beside each point's own validity, the plan
checks that every swept value reaches the trained model and that the objective is a metric the task declares
(`study.sweep.reach`); the cost estimate is `study.sweep.estimate`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from study.config import ConfigError, ExperimentConfig, PipelineConfig, content_hash
from study.config.hashing import same_run_hash
from study.config.experiment import set_fields
from study.config.pipeline import STAGE_REF, is_experiment_mapping
from study.io import load_yaml
from study.config.sweep import NOT_APPLICABLE, Axis, SweepConfig, label_of, route
from study.sweep.estimate import basis_sentence


class SweepSpecError(ValueError):
    """A sweep spec, or some of its points, is invalid; nothing has run."""


@dataclass(frozen=True)
class Point:
    point: str  # content hash
    label: str
    varied: str  # OFAT: the axis this point varies ('baseline' for the baseline); grid: 'grid'
    axes: dict[str, str]  # axis name -> value label
    config: ExperimentConfig | PipelineConfig

    @property
    def is_baseline(self) -> bool:
        return self.varied == "baseline"

    def trial_key(self, seed: int) -> str:
        return f"{self.point}-s{seed}"

    def to_dict(self) -> dict[str, Any]:
        return {"point": self.point, "label": self.label, "varied": self.varied, "is_baseline": self.is_baseline,
                "axes": dict(self.axes), "config": self.config.to_dict()}


@dataclass
class Plan:
    spec: SweepConfig
    axes: list[Axis]
    points: list[Point]
    invalid: list[tuple[str, list[str]]] = field(default_factory=list)  # (label, problems)
    excluded: list[str] = field(default_factory=list)
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (label, same as label)
    refused: list[str] = field(default_factory=list)  # spec-wide problems: axes that miss the model, the objective
    objective: dict[str, Any] = field(default_factory=dict)  # {metric, direction, scale, task}: as declared
    tasks: dict[str, Any] = field(default_factory=dict)  # each task family's declarations (study.sweep.reach)

    @property
    def trials(self) -> list[tuple[Point, int]]:
        return [(p, s) for p in self.points for s in self.spec.seeds]

    @property
    def metric(self) -> str:
        return self.objective["metric"]

    @property
    def direction(self) -> str:
        return self.objective["direction"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "sweep": self.spec.name,
            "design": self.spec.design,
            "objective": dict(self.objective),
            "seeds": list(self.spec.seeds),
            "stages": self.spec.stage_names,
            "axes": {a.name: a.labels for a in self.axes},
            "axis_fields": {a.name: sorted({f for v in a.values.values() for f in v}) for a in self.axes},
            "points": [p.to_dict() for p in self.points],
            "excluded": self.excluded,
            "duplicates": [list(d) for d in self.duplicates],
            "tasks": self.tasks,
            "spec": self.spec.to_dict(),
            "tune": self.spec.tune_settings if self.spec.tune else {},
        }


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[SweepConfig, Path]:
    """Read a sweep YAML; returns the spec and the folder its relative paths start from. `overrides` (as given to
    `--set`): `section.field` (a study in stages: `model.field` or `STAGE.section.field`) sets the base config;
    anything else (`seeds`, `workers`) a field of the spec itself."""
    path = Path(path)
    if not path.is_file():
        raise SweepSpecError(f"sweep spec {path} does not exist")
    data = _yaml_file(path, str(path))
    if not isinstance(data, dict):
        raise SweepSpecError(f"{path}: a sweep spec is a mapping (name, base, axes, seeds, ...)")
    if is_experiment_mapping(data):
        raise SweepSpecError(f"{path} is an experiment config: run it with `study run {path}`; a sweep spec names "
                             "its base config and the axes it varies (experiments/ablation_default.yaml)")
    data.setdefault("name", path.stem)  # as `study status|results SPEC` read it: one folder, results/<stem>
    stages = list(data.get("stages") or {}) if isinstance(data.get("stages"), dict) else []
    for key, value in (overrides or {}).items():
        stage, field_path = route(key, stages)
        if stage is not None:  # `--set pretrain.train.max_steps=50`: that stage's base config
            data["stages"][stage] = {**data["stages"][stage],
                                     "set": {**(data["stages"][stage].get("set") or {}), field_path: value}}
        elif key.split(".", 1)[0] in ("model", "task", "train"):  # `--set train.max_steps=50`: the base config
            if stages:
                raise SweepSpecError(f"--set {key}: in a study in stages, name the stage "
                                     f"({', '.join(f'{s}.{key}' for s in stages)})")
            data["set"] = {**(data.get("set") or {}), key: value}
        else:  # `--set seeds=[0]`: the spec's own fields
            data[key] = value
    try:
        return SweepConfig.from_dict(data), path.parent
    except ConfigError as err:
        raise SweepSpecError(f"{path}: {err}") from None


def _yaml_file(path: Path, where: str) -> Any:
    """The YAML in `path` ({} for an empty file); SweepSpecError naming `where` when it is not YAML (a binary file
    is not YAML either)."""
    try:
        return load_yaml(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise SweepSpecError(f"{where}: not valid YAML: {err}") from None


def _read_base(base: Any, root: Path, where: str) -> dict[str, Any]:
    if isinstance(base, dict):
        return dict(base)
    if not base:
        return {}
    base_path = (root / base) if not Path(base).is_absolute() else Path(base)
    if not base_path.is_file():
        kind = "is a folder, not an experiment YAML" if base_path.is_dir() else "does not exist"
        raise SweepSpecError(f"{where}: experiment config {base_path} {kind}")
    data = _yaml_file(base_path, f"{where}: {base_path}")
    if not isinstance(data, dict):
        raise SweepSpecError(f"{where}: {base_path} holds a {type(data).__name__}, not an experiment (a mapping with "
                             "sections model, task and train)")
    return data


def base_configs(spec: SweepConfig, root: Path) -> dict[str | None, dict[str, Any]]:
    """The base experiment mapping with the spec's `set` applied: {None: base}, or for a study in stages one per
    stage, a later stage's `task.init_from` naming the stage it starts from (`stage:NAME`)."""
    if not spec.stages:
        return {None: set_fields(_read_base(spec.base, root, "base"), spec.set)}
    out: dict[str | None, dict[str, Any]] = {}
    for name, stage in spec.stages.items():
        data = set_fields(_read_base(stage.get("base"), root, f"stages.{name}.base"), stage.get("set") or {})
        if stage.get("init_from"):
            data = set_fields(data, {"task.init_from": f"{STAGE_REF}{stage['init_from']}"})
        out[name] = data
    return out


def build_config(spec: SweepConfig, bases: dict[str | None, dict[str, Any]],
                 assignments: dict[str, Any]) -> ExperimentConfig | PipelineConfig:
    """The point config: each assignment routed to its stage, sweeps logging to files (no progress bars)."""
    per_stage: dict[str | None, dict[str, Any]] = {k: {"train.progress_bar": False} for k in bases}
    for path, value in assignments.items():
        stage, field_path = route(path, spec.stage_names)
        per_stage[stage][field_path] = value
    if not spec.stages:
        return ExperimentConfig.from_dict(set_fields(bases[None], per_stage[None]))
    stages = {k: set_fields(v, per_stage[k]) for k, v in bases.items()}
    return PipelineConfig.from_dict({"name": spec.name, "stages": stages})


def _applies(axis: Axis, labels: dict[str, str]) -> bool:
    return all(labels.get(other) in allowed for other, allowed in axis.when.items())


def _by_condition(conditional: list[Axis]) -> list[Axis]:
    """The conditional axes, each after the axes its condition names: whether an axis applies is read from the
    labels filled before it, so one filled before the axis it refines would never apply (a cycle, which the spec
    refuses, stays in declared order)."""
    names = {a.name for a in conditional}
    ordered: list[Axis] = []
    while len(ordered) < len(conditional):
        placed = {a.name for a in ordered}
        left = [a for a in conditional if a.name not in placed]
        ordered.append(next((a for a in left if set(a.when) & names <= placed), left[0]))
    return ordered


def _fill(labels: dict[str, str], conditional: list[Axis], expand: bool) -> list[dict[str, str]]:
    """Fill the conditional axes (in condition order) where they apply: every value for a grid; else the value
    already chosen (one factor at a time, moved onto a condition) or the baseline. Elsewhere n/a."""
    out = [dict(labels)]
    for axis in conditional:
        nxt = []
        for lab in out:
            if not _applies(axis, lab):
                nxt.append({**lab, axis.name: NOT_APPLICABLE})
            else:
                nxt += [{**lab, axis.name: v} for v in (axis.labels if expand else [lab.get(axis.name, axis.baseline)])]
        out = nxt
    return out


def _onto_condition(axis: Axis, labels: dict[str, str], by_name: dict[str, Axis],
                    seen: tuple[str, ...] = ()) -> dict[str, str]:
    """`labels` moved onto `axis`'s condition: each axis it names to its first allowed value, an axis that is
    itself conditional moved onto its own condition first (a chain: `lr` where `pattern: LG`, where `span: local`)."""
    out = dict(labels)
    for other, allowed in axis.when.items():
        parent = by_name[other]
        if parent.when and other not in seen:
            out = _onto_condition(parent, out, by_name, (*seen, axis.name))
        out[other] = allowed[0]
    return out


def _combos(spec: SweepConfig, axes: list[Axis]) -> list[tuple[str, str, dict[str, str]]]:
    """(label, varied, axis -> value label) for every point of the design, before validation; a conditional axis
    takes a value only where its condition holds (`_unreached` names the values that hold nowhere)."""
    plain = [a for a in axes if not a.when]
    conditional = _by_condition([a for a in axes if a.when])
    order = [a.name for a in plain] + [a.name for a in axes if a.when]  # labels read plain axes first, as declared

    def fill(labels: dict[str, str], expand: bool) -> list[dict[str, str]]:
        return [{name: lab[name] for name in order} for lab in _fill(labels, conditional, expand)]

    if spec.design == "grid":
        combos = []
        for values in itertools.product(*[a.labels for a in plain]):
            for labels in fill(dict(zip([a.name for a in plain], values)), expand=True):
                name = ",".join(f"{k}={v}" for k, v in labels.items() if v != NOT_APPLICABLE)
                combos.append((name, "grid", labels))
        return combos

    # one factor at a time (Narang et al. 2021): the baseline, then each axis's other values
    baseline = {a.name: a.baseline for a in plain}
    combos = [("baseline", "baseline", fill(baseline, expand=False)[0])]
    for axis in plain:
        for value in axis.labels[1:]:
            combos.append((f"{axis.name}={value}", axis.name, fill({**baseline, axis.name: value}, expand=False)[0]))
    by_name = {a.name: a for a in axes}
    for axis in conditional:
        # vary it where it applies: the baseline moved onto its condition (the first allowed value)
        on = fill(_onto_condition(axis, baseline, by_name), expand=False)[0]
        if on[axis.name] == NOT_APPLICABLE:  # a condition no point meets: its values run nowhere (`_unreached`)
            continue
        for value in axis.labels[1:]:
            combos.append((f"{axis.name}={value}", axis.name, {**on, axis.name: value}))
    return combos


def _unreached(spec: SweepConfig, axes: list[Axis], combos: list[tuple[str, str, dict[str, str]]]) -> list[str]:
    """Conditional axis values that no point of the design takes (their condition holds nowhere): the axis would be
    listed as swept, and its values never run. One factor at a time, a conditional axis's baseline is the value it
    holds where it applies, not a point of its own."""
    taken = {(name, value) for _, _, labels in combos for name, value in labels.items()}
    problems = []
    for axis in (a for a in axes if a.when):
        needed = axis.labels if spec.design == "grid" or not any((axis.name, v) in taken for v in axis.labels) \
            else axis.labels[1:]
        missing = [v for v in needed if (axis.name, v) not in taken]
        if missing:
            when = ", ".join(f"{k}: {list(v)}" for k, v in axis.when.items())
            problems.append(f"axes.{axis.name}: {', '.join(missing)} would run at no point of the {spec.design} "
                            f"design: its condition ({when}) holds at no point; make it one the other axes meet")
    return problems


def _set_under_axes(spec: SweepConfig, axes: list[Axis]) -> list[str]:
    """A `set` (or `--set`) of a field an unconditional axis sets at every point never reaches a point: the axis's
    values replace it (the default sweep with `--set model.position=alibi` ran its RoPE baseline and said nothing).
    Under a conditional axis (`when:`) the set holds where the axis does not apply, and is kept."""
    stages = spec.stage_names
    swept = {route(path, stages): axis for axis in axes if not axis.when
             for fields in axis.values.values() for path in fields}
    problems = []
    for where, paths in _set_paths(spec).items():
        for path in paths:
            if (axis := swept.get(route(path, stages))) is not None:
                problems.append(f"{where}: {path}: axes.{axis.name} sets it at every point (its values "
                                f"{', '.join(axis.labels)}), so this value never runs; change the axis's values, or "
                                "drop the set")
    return problems


def _set_paths(spec: SweepConfig) -> dict[str, dict[str, None]]:
    """The fields the spec's `set` (or each stage's `set`) assigns, as axis paths: a value set there must reach the
    trained model as an axis value must (a fine-tuning stage's `model.norm` under init_from would not), or the spec
    would state a setting that never ran."""
    if spec.stage_names:
        return {f"stages.{name}.set": {f"{name}.{key}": None for key in (stage.get("set") or {})}
                for name, stage in spec.stages.items() if stage.get("set")}
    return {"set": {str(key): None for key in spec.set if key != "name"}} if spec.set else {}


def _shared_fields(by_axis: dict[str, dict[str, Any]], by_name: dict[str, Axis], stages: list[str]) -> list[str]:
    """Axes of one point (`by_axis`, in the order their assignments are merged) that set the same field: the later
    one's value replaces the earlier's, so the earlier axis's label would name a value that never ran. Allowed only
    where the later axis is conditional on the earlier (`window` refining `span: local`): it applies exactly where
    the earlier holds the value it refines. Axes whose conditions keep them apart never share a point."""
    problems, names = [], list(by_axis)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            # one field however spelled: in a study in stages `model.nsp` is `pretrain.model.nsp` (route)
            fields = {route(f, stages): f for f in by_axis[second]}
            shared = sorted(f for f in by_axis[first] if route(f, stages) in fields)
            if shared and first not in by_name[second].when:
                problems.append(f"axes.{first} and axes.{second} both set {', '.join(shared)}, and a point combines "
                                f"them: {second}'s value would replace {first}'s, so {first}'s label would not be what "
                                f"ran; make them one axis of named variants, or make {second} conditional on {first} "
                                f"(`when: {{{first}: ...}}`)")
            elif shared:
                problems += _collapsed_refinement(by_name[first], by_name[second], shared)
    return problems


def _collapsed_refinement(first: Axis, second: Axis, shared: list[str]) -> list[str]:
    """A conditional axis that refines several values of the axis it names, values that differ in the field it sets
    (`window` when `span: [global, local]`): its value replaces theirs, so they would train one model under
    different labels (the "global" points with a window)."""
    refined = [label for label in second.when[first.name] if label in first.values]
    out = []
    for field in shared:
        given = {label: first.values[label].get(field) for label in refined}
        if len({repr(v) for v in given.values()}) > 1:
            out.append(f"axes.{second.name} refines axes.{first.name} where it is {', '.join(refined)}, which set "
                       f"{field} differently ({', '.join(f'{k}: {label_of(v)}' for k, v in given.items())}): "
                       f"{second.name}'s value replaces them all, so those points would train one model under "
                       f"different labels; condition {second.name} on the values that share its meaning")
    return out


def _point_problems(cfg: ExperimentConfig | PipelineConfig) -> list[str]:
    stages = cfg.stages.items() if isinstance(cfg, PipelineConfig) else [(None, cfg)]
    return [f"{name + '.' if name else ''}train.precision: auto resolves on each machine, and a sweep's workers may "
            "differ: name it (32-true, bf16-mixed, ...)" for name, stage in stages if stage.train.precision == "auto"]


def expand(spec: SweepConfig, root: str | Path = ".") -> Plan:
    """Every point of the spec with its validated config; invalid points and the axes that would not reach the
    trained model are collected (`check` raises them), not raised here."""
    from study.run.pipeline import stage_name_problems
    from study.sweep import reach

    axes = spec.parsed_axes()
    by_name = {a.name: a for a in axes}
    bases = base_configs(spec, Path(root))
    plan = Plan(spec=spec, axes=axes, points=[])
    seen: dict[str, str] = {}
    tune_refused: dict[str, list[str]] = {}  # a tune range the config refuses: said once, naming its points
    combos = _combos(spec, axes)
    plan.refused += _unreached(spec, axes, combos) + _set_under_axes(spec, axes)
    for label, varied, labels in combos:
        # a rule's values compared as labels: `{tie: false}` is the label 'false', never str(False)
        if any(all(labels.get(k) == label_of(v) for k, v in rule.items()) for rule in spec.exclude):
            plan.excluded.append(label)
            continue
        by_axis = {name: by_name[name].values[value] for name, value in labels.items() if value != NOT_APPLICABLE}
        for problem in _shared_fields(by_axis, by_name, spec.stage_names):
            if problem not in plan.refused:
                plan.refused.append(problem)
        assignments = {k: v for fields in by_axis.values() for k, v in fields.items()}
        try:
            cfg = build_config(spec, bases, assignments)
        except ConfigError as err:
            plan.invalid.append((label, err.problems))
            continue
        if problems := _point_problems(cfg):
            plan.invalid.append((label, problems))
            continue
        if isinstance(cfg, PipelineConfig):  # the same stages at every point: said once
            plan.refused += [p for p in stage_name_problems(cfg) if p not in plan.refused]
        if spec.tune:
            by_axis["tune"] = {spec.tune["field"]: None}
            for problem in _tune_range_problems(spec, bases, assignments):
                tune_refused.setdefault(problem, []).append(label)
        checked = {f"axes.{k}" if k != "tune" else "tune.field": v for k, v in by_axis.items()}
        for problem in reach.reach_problems(spec, cfg, checked, _set_paths(spec)):
            if problem not in plan.refused:
                plan.refused.append(problem)
        digest, same_run = content_hash(cfg), same_run_hash(cfg)
        if same_run in seen:  # e.g. a variant that equals the baseline, or spells out what it leaves unset
            plan.duplicates.append((label, seen[same_run]))
            continue
        seen[same_run] = label
        cfg = cfg.replace(name=f"point-{digest}")  # not the sweep: two sweeps share the run
        plan.points.append(Point(point=digest, label=label, varied=varied, axes=labels, config=cfg))
    plan.refused += [f"{problem} (at {', '.join(names)})" for problem, names in tune_refused.items()]
    if spec.design == "ofat" and "baseline" in plan.excluded and plan.points:  # (none left: `check` says so)
        plan.refused.append("exclude: a rule removes the baseline, which every one-factor-at-a-time point is compared "
                            "with; exclude the other points it names, or make the design a grid")
    if plan.points:
        _objective(plan)
    return plan


def _tune_range_problems(spec: SweepConfig, bases: dict[str | None, dict[str, Any]],
                         assignments: dict[str, Any]) -> list[str]:
    """The point's config with the tuned field at each end of its range must be valid: TPE proposes values between
    them, and a value the config refuses would fail only once a tuning trial starts, after other training."""
    tune, problems = spec.tune_settings, []
    for end in ("low", "high"):
        try:
            build_config(spec, bases, {**assignments, tune["field"]: tune[end]})
        except ConfigError as err:
            problems.append(f"tune.{end}: {tune['field']}={tune[end]!r} makes the config invalid: "
                            + "; ".join(err.problems))
    return problems


def _tune_stage_problem(spec: SweepConfig, metric: str) -> str | None:
    """In a study in stages, the tuned field must be able to move the objective: it belongs to the objective's stage
    or to one that stage starts from. A later stage's (or a sibling's) field leaves every tuning trial the same run
    of the objective's stage (the one at tune.seed), so the choice would be a tie-break, not a tuning."""
    from study.sweep.reach import objective_stage

    stages = spec.stage_names
    tuned = route(spec.tune["field"], stages)[0]
    target = objective_stage(metric, stages)
    ancestry = [target]
    while (parent := (spec.stages[ancestry[-1]] or {}).get("init_from")) is not None:
        ancestry.append(parent)
    if tuned in ancestry:
        return None
    return (f"tune.field: {spec.tune['field']} is the {tuned} stage's, and the objective {metric} is measured in "
            f"the {target} stage, which does not start from it: every tuning value would share one {target} run, "
            f"so the objective could not tell them apart; tune a field of {' or '.join(reversed(ancestry))}, or "
            f"rank by a metric of the {tuned} stage")


def _tune_split_problem(plan: Plan) -> str | None:
    """Tuning chooses each point's tuned value by the objective, and the point's seeds are then scored by it: an
    objective measured on a test split would choose by the test set it reports on (a separate tuning seed does not
    help, the test set is shared), so the choice would flatter the results. Such an objective is refused; the task
    declares which split each metric is measured on (`MetricSpec.split`), so the message names what to use instead."""
    from study.sweep.reach import stage_config, stage_metric
    from study.tasks import family

    metric, stages = plan.objective["metric"], plan.spec.stage_names
    stage, name = stage_metric(metric, stages)
    cfg = stage_config(plan.points[0].config, stage)
    task = family(cfg.task.name)
    declared = task.metric(name)
    if declared is None or declared.split_of(name) != "test":
        return None
    prefix = f"{stage}." if stage in stages[:-1] else ""
    instead = [prefix + m for m in task.objectives_on("valid") if task.unwritten_metric(cfg, m) is None]
    if instead:
        use = (f"tune on a validation metric task {task.name!r} declares: objective: {{metric: {instead[0]}}}"
               + (f" (or {', '.join(instead[1:])})" if instead[1:] else ""))
    else:
        use = f"task {task.name!r} declares no validation metric to tune on; drop tune"
    return (f"objective: {metric} is measured on the test split (declared by task {task.name!r}), and tune would "
            f"choose {plan.spec.tune['field']} by it: the seeds are then scored on that same test set, so the choice "
            f"would flatter them; {use}")


def _objective_at_every_point(plan: Plan) -> tuple[dict[str, Any], list[str]]:
    """The objective as the first point's task declares it, and what is wrong with it at any point: a metric that
    some points never write (`valid_ppl_at_2x` where an axis drops 2 from task.eval_lengths) would leave them
    unranked, and one declared otherwise at some points (another task) would rank them on another scale."""
    from study.sweep import reach

    objective: dict[str, Any] = {}
    problems: dict[str, list[str]] = {}
    declared: dict[tuple, list[str]] = {}
    for p in plan.points:
        resolved, problem = reach.objective(plan.spec, p.config)
        objective = objective or resolved
        if problem is not None:
            problems.setdefault(problem, []).append(p.label)
        else:
            declared.setdefault(tuple(sorted(resolved.items())), []).append(p.label)
    out = [problem if len(labels) == len(plan.points) else f"{problem} (at {', '.join(labels)})"
           for problem, labels in problems.items()]
    if len(declared) > 1:
        out.append(f"objective: {objective.get('metric')} is declared differently at different points: " + "; ".join(
            f"{d['direction']} ({d.get('scale')}, task {d['task']!r}) at {', '.join(labels)}"
            for d, labels in ((dict(k), v) for k, v in declared.items())))
    elif not problems and (problem := _defined_differently(plan, objective["metric"])):
        out.append(problem)
    return objective, out


def _defined_differently(plan: Plan, metric: str) -> str | None:
    """Why `metric` cannot rank the points: the fields that decide what it measures (a per-token loss's tokenizer,
    BLEU's casing) differ between them. None when they agree at every point."""
    from study.sweep import reach

    definitions = {p.label: reach.objective_definition(plan.spec, p.config, metric) for p in plan.points}
    fields = {k for d in definitions.values() for k in d}
    differ = [k for k in sorted(fields) if len({repr(d.get(k)) for d in definitions.values()}) > 1]
    if not differ:
        return None
    by_value: dict[str, list[str]] = {}
    for label, definition in definitions.items():  # (the fields that differ; those alike would only hide them)
        by_value.setdefault(", ".join(f"{k}={definition.get(k)!r}" for k in differ), []).append(label)
    return (f"objective: {metric} measures something else where " + "; ".join(
        f"{value} (at {', '.join(labels)})" for value, labels in by_value.items()) + ": one name, different metrics "
        "(a loss per token of another tokenizer, BLEU of another casing), which cannot rank the points; keep those "
        "fields the same, or rank by a metric they do not decide")


def _objective(plan: Plan) -> None:
    from study.sweep import reach

    plan.objective, problems = _objective_at_every_point(plan)
    plan.refused += [problem for problem in problems if problem not in plan.refused]
    problem = problems[0] if problems else None
    tune = plan.spec.tune_settings if plan.spec.tune else {}
    if tune and tune["pruner"] != "none" and plan.objective.get("direction") != "minimize":
        # the pruner compares the validation loss the trials log as they train: a loss, minimised
        plan.refused.append("tune.pruner: pruning judges the logged validation loss, so it needs an objective "
                            f"that is minimised; {plan.objective.get('metric')} is maximised")
    if tune and problem is None and (split_problem := _tune_split_problem(plan)) is not None:
        plan.refused.append(split_problem)
    if tune and problem is None and plan.points:
        field, metric, stages = plan.spec.tune["field"], plan.objective["metric"], plan.spec.stage_names
        stage, bare = route(field, stages)  # (a stage's field decides the metric of that stage's run only)
        if stage == reach.objective_stage(metric, stages) and \
                bare in reach.objective_definition(plan.spec, plan.points[0].config, metric):
            plan.refused.append(f"tune.field: {field} decides what the objective {metric} measures (a loss per token "
                                "of another tokenizer, BLEU of another casing): its trials could not be ranked by it")
    if tune and plan.spec.stages and problem is None:
        if (stage_problem := _tune_stage_problem(plan.spec, plan.objective["metric"])) is not None:
            plan.refused.append(stage_problem)
    for p in plan.points:
        plan.tasks.update(reach.contracts(p.config))


def check_parts(plan: Plan, data_dir: str | Path | None) -> None:
    """Raise SweepSpecError where an axis value of a suite's training field is not what every part runs (GLUE caps
    each task's steps and warm-up by its data; `reach.part_problems`). Separate from `check`, as it reads the data:
    `study sweep` calls it with the workers' data folder before anything runs."""
    from study.sweep import reach

    by_name = {a.name: a for a in plan.axes}
    for point in plan.points:
        by_axis = {f"axes.{name}": by_name[name].values[value] for name, value in point.axes.items()
                   if value != NOT_APPLICABLE}
        for problem in reach.part_problems(plan.spec, point.config, by_axis, data_dir):
            if problem not in plan.refused:
                plan.refused.append(problem)
    check(plan)


def check(plan: Plan) -> None:
    """Raise SweepSpecError listing every invalid point and every refused axis: a spec with errors runs nothing."""
    lines = []
    if plan.invalid:
        lines.append(f"{len(plan.invalid)} invalid point(s):")
        lines += [f"  {label}:\n" + "\n".join(f"    - {p}" for p in problems) for label, problems in plan.invalid]
    if plan.refused:
        lines.append("refused (a swept value must reach the trained model, and the objective must be a metric the "
                     "task declares):")
        lines += [f"  - {p}" for p in plan.refused]
    if lines:
        raise SweepSpecError(f"sweep {plan.spec.name!r}: nothing was run\n" + "\n".join(lines))
    if not plan.points:
        raise SweepSpecError(f"sweep {plan.spec.name!r}: the design has no points (every point excluded?)")


def describe(plan: Plan, cost: dict[str, Any] | None = None, overridden: bool = False) -> str:
    """The plan as printed before anything runs."""
    from study.sweep.estimate import si

    s = plan.spec
    objective = plan.objective or {}
    lines = [f"sweep {s.name!r}: design={s.design}, {len(plan.points)} point(s) x {len(s.seeds)} seed(s) "
             f"= {len(plan.trials)} trial(s); objective {objective.get('direction')} {objective.get('metric')}"
             + (f" ({objective['scale']}, declared by task {objective['task']!r})" if "scale" in objective else "")]
    if s.stages:
        lines.append("  stages: " + " -> ".join(s.stage_names) + f" (seeds are the {s.stage_names[0]} stage's)")
    if s.tune:
        t = s.tune_settings
        lines.append(f"  tuning mode: before its seeds, each point searches {t['field']} in [{t['low']}, {t['high']}]"
                     f"{' (log scale)' if t['log'] else ''} with TPE over {t['trials']} trials (seed {t['seed']}, "
                     f"pruner {t['pruner']}): {len(plan.points) * t['trials']} more trial(s)")
    for a in plan.axes:
        cond = f" (only where {', '.join(f'{k} in {list(v)}' for k, v in a.when.items())})" if a.when else ""
        lines.append(f"  axis {a.name}: {', '.join(a.labels)}{cond}")
    for p in plan.points:
        lines.append(f"  point {p.point}  {p.label}")
    for label in plan.excluded:
        lines.append(f"  excluded: {label}")
    for label, same in plan.duplicates:
        lines.append(f"  skipped {label}: the same config as {same}")
    if cost and cost["estimated_wall_s"] is None:
        lines.append(f"  cost: {si(cost['train_flops'])}FLOP of training; time not estimated: {cost['not_timed']} "
                     "(give --peak-flops, the matmul rate of the machine that will run them)")
        lines.append("  FLOPs: " + basis_sentence(cost))
    elif cost:
        hours = cost["estimated_wall_s"] / 3600
        lines.append(f"  cost: {si(cost['train_flops'])}FLOP of training; at {si(cost['matmul_flops_per_s'])}FLOP/s "
                     f"matmul x {cost['assumed_utilisation']:.0%} utilisation (an assumption) and "
                     f"{cost['workers']} worker(s): about "
                     + (f"{hours * 60:.0f} min" if hours < 2 else f"{hours:.1f} h"))
        lines.append("  FLOPs and time: " + basis_sentence(cost))
        if cost.get("emulated_bf16"):  # (a study in stages names each stage's precision)
            float32 = " ".join(f"--set {p}train.precision=32-true" for p in [f"{n}." for n in s.stage_names] or [""])
            lines.append(f"  WARNING: {cost['emulated_bf16']}, and the time above assumes the float32 rate: on this "
                         "machine the trials would take far longer, or train far fewer steps within "
                         "train.max_time_s. Run them where bf16 is native (a Zen 4 or Sapphire Rapids CPU, a GPU: "
                         f"--peak-flops gives its rate), or {float32} --results DIR (a float32 sweep is another "
                         "study than a committed bf16 one: its own folder)")
    if s.cost_note:  # (`overridden`: --set changed the plan, which the spec's note does not describe)
        lines.append(f"  documented cost{' of the spec as written, before --set' if overridden else ''}: "
                     f"{s.cost_note}")
    return "\n".join(lines)
