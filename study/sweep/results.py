"""The sweep's results table, rebuilt from the run directories (the record), one row per trial.

Columns: identity (sweep, point, seed, trial_key, label, varied, is_baseline, axis.<name>,
ran_as_planned, task, dataset), outcome (status, attempts, error, steps, diverged_at_step, train_tokens,
stopped_by), `metric.<name>` (nested metrics flattened with '.'), `cost.<name>`, `config.<field>` (every field an
axis sets, as the trial ran it, unset fields resolved: `resolved_fields`), and provenance (run_dir, env.*,
data.fingerprint). Trials that never ran are rows with status
'pending', so a partial sweep's table says what is missing.

Beside it, `curves.parquet` holds every trial's training curves (each run's logs/metrics.csv, with `trial_key` and
`stage` columns; a study in stages has one block per stage), so a report drawn from a clean clone, where no run
directory is committed, draws the same figures. A trial whose run directory is not here (a clean clone, results
copied without their runs) keeps the row and curves the folder already holds: rebuilding never loses a result.

Labels come from what ran: each finished trial's `axis.<name>` is the axis value its resolved config.yaml holds
(a pipeline: the config of the stage the axis belongs to), not the value the spec asked for.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from study.io import atomic_write, load_yaml, read_json, read_json_or_none
from study.record import (DIVERGED, FINISHED, PENDING, RUNNING, RunDir, UnreadableTable, flatten_record, interrupted,
                          metric_value, own_attempts, read_table, stage_run_dirs)
from study.sweep.layout import SweepLayout, current_tuned, read_tuned, seed_key


def _attempt_count(attempts: list[dict[str, Any]]) -> int:
    """Attempts as the queue counts them: an entry that never ended (its worker was killed) and was followed by
    another is that attempt resumed, not one more (docs/sweeps.md)."""
    return sum(1 for a in attempts[:-1] if "ended" in a) + (1 if attempts else 0)


def _status(metrics: dict[str, Any] | None, attempts: list[dict[str, Any]],
            written: float | None = None, objective: str | None = None) -> tuple[str, str]:
    """(status, why) of a trial from its record and this sweep's attempts (`own_attempts`); `written`: when the
    record was written (its file's mtime), so a record another sweep finished after this sweep's attempt failed is
    this trial's result; `objective`: the sweep's, which may have changed since an attempt failed for lack of one."""
    last = attempts[-1] if attempts else {}
    if metrics and metrics.get("status") in FINISHED:
        # finished, but failed by its worker: its objective is missing, or the record was not this attempt's (the
        # process stopped before training, e.g. on another config's run in the directory; study.sweep.worker)
        newer = written is not None and written > float(last.get("ended") or math.inf)
        missed = last.get("missing_objective")  # an objective since replaced by one the record has: its result
        now_ranked = missed not in (None, objective) and objective and metric_value(metrics, objective) is not None
        if last.get("outcome") == "failed" and not newer and not now_ranked:
            return "failed", last.get("error", "")
        why = (metrics.get("divergence") or {}).get("reason", "") if metrics["status"] == DIVERGED else ""
        return metrics["status"], why  # a diverged run says which part of the divergence rule stopped it
    if not attempts:
        return PENDING, ""
    if why := interrupted(last):  # (its worker was killed: the table would say running until the next sweep)
        return PENDING, why
    if "ended" not in last:
        return RUNNING, ""
    if last.get("outcome") == "failed":
        return "failed", last.get("error", "")
    return PENDING, f"last attempt {last.get('outcome', 'ended')}"  # lost/interrupted: queued again


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def _resolved_value(run: RunDir, record: dict[str, Any] | None, path: str, stages: list[str]) -> Any:
    """The value the trial ran at axis path `path`, from the resolved config.yaml of the run directory that ran
    it (a pipeline: of the stage the path belongs to); _MISSING when there is no resolved config to read (a null is a
    value that ran: `window: null` is global attention, never 'not run')."""
    from study.config.sweep import route

    stage, field = route(path, stages)
    directory: Path | None = run.path
    if stage is not None:  # (a stage that never ran, after an earlier one diverged, has no directory)
        found = stage_run_dirs(record, run.path).get(stage)
        directory = Path(found) if found else None
    cfg = RunDir(directory).config if directory is not None else None
    if cfg is None or not cfg.is_file():
        return _MISSING
    return _field_of(load_yaml(cfg.read_text()) or {}, field)


_MISSING = object()


def _field_of(config: dict[str, Any], field: str) -> Any:
    """`section.name` of an experiment's config as a dict, as it runs: a field left unset (null, or absent from a
    config written before the field existed) is read as the value the config resolves it to, so that a run with
    `n_kv_heads: null` and one that spells out n_heads are the same model (MHA). _MISSING where it has no such field."""
    section, _, name = field.partition(".")
    value = (config.get(section) or {}).get(name, _MISSING)
    return value if value is not None and value is not _MISSING else _resolved_default(config, section, name, value)


def _resolved_default(config: dict[str, Any], section: str, name: str, unset: Any) -> Any:
    """The value the validated config gives an unset field: its default, or its `resolved_<name>` property where
    the config derives it from other fields (n_kv_heads -> n_heads, n_encoder_layers -> n_layers, d_ff from d_model
    and the activation); `unset` as it stands where the config does not validate (nothing to resolve it against)."""
    from study.config import ConfigError, ExperimentConfig

    try:
        part = getattr(ExperimentConfig.from_dict(config), section, None)
    except (ConfigError, ValueError, TypeError):
        return unset
    return part.resolved(name) if part is not None and hasattr(part, name) else unset


def ran_labels(plan: dict[str, Any], point: dict[str, Any], run: RunDir,
               record: dict[str, Any] | None) -> dict[str, str] | None:
    """Each axis's label as the trial ran it (the value whose fields all equal its resolved config), or None
    before it has run. '?' marks a resolved config that matches none of the axis's values."""
    from study.config.sweep import NOT_APPLICABLE, SweepConfig, route

    if record is None:
        return None
    spec = SweepConfig.from_dict(plan["spec"])
    by_name = {a.name: a for a in spec.parsed_axes()}
    # in the order the plan merged their assignments (plain axes, then conditional ones): where two set a field,
    # the later one's value is the one that ran
    applied = [by_name[name] for name, label in point["axes"].items() if name in by_name and label != NOT_APPLICABLE]
    out, stages = {}, spec.stage_names
    for i, axis in enumerate(applied):
        # a field a later axis of this point also sets is that axis's (a conditional axis refining this one's
        # value, as `window` refines `span: local`), compared however spelled (`model.nsp` is `pretrain.model.nsp`):
        # this axis is read on the fields left to it
        later = {route(f, stages) for other in applied[i + 1:] for f in other.values[point["axes"][other.name]]}
        own = [f for f in axis.values[point["axes"][axis.name]] if route(f, stages) not in later]
        ran = {f: _resolved_value(run, record, f, stages) for f in own}
        if not own or all(v is _MISSING for v in ran.values()):
            continue  # nothing of its own to read (or no resolved config: a stand-in run): the plan's label stands
        out[axis.name] = next((label for label, fields in _planned(point, axis, later, stages)
                               if all(_ran(ran, run, record, f, stages) == v for f, v in fields.items())), "?")
    return out


