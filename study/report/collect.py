"""Read a sweep's results directory (never rebuild anything): the trial table, the plan and the spec.

    results/<sweep>/results.parquet   one row per trial (point, seed); results.csv as a fallback
    results/<sweep>/plan.json         design, objective, seeds, axes, points (with their configs), and each task
                                      family's declarations: its metrics (direction, scale, whether it may rank a
                                      sweep), its default objective and its comparable training curves
    results/<sweep>/spec.yaml         the sweep spec as written, and its `--set` overrides (as comments)
    results/<sweep>/curves.parquet    every trial's training curves (used when its run directory is not here)

Directions and scales are read from those declarations (and, for `cost.*`, from `study.record.COSTS`), never
guessed from a metric's name: a metric nobody declared has no direction, and a plan.json written before
declarations existed is refused with what to do. A sweep may still be running: trials the plan lists but the
table lacks are added as `pending` rows (never ran), so every report states what is missing instead of silently
averaging what is there.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from study.io import close_sweep_folders, read_json_or_none
from study.record import (COSTS, DIRECTIONS, FINISHED, STATUSES, RunDir, UnreadableTable, interrupted,
                          own_attempts, read_table, stage_run_dirs)

NOT_RUN = ("running", "pending")
# `<split>_ppl_by_length.<L>` and `<split>_ppl_at_2x`: the LM task's extrapolation metrics, on the corpus's last
# split (Tiny Shakespeare: valid; WikiText-2: test)
BY_LENGTH = re.compile(r"^metric\.(?P<split>[a-z]+)_ppl_by_length\.(?P<n>\d+)$")
AT_2X = re.compile(r"^metric\.(?P<split>[a-z]+)_ppl_at_2x$")
SPLIT_WORDS = {"valid": "validation", "test": "test", "dev": "dev"}


class UndeclaredMetric(ValueError):
    """A metric (or a whole plan) without a declaration: its direction and scale are unknown, and never guessed."""


@dataclass(frozen=True)
class Declaration:
    """What a task family (or study.record.COSTS) declares about one metric column."""

    column: str               # metric.<name> or cost.<name>
    declared_as: str          # the declared name or fnmatch pattern it matched
    task: str | None          # the declaring task family (None: a cost)
    direction: str            # 'minimize' | 'maximize'
    scale: str                # unit and range, e.g. 'nats/token', '0-100', 'count'
    objective: bool = True    # False: bookkeeping (counts) that must never rank a sweep
    by_construction: bool = False  # a cost computed from the config by arithmetic, not measured
    description: str = ""
    cost: bool = False  # a cost the task measures (decode time, KV cache held): shown beside the quality
    defined_by: tuple[str, ...] = ()  # config fields (`section.field`) that decide what it measures
    stage: str | None = None  # a study in stages: the stage whose config those fields are in

    @property
    def better(self) -> str:
        return "lower" if self.direction == "minimize" else "higher"


def ran_off_plan(table: pd.DataFrame) -> pd.Series:
    """Per row, whether the trial's resolved config differs from the plan on an axis (`ran_as_planned` false,
    however the table spells it: a bool, or text from a CSV); False where the table has no such column."""
    ran = table.get("ran_as_planned", pd.Series(True, index=table.index))
    return ran.map(lambda v: str(v).strip().lower() == "false").astype(bool)


def metric_column(metric: str) -> str:
    """'valid_loss' -> 'metric.valid_loss'; names that already carry a prefix are kept."""
    return metric if metric.startswith(("metric.", "cost.")) else f"metric.{metric}"


def metric_name(column: str) -> str:
    """'metric.valid_loss' -> 'valid_loss'; costs keep their prefix."""
    return column[len("metric."):] if column.startswith("metric.") else column


def match_declaration(declared: dict[str, dict], name: str) -> tuple[str, dict] | None:
    """(declared name, declaration) of metric `name`: an exact name wins over a pattern, and patterns are tried in
    declaration order (as study.tasks.contract.TaskFamily.metric does)."""
    if name in declared:
        return name, declared[name]
    return next(((p, d) for p, d in declared.items() if fnmatch.fnmatchcase(name, p)), None)


def cost_declaration(column: str, stages: list[str] = ()) -> Declaration | None:
    """A `cost.*` column's direction, unit and whether it is by construction (study.record.COSTS); a pipeline's
    earlier stage's costs (`cost.pretrain.parameters`) are declared the same."""
    name = column[len("cost."):]
    head, _, rest = name.partition(".")
    if head in stages and rest:
        name = rest
    if name not in COSTS:
        return None
    direction, unit, constructed = COSTS[name]
    return Declaration(column, name, None, direction, unit, objective=False, by_construction=constructed)


