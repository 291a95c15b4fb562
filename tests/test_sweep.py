"""The sweep: every (point, seed) exactly once, through kills, concurrent workers and failures.

The queue, storage, worker processes, trial subprocesses and files are all real; the trials use
`sweep_fakes.fake_run` (scripted by the config) instead of training, except the last test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from study.sweep import SweepOptions, SweepSpecError, expand, load_spec, run_sweep
from study.sweep.queue import TrialQueue
from study.sweep.storage import StorageError, open_storage, redact
from study.sweep.layout import trial_specs
from study.io import read_json

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DATA = REPO.parent / "shared" / "data"
FAKE = "sweep_fakes:fake_run"
BASE = {
    "model": {"preset": "gpt2", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16},
    "task": {"name": "lm", "dataset": "tinyshakespeare", "seq_len": 16},
    "train": {"max_steps": 10, "batch_size": 2},
}


@pytest.fixture(autouse=True)
def _fakes_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("STUDY_FAKE_SLEEP", "0")


def write_spec(tmp_path: Path, **fields) -> Path:
    spec = {"name": "t", "base": BASE, "design": "ofat", "axes": {"model.norm_position": ["pre", "post"]},
            "seeds": [0, 1], "heartbeat_s": 1, "grace_s": 5, **fields}
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def opts(tmp_path: Path, **kw) -> SweepOptions:
    return SweepOptions(results=tmp_path / "results", runner=FAKE, estimate_rate=1e11, poll_s=0.3, **kw)


def completions(results: Path) -> dict[str, int]:
    """How many times each run directory finished a run (must be exactly once each)."""
    return {f"{p.parent.parent.name}-s{p.parent.name.split('-')[1]}": len(p.read_text().splitlines())
            for p in results.glob("runs/*/seed-*/completions.log")}


def queue_for(sweep_dir: Path, url: str | None = None) -> tuple[TrialQueue, list[str]]:
    plan = read_json(sweep_dir / "plan.json")
    url = url or f"sqlite:///{sweep_dir / 'study.db'}"
    queue = TrialQueue(open_storage(url), plan["sweep"], plan["objective"]["direction"])
    return queue, [s.key for s in trial_specs(plan)]


def complete_keys(queue: TrialQueue) -> list[str]:
    return [t.user_attrs["key"] for t in queue.trials() if t.state.name == "COMPLETE"]


# -- the spec and the plan --------------------------------------------------------------------
def test_ofat_design_is_the_baseline_plus_each_other_value_of_each_axis(tmp_path):
    spec, root = load_spec(write_spec(tmp_path, axes={
        "model.norm_position": ["pre", "post"],
        "model.position": ["learned", "rope", "alibi"],
        "attention": {"mha": {"model.n_kv_heads": 2}, "mqa": {"model.n_kv_heads": 1}},
    }))
    plan = expand(spec, root)
    assert [p.label for p in plan.points] == [
        "baseline", "norm_position=post", "position=rope", "position=alibi", "attention=mqa"]
    assert plan.points[0].axes == {"norm_position": "pre", "position": "learned", "attention": "mha"}
    assert plan.points[4].config.model.n_kv_heads == 1 and plan.points[4].config.model.position == "learned"
    assert len(plan.trials) == 5 * 2


def test_grid_design_is_the_cartesian_product_with_conditional_sub_grids(tmp_path):
    spec, root = load_spec(write_spec(tmp_path, design="grid", axes={
        "model.norm": ["layernorm", "rmsnorm"],
        "span": {"global": {"model.window": None}, "local": {"model.window": 4}},
        "window": {"field": "model.window", "values": [4, 8], "when": {"span": "local"}},
    }))
    plan = expand(spec, root)
    # window only multiplies the local points: 2 norms x (global + local x 2 windows)
    assert len(plan.points) == 2 * (1 + 2)
    local = [p for p in plan.points if p.axes["span"] == "local"]
    assert sorted(p.config.model.window for p in local) == [4, 4, 8, 8]
    assert all(p.axes["window"] == "n/a" for p in plan.points if p.axes["span"] == "global")


def test_the_same_point_has_the_same_hash_in_any_sweep_and_seeds_share_it(tmp_path):
    a = expand(*load_spec(write_spec(tmp_path, name="a")))
    b = expand(*load_spec(write_spec(tmp_path, name="b", axes={"model.norm_position": ["post", "pre"]})))
    assert {p.point for p in a.points} == {p.point for p in b.points}
    assert len({p.point for p in a.points}) == 2


def test_a_field_added_by_a_later_release_leaves_existing_point_hashes_unchanged():
    # A sweep resumed after an upgrade must find its finished trials under the same run directories: a new field
    # at its default (which keeps the old behaviour) is not part of the hash; set to anything else, it is.
    import dataclasses

    from study.config import ExperimentConfig, TaskConfig
    from study.config import content_hash as point_hash

    NewerTaskConfig = dataclasses.make_dataclass(
        "TaskConfig", [("added_later", float, dataclasses.field(default=1.0))], bases=(TaskConfig,), frozen=True)
    cfg = ExperimentConfig.from_dict({"name": "x", "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
                                      "task": {"seq_len": 16}, "train": {"lr": 3e-3, "seed": 4}})
    newer = ExperimentConfig(name=cfg.name, model=cfg.model, task=NewerTaskConfig(**cfg.task.to_dict()), train=cfg.train)
    assert point_hash(newer) == point_hash(cfg)
    changed = ExperimentConfig(name=cfg.name, model=cfg.model, train=cfg.train,
                               task=NewerTaskConfig(**cfg.task.to_dict(), added_later=2.0))
    assert point_hash(changed) != point_hash(cfg)
    # the name and the seed never count; every other field does
    assert point_hash(cfg.replace(name="y", train=cfg.train.replace(seed=5))) == point_hash(cfg)
    assert point_hash(cfg.replace(train=cfg.train.replace(lr=1e-3))) != point_hash(cfg)


@pytest.mark.parametrize("fields, message", [
    ({"axes": {"model.not_a_field": [1, 2]}}, "not a field of model"),
    ({"axes": {"model.norm": ["rmsnorm", "foonorm"]}}, "foonorm"),
    ({"axes": {"model.nsp": [False, True]}}, "nsp"),  # NSP on a decoder: an invalid combination
    ({"axes": {"model.norm": []}}, "empty"),
    ({"axes": {}}, "at least one axis"),
    ({"seeds": []}, "at least one seed"),
    ({"design": "random"}, "design"),
    ({"axes": {"window": {"field": "model.window", "values": [4], "when": {"span": "local"}}}}, "not another axis"),
    ({"exclude": [{"norm_position": "pre"}, {"norm_position": "post"}]}, "no points"),
    # auto resolves per machine, and the workers of one sweep may differ: a point must name its precision
    ({"axes": {"train.precision": ["32-true", "auto"]}}, "precision: auto"),
])
def test_a_malformed_spec_fails_with_one_clear_error_before_anything_runs(tmp_path, fields, message):
    path = write_spec(tmp_path, **fields)
    with pytest.raises(SweepSpecError, match=message):
        run_sweep(path, opts(tmp_path), say=lambda s: None)
    assert not (tmp_path / "results").exists()


def test_an_invalid_point_is_named_with_its_reason(tmp_path):
    path = write_spec(tmp_path, axes={"model.norm_position": ["pre", "post"], "model.nsp": [False, True]})
    with pytest.raises(SweepSpecError) as err:
        run_sweep(path, opts(tmp_path), say=lambda s: None)
    assert "nsp=true" in str(err.value) and "1 invalid point" in str(err.value)


@pytest.mark.parametrize("url", ["mongodb://x/y", "sqlite://", "not a url", "journal:///"])
def test_a_bad_storage_url_fails_before_anything_runs(tmp_path, url):
    with pytest.raises(StorageError):
        run_sweep(write_spec(tmp_path), opts(tmp_path, storage=url), say=lambda s: None)
    assert not (tmp_path / "results").exists()


def test_an_unreachable_storage_is_reported_without_its_password(tmp_path):
    url = "postgresql://alice:hunter2-secret@127.0.0.1:1/nowhere"
    with pytest.raises(StorageError) as err:
        open_storage(url)
    assert "hunter2-secret" not in str(err.value) and "***" in str(err.value)
    assert redact(url) == "postgresql://alice:***@127.0.0.1:1/nowhere"
    with pytest.raises(StorageError):  # and a sweep against it writes nothing
        run_sweep(write_spec(tmp_path), opts(tmp_path, storage=url), say=lambda s: None)
    assert not (tmp_path / "results").exists()


# -- running ----------------------------------------------------------------------------------
def test_a_sweep_runs_every_trial_once_and_a_second_run_runs_nothing(tmp_path):
    path = write_spec(tmp_path)
    out: list[str] = []
    run_sweep(path, opts(tmp_path), say=out.append)
    results = tmp_path / "results"
    assert completions(results) and set(completions(results).values()) == {1}
    df = pd.read_parquet(results / "t" / "results.parquet")
    assert len(df) == 4 and set(df.status) == {"completed"}
    assert {"axis.norm_position", "metric.valid_loss", "cost.parameters", "run_dir", "seed"} <= set(df.columns)
    assert df.groupby("label")["metric.valid_loss"].mean().round(3).to_dict() == {"baseline": 2.005,
                                                                                   "norm_position=post": 2.105}
    out.clear()
    run_sweep(path, opts(tmp_path), say=out.append)
    assert any("is complete: nothing to run" in line for line in out)
    assert set(completions(results).values()) == {1}


def test_the_spec_kept_beside_the_results_names_the_command_lines_overrides(tmp_path):
    """A report quotes results/<sweep>/spec.yaml: the file alone would show settings that did not run."""
    path = write_spec(tmp_path)
    run_sweep(path, opts(tmp_path), say=lambda s: None, overrides={"train.lr": 0.003, "seeds": [0]})
    kept = (tmp_path / "results" / "t" / "spec.yaml").read_text()
    assert kept.startswith(path.read_text().rstrip("\n"))
    assert kept.endswith("applied on top of the spec above:\n#   train.lr=0.003\n#   seeds=[0]\n")
    df = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet")
    assert set(df["seed"]) == {0}


def test_the_results_folder_keeps_every_trials_curves_and_survives_without_its_run_directories(tmp_path,
                                                                                                  monkeypatch):
    """A clean clone has results/<sweep>/ but no run directories: rebuilding the table there must keep every
    committed row and curve, not turn finished trials back into 'pending'."""
    import shutil

    from study.sweep.results import write_table

    monkeypatch.setenv("STUDY_FAKE_CURVE", "1")
    run_sweep(write_spec(tmp_path, seeds=[0]), opts(tmp_path), say=lambda s: None)
    sweep = tmp_path / "results" / "t"
    table, curves = pd.read_parquet(sweep / "results.parquet"), pd.read_parquet(sweep / "curves.parquet")
    assert sorted(curves.trial_key.unique()) == sorted(table.trial_key) and len(curves) == 2 * 4
    assert list(curves.columns[:3]) == ["trial_key", "stage", "step"] and curves["val/loss"].notna().all()
    shutil.rmtree(tmp_path / "results" / "runs")
    write_table(sweep)
    again = pd.read_parquet(sweep / "results.parquet")
    assert list(again.status) == ["completed", "completed"]
    pd.testing.assert_frame_equal(again[table.columns], table, check_dtype=False)
    pd.testing.assert_frame_equal(pd.read_parquet(sweep / "curves.parquet"), curves, check_dtype=False)


def test_optunas_own_api_reads_each_trials_axis_values_as_params(tmp_path):
    """optuna-dashboard and `trials_dataframe()` see what each trial varied: its axis values are Optuna params with
    categorical distributions over the axis's values ('n/a' where a conditional axis does not apply)."""
    import optuna

    spec = write_spec(tmp_path, seeds=[0], design="grid", axes={
        "model.norm_position": ["pre", "post"],
        "span": {"global": {"model.window": None}, "local": {"model.window": 4}},
        "window": {"field": "model.window", "values": [4, 8], "when": {"span": "local"}}})
    run_sweep(spec, opts(tmp_path), say=lambda s: None)
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path / 'results' / 't' / 'study.db'}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 6
    table = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet").set_index("trial_key")
    for t in done:
        row = table.loc[t.user_attrs["key"]]
        assert t.params == {"norm_position": row["axis.norm_position"], "span": row["axis.span"],
                            "window": row["axis.window"]}
        assert t.distributions["norm_position"] == optuna.distributions.CategoricalDistribution(["pre", "post"])
        assert t.distributions["window"] == optuna.distributions.CategoricalDistribution(["4", "8", "n/a"])
    assert set(study.trials_dataframe()["params_span"].dropna()) == {"global", "local"}