def _ran(ran: dict[str, Any], run: RunDir, record: dict[str, Any], path: str, stages: list[str]) -> Any:
    if path not in ran:  # a field only another value of the axis sets
        ran[path] = _resolved_value(run, record, path, stages)
    return ran[path]


def _planned(point: dict[str, Any], axis: Any, later: set[tuple], stages: list[str]):
    """(label, {field: value}) for each value of `axis`, the point's own first, on the fields not left to a later
    axis; each value as the validated config holds it, which is what a run writes: YAML reads `2e-3` as a string
    and the config stores 0.002, 'SST-2' as 'sst2'. The point's own value is its config's (plan.json); another value
    is this point's config with that value's fields applied, or, where that config is invalid, the spec's text."""
    from study.config.sweep import route

    own = point["axes"][axis.name]
    for label in [own, *(lab for lab in axis.labels if lab != own)]:
        fields = [f for f in axis.values[label] if route(f, stages) not in later]
        cfg = point["config"] if label == own else _with_fields(point["config"], axis.values[label], stages)
        yield label, {f: (_config_value(cfg, f, stages) if cfg is not None else axis.values[label][f]) for f in fields}


def _with_fields(config: dict[str, Any], fields: dict[str, Any], stages: list[str]) -> dict[str, Any] | None:
    from study.config import ConfigError, ExperimentConfig
    from study.config.experiment import set_fields
    from study.config.sweep import route

    by_stage = dict(config["stages"]) if stages else {None: config}
    for path, value in fields.items():
        stage, field = route(path, stages)
        try:
            by_stage[stage] = ExperimentConfig.from_dict(set_fields(by_stage[stage], {field: value})).to_dict()
        except (ConfigError, ValueError):
            return None
    return {**config, "stages": by_stage} if stages else by_stage[None]


