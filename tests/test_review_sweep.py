"""A sweep worker whose trial another worker ends underneath it goes on to its next trial; a lost tuning trial whose
retries are spent settles its point in the same invocation; a sweep's trials use the GPUs the command was given.

The queue (SQLite), the files and the workers are real; the trial processes are stand-ins the worker supervises
in-process, which write a finished run record."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import optuna
import pytest

from study.io import read_json
from study.record import RunDir, make_record
from study.sweep import devices, tuning, worker
from study.sweep.layout import SweepLayout, all_keys, trial_specs
from study.sweep.queue import TrialQueue
from study.sweep.runner import prepare
from study.sweep.storage import open_storage
from sweep_fakes import fake_run
from test_sweep import REPO, opts, write_spec

from test_sweep_tuning import (LR, ONE_POINT, _fakes_importable,  # noqa: F401 (an autouse fixture, shared)
                               _LogsAWorseCurve, two_finished_tuning_trials)


class _Finishes:
    """A trial process that writes a completed run record and exits 0."""

    def __init__(self, run_dir: str, before=None):
        self.run_dir, self.before = run_dir, before

    def wait(self, timeout=None):
        if self.before is not None:
            self.before()
        RunDir(self.run_dir).write(make_record("completed", {"valid_loss": 1.5}, {}, steps=10))
        return 0

    def kill(self):
        pass


class _Launcher:
    """Starts a `_Finishes` per trial; `before(n)` runs as the n-th trial process ends."""

    def __init__(self, before=None):
        self.run_dirs: list[str] = []
        self.before = before

    def start(self, cmd, env, log):
        self.run_dirs.append(cmd[cmd.index("--run-dir") + 1])
        n = len(self.run_dirs)
        return _Finishes(self.run_dirs[-1], (lambda: self.before(n)) if self.before else None)

    def warm(self):
        pass

    def close(self):
        pass


@pytest.fixture(scope="module")
def pg():
    from postgres_server import postgres_or_skip

    server = postgres_or_skip()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "journal", "postgresql"])
def storage_url(request, tmp_path):
    """Each storage the queue runs on: the embedded default, the journal file, a server."""
    if request.param == "postgresql":
        return request.getfixturevalue("pg").new_database()
    return f"{request.param}:///{tmp_path}/queue.{request.param}"


def _sweep(tmp_path: Path, url: str | None = None, **fields):
    _, layout, url = prepare(write_spec(tmp_path, **fields), opts(tmp_path, storage=url), say=lambda s: None)
    plan = read_json(layout.plan_path)
    queue = worker.open_queue(plan, url)
    queue.sync(trial_specs(plan))
    return plan, layout, url, queue


def _reap_from_elsewhere(url: str, trial_id: int) -> None:
    """Another worker (on another host, which cannot see this one run) judges the trial's heartbeat stale, fails it
    and re-queues it."""
    storage = open_storage(url)
    other = TrialQueue(storage, "t", heartbeat_s=1, grace_s=3)
    other.worker = "otherhost:1"
    storage.set_trial_user_attr(trial_id, "heartbeat", time.time() - 60)
    assert other.reap_lost() == 1


def _reaped_at(monkeypatch, queue: TrialQueue, url: str, attr: str, after: bool) -> list[int]:
    """Reap the first trial this worker writes `attr` on, just before (or just after) the write."""
    real, fired = queue.storage.set_trial_user_attr, []

    def write(trial_id, key, value):
        if key == attr and not fired and not after:
            fired.append(trial_id)
            _reap_from_elsewhere(url, trial_id)
        real(trial_id, key, value)
        if key == attr and not fired and after:
            fired.append(trial_id)
            _reap_from_elsewhere(url, trial_id)

    monkeypatch.setattr(queue.storage, "set_trial_user_attr", write)
    return fired


def _outcomes(run_dir) -> list[str]:
    return [a.get("outcome") for a in read_json(RunDir(run_dir).trial)["attempts"]]


# -- a trial ended underneath its worker -------------------------------------------------------------------------
def test_a_trial_reaped_between_recording_its_result_and_ending_it_is_lost_and_its_retry_completes_it(
        tmp_path, monkeypatch, storage_url):
    """Another worker fails the trial after its worker wrote the result's attributes and before it ended the trial:
    the worker records the attempt lost and goes on; the re-queued retry completes the key, once."""
    plan, layout, url, queue = _sweep(tmp_path, storage_url, **ONE_POINT)
    fired = _reaped_at(monkeypatch, queue, url, "status", after=True)
    launcher = _Launcher()
    monkeypatch.setattr(worker, "Launcher", lambda opts: launcher)
    summary = worker.run_worker(queue, layout, worker.WorkerOptions(poll_s=0.1))
    (key,) = all_keys(plan)
    assert fired and summary.lost == [key] and summary.ran == [key, key] and not summary.failed
    assert queue.counts([key]) == {"done": 1, "running": 0, "queued": 0, "failed": 0, "not queued": 0}
    assert _outcomes(launcher.run_dirs[0]) == ["lost", "completed"]


def test_a_tuning_trial_reaped_as_it_starts_is_lost_and_the_worker_goes_on_to_finish_the_sweep(tmp_path, monkeypatch):
    """The storage refuses the tuning trial's first write (another worker failed and re-queued it): the worker moves
    on instead of stopping, the TPE trial it had asked for is told failed, and every key ends done, each once."""
    plan, layout, url, queue = _sweep(tmp_path, tune=LR, **ONE_POINT)
    fired = _reaped_at(monkeypatch, queue, url, "runs_point", after=False)
    launcher = _Launcher()
    monkeypatch.setattr(worker, "Launcher", lambda opts: launcher)
    summary = worker.run_worker(queue, layout, worker.WorkerOptions(poll_s=0.1))
    keys = all_keys(plan)
    assert fired and len(summary.lost) == 1 and not summary.failed
    assert queue.counts(keys)["done"] == 3 and len(launcher.run_dirs) == 3
    tpe = tuning.tune_study(queue, plan, plan["points"][0]["point"])
    assert sorted(t.state.name for t in tpe.trials) == ["COMPLETE", "COMPLETE", "FAIL"]


def test_a_pruned_tuning_trial_reaped_before_it_is_ended_is_lost_not_the_end_of_its_worker(tmp_path, monkeypatch):
    plan, layout, url, queue = _sweep(tmp_path, tune={**LR, "trials": 3, "pruner": "median"}, **ONE_POINT)
    two_finished_tuning_trials(tuning.tune_study(queue, plan, plan["points"][0]["point"]))
    fired = _reaped_at(monkeypatch, queue, url, "status", after=True)

    class Launcher:
        def start(self, cmd, env, log):
            return _LogsAWorseCurve(cmd[cmd.index("--run-dir") + 1])

    claimed = queue.claim(set(all_keys(plan)))
    assert worker.run_trial(queue, layout, claimed, plan, worker.WorkerOptions(), Launcher()) == "lost"
    assert fired == [claimed.trial_id]
    retry = [t for t in queue.trials((optuna.trial.TrialState.WAITING,)) if t.user_attrs["key"] == claimed.spec.key]
    assert [t.user_attrs["attempt"] for t in retry] == [2]


def test_a_worker_interrupted_while_its_trial_process_starts_gives_the_trial_back(tmp_path):
    """Ctrl-C while the launcher starts the trial (the zygote imports torch and Lightning for seconds): the attempt
    is recorded interrupted and the trial is queued again, not left RUNNING for the grace period to reap as lost
    (which would spend one of its retries). The zygote may have forked the trial already: the launcher is closed
    (which kills its children) before the trial is queued again, so no process of the old attempt outlives it."""
    plan, layout, url, queue = _sweep(tmp_path, **ONE_POINT)
    events = []

    class Launcher:
        def start(self, cmd, env, log):
            raise KeyboardInterrupt

        def close(self):
            events.append(("closed", queue.counts(all_keys(plan))["running"]))

    claimed = queue.claim(set(all_keys(plan)))
    with pytest.raises(KeyboardInterrupt):
        worker.run_trial(queue, layout, claimed, plan, worker.WorkerOptions(), Launcher())
    assert events == [("closed", 1)]  # closed while the trial was still this worker's
    (key,) = all_keys(plan)
    assert queue.counts([key]) == {"done": 0, "running": 0, "queued": 1, "failed": 0, "not queued": 0}
    run_dir = next(Path(layout.sweep_dir).parent.rglob("trial.json")).parent
    assert _outcomes(run_dir) == ["interrupted"]


def test_a_worker_interrupted_while_it_opens_its_trials_log_gives_the_trial_back(tmp_path, monkeypatch):
    """Between setting the attempt up and starting its process the worker writes the trial's log header: an
    interrupt there gives the trial back as well."""
    plan, layout, url, queue = _sweep(tmp_path, **ONE_POINT)

    def interrupted_open(*args, **kwargs):
        raise KeyboardInterrupt

    class Launcher:
        def start(self, cmd, env, log):
            raise AssertionError("never reached")

        def close(self):
            pass

    claimed = queue.claim(set(all_keys(plan)))
    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(worker, "open", interrupted_open, raising=False)
        worker.run_trial(queue, layout, claimed, plan, worker.WorkerOptions(), Launcher())
    (key,) = all_keys(plan)
    assert queue.counts([key]) == {"done": 0, "running": 0, "queued": 1, "failed": 0, "not queued": 0}
    run_dir = next(Path(layout.sweep_dir).parent.rglob("trial.json")).parent
    assert _outcomes(run_dir) == ["interrupted"]


def test_a_worker_interrupted_as_it_announces_a_trial_gives_the_trial_back(tmp_path, monkeypatch):
    """The line that names a claimed trial is written once the trial is this worker's: an interrupt there gives
    the trial back, as anywhere after the claim."""
    plan, layout, url, queue = _sweep(tmp_path, **ONE_POINT)
    announce = worker.log.info

    def interrupted_announcement(message, *args):
        if message.startswith("%s: trial %d %s%s seed %d (attempt %d)"):
            raise KeyboardInterrupt
        announce(message, *args)

    monkeypatch.setattr(worker, "Launcher", lambda opts: _Launcher())
    monkeypatch.setattr(worker.log, "info", interrupted_announcement)
    with pytest.raises(KeyboardInterrupt):
        worker.run_worker(queue, layout, worker.WorkerOptions(poll_s=0.1))
    (key,) = all_keys(plan)
    assert queue.counts([key]) == {"done": 0, "running": 0, "queued": 1, "failed": 0, "not queued": 0}


def test_a_claim_ended_underneath_by_another_process_is_skipped_not_raised(tmp_path, monkeypatch):
    plan, layout, url, queue = _sweep(tmp_path, seeds=[0, 1], axes={"model.norm_position": ["pre"]})
    fired = _reaped_at(monkeypatch, queue, url, "heartbeat", after=False)
    claimed = queue.claim(set(all_keys(plan)))
    assert fired and claimed is not None and claimed.trial_id != fired[0]


# -- a lost tuning trial with no retry left ------------------------------------------------------------------------
def test_a_lost_tuning_trial_without_retries_settles_its_point_in_the_same_invocation(tmp_path, monkeypatch):
    """The last tuning trial to end is one whose worker died, with no retry left: the worker that reaps it settles
    the point, so the point's seeds run now, not at the next `study sweep`."""
    plan, layout, url, queue = _sweep(tmp_path, tune=LR, max_retries=0, **ONE_POINT)
    dead = TrialQueue(open_storage(url), "t", heartbeat_s=1, grace_s=5, max_retries=0)
    dead.worker = "otherhost:1"  # a worker elsewhere, alive until the first trial here ends
    lost = dead.claim()
    assert lost.spec.kind == "tune"

    def its_worker_dies(n):
        if n == 1:
            dead.storage.set_trial_user_attr(lost.trial_id, "heartbeat", time.time() - 60)

    launcher = _Launcher(its_worker_dies)
    monkeypatch.setattr(worker, "Launcher", lambda opts: launcher)
    worker.run_worker(queue, layout, worker.WorkerOptions(poll_s=0.1))
    counts = queue.counts(all_keys(plan))
    assert (counts["done"], counts["failed"]) == (2, 1)  # the other tuning trial and the point's seed
    (entry,) = read_json(SweepLayout(layout.sweep_dir).tuned_path).values()
    assert entry["point"] and sorted(t["status"] for t in entry["trials"]) == ["completed", "failed"]


