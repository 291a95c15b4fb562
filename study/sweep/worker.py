"""A sweep worker: claim a trial, run it in a fresh subprocess while proving it is alive,
record the outcome, repeat until no trial is waiting or running anywhere.

`python -m study.sweep.worker --sweep-dir results/<sweep>` is what `study sweep --workers N`
starts N times; the storage URL comes from $STUDY_STORAGE (never the command line, where
`ps` would show its password).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from study.io import atomic_write_json, read_json, read_json_or_none
from study.sweep.queue import Claimed, TrialQueue, TrialSpec
from study.sweep.trial import DEFAULT_RUNNER

log = logging.getLogger(__name__)
FINISHED = ("completed", "diverged")
STORAGE_ENV = "STUDY_STORAGE"


def die_with_parent() -> None:
    """Run in the child before exec: the kernel kills it when its parent (the worker) dies, so a
    killed worker never leaves an orphan training into a run directory a retry will use."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class SweepLayout:
    """Where a sweep's files live: results/<sweep>/ for the sweep, results/runs/ for the runs."""

    sweep_dir: Path

    @property
    def results_root(self) -> Path:
        return self.sweep_dir.parent

    def run_dir(self, point: str, seed: int) -> Path:
        return self.results_root / "runs" / point / f"seed-{seed}"

    def point_config(self, point: str) -> Path:
        return self.sweep_dir / "points" / f"{point}.yaml"

    @property
    def plan_path(self) -> Path:
        return self.sweep_dir / "plan.json"


def trial_specs(plan: dict[str, Any], tuned: dict[str, Any] | None = None) -> list[TrialSpec]:
    """Every trial the plan asks for. In tuning mode: each point's tuning trials, and its seed
    trials once its tuning has picked a setting (`tuned`, from tuned.json)."""
    tune = plan.get("tune") or {}
    specs: list[TrialSpec] = []
    for p in plan["points"]:
        point, label = p["point"], p["label"]
        if not tune:
            specs += [TrialSpec(key=f"{point}-s{s}", point=point, seed=s, label=label) for s in plan["seeds"]]
            continue
        specs += [TrialSpec(key=f"{point}-tune{i}", point=point, seed=tune["seed"], label=label, kind="tune")
                  for i in range(tune["trials"])]
        chosen = (tuned or {}).get(point, {}).get("point")
        if chosen:
            specs += [TrialSpec(key=f"{point}-s{s}", point=point, seed=s, label=label, config_point=chosen)
                      for s in plan["seeds"]]
    return specs


def all_keys(plan: dict[str, Any]) -> list[str]:
    """Every key the sweep will have when done (seed trials of tuned points included)."""
    tune = plan.get("tune") or {}
    keys = []
    for p in plan["points"]:
        keys += [f"{p['point']}-tune{i}" for i in range(tune.get("trials", 0))]
        keys += [f"{p['point']}-s{s}" for s in plan["seeds"]]
    return keys


def read_tuned(layout: "SweepLayout") -> dict[str, Any]:
    path = layout.sweep_dir / "tuned.json"
    return read_json(path) if path.is_file() else {}


def finished_run(run_dir: Path) -> dict[str, Any] | None:
    metrics = read_json_or_none(run_dir / "metrics.json")
    return metrics if metrics and metrics.get("status") in FINISHED else None


def objective_value(metrics: dict[str, Any], metric: str) -> float | None:
    value = metrics.get("metrics", {}).get(metric)
    return float(value) if isinstance(value, (int, float)) else None


def _record_attempt(run_dir: Path, spec: TrialSpec, sweep: str, attempt: dict[str, Any]) -> None:
    """Append (or update) this attempt in run_dir/trial.json, the file record of every attempt."""
    path = run_dir / "trial.json"
    record = read_json(path) if path.is_file() else {"key": spec.key, "point": spec.point, "seed": spec.seed,
                                                      "attempts": []}
    attempts = [a for a in record["attempts"] if a.get("id") != attempt["id"]]
    record["attempts"] = attempts + [attempt]
    record.setdefault("sweeps", [])
    if sweep not in record["sweeps"]:
        record["sweeps"].append(sweep)
    atomic_write_json(path, record)


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class WorkerOptions:
    data_dir: str | None = None
    cache_dir: str | None = None
    threads: int = 1
    runner: str = DEFAULT_RUNNER
    poll_s: float = 2.0
    max_trials: int | None = None  # stop after this many (tests)


@dataclass
class WorkerSummary:
    ran: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


class TrialLost(Exception):
    """Another worker declared this worker's trial lost and re-queued it."""


class TrialPruned(Exception):
    """The tuning pruner stopped this tuning trial early."""


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


def _tune_study(queue: TrialQueue, plan: dict[str, Any], point: str, index: int = 0):
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