def by_length_columns(table: pd.DataFrame) -> tuple[str | None, list[tuple[int, str]]]:
    """(split, [(evaluation length, column)]) of the `<split>_ppl_by_length.<L>` columns; a table holding two
    splits' (never written together) gives the test split's."""
    found: dict[str, list[tuple[int, str]]] = {}
    for col in table.columns:
        m = BY_LENGTH.match(str(col))
        if m:
            found.setdefault(m["split"], []).append((int(m["n"]), col))
    if not found:
        return None, []
    split = "test" if "test" in found else sorted(found)[0]
    return split, sorted(found[split])


def at_2x_column(table: pd.DataFrame) -> str | None:
    """The `<split>_ppl_at_2x` column the table has (test before valid), or None."""
    cols = sorted((c for c in table.columns if AT_2X.match(str(c))), key=lambda c: "metric.test" not in c)
    return cols[0] if cols else None


def _coerce_numeric(table: pd.DataFrame) -> pd.DataFrame:
    """`metric.*` / `cost.*` columns as floats ("n/a" -> NaN), except columns of real strings
    (sacreBLEU signatures), which are kept as they are."""
    for col in table.columns:
        if not col.startswith(("metric.", "cost.")) or pd.api.types.is_numeric_dtype(table[col]):
            continue
        values = pd.to_numeric(table[col], errors="coerce")
        raw = table[col].dropna().astype(str).str.strip().str.lower()
        text = raw[~raw.isin(["", "n/a", "nan", "none", "null", "inf", "-inf"])]
        if values.notna().sum() >= len(text) * 0.5 or text.empty:
            table[col] = values.astype(float)
    return table