# -- the GPUs a sweep's trials use ---------------------------------------------------------------------------------
def records_its_gpus(cfg, run_dir, data_dir=None, cache_dir=None):
    """Trains as fake_run does, and writes the CUDA_VISIBLE_DEVICES the trial process was given."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "cuda_visible_devices").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"))
    return fake_run(cfg, run_dir, data_dir, cache_dir)


def test_trials_use_the_gpus_the_sweep_command_was_given_not_the_first_ones(tmp_path, monkeypatch):
    """`CUDA_VISIBLE_DEVICES=2,3 study sweep --workers 2`: each worker's trials see one of 2 and 3 (never 0 or 1)."""
    from study.sweep import SweepOptions, run_sweep

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    path = write_spec(tmp_path, seeds=[0, 1, 2, 3], axes={"model.norm_position": ["pre"]})
    options = SweepOptions(results=tmp_path / "results", runner="test_review_sweep:records_its_gpus", workers=2,
                           estimate_rate=1e11, poll_s=0.3)
    run_sweep(path, options, say=lambda s: None)
    seen = [p.read_text() for p in (tmp_path / "results" / "runs").glob("*/seed-*/cuda_visible_devices")]
    assert len(seen) == 4 and set(seen) <= {"2", "3"}


@pytest.fixture
def claims_here(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.CLAIMS_ENV, str(tmp_path / "gpu-claims"))
    held: list[devices.GpuClaims] = []
    yield held
    for claims in held:
        claims.release()


