"""Read a sweep's results directory (never rebuild anything): the trial table, the plan and the spec.

    results/<sweep>/results.parquet   one row per trial (point, seed); results.csv as a fallback
    results/<sweep>/plan.json         design, objective, seeds, axes, points (with their configs)
    results/<sweep>/spec.yaml         the sweep spec as written

A sweep may still be running: trials the plan lists but the table lacks are added as `pending` rows
(never ran), so every report states what is missing instead of silently averaging what is there.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

STATUSES = ("completed", "diverged", "failed", "running", "pending")
NOT_RUN = ("running", "pending")

# Primary metric per task family when the plan does not name one: (metric, direction).
DEFAULT_OBJECTIVE = {
    "lm": ("valid_loss", "minimize"),
    "pretrain": ("valid_loss", "minimize"),
    "translation": ("bleu", "maximize"),
    "glue": ("glue_score", "maximize"),
}
LOWER_IS_BETTER = re.compile(r"(loss|ppl|perplexity|bpc|bytes|memory|seconds|flops|parameters)", re.I)
BY_LENGTH = "metric.test_ppl_by_length."
PPL_AT_2X = "metric.test_ppl_at_2x"


def metric_direction(metric: str) -> str:
    """'minimize' for losses, perplexities and costs (except throughput), else 'maximize'."""
    name = metric.split(".", 1)[1] if metric.startswith(("metric.", "cost.")) else metric
    if "tokens_per_s" in name:
        return "maximize"
    return "minimize" if LOWER_IS_BETTER.search(name) else "maximize"


def metric_column(metric: str) -> str:
    """'valid_loss' -> 'metric.valid_loss'; names that already carry a prefix are kept."""
    return metric if metric.startswith(("metric.", "cost.")) else f"metric.{metric}"


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = value


def flatten_metrics(metrics_json: dict) -> dict[str, Any]:
    """A run's metrics.json as a trial row: `metric.*`, `cost.*`, status, steps..."""
    row: dict[str, Any] = {}
    for key in ("status", "steps", "diverged_at_step", "train_tokens", "stopped_by"):
        if key in metrics_json:
            row[key] = metrics_json[key]
    _flatten("metric", metrics_json.get("metrics", {}), row)
    _flatten("cost", metrics_json.get("cost", {}), row)
    return row


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
                base = self.table.loc[self.table["is_baseline"].astype(bool), col].dropna().astype(str)
                values = list(dict.fromkeys(list(base) + list(self.table[col].dropna().astype(str))))
                axes[col[5:]] = values
        return axes

    def objective(self, task: str | None = None) -> tuple[str, str]:
        """(metric name, 'minimize' | 'maximize') for a task: the plan's objective when the task
        records it, else the task family's default, else the first metric with values."""
        sub = self.table if task is None else self.table[self.table["task"] == task]
        candidates = []
        obj = self.plan.get("objective") or {}
        if obj.get("metric"):
            candidates.append((obj["metric"], obj.get("direction") or metric_direction(obj["metric"])))
        if task in DEFAULT_OBJECTIVE:
            candidates.append(DEFAULT_OBJECTIVE[task])
        for metric, direction in candidates:
            col = metric_column(metric)
            if col in sub and pd.to_numeric(sub[col], errors="coerce").notna().any():
                return metric, direction
        for col in self.metric_columns(sub):
            return col[len("metric."):], metric_direction(col)
        return candidates[0] if candidates else ("valid_loss", "minimize")

    @staticmethod
    def metric_columns(table: pd.DataFrame) -> list[str]:
        return [c for c in table.columns if c.startswith("metric.") and pd.api.types.is_numeric_dtype(table[c])
                and table[c].notna().any()]

    # -- variants ---------------------------------------------------------------------------------
    @property
    def baseline_label(self) -> str:
        base = self.table.loc[self.table["is_baseline"].astype(bool), "label"]
        if len(base):
            return str(base.iloc[0])
        return str(self.variant_order[0]) if self.variant_order else "baseline"

    @property
    def variant_order(self) -> list[str]:
        """Every variant label, baseline first, then in plan order (including those never run)."""
        labels = [p["label"] for p in self.plan.get("points", []) if "label" in p]
        labels += list(self.table["label"].dropna().astype(str))
        labels = list(dict.fromkeys(labels))
        base = self.table.loc[self.table["is_baseline"].astype(bool), "label"]
        if len(base) and base.iloc[0] in labels:
            labels.remove(base.iloc[0])
            labels.insert(0, str(base.iloc[0]))
        return labels

    def baseline_values(self) -> dict[str, str]:
        """The baseline point's value on every axis (OFAT: the first value of each axis)."""
        base = self.table[self.table["is_baseline"].astype(bool)]
        out = {}
        for axis, values in self.axes.items():
            col = f"axis.{axis}"
            if len(base) and col in base and base[col].notna().any():
                out[axis] = str(base[col].dropna().iloc[0])
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
        rows = self.table.drop_duplicates("label")
        found: dict[str, str] = {}
        for _, row in rows.iterrows():
            if all(str(row[f"axis.{a}"]) == base.get(a) for a in others):
                found.setdefault(str(row[col]), str(row["label"]))
        order = self.axes.get(axis, []) + sorted(set(found) - set(self.axes.get(axis, [])))
        return [(v, found[v]) for v in order if v in found]

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

    def labels_for(self, task: str) -> list[str]:
        """The variant labels of one task, in variant order."""
        present = set(self.table.loc[self.table["task"] == task, "label"])
        return [lbl for lbl in self.variant_order if lbl in present]

    def datasets_for(self, task: str) -> str:
        return ", ".join(str(d) for d in self.table.loc[self.table["task"] == task, "dataset"].dropna().unique())

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(self.table["task"].dropna().astype(str))) or ["lm"]

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

    def curves(self, row: pd.Series) -> pd.DataFrame | None:
        """The trial's logs/metrics.csv (sparse Lightning rows), or None when absent or unreadable."""
        run_dir = self.run_dir(row)
        if run_dir is None:
            return None
        key = str(run_dir)
        if key not in self._curves:
            path = run_dir / "logs" / "metrics.csv"
            try:
                frame = pd.read_csv(path) if path.is_file() else None
            except (OSError, ValueError, pd.errors.ParserError):
                frame = None
            if frame is not None and "step" not in frame:
                frame = None
            self._curves[key] = frame
        return self._curves[key]

    def point_config(self, label: str) -> dict:
        for p in self.plan.get("points", []):
            if p.get("label") == label:
                return p.get("config") or {}
        return {}


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


