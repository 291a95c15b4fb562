"""Tuning mode: before its seeds run, each point searches one numeric field (usually train.lr) with Optuna's TPE,
so variants are compared at their own best setting; the tuning trials train with a seed outside the compared ones.

Median pruning (Optuna's MedianPruner) may stop unpromising tuning trials early; it never applies to the seeds that
are compared.

What a tuning trial ended with is recorded in tuned.json (under the tuning settings that ran it, `layout.tuning_id`);
the setting is chosen from those records, and a record a killed worker could not write is rebuilt from the queue and
the run directory, so a kill never costs a point its seeds.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from study.io import atomic_write_json
from study.record import RunDir, metric_value
from study.sweep.layout import (SweepLayout, current_tuned, finished_results, read_tuned, trial_specs, tuning_id,
                                tuning_index, tuning_key)
from study.sweep.queue import Claimed, TrialQueue, error_summary, retry_pending


class PruningMonitor:
    """Median pruning of tuning trials (Optuna's MedianPruner), fed from the trial's own CSV log.

    The trial process never holds the storage URL (it may carry a password), so instead of a
    pruning callback inside the trial, the worker reads the validation losses the trial logs
    (`logs/metrics.csv` of `run_dir`, flushed at every logged step; the column `pruning_column` names), reports
    each new one to the tuning trial, and stops the trial when the pruner says so."""

    def __init__(self, trial, run_dir: Path, column: str) -> None:
        self.trial, self.column = trial, column
        self.path = run_dir / "logs" / "metrics.csv"
        self.reported: set[int] = set()
        self.last: float | None = None
        self.last_step: int | None = None

    def should_prune(self) -> bool:
        import csv

        try:
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
        except OSError:
            return False
        for row in rows:
            value, step = row.get(self.column), row.get("step")
            if not value or not step or not step.isdigit() or int(step) in self.reported:
                continue
            try:
                self.last = float(value)
            except ValueError:  # a line still being written
                continue
            self.last_step = int(step)
            self.trial.report(self.last, int(step))
            self.reported.add(int(step))
        return bool(self.reported) and self.trial.should_prune()


def pruning_column(plan: dict[str, Any]) -> str:
    """The validation curve the pruner judges a tuning trial by: the one the objective's task declares comparable
    across its runs (`curves['valid']`), e.g. pretraining's MLM loss, not its `val/loss` (MLM + NSP)."""
    task = plan["objective"]["task"]
    curves = ((plan.get("tasks") or {}).get(task) or {}).get("curves") or {}
    if not curves.get("valid"):
        raise ValueError(f"plan.json declares no validation curve for task {task!r}: median pruning has nothing to "
                         "read (run `study sweep` again: it rewrites the plan with the task's declarations)")
    return str(curves["valid"])


def pruned_run_dir(layout: SweepLayout, plan: dict[str, Any], runs_point: str, seed: int, run_dir: Path) -> Path:
    """The run directory whose validation log the pruner reads: the trial's own, or in a study in stages that of the
    stage whose run writes the objective (an earlier stage trains in its shared directory, the last stage inside the
    trial's), found as the trial process will find it (`study.run.pipeline.stage_dir`)."""
    stages = plan.get("stages") or []
    if not stages:
        return run_dir
    from study.config import experiment_from_dict
    from study.io import load_yaml
    from study.run.pipeline import resolved_precision, stage_dir
    from study.sweep.reach import objective_stage

    cfg = resolved_precision(experiment_from_dict(load_yaml(layout.point_config(runs_point).read_text()))
                             .with_seed(seed))
    return stage_dir(cfg, objective_stage(plan["objective"]["metric"], stages), run_dir, layout.runs_root)


def tune_study(queue: TrialQueue, plan: dict[str, Any], point: str, index: int = 0, fixed: float | None = None):
    """The per-point Optuna study whose TPE sampler proposes that point's tuning settings; its name carries the
    tuning settings (`tuning_id`), so changed settings (or a changed objective direction, which Optuna would keep
    for a study it loads) start a new search. The sampler is seeded per tuning trial (`index`), not per worker:
    workers that start together would otherwise draw the same first settings. With `fixed`, the trial it asks for
    runs that setting (a retry's; Optuna's PartialFixedSampler, so no other worker can take it as enqueue_trial's
    waiting trial could be taken)."""
    import warnings

    import optuna

    tune = plan["tune"]
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if tune["pruner"] == "median" else \
        optuna.pruners.NopPruner()
    sampler = optuna.samplers.TPESampler(seed=tune["sampler_seed"] * 10007 + index,
                                         n_startup_trials=max(2, tune["trials"] // 3))
    if fixed is not None:
        with warnings.catch_warnings():  # experimental since Optuna 2.4, unchanged since
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.PartialFixedSampler({tune["field"]: fixed}, sampler)
    return optuna.create_study(
        study_name=f"{plan['sweep']}~tune~{point}~{tuning_id(plan)}", storage=queue.storage,
        direction=queue.direction, pruner=pruner, load_if_exists=True, sampler=sampler)


def end_given_up(queue: TrialQueue, plan: dict[str, Any], trials: list) -> None:
    """The TPE trial of each tuning attempt the reaper failed for good ends as failed: no retry starts at its
    setting to end it (`start_tuning`), and the point's tuning study would hold it running for good."""
    from optuna.trial import TrialState

    for t in trials:
        point, key = t.user_attrs.get("point"), str(t.user_attrs.get("key"))
        # (only this tuning's: the key names the tuning, whose TPE study holds the trial)
        if "tune_trial" in t.user_attrs and key == tuning_key(plan, point, tuning_index(key)):
            study = tune_study(queue, plan, point, tuning_index(key))
            study.tell(t.user_attrs["tune_trial"], state=TrialState.FAIL, skip_if_finished=True)


def start_tuning(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], claimed: Claimed):
    """Ask TPE for this tuning trial's setting; write the config it runs. Returns (config point, study, tune trial)."""
    from optuna.trial import TrialState

    from study.config import content_hash, experiment_from_dict
    from study.config.experiment import set_fields
    from study.config.sweep import route
    from study.io import atomic_write_text, load_yaml

    tune = plan["tune"]
    drawn, before = _drawn_before(queue, claimed)
    study = tune_study(queue, plan, claimed.spec.point, tuning_index(claimed.spec.key), fixed=drawn)
    if before is not None:  # where a killed worker left it running, it ends here (this trial runs its setting)
        study.tell(before, state=TrialState.FAIL, skip_if_finished=True)
    trial = study.ask()
    try:
        queue.storage.set_trial_user_attr(claimed.trial_id, "tune_trial", trial.number)
        value = trial.suggest_float(tune["field"], tune["low"], tune["high"], log=tune["log"])
        data = load_yaml(layout.point_config(claimed.spec.point).read_text())
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
    except Exception:  # the attempt fails or was taken back (the worker records which): TPE must not wait for this
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)  # setting's result
        raise
    return digest, study, trial


def _drawn_before(queue: TrialQueue, claimed: Claimed) -> tuple[float | None, int | None]:
    """(the setting it ran, its TPE trial's number) of the attempt this claim retries, each None where there is
    none (a first attempt; one stopped before it drew or wrote its config). A retry runs the setting its attempt
    drew, as any retried trial reruns its config: the same run directory, so it resumes from the attempt's last
    checkpoint (a fresh draw would restart from step 0 at another setting, and leave the TPE trial of an attempt
    whose worker was killed running for good)."""
    before = next((t for t in queue.by_key().get(claimed.spec.key, []) if t.number == claimed.retry_of), None)
    if before is None:
        return None, None
    value = before.user_attrs.get("tuned_value")  # (the key names the tuning settings: the same search space)
    return (None if value is None else float(value)), before.user_attrs.get("tune_trial")


def finish_tuning_trial(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], claimed: Claimed,
                        study, trial, runs_point: str, status: str, value: float | None, tell: bool = True,
                        **extra: Any) -> None:
    """Tell TPE the outcome, record it in tuned.json, and settle the point if its tuning is over. `value` is the
    objective of a completed trial; a pruned or diverged one has none (`extra`: the last validation loss it logged,
    with its step), a failed one its error."""
    from optuna.trial import TrialState

    ok = status == "completed" and value is not None and math.isfinite(value)
    if tell and status == "diverged":  # a result, the worst there is: TPE ranks it below every other and steers
        # away from it (told as a failure, TPE would ignore it and keep proposing the region where lr diverges; told
        # as pruned, it would outrank a trial pruned at an earlier step)
        study.tell(trial, math.inf if study.direction.name == "MINIMIZE" else -math.inf)
    elif tell:
        state = TrialState.PRUNED if status == "pruned" else TrialState.COMPLETE if ok else TrialState.FAIL
        study.tell(trial, value if ok else None, state=state)
    record_tuning_trial(queue, layout, plan, claimed.spec.point, {
        "key": claimed.spec.key, "value": trial.params.get(plan["tune"]["field"]), "status": status,
        "objective": value if ok else None, "runs_point": runs_point,
        "run_dir": str(layout.run_dir(runs_point, claimed.spec.seed)), **extra})


