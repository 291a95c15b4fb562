"""Settling a trial: the run directory's record decides whether it is a result, whatever the process's exit code, where
the attempt wrote it, and a worker whose trial was taken back by another worker just before it settled keeps going.

The queue and files are real; the trial processes are scripted (`sweep_fakes.fake_run`, a runner that dies after
writing its record, or a stand-in child that the worker supervises in-process)."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import optuna
import pandas as pd
import pytest

from study.io import read_json, read_json_or_none
from study.record import RunDir, make_record
from study.sweep import SweepOptions, run_sweep
from study.sweep.layout import trial_specs
from study.sweep.queue import TrialQueue, TrialSpec
from study.sweep.results import _status, own_attempts
from study.sweep.runner import prepare
from study.sweep.storage import open_storage
from study.sweep import worker
from sweep_fakes import fake_run
from test_sweep import REPO, TESTS, opts, write_spec

PLAN = {"sweep": "s", "objective": {"metric": "valid_loss"}}


@pytest.fixture(autouse=True)
def _fakes_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("STUDY_FAKE_SLEEP", "0")


def finish_then_die(cfg, run_dir, data_dir=None, cache_dir=None):
    """A trial process killed right after its finished metrics.json is written (OOM killer, a DDP rank's crash)."""
    fake_run(cfg, run_dir, data_dir, cache_dir)
    os.kill(os.getpid(), signal.SIGKILL)


def _claimed_attempt(tmp_path, queue: TrialQueue):
    from study.sweep.layout import SweepLayout

    layout = SweepLayout(tmp_path / "s")
    queue.sync([TrialSpec(key="p-s0", point="p", seed=0, label="baseline")])
    return layout, worker._start(queue, layout, queue.claim({"p-s0"}), PLAN)


def _last_attempt(run_dir) -> dict:
    return read_json(RunDir(run_dir).trial)["attempts"][-1]


# -- a finished record is a result whatever the exit code --------------------------------------------------------
def test_a_trial_killed_after_writing_its_finished_record_is_settled_as_that_result(tmp_path):
    queue = TrialQueue(optuna.storages.InMemoryStorage(), "s", max_retries=0)
    layout, attempt = _claimed_attempt(tmp_path, queue)
    RunDir(attempt.run_dir).write(make_record("completed", {"valid_loss": 1.23}, {}, steps=10))
    assert worker._settle(queue, layout, PLAN, attempt, rc=-9) == "completed"
    [trial] = queue.trials()
    assert trial.state.name == "COMPLETE" and trial.value == 1.23 and queue.counts(["p-s0"])["done"] == 1
    last = _last_attempt(attempt.run_dir)
    assert last["outcome"] == "completed" and last["returncode"] == -9  # the exit code stays in the log
    run = RunDir(attempt.run_dir)
    assert _status(run.read(), own_attempts(read_json_or_none(run.trial), "s")) == ("completed", "")


def test_a_killed_trial_whose_finished_record_lacks_the_objective_fails_for_that_reason_without_a_retry(tmp_path):
    # the same record on every retry: what a retry would find is this failure again
    queue = TrialQueue(optuna.storages.InMemoryStorage(), "s", max_retries=2)
    layout, attempt = _claimed_attempt(tmp_path, queue)
    RunDir(attempt.run_dir).write(make_record("completed", {"train_loss": 1.0}, {}, steps=10))
    assert worker._settle(queue, layout, PLAN, attempt, rc=-9) == "failed"
    assert [t.state.name for t in queue.trials()] == ["FAIL"]
    last = _last_attempt(attempt.run_dir)
    assert last["returncode"] == -9 and "no finite 'valid_loss'" in last["error"]
    assert last["missing_objective"] == "valid_loss"  # so a later objective the record has makes it a result
    run = RunDir(attempt.run_dir)
    status, error = _status(run.read(), own_attempts(read_json_or_none(run.trial), "s"))
    assert status == "failed" and "no finite 'valid_loss'" in error
    assert _status(run.read(), own_attempts(read_json_or_none(run.trial), "s"), objective="train_loss")[0] == \
        "completed"


def test_a_failed_process_does_not_take_a_finished_record_it_did_not_write_for_its_result(tmp_path):
    """A record already in the directory when the attempt started (another config's finished run, which the trial
    refused with RunDirConflict and exit code 1) is not this attempt's result: the attempt failed, and so does the
    results table's row."""
    queue = TrialQueue(optuna.storages.InMemoryStorage(), "s", max_retries=0)
    from study.sweep.layout import SweepLayout

    layout = SweepLayout(tmp_path / "s")
    run = RunDir(layout.run_dir("p", 0))
    run.path.mkdir(parents=True)
    run.write(make_record("completed", {"valid_loss": 9.9}, {}, steps=10))  # there before the attempt
    queue.sync([TrialSpec(key="p-s0", point="p", seed=0, label="baseline")])
    attempt = worker._start(queue, layout, queue.claim({"p-s0"}), PLAN)
    assert worker._settle(queue, layout, PLAN, attempt, rc=1) == "failed"
    assert [t.state.name for t in queue.trials()] == ["FAIL"]
    assert _last_attempt(attempt.run_dir)["outcome"] == "failed"
    assert _status(run.read(), own_attempts(read_json_or_none(run.trial), "s"))[0] == "failed"
    # the same record written during the attempt (a process killed after finishing) is its result
    queue2 = TrialQueue(optuna.storages.InMemoryStorage(), "s2", max_retries=0)
    queue2.sync([TrialSpec(key="p-s0", point="p", seed=0, label="baseline")])
    attempt2 = worker._start(queue2, layout, queue2.claim({"p-s0"}), {**PLAN, "sweep": "s2"})
    run.write(make_record("completed", {"valid_loss": 1.5}, {}, steps=10))
    assert worker._settle(queue2, layout, {**PLAN, "sweep": "s2"}, attempt2, rc=-9) == "completed"


def test_sweeps_sharing_a_run_directory_each_read_their_own_attempts(tmp_path):
    """trial.json is shared by the sweeps that share a point's run directory: sweep b's failed attempt (its process
    stopped before handing back) does not turn sweep a's finished trial into a failed one, and a record sweep b
    finished after sweep a's attempt had failed is sweep a's result too."""
    from study.sweep.layout import SweepLayout

    layout = SweepLayout(tmp_path / "s")
    run = RunDir(layout.run_dir("p", 0))

    def attempt_of(sweep: str):
        queue = TrialQueue(optuna.storages.InMemoryStorage(), sweep, max_retries=0)
        queue.sync([TrialSpec(key="p-s0", point="p", seed=0, label="baseline")])
        return queue, worker._start(queue, layout, queue.claim({"p-s0"}), {**PLAN, "sweep": sweep})

    def status(sweep: str) -> str:
        return _status(run.read(), own_attempts(read_json_or_none(run.trial), sweep), run.metrics.stat().st_mtime)[0]

    queue, attempt = attempt_of("a")
    run.write(make_record("completed", {"valid_loss": 1.5}, {}, steps=10))
    assert worker._settle(queue, layout, {**PLAN, "sweep": "a"}, attempt, rc=0) == "completed"
    queue, attempt = attempt_of("b")
    assert worker._settle(queue, layout, {**PLAN, "sweep": "b"}, attempt, rc=1) == "failed"
    assert (status("a"), status("b")) == ("completed", "failed")
    # the other way round: a's attempt failed first, then b finished the run
    run.metrics.unlink()
    queue, attempt = attempt_of("a")
    assert worker._settle(queue, layout, {**PLAN, "sweep": "a"}, attempt, rc=1) == "failed"
    queue, attempt = attempt_of("b")
    time.sleep(0.01)
    run.write(make_record("completed", {"valid_loss": 1.4}, {}, steps=10))
    assert worker._settle(queue, layout, {**PLAN, "sweep": "b"}, attempt, rc=0) == "completed"
    assert (status("a"), status("b")) == ("completed", "completed")


def test_a_sweep_whose_trial_process_dies_after_finishing_tabulates_its_result(tmp_path):
    path = write_spec(tmp_path, seeds=[0], axes={"model.norm_position": ["pre"]}, max_retries=0)
    options = SweepOptions(results=tmp_path / "results", runner="test_sweep_settle:finish_then_die",
                           estimate_rate=1e11, poll_s=0.3)
    final = run_sweep(path, options, say=lambda s: None)
    df = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet")
    assert list(df.status) == ["completed"] and df["metric.valid_loss"].notna().all()
    assert final["done"] == 1 and final["failed"] == 0


# -- a trial taken back by another worker just before it settles ---------------------------------------------------
def _reaped_by_another_worker(storage, queue: TrialQueue, trial_id: int) -> None:
    other = TrialQueue(storage, queue.sweep, heartbeat_s=1, grace_s=3)
    other.worker = "otherhost:1"  # a worker elsewhere, which cannot see that this one still runs
    storage.set_trial_user_attr(trial_id, "heartbeat", time.time() - 10)  # this worker was paused past the grace
    assert other.reap_lost() == 1


@pytest.mark.parametrize("rc", [0, 1])
def test_settling_a_trial_another_worker_reaped_leaves_it_to_that_workers_retry(tmp_path, caplog, rc):
    storage = optuna.storages.InMemoryStorage()
    queue = TrialQueue(storage, "s", heartbeat_s=1, grace_s=3)
    layout, attempt = _claimed_attempt(tmp_path, queue)
    _reaped_by_another_worker(storage, queue, attempt.claimed.trial_id)
    if rc == 0:
        RunDir(attempt.run_dir).write(make_record("completed", {"valid_loss": 1.0}, {}, steps=1))
    with caplog.at_level(logging.INFO, logger="study.sweep.worker"):
        assert worker._settle(queue, layout, PLAN, attempt, rc=rc) == "lost"
    assert [(t.state.name, t.user_attrs["attempt"]) for t in queue.trials()] == [("FAIL", 1), ("WAITING", 2)]
    assert _last_attempt(attempt.run_dir)["outcome"] == "lost"
    assert len([r for r in caplog.records if "another worker" in r.getMessage()]) == 1


class _ChildReapedBeforeItExits:
    """A trial process that finishes while another worker reaps its trial, before its worker's next heartbeat."""

    def __init__(self, storage, queue, run_dir, trial_id):
        self.storage, self.queue, self.run_dir, self.trial_id = storage, queue, run_dir, trial_id

    def wait(self, timeout=None):
        if self.trial_id is not None:
            _reaped_by_another_worker(self.storage, self.queue, self.trial_id)
        RunDir(self.run_dir).write(make_record("completed", {"valid_loss": 1.5}, {}, steps=10))
        return 0

    def kill(self):
        pass


def test_a_worker_whose_trial_is_reaped_as_it_ends_goes_on_and_the_retry_settles_it(tmp_path, monkeypatch):
    plan, layout, url = prepare(write_spec(tmp_path, seeds=[0], axes={"model.norm_position": ["pre"]}),
                                opts(tmp_path), say=lambda s: None)
    storage = open_storage(url)
    queue = TrialQueue(storage, "t", heartbeat_s=1, grace_s=3)
    queue.sync(trial_specs(read_json(layout.plan_path)))
    starts = []

    class Launcher:  # the first attempt is reaped; the retry, claimed by this same worker, ends normally
        def start(self, cmd, env, log):
            run_dir = cmd[cmd.index("--run-dir") + 1]
            first = None if starts else queue.trials(states=(optuna.trial.TrialState.RUNNING,))[0]._trial_id
            starts.append(run_dir)
            return _ChildReapedBeforeItExits(storage, queue, run_dir, first)

        def warm(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(worker, "Launcher", lambda opts: Launcher())
    summary = worker.run_worker(queue, layout, worker.WorkerOptions(poll_s=0.1))
    key = trial_specs(read_json(layout.plan_path))[0].key
    assert summary.lost == [key] and summary.ran == [key, key] and not summary.failed
    assert queue.counts([key])["done"] == 1 and len(starts) == 2


def test_a_result_fine_tuned_from_a_model_since_replaced_is_no_finished_trial(tmp_path):
    """A sweep rebuilds its queue from the run directories; a fine-tuning result whose start (task.init_from) was
    forced anew since is not handed back by the run layer, so the sweep does not count it done: it is queued again."""
    from study.config import ExperimentConfig
    from study.record import started_from
    from study.sweep.layout import SweepLayout, finished_results

    pre = RunDir(tmp_path / "pre")
    pre.path.mkdir()
    pre.weights.write_bytes(b"the pretrained model")
    layout = SweepLayout(tmp_path / "s")
    cfg = ExperimentConfig.from_dict({"model": {"arch": "encoder", "objective": "mlm"},
                                      "task": {"name": "glue", "dataset": "glue", "init_from": str(pre.path)}})
    layout.point_config("p").parent.mkdir(parents=True)
    layout.point_config("p").write_text(cfg.to_yaml())
    run = RunDir(layout.run_dir("p", 0))
    run.path.mkdir(parents=True)
    run.write(make_record("completed", {"glue_score": 60.0}, {}, steps=10))
    run.data.write_text(json.dumps({"parts": {"SST-2/seed0": started_from(pre.path)}}))
    specs = [TrialSpec(key="p-s0", point="p", seed=0, label="baseline")]
    assert finished_results(layout, specs, "glue_score") == {"p-s0": 60.0}
    pre.weights.write_bytes(b"the model trained anew")  # `study run --force` of the pretraining
    assert finished_results(layout, specs, "glue_score") == {}


def test_a_rebuilt_queue_s_attempts_keep_the_earlier_ones_of_the_same_trial_number(tmp_path):
    """After the documented storage move (the queue rebuilt) trial numbers start again: the new attempt #0 replaced
    the old #0 in trial.json, so the history and the table's attempt count lost it."""
    for _ in range(2):  # two queues, each numbering its first trial 0, over one run directory
        queue = TrialQueue(optuna.storages.InMemoryStorage(), "s", max_retries=0)
        layout, attempt = _claimed_attempt(tmp_path, queue)
        attempt.write("s", outcome="failed", error="x", ended=time.time())
    attempts = own_attempts(read_json(RunDir(attempt.run_dir).trial), "s")
    assert [a["trial"] for a in attempts] == [0, 0] and len({a["id"] for a in attempts}) == 2
