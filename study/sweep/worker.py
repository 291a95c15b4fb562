"""A sweep worker: claim a trial, run it in a fresh subprocess while proving it is alive,
record the outcome, repeat until no trial is waiting or running anywhere.

`python -m study.sweep.worker --sweep-dir results/<sweep>` is what `study sweep --workers N`
starts N times; the storage URL comes from $STUDY_STORAGE (never the command line, where
`ps` would show its password).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from study.io import atomic_write_json, read_json
from study.sweep.queue import Claimed, TrialQueue, TrialSpec
from study.sweep.trial import DEFAULT_RUNNER

log = logging.getLogger(__name__)
FINISHED = ("completed", "diverged")
STORAGE_ENV = "STUDY_STORAGE"


def _die_with_parent() -> None:
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


def trial_specs(plan: dict[str, Any]) -> list[TrialSpec]:
    return [TrialSpec(key=f"{p['point']}-s{s}", point=p["point"], seed=s, label=p["label"])
            for p in plan["points"] for s in plan["seeds"]]


def finished_run(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "metrics.json"
    if not path.is_file():
        return None
    try:
        metrics = read_json(path)
    except (OSError, json.JSONDecodeError):
        return None
    return metrics if metrics.get("status") in FINISHED else None


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


def run_trial(queue: TrialQueue, layout: SweepLayout, claimed: Claimed, metric: str, opts: WorkerOptions,
              sweep: str) -> str:
    """Run one claimed trial in a subprocess; returns completed, diverged, failed or lost."""
    import optuna

    spec = claimed.spec
    run_dir = layout.run_dir(spec.point, spec.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    attempt = {"id": f"{sweep}#{claimed.number}", "trial": claimed.number, "attempt": claimed.attempt,
               "worker": queue.worker, "started": time.time()}
    _record_attempt(run_dir, spec, sweep, attempt)
    cmd = [sys.executable, "-m", "study.sweep.trial", "--config", str(layout.point_config(spec.point)),
           "--seed", str(spec.seed), "--run-dir", str(run_dir), "--runner", opts.runner]
    if opts.data_dir:
        cmd += ["--data-dir", str(opts.data_dir)]
    if opts.cache_dir:
        cmd += ["--cache-dir", str(opts.cache_dir)]
    env = {k: v for k, v in os.environ.items() if k != STORAGE_ENV}
    env.update(OMP_NUM_THREADS=str(opts.threads), MKL_NUM_THREADS=str(opts.threads), PYTHONUNBUFFERED="1")
    log_path = run_dir / "trial.log"
    with open(log_path, "ab") as out:
        out.write(f"\n=== {sweep} trial {claimed.number} attempt {claimed.attempt} on {queue.worker} ===\n".encode())
        out.flush()
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
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
        except TrialLost:
            child.kill()
            child.wait()
            attempt.update(ended=time.time(), outcome="lost")
            _record_attempt(run_dir, spec, sweep, attempt)
            return "lost"
        except BaseException:  # Ctrl-C or SIGTERM: stop the child, give the trial back
            child.kill()
            child.wait()
            attempt.update(ended=time.time(), outcome="interrupted")
            _record_attempt(run_dir, spec, sweep, attempt)
            queue.release(claimed, "worker interrupted")
            raise
    metrics = finished_run(run_dir)
    attempt.update(ended=time.time(), returncode=rc)
    if rc == 0 and metrics is not None:
        attempt["outcome"] = metrics["status"]
        _record_attempt(run_dir, spec, sweep, attempt)
        queue.finish(claimed, metrics["status"], objective_value(metrics, metric),
                     {"run_dir": str(run_dir), "steps": metrics.get("steps"),
                      "diverged_at_step": metrics.get("diverged_at_step")})
        return metrics["status"]
    error = _log_tail(log_path) or f"exit code {rc}"
    if rc == 0:
        error += "\n(the trial exited without writing a finished metrics.json)"
    attempt.update(outcome="failed", error=error.splitlines()[-1] if error else "")
    _record_attempt(run_dir, spec, sweep, attempt)
    queue.fail(claimed, error)
    return "failed"


def run_worker(queue: TrialQueue, layout: SweepLayout, opts: WorkerOptions) -> WorkerSummary:
    """Drain the queue. Stays while other workers' trials run, since a lost one comes back."""
    plan = read_json(layout.plan_path)
    specs = trial_specs(plan)
    keys = [s.key for s in specs]
    metric = plan["objective"]["metric"]
    summary = WorkerSummary()
    while opts.max_trials is None or len(summary.ran) < opts.max_trials:
        queue.reap_lost()
        claimed = queue.claim()
        if claimed is None:
            counts = queue.counts(keys)
            if counts["running"] or counts["queued"]:
                time.sleep(opts.poll_s)
                continue
            if queue.sync(specs, retry_failed=False)["enqueued"]:  # keys dropped in a duplicate race
                continue
            break
        log.info("%s: trial %d %s seed %d (attempt %d)", queue.worker, claimed.number, claimed.spec.label,
                 claimed.spec.seed, claimed.attempt)
        outcome = run_trial(queue, layout, claimed, metric, opts, plan["sweep"])
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