def _config_value(config: dict[str, Any], path: str, stages: list[str]) -> Any:
    from study.config.sweep import route

    stage, field = route(path, stages)
    return _field_of(config["stages"][stage] if stage is not None else config, field)


def trial_row(plan: dict[str, Any], point: dict[str, Any], seed: int, run_dir: Path) -> dict[str, Any]:
    """One trial as a table row: identity, labels from what ran, outcome, metric.*, cost.*, provenance."""
    run = RunDir(run_dir)
    record = run.read()
    row: dict[str, Any] = {
        "sweep": plan["sweep"], "point": point["point"], "seed": seed, "trial_key": f"{point['point']}-s{seed}",
        "label": point["label"], "varied": point["varied"], "is_baseline": point["is_baseline"],
    }
    ran = ran_labels(plan, point, run, record if record and record.get("status") in FINISHED else None)
    for name, label in point["axes"].items():
        row[f"axis.{name}"] = (ran or {}).get(name, label)
    mismatched = {k: v for k, v in (ran or {}).items() if v != point["axes"].get(k)}
    row["ran_as_planned"] = not mismatched
    if mismatched:  # the plan refuses such axes; a row that slips through says what ran, never what was asked
        row["label"] = f"{point['label']} (ran: " + ", ".join(f"{k}={v}" for k, v in mismatched.items()) + ")"
    row.update(_task_columns(point["config"]))
    row.update(resolved_fields(plan, point, run, record if record and record.get("status") in FINISHED else None))
    attempts = own_attempts(read_json_or_none(run.trial), plan["sweep"])
    status, error = _status(record, attempts, _mtime(run.metrics), plan.get("objective", {}).get("metric"))
    row.update(status=status, attempts=_attempt_count(attempts), error=error)
    try:
        flat = flatten_record(record or {})
    except ValueError as err:  # a record this version cannot read: said with its file, not misread
        raise ValueError(f"{run.metrics}: {err}") from None
    flat.pop("status", None)
    row.update({k: flat.get(k) for k in ("steps", "diverged_at_step", "train_tokens", "stopped_by")})
    row.update({k: v for k, v in flat.items() if k.startswith(("metric.", "cost."))})
    row["run_dir"] = str(run_dir)
    row.update(_provenance(run))
    return row


def resolved_fields(plan: dict[str, Any], point: dict[str, Any], run: RunDir | None,
                    record: dict[str, Any] | None) -> dict[str, str]:
    """`config.<field>` for every field an axis of the sweep sets (plan.json's axis_fields), as text (`label_of`):
    the value the trial ran, read from its resolved config.yaml with unset fields resolved (`_field_of`), or, before
    it has run, the value its planned config resolves to. The report compares cells on these (does a cell an axis
    does not apply to hold that axis as the baseline does?), since it reads result files and never the config's
    defaults."""
    from study.config.sweep import label_of

    stages = [str(s) for s in plan.get("stages") or []]
    fields = dict.fromkeys(f for fs in (plan.get("axis_fields") or {}).values() for f in fs)
    out = {}
    for f in fields:
        value = _resolved_value(run, record, f, stages) if record is not None and run is not None else _MISSING
        if value is _MISSING:
            value = _config_value(point["config"], f, stages)
        out[f"config.{f}"] = None if value is _MISSING else label_of(value)
    return out


