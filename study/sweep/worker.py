"""A sweep worker: claim a trial, run it in a fresh subprocess while proving it is alive,
record the outcome, repeat until no trial is waiting or running anywhere.

`python -m study.sweep.worker --sweep-dir results/<sweep>` is what `study sweep --workers N`
starts N times; the storage URL comes from $STUDY_STORAGE (never the command line, where
`ps` would show its password).

Why the liveness protocol is hand-built on Optuna's storage rather than Optuna's own heartbeat
(`RDBStorage(heartbeat_interval=..., grace_period=...)` with `RetryFailedTrialCallback`): Optuna's
heartbeat exists only for RDB storages (not the journal file this tool also supports), it is beaten
from the process that runs `study.optimize`, and its retry re-creates the trial through the sampler.
Here the trial runs in a child process (a fresh interpreter per trial, which must never hold the
storage URL with its password), trials are enqueued fixed (point, seed) pairs with no sampler, a
worker on the same host can see at once that a dead worker's process is gone (no grace period to
wait out), and a retry must keep the key and count the attempt. `study.sweep.queue` holds the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from study.interrupts import deliver_interrupts, shielded
from study.io import atomic_write_json, exclusive_lock, read_json
from study.record import RunDir, metric_value
from study.sweep import tuning
from study.sweep.layout import SweepLayout, all_keys, check_storage, read_tuned, trial_specs, tuning_id
from study.sweep.queue import Claimed, TrialQueue, TrialSpec, error_summary
from study.sweep.storage import DEFAULT_RETRY_S, StorageError, open_storage, retrying, retrying_at_most
from study.sweep.trial import DEFAULT_RUNNER
from study.sweep.zygote import Zygote, die_with_parent, kill_group

log = logging.getLogger(__name__)
STORAGE_ENV = "STUDY_STORAGE"
# How long an interrupted worker gives back its trial: reaping the killed trial process, then an unreachable storage.
# (The first Ctrl-C or SIGTERM stops a worker and later ones are ignored, so this bounds how long it takes.)
GIVE_BACK_S = 10.0
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                   "GROUP_RANK")


class SpawnedTrial(subprocess.Popen):
    """A trial started as a fresh interpreter in a session of its own, so that killing it, and its end, take the DDP
    ranks Lightning started for it along (see study.sweep.zygote.kill_group)."""

    def kill(self) -> None:
        if self.returncode is None:
            kill_group(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        kill_group(self.pid, leader=False)  # ranks a failed rank zero left waiting in a collective call
        return code


class Launcher:
    """Starts this worker's trial processes: forked from a zygote that imported torch and Lightning once
    (`fork`, the default: study.sweep.zygote says what a child keeps of a fresh process), or a fresh interpreter each
    (`spawn`: `python -m study.sweep.trial`). Either way the worker supervises an exit code and a log file."""

    def __init__(self, opts: "WorkerOptions"):
        self.opts = opts
        self.zygote: Zygote | None = None

    def warm(self) -> None:
        """Start the zygote now, before a trial is claimed: its imports take seconds (more on a loaded machine), and
        a worker starting it for a claimed trial sends that trial no heartbeat meanwhile, so another worker could
        judge it lost. A zygote that fails to start here is started again for the first trial (which then fails
        with the reason)."""
        if self.opts.launcher == "fork" and self.zygote is None:
            with contextlib.suppress(RuntimeError, OSError):
                self.zygote = Zygote(self.opts.runner, trial_environment(self.opts))

    def start(self, cmd: list[str], env: dict[str, str], log: Path):
        if self.opts.launcher == "spawn":
            with open(log, "ab") as out:
                return SpawnedTrial(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent,
                                    start_new_session=True)
        argv = cmd[cmd.index("study.sweep.trial") + 1:]
        for tries_left in (1, 0):  # a zygote that died (e.g. killed for memory) is started again, once
            try:
                if self.zygote is None:
                    self.zygote = Zygote(self.opts.runner, env)  # a trial's environment is the worker's, fixed
                return self.zygote.start(argv, str(log), self.opts.threads, {})
            except (RuntimeError, OSError):
                self.close()
                if not tries_left:
                    raise

    def close(self) -> None:
        if self.zygote is not None:
            with contextlib.suppress(Exception):
                self.zygote.close()
            self.zygote = None


def _record_attempt(run_dir: Path, spec: TrialSpec, sweep: str, attempt: dict[str, Any]) -> None:
    """Append (or update) this attempt in run_dir/trial.json, the file record of every attempt. Under a lock: workers
    of two sweeps that share the point update it too, and a read-modify-write without one could drop an attempt."""
    path = RunDir(run_dir).trial
    with exclusive_lock(path.parent / f".{path.name}.lock"):
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
    workers: int = 1  # how many workers drain the queue together (for the progress line's time left)
    storage_retry_s: float = DEFAULT_RETRY_S  # how long an unreachable storage is waited out (per outage)
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES of this worker's trials (study.sweep.devices); None: as inherited
    launcher: str = "fork"  # fork: from a zygote that imported once; spawn: a fresh interpreter per trial


@dataclass
class WorkerSummary:
    ran: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # wall time of each trial it ran


class TrialLost(Exception):
    """Another worker declared this worker's trial lost and re-queued it."""