def _claim(held, *args):
    gpus, claims = devices.claim(*args)
    held.append(claims)
    return gpus


def test_a_second_sweep_on_the_host_draws_the_gpus_the_first_does_not_hold(claims_here, caplog):
    four = ["0", "1", "2", "3"]
    assert _claim(claims_here, 2, 1, four) == ["0", "1"]
    assert _claim(claims_here, 1, 2, four) == ["2,3"]
    assert not caplog.records
    claims_here.pop(0).release()  # the first sweep ended: its GPUs are free again
    assert _claim(claims_here, 2, 1, four) == ["0", "1"]


def test_a_sweep_that_finds_too_few_free_gpus_shares_held_ones_and_says_which(claims_here, caplog):
    assert _claim(claims_here, 1, 1, ["0", "1"]) == ["0"]
    assert _claim(claims_here, 2, 1, ["0", "1"]) == ["1", "0"]  # the free one first
    assert "GPU(s) 0 are in use by another `study sweep` on this host" in caplog.text


def test_a_killed_sweeps_gpus_are_free_at_once(claims_here):
    import signal
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "from study.sweep import devices; import sys, time; "
                               "devices.claim(1, 1, ['0']); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    assert _claim(claims_here, 1, 1, ["0", "1"]) == ["1"]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert _claim(claims_here, 1, 1, ["0"]) == ["0"]


