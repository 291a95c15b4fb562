"""Tuning mode keeps "a study never lies": what a tuning chose comes from tuning trials of the spec's own tune
settings that finished, and reaches the seeds it labels; a tune block the config or the sampler would refuse is
refused before anything runs; a tuning trial that fails to start, or a worker killed as a tuning trial ends, costs
no point its seeds.

The queue, the processes and the files are real; training is scripted (`sweep_fakes.fake_run`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml

from study.io import atomic_write_json, read_json
from study.record import RunDir
from study.sweep import SweepInterrupted, SweepOptions, SweepSpecError, expand, load_spec, run_sweep
from study.sweep import tuning
from study.sweep import worker
from study.sweep.layout import SweepLayout, all_keys, trial_specs
from study.sweep.plan import check
from study.record import host_id as _host
from study.sweep.queue import TrialQueue
from study.sweep.results import build_table, tuning_table
from study.sweep.runner import prepare
from study.sweep.storage import open_storage
from sweep_fakes import fake_run
from test_sweep import REPO, TESTS, completions, opts, queue_for, write_spec

NSP_GLUE = REPO / "experiments" / "sweeps" / "nsp_glue.yaml"
LR = {"field": "train.lr", "low": 1e-4, "high": 1e-2, "trials": 2}
ONE_POINT = {"seeds": [0], "axes": {"model.norm_position": ["pre"]}}


@pytest.fixture(autouse=True)
def _fakes_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("STUDY_FAKE_SLEEP", "0")


def quiet(_line: str) -> None:
    pass


def runner_opts(tmp_path: Path, runner: str) -> SweepOptions:
    return SweepOptions(results=tmp_path / "results", runner=f"test_sweep_tuning:{runner}", estimate_rate=1e11,
                        poll_s=0.3)


def tuned_entry(tmp_path: Path) -> dict:
    (entry,) = read_json(tmp_path / "results" / "t" / "tuned.json").values()
    return entry


def flaky_run(cfg, run_dir, data_dir=None, cache_dir=None):
    """Fails while the file $STUDY_TEST_FAIL_FLAG exists (data not mounted yet), then trains as fake_run does."""
    if Path(os.environ["STUDY_TEST_FAIL_FLAG"]).exists():
        raise RuntimeError("scripted transient failure (data not mounted)")
    return fake_run(cfg, run_dir, data_dir, cache_dir)


def first_tuning_trial_fails(cfg, run_dir, data_dir=None, cache_dir=None):
    """The first tuning trial to start fails (for good, with max_retries 0); every other run trains as fake_run."""
    marker = Path(os.environ["STUDY_TEST_FAILED_ONCE"])
    if cfg.train.seed == 1000 and not marker.exists():
        marker.write_text("")
        raise RuntimeError("scripted failure of one tuning trial")
    return fake_run(cfg, run_dir, data_dir, cache_dir)


def second_tuning_trial_fails_once(cfg, run_dir, data_dir=None, cache_dir=None):
    """The second tuning trial to start fails on its first attempt; every other run trains as fake_run."""
    count = Path(os.environ["STUDY_TEST_FAILED_ONCE"])
    if cfg.train.seed == 1000:
        started = len(count.read_text()) if count.exists() else 0
        count.write_text("x" * (started + 1))
        if started == 1:
            raise RuntimeError("scripted failure of one attempt")
    return fake_run(cfg, run_dir, data_dir, cache_dir)


def leaves_an_objectiveless_seed_run(cfg, run_dir, data_dir=None, cache_dir=None):
    """As the run layer: a finished run directory is handed back untrained. A tuning trial also leaves its config's
    seed-0 directory finished without the objective (another sweep's run of that config, whose task broke its
    declaration)."""
    if (record := RunDir(run_dir).finished()) is not None:
        return record
    record = fake_run(cfg, run_dir, data_dir, cache_dir)
    sibling = Path(run_dir).parent / "seed-0"
    if cfg.train.seed == 1000 and not sibling.exists():
        sibling.mkdir()
        atomic_write_json(sibling / "metrics.json", {"status": "completed", "steps": 10, "metrics": {}})
    return record


# -- the tune settings are part of what a tuning is ---------------------------------------------------------------
def _plan(**tune) -> dict:
    return {"sweep": "t", "points": [{"point": "p", "label": "baseline"}], "seeds": [0],
            "objective": {"metric": "valid_loss", "direction": "minimize"},
            "tune": {"field": "train.lr", "low": 1e-4, "high": 1e-2, "log": True, "trials": 2, "seed": 1000,
                     "pruner": "none", "sampler_seed": 0, **tune}}


@pytest.mark.parametrize("change", [
    {"field": "train.weight_decay"}, {"low": 1e-5}, {"high": 1e-1}, {"log": False}, {"trials": 3}, {"seed": 7},
    {"pruner": "median"}, {"sampler_seed": 1}, {"objective": {"metric": "valid_ppl", "direction": "minimize"}},
    {"objective": {"metric": "valid_loss", "direction": "maximize"}},
])
def test_every_tune_setting_and_the_objective_name_the_tuning_trials_and_the_tuned_seeds(change):
    before = _plan()
    after = {**before, **{k: v for k, v in change.items() if k == "objective"},
             "tune": {**before["tune"], **{k: v for k, v in change.items() if k != "objective"}}}
    assert all_keys(json.loads(json.dumps(before))) == all_keys(before)  # read back from plan.json: the same trials
    assert not set(all_keys(after)) & set(all_keys(before))


def test_a_range_end_written_as_an_integer_or_a_float_is_the_same_tuning():
    assert all_keys(_plan(low=0, high=1, log=False)) == all_keys(_plan(low=0.0, high=1.0, log=False))


def test_a_changed_objective_direction_gets_a_tpe_study_of_that_direction():
    storage = optuna.storages.InMemoryStorage()
    first = tuning.tune_study(TrialQueue(storage, "t", "minimize"), _plan(), "p")
    plan = {**_plan(), "objective": {"metric": "valid_loss", "direction": "maximize"}}
    second = tuning.tune_study(TrialQueue(storage, "t", "maximize"), plan, "p")
    assert first.direction.name == "MINIMIZE" and second.direction.name == "MAXIMIZE"


def test_a_changed_tune_block_is_tuned_again_and_the_table_labels_what_ran(tmp_path):
    run_sweep(write_spec(tmp_path, tune=LR, **ONE_POINT), opts(tmp_path), say=quiet)
    decay = {"field": "train.weight_decay", "low": 0.0, "high": 0.3, "log": False, "trials": 2}
    path = write_spec(tmp_path, tune=decay, **ONE_POINT)
    prepare(path, opts(tmp_path), say=quiet)  # the new spec, before its tuning ran: nothing of the old one is its
    (row,) = build_table(tmp_path / "results" / "t").to_dict("records")
    assert row["status"] == "pending" and pd.isna(row["tuned.train.weight_decay"])
    run_sweep(path, opts(tmp_path), say=quiet)
    entry = tuned_entry(tmp_path)
    assert entry["field"] == "train.weight_decay" and len(entry["trials"]) == 2
    assert [old["field"] for old in entry["superseded"].values()] == ["train.lr"]  # the earlier tuning is kept
    (row,) = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet").to_dict("records")
    ran = yaml.safe_load(Path(row["run_dir"], "config.yaml").read_text())["train"]
    assert row["status"] == "completed" and ran["weight_decay"] == row["tuned.train.weight_decay"] == entry["value"]
    assert ran.get("lr", 1e-3) == 1e-3  # the base's: the earlier tuning's lr is not what this tuning's seeds ran
    assert set(completions(tmp_path / "results").values()) == {1}  # every run trained once


# -- the seeds run the tuned config, and only a result on disk counts as done ---------------------------------------
def test_adding_tune_to_a_sweep_that_ran_runs_its_seeds_with_the_tuned_setting(tmp_path):
    run_sweep(write_spec(tmp_path, **ONE_POINT), opts(tmp_path), say=quiet)
    final = run_sweep(write_spec(tmp_path, tune=LR, **ONE_POINT), opts(tmp_path), say=quiet)
    entry = tuned_entry(tmp_path)
    (row,) = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet").to_dict("records")
    assert final["done"] == 3 and Path(row["run_dir"]) == tmp_path / "results" / "runs" / entry["point"] / "seed-0"
    ran = yaml.safe_load(Path(row["run_dir"], "config.yaml").read_text())["train"]
    assert ran["lr"] == row["tuned.train.lr"] == entry["value"] != 1e-3


def test_settling_queues_a_tuned_seed_whose_run_is_not_on_disk_though_the_queue_remembers_it_done(tmp_path):
    run_sweep(write_spec(tmp_path, tune=LR, **ONE_POINT), opts(tmp_path), say=quiet)
    sweep = tmp_path / "results" / "t"
    RunDir(sweep.parent / "runs" / tuned_entry(tmp_path)["point"] / "seed-0").metrics.unlink()
    queue, _ = queue_for(sweep)
    plan = read_json(sweep / "plan.json")
    with queue.lock():
        tuning.settle_tuning_locked(queue, SweepLayout(sweep), plan, [p["point"] for p in plan["points"]])
    seed_keys = [k for k in all_keys(plan) if "-tune" not in k]
    assert queue.counts(seed_keys)["queued"] == 1


def test_a_tuned_seed_whose_finished_run_lacks_the_objective_is_not_recorded_as_done(tmp_path):
    options = runner_opts(tmp_path, "leaves_an_objectiveless_seed_run")
    final = run_sweep(write_spec(tmp_path, tune=LR, **ONE_POINT, max_retries=0), options, say=quiet)
    assert final["failed"] == 1 and final["done"] == 2
    (row,) = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet").to_dict("records")
    assert row["status"] == "failed" and "no finite 'valid_loss'" in row["error"]


# -- what tuning chose comes from tuning trials that finished -------------------------------------------------------
def test_a_point_whose_tuning_failed_is_tuned_when_a_rerun_finishes_it(tmp_path, monkeypatch):
    flag = tmp_path / "data-not-mounted"
    flag.write_text("")
    monkeypatch.setenv("STUDY_TEST_FAIL_FLAG", str(flag))
    path = write_spec(tmp_path, tune=LR, **ONE_POINT, max_retries=0)
    options = runner_opts(tmp_path, "flaky_run")
    assert run_sweep(path, options, say=quiet)["failed"] == 2
    assert "no tuning trial finished (the last error: RuntimeError: scripted" in tuned_entry(tmp_path)["error"]
    flag.unlink()
    final = run_sweep(path, options, say=quiet)
    entry = tuned_entry(tmp_path)
    assert final["done"] == 3 and "error" not in entry and entry["point"]
    (row,) = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet").to_dict("records")
    assert row["status"] == "completed" and row["tuned.train.lr"] == entry["value"]


def test_a_worker_killed_as_tuning_trials_end_costs_the_point_nothing(tmp_path, monkeypatch):
    """Each tuning trial's result reaches the queue and TPE, and the worker dies before tuned.json records it: the
    rerun chooses from the trials the queue saw end, reading each one's run directory."""
    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # what a kill between the queue's record and tuned.json's leaves, in-process

    path, record = write_spec(tmp_path, tune=LR, **ONE_POINT), tuning.record_tuning_trial
    monkeypatch.setattr(tuning, "record_tuning_trial", killed)
    for _ in range(2):  # one tuning trial per invocation
        with pytest.raises(SweepInterrupted):
            run_sweep(path, opts(tmp_path), say=quiet)
    monkeypatch.setattr(tuning, "record_tuning_trial", record)
    final = run_sweep(path, opts(tmp_path), say=quiet)
    entry = tuned_entry(tmp_path)
    assert final["done"] == 3 and len(entry["trials"]) == 2 and "error" not in entry
    best = min(entry["trials"], key=lambda t: t["objective"])
    assert entry["point"] == best["runs_point"] and entry["value"] == best["value"]
    assert all(t["status"] == "completed" and "recovered" in t for t in entry["trials"])