class TrialPruned(Exception):
    """The tuning pruner stopped this tuning trial early."""


@dataclass
class Attempt:
    """One attempt at a claimed trial: where it runs, its file record and, in tuning mode, its TPE trial."""

    claimed: Claimed
    run_dir: Path
    runs_point: str
    record: dict[str, Any]
    tuning: tuple | None = None  # (Optuna study, Optuna trial) of a tuning trial
    # the run directory's metrics.json when the attempt started (None: none): a record this attempt wrote is another
    # file (atomic writes replace it), which is how a process that died after writing its result is told from one that
    # stopped before training (e.g. on another config's finished run in the directory: RunDirConflict)
    record_before: tuple[int, int] | None = None

    def write(self, sweep: str, **update: Any) -> None:
        self.record.update(update)
        _record_attempt(self.run_dir, self.claimed.spec, sweep, self.record)

    def tell_failed(self) -> None:
        if self.tuning:  # (already ended where this attempt's retry started: it ends the trial a lost worker left)
            self.tuning[0].tell(self.tuning[1], state=optuna.trial.TrialState.FAIL, skip_if_finished=True)


def _start(queue: TrialQueue, layout: SweepLayout, claimed: Claimed, plan: dict[str, Any]) -> Attempt:
    runs_point, tuning_pair = claimed.spec.runs_point or claimed.spec.point, None
    if claimed.spec.kind == "tune":
        runs_point, study, tune_trial = tuning.start_tuning(queue, layout, plan, claimed)
        tuning_pair = (study, tune_trial)
    run_dir = layout.run_dir(runs_point, claimed.spec.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    # the id: <sweep>#<trial number>, and when it started: trial numbers start again in a rebuilt queue (a moved
    # storage), whose attempts would otherwise replace the earlier ones of the same number in trial.json
    started = time.time()
    attempt = Attempt(claimed, run_dir, runs_point,
                      {"id": f"{plan['sweep']}#{claimed.number}@{started:.6f}", "trial": claimed.number,
                       "attempt": claimed.attempt, "worker": queue.worker, "started": started,
                       "kind": claimed.spec.kind}, tuning_pair, _file_identity(RunDir(run_dir).metrics))
    attempt.write(plan["sweep"])
    return attempt


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _command(layout: SweepLayout, attempt: Attempt, opts: WorkerOptions) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "study.sweep.trial", "--config", str(layout.point_config(attempt.runs_point)),
           "--seed", str(attempt.claimed.spec.seed), "--run-dir", str(attempt.run_dir), "--runner", opts.runner]
    if opts.data_dir:
        cmd += ["--data-dir", str(opts.data_dir)]
    if opts.cache_dir:
        cmd += ["--cache-dir", str(opts.cache_dir)]
    return cmd, trial_environment(opts)