def _task_columns(cfg: dict[str, Any]) -> dict[str, Any]:
    """task and dataset of the point (a pipeline: its last stage's, the one the objective is measured on)."""
    if "stages" in cfg:
        cfg = list(cfg["stages"].values())[-1]
    return {"task": cfg["task"]["name"], "dataset": cfg["task"]["dataset"]}


def _provenance(run: RunDir) -> dict[str, Any]:
    env = read_json_or_none(run.env) or {}
    git = env.get("git") or {}
    data = read_json_or_none(run.data)
    return {
        "env.git": (git.get("commit", "") + ("+dirty" if git.get("dirty") else "")) if isinstance(git, dict) else git,
        "env.torch": (env.get("packages") or {}).get("torch"),
        "env.device": env.get("device"),  # the GPU's name, else the CPU's
        "env.cpu_capability": env.get("cpu_capability"),  # AVX2, AVX512, ...
        "env.native_bf16": env.get("native_bf16"),
        "env.precision": env.get("precision"),
        "env.threads": env.get("torch_threads"),
        "data.fingerprint": hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16] if data else None,
    }


def build_table(sweep_dir: str | Path):
    """The results DataFrame of a sweep, from plan.json and the run directories."""
    import pandas as pd

    layout = SweepLayout(Path(sweep_dir))
    plan = read_json(layout.plan_path)
    tuned = current_tuned(plan, read_tuned(layout))  # (another tuning's choice is not what these seeds ran)
    previous = {row["trial_key"]: row for row in read_previous(layout.sweep_dir / "results").to_dict("records")}
    rows = []
    for p in plan["points"]:
        chosen = tuned.get(p["point"], {})
        for s in plan["seeds"]:
            if plan.get("tune"):  # tuning mode: the seeds ran the point's tuned config (once tuning picked it)
                run_dir = layout.run_dir(chosen["point"], s) if chosen.get("point") else layout.run_dir("untuned", s)
                row = trial_row(plan, p, s, run_dir)
                # keyed by the tuning too: a row kept from an earlier table is kept only for these tuning settings
                row["trial_key"] = seed_key(plan, p["point"], s)
                row[f"tuned.{plan['tune']['field']}"] = chosen.get("value")
                if chosen.get("error") and row["status"] == "pending":
                    row.update(status="failed", error=chosen["error"])
            else:
                row = trial_row(plan, p, s, layout.run_dir(p["point"], s))
            kept = previous.get(row["trial_key"])
            # its run directory is not here, or holds an unfinished attempt while the table recorded it finished
            # (elsewhere): keep the recorded row
            if kept is not None and (not Path(row["run_dir"]).is_dir()
                                     or (kept.get("status") in FINISHED and row["status"] not in FINISHED)):
                row = _kept(kept, plan, p)
            rows.append(row)
    df = pd.DataFrame(rows)
    for column in df.columns:  # a column mixing numbers and text (a task's own marker) is kept as text
        kinds = {type(v) for v in df[column].dropna()}
        if str in kinds and len(kinds) > 1:
            df[column] = df[column].map(lambda v: None if v is None or v != v else str(v))
    first = [c for c in df.columns if not c.startswith(("metric.", "cost.", "config.", "env.", "data."))]
    rest = sorted(c for c in df.columns if c not in first)
    return df[first + rest]