def test_a_worker_about_to_exit_settles_a_point_whose_tuning_just_ended_and_runs_its_seeds(tmp_path, monkeypatch):
    """Between the queue's record of a point's last tuning trial and its worker settling the point, the queue holds
    nothing to run: a worker that looked then would exit, leaving the point's seeds to fewer workers. Here the
    settling after each tuning trial never happens; the worker settles the point itself before it would exit."""
    def recorded_but_not_settled(queue, layout, plan, point, record):
        with queue.lock():
            tuned = tuning.read_tuned(layout)
            tuning.entry_for(tuned, point, plan)["trials"].append(record)
            tuning.atomic_write_json(layout.tuned_path, tuned)

    monkeypatch.setattr(tuning, "record_tuning_trial", recorded_but_not_settled)
    final = run_sweep(write_spec(tmp_path, tune=LR, **ONE_POINT), opts(tmp_path), say=quiet)
    assert final["done"] == 3 and tuned_entry(tmp_path)["point"]  # two tuning trials, then the seed, in one run


def two_finished_tuning_trials(study) -> None:
    """Two tuning trials with their validation curves: the median a pruned trial's curve is held against."""
    for curve in ([2.0, 1.8], [2.1, 1.9]):
        finished = study.ask()
        for step, value in enumerate(curve, start=1):
            finished.report(value, step)
        study.tell(finished, curve[-1])