def trial_environment(opts: WorkerOptions) -> dict[str, str]:
    """The environment of this worker's trials: the worker's without the storage URL, with its threads and GPUs.
    Not the worker's distributed settings either: a MASTER_PORT shared by two DDP trials on one host makes one fail
    (address in use) or join the other's group, and an inherited LOCAL_RANK tells Lightning that someone else
    starts the ranks. Without them Lightning picks a free port for each trial and starts its ranks itself."""
    env = {k: v for k, v in os.environ.items() if k != STORAGE_ENV and k not in DISTRIBUTED_ENV}
    env.update(OMP_NUM_THREADS=str(opts.threads), MKL_NUM_THREADS=str(opts.threads), PYTHONUNBUFFERED="1")
    if opts.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = opts.gpus
    return env


def _supervise(queue: TrialQueue, child: subprocess.Popen, attempt: Attempt, pruning) -> int:
    """Wait for the trial process, beating the heartbeat; raises TrialLost when another worker took the trial
    back, TrialPruned when the tuning pruner stops it."""
    while True:
        try:
            return child.wait(timeout=queue.heartbeat_s)
        except subprocess.TimeoutExpired:
            try:
                queue.beat(attempt.claimed)
            except optuna.exceptions.UpdateFinishedTrialError:
                raise TrialLost() from None
            if not queue.still_mine(attempt.claimed):
                raise TrialLost()
            if pruning is not None and pruning.should_prune():
                raise TrialPruned()


def _stop(child) -> None:
    """Kill a trial's process and reap it, waiting at most GIVE_BACK_S: past that the worker goes on with what it was
    doing (its run directory's lock keeps a retry from training beside a process that outlived the kill)."""
    child.kill()
    try:
        child.wait(timeout=GIVE_BACK_S)
    except subprocess.TimeoutExpired:
        log.warning("the trial process (pid %s) was killed but not reaped within %.0f s", child.pid, GIVE_BACK_S)


def _begin(queue: TrialQueue, layout: SweepLayout, claimed: Claimed, plan: dict[str, Any]):
    """(the attempt, its pruning monitor), or the outcome of a trial that could not start (its tuning setting's
    config, its run directory): it fails, not the worker. Interrupted here, the trial goes back to the queue."""
    attempt = None
    try:
        attempt = _start(queue, layout, claimed, plan)
        return attempt, (tuning.PruningMonitor(attempt.tuning[1], tuning.pruned_run_dir(
            layout, plan, attempt.runs_point, claimed.spec.seed, attempt.run_dir), tuning.pruning_column(plan))
            if attempt.tuning and plan["tune"]["pruner"] != "none" else None)
    except StorageError:  # the storage gone for good: the worker stops (main), the grace period gives it back
        raise
    except optuna.exceptions.UpdateFinishedTrialError:  # another worker ended (and re-queued) it as it started
        return _taken_back(queue, plan, attempt, claimed)
    except Exception as err:  # noqa: BLE001
        return _start_failed(queue, layout, plan, claimed, err, attempt)
    except BaseException:  # Ctrl-C or SIGTERM
        with shielded():
            _interrupted(queue, claimed, attempt, plan["sweep"])
        raise


