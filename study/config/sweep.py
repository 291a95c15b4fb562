"""`SweepConfig`: a base experiment, the axes to vary, the design and the seeds.

YAML form (see experiments/ablation_default.yaml):

    name: default
    base: shakespeare_char_llama2.yaml        # an experiment YAML, relative to this file
    set: {train.max_steps: 400}                # overrides applied to the base
    design: ofat                               # one-factor-at-a-time from the baseline, or grid
    axes:
      model.norm_position: [pre, post]         # a config field and its values; the first is the baseline
      attention:                               # a named axis whose values set several fields
        mha: {model.n_kv_heads: 4}
        gqa: {model.n_kv_heads: 2}
        mqa: {model.n_kv_heads: 1}
      window:                                  # a conditional sub-grid: only where span=local
        field: model.window
        values: [16, 32]
        when: {span: local}
    seeds: [0, 1, 2]
    objective: {metric: valid_loss}            # a metric the task declares; default: the task's own objective

A study in stages (pretrain -> fine-tune; see experiments/sweeps/nsp_glue.yaml) names its stages instead of one
base; each trial runs them in order, a later stage starting from an earlier one's run directory:

    stages:
      pretrain: {base: ../wikitext2_bert_pretrain_nsp.yaml, set: {train.max_steps: 1000}}
      glue: {base: ../glue_finetune.yaml, init_from: pretrain}
    axes:
      model.nsp: [true, false]                 # model.*: the pretrained model, which every later stage fine-tunes
      glue.train.lr: [1.0e-4, 3.0e-4]          # STAGE.section.field: one stage's setting
    seeds: [0, 1, 2]                           # the first stage's seed (pretraining: the unit that varies)

Every axis value becomes a label (its YAML scalar, or the variant's name) so results
tables and reports can name it; `Axis.values` maps label -> field assignments.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from study.config.base import Config, Problems
from study.record import DIRECTIONS

DESIGNS = ("ofat", "grid")
SECTIONS = ("model", "task", "train")
PRUNERS = ("none", "median")
# the tuning trials train with a seed outside the compared ones, so that picking the best setting
# on them does not flatter the seeds the report compares
TUNE_DEFAULTS = {"log": True, "trials": 8, "seed": 1000, "pruner": "none", "sampler_seed": 0}
NOT_APPLICABLE = "n/a"  # the label of a conditional axis at points where its condition does not hold


@dataclass(frozen=True)
class Axis:
    """One design axis: ordered labels -> the config fields each sets; `when` makes it conditional."""

    name: str
    values: dict[str, dict[str, Any]]
    when: dict[str, tuple[str, ...]]

    @property
    def labels(self) -> list[str]:
        return list(self.values)

    @property
    def baseline(self) -> str:
        return self.labels[0]


def label_of(value: Any) -> str:
    """How a YAML scalar value is written in labels, tables and directory names."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def route(path: str, stages: list[str]) -> tuple[str | None, str]:
    """(stage, section.field) of an axis or `set` path: in a study in stages `model.*` is the first stage's (the
    model every later stage starts from) and other fields name their stage (`glue.train.lr`); else (None, path)."""
    if not stages:
        return None, path
    head, _, rest = path.partition(".")
    if head in stages:
        return head, rest
    return (stages[0], path) if head == "model" else (None, path)


def _known_field(path: str, stages: list[str] = ()) -> str | None:
    """None if `path` names a config field (`section.field`; in a study in stages `model.field` or
    `STAGE.section.field`), else what is wrong with it."""
    from study.config.model import ModelConfig
    from study.config.task import TaskConfig
    from study.config.train import TrainConfig

    stages = list(stages)
    stage, path = route(path, stages)
    if stages and stage is None:
        return (f"{path!r}: in a study in stages, name the stage ({', '.join(f'{s}.{path}' for s in stages)}); "
                "model.* fields are the first stage's")
    section, _, name = path.partition(".")
    classes = {"model": ModelConfig, "task": TaskConfig, "train": TrainConfig}
    if section not in classes or not name:
        return f"{path!r} is not a config field; axes set fields like model.norm, task.seq_len or train.lr"
    names = {f.name for f in dataclasses.fields(classes[section])} | ({"preset"} if section == "model" else set())
    if name not in names:
        return f"{path!r} is not a field of {section}; valid: {sorted(names)}"
    if section == "train" and name == "seed":
        return "train.seed is not an axis: list the seeds under `seeds:`"
    return None


