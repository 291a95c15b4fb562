"""One run directory, many ways to reach it: a pipeline's fine-tuning stage resumes however its results folder is
named, and two sweeps that share a point (one run directory, two queues) train it once, one trial after the other.

The trial processes are real (`python -m study.sweep.trial`); training is replaced by `held_run`, which holds the run
directory until the test releases it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from study.config import ExperimentConfig, PipelineConfig, content_hash
from study.io import atomic_write_json, atomic_write_text, read_json
from study.record import COMPLETED, RunDir, make_record
from study.run import RunDirConflict, environment
from study.run.conflict import finished_run
from study.sweep import trial

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WAITING = "is being run by another process"  # the line a trial that waits for the run directory logs

PRETRAIN = {"model": {"preset": "bert", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64},
            "task": {"name": "pretrain", "dataset": "wikitext-2", "seq_len": 64, "vocab_size": 100},
            "train": {"precision": "32-true"}}
GLUE = {"model": {"arch": "encoder", "objective": "mlm"},
        "task": {"name": "glue", "dataset": "sst2", "init_from": "stage:pretrain", "seq_len": 64},
        "train": {"precision": "32-true"}}


def _finished(run_dir: str | Path, stage) -> dict:
    run = RunDir(run_dir)
    run.path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run.config, stage.to_yaml())
    record = make_record(COMPLETED, {"valid_loss": 1.0}, {}, steps=1)
    run.write(record)
    return record


# ---- a fine-tuning stage names the run it starts from, however the results folder is spelled


def test_a_pipeline_trial_records_the_run_it_fine_tunes_from_the_same_way_from_any_working_directory(
        tmp_path, monkeypatch):
    import study.run

    started: dict[str, str] = {}

    def stage_runner(stage, run_dir, **_):  # the pipeline's stages, without training
        if stage.task.init_from:
            started[str(run_dir)] = stage.task.init_from
        return _finished(run_dir, stage)

    monkeypatch.setattr(study.run, "run_experiment", stage_runner)
    monkeypatch.setattr("study.run.pipeline.refuse_missing_data", lambda cfg, data_dir: None)  # no data here
    monkeypatch.setattr(environment, "prepare_training_process", lambda accelerator: None)
    monkeypatch.setattr(environment, "snapshot", lambda *args, **kwargs: {})
    cfg = PipelineConfig.from_dict({"name": "p", "stages": {"pretrain": PRETRAIN, "glue": GLUE}})
    (tmp_path / "p.yaml").write_text(cfg.to_yaml())
    (tmp_path / "work").mkdir()
    argv = ["--config", str(tmp_path / "p.yaml"), "--seed", "0", "--runner", "study.run.pipeline:run_pipeline"]
    monkeypatch.chdir(tmp_path / "work")  # the worker's --results as a relative path
    trial.main([*argv, "--run-dir", "../results/runs/a/seed-0"])
    monkeypatch.chdir(tmp_path)  # the same folder from another working directory
    trial.main([*argv, "--run-dir", str(tmp_path / "results/runs/b/seed-0")])

    pretrain = (tmp_path / "results/runs").resolve() / content_hash(cfg.with_seed(0).stages["pretrain"]) / "seed-0"
    assert sorted(started.values()) == [str(pretrain), str(pretrain)], started


def test_an_interrupted_fine_tuning_run_resumes_when_its_pretrained_run_is_named_another_way(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    glue = ExperimentConfig.from_dict(GLUE)
    pretrained = "results/runs/8e398f530ce8/seed-0"

    def resumed(stored_init_from: str, init_from: str, where: str) -> bool:
        run = RunDir(tmp_path / where / "glue")
        run.path.mkdir(parents=True)
        atomic_write_text(run.config, glue.replace(task=glue.task.replace(init_from=stored_init_from)).to_yaml())
        try:
            return finished_run(run, glue.replace(task=glue.task.replace(init_from=init_from)), force=False) is None
        except RunDirConflict:
            return False

    # a relative spelling (another cwd, a folder given as results/), and the results folder moved wholesale
    assert resumed(pretrained, str(tmp_path / pretrained), "relative")
    assert resumed(f"/mnt/old-machine/{pretrained}", str(tmp_path / pretrained), "moved")
    # another pretrained run is still another config: another seed, another hash, another folder of runs
    assert not resumed(pretrained, str(tmp_path / "results/runs/8e398f530ce8/seed-1"), "seed")
    assert not resumed(pretrained, str(tmp_path / "results/runs/0123456789ab/seed-0"), "hash")
    assert not resumed("/data/pretrained/bert-a", "/data/pretrained/bert-b", "plain")


def test_a_run_directory_reached_under_another_name_is_the_same_run(tmp_path):
    """A sweep names its point `point-<hash>`, a pipeline its stage after the stage's base config: one
    content-addressed directory, reached under two names, holds one run (its name is a label, not what runs)."""
    stage = ExperimentConfig.from_dict({**PRETRAIN, "name": "wikitext2-bert-nsp"})
    record = _finished(tmp_path / "run", stage.replace(name="point-79d790515995"))
    assert finished_run(RunDir(tmp_path / "run"), stage, force=False) == record
    with pytest.raises(RunDirConflict, match="train.lr"):  # what runs still decides
        finished_run(RunDir(tmp_path / "run"), stage.replace(train=stage.train.replace(lr=0.5)), force=False)


# ---- two sweeps' trials of one point: one runs the directory at a time


def held_run(cfg, run_dir, data_dir=None, cache_dir=None):
    """A trial runner that hands a finished run back untrained (as the run layer does) and otherwise trains until
    the test writes `release` beside the run directory; it logs what it did to `events.log` there."""
    run, beside = RunDir(run_dir), Path(run_dir).parent
    run.path.mkdir(parents=True, exist_ok=True)  # as the worker does before it starts the trial

    def event(what: str) -> None:
        with open(beside / "events.log", "a") as f:
            f.write(f"{what} {os.getpid()}\n")

    if (done := run.finished()) is not None:
        event("skip")
        return done
    event("start")
    deadline = time.time() + 60
    while not (beside / "release").exists() and time.time() < deadline:
        time.sleep(0.05)
    event("end")
    return _finished(run_dir, cfg)


def _trial(tmp_path: Path, name: str, **env: str) -> subprocess.Popen:
    config = tmp_path / "point.yaml"
    if not config.exists():
        config.write_text(ExperimentConfig.from_dict(PRETRAIN).to_yaml())
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    base.update(PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]), OMP_NUM_THREADS="1", **env)
    with open(tmp_path / f"{name}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "study.sweep.trial", "--config", str(config), "--seed", "0",
                                 "--run-dir", str(tmp_path / "runs/abc/seed-0"),
                                 "--runner", "test_run_dir_sharing:held_run"],
                                env=base, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _events(tmp_path: Path) -> list[str]:
    path = tmp_path / "runs/abc/events.log"
    return path.read_text().splitlines() if path.exists() else []


def _until(condition, what: str, *running: subprocess.Popen, timeout: float = 90) -> None:
    started = time.time()
    while not condition():
        assert time.time() - started < timeout, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in running), f"a trial process ended before {what}"
        time.sleep(0.05)


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def _waiting_or_started(tmp_path: Path, name: str, proc: subprocess.Popen):
    """True once `proc` waits for the run directory (its log says so) or has started training it (no lock)."""
    return lambda: WAITING in (tmp_path / f"{name}.log").read_text() or f"start {proc.pid}" in _events(tmp_path)


def test_a_second_sweeps_trial_of_the_same_run_waits_and_then_finds_it_finished(tmp_path, procs):
    first = _trial(tmp_path, "first")
    procs.append(first)
    _until(lambda: f"start {first.pid}" in _events(tmp_path), "the first trial to start", first)
    second = _trial(tmp_path, "second")
    procs.append(second)
    _until(_waiting_or_started(tmp_path, "second", second), "the second trial to reach the run directory", second)
    (tmp_path / "runs/abc/release").write_text("")
    assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
    assert _events(tmp_path) == [f"start {first.pid}", f"end {first.pid}", f"skip {second.pid}"]


def test_the_run_directory_lock_is_rank_zeros_and_dies_with_its_holder(tmp_path, procs):
    holder = _trial(tmp_path, "holder")
    procs.append(holder)
    _until(lambda: f"start {holder.pid}" in _events(tmp_path), "the first trial to start", holder)
    other_rank = _trial(tmp_path, "rank1", LOCAL_RANK="1")  # a DDP rank rank zero started: it must not wait
    waiter = _trial(tmp_path, "waiter")
    procs.extend([other_rank, waiter])
    _until(lambda: f"start {other_rank.pid}" in _events(tmp_path), "the other DDP rank to start", other_rank)
    _until(_waiting_or_started(tmp_path, "waiter", waiter), "the second trial to reach the run directory", waiter)
    assert f"start {waiter.pid}" not in _events(tmp_path)  # it waits while the holder trains
    os.killpg(holder.pid, signal.SIGKILL)  # a worker killed mid-trial: the kernel releases its lock
    holder.wait()
    _until(lambda: f"start {waiter.pid}" in _events(tmp_path), "the waiting trial to take the run over")
    (tmp_path / "runs/abc/release").write_text("")
    assert waiter.wait(timeout=60) == 0 and other_rank.wait(timeout=60) == 0
    assert RunDir(tmp_path / "runs/abc/seed-0").finished() is not None


def test_a_workers_update_of_trial_json_waits_for_anothers(tmp_path):
    """Workers of two sweeps that share a point both append their attempts to its trial.json: the read-modify-write
    happens under a lock, so neither drops the other's attempt."""
    from study.io import exclusive_lock
    from study.sweep.queue import TrialSpec
    from study.sweep.worker import _record_attempt

    run_dir = tmp_path / "runs" / "abc" / "seed-0"
    run_dir.mkdir(parents=True)
    trial_json = RunDir(run_dir).trial
    spec = TrialSpec(key="abc/seed-0", point="abc", seed=0, label="baseline")
    _record_attempt(run_dir, spec, "sweep-a", {"id": "sweep-a#0", "outcome": "completed"})
    code = ("import sys; from pathlib import Path; from study.sweep.queue import TrialSpec; "
            "from study.sweep.worker import _record_attempt; "
            "_record_attempt(Path(sys.argv[1]), TrialSpec(key='abc/seed-0', point='abc', seed=0, label='baseline'), 'sweep-b', "
            "{'id': 'sweep-b#0', 'outcome': 'completed'})")
    with exclusive_lock(trial_json.parent / f".{trial_json.name}.lock"):  # another worker is mid-update
        other = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=REPO)
        time.sleep(3)
        assert other.poll() is None  # it waits rather than read the file under the holder's feet
        record = read_json(trial_json)
        record["attempts"].append({"id": "sweep-a#1", "outcome": "failed"})  # the holder's own update
        atomic_write_json(trial_json, record)
    assert other.wait(timeout=60) == 0
    ids = [a["id"] for a in read_json(trial_json)["attempts"]]
    assert ids == ["sweep-a#0", "sweep-a#1", "sweep-b#0"]
    assert read_json(trial_json)["sweeps"] == ["sweep-a", "sweep-b"]


