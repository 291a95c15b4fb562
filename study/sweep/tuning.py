"""Tuning mode: before its seeds run, each point searches one numeric field (usually train.lr) with Optuna's TPE,
so variants are compared at their own best setting; the tuning trials train with a seed outside the compared ones.

Median pruning (Optuna's MedianPruner) may stop unpromising tuning trials early; it never applies to the seeds that
are compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from study.io import atomic_write_json
from study.record import RunDir, metric_value
from study.sweep.layout import SweepLayout, read_tuned, trial_specs
from study.sweep.queue import Claimed, TrialQueue


class PruningMonitor:
    """Median pruning of tuning trials (Optuna's MedianPruner), fed from the trial's own CSV log.

    The trial process never holds the storage URL (it may carry a password), so instead of a
    pruning callback inside the trial, the worker reads the validation losses the trial logs
    (`logs/metrics.csv`, column `val/loss`, flushed at every logged step), reports each new one
    to the tuning trial, and stops the trial when the pruner says so."""

    COLUMN = "val/loss"

    def __init__(self, trial, run_dir: Path) -> None:
        self.trial = trial
        self.path = run_dir / "logs" / "metrics.csv"
        self.reported: set[int] = set()
        self.last: float | None = None

    def should_prune(self) -> bool:
        import csv

        try:
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
        except OSError:
            return False
        for row in rows:
            value, step = row.get(self.COLUMN), row.get("step")
            if not value or not step or not step.isdigit() or int(step) in self.reported:
                continue
            try:
                self.last = float(value)
            except ValueError:  # a line still being written
                continue
            self.trial.report(self.last, int(step))
            self.reported.add(int(step))
        return bool(self.reported) and self.trial.should_prune()


def tune_study(queue: TrialQueue, plan: dict[str, Any], point: str, index: int = 0):
    """The per-point Optuna study whose TPE sampler proposes that point's tuning settings. The
    sampler is seeded per tuning trial (`index`), not per worker: workers that start together
    would otherwise draw the same first settings."""
    import optuna

    tune = plan["tune"]
    return optuna.create_study(
        study_name=f"{plan['sweep']}~tune~{point}", storage=queue.storage, direction=queue.direction,
        sampler=optuna.samplers.TPESampler(seed=tune["sampler_seed"] * 10007 + index,
                                           n_startup_trials=max(2, tune["trials"] // 3)),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2) if tune["pruner"] == "median" else optuna.pruners.NopPruner(),
        load_if_exists=True)


def start_tuning(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], claimed: Claimed):
    """Ask TPE for this tuning trial's setting; write the config it runs. Returns (config point, tune trial)."""
    import yaml

    from study.config import content_hash, experiment_from_dict
    from study.config.experiment import set_fields
    from study.config.sweep import route
    from study.io import atomic_write_text

    tune = plan["tune"]
    index = int(claimed.spec.key.rsplit("-tune", 1)[1])
    study = tune_study(queue, plan, claimed.spec.point, index)
    trial = study.ask()
    value = trial.suggest_float(tune["field"], tune["low"], tune["high"], log=tune["log"])
    data = yaml.safe_load(layout.point_config(claimed.spec.point).read_text())
    stage, field = route(tune["field"], plan.get("stages") or [])
    if stage is None:
        data = set_fields(data, {field: value})
    else:
        data["stages"][stage] = set_fields(data["stages"][stage], {field: value})
    cfg = experiment_from_dict(data)
    digest = content_hash(cfg)
    atomic_write_text(layout.point_config(digest), cfg.replace(name=f"point-{digest}").to_yaml())
    queue.storage.set_trial_user_attr(claimed.trial_id, "runs_point", digest)
    queue.storage.set_trial_user_attr(claimed.trial_id, "tuned_value", value)
    return digest, study, trial


def finish_tuning_trial(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], claimed: Claimed,
                         study, trial, runs_point: str, status: str, value: float | None, tell: bool = True) -> None:
    """Tell TPE the outcome, record it in tuned.json, and settle the point if its tuning is over."""
    import math

    from optuna.trial import TrialState

    if tell:
        ok = status == "completed" and value is not None and math.isfinite(value)
        state = TrialState.PRUNED if status == "pruned" else TrialState.COMPLETE if ok else TrialState.FAIL
        study.tell(trial, value if ok else None, state=state)
    tune = plan["tune"]
    point = claimed.spec.point
    with queue.lock():
        tuned = read_tuned(layout)
        entry = tuned.setdefault(point, {"field": tune["field"], "trials": []})
        entry["trials"].append({"key": claimed.spec.key, "value": trial.params.get(tune["field"]), "status": status,
                                "objective": value, "runs_point": runs_point,
                                "run_dir": str(layout.run_dir(runs_point, claimed.spec.seed))})
        atomic_write_json(layout.tuned_path, tuned)
        settle_tuning_locked(queue, layout, plan, [point])


def settle_tuning_locked(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], points: list[str]) -> None:
    """For each point whose tuning trials are all over: pick the best setting (once) and queue the
    point's seed trials with it. The caller holds `queue.lock()`, so this happens exactly once."""
    from optuna.trial import TrialState

    tune = plan["tune"]
    tuned = read_tuned(layout)
    groups = queue.by_key()
    changed = False
    for point in points:
        keys = [f"{point}-tune{i}" for i in range(tune["trials"])]
        settled = all(any(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in groups.get(k, []))
                      and not any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in groups.get(k, []))
                      for k in keys)
        entry = tuned.get(point)
        if not settled or entry is None:
            continue
        if not entry.get("point") and not entry.get("error"):
            study = tune_study(queue, plan, point)
            finished = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
            best = (min if queue.direction == "minimize" else max)(finished, key=lambda t: t.value) if finished else None
            chosen = best and next((t for t in entry["trials"] if t["status"] == "completed"
                                    and t["value"] == best.params[tune["field"]]), None)
            if chosen:
                entry.update(value=chosen["value"], objective=best.value, point=chosen["runs_point"])
            else:
                entry["error"] = "no tuning trial finished; the point's seeds cannot run"
            changed = True
        if entry.get("point"):
            specs = [s for s in trial_specs(plan, tuned) if s.point == point and s.kind == "seed"]
            done = {s.key: metric_value(m, plan["objective"]["metric"]) for s in specs
                    if (m := RunDir(layout.run_dir(entry["point"], s.seed)).finished()) is not None}
            queue.sync_locked(specs, done)
    if changed:
        atomic_write_json(layout.tuned_path, tuned)