def _axis_field(path: str, stages: list[str] = ()) -> str | None:
    """None if an axis may set `path`, else why not: a config field (`_known_field`), and not a preset, whose
    fields the base's own model fields override (the axis would not say what ran)."""
    problem = _known_field(path, stages)
    if problem is None and route(path, list(stages))[1] == "model.preset":
        from study.config.presets import PRESETS

        return (f"{path!r}: a preset is not an axis value (it sets many model fields, and the base's own model fields "
                "override it, so the label would not say what ran); vary the fields that differ as named variants, "
                "e.g. gpt2: {model.norm: layernorm, model.position: learned, model.activation: gelu_tanh}; "
                f"each preset's fields: study/config/presets.py ({', '.join(sorted(PRESETS))})")
    return problem


def _tune_field(path: str, stages: list[str]) -> str | None:
    """None if tuning mode may search `path`, else why not: a field an axis could set (`_axis_field`) that holds a
    float, since TPE proposes floats (an integer field would be refused by the config only once a trial starts)."""
    import typing

    from study.config.base import _strip_optional
    from study.config.model import ModelConfig
    from study.config.task import TaskConfig
    from study.config.train import TrainConfig

    problem = _axis_field(path, stages)
    if problem is not None:
        return problem
    section, _, name = route(path, list(stages))[1].partition(".")
    kind = _strip_optional(typing.get_type_hints({"model": ModelConfig, "task": TaskConfig,
                                                  "train": TrainConfig}[section])[name])
    if kind is not float:
        return (f"{path!r} holds {getattr(kind, '__name__', kind)}, and TPE proposes real numbers: tune a float "
                "field (train.lr, train.weight_decay, model.dropout, ...); compare other values as an axis")
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_axis(name: str, raw: Any, p: Problems, stages: list[str] = ()) -> Axis | None:
    """Normalise the three spellings of an axis (see the module docstring)."""
    where = f"axes.{name}"
    when_raw: dict[str, Any] = {}
    if "." in name and isinstance(raw, list):  # model.norm: [layernorm, rmsnorm]; glue.train.lr: [...]
        field_path, values_raw, name = name, raw, name.rsplit(".", 1)[1]
    elif isinstance(raw, dict) and ("values" in raw or "field" in raw):
        unknown = sorted(set(raw) - {"field", "values", "when"})
        if unknown:
            p.add(where, f"unknown keys {unknown}; an axis has field, values and when")
            return None
        field_path, values_raw, when_raw = raw.get("field"), raw.get("values"), raw.get("when") or {}
    elif isinstance(raw, dict):  # named variants
        field_path, values_raw = None, raw
    else:
        p.add(where, "must be a list of values (with a field path as its name), a mapping of named variants, "
                     "or {field, values, when}")
        return None

    values: dict[str, dict[str, Any]] = {}
    if field_path is not None:
        problem = _axis_field(str(field_path), stages)
        if problem:
            p.add(where, problem)
            return None
        if not isinstance(values_raw, list):
            p.add(where, f"values must be a list, got {values_raw!r}")
            return None
        for v in values_raw:
            values[label_of(v)] = {str(field_path): v}
    else:
        if not isinstance(values_raw, dict):  # (a list: {values: [16, 32]} without the field they set)
            p.add(where, f"has values {values_raw!r} but no field: add field: <section.name>, e.g. model.window"
                  if isinstance(values_raw, list) else
                  f"values must be a mapping of variant name -> fields, got {values_raw!r}")
            return None
        for label, assignments in values_raw.items():
            if not isinstance(assignments, dict) or not assignments:
                p.add(f"{where}.{label}", "must map config fields to values, e.g. {model.n_kv_heads: 1}")
                return None
            for path in assignments:
                problem = _axis_field(str(path), stages)
                if problem:
                    p.add(f"{where}.{label}", problem)
                    return None
            values[label_of(label)] = dict(assignments)
    if not values:
        p.add(where, "has no values (an empty axis makes an empty grid)")
        return None
    if len(values) != len(values_raw):
        p.add(where, "lists a value twice")
        return None
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        p.add(where, f"axis name {name!r}: use letters, digits and _ only")
        return None
    if not isinstance(when_raw, dict):
        p.add(f"{where}.when", "must map other axes to the value(s) where this axis applies")
        return None
    when = {str(k): tuple(label_of(x) for x in (v if isinstance(v, list) else [v])) for k, v in when_raw.items()}
    return Axis(name=name, values=values, when=when)


