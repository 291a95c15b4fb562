"""`study sweep SPEC`: plan, validate, enqueue, run workers, write the results table.

    results/<sweep>/study.db         the queue (SQLite by default; or --storage URL)
    results/<sweep>/results.parquet  one row per (point, seed), rebuilt from the run directories
    (and the files `study.sweep.layout` lists)

Running the same command again continues an interrupted sweep, and says so and runs nothing
once the sweep is complete. Other machines join by running the same command with the same
`--storage` URL (and a shared results/ folder).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from study.interrupts import Terminated, shielded
from study.io import atomic_write_json, atomic_write_text, exclusive_lock, read_json
from study.sweep import plan as planning
from study.sweep import reach
from study.sweep.estimate import default_threads, estimate
from study.sweep.storage import (DEFAULT_RETRY_S, StorageError, default_url, file_path, open_storage, redact,
                                  retrying_at_most, scheme, validate_url)
from study.sweep.devices import DeviceError, assign, claim, gpus_per_trial, visible_gpus
from study.sweep.trial import DEFAULT_RUNNER
from study.sweep.layout import (SweepLayout, all_keys, check_storage, finished_results, read_tuned, record_storage,
                                recorded_storage, trial_specs)
from study.sweep.tuning import retryable, settle_tuning_locked
from study.sweep.worker import GIVE_BACK_S, STORAGE_ENV, WorkerOptions, die_with_parent, open_queue, run_worker

log = logging.getLogger(__name__)


@dataclass
class SweepOptions:
    results: str | Path = "results"
    storage: str | None = None
    workers: int | None = None
    threads: int | None = None
    data_dir: str | None = None
    cache_dir: str | None = None
    runner: str = DEFAULT_RUNNER
    dry_run: bool = False
    estimate_rate: float | None = None  # FLOP/s for the plan's estimate (None: measure)
    poll_s: float = 2.0
    launcher: str = "fork"  # how workers start trials (study.sweep.worker.Launcher)
    storage_retry_s: float = DEFAULT_RETRY_S  # how long a worker waits out an unreachable storage


def _check_data(plan: planning.Plan, plan_data: dict[str, Any], opts: SweepOptions, layout: SweepLayout,
                keys_left: list[str]) -> None:
    """Refuse a sweep whose trials left to run could not read their data (a --data-dir without the dataset), before
    any of them starts: each would fail with it three times. Only the points with a trial left are read (a finished
    point's data may be gone); a --runner of one's own reads what it reads. A dry run reads no data: it may plan for
    another machine, and with the hub reachable it would download the datasets."""
    if opts.runner != DEFAULT_RUNNER:
        return
    left = set(keys_left)
    points = {s.point for s in trial_specs(plan_data, read_tuned(layout))
              if s.key in left and layout.run(s.runs_point or s.point, s.seed).finished() is None}
    configs = [p.config for p in plan.points if p.point in points]
    if problems := reach.data_problems(configs, opts.data_dir, plan.metric):
        raise planning.SweepSpecError("the data the trials left to run read cannot be read (each would fail with it; "
                                      "none was started):\n" + "\n".join(problems))


def prepare(spec_path: str | Path, opts: SweepOptions, say: Callable[[str], None] = print,
            overrides: dict[str, Any] | None = None) -> tuple[planning.Plan, SweepLayout, str]:
    """Validate the spec and every point, print the plan, write the sweep folder. Runs nothing."""
    spec, root = planning.load_spec(spec_path, overrides)
    plan = planning.expand(spec, root)
    planning.check(plan)
    planning.check_parts(plan, opts.data_dir)
    workers = opts.workers or spec.workers
    threads = opts.threads or default_threads(workers)
    say(planning.describe(plan, estimate(plan, opts.estimate_rate, workers, threads), overridden=bool(overrides)))
    try:
        assign(workers, gpus_per_trial(plan.to_dict()), visible_gpus())  # every worker its own GPUs, or one clear error
    except DeviceError as err:
        if not opts.dry_run:
            raise
        say(f"  not on this machine: {err}")  # a dry run plans a sweep for the machine that will run it
    layout = SweepLayout(Path(opts.results) / spec.name)
    url = opts.storage or default_url(layout.sweep_dir)
    validate_url(url)
    if left := refuse_dropping_records(layout, plan.to_dict()):
        say(f"  note: {len(left)} finished trial(s) of the plan this folder last ran are not in this one (e.g. "
            f"{', '.join(left[:3])}): their run directories stay on disk, and a spec that plans them again finds "
            "them finished; this folder's results table and report will hold this plan's trials only")
    if opts.dry_run:
        return plan, layout, url
    # before anything in the sweep folder is written or rewritten: another storage than the folder's is refused,
    # and the storage is opened (a server unreachable, a journal path that is a folder, an unopenable file fail)
    check_storage(layout, url)
    open_storage(url)
    record_storage(layout, url)
    atomic_write_text(layout.sweep_dir / "spec.yaml", spec_as_run(spec_path, overrides))
    data = plan.to_dict()
    data["storage"] = redact(url)
    for p in plan.points:
        atomic_write_text(layout.point_config(p.point), p.config.to_yaml())
    atomic_write_json(layout.plan_path, data)
    return plan, layout, url


def refuse_dropping_records(layout: SweepLayout, plan: dict[str, Any]) -> list[str]:
    """Refuse a plan that would leave out of the sweep folder's results table a finished trial whose run directory
    is not here (a clean clone of a committed study, a copied folder): its row is then the only record, and the
    table is rebuilt for the planned trials alone. A spec of fewer seeds or other points under the same name (or
    `--set seeds=...`) would drop such rows for good; the trials whose run directories are here stay on disk, and
    are returned (their keys), for the plan to say so."""
    from study.record import FINISHED
    from study.sweep.layout import seed_key
    from study.sweep.results import read_previous

    planned = {seed_key(plan, p["point"], s) for p in plan["points"] for s in plan["seeds"]}
    previous = read_previous(layout.sweep_dir / "results")
    if previous.empty or "status" not in previous:
        return []
    left = [r for r in previous.to_dict("records") if r["trial_key"] not in planned and r.get("status") in FINISHED]
    dropped = [r["trial_key"] for r in left if not Path(str(r.get("run_dir") or "")).is_dir()]
    if dropped:
        raise planning.SweepSpecError(
            f"{layout.sweep_dir} holds {len(dropped)} finished trial(s) this spec does not plan (e.g. "
            f"{', '.join(sorted(dropped)[:3])}) whose run directories are not here: its results table is their only "
            "record, and running this plan there would drop them. Give this spec another name or --results folder "
            "(or restore the spec and seeds that ran them); nothing was run")
    return sorted(str(r["trial_key"]) for r in left)


def spec_as_run(spec_path: str | Path, overrides: dict[str, Any] | None) -> str:
    """The spec file's text, and the command line's `--set` overrides after it (plan.json's `spec` holds them
    applied): a report that quotes spec.yaml shows what ran, not what the file alone says."""
    text = Path(spec_path).read_text()
    if not overrides:
        return text
    lines = [f"#   {k}={json.dumps(v)}" for k, v in overrides.items()]
    return text.rstrip("\n") + "\n\n# run with `--set`, applied on top of the spec above:\n" + "\n".join(lines) + "\n"


def run_sweep(spec_path: str | Path, opts: SweepOptions, say: Callable[[str], None] = print,
              overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run (or continue) a sweep to the end; returns the final counts."""
    from study.sweep.results import summary, write_table

    plan, layout, url = prepare(spec_path, opts, say, overrides)
    if opts.dry_run:
        say("dry run: nothing was run")
        return {}
    started = time.time()
    plan_data = read_json(layout.plan_path)
    queue = open_queue(plan_data, url, opts.storage_retry_s)
    tuned = read_tuned(layout)
    specs = trial_specs(plan_data, tuned)
    keys = all_keys(plan_data)
    with queue.lock():  # the run directories read under the lock: one another host finishes now is not requeued
        added = queue.sync_anew_locked(retryable(specs, plan_data, tuned), finished_results(layout, specs, plan.metric))
        if plan_data.get("tune"):  # tuning that ended while no worker could settle it (a kill)
            settle_tuning_locked(queue, layout, plan_data, [p["point"] for p in plan_data["points"]])
    counts = queue.counts(keys)
    say(f"storage {redact(url)}: {counts['done']}/{len(keys)} trials done, {counts['running']} running, "
        f"{counts['queued']} queued ({added['enqueued']} newly queued, {added['recorded']} found finished on disk)")
    workers = opts.workers or plan.spec.workers
    threads = opts.threads or default_threads(workers)
    to_finish = _left_to_finish(plan_data, layout, keys)
    if queue.counts(to_finish)["done"] == len(to_finish):
        say(f"sweep {plan.spec.name!r} is complete: nothing to run")
    else:
        _check_data(plan, plan_data, opts, layout, to_finish)
        say(f"running with {workers} worker(s) x {threads} thread(s)")
        _run_workers(queue, layout, url, plan_data, opts, workers, threads, started)
    final = queue.counts(keys)
    _record_invocation(layout, started, workers, threads, final)  # first: the record outlives a table error
    df = write_table(layout.sweep_dir)
    say(summary(df, plan.metric))
    say(f"{final['done']}/{len(keys)} trials done; {final['failed']} failed"
        + (f"; see {layout.sweep_dir / 'results.csv'}" if len(df) else ""))
    return final


def _left_to_finish(plan_data: dict[str, Any], layout: SweepLayout, keys: list[str]) -> list[str]:
    """The keys a complete sweep has done: all but the failed tuning trials of a point whose setting is chosen,
    which are never run again (tuning.retryable). Read after settling, which may have chosen a setting just now."""
    tuned = read_tuned(layout)
    now = trial_specs(plan_data, tuned)
    settled = {s.key for s in now if s.kind == "tune"} - {s.key for s in retryable(now, plan_data, tuned)}
    return [k for k in keys if k not in settled]


def _run_workers(queue, layout: SweepLayout, url: str, plan_data: dict[str, Any], opts: SweepOptions, workers: int,
                 threads: int, started: float) -> None:
    """Run the workers to the end, each on its own GPUs, held host-wide while they run (`devices.claim`: a second
    `study sweep` on this host draws other GPUs); Ctrl-C becomes SweepInterrupted once the invocation is recorded."""
    wopts = WorkerOptions(data_dir=opts.data_dir, cache_dir=opts.cache_dir, threads=threads, runner=opts.runner,
                          poll_s=opts.poll_s, workers=workers, storage_retry_s=opts.storage_retry_s,
                          launcher=opts.launcher)
    gpus, claims = claim(workers, gpus_per_trial(plan_data), visible_gpus())  # (their number checked in prepare)
    try:
        if workers == 1:
            run_worker(queue, layout, replace(wopts, gpus=gpus[0]))
        else:
            run_worker_processes(layout, url, workers, wopts, gpus)
    except (KeyboardInterrupt, Terminated) as stop:  # Ctrl-C, or SIGTERM (`kill`, a batch scheduler)
        keys = all_keys(plan_data)
        try:  # later signals are ignored now: an unreachable storage is waited for briefly, not for its retry time
            with retrying_at_most(queue.storage, GIVE_BACK_S):
                counts = queue.counts(keys)
        except StorageError:
            counts = None
        _record_invocation(layout, started, workers, threads, counts, interrupted=True)
        done = f"{counts['done']}/{len(keys)}" if counts else f"?/{len(keys)} (the storage is unreachable)"
        raise SweepInterrupted(f"{'interrupted' if isinstance(stop, KeyboardInterrupt) else 'terminated'}: "
                               f"{done} trials done; the running ones were stopped and given back to the queue. "
                               "Run the same command again to resume.",
                               130 if isinstance(stop, KeyboardInterrupt) else stop.code) from None
    finally:
        claims.release()


class SweepInterrupted(Exception):
    """Ctrl-C (or SIGTERM) stopped a sweep; its message says what was interrupted and how to resume, `exit_code` is
    130 for Ctrl-C and 143 for SIGTERM (as a shell reports a process those signals killed)."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


def _record_invocation(layout: SweepLayout, started: float, workers: int, threads: int,
                       counts: dict[str, int] | None, interrupted: bool = False) -> None:
    """Append this invocation (when, how many workers, how long, the counts after it) to
    results/<sweep>/invocations.json: the sweep's wall-clock cost is measured, not guessed."""
    import socket

    path = layout.sweep_dir / "invocations.json"
    entry = {"host": socket.gethostname(), "started": started, "ended": time.time(),
             "wall_seconds": time.time() - started, "workers": workers, "threads": threads,
             "counts_after": counts, **({"interrupted": True} if interrupted else {})}
    with exclusive_lock(path.parent / f".{path.name}.lock"):  # two invocations ending at once each keep their entry
        history = read_json(path) if path.is_file() else []
        atomic_write_json(path, [*history, entry])


def run_worker_processes(layout: SweepLayout, url: str, workers: int, opts: WorkerOptions,
                         gpus: list[str | None] | None = None) -> None:
    """Start `workers` local worker processes (worker i with the GPUs `gpus[i]`) and wait for them; they die with
    this process."""
    env = {**os.environ, STORAGE_ENV: url}
    cmd = [sys.executable, "-m", "study.sweep.worker", "--sweep-dir", str(layout.sweep_dir),
           "--threads", str(opts.threads), "--runner", opts.runner, "--poll-s", str(opts.poll_s),
           "--workers", str(workers), "--storage-retry-s", str(opts.storage_retry_s), "--launcher", opts.launcher]
    if opts.data_dir:
        cmd += ["--data-dir", str(opts.data_dir)]
    if opts.cache_dir:
        cmd += ["--cache-dir", str(opts.cache_dir)]
    procs = []
    for gpu in gpus or [None] * workers:
        procs.append(subprocess.Popen(cmd + (["--gpus", gpu] if gpu is not None else []), env=env,
                                      preexec_fn=die_with_parent))
        time.sleep(0.2)  # stagger the first claims
    try:
        for i, p in enumerate(procs, start=1):
            # a worker that stopped on an error (its traceback is above) leaves the sweep short and its trial running
            # until a worker or the next `study sweep` takes it back: said here, not left to the final counts to hint
            if p.wait():
                log.warning("worker %d of %d (pid %d) stopped with exit code %d; its running trial is taken back when "
                            "another worker or the next `study sweep` finds it gone", i, workers, p.pid, p.returncode)
    except BaseException:
        with shielded():  # a second Ctrl-C must not end this process, which kills the workers (die_with_parent)
            _stop_workers(procs)
        raise


def _stop_workers(procs: list[subprocess.Popen]) -> None:
    """Ask every worker to stop (SIGTERM: a worker the terminal's Ctrl-C reached already ignores it) and wait for them
    to give their trials back, each within GIVE_BACK_S (`worker.GIVE_BACK_S`, twice: its trial process, then the
    storage) plus its own exit; a worker still running then is killed, and its trial is taken back as lost."""
    for p in procs:
        p.terminate()
    allowed = 2 * GIVE_BACK_S + 10
    deadline = time.time() + allowed
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            log.warning("worker pid %d did not stop within %.0f s of being asked; killed", p.pid, allowed)
            p.kill()
            p.wait()


def _recorded_file_storage(layout: SweepLayout) -> str | None:
    """The sweep's own sqlite or journal file (recorded absolute), for `study status` without --storage; a server's
    URL is not recorded whole (its password), so that one comes from --storage or $STUDY_STORAGE."""
    recorded = recorded_storage(layout)
    if recorded and recorded["identity"].startswith(("sqlite:", "journal:")):
        return recorded["identity"]
    return None


def _interrupted(queue, keys: list[str]) -> tuple[list, int]:
    """The RUNNING trials of this plan's keys that nothing runs (a Ctrl-C'd or killed worker's; the next worker takes
    them back), and how many keys `counts` calls running only through them (the study may also hold trials of keys an
    earlier version of the spec had, and a key's finished or live trial outranks a lost one)."""
    from optuna.trial import TrialState

    wanted = set(keys)
    lost = [(t, why) for t, why in queue.lost_running() if t.user_attrs.get("key") in wanted]
    lost_ids, groups = {t.number for t, _ in lost}, queue.by_key()
    stalled = {key for key in {t.user_attrs["key"] for t, _ in lost}
               if not any(x.state == TrialState.COMPLETE or (x.state == TrialState.RUNNING and x.number not in lost_ids)
                          for x in groups.get(key, []))}
    return lost, len(stalled)


@dataclass(frozen=True)
class SweepStatus:
    """What `study status` prints, and why the queue could not be read where it could not (an unreachable or
    refused storage: the run directories are still reported, and the command exits 1)."""

    text: str
    queue_error: str | None = None

    def __str__(self) -> str:
        return self.text


def status(sweep_dir: str | Path, storage: str | None = None) -> SweepStatus:
    """Progress of a sweep from its queue and its run directories. A storage URL of no known scheme is a
    StorageError (bad input, before anything is read); a queue file that is not there is reported, not created."""
    layout = SweepLayout(Path(sweep_dir))
    if not layout.plan_path.is_file():
        raise FileNotFoundError(f"{layout.sweep_dir} holds no sweep (no plan.json); run `study sweep SPEC` first")
    plan = read_json(layout.plan_path)
    specs = [s for s in trial_specs(plan, read_tuned(layout)) if s.kind == "seed"]
    keys = all_keys(plan)
    url = storage or _recorded_file_storage(layout) or default_url(layout.sweep_dir)
    validate_url(url)
    check_storage(layout, url)  # another storage than the folder's is refused, as `study sweep` refuses it
    lines = [f"sweep {plan['sweep']!r}: {len(plan['points'])} points x {len(plan['seeds'])} seeds"
             + (f" (+ {len(keys) - len(plan['points']) * len(plan['seeds'])} tuning trials)" if plan.get("tune") else "")
             + f" = {len(keys)} trials"]
    error = None
    try:
        if (nothing := _nothing_queued(url, plan["sweep"])) is not None:
            lines.append(f"queue ({redact(url)}) unavailable: {nothing}: nothing was queued there")
        else:
            lines += _queue_lines(plan, url, keys)
    except Exception as err:  # status still reports the files when the queue is unreachable
        error = redact(str(err)).splitlines()[0] if str(err) else type(err).__name__
        lines.append(f"queue ({redact(url)}) unavailable: {error}")
    on_disk = sum(layout.run(s.runs_point or s.point, s.seed).finished() is not None for s in specs)
    lines.append(f"finished seed-trial run directories: {on_disk}/{len(plan['points']) * len(plan['seeds'])}")
    from study.sweep.results import build_table, summary

    lines += ["", summary(build_table(layout.sweep_dir), plan["objective"]["metric"])]  # the metric so far, per point
    return SweepStatus("\n".join(lines), error)


def _nothing_queued(url: str, sweep: str) -> str | None:
    """Why the storage holds no queue of `sweep` (no file there, an empty journal, no such study), or None; a
    StorageError where a file there is no Optuna queue. A file is read before it is opened: opening writes (Optuna
    creates its tables in a SQLite file, and the queue a study in any storage), and status must not write a file it
    was only shown. (A server's database without Optuna's tables gets them when opened: it is there for queues.)"""
    if scheme(url) in ("sqlite", "journal"):
        path = file_path(url)
        if not path.exists():
            return f"no queue file at {path}"
        if not path.is_file():
            raise StorageError(f"{path} is a folder, not a queue file")
        if path.stat().st_size == 0:
            return f"{path} is empty"
        _check_queue_file(path, scheme(url))
    storage = open_storage(url)
    try:
        storage.get_study_id_from_name(sweep)
    except KeyError:
        return f"no sweep {sweep!r} in this storage"
    return None


def _check_queue_file(path: Path, kind: str) -> None:
    """A StorageError unless `path` is an Optuna SQLite database or journal, read without writing."""
    import sqlite3

    try:
        if kind == "journal":
            with open(path, "rb") as f:
                first = json.loads(f.readline())
            if not isinstance(first, dict) or "op_code" not in first:
                raise ValueError("its first line is no journal operation")
            return
        with contextlib.closing(sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)) as db:
            if not db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='studies'").fetchone():
                raise ValueError("it has no `studies` table")
    except (sqlite3.OperationalError, OSError) as err:  # (locked by a writer past the timeout, unreadable)
        raise StorageError(f"cannot read {path}: {err}") from None
    except (ValueError, sqlite3.Error, UnicodeDecodeError) as err:
        raise StorageError(f"{path} is not an Optuna {'journal' if kind == 'journal' else 'SQLite queue'} ({err})"
                           "; status does not write it") from None


def _queue_lines(plan: dict[str, Any], url: str, keys: list[str]) -> list[str]:
    """The queue's counts, and each trial a stopped worker left running."""
    queue = open_queue(plan, url, retry_s=0)  # status reports an outage, it does not wait it out
    counts = queue.counts(keys)
    lost, stalled = _interrupted(queue, keys)
    if lost:
        counts = {**counts, "running": counts["running"] - stalled, "interrupted": stalled}
    return [f"queue ({redact(url)}): " + ", ".join(f"{v} {k}" for k, v in counts.items())] + [
        f"  interrupted: {t.user_attrs.get('label')} seed {t.user_attrs.get('seed')} ({why}); rerunning "
        "`study sweep` resumes it" for t, why in lost]