def _start_tuning(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], claimed: Claimed):
    """Ask TPE for this tuning trial's setting; write the config it runs. Returns (config point, tune trial)."""
    from study.config import ExperimentConfig
    from study.config.experiment import set_fields
    from study.io import atomic_write_text
    from study.sweep.plan import point_hash

    tune = plan["tune"]
    index = int(claimed.spec.key.rsplit("-tune", 1)[1])
    study = _tune_study(queue, plan, claimed.spec.point, index)
    trial = study.ask()
    value = trial.suggest_float(tune["field"], tune["low"], tune["high"], log=tune["log"])
    base = ExperimentConfig.from_yaml(layout.point_config(claimed.spec.point))
    cfg = ExperimentConfig.from_dict(set_fields(base.to_dict(), {tune["field"]: value}))
    digest = point_hash(cfg)
    atomic_write_text(layout.point_config(digest), cfg.replace(name=f"point-{digest}").to_yaml())
    queue.storage.set_trial_user_attr(claimed.trial_id, "config_point", digest)
    queue.storage.set_trial_user_attr(claimed.trial_id, "tuned_value", value)
    return digest, study, trial


def _finish_tuning_trial(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], claimed: Claimed,
                         study, trial, config_point: str, status: str, value: float | None, tell: bool = True) -> None:
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
                                "objective": value, "config_point": config_point,
                                "run_dir": str(layout.run_dir(config_point, claimed.spec.seed))})
        atomic_write_json(layout.sweep_dir / "tuned.json", tuned)
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
            study = _tune_study(queue, plan, point)
            finished = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
            best = (min if queue.direction == "minimize" else max)(finished, key=lambda t: t.value) if finished else None
            chosen = best and next((t for t in entry["trials"] if t["status"] == "completed"
                                    and t["value"] == best.params[tune["field"]]), None)
            if chosen:
                entry.update(value=chosen["value"], objective=best.value, point=chosen["config_point"])
            else:
                entry["error"] = "no tuning trial finished; the point's seeds cannot run"
            changed = True
        if entry.get("point"):
            specs = [s for s in trial_specs(plan, tuned) if s.point == point and s.kind == "seed"]
            done = {s.key: objective_value(m, plan["objective"]["metric"]) for s in specs
                    if (m := finished_run(layout.run_dir(entry["point"], s.seed))) is not None}
            queue.sync_locked(specs, done)
    if changed:
        atomic_write_json(layout.sweep_dir / "tuned.json", tuned)


