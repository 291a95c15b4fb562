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