def record_tuning_trial(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], point: str,
                        record: dict[str, Any]) -> None:
    """Append one tuning trial's outcome to its point's tuned.json entry, then settle the point if its tuning is
    over (under the sweep's lock: workers of one point write the file in turn). Where another worker settled the
    point between this trial's end in the queue and this call, it recovered this outcome from the queue
    (`_recover`): this record replaces that one rather than listing the trial twice."""
    with queue.lock():
        tuned = read_tuned(layout)
        trials = entry_for(tuned, point, plan)["trials"]
        trials[:] = [t for t in trials if not (t.get("recovered") and t["key"] == record["key"]
                                               and t["status"] == record["status"])]
        trials.append(record)
        atomic_write_json(layout.tuned_path, tuned)
        settle_tuning_locked(queue, layout, plan, [point])


def entry_for(tuned: dict[str, Any], point: str, plan: dict[str, Any]) -> dict[str, Any]:
    """The point's tuned.json entry for this plan's tuning settings, made current in `tuned`: an entry of other
    settings is kept under `superseded` (by its `tuning`), and one kept there for these settings comes back."""
    fingerprint, entry = tuning_id(plan), tuned.get(point)
    if entry is not None and entry.get("tuning") == fingerprint:
        return entry
    earlier = dict((entry or {}).get("superseded") or {})
    if entry is not None:
        earlier[str(entry.get("tuning", "unrecorded"))] = {k: v for k, v in entry.items() if k != "superseded"}
    tune = plan["tune"]
    current = earlier.pop(fingerprint, None) or {
        "tuning": fingerprint, "field": tune["field"], "settings": dict(tune),
        "ranked_by": {k: plan["objective"][k] for k in ("metric", "direction")}, "trials": []}
    tuned[point] = {**current, **({"superseded": earlier} if earlier else {})}
    return tuned[point]