def test_a_sweep_runs_its_trials_on_the_gpus_another_sweep_on_the_host_does_not_hold(tmp_path, monkeypatch,
                                                                                      claims_here):
    from study.sweep import SweepOptions, run_sweep

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert _claim(claims_here, 1, 1, ["2"]) == ["2"]  # another sweep's
    path = write_spec(tmp_path, seeds=[0, 1], axes={"model.norm_position": ["pre"]})
    options = SweepOptions(results=tmp_path / "results", runner="test_review_sweep:records_its_gpus", workers=1,
                           estimate_rate=1e11, poll_s=0.3)
    run_sweep(path, options, say=lambda s: None)
    seen = [p.read_text() for p in (tmp_path / "results" / "runs").glob("*/seed-*/cuda_visible_devices")]
    assert seen == ["3", "3"]
    assert _claim(claims_here, 1, 1, ["3"]) == ["3"]  # released when the sweep ended


def test_a_worker_process_that_stops_on_an_error_is_named_with_its_exit_code(tmp_path, caplog):
    from study.sweep.runner import run_worker_processes

    nothing_here = SweepLayout(tmp_path / "no-sweep")  # no plan.json: the worker process stops at once
    run_worker_processes(nothing_here, f"sqlite:///{tmp_path}/q.db", 1, worker.WorkerOptions(), [None])
    assert "worker 1 of 1 (pid" in caplog.text and "stopped with exit code 1" in caplog.text