def run_trial(queue: TrialQueue, layout: SweepLayout, claimed: Claimed, plan: dict[str, Any],
              opts: WorkerOptions) -> str:
    """Run one claimed trial in a subprocess; returns completed, diverged, failed or lost."""
    import optuna

    sweep, metric = plan["sweep"], plan["objective"]["metric"]
    spec = claimed.spec
    tuning = None
    config_point = spec.config_point or spec.point
    if spec.kind == "tune":
        config_point, study, tune_trial = _start_tuning(queue, layout, plan, claimed)
        tuning = (study, tune_trial)
    run_dir = layout.run_dir(config_point, spec.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    attempt = {"id": f"{sweep}#{claimed.number}", "trial": claimed.number, "attempt": claimed.attempt,
               "worker": queue.worker, "started": time.time(), "kind": spec.kind}
    _record_attempt(run_dir, spec, sweep, attempt)
    cmd = [sys.executable, "-m", "study.sweep.trial", "--config", str(layout.point_config(config_point)),
           "--seed", str(spec.seed), "--run-dir", str(run_dir), "--runner", opts.runner]
    if opts.data_dir:
        cmd += ["--data-dir", str(opts.data_dir)]
    if opts.cache_dir:
        cmd += ["--cache-dir", str(opts.cache_dir)]
    env = {k: v for k, v in os.environ.items() if k != STORAGE_ENV}
    env.update(OMP_NUM_THREADS=str(opts.threads), MKL_NUM_THREADS=str(opts.threads), PYTHONUNBUFFERED="1")
    log_path = run_dir / "trial.log"
    pruning = PruningMonitor(tuning[1], run_dir) if tuning and plan["tune"]["pruner"] != "none" else None
    with open(log_path, "ab") as out:
        out.write(f"\n=== {sweep} trial {claimed.number} attempt {claimed.attempt} on {queue.worker} ===\n".encode())
        out.flush()
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
        try:
            while True:
                try:
                    rc = child.wait(timeout=queue.heartbeat_s)
                    break
                except subprocess.TimeoutExpired:
                    try:
                        queue.beat(claimed)
                    except optuna.exceptions.UpdateFinishedTrialError:
                        raise TrialLost() from None
                    if not queue.still_mine(claimed):
                        raise TrialLost()
                    if pruning is not None and pruning.should_prune():
                        raise TrialPruned()
        except TrialPruned:
            child.kill()
            child.wait()
            attempt.update(ended=time.time(), outcome="pruned")
            _record_attempt(run_dir, spec, sweep, attempt)
            queue.finish(claimed, "pruned", pruning.last, {"run_dir": str(run_dir)})
            _finish_tuning_trial(queue, layout, plan, claimed, *tuning, config_point, "pruned", pruning.last)
            return "pruned"
        except TrialLost:
            child.kill()
            child.wait()
            attempt.update(ended=time.time(), outcome="lost")
            _record_attempt(run_dir, spec, sweep, attempt)
            if tuning:
                tuning[0].tell(tuning[1], state=optuna.trial.TrialState.FAIL)
            return "lost"
        except BaseException:  # Ctrl-C or SIGTERM: stop the child, give the trial back
            child.kill()
            child.wait()
            attempt.update(ended=time.time(), outcome="interrupted")
            _record_attempt(run_dir, spec, sweep, attempt)
            queue.release(claimed, "worker interrupted")
            if tuning:
                tuning[0].tell(tuning[1], state=optuna.trial.TrialState.FAIL)
            raise
    metrics = finished_run(run_dir)
    attempt.update(ended=time.time(), returncode=rc)
    if rc == 0 and metrics is not None:
        attempt["outcome"] = metrics["status"]
        _record_attempt(run_dir, spec, sweep, attempt)
        value = objective_value(metrics, metric)
        queue.finish(claimed, metrics["status"], value,
                     {"run_dir": str(run_dir), "steps": metrics.get("steps"),
                      "diverged_at_step": metrics.get("diverged_at_step")})
        if tuning:
            _finish_tuning_trial(queue, layout, plan, claimed, *tuning, config_point, metrics["status"], value)
        return metrics["status"]
    error = _log_tail(log_path) or f"exit code {rc}"
    if rc == 0:
        error += "\n(the trial exited without writing a finished metrics.json)"
    attempt.update(outcome="failed", error=error.splitlines()[-1] if error else "")
    _record_attempt(run_dir, spec, sweep, attempt)
    requeued = queue.fail(claimed, error)
    if tuning:
        tuning[0].tell(tuning[1], state=optuna.trial.TrialState.FAIL)
        if not requeued:  # this tuning trial failed for good: the point's tuning may now be settled
            _finish_tuning_trial(queue, layout, plan, claimed, *tuning, config_point, "failed", None, tell=False)
    return "failed"


def run_worker(queue: TrialQueue, layout: SweepLayout, opts: WorkerOptions) -> WorkerSummary:
    """Drain the queue. Stays while other workers' trials run, since a lost one comes back."""
    plan = read_json(layout.plan_path)
    keys = set(all_keys(plan))
    summary = WorkerSummary()
    while opts.max_trials is None or len(summary.ran) < opts.max_trials:
        queue.reap_lost()
        claimed = queue.claim(keys)
        if claimed is None:
            specs = trial_specs(plan, read_tuned(layout))
            counts = queue.counts([s.key for s in specs])
            if counts["running"] or counts["queued"]:
                time.sleep(opts.poll_s)
                continue
            if queue.sync(specs, retry_failed=False)["enqueued"]:  # keys dropped in a duplicate race
                continue
            break
        log.info("%s: trial %d %s%s seed %d (attempt %d)", queue.worker, claimed.number, claimed.spec.label,
                 " (tuning)" if claimed.spec.kind == "tune" else "", claimed.spec.seed, claimed.attempt)
        outcome = run_trial(queue, layout, claimed, plan, opts)
        log.info("%s: trial %d %s seed %d: %s", queue.worker, claimed.number, claimed.spec.label,
                 claimed.spec.seed, outcome)
        summary.ran.append(claimed.spec.key)
        if outcome == "failed":
            summary.failed.append(claimed.spec.key)
        elif outcome == "lost":
            summary.lost.append(claimed.spec.key)
    return summary


def open_queue(plan: dict[str, Any], storage_url: str) -> TrialQueue:
    from study.sweep.storage import open_storage

    spec = plan["spec"]
    return TrialQueue(open_storage(storage_url), plan["sweep"], plan["objective"]["direction"],
                      heartbeat_s=spec["heartbeat_s"], grace_s=spec["grace_s"], max_retries=spec["max_retries"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.sweep.worker")
    parser.add_argument("--sweep-dir", required=True)
    parser.add_argument("--data-dir")
    parser.add_argument("--cache-dir")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runner", default=DEFAULT_RUNNER)
    parser.add_argument("--poll-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    url = os.environ.get(STORAGE_ENV)
    if not url:
        print(f"worker: set ${STORAGE_ENV} to the sweep's storage URL", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_trial's cleanup gives the trial back
    layout = SweepLayout(Path(args.sweep_dir))
    plan = read_json(layout.plan_path)
    queue = open_queue(plan, url)
    run_worker(queue, layout, WorkerOptions(data_dir=args.data_dir, cache_dir=args.cache_dir, threads=args.threads,
                                            runner=args.runner, poll_s=args.poll_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