@dataclass
class SweepResults:
    """A sweep's trial table with its plan; `table` has one row per planned or recorded trial."""

    root: Path
    table: pd.DataFrame
    plan: dict = field(default_factory=dict)
    spec_text: str | None = None
    source: str = ""

    # -- identity ---------------------------------------------------------------------------------
    @property
    def sweep(self) -> str:
        if self.plan.get("sweep"):
            return str(self.plan["sweep"])
        if "sweep" in self.table and self.table["sweep"].notna().any():
            return str(self.table["sweep"].dropna().iloc[0])
        return self.root.name

    @property
    def design(self) -> str:
        if self.plan.get("design"):
            return str(self.plan["design"])
        varied = set(self.table.get("varied", pd.Series(dtype=str)).dropna())
        return "grid" if varied == {"grid"} else "ofat"

    @property
    def seeds(self) -> list[int]:
        if self.plan.get("seeds") is not None:
            return [int(s) for s in self.plan["seeds"]]
        return sorted(int(s) for s in self.table["seed"].dropna().unique())

    @property
    def axes(self) -> dict[str, list[str]]:
        """Axis name -> value labels in plan order (OFAT: the baseline value first)."""
        if self.plan.get("axes"):
            return {k: [str(v) for v in vals] for k, vals in self.plan["axes"].items()}
        axes = {}
        for col in self.table.columns:
            if col.startswith("axis."):
                base = self._baseline_rows()[col].dropna().astype(str)
                values = list(dict.fromkeys(list(base) + list(self.table[col].dropna().astype(str))))
                axes[col[5:]] = values
        return axes

    # -- declarations -----------------------------------------------------------------------------------
    @property
    def stages(self) -> list[str]:
        """A study in stages: its stage names in order (the last one's metrics are unprefixed); else []."""
        return [str(s) for s in self.plan.get("stages") or []]

    @cached_property
    def stage_tasks(self) -> dict[str, str]:
        """Stage name -> the task family that runs it, from the points' configs."""
        out: dict[str, str] = {}
        for p in self.plan.get("points", []):
            for name, exp in ((p.get("config") or {}).get("stages") or {}).items():
                out.setdefault(name, ((exp or {}).get("task") or {}).get("name"))
        return out

    def _task_of(self, task: str | None) -> str:
        """The task whose declarations name an unprefixed metric: `task`, else a pipeline's last stage's, else the
        objective's."""
        if task is not None:
            return task
        if self.stages and self.stage_tasks.get(self.stages[-1]):
            return self.stage_tasks[self.stages[-1]]
        return str((self.plan.get("objective") or {}).get("task") or self.tasks[0])

    def declaration(self, metric: str, task: str | None = None) -> Declaration | None:
        """The declaration of a metric (`valid_loss`, `metric.SST-2/accuracy`, `pretrain.valid_mlm_loss`) of
        `task` (default: the objective's task), or of a `cost.*` column; None when nothing declares it."""
        column = metric_column(metric)
        if column.startswith("cost."):
            return cost_declaration(column, self.stages[:-1])
        name, family = metric_name(column), self._task_of(task)
        stage = self.stages[-1] if self.stages else None
        head, _, rest = name.partition(".")
        if head in self.stages[:-1] and rest:  # an earlier stage's metric, declared by that stage's task
            name, family, stage = rest, self.stage_tasks.get(head, family), head
        found = match_declaration(((self.plan.get("tasks") or {}).get(family) or {}).get("metrics") or {}, name)
        if found is None:
            return None
        pattern, d = found
        check_direction(d.get("direction"), f"{column} (declared as {pattern!r}, task {family!r})",
                        self.root / "plan.json")
        return Declaration(column, pattern, family, d["direction"], str(d.get("scale") or ""),
                           bool(d.get("objective", True)), description=str(d.get("description") or ""),
                           cost=bool(d.get("cost", False)), defined_by=tuple(d.get("defined_by") or ()), stage=stage)

    def declared(self, metric: str, task: str | None = None) -> Declaration:
        """As `declaration`, but a metric nobody declared is an error: its direction is never guessed."""
        found = self.declaration(metric, task)
        if found is None:
            raise UndeclaredMetric(f"{metric_column(metric)}: no declaration in {self.root / 'plan.json'} for task "
                                   f"{self._task_of(task)!r} (nor in study.record.COSTS), so its direction and scale "
                                   "are unknown; the report does not guess them")
        return found

    def objective(self, task: str | None = None) -> tuple[str, str]:
        """(metric name, 'minimize' | 'maximize'): the plan's declared objective for its task (a study in stages:
        for the whole pipeline, whichever stage's metric it names), else `task`'s declared default objective.
        Never another metric, and never a direction guessed from a name."""
        obj = self.plan.get("objective") or {}
        if task is None or task == obj.get("task") or self.stages:
            metric, family = str(obj["metric"]), obj.get("task")
        else:
            declared = (self.plan.get("tasks") or {}).get(task) or {}
            if not declared.get("default_objective"):
                raise UndeclaredMetric(f"task {task!r}: plan.json declares no default objective for it")
            metric, family = str(declared["default_objective"]), task
        spec = self.declared(metric, None if self.stages else family)
        if not spec.objective:
            raise UndeclaredMetric(f"{metric} ({spec.scale}) is declared bookkeeping, not a quality measure: "
                                   "it never ranks a sweep")
        return metric, spec.direction

    def curve_columns(self, task: str) -> dict[str, str]:
        """{'train': column, 'valid': column} of logs/metrics.csv that the task declares comparable across its
        variants (pretraining: the MLM loss, never MLM + NSP against MLM alone)."""
        curves = ((self.plan.get("tasks") or {}).get(task) or {}).get("curves")
        if not curves:
            raise UndeclaredMetric(f"task {task!r}: plan.json declares no training curves for it")
        return dict(curves)

    @staticmethod
    def metric_columns(table: pd.DataFrame) -> list[str]:
        return [c for c in table.columns if c.startswith("metric.") and pd.api.types.is_numeric_dtype(table[c])
                and table[c].notna().any()]

    # -- variants ---------------------------------------------------------------------------------
    def _baseline_rows(self) -> pd.DataFrame:
        """The baseline point's trials that ran as planned (or never ran). One whose resolved config differs from
        the plan keeps is_baseline but is relabelled by what ran (study.sweep.results.trial_row): it is a variant
        of its own, so it must never define the baseline nor be paired as it."""
        return self.table[self.table["is_baseline"].astype(bool) & ~ran_off_plan(self.table)]

    def _planned_baseline_label(self) -> str | None:
        """The baseline point's label; plan.json's when none of its trials ran as planned, so that the baseline
        then has no trials (and no pairs) rather than an off-plan trial standing in for it."""
        base = self._baseline_rows()["label"]
        if len(base):
            return str(base.iloc[0])
        return next((str(p["label"]) for p in self.plan.get("points", []) if p.get("is_baseline") and "label" in p),
                    None)

    @property
    def baseline_label(self) -> str:
        base = self._planned_baseline_label()
        if base is not None:
            return base
        return str(self.variant_order[0]) if self.variant_order else "baseline"

    @property
    def variant_order(self) -> list[str]:
        """Every variant label, baseline first, then in plan order (including those never run)."""
        labels = [p["label"] for p in self.plan.get("points", []) if "label" in p]
        labels += list(self.table["label"].dropna().astype(str))
        labels = list(dict.fromkeys(labels))
        base = self._planned_baseline_label()
        if base in labels:
            labels.remove(base)
            labels.insert(0, base)
        return labels

    def baseline_values(self) -> dict[str, str]:
        """The baseline point's value on every axis: as its trials ran, else as the plan lists the point. A grid's
        baseline is its first point, the all-first-values cell only where no `exclude` rule removed that."""
        base = self._baseline_rows()
        if not len(base):  # a grid (no point is_baseline), or a baseline that has not run
            base = self.table[(self.table["label"] == self.baseline_label) & ~ran_off_plan(self.table)]
        planned = next((p.get("axes") or {} for p in self.plan.get("points", [])
                        if p.get("label") == self.baseline_label), {})
        out = {}
        for axis, values in self.axes.items():
            col = f"axis.{axis}"
            if len(base) and col in base and base[col].notna().any():
                out[axis] = str(base[col].dropna().iloc[0])
            elif axis in planned:
                out[axis] = str(planned[axis])
            elif values:
                out[axis] = values[0]
        return out

    def axis_labels(self, axis: str) -> list[tuple[str, str]]:
        """[(value, label)] of the points that differ from the baseline on `axis` only, baseline
        included, in the axis's value order: the one-factor slice of OFAT designs and of grids."""
        col = f"axis.{axis}"
        if col not in self.table:
            return []
        base = self.baseline_values()
        others = [a for a in self.axes if a != axis and f"axis.{a}" in self.table]
        rows = self.table[~ran_off_plan(self.table)].drop_duplicates("label")  # (an off-plan trial ran another point)
        found: dict[str, str] = {}
        for _, row in rows.iterrows():
            if all(str(row[f"axis.{a}"]) == base.get(a) for a in others):
                found.setdefault(str(row[col]), str(row["label"]))
        order = self.axes.get(axis, []) + sorted(set(found) - set(self.axes.get(axis, [])))
        return [(v, found[v]) for v in order if v in found]

    def ran_at(self, label: str, field: str) -> str | None:
        """The value cell `label` ran `field` at (normalised): the table's `config.<field>`, where the sweep recorded
        it with unset fields resolved (study.sweep.results.resolved_fields: `n_kv_heads: null` ran as n_heads); None
        where the table does not record it (one written before it did)."""
        col = f"config.{field}"
        values = self.table.loc[self.table["label"] == label, col].dropna() if col in self.table else []
        return normalise_value(values.iloc[0]) if len(values) else None

    def defined_differently(self, column: str, task: str | None, labels: list[str]) -> dict[str, list[str]]:
        """field -> the values the cells `labels` ran it at, for each field that decides what `column` measures (its
        declared `defined_by`) and that they ran differently: there the column measures a different thing in each
        (one vocabulary's per-token loss beside another's), and its values are not comparable."""
        spec = self.declaration(column, task)
        out = {}
        for field in spec.defined_by if spec is not None else ():
            # a cell that leaves the field unset beside one that sets it may run another value (eval_tokens: null is
            # the whole split): unset is a value of its own, as the sweep's plan counts it; a recorded metric no
            # completed trial of a cell wrote is unknown, not a value
            values = [self._defining_value(label, field, spec.stage) for label in labels]
            recorded = field.startswith("metric.")
            ran = {v for v in values if v is not None} if recorded else {UNSET if v is None else v for v in values}
            if len(ran) > 1:
                out[field] = sorted(ran, key=_numbers_first)
        return out

    def _defining_value(self, label: str, field: str, stage: str | None) -> str | None:
        """The value cell `label` ran `field` (of `stage`) at: as tuning chose it (`tuned.<field>`), else as an axis
        set it (`ran_at`: what ran), else as planned, literally (None where unset: the default, or what the config
        derives, such as the tokenizer from the dataset, which is not recorded)."""
        if field.startswith("metric."):  # written by the run beside the metric: what each completed trial recorded
            return self._recorded_value(label, field, stage)
        spellings = self._spellings(field, stage)
        tuned = f"tuned.{(self.plan.get('tune') or {}).get('field')}"
        if tuned[len("tuned."):] in spellings and tuned in self.table:
            values = self.table.loc[self.table["label"] == label, tuned].dropna()
            if len(values):
                return normalise_value(values.iloc[0])
        axis_paths = {p for ps in (self.plan.get("axis_fields") or {}).values() for p in ps}
        for path in sorted(spellings & axis_paths):
            if (value := self.ran_at(label, path)) is not None:
                return value
        planned = config_field(self.experiment_config(label, stage), field)
        return None if planned is None else normalise_value(planned)

    def _recorded_value(self, label: str, column: str, stage: str | None) -> str | None:
        """The values cell `label`'s completed trials recorded in `column` (a metric of `stage`, under its stage's
        prefix where that is an earlier stage), joined: seeds that recorded different ones make a value of their
        own. None where none recorded it (a table written before the metric was)."""
        if stage is not None and self.stages and stage != self.stages[-1]:
            column = f"metric.{stage}.{column[len('metric.'):]}"
        rows = self.table[(self.table["label"] == label) & (self.table["status"] == "completed")]
        values = sorted({normalise_value(v) for v in rows[column].dropna()}) if column in rows else []
        return " | ".join(values) or None

    def _spellings(self, field: str, stage: str | None) -> set[str]:
        """The paths a spec may set `field` of `stage` by (study.config.sweep.route's rule: in a study in stages a path
        names its stage, `pretrain.task.mlm_probability`, and `model.*` alone is the first stage's)."""
        if not self.stages:
            return {field}
        return {f"{stage}.{field}"} | ({field} if stage == self.stages[0] and field.startswith("model.") else set())

    def set_alike(self, labels: tuple[str, str], fields: list[str]) -> bool:
        """Do two cells set every field in `fields` alike, as they ran? On the values the table records (a cell that
        leaves n_kv_heads unset and one that spells out n_heads both ran MHA); where it records none, on the planned
        configs literally, since the report does not know a config's defaults (an unset field there is not taken
        for one, and the cells are then not alike)."""
        configs = [self.experiment_config(label) for label in labels]
        for f in fields:
            ran = [self.ran_at(label, f) for label in labels]
            if None not in ran:
                if ran[0] != ran[1]:
                    return False
            elif not all(configs) or config_field(configs[0], f) != config_field(configs[1], f):
                return False
        return True

    def label_for(self, axis: str, value: str) -> str | None:
        """The label of the point that sets `axis` to `value` and every other axis to the baseline."""
        want = normalise_value(value)
        for v, label in self.axis_labels(axis):
            if normalise_value(v) == want:
                return label
        return None

    # -- status -----------------------------------------------------------------------------------
    @property
    def status_counts(self) -> dict[str, int]:
        counts = self.table["status"].value_counts().to_dict()
        return {s: int(counts.get(s, 0)) for s in STATUSES} | {
            s: int(n) for s, n in counts.items() if s not in STATUSES}

    @property
    def is_partial(self) -> bool:
        return bool(self.table["status"].isin(NOT_RUN).any())

    def problems(self) -> pd.DataFrame:
        """Every trial that did not complete: failed, diverged, still running or never run."""
        bad = self.table[self.table["status"] != "completed"]
        order = {s: i for i, s in enumerate(("failed", "diverged", "running", "pending"))}
        return bad.assign(_o=bad["status"].map(order).fillna(9)).sort_values(["_o", "label", "seed"]).drop(columns="_o")

    def completed(self, task: str | None = None) -> pd.DataFrame:
        done = self.table[self.table["status"] == "completed"]
        return done if task is None else done[done["task"] == task]

    def finished(self, task: str | None = None) -> pd.DataFrame:
        """The trials that ended with a result: completed or diverged (a paired difference names the divergences)."""
        done = self.table[self.table["status"].isin(FINISHED)]
        return done if task is None else done[done["task"] == task]

    def labels_for(self, task: str) -> list[str]:
        """The variant labels of one task, in variant order."""
        present = set(self.table.loc[self.table["task"] == task, "label"])
        return [lbl for lbl in self.variant_order if lbl in present]

    def datasets_for(self, task: str) -> str:
        return ", ".join(str(d) for d in self.table.loc[self.table["task"] == task, "dataset"].dropna().unique())

    @property
    def tasks(self) -> list[str]:
        found = list(dict.fromkeys(self.table["task"].dropna().astype(str)))
        if found:
            return found
        # no row names its task (nothing has run): the task the plan's points run, else the objective's
        tasks = [(self.experiment_config(str(p.get("label"))).get("task") or {}).get("name")
                 for p in self.plan.get("points", [])]
        return list(dict.fromkeys(t for t in tasks if t)) or [str((self.plan.get("objective") or {}).get("task"))]

    # -- run directories --------------------------------------------------------------------------
    def run_dir(self, row: pd.Series | dict) -> Path | None:
        """The trial's run directory: as recorded, or relative to the results dir or its parents."""
        raw = row.get("run_dir") if hasattr(row, "get") else None
        if raw is None or (isinstance(raw, float) and math.isnan(raw)) or not str(raw).strip():
            return None
        path = Path(str(raw))
        candidates = [path] if path.is_absolute() else [self.root / path, Path.cwd() / path,
                                                         self.root.parent / path, self.root.parent.parent / path]
        if path.is_absolute():  # moved results: try the tail relative to the results directory
            candidates += [self.root / Path(*path.parts[-k:]) for k in (1, 2, 3) if len(path.parts) >= k]
        for c in candidates:
            if c.is_dir():
                return c
        return None

    @cached_property
    def _curves(self) -> dict[str, pd.DataFrame]:
        return {}

    @cached_property
    def invocations(self) -> list[dict]:
        """results/<sweep>/invocations.json: each `study sweep` command's measured wall time, workers and threads."""
        path = self.root / "invocations.json"
        try:
            data = json.loads(path.read_text()) if path.is_file() else []
        except (OSError, ValueError):
            return []
        return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []

    @cached_property
    def curves_file(self) -> pd.DataFrame | None:
        """results/<sweep>/curves.parquet (every trial's curves, committed with the table), or None."""
        path = self.root / "curves.parquet"
        try:
            return pd.read_parquet(path) if path.is_file() else None
        except (OSError, ValueError, ImportError):
            return None

    def _stage_run_dir(self, row: pd.Series | dict, stage: str | None) -> Path | None:
        run_dir = self.run_dir(row)
        if run_dir is not None and stage is not None:
            stage_dir = stage_run_dirs(RunDir(run_dir).read(), run_dir).get(stage)
            run_dir = self.run_dir({"run_dir": stage_dir}) if stage_dir else None
        return run_dir

    def curves(self, row: pd.Series, stage: str | None = None) -> pd.DataFrame | None:
        """The trial's training curves (sparse Lightning rows with a `step` column), or None: from its run
        directory's logs when it is here (a sweep still running), else from the committed curves.parquet; `stage`:
        the curves of that stage of a study in stages."""
        run_dir = self._stage_run_dir(row, stage)
        key = f"{run_dir}" if run_dir is not None else f"{row.get('trial_key')}:{stage or ''}"
        if key not in self._curves:
            self._curves[key] = (RunDir(run_dir).read_curves() if run_dir is not None
                                 else self._stored_curves(row, stage))
        return self._curves[key]

    def _stored_curves(self, row: pd.Series | dict, stage: str | None) -> pd.DataFrame | None:
        stored = self.curves_file
        if stored is None or "trial_key" not in stored:
            return None
        frame = stored[(stored["trial_key"] == row.get("trial_key")) & (stored["stage"].fillna("") == (stage or ""))]
        frame = frame.drop(columns=["trial_key", "stage"]).dropna(axis=1, how="all")
        return frame.reset_index(drop=True) if len(frame) and "step" in frame else None

    def point_config(self, label: str) -> dict:
        """The planned config of the point `label` (an experiment, or a pipeline {name, stages})."""
        for p in self.plan.get("points", []):
            if p.get("label") == label:
                return p.get("config") or {}
        return {}

    def experiment_config(self, label: str, stage: str | None = None) -> dict:
        """The planned experiment of point `label`: itself, or a pipeline's stage `stage` (default: its last, the
        one the table's task and dataset are)."""
        cfg = self.point_config(label)
        stages = cfg.get("stages") if isinstance(cfg, dict) else None
        if not stages:
            return cfg
        return (stages.get(stage) if stage else list(stages.values())[-1]) or {}