def run_trial(queue: TrialQueue, layout: SweepLayout, claimed: Claimed, plan: dict[str, Any],
              opts: WorkerOptions, launcher: Launcher | None = None) -> str:
    """Run one claimed trial in a subprocess; returns completed, diverged, failed, pruned or lost."""
    sweep, begun = plan["sweep"], _begin(queue, layout, claimed, plan)
    if isinstance(begun, str):
        return begun
    attempt, pruning = begun
    launcher = launcher or Launcher(WorkerOptions(launcher="spawn"))
    header = f"\n=== {sweep} trial {claimed.number} attempt {claimed.attempt} on {queue.worker} ===\n"
    try:  # a trial that cannot start (its log, the zygote's preload) fails this attempt, as a crash would
        log.info("%s: trial %d %s%s seed %d (attempt %d)", queue.worker, claimed.number, claimed.spec.label,
                 " (tuning)" if claimed.spec.kind == "tune" else "", claimed.spec.seed, claimed.attempt)
        child = _launch(layout, attempt, opts, launcher, header)
    except Exception as err:  # noqa: BLE001
        return _settle(queue, layout, plan, attempt, _note_start_failure(RunDir(attempt.run_dir).trial_log, err))
    except BaseException:  # Ctrl-C or SIGTERM as the zygote imports or forks: a child it forked dies with it first
        with shielded():
            launcher.close()
            _interrupted(queue, claimed, attempt, sweep)
        raise
    try:
        rc = _supervise(queue, child, attempt, pruning)
    except TrialPruned:
        _stop(child)
        attempt.write(sweep, ended=time.time(), outcome="pruned")
        # what it logged last is a partial run's validation loss, not the objective: recorded as what it is
        last = {"last_val_loss": pruning.last, "last_val_step": pruning.last_step}
        try:
            queue.finish(claimed, "pruned", None, {"run_dir": str(attempt.run_dir), **last})
        except optuna.exceptions.UpdateFinishedTrialError:
            return _taken_back(queue, plan, attempt)
        tuning.finish_tuning_trial(queue, layout, plan, claimed, *attempt.tuning, attempt.runs_point, "pruned",
                                   None, **last)
        return "pruned"
    except TrialLost:
        _stop(child)
        attempt.write(sweep, ended=time.time(), outcome="lost")
        attempt.tell_failed()
        return "lost"
    except BaseException:  # Ctrl-C or SIGTERM: stop the child, give the trial back
        with shielded():
            _stop(child)
            _interrupted(queue, claimed, attempt, sweep)
        raise
    return _settle(queue, layout, plan, attempt, rc)


def _launch(layout: SweepLayout, attempt: Attempt, opts: WorkerOptions, launcher: Launcher, header: str):
    """The attempt's process, started with its output appended to the run's trial.log after `header`."""
    cmd, env = _command(layout, attempt, opts)
    trial_log = RunDir(attempt.run_dir).trial_log
    with open(trial_log, "ab") as out:
        out.write(header.encode())
    return launcher.start(cmd, env, trial_log)


def _interrupted(queue: TrialQueue, claimed: Claimed, attempt: Attempt | None, sweep: str) -> None:
    """The worker was interrupted during this attempt: the trial goes back to the queue (first, and within
    GIVE_BACK_S of an unreachable storage: the worker is stopping), then its record says so."""
    with contextlib.suppress(StorageError), retrying_at_most(queue.storage, GIVE_BACK_S):
        queue.release(claimed, "worker interrupted")
        if attempt is not None:
            attempt.tell_failed()
    if attempt is not None:
        try:
            attempt.write(sweep, ended=time.time(), outcome="interrupted")
        except OSError as err:  # (a full disk): the interrupt, not this, is what the worker stops with
            log.warning("%s: could not record the interrupted attempt: %s", queue.worker, err)


def _start_failed(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], claimed: Claimed,
                  err: Exception, attempt: Attempt | None) -> str:
    """A trial that could not start is a failed attempt, retried like any other: never a result, and never the end
    of the worker (whose other trials would wait out the grace period)."""
    error = f"the trial could not start: {type(err).__name__}: {err}"
    log.warning("%s: trial %d %s: %s", queue.worker, claimed.number, claimed.spec.label, error)
    if attempt is not None:  # it got as far as its run directory: the attempt's record says how it ended
        attempt.write(plan["sweep"], ended=time.time(), outcome="failed", error=error.splitlines()[0])
        attempt.tell_failed()
    try:
        requeued = queue.fail(claimed, error)
    except optuna.exceptions.UpdateFinishedTrialError:  # another worker ended it (and re-queued it) meanwhile
        return _taken_back(queue, plan, None, claimed)  # (its attempt's record and TPE trial: failed, above)
    if claimed.spec.kind == "tune" and not requeued:  # this tuning trial failed for good: its point may be settled
        tuning.record_tuning_trial(queue, layout, plan, claimed.spec.point, {
            "key": claimed.spec.key, "value": None, "status": "failed", "objective": None, "runs_point": None,
            "run_dir": None, "error": error.splitlines()[0]})
    return "failed"