def test_a_spec_that_gains_an_axis_value_still_runs_when_optuna_refuses_the_new_choices(tmp_path):
    """Optuna keeps one distribution per param name: the new value's trials run (without params), nothing crashes."""
    run_sweep(write_spec(tmp_path, seeds=[0], axes={"model.position": ["rope", "alibi"]}), opts(tmp_path),
              say=lambda s: None)
    final = run_sweep(write_spec(tmp_path, seeds=[0], axes={"model.position": ["rope", "alibi", "learned"]}),
                      opts(tmp_path), say=lambda s: None)
    assert final["done"] == 3 and final["failed"] == 0
    assert set(completions(tmp_path / "results").values()) == {1} and len(completions(tmp_path / "results")) == 3
    import optuna

    study = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path / 'results' / 't' / 'study.db'}")
    params = {t.user_attrs["label"]: t.params for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert params["baseline"] == {"position": "rope"} and params["position=learned"] == {}  # refused, not fatal


def test_a_metric_that_does_not_apply_is_a_missing_number_in_the_table(tmp_path):
    path = write_spec(tmp_path, seeds=[0], axes={"model.position": ["rope", "learned"]})
    run_sweep(path, opts(tmp_path), say=lambda s: None)
    df = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet").set_index("label")
    assert df.loc["baseline", "metric.valid_ppl_by_length.16"] == 7.5
    assert pd.isna(df.loc["position=learned", "metric.valid_ppl_by_length.16"])  # n/a: learned cannot extrapolate


def test_deleting_a_finished_run_directory_makes_the_next_invocation_run_it_again(tmp_path):
    import shutil

    path = write_spec(tmp_path, seeds=[0])
    run_sweep(path, opts(tmp_path), say=lambda s: None)
    done = completions(tmp_path / "results")
    victim = next(iter(done))
    shutil.rmtree(tmp_path / "results" / "runs" / victim.rsplit("-s", 1)[0])
    out: list[str] = []
    run_sweep(path, opts(tmp_path), say=out.append)
    assert any("1 newly queued" in line for line in out)
    assert completions(tmp_path / "results") == done  # rerun once; the other point untouched


def test_a_point_shared_with_an_earlier_sweep_is_not_trained_again(tmp_path):
    run_sweep(write_spec(tmp_path, name="first", seeds=[0]), opts(tmp_path), say=lambda s: None)
    out: list[str] = []
    run_sweep(write_spec(tmp_path, name="second", seeds=[0], axes={"model.norm_position": ["pre", "post", "sandwich"]}),
              opts(tmp_path), say=out.append)
    assert any("2 found finished on disk" in line for line in out)
    assert set(completions(tmp_path / "results").values()) == {1} and len(completions(tmp_path / "results")) == 3


def test_a_diverging_point_is_a_result_and_a_failing_point_is_retried_then_reported(tmp_path):
    path = write_spec(tmp_path, max_retries=1, seeds=[0], axes={
        "model.d_model": [32, 24, 40],  # 24 always fails, 40 fails once then succeeds
        "train.lr": [0.001, 5.0],  # 5.0 diverges (scripted)
    })
    final = run_sweep(path, opts(tmp_path), say=lambda s: None)
    df = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet").set_index(["label", "seed"])
    assert set(df.loc["lr=5.0"].status) == {"diverged"} and set(df.loc["lr=5.0"].diverged_at_step) == {3}
    assert set(df.loc["d_model=24"].status) == {"failed"}
    assert "scripted failure" in df.loc["d_model=24"].error.iloc[0]
    assert set(df.loc["d_model=24"].attempts) == {2}  # the first try and max_retries=1 retry
    assert set(df.loc["d_model=40"].status) == {"completed"} and set(df.loc["d_model=40"].attempts) == {2}
    assert set(df.loc["baseline"].status) == {"completed"}
    assert final["failed"] == 1 and final["done"] == 3


def test_a_completed_trial_without_its_objective_fails_with_the_reason_and_is_not_retried(tmp_path):
    # Optuna would store it COMPLETE with inf and rank it last; it is a result nothing can rank
    path = write_spec(tmp_path, max_retries=2, seeds=[0], axes={"model.d_model": [32, 48]})
    final = run_sweep(path, opts(tmp_path), say=lambda s: None)
    df = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet").set_index("label")
    assert df.loc["d_model=48", "status"] == "failed" and df.loc["d_model=48", "attempts"] == 1
    assert "no finite 'valid_loss'" in df.loc["d_model=48", "error"]
    assert df.loc["baseline", "status"] == "completed" and final["failed"] == 1
    queue, _ = queue_for(tmp_path / "results" / "t")
    assert not [t for t in queue.trials() if t.state.name == "COMPLETE" and t.user_attrs.get("point") ==
                df.loc["d_model=48", "point"]]


def test_a_sweep_killed_mid_trial_resumes_and_finishes_every_trial_exactly_once(tmp_path):
    path = write_spec(tmp_path, axes={"model.norm_position": ["pre", "post"], "model.norm": ["layernorm", "rmsnorm"]},
                      seeds=[0, 1])
    cmd = [sys.executable, "-m", "study.cli", "sweep", str(path), "--results", str(tmp_path / "results"),
           "--workers", "2", "--runner", FAKE]
    env = {**os.environ, "STUDY_FAKE_SLEEP": "3"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = tmp_path / "results" / "runs"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(runs.glob("*/seed-*/executions.log"))) < 2:
        time.sleep(0.2)
    assert len(list(runs.glob("*/seed-*/executions.log"))) >= 2, "no trial started"
    os.killpg(proc.pid, signal.SIGKILL)  # the whole sweep: driver, workers and trial processes
    proc.wait()
    time.sleep(0.5)
    assert not completions(tmp_path / "results")  # killed before any trial finished

    out: list[str] = []
    run_sweep(path, opts(tmp_path, workers=2), say=out.append)
    done = completions(tmp_path / "results")
    assert len(done) == 6 and set(done.values()) == {1}
    queue, keys = queue_for(tmp_path / "results" / "t")
    assert sorted(complete_keys(queue)) == sorted(keys)  # each key completed exactly once
    df = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet")
    assert set(df.status) == {"completed"}


def _sweep_with_two_trials_running(tmp_path) -> tuple[Path, subprocess.Popen]:
    """`study sweep` with two workers, in a session of its own (its process group stands for a terminal's), once
    both have a 5-second trial running: (its spec, its process)."""
    path = write_spec(tmp_path, seeds=[0, 1])
    cmd = [sys.executable, "-m", "study.cli", "sweep", str(path), "--results", str(tmp_path / "results"),
           "--workers", "2", "--runner", FAKE]
    proc = subprocess.Popen(cmd, env={**os.environ, "STUDY_FAKE_SLEEP": "5"}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = tmp_path / "results" / "runs"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(runs.glob("*/seed-*/executions.log"))) < 2:
        time.sleep(0.2)
    return path, proc


def test_ctrl_c_says_what_it_interrupted_in_one_line_and_the_rerun_resumes(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group): no traceback, one line saying what was interrupted and how
    to resume, exit 130; `study status` shows nothing running; the same command then finishes every trial once."""
    path, proc = _sweep_with_two_trials_running(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends every process of the sweep
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    lines = [line for line in err.splitlines() if line.startswith("study sweep:")]
    assert len(lines) == 1 and "interrupted: 0/4 trials done" in lines[0] and "same command again" in lines[0]
    status = subprocess.run([sys.executable, "-m", "study.cli", "status", "t", "--results", str(tmp_path / "results")],
                            capture_output=True, text=True, check=True).stdout
    assert "0 running" in status, status
    invocations = json.loads((tmp_path / "results" / "t" / "invocations.json").read_text())
    assert invocations[-1]["interrupted"] is True
    run_sweep(path, opts(tmp_path, workers=2), say=lambda s: None)
    assert set(completions(tmp_path / "results").values()) == {1} and len(completions(tmp_path / "results")) == 4


@pytest.mark.parametrize(("signals", "code", "word"), [
    ((("group", signal.SIGINT), ("group", signal.SIGINT)), 130, "interrupted"),
    ((("sweep", signal.SIGTERM),), 143, "terminated"),
], ids=["ctrl-c-twice", "sigterm-to-the-sweep-alone"])
def test_a_second_ctrl_c_or_a_sigterm_to_the_sweep_alone_still_gives_every_running_trial_back(tmp_path, signals,
                                                                                              code, word):
    """A second Ctrl-C while the workers give their trials back does not cut that short (the sweep's exit would kill
    them); `kill PID` of the sweep alone stops its workers too, and says so in one line, as Ctrl-C does."""
    _, proc = _sweep_with_two_trials_running(tmp_path)
    for i, (to, signum) in enumerate(signals):
        time.sleep(0.05 if i else 0)
        os.killpg(proc.pid, signum) if to == "group" else os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("study sweep:")]
    assert len(lines) == 1 and lines[0].startswith(f"study sweep: {word}: 0/4 trials done"), err
    queue, _ = queue_for(tmp_path / "results" / "t")
    assert [t.number for t in queue.trials() if t.state.name == "RUNNING"] == []
    assert json.loads((tmp_path / "results" / "t" / "invocations.json").read_text())[-1]["interrupted"] is True


def test_each_finished_trial_reports_the_sweeps_progress_and_time_left():
    from study.sweep.worker import _progress_text

    counts = {"done": 7, "running": 2, "queued": 8, "failed": 1, "not queued": 0}
    assert _progress_text(counts, [60.0, 120.0], workers=2) == "[7/18 done, 1 failed; ~8 min left]"
    assert _progress_text({**counts, "running": 0, "queued": 0, "done": 17}, [60.0], 2) == "[17/18 done, 1 failed]"
    assert _progress_text(counts, [], 2) == "[7/18 done, 1 failed]"  # nothing timed yet: no guess


def _concurrent_commands(tmp_path: Path, spec: Path, storage: str, n: int = 4) -> list[subprocess.CompletedProcess]:
    """n separate `study sweep` commands against one storage, as n machines would join."""
    cmd = [sys.executable, "-m", "study.cli", "sweep", str(spec), "--results", str(tmp_path / "results"),
           "--workers", "1", "--runner", FAKE, "--storage", storage]
    env = {**os.environ, "STUDY_FAKE_SLEEP": "0.3"}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(n)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=240), p.stdout.read().decode()) for p in procs]


def _assert_exactly_the_grid(tmp_path: Path, spec: Path, storage: str, password: str | None = None) -> None:
    runs = _concurrent_commands(tmp_path, spec, storage)
    failed = [r for r in runs if r.returncode != 0]
    assert not failed, failed[0].stdout[-3000:]
    assert any(": completed" in r.stdout for r in runs)  # the in-process worker reports its trials
    done = completions(tmp_path / "results")
    assert len(done) == 8 and set(done.values()) == {1}, done
    queue, keys = queue_for(tmp_path / "results" / "t", storage)
    assert sorted(complete_keys(queue)) == sorted(keys)
    if password:
        assert not any(password in r.stdout for r in runs)
        for f in (tmp_path / "results").rglob("*"):
            if f.is_file() and f.suffix in (".json", ".yaml", ".csv", ".log"):
                assert password not in f.read_text(errors="replace"), f


GRID = {"design": "grid", "axes": {"model.norm_position": ["pre", "post"], "model.norm": ["layernorm", "rmsnorm"],
                                   "model.activation": ["gelu", "relu"]}, "seeds": [0]}


def test_four_concurrent_workers_on_sqlite_run_exactly_the_grid(tmp_path):
    _assert_exactly_the_grid(tmp_path, write_spec(tmp_path, **GRID), f"sqlite:///{tmp_path / 'q.db'}")


def test_four_concurrent_workers_on_the_journal_file_run_exactly_the_grid(tmp_path):
    _assert_exactly_the_grid(tmp_path, write_spec(tmp_path, **GRID), f"journal:///{tmp_path / 'q.log'}")


@pytest.fixture(scope="module")
def postgres():
    from postgres_server import postgres_or_skip

    server = postgres_or_skip()
    yield server
    server.stop()


def test_four_concurrent_workers_on_postgresql_run_exactly_the_grid_and_never_print_the_password(tmp_path, postgres):
    url = postgres.new_database(password="pw-never-printed")
    _assert_exactly_the_grid(tmp_path, write_spec(tmp_path, **GRID), url, password="pw-never-printed")
    plan = read_json(tmp_path / "results" / "t" / "plan.json")
    assert plan["storage"].startswith("postgresql://postgres:***@")


def test_tuning_mode_picks_each_points_best_setting_then_runs_its_seeds_with_it(tmp_path):
    tune = {"field": "train.lr", "low": 1e-4, "high": 1e-1, "log": True, "trials": 4, "seed": 100}
    path = write_spec(tmp_path, tune=tune, seeds=[0, 1])
    run_sweep(path, opts(tmp_path, workers=2), say=lambda s: None)
    sweep = tmp_path / "results" / "t"
    tuned = read_json(sweep / "tuned.json")
    assert len(tuned) == 2
    for entry in tuned.values():
        assert len(entry["trials"]) == 4
        best = min((t for t in entry["trials"] if t["status"] == "completed"), key=lambda t: t["objective"])
        assert entry["value"] == best["value"]
    df = pd.read_parquet(sweep / "results.parquet")
    assert list(df.status) == ["completed"] * 4
    for _, row in df.iterrows():  # every compared seed trained with its point's chosen lr
        cfg = yaml.safe_load(Path(row["run_dir"], "config.yaml").read_text())
        assert cfg["train"]["lr"] == row["tuned.train.lr"] == tuned[row["point"]]["value"]
        assert cfg["train"]["seed"] == row["seed"]
    tuning = pd.read_csv(sweep / "tuning.csv")
    assert len(tuning) == 8 and set(tuning.status) == {"completed"} and tuning.chosen.sum() == 2
    out: list[str] = []
    run_sweep(path, opts(tmp_path, workers=2), say=out.append)
    assert any("is complete: nothing to run" in line for line in out)
    assert set(completions(tmp_path / "results").values()) == {1}


def test_the_pruning_monitor_stops_a_tuning_trial_whose_logged_loss_is_worse_than_the_median(tmp_path):
    import optuna

    from study.sweep.tuning import PruningMonitor

    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    for curve in ([3.0, 2.5], [2.8, 2.4]):  # two finished trials
        t = study.ask()
        for step, v in enumerate(curve, start=1):
            t.report(v, step)
        study.tell(t, curve[-1])

    def monitor_for(values: list[float]) -> PruningMonitor:
        run_dir = tmp_path / f"run{len(values)}{values[0]}"
        (run_dir / "logs").mkdir(parents=True)
        rows = "".join(f"{step},,{v}\n" for step, v in enumerate(values, start=1))
        (run_dir / "logs" / "metrics.csv").write_text("step,train/loss,val/loss\n" + rows + "3,2.1,\n")
        return PruningMonitor(study.ask(), run_dir, "val/loss")

    assert monitor_for([3.5, 3.4]).should_prune()  # worse than both at step 2
    good = monitor_for([2.7, 2.2])
    assert not good.should_prune() and good.reported == {1, 2} and good.last == 2.2
    assert not PruningMonitor(study.ask(), tmp_path / "no-log-yet", "val/loss").should_prune()


def test_tuning_with_median_pruning_settles_every_point_and_runs_its_seeds(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDY_FAKE_CURVE", "1")
    tune = {"field": "train.lr", "low": 1e-5, "high": 1e-1, "trials": 5, "seed": 100, "pruner": "median"}
    path = write_spec(tmp_path, tune=tune, seeds=[0], axes={"model.norm_position": ["pre"]})
    run_sweep(path, opts(tmp_path), say=lambda s: None)
    tuned = read_json(tmp_path / "results" / "t" / "tuned.json")
    (entry,) = tuned.values()
    statuses = [t["status"] for t in entry["trials"]]
    assert len(statuses) == 5 and set(statuses) <= {"completed", "pruned"}
    assert entry["value"] in [t["value"] for t in entry["trials"] if t["status"] == "completed"]
    df = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet")
    assert list(df.status) == ["completed"]


def test_tuning_on_a_compared_seed_is_refused(tmp_path):
    path = write_spec(tmp_path, tune={"field": "train.lr", "low": 1e-4, "high": 1e-2, "seed": 0}, seeds=[0, 1])
    with pytest.raises(SweepSpecError, match="tune.seed"):
        run_sweep(path, opts(tmp_path), say=lambda s: None)


def test_a_lost_trial_is_requeued_once_by_whichever_worker_notices(tmp_path):
    path = write_spec(tmp_path, seeds=[0])
    from study.sweep.runner import prepare

    plan, layout, url = prepare(path, opts(tmp_path, dry_run=False), say=lambda s: None)
    plan_data = read_json(layout.plan_path)
    storage = open_storage(url)
    a = TrialQueue(storage, "t", grace_s=5, heartbeat_s=1)
    b = TrialQueue(open_storage(url), "t", grace_s=5, heartbeat_s=1)
    a.sync(trial_specs(plan_data))
    claimed = a.claim()
    # the claim is a's and fresh: nobody reaps it
    assert b.reap_lost() == 0
    # its heartbeat stops (a was suspended or its machine died)
    storage.set_trial_user_attr(claimed.trial_id, "heartbeat", time.time() - 60)
    assert b.reap_lost() + a.reap_lost() == 1  # exactly one worker wins the re-queue
    waiting = [t for t in b.trials() if t.state.name == "WAITING"]
    assert [t.user_attrs["key"] for t in waiting].count(claimed.spec.key) == 1
    assert [t.user_attrs["attempt"] for t in waiting if t.user_attrs["key"] == claimed.spec.key] == [2]
    assert not a.still_mine(claimed)


# -- with real training ---------------------------------------------------------------------
@pytest.mark.realdata
@pytest.mark.skipif(not DATA.is_dir(), reason="real benchmark data not found at ../shared/data")
def test_a_real_sweep_trains_each_point_and_tabulates_metrics_and_cost(tmp_path):
    base = {"model": {"preset": "llama2", "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                      "max_seq_len": 32},
            "task": {"name": "lm", "dataset": "tinyshakespeare", "seq_len": 16, "eval_lengths": [1, 2],
                     "eval_tokens": 2000},
            "train": {"max_steps": 4, "batch_size": 4, "eval_every": 4, "eval_batches": 2, "warmup_steps": 1}}
    path = write_spec(tmp_path, base=base, axes={"model.position": ["rope", "alibi"]}, seeds=[0])
    run_sweep(path, SweepOptions(results=tmp_path / "results", data_dir=str(DATA), estimate_rate=1e11,
                                 cache_dir=str(tmp_path / "cache"), poll_s=0.3), say=lambda s: None)
    df = pd.read_parquet(tmp_path / "results" / "t" / "results.parquet")
    assert list(df.status) == ["completed", "completed"], df.error.tolist()
    assert df["metric.valid_loss"].notna().all() and df["metric.valid_ppl_by_length.32"].notna().all()
    assert (df["cost.parameters"] > 0).all() and (df["cost.kv_cache_bytes_per_token"] > 0).all()
    assert df["env.torch"].notna().all() and df["data.fingerprint"].notna().all()


# -- the shipped specs ----------------------------------------------------------------------
SHIPPED = sorted([REPO / "experiments" / "ablation_default.yaml", *(REPO / "experiments" / "sweeps").glob("*.yaml")])


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_spec_is_valid_and_its_readme_row_is_what_the_plan_computes(path):
    import re

    from study.sweep.estimate import estimate
    from study.sweep.plan import check

    plan = expand(*load_spec(path))
    check(plan)
    flops = estimate(plan, rate_flops=1e12)["train_flops"]
    row = next(line for line in (REPO / "README.md").read_text().splitlines()
               if line.startswith(f"| `experiments/{path.relative_to(REPO / 'experiments')}`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[3]) == len(plan.trials)
    number, unit = re.fullmatch(r"([\d.]+) ([TPE])FLOP", cells[4]).groups()
    assert float(number) * {"T": 1e12, "P": 1e15, "E": 1e18}[unit] == pytest.approx(flops, rel=0.01)


def test_the_default_sweep_answers_the_questions_the_issue_asks_with_three_seeds():
    plan = expand(*load_spec(REPO / "experiments" / "ablation_default.yaml"))
    axes = {a.name: a.labels for a in plan.axes}
    assert axes["norm_position"] == ["pre", "post"] and axes["norm"] == ["rmsnorm", "layernorm"]
    assert set(axes["position"]) == {"rope", "learned", "sinusoidal", "alibi", "t5_bias", "none"}
    assert axes["attention"] == ["mha", "gqa", "mqa"] and axes["span"] == ["global", "local"]
    assert len(plan.spec.seeds) >= 3
    assert plan.points[0].config.task.eval_lengths == (1, 2, 4)  # the extrapolation evaluation


def test_a_trial_queued_by_an_earlier_version_of_the_spec_is_dropped_not_run(tmp_path):
    path = write_spec(tmp_path, seeds=[0], axes={"model.norm_position": ["pre", "post", "sandwich"]})
    from study.sweep.runner import prepare

    _, layout, url = prepare(path, opts(tmp_path), say=lambda s: None)
    queue = TrialQueue(open_storage(url), "t")
    queue.sync(trial_specs(read_json(layout.plan_path)))  # queued, then the spec loses 'sandwich'
    path = write_spec(tmp_path, seeds=[0], axes={"model.norm_position": ["pre", "post"]})
    run_sweep(path, opts(tmp_path), say=lambda s: None)
    assert len(completions(tmp_path / "results")) == 2
    dropped = [t for t in queue.trials() if t.user_attrs.get("dropped")]
    assert len(dropped) == 1 and dropped[0].user_attrs["label"] == "norm_position=sandwich"


@pytest.mark.realdata
@pytest.mark.skipif(not DATA.is_dir(), reason="real benchmark data not found at ../shared/data")
def test_a_trial_process_can_train_with_lightning_ddp_over_several_devices(tmp_path):
    cfg = {"name": "ddp", "model": {"preset": "llama2", "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                                    "max_seq_len": 32},
           "task": {"name": "lm", "dataset": "tinyshakespeare", "seq_len": 16, "eval_lengths": [1], "eval_tokens": 2000},
           "train": {"max_steps": 4, "batch_size": 4, "eval_every": 4, "eval_batches": 2, "warmup_steps": 1,
                     "accelerator": "cpu", "devices": 2, "strategy": "ddp", "progress_bar": False}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "study.sweep.trial", "--config", str(tmp_path / "cfg.yaml"), "--seed", "0",
                           "--run-dir", str(run), "--data-dir", str(DATA), "--cache-dir", str(tmp_path / "cache")],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr  # two ranks really ran
    metrics = read_json(run / "metrics.json")
    assert metrics["status"] == "completed" and metrics["steps"] == 4
    assert metrics["train_tokens"] == 4 * 4 * 16 * 2  # both ranks' tokens are counted