class _LogsAWorseCurve:
    """A tuning trial process that logs validation losses above the finished tuning trials' and keeps training."""

    def __init__(self, run_dir: str):
        self.log, self.killed = Path(run_dir) / "logs" / "metrics.csv", False

    def wait(self, timeout=None):
        if self.killed:  # waited for after the kill
            return -9
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text("step,train/loss,val/loss\n1,,4.0\n2,,3.5\n3,3.2,\n")
        raise subprocess.TimeoutExpired("trial", timeout)

    def kill(self):
        self.killed = True


def test_a_pruned_tuning_trial_records_its_last_validation_loss_not_an_objective(tmp_path):
    _, layout, url = prepare(write_spec(tmp_path, tune={**LR, "trials": 3, "pruner": "median"}, **ONE_POINT),
                             opts(tmp_path), say=quiet)
    plan = read_json(layout.plan_path)
    queue = TrialQueue(open_storage(url), "t", heartbeat_s=1, grace_s=120)  # nothing here is reaped, however loaded
    queue.sync(trial_specs(plan))
    two_finished_tuning_trials(tuning.tune_study(queue, plan, plan["points"][0]["point"]))

    class Launcher:
        def start(self, cmd, env, log):
            return _LogsAWorseCurve(cmd[cmd.index("--run-dir") + 1])

    claimed = queue.claim(set(all_keys(plan)))
    assert worker.run_trial(queue, layout, claimed, plan, worker.WorkerOptions(), Launcher()) == "pruned"
    (record,) = tuned_entry(tmp_path)["trials"]
    assert record["status"] == "pruned" and record["objective"] is None  # a partial run's loss is no objective
    assert record["last_val_loss"] == 3.5 and record["last_val_step"] == 2
    (row,) = tuning_table(layout.sweep_dir).to_dict("records")
    assert pd.isna(row["objective"]) and row["last_val_loss"] == 3.5 and row["last_val_step"] == 2