def _kept(row: dict[str, Any], plan: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """A row kept from the table written before, with the `config.*` columns a table of older code lacks filled from
    the point's planned config where the trial ran as planned (its axis fields are then the plan's); left empty
    where it did not (the report then does not take them for the plan's)."""
    if str(row.get("ran_as_planned")).strip().lower() == "false":
        return row
    filled = resolved_fields(plan, point, None, None)
    return row | {k: v for k, v in filled.items() if row.get(k) is None or row.get(k) != row.get(k)}


def read_previous(stem: Path):
    """The table written before (`<stem>.parquet`, else `<stem>.csv`), or an empty one where there is none. One
    that is there but cannot be read is an error, not an empty table: its rows may be the only record of trials
    whose run directories are elsewhere, and a table rebuilt without them would lose them."""
    import pandas as pd

    try:
        table, _ = read_table([stem.with_suffix(".parquet"), stem.with_suffix(".csv")])
    except UnreadableTable as err:
        raise UnreadableTable(f"{err} cannot be read as the table written before; restore it (git checkout) or move "
                              "it aside to rebuild the table from the run directories alone") from None
    return table if table is not None else pd.DataFrame(columns=["trial_key"])


def curves_table(df, sweep_dir: Path):
    """Every trial's curves: its run's (stage "") and, for a study in stages, each stage's (`stages.<name>.run_dir`
    in its record); trials whose run directory is not here keep the rows the folder's curves.parquet holds."""
    import pandas as pd

    previous = read_previous(sweep_dir / "curves")
    frames = []
    for row in df.to_dict("records"):
        run_dir = Path(str(row.get("run_dir") or ""))
        if not run_dir.is_dir():
            frames.append(previous[previous["trial_key"] == row["trial_key"]])
            continue
        stage_dirs = stage_run_dirs(RunDir(run_dir).read(), run_dir)
        parts = [("", run_dir)] + [(name, Path(d)) for name, d in stage_dirs.items()]
        for stage, directory in parts:
            frame = RunDir(directory).read_curves()
            if frame is not None:
                frames.append(frame.assign(trial_key=row["trial_key"], stage=stage))
    frames = [f for f in frames if not f.empty]
    if not frames:
        return None
    curves = pd.concat(frames, ignore_index=True)
    first = ["trial_key", "stage", "step"]
    return curves[first + [c for c in curves.columns if c not in first]]


def write_table(sweep_dir: str | Path):
    """Rebuild and write results.parquet, results.csv and curves.parquet atomically; returns the DataFrame."""
    sweep_dir = Path(sweep_dir)
    df = build_table(sweep_dir)
    curves = curves_table(df, sweep_dir)
    if curves is not None:
        atomic_write(sweep_dir / "curves.parquet", lambda p: curves.to_parquet(p, index=False))
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
    """One row per tuning trial of the spec's tuning settings (tuning mode only): point, label, the setting tried,
    its objective (a completed trial's only; a pruned trial's last logged validation loss, a partial run's on the
    validation batches, is `last_val_loss` at `last_val_step`)."""
    import pandas as pd

    layout = SweepLayout(Path(sweep_dir))
    plan = read_json(layout.plan_path)
    if not plan.get("tune"):
        return None
    labels = {p["point"]: p["label"] for p in plan["points"]}
    columns = ["point", "label", "field", "value", "objective", "last_val_loss", "last_val_step", "status", "chosen",
               "run_dir"]
    rows = []
    for point, entry in current_tuned(plan, read_tuned(layout)).items():
        for t in entry.get("trials", []):
            rows.append({"point": point, "label": labels.get(point), "field": entry["field"], "value": t["value"],
                         "objective": t["objective"], "last_val_loss": t.get("last_val_loss"),
                         "last_val_step": t.get("last_val_step"), "status": t["status"],
                         "chosen": bool(entry.get("point")) and t["status"] == "completed"
                         and t.get("runs_point") == entry["point"],
                         "run_dir": t["run_dir"]})
    return pd.DataFrame(rows, columns=columns)


def summary(df, metric: str) -> str:
    """Mean, standard deviation and count of the objective per point, in the plan's order."""
    col = f"metric.{metric}"
    width = max([28, *(len(str(label)) for label in df["label"].unique())]) if "label" in df else 28
    lines = [f"{'point':<{width}} {'n':>2} {'done':>4} {metric:>12} {'sd':>8}  status"]
    for label, group in df.groupby("label", sort=False):
        done = group[group.status.isin(FINISHED)]
        values = done[col].dropna() if col in done else []
        mean = f"{values.mean():.4f}" if len(values) else "-"
        sd = f"{values.std(ddof=1):.4f}" if len(values) > 1 else "-"
        states = ", ".join(f"{k} {v}" for k, v in group.status.value_counts().items())
        lines.append(f"{label:<{width}} {len(group):>2} {len(done):>4} {mean:>12} {sd:>8}  {states}")
    return "\n".join(lines)