def _condition_cycles(axes: list[Axis]) -> dict[str, list[str]]:
    """Axis name -> a cycle of conditions through it (`a -> b -> a`), said once per cycle."""
    when = {a.name: [o for o in a.when if o != a.name] for a in axes}  # (naming itself is refused on its own)

    def walk(path: list[str]) -> list[str] | None:
        for other in when.get(path[-1], []):
            if other == path[0]:
                return [*path, other]
            if other not in path and (found := walk([*path, other])):
                return found
        return None

    cycles: dict[str, list[str]] = {}
    for start in when:
        cycle = walk([start])
        if cycle and not any(set(cycle) == set(c) for c in cycles.values()):
            cycles[start] = cycle
    return cycles


@dataclass(frozen=True)
class SweepConfig(Config):
    name: str = "sweep"
    description: str = ""
    base: Any = None  # path to an experiment YAML (relative to the spec) or an inline experiment mapping
    set: dict = field(default_factory=dict)  # `section.field: value` overrides applied to the base
    # a study in stages instead of one base: stage name -> {base, set, init_from: an earlier stage}, in order
    stages: dict = field(default_factory=dict)
    design: str = "ofat"
    axes: dict = field(default_factory=dict)
    exclude: tuple = ()  # mappings {axis: label, ...}; points matching one are dropped (grid designs)
    seeds: tuple[int, ...] = (0, 1, 2)
    # {metric: NAME}: a metric the task (a study in stages: its last stage's task, or STAGE.NAME) declares; its
    # direction comes from the declaration (a direction given here must agree). Empty: the task's default objective
    objective: dict = field(default_factory=dict)
    max_retries: int = 2  # a failed or lost trial runs at most 1 + max_retries times per invocation
    heartbeat_s: int = 10  # a running trial's worker proves it is alive this often
    grace_s: int = 60  # ...and is declared lost (its trial re-queued) after this long without a heartbeat
    workers: int = 1  # local worker processes (`--workers` overrides)
    cost_note: str = ""  # the expected cost as documented for the spec (shown in the plan)
    # Optional tuning mode: before its seeds run, each point searches one float field (usually
    # train.lr) with TPE, so variants are compared at their own best setting, e.g.
    #   tune: {field: train.lr, low: 3.0e-4, high: 1.0e-2, log: true, trials: 8}
    # Pruning (pruner: median) stops unpromising tuning trials early; it is off by default, and
    # never applies to the seeds that are compared.
    tune: dict = field(default_factory=dict)

    def _validate(self, p: Problems) -> None:
        p.check(bool(re.fullmatch(r"(?!\.+$)[A-Za-z0-9_.-]+", self.name)), "name",
                f"{self.name!r}: use letters, digits and _ . - only, not dots alone (it names a directory and a "
                "study)")
        self._validate_base(p)
        p.choice("design", self.design, DESIGNS)
        p.check(isinstance(self.set, dict), "set", "must map section.field to a value")
        for key in (self.set if isinstance(self.set, dict) else {}):
            if key != "name":
                problem = _known_field(str(key))
                if problem:
                    p.add(f"set.{key}", problem)
        self._validate_stages(p)
        p.check(isinstance(self.axes, dict) and len(self.axes) > 0, "axes", "must list at least one axis")
        p.check(len(self.seeds) >= 1, "seeds", "must list at least one seed")
        p.check(len(set(self.seeds)) == len(self.seeds), "seeds", f"lists a seed twice: {list(self.seeds)}")
        p.check(all(s >= 0 for s in self.seeds), "seeds", "must be >= 0")
        if isinstance(self.objective, dict):
            unknown = sorted(set(self.objective) - {"metric", "direction"})
            p.check(not unknown, "objective", f"unknown keys {unknown}; valid: metric, direction")
            p.check(self.objective.get("metric") is None or isinstance(self.objective.get("metric"), str),
                    "objective.metric", "must name a metric the task declares, e.g. valid_loss, bleu, glue_score")
            if self.objective.get("direction") is not None:
                p.choice("objective.direction", self.objective["direction"], DIRECTIONS)
        else:
            p.add("objective", "must be {metric: NAME} (the direction is the metric's declared one)")
        p.check(self.max_retries >= 0, "max_retries", f"must be >= 0, got {self.max_retries}")
        p.check(self.heartbeat_s >= 1, "heartbeat_s", f"must be >= 1, got {self.heartbeat_s}")
        p.check(self.grace_s > 2 * self.heartbeat_s, "grace_s",
                f"must exceed twice heartbeat_s={self.heartbeat_s}, got {self.grace_s}")
        p.check(self.workers >= 1, "workers", f"must be >= 1, got {self.workers}")
        self._validate_tune(p)
        axes = self.parsed_axes(p) if isinstance(self.axes, dict) else []
        names = [a.name for a in axes]
        for axis in axes:
            for other, labels in axis.when.items():
                if other not in names or other == axis.name:
                    p.add(f"axes.{axis.name}.when", f"{other!r} is not another axis; axes: {names}")
                    continue
                known = next(a for a in axes if a.name == other).labels
                for label in labels:
                    p.check(label in known, f"axes.{axis.name}.when",
                            f"{other}={label!r} is not a value of axis {other!r}; values: {known}")
        for axis_name, cycle in _condition_cycles(axes).items():
            p.add(f"axes.{axis_name}.when", f"the conditions form a cycle ({' -> '.join(cycle)}): each axis applies "
                                            "only where another already does, so no point would take their values")
        for i, rule in enumerate(self.exclude):
            if not isinstance(rule, dict) or not rule:
                p.add(f"exclude[{i}]", "must map axes to values, e.g. {position: learned, span: local}")
                continue
            for axis_name, value in rule.items():
                match = [a for a in axes if a.name == axis_name]
                if not match:
                    p.add(f"exclude[{i}]", f"{axis_name!r} is not an axis; axes: {names}")
                elif label_of(value) not in match[0].labels:
                    p.add(f"exclude[{i}]", f"{axis_name}={value!r} is not a value of that axis; values: {match[0].labels}")

    def _validate_base(self, p: Problems) -> None:
        p.check(self.base is None or isinstance(self.base, (str, dict)), "base",
                "must be the path of an experiment YAML or an inline {model, task, train} mapping")
        # without it every point would silently train the defaults (a Tiny Shakespeare decoder)
        p.check(self.base not in (None, "") or bool(self.stages), "base",
                "missing: name the experiment every point starts from (an experiment YAML, relative to the spec, or "
                "an inline {model, task, train} mapping), or give stages")

    def _validate_tune(self, p: Problems) -> None:
        t = self.tune
        if not t:
            return
        if not isinstance(t, dict):
            p.add("tune", "must be {field, low, high, log, trials, seed, pruner} or empty")
            return
        unknown = sorted(set(t) - set(TUNE_DEFAULTS) - {"field", "low", "high"})
        p.check(not unknown, "tune", f"unknown keys {unknown}; valid: field, low, high, {', '.join(TUNE_DEFAULTS)}")
        problem = _tune_field(str(t.get("field")), self.stage_names)
        p.check(problem is None, "tune.field", problem or "")
        s = self.tune_settings
        # YAML reads `log: "false"` as a string, which is true: only a boolean says which scale was searched
        p.check(isinstance(s["log"], bool), "tune.log", f"must be true or false, got {s['log']!r}")
        low, high = t.get("low"), t.get("high")
        if p.check(_is_number(low) and _is_number(high) and low < high, "tune.low",
                   f"tune needs numeric low < high, got low={low!r}, high={high!r}"):
            p.check(s["log"] is not True or low > 0, "tune.low", "a log-scale search needs low > 0")
        trials_ok = p.check(_is_int(s["trials"]) and s["trials"] >= 2, "tune.trials",
                            f"must be an integer >= 2, got {s['trials']!r}")
        p.choice("tune.pruner", s["pruner"], PRUNERS)  # (its objective's direction is checked with the plan)
        p.check(_is_int(s["seed"]) and s["seed"] >= 0 and s["seed"] not in self.seeds, "tune.seed",
                f"must be an integer >= 0 outside seeds={list(self.seeds)} (picking the best setting on a compared "
                f"seed would flatter it), got {s['seed']!r}")
        # TPE is seeded sampler_seed * 10007 + the tuning trial's index, and numpy takes seeds below 2**32
        top = (2**32 - 1 - (s["trials"] - 1 if trials_ok else 0)) // 10007
        p.check(_is_int(s["sampler_seed"]) and 0 <= s["sampler_seed"] <= top, "tune.sampler_seed",
                f"must be an integer from 0 to {top}, got {s['sampler_seed']!r}")
        # one field however spelled: in a study in stages `model.dropout` is `pretrain.model.dropout` (route)
        stages = self.stage_names
        axes = {route(f, stages): (a.name, f) for a in self.parsed_axes() for v in a.values.values() for f in v}
        if (both := axes.get(route(str(t.get("field")), stages))) is not None:
            p.add("tune.field", f"{t.get('field')} is the field axes.{both[0]} sets ({both[1]}): the tuned value "
                                "would replace the axis's; tune a field the axes do not set")

    def _validate_stages(self, p: Problems) -> None:
        if not self.stages:
            return
        if not isinstance(self.stages, dict) or len(self.stages) < 2:
            p.add("stages", "must map at least two stage names to {base, set, init_from}")
            return
        p.check(self.base is None and not self.set, "stages",
                "a study in stages gives each stage its base and set; remove the top-level base and set")
        names = list(self.stages)
        for i, (name, stage) in enumerate(self.stages.items()):
            where = f"stages.{name}"
            if not re.fullmatch(r"[A-Za-z0-9_]+", str(name)) or name in SECTIONS:
                p.add(where, "a stage name uses letters, digits and _ and is not model, task or train")
            if not isinstance(stage, dict):
                p.add(where, "must be {base: EXPERIMENT.yaml, set: {...}, init_from: EARLIER_STAGE}")
                continue
            unknown = sorted(set(stage) - {"base", "set", "init_from"})
            p.check(not unknown, where, f"unknown keys {unknown}; a stage has base, set and init_from")
            p.check(stage.get("base") is not None, f"{where}.base", "each stage needs its base experiment")
            p.check(isinstance(stage.get("set", {}), dict), f"{where}.set", "must map section.field to a value")
            for key in stage.get("set") or {}:
                problem = _known_field(str(key))
                if problem:
                    p.add(f"{where}.set.{key}", problem)
            ref = stage.get("init_from")
            if i == 0:
                p.check(ref is None, f"{where}.init_from", "the first stage cannot start from another")
            else:
                p.check(ref in names[:i], f"{where}.init_from",
                        f"a later stage starts from an earlier one: one of {names[:i]}, got {ref!r}")

    @property
    def stage_names(self) -> list[str]:
        return list(self.stages) if isinstance(self.stages, dict) else []

    @property
    def tune_settings(self) -> dict[str, Any]:
        return {**TUNE_DEFAULTS, **(self.tune or {})}

    def parsed_axes(self, p: Problems | None = None) -> list[Axis]:
        p = p if p is not None else Problems()
        axes = [parse_axis(str(name), raw, p, self.stage_names) for name, raw in self.axes.items()]
        seen: dict[str, str] = {}  # axis name -> how the spec wrote it
        for written, a in zip(map(str, self.axes), axes):
            if a is None:
                continue
            # a field path's axis is named by its last part: pretrain.train.lr and glue.train.lr are both `lr`
            if a.name in seen:
                path = written if "." in written else seen[a.name]
                p.add(f"axes.{a.name}", f"two axes have this name ({seen[a.name]} and {written}); name them apart "
                                        f"with {{field: ..., values: [...]}}, e.g. {a.name}_2: {{field: {path}, "
                                        "values: [...]}")
            seen.setdefault(a.name, written)
        parsed = [a for a in axes if a is not None]
        return parsed