UNSET = "(unset)"  # a field a cell's config leaves to its default, beside cells that set it


def _numbers_first(value: str) -> tuple:
    """Sort key: numbers in numeric order (8000 before 16000), then other text."""
    try:
        return 0, float(value), ""
    except ValueError:
        return 1, 0.0, value


def config_field(config: dict, dotted: str) -> Any:
    """`section.name` of a config as a dict, literally (None where it is unset or absent)."""
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def normalise_value(value: Any) -> str:
    """Axis values compared loosely: 'True'/'on'/'yes' -> 'true', '8.0' -> '8', case-folded."""
    text = str(value).strip().lower()
    try:
        num = float(text)
        return str(int(num)) if num.is_integer() else repr(num)
    except ValueError:
        return {"on": "true", "yes": "true", "off": "false", "no": "false"}.get(text, text)


def _plan_rows(plan: dict, sweep: str) -> pd.DataFrame:
    """One pending row per (point, seed) of the plan."""
    rows = []
    for p in plan.get("points", []):
        cfg = p.get("config") or {}
        if isinstance(cfg, dict) and cfg.get("stages"):  # a pipeline: its last stage's task, as results.csv has
            cfg = list(cfg["stages"].values())[-1] or {}
        task = cfg.get("task", {}) if isinstance(cfg, dict) else {}
        for seed in plan.get("seeds", []):
            row = {"sweep": sweep, "point": p.get("point"), "seed": int(seed), "trial_key": f"{p.get('point')}-s{seed}",
                   "label": p.get("label"), "varied": p.get("varied"), "is_baseline": bool(p.get("is_baseline")),
                   "task": task.get("name"), "dataset": task.get("dataset"), "status": "pending", "attempts": 0,
                   "error": "not in the results table (never ran)"}
            for axis, value in (p.get("axes") or {}).items():
                row[f"axis.{axis}"] = str(value)
            rows.append(row)
    return pd.DataFrame(rows)