class _FinishesWithLoss:
    """A tuning trial process that writes a completed record with its objective and exits 0."""

    def __init__(self, run_dir: str, loss: float):
        self.run_dir, self.loss = run_dir, loss

    def wait(self, timeout=None):
        atomic_write_json(Path(self.run_dir) / "metrics.json",
                          {"status": "completed", "steps": 3, "metrics": {"valid_loss": self.loss}})
        return 0

    def kill(self):
        pass


def test_a_tuning_trials_line_shows_the_objective_of_the_setting_it_ran_not_of_its_base_point(tmp_path):
    """The worker logs each trial's objective as it ends. A tuning trial ran at the setting TPE drew, in that
    setting's run directory; its point's own directory holds another run (here: one with a better loss)."""
    _, layout, url = prepare(write_spec(tmp_path, tune=LR, **ONE_POINT), opts(tmp_path), say=quiet)
    plan = read_json(layout.plan_path)
    queue = TrialQueue(open_storage(url), "t", heartbeat_s=1, grace_s=120)  # nothing here is reaped, however loaded
    queue.sync(trial_specs(plan))
    point = plan["points"][0]["point"]
    RunDir(layout.run_dir(point, 1000)).write({"status": "completed", "steps": 3, "metrics": {"valid_loss": 0.5}})

    class Launcher:
        def start(self, cmd, env, log):
            return _FinishesWithLoss(cmd[cmd.index("--run-dir") + 1], 2.25)

    claimed = queue.claim(set(all_keys(plan)))
    assert claimed.spec.kind == "tune" and claimed.spec.seed == 1000
    assert worker.run_trial(queue, layout, claimed, plan, worker.WorkerOptions(), Launcher()) == "completed"
    (record,) = tuned_entry(tmp_path)["trials"]
    assert record["runs_point"] != point
    text = worker._objective_text(layout, claimed, plan)
    assert text == f", valid_loss 2.25 at train.lr {record['value']:.4g}"


