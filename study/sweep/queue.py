"""The sweep's trial queue, on Optuna's storage, with the holes that make a plain grid
sampler unreliable closed (optuna #3256: failed points count as visited and never re-run;
#485: a killed worker's trial stays RUNNING forever; GridSampler with several workers re-runs
points).

* Each (point, seed) is one *key*. The plan is enqueued under a lock (a marker study that only
  one process can create), so several workers started together enqueue it once.
* A worker claims a WAITING trial with the storage's atomic WAITING -> RUNNING update, then
  checks that no other trial of the same key is running or done (a second guard).
* While a trial runs, its worker writes a heartbeat (a user attribute). A RUNNING trial whose
  heartbeat is older than the grace period, or whose worker process on this host is gone, is
  failed by whichever worker notices first (an atomic RUNNING -> FAIL update that only one wins)
  and that winner re-queues it once; the retry resumes from the run's last checkpoint.
* A trial that exits with an error is failed and re-queued up to `max_retries` times; after that
  it stays failed, with its error, until the sweep is run again.

Optuna's own heartbeat (`RDBStorage(heartbeat_interval=...)` with `RetryFailedTrialCallback`) is not used: it exists
for RDB storages only (this queue also runs on the journal file), it is beaten by the process that runs
`study.optimize` (here the trial is a child process that never holds the storage URL), its retry goes back through
a sampler (here a retry must keep its (point, seed) key and count its attempt), and it cannot tell that a worker on
this host is gone before the grace period ends. Everything else is Optuna's: the storages, the atomic state updates,
the study of each sweep, TPE for tuning mode.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import optuna
from optuna.trial import TrialState

from study.record import host_id, worker_gone

log = logging.getLogger(__name__)
ACTIVE = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)
# A failed attempt that is about to be queued again: set before it is failed, so that between the failure and the
# retry (two storage updates) no other worker takes its key for failed for good (retry_pending)
RETRYING = "retrying"
ENDED_BY = "ended_by"  # a token of the call that ends a trial (see TrialQueue._end)
LOCK_STALE_S = 120.0  # a lock held this long by a process elsewhere is taken over
LOCK_SAY_EVERY_S = 10.0


@dataclass(frozen=True)
class TrialSpec:
    key: str
    point: str
    seed: int
    label: str
    kind: str = "seed"  # 'seed': a trial the report compares; 'tune': a tuning-mode search trial
    runs_point: str | None = None  # the point whose config (and run directory) it runs, when not its own: a seed
    # trial of tuning mode runs its point's tuned config
    axes: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # (axis, its value's label, every label of the axis)

    def attrs(self) -> dict[str, Any]:
        out = {"key": self.key, "point": self.point, "seed": self.seed, "label": self.label, "kind": self.kind}
        if self.runs_point:
            out["runs_point"] = self.runs_point
        if self.axes:
            out["axes"] = {name: [label, list(choices)] for name, label, choices in self.axes}
        return out

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> "TrialSpec":
        axes = tuple((name, str(v[0]), tuple(v[1])) for name, v in (attrs.get("axes") or {}).items())
        return cls(key=attrs["key"], point=attrs["point"], seed=int(attrs["seed"]), label=attrs.get("label", ""),
                   kind=attrs.get("kind", "seed"),
                   runs_point=attrs.get("runs_point", attrs.get("config_point")),  # (its earlier name)
                   axes=axes)

    def params(self) -> tuple[dict[str, str], dict[str, Any]]:
        """The axis values as Optuna params with categorical distributions, so that Optuna's own tools
        (optuna-dashboard's parameter views, `study.trials_dataframe()`) show what each trial varied."""
        params = {name: label for name, label, _ in self.axes}
        return params, {name: optuna.distributions.CategoricalDistribution(choices) for name, _, choices in self.axes}


class _LockWait:
    """How long this process has waited for the enqueue lock under its current holder, and when it last said so."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.holder, self.since, self.said = None, time.time(), 0.0

    def waited(self, holder: str, recovered_at: float = 0.0) -> float:
        """Seconds waited for this holder (a new holder restarts the count; so does the end of a storage outage,
        during which nobody could release it)."""
        if holder != self.holder:
            self.holder, self.since = holder, time.time()
        self.since = max(self.since, recovered_at)
        return time.time() - self.since

    def say(self, holder: str, sweep: str) -> None:
        now = time.time()
        if now - self.since >= 1.0 and now - self.said >= LOCK_SAY_EVERY_S:
            log.info("waiting for the enqueue lock of sweep %r, held by %s for %.0f s (taken over after %.0f s)",
                     sweep, holder or "a process starting", now - self.since, LOCK_STALE_S)
            self.said = now


@dataclass
class Claimed:
    trial_id: int
    number: int
    spec: TrialSpec
    attempt: int
    supersedes: tuple[int, ...] = ()  # completed trials of this key whose run directory was lost
    retry_of: int | None = None  # the trial number of the attempt this one retries


def _stale_reason(age_s: float, worker: str) -> str:
    """Why a trial is judged lost by its heartbeat's age. The age compares the beating worker's clock with this one's,
    so a worker on another host whose clock runs behind by more than grace_s looks silent while it beats."""
    reason = f"no heartbeat for {age_s:.0f} s"
    host = worker.rpartition(":")[0]
    if host and host != host_id():
        reason += f" (beaten on {host}: if its clock is behind this host's, sync the clocks or raise grace_s)"
    return reason


class TrialQueue:
    def __init__(self, storage: Any, sweep: str, direction: str = "minimize", *,
                 heartbeat_s: int = 10, grace_s: int = 60, max_retries: int = 2) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.storage = storage
        self.sweep = sweep
        self.direction = direction
        self.heartbeat_s = heartbeat_s
        self.grace_s = grace_s
        self.max_retries = max_retries
        self.study = optuna.create_study(study_name=sweep, storage=storage, direction=direction, load_if_exists=True)
        self.worker = f"{host_id()}:{os.getpid()}"

    # -- reading ------------------------------------------------------------------------
    def trials(self, states: tuple[TrialState, ...] | None = None) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states)

    def by_key(self) -> dict[str, list[optuna.trial.FrozenTrial]]:
        out: dict[str, list[optuna.trial.FrozenTrial]] = {}
        for t in self.trials():
            key = t.user_attrs.get("key")
            if key is not None:
                out.setdefault(key, []).append(t)
        return out

    def counts(self, keys: list[str]) -> dict[str, int]:
        """Per key, its most advanced state: done (completed or diverged), running, queued, failed."""
        groups = self.by_key()
        counts = {"done": 0, "running": 0, "queued": 0, "failed": 0, "not queued": 0}
        for key in keys:
            trials = groups.get(key, [])
            superseded = {n for t in trials for n in t.user_attrs.get("supersedes", ())}
            states = {t.state for t in trials if t.number not in superseded}
            if TrialState.COMPLETE in states:
                counts["done"] += 1
            elif TrialState.RUNNING in states:
                counts["running"] += 1
            elif TrialState.WAITING in states:
                counts["queued"] += 1
            elif TrialState.FAIL in states:
                counts["failed"] += 1
            else:
                counts["not queued"] += 1
        return counts

    # -- enqueueing -----------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """The sweep-wide lock (re-entrant in neither sense: do not nest)."""
        with self._enqueue_lock():
            yield

    @contextlib.contextmanager
    def _enqueue_lock(self) -> Iterator[None]:
        """A marker study that only one process can create, recording its holder (host:pid): a holder that is a
        dead process on this host is taken over at once; any other is waited for, saying so every
        LOCK_SAY_EVERY_S, and taken over after LOCK_STALE_S (a process on another host that died holding it)."""
        from optuna.study import StudyDirection

        name = f"{self.sweep}~enqueue-lock"
        wait = _LockWait()
        while True:
            try:
                lock_id = self.storage.create_new_study([StudyDirection.MINIMIZE], study_name=name)
                break
            except optuna.exceptions.DuplicatedStudyError:
                self._wait_for_lock(name, wait)
        try:
            self.storage.set_study_user_attr(lock_id, "holder", {"worker": self.worker, "since": time.time()})
            yield
        finally:
            with contextlib.suppress(KeyError):
                self.storage.delete_study(lock_id)

    def _lock_holder(self, name: str) -> tuple[int | None, dict[str, Any] | None]:
        """The lock study's id and its holder ({"worker": host:pid, "since"}; None in the instant before the
        holder records itself); (None, None) when the lock was just released."""
        try:
            lock_id = self.storage.get_study_id_from_name(name)
            return lock_id, self.storage.get_study_user_attrs(lock_id).get("holder")
        except KeyError:
            return None, None

    def _wait_for_lock(self, name: str, wait: "_LockWait") -> None:
        lock_id, holder = self._lock_holder(name)
        if lock_id is None:
            return
        worker = (holder or {}).get("worker", "")
        dead_here = worker_gone(worker)
        waited = wait.waited(worker, recovered_at=getattr(self.storage, "recovered_at", 0.0))
        if dead_here or waited > LOCK_STALE_S:
            if self._lock_holder(name) == (lock_id, holder):  # still the one judged (not a new holder's lock)
                log.warning("taking over the enqueue lock of sweep %r from %s: %s", self.sweep, worker or "?",
                            "that process is gone" if dead_here else f"held for over {LOCK_STALE_S:.0f} s")
                with contextlib.suppress(KeyError):
                    self.storage.delete_study(lock_id)
            wait.restart()
            return
        wait.say(worker, self.sweep)
        time.sleep(0.2)

    def sync(self, specs: list[TrialSpec], finished: dict[str, float | None] | None = None,
             retry_failed: bool = True) -> dict[str, int]:
        """Enqueue every key that has no waiting, running or completed trial.

        `finished` maps keys whose run directory already holds a finished run to its objective
        value: those are recorded as COMPLETE without running (the storage rebuilt from the files).
        With retry_failed=False (a worker topping up at the end) only keys whose every trial was
        dropped as a duplicate are enqueued, never a key that failed for good."""
        with self._enqueue_lock():
            return self.sync_locked(specs, finished, retry_failed)

    def sync_locked(self, specs: list[TrialSpec], finished: dict[str, float | None] | None = None,
                    retry_failed: bool = True, verify_files: bool = False) -> dict[str, int]:
        """`sync` for a caller that holds `lock()`. With verify_files, `finished` is the complete list of
        finished run directories on disk, and completed trials missing from it are queued again."""
        finished = finished or {}
        added = {"enqueued": 0, "recorded": 0}
        groups = self.by_key()
        for spec in specs:
            trials = groups.get(spec.key, [])
            # the run directories are the record: a completed trial whose finished run directory is
            # gone (deleted to rerun it, or lost) runs again
            record_gone = (spec.kind == "seed" and spec.key not in finished and verify_files
                           and not any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in trials))
            if any(t.state in ACTIVE for t in trials) and not record_gone:
                continue
            if not retry_failed and any(t.state == TrialState.FAIL for t in trials):
                continue
            attrs = spec.attrs()
            if spec.key in finished:
                value = finished[spec.key]
                params, distributions = spec.params()
                done = dict(state=TrialState.COMPLETE, value=self._storable(value),
                            user_attrs={**attrs, "from_files": True})
                try:
                    self.study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, **done))
                except ValueError:  # choices that differ from earlier trials' (see _set_params)
                    self.study.add_trial(optuna.trial.create_trial(**done))
                added["recorded"] += 1
            else:
                if record_gone:  # the completed trial(s) of this key no longer count as done
                    attrs["supersedes"] = [t.number for t in trials if t.state == TrialState.COMPLETE]
                self.study.enqueue_trial({}, user_attrs={**attrs, "attempt": 1})
                added["enqueued"] += 1
        return added

    def _storable(self, value: float | None) -> float:
        """Optuna stores no NaN: a diverged or metric-less run is recorded as the worst value."""
        if value is None or not math.isfinite(value):
            return math.inf if self.direction == "minimize" else -math.inf
        return float(value)

    def _requeue(self, trial: optuna.trial.FrozenTrial, reason: str, counts: bool = True) -> bool:
        """Queue a trial again, as its next attempt (or the same attempt when `counts` is False: a
        worker that was stopped did not fail)."""
        attempt = int(trial.user_attrs.get("attempt", 1))
        if not counts:
            attempt -= 1
        elif not self._retries_left(attempt):
            log.warning("trial %s (%s) failed %d time(s): %s; not retried again in this run",
                        trial.number, trial.user_attrs.get("label"), attempt, reason)
            return False
        attrs = TrialSpec.from_attrs(trial.user_attrs).attrs()
        if "supersedes" in trial.user_attrs:
            attrs["supersedes"] = trial.user_attrs["supersedes"]
        self.study.enqueue_trial({}, user_attrs={**attrs, "attempt": attempt + 1, "retry_of": trial.number,
                                                  "retry_reason": reason})
        log.warning("re-queued %s (attempt %d): %s", trial.user_attrs.get("label"), attempt + 1, reason)
        return True

    def _retries_left(self, attempt: int) -> bool:
        return attempt <= self.max_retries

    # -- claiming -------------------------------------------------------------------------
    def lost_running(self) -> list[tuple[optuna.trial.FrozenTrial, str]]:
        """RUNNING trials nothing is running: their worker process on this host is gone, or their heartbeat is
        older than the grace period (a worker elsewhere); with the reason. Reads only."""
        now, lost = time.time(), []
        for t in self.trials((TrialState.RUNNING,)):
            beat = t.user_attrs.get("heartbeat")
            if beat is None:
                beat = t.datetime_start.timestamp() if t.datetime_start else now
            # nobody could beat while the storage was down: after an outage every worker gets the grace period anew
            beat = max(beat, getattr(self.storage, "recovered_at", 0.0))
            worker = str(t.user_attrs.get("worker", ""))
            dead_here = worker_gone(worker)
            if dead_here or now - beat > self.grace_s:
                lost.append((t, "its worker process is gone" if dead_here else _stale_reason(now - beat, worker)))
        return lost

    def sync_anew_locked(self, specs: list[TrialSpec], finished: dict[str, float | None]) -> dict[str, int]:
        """What a new `study sweep` does first, holding `lock()`: the RUNNING trials nothing runs (a sweep killed
        with them: kill -9, a reboot, a preemption) are queued again as the same attempt (a tuning trial at the
        setting it drew), not counted against their retries; then failed and missing trials are queued
        (`sync_locked`). Left to the workers' reaper, each such kill spent an attempt, and the third failed the
        trial unrun."""
        for t, reason in self.lost_running():
            try:
                if not self._fail(t._trial_id, retrying=True):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker's reaper got there first; it re-queues
            self._requeue(t, f"lost: {reason}, with the sweep that ran it", counts=False)
        return self.sync_locked(specs, finished, retry_failed=True, verify_files=True)

    def reap_lost(self) -> int:
        """Fail and re-queue RUNNING trials whose worker is gone; returns how many this call won."""
        return len(self.reap())

    def reap(self) -> list[tuple[optuna.trial.FrozenTrial, bool]]:
        """Fail RUNNING trials whose worker is gone and re-queue those with retries left; returns the trials this
        call won, each with whether it was re-queued (one that was not has failed for good: the caller settles
        what waits on it, such as a tuned point's seeds)."""
        won = []
        for t, reason in self.lost_running():
            # a trial moved to RUNNING whose claimant never marked it its own ran nothing (the claim's reply was
            # lost, or its worker died at once): queued again as the same attempt, spending no retry
            ran = "worker" in t.user_attrs
            try:
                retrying = not ran or self._retries_left(int(t.user_attrs.get("attempt", 1)))
                if not self._fail(t._trial_id, retrying=retrying):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker got there first; it re-queues
            won.append((t, self._requeue(t, f"lost: {reason}", counts=ran)))
        return won

    def claim(self, keys: set[str] | None = None) -> Claimed | None:
        """Atomically take the oldest waiting trial; None when the queue is empty. A waiting trial
        whose key is not in `keys` (the spec changed since it was queued) is dropped, not run."""
        for t in sorted(self.trials((TrialState.WAITING,)), key=lambda t: t.number):
            try:
                if not self.storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                    # taken by another worker, or by this call's own first try whose reply was lost: no worker
                    # marks it then, and the reaper queues it again without spending a retry (see `reap`)
                    continue
                claimed = self._take(t, keys)
            except optuna.exceptions.UpdateFinishedTrialError:
                # taken (or ended) by another process between two of these updates: whoever ended it re-queued it
                log.info("trial %s was ended by another process as it was claimed; moving on", t.number)
                continue
            if claimed is not None:
                return claimed
        return None

    def _take(self, t: optuna.trial.FrozenTrial, keys: set[str] | None) -> Claimed | None:
        """Make a trial this worker just moved to RUNNING its own; None (and the trial PRUNED) when it is not to
        run: its key left the plan, or another trial of its key is done or running."""
        spec = TrialSpec.from_attrs(t.user_attrs)
        claimed = Claimed(trial_id=t._trial_id, number=t.number, spec=spec, attempt=int(t.user_attrs.get("attempt", 1)),
                          supersedes=tuple(t.user_attrs.get("supersedes", ())), retry_of=t.user_attrs.get("retry_of"))
        self.storage.set_trial_user_attr(t._trial_id, "worker", self.worker)
        self.beat(claimed)
        if keys is not None and spec.key not in keys:
            self.storage.set_trial_user_attr(t._trial_id, "dropped", "not in the current plan")
            self.storage.set_trial_state_values(t._trial_id, state=TrialState.PRUNED)
            return None
        duplicate = self._duplicate_of(claimed)
        if duplicate is not None:
            self.storage.set_trial_user_attr(t._trial_id, "duplicate_of", duplicate)
            self.storage.set_trial_state_values(t._trial_id, state=TrialState.PRUNED)
            return None
        self._set_params(t._trial_id, spec)
        return claimed

    def _set_params(self, trial_id: int, spec: TrialSpec) -> None:
        """The trial's axis values as Optuna params. Optuna keeps one distribution per param name for a whole
        study: after a spec gained an axis value, the earlier trials' choices differ and Optuna refuses the new
        ones; the trial then runs without params (they are for Optuna's viewers only: the record is the files)."""
        params, distributions = spec.params()
        try:
            for name, label in params.items():
                distribution = distributions[name]
                self.storage.set_trial_param(trial_id, name, distribution.to_internal_repr(label), distribution)
        except ValueError as err:
            log.info("trial %s: axis values not stored as Optuna params (%s)", spec.key, err)

    def _duplicate_of(self, claimed: Claimed) -> int | None:
        """Another trial of the same key that is done, or running and claimed before this one."""
        for t in self.by_key().get(claimed.spec.key, []):
            if t.number == claimed.number or t.number in claimed.supersedes:
                continue
            if t.state == TrialState.COMPLETE:
                return t.number
            if t.state == TrialState.RUNNING and t.number < claimed.number:
                return t.number
        return None

    def beat(self, claimed: Claimed) -> None:
        self.storage.set_trial_user_attr(claimed.trial_id, "heartbeat", time.time())

    def still_mine(self, claimed: Claimed) -> bool:
        t = self.storage.get_trial(claimed.trial_id)
        return t.state == TrialState.RUNNING and t.user_attrs.get("worker") == self.worker

    # -- finishing ------------------------------------------------------------------------
    def finish(self, claimed: Claimed, status: str, value: float | None, attrs: dict[str, Any]) -> None:
        """Record a run that ended with a result (completed, or diverged: a result, not a failure). Raises
        UpdateFinishedTrialError when another process ended the trial first (see `_end`)."""
        for k, v in {**attrs, "status": status}.items():
            self.storage.set_trial_user_attr(claimed.trial_id, k, v)
        self._end(claimed.trial_id, TrialState.COMPLETE, self._storable(value))

    def fail(self, claimed: Claimed, error: str, retry: bool = True) -> bool:
        """Record a failed attempt and re-queue it if retries are left (and `retry`: a failure that would repeat,
        such as a completed run without the objective, is not retried); returns whether it was. Raises
        UpdateFinishedTrialError when another process ended the trial first (see `_end`)."""
        self.storage.set_trial_user_attr(claimed.trial_id, "error", error[-2000:])
        self.storage.set_trial_user_attr(claimed.trial_id, "status", "failed")
        self._fail(claimed.trial_id, retrying=retry and self._retries_left(claimed.attempt))
        if not retry:
            return False
        reason = error_summary(error) or "error"
        return self._requeue(self.storage.get_trial(claimed.trial_id), reason)

    def _fail(self, trial_id: int, retrying: bool) -> bool:
        """The storage's atomic RUNNING -> FAIL update (see `_end`), marked first with whether the attempt is queued
        again next (RETRYING, read by retry_pending); False where the trial had already left RUNNING."""
        self.storage.set_trial_user_attr(trial_id, RETRYING, retrying)
        return self._end(trial_id, TrialState.FAIL)

    def _end(self, trial_id: int, state: TrialState, value: float | None = None) -> bool:
        """The storage's atomic RUNNING -> `state` update. Not `study.tell`: when another worker reaped the trial a
        moment earlier, tell raises a ValueError ('Cannot tell a FAIL trial') that cannot be told from a wrong
        value, while the storage raises UpdateFinishedTrialError, the one signal every caller handles.

        A call the storage retried after a connection error (study.sweep.storage.retrying) may find the trial ended
        by its own first try, whose reply was lost. The token this call wrote first tells: the trial ended with it
        is this call's own update, not another process's (one that marked the trial before this call did and ended
        it during the outage would be taken for this call's too: both then queue a retry, and the second of the
        key's attempts to be claimed is dropped as a duplicate)."""
        token = uuid.uuid4().hex
        self.storage.set_trial_user_attr(trial_id, ENDED_BY, token)
        try:
            return self.storage.set_trial_state_values(trial_id, state=state, values=None if value is None else [value])
        except optuna.exceptions.UpdateFinishedTrialError:
            if getattr(self.storage, "last_call_retried", False):
                t = self.storage.get_trial(trial_id)
                if t.state == state and t.user_attrs.get(ENDED_BY) == token:
                    return True
            raise

    def release(self, claimed: Claimed, reason: str) -> None:
        """Give a claimed trial back (this worker is stopping): fail it and re-queue it."""
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            if self._fail(claimed.trial_id, retrying=True):
                self._requeue(self.storage.get_trial(claimed.trial_id), reason, counts=False)


def error_summary(error: str) -> str:
    """One line saying why an attempt failed: the exception's own line of a trial's log tail, with the lines of its
    message after it (a DataError names the dataset on its first line, the files it lacks on the next ones); the last
    line alone was often an indented fragment ("    tinyshakespeare/input.txt  (or input.txt.gz)")."""
    lines = error.strip().splitlines()
    heads = [i for i, line in enumerate(lines) if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Unavailable|Interrupt"
                                                           r"|Conflict|Refused)\b.*:", line)]
    if not heads:
        return lines[-1].strip() if lines else ""
    message = [lines[heads[-1]]]
    for line in lines[heads[-1] + 1:]:  # its message's further lines are indented
        if not line[:1].isspace():
            break
        message.append(line)
    return " ".join(line.strip() for line in message if line.strip())[:600]


def retry_pending(trials: list[optuna.trial.FrozenTrial]) -> bool:
    """Whether one key's trials include a failed attempt whose retry is not queued yet (marked RETRYING and no later
    trial of the key): its worker is between failing it and queueing the retry. One that died there leaves the key
    to the next `study sweep`, which queues failed keys again."""
    latest = max((t.number for t in trials), default=-1)
    return any(t.state == TrialState.FAIL and t.user_attrs.get(RETRYING) and t.number == latest for t in trials)