def check_plan(plan: dict, root: Path) -> None:
    """A plan.json the report can read: it declares the objective (with the task that declares it) and every task
    family's metrics. One written before declarations existed is refused, saying what to do."""
    where = root / "plan.json"
    if not plan:
        raise UndeclaredMetric(f"{where} is missing: the report reads every metric's direction and scale from the "
                               "declarations `study sweep` writes there, and never guesses them")
    obj = plan.get("objective") or {}
    missing = [k for k in ("metric", "direction", "task") if not obj.get(k)]
    missing += ["tasks"] if not isinstance(plan.get("tasks"), dict) or not plan["tasks"] else []
    if missing:
        raise UndeclaredMetric(
            f"{where} predates declared metrics (it lacks {', '.join(missing)}): its metrics' directions and scales "
            "are not recorded and the report does not guess them. Re-run the sweep with the current `study sweep` "
            "(finished trials are found and kept; only plan.json and the results table are rewritten).")
    check_direction(obj["direction"], f"the objective {obj['metric']}", where)
    for task, declared in plan["tasks"].items():
        for name, d in ((declared or {}).get("metrics") or {}).items():
            check_direction((d or {}).get("direction"), f"{name} (task {task!r})", where)


def check_direction(direction: Any, what: str, where: Path) -> None:
    """A declared direction is 'minimize' or 'maximize'; any other value ('min', a typo, none) is refused, never read
    as one of them: read as maximize, a 'min' would flip every verdict of the metric without a word."""
    if direction not in DIRECTIONS:
        raise UndeclaredMetric(f"{what}: {where} declares the direction {direction!r}; a direction is one of "
                               f"{', '.join(repr(d) for d in DIRECTIONS)}, and the report does not guess which one "
                               "is meant")