# -- a tune block that cannot run is refused before anything runs --------------------------------------------------
@pytest.mark.parametrize("tune, message", [
    ({"field": "train.warmup_steps", "low": 10, "high": 200, "log": False},
     "tune.field: 'train.warmup_steps' holds int"),
    ({**LR, "log": "false"}, "tune.log: must be true or false, got 'false'"),
    ({**LR, "sampler_seed": -1}, "tune.sampler_seed: must be an integer from 0 to"),
    ({**LR, "sampler_seed": 2**32}, "tune.sampler_seed: must be an integer from 0 to"),
    ({**LR, "sampler_seed": 0.5}, "tune.sampler_seed"),
    ({**LR, "seed": True}, "tune.seed: must be an integer"),  # (YAML's true, which Python counts as the seed 1)
    ({"field": "train.weight_decay", "low": -1.0, "high": -0.5, "log": False},
     "tune.low: train.weight_decay=-1.0 makes the config invalid: train.weight_decay: must be >= 0"),
    ({"field": "train.weight_decay", "low": 0.0, "high": float("inf"), "log": False}, "tune.high"),
])
def test_a_tune_block_the_config_or_the_sampler_would_refuse_is_refused_before_anything_runs(tmp_path, tune, message):
    with pytest.raises(SweepSpecError, match=message.replace("(", r"\(")):
        run_sweep(write_spec(tmp_path, tune=tune, **ONE_POINT), opts(tmp_path), say=quiet)
    assert not (tmp_path / "results").exists()


def test_a_tuning_trial_that_cannot_start_fails_that_attempt_and_the_worker_goes_on(tmp_path, monkeypatch):
    real, calls = tuning.start_tuning, []

    def refused_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("scripted: the sampler refused its seed")
        return real(*args, **kwargs)

    monkeypatch.setattr(tuning, "start_tuning", refused_once)
    final = run_sweep(write_spec(tmp_path, tune=LR, **ONE_POINT), opts(tmp_path), say=quiet)
    assert final["done"] == 3 and final["failed"] == 0
    queue, _ = queue_for(tmp_path / "results" / "t")
    failed = [t for t in queue.trials() if t.state.name == "FAIL"]
    assert len(failed) == 1 and "could not start: ValueError: scripted" in failed[0].user_attrs["error"]


# -- a study in stages -----------------------------------------------------------------------------------------------
def _staged(**overrides):
    plan = expand(*load_spec(NSP_GLUE, overrides))
    check(plan)
    return plan


def test_the_tuned_field_and_an_axis_are_one_field_however_spelled_in_a_study_in_stages():
    tune = {"field": "pretrain.model.dropout", "low": 0.0, "high": 0.3, "log": False, "trials": 2}
    with pytest.raises(SweepSpecError, match="tune.field: pretrain.model.dropout is the field axes.dropout sets"):
        _staged(axes={"model.dropout": [0.0, 0.2]}, tune=tune)