def _note_start_failure(log: Path, err: Exception) -> int:
    """Write why the trial process could not start to its log (where a failed trial's error is read from); the exit
    code to settle the attempt with."""
    with contextlib.suppress(OSError), open(log, "a") as out:  # (a log that cannot be written: the error is why)
        out.write(f"the trial process could not start: {type(err).__name__}: {err}\n")
    return 1


def _settle(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], attempt: Attempt, rc: int) -> str:
    """Record how an attempt that ran to its end ended (`_settle_mine`), unless another worker took the trial back
    meanwhile (it judged the heartbeat stale, and the process ended before the next beat would have told this
    worker): that worker re-queued it, and the retry settles it (a finished run directory is found, not retrained)."""
    attempt.record.update(ended=time.time(), returncode=rc)
    if queue.still_mine(attempt.claimed):
        try:
            return _settle_mine(queue, layout, plan, attempt, rc)
        except optuna.exceptions.UpdateFinishedTrialError:  # taken back between the check and the update
            pass
    return _taken_back(queue, plan, attempt)


def _taken_back(queue: TrialQueue, plan: dict[str, Any], attempt: Attempt | None,
                claimed: Claimed | None = None) -> str:
    """The storage says another process ended this worker's trial (a worker that judged it lost failed it and
    re-queued it, as `TrialQueue.reap` does): the attempt is lost, the retry settles the key, and this worker goes on
    to its next trial."""
    claimed = claimed or attempt.claimed
    log.warning("%s: trial %d was ended by another worker (which judged it lost) before this one recorded it; its "
                "retry settles it",
                queue.worker, claimed.number)
    if attempt is not None:
        attempt.write(plan["sweep"], outcome="lost")
        attempt.tell_failed()
    return "lost"


def _settle_mine(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any], attempt: Attempt, rc: int) -> str:
    """A result (completed or diverged), or a failure (an error, or a completed run whose objective is not in its
    record: a result nothing could rank). The run directory's record decides, whatever the exit code, where this
    attempt wrote it: a process killed after writing its finished record left that result (the exit code stays in
    trial.json)."""
    sweep, metric, claimed = plan["sweep"], plan["objective"]["metric"], attempt.claimed
    run = RunDir(attempt.run_dir)
    record = run.finished()
    if rc != 0 and _file_identity(run.metrics) == attempt.record_before:
        record = None  # a failed process that wrote nothing: what the directory held is not this attempt's result
    value = metric_value(record, metric) if record else None
    if record is not None and (record["status"] != "completed" or value is not None):
        attempt.write(sweep, outcome=record["status"])
        queue.finish(claimed, record["status"], value,
                     {"run_dir": str(attempt.run_dir), "steps": record.get("steps"),
                      "diverged_at_step": record.get("diverged_at_step")})
        if attempt.tuning:
            tuning.finish_tuning_trial(queue, layout, plan, claimed, *attempt.tuning, attempt.runs_point,
                                       record["status"], value)
        return record["status"]
    retry, missing = True, {}
    if record is not None:  # completed, but the objective is missing: the same on every retry, whatever the exit
        written = sorted(k[len("metric."):] for k, v in _numeric_metrics(record).items())
        error = (f"the run completed but its metrics.json has no finite {metric!r}, the sweep's objective; "
                 f"it has {written[:12]}")
        retry, missing = False, {"missing_objective": metric}  # (a later objective the record has: results.py)
    else:
        error = _log_tail(run.trial_log) or f"exit code {rc}"
        if rc == 0:
            error += "\n(the trial exited without writing a finished metrics.json)"
    attempt.write(sweep, outcome="failed", error=error_summary(error), **missing)
    requeued = queue.fail(claimed, error, retry=retry)
    if attempt.tuning:
        attempt.tell_failed()
        if not requeued:  # this tuning trial failed for good: the point's tuning may now be settled
            tuning.finish_tuning_trial(queue, layout, plan, claimed, *attempt.tuning, attempt.runs_point,
                                       "failed", None, tell=False, error=error_summary(error))
    return "failed"