def retryable(specs: list, plan: dict[str, Any], tuned: dict[str, Any]) -> list:
    """The trials a rerun may queue again: all but the tuning trials of a point whose setting is chosen. A point's
    setting is chosen once, so a failed tuning trial retried after it could not change it: it would train for
    nothing, and its result would sit in tuned.json beside a choice it may beat."""
    chosen = {point for point, entry in current_tuned(plan, tuned).items() if entry.get("point")}
    return [s for s in specs if s.kind != "tune" or s.point not in chosen]


def settle_points(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], points: list[str]) -> None:
    """`settle_tuning_locked` under the sweep's lock, for a caller that does not hold it."""
    with queue.lock():
        settle_tuning_locked(queue, layout, plan, points)


def settle_tuning_locked(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], points: list[str]) -> None:
    """For each point whose tuning trials are all over: choose the best setting among the completed tuning trials
    (once) and queue the point's seed trials with it. A point whose tuning runs again (a rerun retrying its failed
    tuning trials) loses the error it settled with: it is judged again when that tuning ends. The caller holds
    `queue.lock()`, so this happens exactly once."""
    import json

    tuned = read_tuned(layout)
    before = json.dumps(tuned, sort_keys=True)
    groups = queue.by_key()
    for point in points:
        keys = [tuning_key(plan, point, i) for i in range(plan["tune"]["trials"])]
        if not all(_over(groups.get(k, [])) for k in keys):
            if tuned.get(point, {}).get("tuning") == tuning_id(plan):
                tuned[point].pop("error", None)
            continue
        entry = entry_for(tuned, point, plan)
        _recover(layout, plan, entry, keys, groups)
        if not entry.get("point"):
            _choose(entry, plan["objective"]["direction"])
        if entry.get("point"):
            specs = [s for s in trial_specs(plan, tuned) if s.point == point and s.kind == "seed"]
            # the run directories are the record: a seed key whose run is not finished on disk runs (again)
            queue.sync_locked(specs, finished_results(layout, specs, plan["objective"]["metric"]), verify_files=True)
    if json.dumps(tuned, sort_keys=True) != before:
        atomic_write_json(layout.tuned_path, tuned)


