"""Expand a sweep spec into points, validate every point, and estimate the cost.

A *point* is one complete experiment config (minus the seed); a *trial* is a
(point, seed) pair. Every point gets a content hash of its complete config, so the
same point in two sweeps is the same run directory (`results/runs/<hash>/seed-<k>`)
and is trained once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from study.config import Config, ConfigError, ExperimentConfig
from study.config.experiment import set_fields
from study.config.sweep import NOT_APPLICABLE, Axis, SweepConfig

# Throughput a training step reaches, as a fraction of the peak matmul rate, for the small
# models these sweeps train on a CPU (measured here: ~50% for the default sweep's trials); used only for
# the plan's time estimate, which says so.
ASSUMED_UTILISATION = 0.45
TRIAL_OVERHEAD_S = 15.0  # process start (import lightning ~5 s), data, final evaluation


class SweepSpecError(ValueError):
    """A sweep spec, or some of its points, is invalid; nothing has run."""


@dataclass(frozen=True)
class Point:
    point: str  # content hash
    label: str
    varied: str  # OFAT: the axis this point varies ('baseline' for the baseline); grid: 'grid'
    axes: dict[str, str]  # axis name -> value label
    config: ExperimentConfig

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

    @property
    def trials(self) -> list[tuple[Point, int]]:
        return [(p, s) for p in self.points for s in self.spec.seeds]

    def to_dict(self) -> dict[str, Any]:
        return {
            "sweep": self.spec.name,
            "design": self.spec.design,
            "objective": {"metric": self.spec.metric, "direction": self.spec.direction},
            "seeds": list(self.spec.seeds),
            "axes": {a.name: a.labels for a in self.axes},
            "points": [p.to_dict() for p in self.points],
            "excluded": self.excluded,
            "duplicates": [list(d) for d in self.duplicates],
            "spec": self.spec.to_dict(),
            "tune": self.spec.tune_settings if self.spec.tune else {},
        }


def point_hash(cfg: ExperimentConfig) -> str:
    """Content hash of everything that defines a point: the model, task and training config
    without the experiment name and the seed.

    Fields at their declared default are left out, so a release that adds a field (whose default keeps the old
    behaviour, as a new field's must) leaves every existing point's hash, and so its run directory, unchanged: a
    sweep resumed after an upgrade neither repeats its finished trials nor orphans them. The other side of that
    bargain: changing an existing field's default changes what those points mean, and needs a new field instead."""
    data = _without_defaults(cfg)
    data.pop("name", None)
    data.get("train", {}).pop("seed", None)
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _without_defaults(section: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, Config):
            out[f.name] = _without_defaults(value)
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


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[SweepConfig, Path]:
    """Read a sweep YAML; returns the spec and the folder its relative paths start from."""
    path = Path(path)
    if not path.is_file():
        raise SweepSpecError(f"sweep spec {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise SweepSpecError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise SweepSpecError(f"{path}: a sweep spec is a mapping (name, base, axes, seeds, ...)")
    for key, value in (overrides or {}).items():
        if key.split(".", 1)[0] in ("model", "task", "train"):  # `--set train.max_steps=50`: the base config
            data["set"] = {**(data.get("set") or {}), key: value}
        else:  # `--set seeds=[0]`: the spec's own fields
            data[key] = value
    try:
        return SweepConfig.from_dict(data), path.parent
    except ConfigError as err:
        raise SweepSpecError(f"{path}: {err}") from None


def _base_dict(spec: SweepConfig, root: Path) -> dict[str, Any]:
    if isinstance(spec.base, dict):
        data = dict(spec.base)
    elif spec.base:
        base_path = (root / spec.base) if not Path(spec.base).is_absolute() else Path(spec.base)
        if not base_path.is_file():
            raise SweepSpecError(f"base: experiment config {base_path} does not exist")
        data = yaml.safe_load(base_path.read_text()) or {}
    else:
        data = {}
    return set_fields(data, spec.set)


def _combos(spec: SweepConfig, axes: list[Axis]) -> list[tuple[str, str, dict[str, str]]]:
    """(label, varied, axis -> value label) for every point of the design, before validation."""
    plain = [a for a in axes if not a.when]
    conditional = [a for a in axes if a.when]

    def applies(axis: Axis, labels: dict[str, str]) -> bool:
        return all(labels.get(other) in allowed for other, allowed in axis.when.items())

    def with_conditionals(labels: dict[str, str], expand: bool) -> list[dict[str, str]]:
        """Fill the conditional axes: their baseline (or every value, for a grid) where they apply."""
        out = [dict(labels)]
        for axis in conditional:
            nxt = []
            for lab in out:
                if not applies(axis, lab):
                    nxt.append({**lab, axis.name: NOT_APPLICABLE})
                else:
                    nxt += [{**lab, axis.name: v} for v in (axis.labels if expand else [axis.baseline])]
            out = nxt
        return out

    if spec.design == "grid":
        combos = []
        for values in itertools.product(*[a.labels for a in plain]):
            for labels in with_conditionals(dict(zip([a.name for a in plain], values)), expand=True):
                name = ",".join(f"{k}={v}" for k, v in labels.items() if v != NOT_APPLICABLE)
                combos.append((name, "grid", labels))
        return combos

    # one factor at a time (Narang et al. 2021): the baseline, then each axis's other values
    baseline = {a.name: a.baseline for a in plain}
    combos = [("baseline", "baseline", with_conditionals(baseline, expand=False)[0])]
    for axis in plain:
        for value in axis.labels[1:]:
            combos.append((f"{axis.name}={value}", axis.name,
                           with_conditionals({**baseline, axis.name: value}, expand=False)[0]))
    for axis in conditional:
        # vary it where it applies: the baseline moved onto its condition (the first allowed value)
        on = {**baseline, **{other: allowed[0] for other, allowed in axis.when.items()}}
        for value in axis.labels[1:]:
            labels = {**with_conditionals(on, expand=False)[0], axis.name: value}
            combos.append((f"{axis.name}={value}", axis.name, labels))
    return combos


def expand(spec: SweepConfig, root: str | Path = ".") -> Plan:
    """Every point of the spec with its validated config; invalid points are collected, not raised."""
    axes = spec.parsed_axes()
    by_name = {a.name: a for a in axes}
    base = _base_dict(spec, Path(root))
    plan = Plan(spec=spec, axes=axes, points=[])
    seen: dict[str, str] = {}
    for label, varied, labels in _combos(spec, axes):
        if any(all(labels.get(k) == str(v) for k, v in rule.items()) for rule in spec.exclude):
            plan.excluded.append(label)
            continue
        assignments: dict[str, Any] = {}
        for name, value in labels.items():
            if value != NOT_APPLICABLE:
                assignments.update(by_name[name].values[value])
        # sweeps log to files: no progress bars (and no point hash that depends on one)
        data = set_fields(base, {**assignments, "train.progress_bar": False})
        try:
            cfg = ExperimentConfig.from_dict(data)
        except ConfigError as err:
            plan.invalid.append((label, err.problems))
            continue
        if cfg.train.precision == "auto":  # the seeds of a point share a run directory, whichever worker runs them
            plan.invalid.append((label, ["train.precision: auto resolves on each machine, and a sweep's workers may "
                                         "differ: name it (32-true, bf16-mixed, ...)"]))
            continue
        digest = point_hash(cfg)
        if digest in seen:  # e.g. a variant that equals the baseline
            plan.duplicates.append((label, seen[digest]))
            continue
        seen[digest] = label
        cfg = cfg.replace(name=f"point-{digest}")  # not the sweep: two sweeps share the run
        plan.points.append(Point(point=digest, label=label, varied=varied, axes=labels, config=cfg))
    return plan


def check(plan: Plan) -> None:
    """Raise SweepSpecError listing every invalid point: a spec with errors runs nothing."""
    if plan.invalid:
        lines = [f"  {label}:\n" + "\n".join(f"    - {p}" for p in problems) for label, problems in plan.invalid]
        raise SweepSpecError(f"sweep {plan.spec.name!r}: {len(plan.invalid)} invalid point(s); nothing was run\n"
                             + "\n".join(lines))
    if not plan.points:
        raise SweepSpecError(f"sweep {plan.spec.name!r}: the design has no points (every point excluded?)")


def matmul_rate_flops(threads: int = 1, seconds: float = 0.3) -> float:
    """This machine's float32 matmul rate (FLOP/s) with `threads` threads, measured in a fraction of a second."""
    import time

    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            a @ b
            count += 1
        return 2 * n**3 * count / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)


def _planning_vocab(cfg: ExperimentConfig) -> int:
    """The vocabulary the run will have: the task's tokenizer size when it sets one; char-level
    vocabularies are small (at most a few hundred symbols); otherwise the model config's."""
    if cfg.task.vocab_size:
        return cfg.task.vocab_size
    return 256 if cfg.task.tokenizer == "char" else cfg.model.vocab_size


def estimate(plan: Plan, rate_flops: float | None = None, workers: int = 1, threads: int = 1) -> dict[str, Any]:
    """Training FLOPs of the whole plan (from the accounting module) and a rough wall-clock time:
    each trial's FLOPs at the matmul rate one trial's threads reach, times an assumed utilisation."""
    from study.model.accounting import flops_per_token
    from study.tasks.registry import predicted_fraction

    per_point = []
    for p in plan.points:
        c = p.config
        tokens_per_step = c.train.batch_size * c.train.accumulate * c.task.seq_len
        model = c.model.replace(vocab_size=_planning_vocab(c))
        flops = flops_per_token(model, c.task.seq_len, predicted_fraction=predicted_fraction(c))
        flops *= tokens_per_step * c.train.max_steps
        per_point.append(flops)
    runs_per_point = len(plan.spec.seeds) + (plan.spec.tune_settings["trials"] if plan.spec.tune else 0)
    total = sum(per_point) * runs_per_point
    rate = rate_flops if rate_flops is not None else matmul_rate_flops(threads)
    seconds = []
    for p, flops in zip(plan.points, per_point):
        s = flops / (rate * ASSUMED_UTILISATION * max(1, p.config.train.devices))  # DDP: devices share a trial
        if p.config.train.max_time_s:
            s = min(s, p.config.train.max_time_s)
        seconds.append(s + TRIAL_OVERHEAD_S)
    wall = sum(seconds) * runs_per_point / max(1, workers)
    return {"train_flops": total, "matmul_flops_per_s": rate, "assumed_utilisation": ASSUMED_UTILISATION,
            "estimated_wall_s": wall, "workers": workers}


def describe(plan: Plan, cost: dict[str, Any] | None = None) -> str:
    """The plan as printed before anything runs."""
    s = plan.spec
    lines = [f"sweep {s.name!r}: design={s.design}, {len(plan.points)} point(s) x {len(s.seeds)} seed(s) "
             f"= {len(plan.trials)} trial(s); objective {s.direction} {s.metric}"]
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
    if cost:
        hours = cost["estimated_wall_s"] / 3600
        lines.append(f"  cost: {_si(cost['train_flops'])}FLOP of training; at {_si(cost['matmul_flops_per_s'])}FLOP/s "
                     f"matmul x {cost['assumed_utilisation']:.0%} utilisation (an assumption) and "
                     f"{cost['workers']} worker(s): about "
                     + (f"{hours * 60:.0f} min" if hours < 2 else f"{hours:.1f} h"))
    if s.cost_note:
        lines.append(f"  documented cost: {s.cost_note}")
    return "\n".join(lines)


def _si(x: float) -> str:
    for factor, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= factor:
            return f"{x / factor:.1f} {prefix}"
    return f"{x:.0f} "


def default_threads(workers: int) -> int:
    """CPU threads per trial so that `workers` trials share the cores without oversubscription."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))