def _add_ppl_at_2x(table: pd.DataFrame, plan: dict) -> pd.DataFrame:
    """`metric.test_ppl_at_2x`: test perplexity at twice the training length (the extrapolation
    point of Press et al. 2022, Table 2's L_valid ~ 2L), from `metric.test_ppl_by_length.<L>`."""
    lengths = sorted(int(c[len(BY_LENGTH):]) for c in table.columns
                     if c.startswith(BY_LENGTH) and c[len(BY_LENGTH):].isdigit())
    if not lengths or PPL_AT_2X in table:
        return table
    seq_len = {p.get("label"): ((p.get("config") or {}).get("task") or {}).get("seq_len")
               for p in plan.get("points", [])}
    values = []
    for _, row in table.iterrows():
        train_len = seq_len.get(row.get("label"))
        if not train_len:
            have = [n for n in lengths if pd.notna(row.get(f"{BY_LENGTH}{n}"))]
            train_len = have[0] if have else lengths[0]
        values.append(row.get(f"{BY_LENGTH}{2 * int(train_len)}", np.nan))
    table[PPL_AT_2X] = pd.to_numeric(pd.Series(values, index=table.index), errors="coerce")
    return table


def load_results(path: str | Path) -> SweepResults:
    """Load `results/<sweep>/` (or a results.parquet / results.csv file inside it)."""
    path = Path(path)
    root = path.parent if path.is_file() else path
    if not root.is_dir():
        raise FileNotFoundError(f"no results directory at {root}")
    plan: dict = {}
    if (root / "plan.json").is_file():
        plan = json.loads((root / "plan.json").read_text())
    spec_text = (root / "spec.yaml").read_text() if (root / "spec.yaml").is_file() else None

    table, source = None, ""
    files = [path] if path.is_file() else [root / "results.parquet", root / "results.csv"]
    for f in files:
        if not f.is_file():
            continue
        try:
            table = pd.read_parquet(f) if f.suffix == ".parquet" else pd.read_csv(f, keep_default_na=True)
            source = f.name
            break
        except Exception:  # a parquet being rewritten by a running sweep: fall back to the CSV
            continue
    if table is None:
        if not plan:
            raise FileNotFoundError(f"{root} holds neither results.parquet, results.csv nor plan.json")
        table, source = pd.DataFrame(columns=["label", "seed", "status", "is_baseline", "task"]), "plan.json only"

    has_sweep = "sweep" in table and table["sweep"].notna().any()
    sweep = plan.get("sweep") or (str(table["sweep"].dropna().iloc[0]) if has_sweep else root.name)
    table = table.copy()
    for col, default in (("status", "pending"), ("is_baseline", False), ("error", ""), ("attempts", 0),
                         ("varied", ""), ("seed", np.nan), ("label", ""), ("task", None), ("dataset", None)):
        if col not in table:
            table[col] = default
    table["status"] = table["status"].fillna("pending").astype(str).str.lower()
    table["is_baseline"] = table["is_baseline"].map(
        lambda v: str(v).strip().lower() in ("true", "1", "yes") if not isinstance(v, (bool, np.bool_)) else bool(v))
    table["error"] = table["error"].astype(object).where(table["error"].notna(), "").astype(str)

    if plan.get("points"):
        planned = _plan_rows(plan, sweep)
        have = set(zip(table.get("point", pd.Series(dtype=str)).astype(str), table["seed"].astype("Int64").astype(str)))
        if len(planned):
            missing = planned[[(str(p), str(s)) not in have for p, s in zip(planned["point"], planned["seed"])]]
            if len(missing):
                table = pd.concat([table, missing], ignore_index=True)
        # fill identity columns the table lacks from the plan (task, axes) per label
        by_label = planned.drop_duplicates("label").set_index("label") if len(planned) else pd.DataFrame()
        for col in ("task", "dataset", "varied", *[c for c in by_label.columns if c.startswith("axis.")]):
            if col in by_label:
                fill = table["label"].map(by_label[col])
                table[col] = table[col].where(table[col].notna(), fill) if col in table else fill
    for col in [c for c in table.columns if c.startswith("axis.")]:
        table[col] = table[col].map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
    table["seed"] = pd.to_numeric(table["seed"], errors="coerce").astype("Int64")
    table = _coerce_numeric(table)
    table = _add_ppl_at_2x(table, plan)
    return SweepResults(root=root, table=table.reset_index(drop=True), plan=plan, spec_text=spec_text, source=source)