def test_a_stale_heartbeat_from_another_host_names_clock_skew_as_a_cause():
    """A heartbeat's age compares two hosts' clocks: the reason a trial is reaped says so when its worker is elsewhere."""
    from study.record import host_id as _host
    from study.sweep.queue import _stale_reason

    elsewhere = _stale_reason(75.2, "gpu-node-7:4242")
    assert elsewhere.startswith("no heartbeat for 75 s") and "gpu-node-7" in elsewhere and "clock" in elsewhere
    assert _stale_reason(75.2, f"{_host()}:4242") == "no heartbeat for 75 s"


@pytest.mark.skipif(not Path("/proc/self/ns/pid").exists(), reason="no PID namespaces here")
def test_a_worker_is_judged_gone_by_its_pid_only_in_this_process_s_pid_namespace():
    """Containers on one machine may share a hostname but not their PIDs: a worker of another namespace whose pid
    is free here runs on, and only its heartbeat's age may reap its trials."""
    import socket

    from study.record import host_id as _host, worker_gone as _gone_from_this_host

    gone = subprocess.Popen(["true"])
    gone.wait()
    assert _gone_from_this_host(f"{_host()}:{gone.pid}")
    assert not _gone_from_this_host(f"{socket.gethostname()}:{gone.pid}")  # the same hostname, another namespace
    assert TrialQueue(optuna.storages.InMemoryStorage(), "s").worker == f"{_host()}:{os.getpid()}"


def test_a_trial_killed_with_its_sweep_three_times_runs_again_as_a_first_attempt():
    """Each kill -9, reboot or preemption of a running `study sweep` left its trial RUNNING; the next invocation's
    worker reaped it as a failed attempt, so with max_retries 2 the third such kill failed the trial for good, unrun.
    A new invocation queues what nothing runs again as the same attempt."""
    from study.record import host_id as _host
    from study.sweep.queue import TrialSpec

    storage = optuna.storages.InMemoryStorage()
    spec = TrialSpec(key="p-s0", point="p", seed=0, label="baseline")
    queue = TrialQueue(storage, "s", max_retries=2)
    dead = subprocess.Popen(["true"])
    dead.wait()
    queue.sync([spec])
    for _ in range(3):  # three invocations, each killed while its trial ran
        with queue.lock():
            queue.sync_anew_locked([spec], {})
        claimed = queue.claim({"p-s0"})
        assert claimed is not None
        storage.set_trial_user_attr(claimed.trial_id, "worker", f"{_host()}:{dead.pid}")
    with queue.lock():
        queue.sync_anew_locked([spec], {})
    assert queue.reap() == []  # nothing left for the worker's reaper to count
    again = queue.claim({"p-s0"})
    assert again is not None and storage.get_trial(again.trial_id).user_attrs["attempt"] == 1
    assert storage.get_trial(again.trial_id).user_attrs["retry_of"] == claimed.number  # its history kept


def test_a_trial_failed_for_an_objective_since_replaced_by_one_its_record_has_is_its_result():
    """It completed without the sweep's first objective (valid_ppl inf) and failed; the objective became valid_loss,
    and the rerun's queue counted it done from its files, writing no attempt: the table kept saying failed, and the
    summary and the report left the finished result out."""
    from study.sweep.results import _status

    record = {"status": "completed", "metrics": {"valid_loss": 2.0, "valid_ppl": float("inf")}}
    failed = [{"id": "s#1", "started": 1.0, "ended": 2.0, "outcome": "failed", "error": "no finite 'valid_ppl'",
               "missing_objective": "valid_ppl"}]
    assert _status(record, failed, written=1.5, objective="valid_loss") == ("completed", "")
    assert _status(record, failed, written=1.5, objective="valid_ppl")[0] == "failed"  # still missing it
    older = [{**failed[0], "missing_objective": None}]  # another failure: this record was not the attempt's
    assert _status(record, older, written=1.5, objective="valid_loss")[0] == "failed"