def _numeric_metrics(record: dict[str, Any]) -> dict[str, float]:
    from study.record import flatten_record

    return {k: v for k, v in flatten_record(record).items() if k.startswith("metric.")
            and isinstance(v, float) and math.isfinite(v)}


def run_worker(queue: TrialQueue, layout: SweepLayout, opts: WorkerOptions) -> WorkerSummary:
    """Drain the queue. Stays while other workers' trials run, since a lost one comes back."""
    plan = read_json(layout.plan_path)
    keys = set(all_keys(plan))
    summary, launcher = WorkerSummary(), Launcher(opts)
    try:
        launcher.warm()
        if plan.get("tune"):
            # a tuning trial writes the config its drawn setting runs, and validating a config imports the axis
            # registries (torch): seconds, more on a loaded machine, during which the claimed trial gets no
            # heartbeat and another worker could judge it lost. Imported now, before anything is claimed.
            import study.axes  # noqa: F401
        _drain(queue, layout, opts, plan, keys, summary, launcher)
    finally:
        launcher.close()
    return summary


def _drain(queue: TrialQueue, layout: SweepLayout, opts: WorkerOptions, plan: dict[str, Any], keys: set[str],
           summary: WorkerSummary, launcher: Launcher) -> None:
    while opts.max_trials is None or len(summary.ran) < opts.max_trials:
        # a lost tuning trial with no retry left may have been its point's last: no worker ran it to its end, so the
        # reaper settles the point (its seeds are queued now, not by the next `study sweep`)
        given_up = [t for t, requeued in queue.reap() if not requeued and t.user_attrs.get("kind") == "tune"]
        if given_up and plan.get("tune"):
            tuning.end_given_up(queue, plan, given_up)
            tuning.settle_points(queue, layout, plan, sorted({t.user_attrs.get("point") for t in given_up}))
        claimed = queue.claim(keys)
        if claimed is None:
            if _work_ahead(queue, layout, plan):
                time.sleep(opts.poll_s)
                continue
            with queue.lock():
                # a point whose last tuning trial ended a moment ago is settled by its worker (its seeds queued) next:
                # settling here (once, under the lock, whoever comes first) keeps this worker for those seeds. Only
                # a point not settled yet: settling a settled one queues its failed seeds again, for good
                if plan.get("tune"):
                    tuning.settle_tuning_locked(queue, layout, plan, tuning.unsettled_points(layout, plan))
                if _work_ahead(queue, layout, plan) or \
                        queue.sync_locked(trial_specs(plan, read_tuned(layout)), retry_failed=False)["enqueued"]:
                    continue  # (sync: keys dropped in a duplicate race)
            break
        started = time.time()
        outcome = run_trial(queue, layout, claimed, plan, opts, launcher)
        summary.seconds.append(time.time() - started)
        log.info("%s: trial %d %s seed %d: %s%s %s", queue.worker, claimed.number, claimed.spec.label,
                 claimed.spec.seed, outcome, _objective_text(layout, claimed, plan),
                 _progress_text(queue.counts(sorted(keys)), summary.seconds, opts.workers))
        summary.ran.append(claimed.spec.key)
        if outcome == "failed":
            summary.failed.append(claimed.spec.key)
        elif outcome == "lost":
            summary.lost.append(claimed.spec.key)


def _work_ahead(queue: TrialQueue, layout: SweepLayout, plan: dict[str, Any]) -> bool:
    """Whether trials run or wait, with the keys read from tuned.json as it is now (a tuned point's seeds join them
    once the point is settled)."""
    counts = queue.counts([s.key for s in trial_specs(plan, read_tuned(layout))])
    return bool(counts["running"] or counts["queued"])


