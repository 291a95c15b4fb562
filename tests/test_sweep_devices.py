"""Each local worker's trials get their own GPUs (CUDA_VISIBLE_DEVICES), as many as a trial's train.devices; a sweep
that cannot give every worker its own is refused before anything runs; without GPUs nothing is assigned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from study.sweep.devices import DeviceError, assign, gpus_per_trial, visible_gpus

REPO = Path(__file__).resolve().parent.parent


def test_workers_get_disjoint_gpus_in_order():
    assert assign(2, 1, ["0", "1", "2", "3"]) == ["0", "1"]
    assert assign(2, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert assign(2, 1, ["4", "6"]) == ["4", "6"]  # the ids this process may use, not 0..n-1


def test_more_gpus_than_there_are_is_refused_with_what_would_fit():
    with pytest.raises(DeviceError, match=r"3 worker\(s\) x 2 GPU\(s\) per trial need 6 GPUs, but 4 are visible.*"
                                          r"--workers 2"):
        assign(3, 2, ["0", "1", "2", "3"])


def test_without_gpus_every_worker_trains_on_the_cpu():
    assert assign(3, 4, []) == [None, None, None]


def test_visible_gpus_follow_cuda_visible_devices_when_set():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_a_trial_needs_as_many_gpus_as_its_points_largest_train_devices():
    plan = json.loads((REPO / "results" / "default" / "plan.json").read_text())
    assert gpus_per_trial(plan) == 1
    plan["points"][1]["config"]["train"]["devices"] = 4
    assert gpus_per_trial(plan) == 4
    staged = {"points": [{"config": {"stages": {"pretrain": {"train": {"devices": 2}}, "glue": {"train": {}}}}}]}
    assert gpus_per_trial(staged) == 2


def test_a_sweep_on_the_cpu_needs_no_gpu_whatever_the_host_has():
    plan = json.loads((REPO / "results" / "default" / "plan.json").read_text())
    for point in plan["points"]:
        point["config"]["train"]["accelerator"] = "cpu"
    assert gpus_per_trial(plan) == 0
    assert assign(4, gpus_per_trial(plan), ["0"]) == [None] * 4  # 4 CPU workers on a 1-GPU host: not refused


def test_a_trial_whose_process_cannot_start_fails_with_the_reason_instead_of_killing_its_worker(tmp_path,
                                                                                              monkeypatch):
    """The zygote cannot import the runner's module: every attempt fails with that reason in the results table and
    the sweep ends (retries spent), rather than the worker dying with its trial left RUNNING."""
    import pandas as pd

    from study.sweep import SweepOptions, run_sweep
    from tests.test_sweep import write_spec

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    path = write_spec(tmp_path, seeds=[0], max_retries=1)
    options = SweepOptions(results=tmp_path / "results", runner="tests.no_such_runner_module:run", estimate_rate=1e11,
                           poll_s=0.3)
    final = run_sweep(path, options, say=lambda *_: None)
    assert final["failed"] == 2 and final["running"] == 0
    table = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet")
    assert set(table.status) == {"failed"}
    assert all("could not start" in e for e in table.error)


def test_a_trial_gets_no_distributed_settings_from_its_worker(monkeypatch, tmp_path):
    """Two DDP trials given the worker's MASTER_PORT would collide on it (one fails, or joins the other's group), and
    an inherited LOCAL_RANK would tell Lightning not to start the trial's ranks: a trial's environment has neither,
    so Lightning picks a free port for each; its GPUs and threads are its own."""
    from types import SimpleNamespace

    from study.sweep import worker

    for name, value in {"MASTER_PORT": "29500", "MASTER_ADDR": "10.0.0.1", "LOCAL_RANK": "0", "RANK": "0",
                        "WORLD_SIZE": "8", "STUDY_STORAGE": "sqlite:///x.db"}.items():
        monkeypatch.setenv(name, value)
    attempt = SimpleNamespace(runs_point="p", claimed=SimpleNamespace(spec=SimpleNamespace(seed=0)), run_dir=tmp_path)
    layout = SimpleNamespace(point_config=lambda point: tmp_path / f"{point}.yaml")
    _, env = worker._command(layout, attempt, worker.WorkerOptions(threads=2, gpus="2,3"))
    assert not set(env) & {"MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "RANK", "WORLD_SIZE", "STUDY_STORAGE"}
    assert (env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"]) == ("2,3", "2")


def test_a_spawned_trial_takes_the_ranks_it_started_along_when_killed_or_ended(tmp_path):
    """--launcher spawn: the trial runs in a session of its own; killing it kills the ranks Lightning's launcher
    started (a plain Popen each), and ranks its end leaves behind are killed when it is waited for."""
    import os
    import signal
    import sys
    import time

    from study.sweep.worker import SpawnedTrial

    def rank_of(script: str) -> tuple[SpawnedTrial, int]:
        pid_file = tmp_path / f"{len(list(tmp_path.iterdir()))}.pid"
        code = ("import subprocess, sys, time; "
                "r = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                f"open({str(pid_file)!r}, 'w').write(str(r.pid)); " + script)
        trial = SpawnedTrial([sys.executable, "-c", code], start_new_session=True)
        while not pid_file.is_file() or not pid_file.read_text():
            time.sleep(0.05)
        return trial, int(pid_file.read_text())

    def gone(pid: int) -> bool:
        for _ in range(200):
            try:
                os.kill(pid, 0)
                if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                    return True
            except (ProcessLookupError, FileNotFoundError):
                return True
            time.sleep(0.05)
        return False

    trial, rank = rank_of("time.sleep(600)")
    trial.kill()
    assert trial.wait(timeout=30) == -signal.SIGKILL and gone(rank)
    trial, rank = rank_of("sys.exit(1)")
    assert trial.wait(timeout=30) == 1 and gone(rank)


def test_a_dry_run_plans_a_gpu_sweep_on_a_machine_with_fewer_gpus_and_says_it_cannot_run_here(monkeypatch, tmp_path):
    """attention_cluster.yaml's 8 workers x 4 GPUs, planned on a 1-GPU machine: the dry run describes the plan and
    says why it would not run here; the sweep itself is refused before anything is written."""
    import study.sweep.runner as runner
    from study.sweep.runner import SweepOptions, prepare

    monkeypatch.setattr(runner, "visible_gpus", lambda: ["0"])
    said = []
    spec = REPO / "experiments" / "sweeps" / "attention_cluster.yaml"
    opts = SweepOptions(results=tmp_path / "results", dry_run=True, estimate_rate=1e12)
    prepare(spec, opts, say=said.append)
    assert any("not on this machine:" in s and "GPUs, but 1 are visible" in s for s in said), said
    with pytest.raises(DeviceError):
        prepare(spec, SweepOptions(results=tmp_path / "results", estimate_rate=1e12), say=said.append)
    assert not (tmp_path / "results").exists()
