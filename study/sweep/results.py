"""The sweep's results table, rebuilt from the run directories (the record), one row per trial.

Columns: identity (sweep, point, seed, trial_key, label, varied, is_baseline, axis.<name>,
task, dataset), outcome (status, attempts, error, steps, diverged_at_step, train_tokens,
stopped_by), `metric.<name>` (nested metrics flattened with '.'), `cost.<name>`, and
provenance (run_dir, env.*, data.fingerprint). Trials that never ran are rows with status
'pending', so a partial sweep's table says what is missing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from study.io import atomic_write, read_json, read_json_or_none
from study.sweep.worker import FINISHED, SweepLayout, read_tuned

STATUSES = ("completed", "diverged", "failed", "running", "pending")


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(value, bool):
        out[prefix] = value
    elif isinstance(value, (int, float)):
        out[prefix] = float(value) if prefix.startswith("metric.") else value
    elif isinstance(value, str):
        # 'n/a' marks a metric that does not apply (learned positions past their table): a missing number
        out[prefix] = float("nan") if prefix.startswith("metric.") and value == "n/a" else value
    elif value is None and prefix.startswith("metric."):
        out[prefix] = float("nan")  # n/a, e.g. learned positions beyond their table


def _status(metrics: dict[str, Any] | None, trial: dict[str, Any] | None) -> tuple[str, str]:
    if metrics and metrics.get("status") in FINISHED:
        return metrics["status"], ""
    attempts = (trial or {}).get("attempts", [])
    if not attempts:
        return "pending", ""
    last = attempts[-1]
    if "ended" not in last:
        return "running", ""
    if last.get("outcome") == "failed":
        return "failed", last.get("error", "")
    return "pending", f"last attempt {last.get('outcome', 'ended')}"  # lost/interrupted: queued again


def trial_row(sweep: str, point: dict[str, Any], seed: int, run_dir: Path) -> dict[str, Any]:
    cfg = point["config"]
    row: dict[str, Any] = {
        "sweep": sweep, "point": point["point"], "seed": seed, "trial_key": f"{point['point']}-s{seed}",
        "label": point["label"], "varied": point["varied"], "is_baseline": point["is_baseline"],
    }
    for name, label in point["axes"].items():
        row[f"axis.{name}"] = label
    row["task"] = cfg["task"]["name"]
    row["dataset"] = cfg["task"]["dataset"]
    metrics = read_json_or_none(run_dir / "metrics.json")
    trial = read_json_or_none(run_dir / "trial.json")
    status, error = _status(metrics, trial)
    row.update(status=status, attempts=len((trial or {}).get("attempts", [])), error=error)
    m = metrics or {}
    row.update(steps=m.get("steps"), diverged_at_step=m.get("diverged_at_step"),
               train_tokens=m.get("train_tokens"), stopped_by=m.get("stopped_by"))
    _flatten("metric", m.get("metrics", {}), row)
    _flatten("cost", m.get("cost", {}), row)
    row["run_dir"] = str(run_dir)
    env = read_json_or_none(run_dir / "env.json") or {}
    git = env.get("git") or {}
    row["env.git"] = (git.get("commit", "") + ("+dirty" if git.get("dirty") else "")) if isinstance(git, dict) else git
    row["env.torch"] = (env.get("packages") or {}).get("torch")
    row["env.device"] = env.get("cuda") or env.get("device")
    row["env.threads"] = env.get("torch_threads")
    data = read_json_or_none(run_dir / "data.json")
    row["data.fingerprint"] = (hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
                               if data else None)
    return row


def build_table(sweep_dir: str | Path):
    """The results DataFrame of a sweep, from plan.json and the run directories."""
    import pandas as pd

    layout = SweepLayout(Path(sweep_dir))
    plan = read_json(layout.plan_path)
    tuned = read_tuned(layout)
    rows = []
    for p in plan["points"]:
        chosen = tuned.get(p["point"], {})
        for s in plan["seeds"]:
            if plan.get("tune"):  # tuning mode: the seeds ran the point's tuned config (once tuning picked it)
                run_dir = layout.run_dir(chosen["point"], s) if chosen.get("point") else layout.run_dir("untuned", s)
                row = trial_row(plan["sweep"], p, s, run_dir)
                row[f"tuned.{plan['tune']['field']}"] = chosen.get("value")
                if chosen.get("error") and row["status"] == "pending":
                    row.update(status="failed", error=chosen["error"])
            else:
                row = trial_row(plan["sweep"], p, s, layout.run_dir(p["point"], s))
            rows.append(row)
    df = pd.DataFrame(rows)
    for column in df.columns:  # a column mixing numbers and text (a task's own marker) is kept as text
        kinds = {type(v) for v in df[column].dropna()}
        if str in kinds and len(kinds) > 1:
            df[column] = df[column].map(lambda v: None if v is None or v != v else str(v))
    first = [c for c in df.columns if not c.startswith(("metric.", "cost.", "env.", "data."))]
    rest = sorted(c for c in df.columns if c not in first)
    return df[first + rest]


def write_table(sweep_dir: str | Path):
    """Rebuild and write results.parquet and results.csv atomically; returns the DataFrame."""
    sweep_dir = Path(sweep_dir)
    df = build_table(sweep_dir)
    atomic_write(sweep_dir / "results.csv", lambda p: df.to_csv(p, index=False))
    tuning = tuning_table(sweep_dir)
    if tuning is not None:
        atomic_write(sweep_dir / "tuning.csv", lambda p: tuning.to_csv(p, index=False))
    try:
        atomic_write(sweep_dir / "results.parquet", lambda p: df.to_parquet(p, index=False))
    except ImportError:  # pyarrow is a dependency; a stripped install still gets the CSV
        pass
    return df


def tuning_table(sweep_dir: str | Path):
    """One row per tuning trial (tuning mode only): point, label, the setting tried, its objective."""
    import pandas as pd

    layout = SweepLayout(Path(sweep_dir))
    plan = read_json(layout.plan_path)
    if not plan.get("tune"):
        return None
    labels = {p["point"]: p["label"] for p in plan["points"]}
    rows = []
    for point, entry in read_tuned(layout).items():
        for t in entry.get("trials", []):
            rows.append({"point": point, "label": labels.get(point), "field": entry["field"], "value": t["value"],
                         "objective": t["objective"], "status": t["status"], "chosen": t["value"] == entry.get("value"),
                         "run_dir": t["run_dir"]})
    return pd.DataFrame(rows, columns=["point", "label", "field", "value", "objective", "status", "chosen", "run_dir"])


def summary(df, metric: str) -> str:
    """Mean, standard deviation and count of the objective per point, in the plan's order."""
    col = f"metric.{metric}"
    lines = [f"{'point':<28} {'n':>2} {'done':>4} {metric:>12} {'sd':>8}  status"]
    for label, group in df.groupby("label", sort=False):
        done = group[group.status.isin(["completed", "diverged"])]
        values = done[col].dropna() if col in done else []
        mean = f"{values.mean():.4f}" if len(values) else "-"
        sd = f"{values.std(ddof=1):.4f}" if len(values) > 1 else "-"
        states = ", ".join(f"{k} {v}" for k, v in group.status.value_counts().items())
        lines.append(f"{label:<28} {len(group):>2} {len(done):>4} {mean:>12} {sd:>8}  {states}")
    return "\n".join(lines)