def test_tuning_a_stage_the_objectives_stage_does_not_start_from_is_refused_naming_both():
    tune = {"field": "glue.train.weight_decay", "low": 0.0, "high": 0.3, "log": False, "trials": 2}
    with pytest.raises(SweepSpecError, match="glue.train.weight_decay is the glue stage's, and the objective "
                                             "pretrain.valid_mlm_loss_full_sentences is measured in the pretrain "
                                             "stage"):
        _staged(objective={"metric": "pretrain.valid_mlm_loss_full_sentences"}, tune=tune)
    _staged(tune=tune)  # the objective glue_score is measured where it is tuned
    _staged(tune={**tune, "field": "pretrain.train.lr", "low": 1e-4, "log": True})  # ... or in a stage after it


def test_median_pruning_in_a_study_in_stages_reads_the_log_of_the_objectives_stage(tmp_path):
    from study.config import experiment_from_dict
    from study.run.pipeline import stage_dir

    tune = {"field": "pretrain.train.lr", "low": 1e-4, "high": 3e-3, "trials": 2, "pruner": "median"}
    plan = _staged(objective={"metric": "pretrain.valid_mlm_loss_full_sentences"}, tune=tune).to_dict()
    layout = SweepLayout(tmp_path / "results" / "nsp-glue")
    data = plan["points"][0]["config"]
    data["stages"]["pretrain"]["train"]["lr"] = 1.5e-3  # a tuning trial's setting
    cfg = experiment_from_dict(data)
    layout.point_config("tuned").parent.mkdir(parents=True)
    layout.point_config("tuned").write_text(cfg.to_yaml())
    run_dir = layout.run_dir("tuned", 1000)
    watched = tuning.pruned_run_dir(layout, plan, "tuned", 1000, run_dir)
    assert watched == stage_dir(cfg.with_seed(1000), "pretrain", run_dir, layout.runs_root) != run_dir


def test_a_tuning_trial_recorded_after_another_worker_settled_its_point_is_listed_once(tmp_path, monkeypatch):
    """Two workers: one's tuning trial ends in the queue, and before it writes tuned.json the other's (the point's
    last) ends and settles the point, recovering the first one's outcome from the queue. The first worker's record
    then replaces the recovered one (a CI run saw the trial listed twice)."""
    record, held = tuning.record_tuning_trial, []

    def late_first(*args, **kwargs):
        if not held:
            held.append((args, kwargs))  # the first worker, not yet at tuned.json
            return
        record(*args, **kwargs)  # the other worker settles the point
        record(*held[0][0], **held[0][1])  # then the first one writes its record

    monkeypatch.setattr(tuning, "record_tuning_trial", late_first)
    run_sweep(write_spec(tmp_path, tune=LR, **ONE_POINT), opts(tmp_path), say=quiet)
    trials = tuned_entry(tmp_path)["trials"]
    assert sorted(t["key"] for t in trials) == sorted({t["key"] for t in trials}) and len(trials) == 2
    assert not any("recovered" in t for t in trials)


def test_a_diverged_tuning_trial_is_a_bad_result_tpe_learns_from_not_a_failure_it_ignores(tmp_path):
    """TPE draws from the trials it was told completed or pruned; a failed one teaches it nothing, so a learning
    rate tuned near where training diverges would keep being proposed there. A diverged trial is told completed
    with the worst value there is, ranked below every other (as pruned it would outrank a trial pruned earlier).
    (The fake run diverges at lr >= 1.)"""
    path = write_spec(tmp_path, tune={**LR, "low": 1.0, "high": 2.0, "log": False}, **ONE_POINT)
    run_sweep(path, opts(tmp_path), say=quiet)
    storage = open_storage(f"sqlite:///{tmp_path / 'results' / 't' / 'study.db'}")
    (name,) = [n for n in optuna.get_all_study_names(storage) if "~tune~" in n]
    told = [(t.state.name, t.value) for t in optuna.load_study(study_name=name, storage=storage).trials]
    assert told == [("COMPLETE", float("inf"))] * 2
    entry = tuned_entry(tmp_path)
    assert [t["status"] for t in entry["trials"]] == ["diverged", "diverged"] and "point" not in entry