def _read_table(path: Path, root: Path) -> tuple[pd.DataFrame | None, str]:
    files = [path] if path.is_file() else [root / "results.parquet", root / "results.csv"]
    try:
        table, found = read_table(files, read_csv=_read_csv)
    except UnreadableTable as err:  # read as no table, a damaged one would report every trial as never run
        raise UnreadableTable(f"the results table cannot be read: {err}; restore it (git checkout), or where the run "
                              "directories are here move it aside and run `study results`") from None
    return table, found.name if found is not None else ""


def _read_csv(path: Path) -> pd.DataFrame:
    """results.csv with its axis values as written, the plan's labels: type guessing read `true` as True and `4`
    as 4.0 beside an n/a (labels that then matched no plan value), and `n/a` itself as missing."""
    axes = [c for c in pd.read_csv(path, nrows=0).columns if c.startswith("axis.")]
    return pd.read_csv(path, converters={c: (lambda v: v or None) for c in axes})


def _normalise(table: pd.DataFrame) -> pd.DataFrame:
    """Identity columns with their types, whatever file (or none) they came from."""
    table = table.copy()
    for col, default in (("status", "pending"), ("is_baseline", False), ("error", ""), ("attempts", 0),
                         ("varied", ""), ("seed", np.nan), ("label", ""), ("task", None), ("dataset", None)):
        if col not in table:
            table[col] = default
    table["status"] = table["status"].fillna("pending").astype(str).str.lower()
    table["is_baseline"] = table["is_baseline"].map(
        lambda v: str(v).strip().lower() in ("true", "1", "yes") if not isinstance(v, (bool, np.bool_)) else bool(v))
    table["error"] = table["error"].astype(object).where(table["error"].notna(), "").astype(str)
    return table