def test_a_moved_results_folder_still_finds_a_pipelines_stages(tmp_path):
    """A pipeline's record names its stages' run directories by absolute path; after the results folder moves (another
    mount, another machine), each is found as the same <hash>/seed-<k> beside the pipeline's own run directory."""
    from study.record import stage_run_dirs

    runs = tmp_path / "moved" / "runs"
    (runs / "abcdef012345" / "seed-0").mkdir(parents=True)
    pipeline_dir = runs / "0123456789ab" / "seed-0"
    pipeline_dir.mkdir(parents=True)
    record = {"stages": {"pretrain": {"run_dir": str(tmp_path / "old" / "runs" / "abcdef012345" / "seed-0")},
                         "glue": {"run_dir": str(pipeline_dir)}}}
    assert stage_run_dirs(record, pipeline_dir) == {"pretrain": str(runs / "abcdef012345" / "seed-0"),
                                                    "glue": str(pipeline_dir)}
    assert stage_run_dirs(record)["pretrain"] == str(tmp_path / "old" / "runs" / "abcdef012345" / "seed-0")
    # the last stage inside the pipeline's directory; a pipeline run alone keeps its earlier stages in its stages/
    (pipeline_dir / "glue").mkdir()
    (pipeline_dir / "stages" / "fedcba987654" / "seed-0").mkdir(parents=True)
    old = tmp_path / "old" / "runs" / "0123456789ab" / "seed-0"
    alone = {"stages": {"pretrain": {"run_dir": str(old / "stages" / "fedcba987654" / "seed-0")},
                        "glue": {"run_dir": str(old / "glue")}}}
    assert stage_run_dirs(alone, pipeline_dir) == {"pretrain": str(pipeline_dir / "stages" / "fedcba987654" / "seed-0"),
                                                   "glue": str(pipeline_dir / "glue")}