def test_median_pruning_judges_the_curve_the_objectives_task_declares_comparable(tmp_path):
    """Pretraining logs `val/loss` as MLM + NSP loss; its objective and declared validation curve are the MLM loss
    alone, so a trial with NSP is not pruned for the NSP loss it adds."""
    tune = {"field": "pretrain.train.lr", "low": 1e-4, "high": 3e-3, "trials": 2, "pruner": "median"}
    plan = _staged(objective={"metric": "pretrain.valid_mlm_loss_full_sentences"}, tune=tune).to_dict()
    assert tuning.pruning_column(plan) == "val/mlm_loss"
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.csv").write_text("step,val/loss,val/mlm_loss\n5,7.5,6.8\n10,7.1,6.4\n")

    class Reported:
        def __init__(self):
            self.seen = []

        def report(self, value, step):
            self.seen.append((step, value))

        def should_prune(self):
            return False

    trial = Reported()
    tuning.PruningMonitor(trial, tmp_path, tuning.pruning_column(plan)).should_prune()
    assert trial.seen == [(5, 6.8), (10, 6.4)]
    assert tuning.pruning_column(_plan() | {"objective": {"metric": "valid_loss", "task": "lm"},
                                            "tasks": {"lm": {"curves": {"valid": "val/loss"}}}}) == "val/loss"
    with pytest.raises(ValueError, match="declares no validation curve for task 'lm'"):
        tuning.pruning_column(_plan() | {"objective": {"metric": "valid_loss", "task": "lm"}, "tasks": {}})


def test_a_rerun_does_not_retrain_a_failed_tuning_trial_of_a_point_already_settled(tmp_path, monkeypatch):
    """The point chose from the tuning trial that completed and its seed ran; its setting is chosen once, so the
    tuning trial that failed is not retried by the next `study sweep` (it could change nothing)."""
    monkeypatch.setenv("STUDY_TEST_FAILED_ONCE", str(tmp_path / "failed-once"))
    path = write_spec(tmp_path, tune=LR, **ONE_POINT, max_retries=0)
    options = runner_opts(tmp_path, "first_tuning_trial_fails")
    first = run_sweep(path, options, say=quiet)
    entry = tuned_entry(tmp_path)
    assert first["failed"] == 1 and first["done"] == 2 and entry["point"]
    said: list[str] = []
    again = run_sweep(path, options, say=said.append)
    assert again == first and tuned_entry(tmp_path) == entry
    queue, _ = queue_for(tmp_path / "results" / "t")
    assert len(queue.trials()) == 3  # two tuning trials and the seed: nothing queued again
    assert any("is complete: nothing to run" in line for line in said)  # and no workers started for nothing
    assert not any(line.startswith("running with") for line in said)


def test_a_point_is_not_settled_while_a_failed_tuning_trials_retry_is_being_queued(tmp_path, monkeypatch):
    """Failing an attempt and queueing its retry are two storage updates; another worker settling the point between
    them must not take the key for failed for good (it would choose without it, and ignore the retry's result)."""
    from study.sweep.queue import TrialQueue as Queue

    monkeypatch.setenv("STUDY_TEST_FAILED_ONCE", str(tmp_path / "started"))
    path = write_spec(tmp_path, tune=LR, **ONE_POINT, max_retries=1)
    requeue, seen = Queue._requeue, []

    def settle_first(self, trial, reason, counts=True):  # the other worker, in the window
        layout = SweepLayout(tmp_path / "results" / "t")
        tuning.settle_points(self, layout, read_json(layout.plan_path), [trial.user_attrs["point"]])
        seen.append("point" in tuned_entry(tmp_path))
        return requeue(self, trial, reason, counts)

    monkeypatch.setattr(Queue, "_requeue", settle_first)
    final = run_sweep(path, runner_opts(tmp_path, "second_tuning_trial_fails_once"), say=quiet)
    entry = tuned_entry(tmp_path)
    assert seen == [False] and final["done"] == 3
    completed = [t for t in entry["trials"] if t["status"] == "completed"]
    assert len(completed) == 2 and entry["objective"] == min(t["objective"] for t in completed)