def _add_planned(table: pd.DataFrame, plan: dict, sweep: str) -> pd.DataFrame:
    """Pending rows for the planned trials the table lacks, and identity columns it lacks filled from the plan."""
    planned = _plan_rows(plan, sweep)
    if not len(planned):
        return table
    have = set(zip(table.get("point", pd.Series(dtype=str)).astype(str), table["seed"].astype("Int64").astype(str)))
    missing = planned[[(str(p), str(s)) not in have for p, s in zip(planned["point"], planned["seed"])]]
    if len(missing):
        table = pd.concat([table, missing], ignore_index=True)
    by_label = planned.drop_duplicates("label").set_index("label")
    for col in ("task", "dataset", "varied", *[c for c in by_label.columns if c.startswith("axis.")]):
        if col in by_label:
            fill = table["label"].map(by_label[col])
            table[col] = table[col].where(table[col].notna(), fill) if col in table else fill
    return table


def load_results(path: str | Path) -> SweepResults:
    """Load `results/<sweep>/` (or a results.parquet / results.csv file inside it). Raises FileNotFoundError
    when there is nothing to read, UndeclaredMetric when plan.json is missing or predates declared metrics."""
    path = Path(path)
    root = path.parent if path.is_file() else path
    if not root.is_dir():
        close = close_sweep_folders(root)
        raise FileNotFoundError(f"no results directory at {root}" + (f"; did you mean {', '.join(close)}?" if close
                                                                      else ""))
    plan: dict = json.loads((root / "plan.json").read_text()) if (root / "plan.json").is_file() else {}
    table, source = _read_table(path, root)
    if table is None and not plan:
        raise FileNotFoundError(f"{root} holds neither results.parquet, results.csv nor plan.json")
    check_plan(plan, root)
    spec_text = (root / "spec.yaml").read_text() if (root / "spec.yaml").is_file() else None
    if table is None:
        table, source = pd.DataFrame(columns=["label", "seed", "status", "is_baseline", "task"]), "plan.json only"
    has_sweep = "sweep" in table and table["sweep"].notna().any()
    sweep = plan.get("sweep") or (str(table["sweep"].dropna().iloc[0]) if has_sweep else root.name)
    table = _add_planned(_normalise(table), plan, sweep)
    for col in [c for c in table.columns if c.startswith("axis.")]:
        table[col] = table[col].map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
    table["seed"] = pd.to_numeric(table["seed"], errors="coerce").astype("Int64")
    table = _coerce_numeric(table)
    results = SweepResults(root=root, table=table.reset_index(drop=True), plan=plan, spec_text=spec_text, source=source)
    _mark_interrupted(results)
    return results


def _mark_interrupted(results: SweepResults) -> None:
    """Rows the table calls running whose attempt's worker is gone (the table is the sweep's last write, and a
    `kill -9` ended the sweep before it could write another): pending, saying why, as `study results` rebuilds them.
    Where the run directory is not here, or its worker ran on another host, the row stays as written."""
    table = results.table
    for i in table.index[table["status"] == "running"]:
        run_dir = results.run_dir(table.loc[i])
        attempts = own_attempts(read_json_or_none(RunDir(run_dir).trial), results.sweep) if run_dir else []
        if attempts and (why := interrupted(attempts[-1])):
            table.loc[i, ["status", "error"]] = ["pending", why]