def unsettled_points(layout: SweepLayout, plan: dict[str, Any]) -> list[str]:
    """The points of this plan's tuning whose setting is not chosen yet (tuned.json has no `point` for them)."""
    tuned = current_tuned(plan, read_tuned(layout))
    return [p["point"] for p in plan["points"] if not tuned.get(p["point"], {}).get("point")]


def _over(trials: list) -> bool:
    """Whether a tuning key has ended: a completed or failed trial, none waiting or running, and no failed attempt
    whose retry its worker has yet to queue."""
    from optuna.trial import TrialState

    return (any(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
            and not any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in trials)
            and not retry_pending(trials))


def _recover(layout: SweepLayout, plan: dict[str, Any], entry: dict[str, Any], keys: list[str], groups) -> None:
    """Add the tuning trials the queue saw end but tuned.json lacks (a worker killed between recording the result in
    the queue and writing tuned.json), from the queue's attributes and the trial's run directory."""
    from optuna.trial import TrialState

    ended = {t["key"] for t in entry["trials"] if t["status"] != "failed"}
    failed = {t["key"] for t in entry["trials"] if t["status"] == "failed"}
    for key in keys:
        trials = sorted(groups.get(key, []), key=lambda t: t.number)
        done = next((t for t in trials if t.state == TrialState.COMPLETE), None)
        if done is not None and key not in ended:
            entry["trials"].append(_recovered(layout, plan, key, done))
        elif done is None and key not in ended | failed and trials:
            entry["trials"].append(_recovered(layout, plan, key, trials[-1]))


def _recovered(layout: SweepLayout, plan: dict[str, Any], key: str, trial) -> dict[str, Any]:
    attrs = trial.user_attrs
    runs_point = attrs.get("runs_point")
    run_dir = layout.run_dir(runs_point, int(attrs["seed"])) if runs_point else None
    status = attrs.get("status", "failed")
    record = {"key": key, "value": attrs.get("tuned_value"), "status": status, "objective": None,
              "runs_point": runs_point, "run_dir": str(run_dir) if run_dir else None,
              "recovered": "from the queue and the run directory: its worker stopped before recording it here"}
    if status == "completed" and run_dir is not None:
        finished = RunDir(run_dir).finished()
        record["objective"] = metric_value(finished, plan["objective"]["metric"]) if finished else None
    if status == "pruned":
        record.update(last_val_loss=attrs.get("last_val_loss"), last_val_step=attrs.get("last_val_step"))
    if status == "failed" and attrs.get("error"):
        record["error"] = error_summary(attrs["error"])
    return record


def _choose(entry: dict[str, Any], direction: str) -> None:
    """The best completed tuning trial's setting, or the error that leaves the point's seeds unrun."""
    done = [t for t in entry["trials"] if t["status"] == "completed" and t.get("runs_point")
            and isinstance(t.get("objective"), (int, float)) and math.isfinite(t["objective"])]
    if done:
        best = (min if direction == "minimize" else max)(done, key=lambda t: t["objective"])
        entry.update(value=best["value"], objective=best["objective"], point=best["runs_point"])
        entry.pop("error", None)
        return
    errors = [t["error"] for t in entry["trials"] if t.get("error")]
    entry["error"] = ("no tuning trial finished" + (f" (the last error: {errors[-1]})" if errors else "")
                      + "; the point's seeds cannot run")