@pytest.mark.parametrize("ended", ["interrupted", "killed"])
def test_a_tuning_trial_whose_worker_stopped_is_retried_at_the_setting_it_drew(tmp_path, monkeypatch, ended):
    """Its worker interrupted (Ctrl-C gives the trial back) or killed (the next worker reaps it), a tuning trial is
    retried at the setting it drew, in the same run directory, so it resumes from that attempt's checkpoint as any
    retried trial does, rather than restarting at a fresh draw; the attempt's TPE trial ends (a killed worker's
    would otherwise stay running for good)."""
    path, supervise, interrupted = write_spec(tmp_path, tune=LR, **ONE_POINT), worker._supervise, worker._interrupted

    def stopped(queue, child, attempt, pruning):  # the first tuning trial's worker stops as the trial trains
        monkeypatch.setattr(worker, "_supervise", supervise)
        if ended == "killed":  # nothing is given back: the trial stays running in the queue and in TPE
            monkeypatch.setattr(worker, "_interrupted", lambda *args: None)
        raise KeyboardInterrupt

    monkeypatch.setattr(worker, "_supervise", stopped)
    with pytest.raises(SweepInterrupted):
        run_sweep(path, opts(tmp_path), say=quiet)
    queue, _ = queue_for(tmp_path / "results" / "t")
    (first,) = [t for t in queue.trials() if "tuned_value" in t.user_attrs]
    if ended == "killed":
        assert first.state.name == "RUNNING"
        gone = subprocess.Popen(["true"])
        gone.wait()
        queue.storage.set_trial_user_attr(first._trial_id, "worker", f"{_host()}:{gone.pid}")
    monkeypatch.setattr(worker, "_interrupted", interrupted)
    final = run_sweep(path, opts(tmp_path), say=quiet)
    assert final["done"] == 3
    retry = next(t for t in queue.trials() if t.user_attrs.get("retry_of") == first.number)
    assert retry.user_attrs["tuned_value"] == first.user_attrs["tuned_value"]
    assert retry.user_attrs["runs_point"] == first.user_attrs["runs_point"]
    storage = open_storage(f"sqlite:///{tmp_path / 'results' / 't' / 'study.db'}")
    (name,) = [n for n in optuna.get_all_study_names(storage) if "~tune~" in n]
    told = optuna.load_study(study_name=name, storage=storage).trials
    assert sorted(t.state.name for t in told) == ["COMPLETE", "COMPLETE", "FAIL"]
    stopped_at, retried_at = told[first.user_attrs["tune_trial"]], told[retry.user_attrs["tune_trial"]]
    assert stopped_at.state.name == "FAIL" and retried_at.params == stopped_at.params


def test_a_tuning_worker_imports_the_axis_registries_before_it_claims_a_trial(tmp_path):
    """A tuning trial's start validates the config of its drawn setting, which imports torch (seconds, more on a
    loaded machine) while the claimed trial gets no heartbeat: another worker judged it lost (seen in CI). A fresh
    worker process has imported them before its first claim."""
    import json
    import sys as _sys

    (tmp_path / "plan.json").write_text(json.dumps({"sweep": "t", "points": [], "seeds": [0], "tune": {"trials": 1}}))
    script = f"""
import contextlib, sys
from pathlib import Path
from study.sweep import tuning, worker
from study.sweep.layout import SweepLayout

class Queue:
    def reap(self): return []
    def claim(self, keys):
        print("axes imported at the first claim:", "study.axes" in sys.modules)
        return None
    def counts(self, keys): return {{"running": 0, "queued": 0}}
    def lock(self): return contextlib.nullcontext()
    def sync_locked(self, specs, retry_failed): return {{"enqueued": 0}}

tuning.settle_tuning_locked = lambda *a: None
worker.run_worker(Queue(), SweepLayout(Path({str(tmp_path)!r})), worker.WorkerOptions(launcher="spawn"))
"""
    out = subprocess.run([_sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "axes imported at the first claim: True" in out.stdout, out.stderr[-2000:]