def _progress_text(counts: dict[str, int], seconds: list[float], workers: int) -> str:
    """'[7/18 done, 1 failed; ~35 min left]': the sweep's progress as each trial ends, the time left estimated from
    this worker's own trials (their mean wall time x the trials left / the workers)."""
    total = sum(counts.values())
    left = counts["queued"] + counts["running"] + counts["not queued"]
    text = f"[{counts['done']}/{total} done" + (f", {counts['failed']} failed" if counts["failed"] else "")
    if left and seconds:
        minutes = sum(seconds) / len(seconds) * left / max(1, workers) / 60
        text += f"; ~{minutes:.0f} min left" if minutes >= 1 else "; <1 min left"
    return text + "]"


def _objective_text(layout: SweepLayout, claimed: Claimed, plan: dict[str, Any]) -> str:
    """', valid_loss 1.4821' for a finished trial: each trial's number as it finishes, not only at the end. A tuning
    trial ran its point at the setting TPE drew (its own run directory, recorded in tuned.json), so its line shows
    that run's number and the setting: ', valid_loss 1.4821 at train.lr 0.0031'."""
    metric, point, setting = plan["objective"]["metric"], claimed.spec.runs_point or claimed.spec.point, ""
    if claimed.spec.kind == "tune":
        entry = read_tuned(layout).get(claimed.spec.point) or {}
        ran = [t for t in entry.get("trials", []) if t.get("key") == claimed.spec.key and t.get("runs_point")]
        if entry.get("tuning") != tuning_id(plan) or not ran:
            return ""
        drawn = ran[-1].get("value")
        drawn = f"{drawn:.4g}" if isinstance(drawn, float) else drawn
        point, setting = ran[-1]["runs_point"], f" at {entry.get('field')} {drawn}"
    record = RunDir(layout.run_dir(point, claimed.spec.seed)).finished()
    value = metric_value(record, metric) if record else None
    return f", {metric} {value:.4g}{setting}" if value is not None else ""


def open_queue(plan: dict[str, Any], storage_url: str, retry_s: float = DEFAULT_RETRY_S) -> TrialQueue:
    """The sweep's queue; every storage call in it waits out an outage of up to `retry_s` seconds."""
    spec = plan["spec"]
    storage = retrying(open_storage(storage_url), retry_s, storage_url)
    return TrialQueue(storage, plan["sweep"], plan["objective"]["direction"],
                      heartbeat_s=spec["heartbeat_s"], grace_s=spec["grace_s"], max_retries=spec["max_retries"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.sweep.worker")
    parser.add_argument("--sweep-dir", required=True)
    parser.add_argument("--data-dir")
    parser.add_argument("--cache-dir")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runner", default=DEFAULT_RUNNER)
    parser.add_argument("--poll-s", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=1, help="workers draining the queue together")
    parser.add_argument("--storage-retry-s", type=float, default=DEFAULT_RETRY_S,
                        help="how long to wait out an unreachable storage before stopping")
    parser.add_argument("--gpus", help="CUDA_VISIBLE_DEVICES for this worker's trials")
    parser.add_argument("--launcher", choices=("fork", "spawn"), default="fork")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    url = os.environ.get(STORAGE_ENV)
    if not url:
        print(f"worker: set ${STORAGE_ENV} to the sweep's storage URL", file=sys.stderr)
        return 2
    deliver_interrupts(sigterm=True, once=True)  # on Ctrl-C or SIGTERM run_trial gives the trial back, undisturbed
    layout = SweepLayout(Path(args.sweep_dir))
    plan = read_json(layout.plan_path)
    try:
        check_storage(layout, url)
        queue = open_queue(plan, url, args.storage_retry_s)
        run_worker(queue, layout, WorkerOptions(data_dir=args.data_dir, cache_dir=args.cache_dir,
                                                threads=args.threads, runner=args.runner, poll_s=args.poll_s,
                                                workers=args.workers, storage_retry_s=args.storage_retry_s,
                                                gpus=args.gpus, launcher=args.launcher))
    except StorageError as err:  # another storage than the sweep's, or an outage that outlasted the retries
        print(f"worker: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the `study sweep` parent says what happened
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