def test_a_tuning_attempt_the_reaper_gives_up_ends_its_tpe_trial():
    """No retry starts at its setting to end it, and the point's TPE study kept it RUNNING for good."""
    from study.config.sweep import TUNE_DEFAULTS
    from study.sweep.layout import tuning_key
    from study.sweep.queue import TrialSpec

    storage = optuna.storages.InMemoryStorage()
    queue = TrialQueue(storage, "s", max_retries=0)
    plan = {"sweep": "s", "objective": {"metric": "valid_loss", "direction": "minimize"},
            "tune": {**TUNE_DEFAULTS, "field": "train.lr", "low": 1e-4, "high": 1e-2, "trials": 2}}
    key = tuning_key(plan, "p", 0)
    study = tuning.tune_study(queue, plan, "p", 0)
    asked = study.ask()
    queue.sync([TrialSpec(key=key, point="p", seed=0, label="baseline", kind="tune")])
    claimed = queue.claim({key})
    storage.set_trial_user_attr(claimed.trial_id, "tune_trial", asked.number)
    given_up = [storage.get_trial(claimed.trial_id)]
    tuning.end_given_up(queue, plan, given_up)
    assert study.trials[asked.number].state.name == "FAIL"


def test_status_counts_interrupted_trials_of_this_plans_keys_once_and_never_a_negative_running():
    from study.record import host_id as _host
    from study.sweep.queue import TrialSpec
    from study.sweep.runner import _interrupted

    storage = optuna.storages.InMemoryStorage()
    queue = TrialQueue(storage, "s", max_retries=2)
    dead = subprocess.Popen(["true"])
    dead.wait()
    specs = [TrialSpec(key=k, point=k, seed=0, label=k) for k in ("a", "b", "old")]
    queue.sync(specs)
    for key in ("a", "b", "old"):  # each left running by a killed worker
        claimed = queue.claim({key})
        storage.set_trial_user_attr(claimed.trial_id, "worker", f"{_host()}:{dead.pid}")
    queue.study.add_trial(optuna.trial.create_trial(  # "a" finished meanwhile: another attempt of it completed
        state=optuna.trial.TrialState.COMPLETE, value=1.0, user_attrs=specs[0].attrs()))
    keys = ["a", "b"]  # "old": a key of an earlier version of the spec
    lost, stalled = _interrupted(queue, keys)
    assert sorted(t.user_attrs["key"] for t, _ in lost) == ["a", "b"] and stalled == 1
    assert queue.counts(keys)["running"] - stalled == 0


def test_a_given_up_tuning_attempt_of_an_earlier_tuning_leaves_the_current_tpe_study_alone():
    from study.config.sweep import TUNE_DEFAULTS
    from study.sweep.queue import TrialSpec

    storage = optuna.storages.InMemoryStorage()
    queue = TrialQueue(storage, "s", max_retries=0)
    plan = {"sweep": "s", "objective": {"metric": "valid_loss", "direction": "minimize"},
            "tune": {**TUNE_DEFAULTS, "field": "train.lr", "low": 1e-4, "high": 1e-2, "trials": 2}}
    queue.sync([TrialSpec(key="p-oldtuning-tune0", point="p", seed=0, label="baseline", kind="tune")])
    claimed = queue.claim({"p-oldtuning-tune0"})
    storage.set_trial_user_attr(claimed.trial_id, "tune_trial", 5)  # a number the current study holds too
    current = tuning.tune_study(queue, plan, "p", 0)
    for _ in range(6):
        current.ask()
    tuning.end_given_up(queue, plan, [storage.get_trial(claimed.trial_id)])  # no error: the worker goes on
    assert current.trials[5].state == optuna.trial.TrialState.RUNNING  # not the earlier tuning's trial: left alone
