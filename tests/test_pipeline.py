"""A pipeline (pretrain -> GLUE) as one experiment: stages in order, shared stages trained once, nothing lost by a
kill between or within stages, and the study in stages as a sweep whose axes reach the pretrained model.

Real runs on tiny synthetic WikiText and GLUE folders (tests/test_glue_task.py's), a few steps each."""

from __future__ import annotations

import copy
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from study.config import ExperimentConfig, PipelineConfig, content_hash, load_experiment
from study.record import RunDir
from study.run import environment, run_experiment
from study.sweep import SweepOptions, SweepSpecError, run_sweep
from test_glue_task import TRAIN as GLUE_TRAIN
from test_glue_task import write_glue
from test_pretrain_task import BASE as PRETRAIN_BASE
from test_pretrain_task import write_wikitext

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
pytestmark = pytest.mark.usefixtures("offline_hub", "one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pipeline") / "data"
    write_glue(root)
    write_wikitext(root)
    return root


def stages(nsp: bool = True, glue_lr: float = 1e-3, tasks=("sst2", "cola")) -> dict:
    pre = copy.deepcopy(PRETRAIN_BASE)
    pre["model"]["nsp"] = nsp
    pre["train"]["max_steps"] = 3
    glue = {"model": {"arch": "encoder", "objective": "mlm", "dropout": 0.1},
            "task": {"name": "glue", "dataset": "glue", "glue_tasks": list(tasks), "seq_len": 32,
                     "init_from": "stage:pretrain", "finetune_seeds": [0, 1], "epochs": 1},
            "train": {**GLUE_TRAIN, "max_steps": 100, "lr": glue_lr}}
    return {"pretrain": pre, "glue": glue}


def pipeline(**kw) -> PipelineConfig:
    return PipelineConfig.from_dict({"name": "nsp-glue", "stages": stages(**kw)})


def mtime(path: Path) -> int:
    return path.stat().st_mtime_ns


def test_a_pipeline_pretrains_then_finetunes_from_that_run(data, tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "_malloc_set", {})  # as a fresh process: no malloc setting made yet
    cfg = pipeline()
    m = run_experiment(cfg, tmp_path / "trial", data_dir=data, cache_dir=tmp_path / "cache",
                       stage_root=tmp_path / "runs")
    assert m["status"] == "completed" and m["schema"] == 2
    pre_dir = tmp_path / "runs" / content_hash(cfg.stages["pretrain"]) / "seed-0"
    assert m["stages"]["pretrain"]["run_dir"] == str(pre_dir) and RunDir(pre_dir).finished()
    assert m["stages"]["glue"]["run_dir"] == str(tmp_path / "trial" / "glue")
    # what every stage read, at the top (a results table's data.fingerprint)
    from study.io import read_json

    stage_dirs = {"pretrain": pre_dir, "glue": tmp_path / "trial" / "glue"}
    data_json = read_json(tmp_path / "trial" / "data.json")["stages"]
    assert data_json == {n: read_json(RunDir(d).data) for n, d in stage_dirs.items()} and data_json["glue"]
    # the last stage's metrics, each earlier stage's under its name, both declared
    assert 0 <= m["metrics"]["glue_score"] <= 100 and "SST-2/accuracy" in m["metrics"]
    assert m["metrics"]["pretrain"]["valid_mlm_loss"] > 0 and m["metrics"]["pretrain"]["valid_nsp_accuracy"] >= 0
    assert m["declared"]["glue_score"]["direction"] == "maximize"
    assert m["declared"]["pretrain.valid_mlm_loss"]["direction"] == "minimize"
    # the fine-tuning stage started from the pretraining stage's run directory, and says so
    glue_cfg = ExperimentConfig.from_yaml((tmp_path / "trial" / "glue" / "config.yaml").read_text())
    assert glue_cfg.task.init_from == str(pre_dir) and glue_cfg.model.d_model == 32 and not glue_cfg.model.nsp
    assert m["init"]["pretrain_objective"] == "mlm+nsp" and m["init"]["from"] == str(pre_dir)
    assert m["metrics"]["seeds"] == [0, 1] and set(m["parts"]["SST-2"]["seeds"]) == {"0", "1"}
    # the pipeline's env.json records the process settings its stages trained with
    if platform.libc_ver()[0] == "glibc":
        assert json.loads((tmp_path / "trial" / "env.json").read_text())["malloc"] == environment.CPU_MALLOC
    # the pipeline's config.yaml is the pipeline, and a finished pipeline is not run again
    assert load_experiment(tmp_path / "trial" / "config.yaml") == cfg
    before = mtime(tmp_path / "trial" / "metrics.json")
    assert run_experiment(cfg, tmp_path / "trial", data_dir=data, cache_dir=tmp_path / "cache",
                          stage_root=tmp_path / "runs") == m
    assert mtime(tmp_path / "trial" / "metrics.json") == before


def test_pipelines_that_differ_only_after_pretraining_share_the_pretraining_run(data, tmp_path):
    kw = dict(data_dir=data, cache_dir=tmp_path / "cache", stage_root=tmp_path / "runs")
    a = run_experiment(pipeline(glue_lr=1e-3), tmp_path / "a", **kw)
    pre = Path(a["stages"]["pretrain"]["run_dir"])
    stamp = mtime(pre / "metrics.json"), mtime(pre / "model.pt")
    b = run_experiment(pipeline(glue_lr=3e-4), tmp_path / "b", **kw)
    assert b["stages"]["pretrain"]["run_dir"] == str(pre)
    assert (mtime(pre / "metrics.json"), mtime(pre / "model.pt")) == stamp  # found finished, not trained again
    assert b["metrics"]["pretrain"] == a["metrics"]["pretrain"]
    c = run_experiment(pipeline(nsp=False), tmp_path / "c", **kw)  # a pretraining change is another run
    assert c["stages"]["pretrain"]["run_dir"] != str(pre) and c["init"]["pretrain_objective"] == "mlm"


def test_a_pipeline_seed_is_the_pretraining_seed(data, tmp_path):
    cfg = pipeline().with_seed(7)
    assert cfg.stages["pretrain"].train.seed == 7 and cfg.stages["glue"].task.finetune_seeds == (0, 1)
    assert content_hash(cfg) == content_hash(pipeline())  # the seed is not part of the point
    m = run_experiment(cfg, tmp_path / "t", data_dir=data, cache_dir=tmp_path / "cache", stage_root=tmp_path / "r")
    assert m["stages"]["pretrain"]["seed"] == 7 and m["stages"]["pretrain"]["run_dir"].endswith("seed-7")
    assert m["stages"]["glue"]["finetune_seeds"] == [0, 1] and "seed" not in m["stages"]["glue"]  # what it ran
    assert m["init"]["pretrain_seed"] == 7


def _run_trial_process(spec_yaml: Path, run_dir: Path, data: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "study.sweep.trial", "--config", str(spec_yaml), "--seed", "0",
                             "--run-dir", str(run_dir), "--data-dir", str(data), "--cache-dir", str(cache)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    started = time.time()
    while not path.exists():
        assert proc.poll() is None, f"the trial ended before {path} appeared"
        assert time.time() - started < timeout, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.parametrize("kill_when", ["between stages", "within the fine-tuning stage"])
def test_a_trial_killed_between_or_within_stages_resumes_and_loses_nothing(data, tmp_path, kill_when):
    cfg = pipeline(tasks=("sst2", "cola", "mrpc"))
    point = tmp_path / "point.yaml"
    point.write_text(cfg.to_yaml())
    run_dir = tmp_path / "runs" / content_hash(cfg) / "seed-0"  # as a sweep lays it out
    pre = tmp_path / "runs" / content_hash(cfg.stages["pretrain"]) / "seed-0"
    proc = _run_trial_process(point, run_dir, data, tmp_path / "cache")
    marker = pre / "metrics.json" if kill_when == "between stages" else run_dir / "glue" / "SST-2" / "seed1" / "metrics.json"
    _wait_for(marker, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "metrics.json").exists()
    pre_stamp = mtime(pre / "metrics.json")
    done = {p: mtime(p) for p in (run_dir / "glue").glob("*/seed*/metrics.json")} if (run_dir / "glue").is_dir() else {}
    again = _run_trial_process(point, run_dir, data, tmp_path / "cache")
    assert again.wait(timeout=600) == 0
    m = RunDir(run_dir).finished()
    assert m is not None and m["status"] == "completed" and set(m["parts"]) == {"SST-2", "CoLA", "MRPC"}
    assert mtime(pre / "metrics.json") == pre_stamp  # the pretraining stage was not trained again
    assert all(mtime(p) == t for p, t in done.items())  # nor any finished fine-tuning run
    if kill_when != "between stages":
        assert done, "the kill came after some fine-tuning runs had finished"


# -- the study in stages as a sweep -----------------------------------------------------------------------------
def write_staged_spec(tmp_path: Path, **fields) -> Path:
    s = stages(tasks=("sst2",))
    spec = {"name": "nsp", "stages": {"pretrain": {"base": s["pretrain"]},
                                      "glue": {"base": {**s["glue"], "task": {**s["glue"]["task"], "init_from": None}},
                                               "init_from": "pretrain"}},
            "axes": {"model.nsp": [True, False]}, "seeds": [0, 1], "objective": {"metric": "glue_score"}, **fields}
    path = tmp_path / "nsp.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_a_study_in_stages_sweeps_a_pretraining_axis_and_labels_come_from_what_ran(data, tmp_path):
    spec = write_staged_spec(tmp_path)
    out: list[str] = []
    final = run_sweep(spec, SweepOptions(results=tmp_path / "results", data_dir=str(data), estimate_rate=1e11,
                                         cache_dir=str(tmp_path / "cache"), poll_s=0.3), say=out.append)
    assert final["done"] == 4 and final["failed"] == 0
    df = pd.read_parquet(tmp_path / "results" / "nsp" / "results.parquet")
    assert sorted(df["axis.nsp"]) == ["false", "false", "true", "true"] and df["ran_as_planned"].all()
    assert df["metric.glue_score"].notna().all() and df["metric.pretrain.valid_mlm_loss"].notna().all()
    assert df.loc[df["axis.nsp"] == "false", "metric.pretrain.valid_nsp_accuracy"].isna().all()
    assert df.loc[df["axis.nsp"] == "true", "metric.pretrain.valid_nsp_accuracy"].notna().all()
    # the swept value reached the pretrained model: each pretraining run's resolved config holds it
    for _, row in df.iterrows():
        record = RunDir(row["run_dir"]).finished()
        pre_cfg = ExperimentConfig.from_yaml(Path(record["stages"]["pretrain"]["run_dir"], "config.yaml").read_text())
        assert pre_cfg.model.nsp == (row["axis.nsp"] == "true") and pre_cfg.train.seed == row["seed"]
    # ... and it changed what was trained: the two variants' pretraining losses differ seed by seed
    pre = df.pivot(index="seed", columns="axis.nsp", values="metric.pretrain.valid_mlm_loss")
    assert (pre["true"] != pre["false"]).all()
    plan = yaml.safe_load((tmp_path / "results" / "nsp" / "plan.json").read_text())
    assert plan["objective"] == {"metric": "glue_score", "direction": "maximize", "scale": "0-100", "task": "glue"}
    assert plan["stages"] == ["pretrain", "glue"] and plan["tasks"]["pretrain"]["curves"]["valid"] == "val/mlm_loss"


@pytest.mark.parametrize("fields, message", [
    ({"axes": {"glue.model.norm": ["layernorm", "rmsnorm"]}}, "task.init_from takes the architecture"),
    ({"axes": {"train.lr": [1e-3, 3e-4]}}, "name the stage"),
    ({"axes": {"glue.task.mlm_probability": [0.15, 0.2]}}, "does not read it"),
    ({"axes": {"model.nsp": [True, False]}, "objective": {"metric": "valid_loss"}}, "not a metric task 'glue' writes"),
    ({"axes": {"model.nsp": [True, False]}, "objective": {"metric": "pretrain.valid_masked_tokens"}}, "bookkeeping"),
    ({"axes": {"model.nsp": [True, False]}, "objective": {"metric": "glue_score", "direction": "minimize"}},
     "declared maximize"),
])
def test_a_study_in_stages_refuses_axes_and_objectives_that_miss_the_model(tmp_path, fields, message):
    with pytest.raises(SweepSpecError, match=message):
        run_sweep(write_staged_spec(tmp_path, **fields),
                  SweepOptions(results=tmp_path / "results", estimate_rate=1e11), say=lambda s: None)
    assert not (tmp_path / "results").exists()


def test_the_shipped_nsp_study_is_a_valid_plan_whose_axis_reaches_the_pretrained_model():
    from study.sweep import expand, load_spec
    from study.sweep.plan import check

    plan = expand(*load_spec(REPO / "experiments" / "sweeps" / "nsp_glue.yaml"))
    check(plan)
    assert [p.label for p in plan.points] == ["baseline", "nsp=false"] and len(plan.spec.seeds) >= 3
    assert [p.config.stages["pretrain"].model.nsp for p in plan.points] == [True, False]
    glue = plan.points[0].config.stages["glue"]
    assert glue.task.init_from == "stage:pretrain" and len(glue.task.finetune_seeds) >= 2
    assert set(glue.task.glue_tasks) >= {"sst2", "cola", "mrpc", "stsb", "rte", "wnli"} or not glue.task.glue_tasks
    assert plan.objective["metric"] == "glue_score" and plan.objective["direction"] == "maximize"


def test_a_middle_stage_runs_where_what_it_starts_from_is_part_of_its_name():
    """pretrain -> MNLI -> RTE: the MNLI stage's config names its start only as `stage:pretrain`, so two pipelines
    with different pretraining would share one MNLI directory; its name includes the directory it starts from."""
    from study.config import PipelineConfig
    from study.run.pipeline import stage_dir

    def pipeline(d_model: int, seed: int = 0) -> PipelineConfig:
        glue = {"model": {"arch": "encoder", "objective": "mlm"},
                "task": {"name": "glue", "dataset": "glue", "seq_len": 32}}
        return PipelineConfig.from_dict({"name": "stilts", "stages": {
            "pretrain": {"model": {"arch": "encoder", "objective": "mlm", "d_model": d_model, "n_layers": 1,
                                   "n_heads": 2, "max_seq_len": 32, "type_vocab_size": 2},
                         "task": {"name": "pretrain", "dataset": "wikitext-2", "seq_len": 32, "vocab_size": 120},
                         "train": {"seed": seed}},
            "mnli": {**glue, "task": {**glue["task"], "glue_tasks": ["mnli"], "init_from": "stage:pretrain"}},
            "rte": {**glue, "task": {**glue["task"], "glue_tasks": ["rte"], "init_from": "stage:mnli"}}}})

    def middle(cfg):
        return stage_dir(cfg, "mnli", Path("run"), Path("stages"))

    assert middle(pipeline(32)) == middle(pipeline(32))
    assert len({middle(pipeline(32)), middle(pipeline(64)), middle(pipeline(32, seed=1))}) == 3
    assert stage_dir(pipeline(32), "rte", Path("run"), Path("stages")) == Path("run/rte")


@pytest.mark.parametrize("names, message", [
    (("glue_score", "glue"), r"stages\.glue_score: an earlier stage's metrics .* \(glue: glue_score\)"),
    (("cola_std", "glue"), r"stages\.cola_std: .* \(glue: \*_std\)"),
    (("pretrain", "parameters"), r"stages\.parameters: a stage name may not be a cost column"),
])
def test_a_stage_named_like_a_number_of_the_pipeline_record_is_refused_before_anything_runs(tmp_path, names, message):
    """The record keeps each earlier stage's metrics under its name beside the last stage's, and each stage's cost
    under its name beside the cost columns: such a name would overwrite one of those numbers."""
    from study.config import ConfigError

    first, last = names
    s = stages()
    s["glue"]["task"]["init_from"] = f"stage:{first}"
    cfg = PipelineConfig.from_dict({"name": "clash", "stages": {first: s["pretrain"], last: s["glue"]}})
    with pytest.raises(ConfigError, match=message):
        run_experiment(cfg, tmp_path / "trial", data_dir=tmp_path / "no-data")
    assert not (tmp_path / "trial").exists()
    spec = yaml.safe_load(write_staged_spec(tmp_path).read_text())
    spec["stages"] = {first: spec["stages"]["pretrain"], last: {**spec["stages"]["glue"], "init_from": first}}
    (tmp_path / "clash.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(SweepSpecError, match=message):
        run_sweep(tmp_path / "clash.yaml", SweepOptions(results=tmp_path / "results", estimate_rate=1e11),
                  say=lambda s: None)
    assert not (tmp_path / "results").exists()


def test_a_fine_tuning_stage_is_checked_against_the_pretrained_model_not_its_placeholder_section():
    """task.init_from replaces the model section, so the section as written (learned positions, 512 rows by default)
    says nothing: a seq_len the pretrained positions cannot address is refused naming the stage; one they can is
    accepted, whatever the placeholder would have allowed."""
    from study.config import ConfigError
    from study.run.pipeline import refuse_unrunnable_stages

    s = stages()
    s["pretrain"]["model"].update(position="learned", max_seq_len=32)
    s["glue"]["task"]["seq_len"] = 64
    with pytest.raises(ConfigError, match=r"stages\.glue\.task\.seq_len: 64 exceeds model\.max_seq_len=32"):
        refuse_unrunnable_stages(PipelineConfig.from_dict({"name": "p", "stages": s}))
    s["pretrain"]["model"].update(position="alibi")
    s["glue"]["task"]["seq_len"] = 1024  # beyond the placeholder's 512 learned rows
    refuse_unrunnable_stages(PipelineConfig.from_dict({"name": "p", "stages": s}))


def test_fine_tuning_longer_than_pretraining_is_refused_where_positions_are_learned_rows_per_position():
    """Pretrained at 16 tokens with a 32-row learned table, rows 16-31 are never trained (they keep their random
    start, weight decay aside): fine-tuning at 32 would read them. ALiBi has no rows; at 16 every row read is
    trained."""
    from study.config import ConfigError
    from study.run.pipeline import refuse_unrunnable_stages

    s = stages()
    s["pretrain"]["model"].update(position="learned", max_seq_len=32)
    s["pretrain"]["task"]["seq_len"] = 16
    s["glue"]["task"]["seq_len"] = 32
    with pytest.raises(ConfigError, match=r"stages\.glue\.task\.seq_len: 32 is longer than the 16-token sequences the "
                                          r"pretrained run trained its learned positions on: rows 16 to 31"):
        refuse_unrunnable_stages(PipelineConfig.from_dict({"name": "p", "stages": s}))
    s["glue"]["task"]["seq_len"] = 16
    refuse_unrunnable_stages(PipelineConfig.from_dict({"name": "p", "stages": s}))
    s["pretrain"]["model"]["position"] = "alibi"
    s["glue"]["task"]["seq_len"] = 32
    refuse_unrunnable_stages(PipelineConfig.from_dict({"name": "p", "stages": s}))


def test_a_per_task_seq_len_beyond_the_pretrained_positions_is_refused_before_pretraining():
    """The suite's seq_len was checked; a task's own (task.per_task) failed in that task's fine-tuning, after the
    pretraining had run."""
    from study.config import ConfigError
    from study.run.pipeline import refuse_unrunnable_stages

    s = stages()
    s["pretrain"]["model"].update(position="learned", max_seq_len=32)
    s["glue"]["task"]["per_task"] = {"cola": {"task.seq_len": 64}}
    with pytest.raises(ConfigError, match=r"stages\.glue\.task\.per_task\.cola: task\.seq_len: 64 exceeds "
                                          r"model\.max_seq_len=32"):
        refuse_unrunnable_stages(PipelineConfig.from_dict({"name": "p", "stages": s}))


def test_the_pipelines_env_json_names_each_stages_precision_where_they_differ():
    """The first stage's precision alone said the whole pipeline trained in it (the results table's env.precision)."""
    from study.run.pipeline import _precisions

    both = stages()
    both["pretrain"]["train"]["precision"] = both["glue"]["train"]["precision"] = "32-true"
    assert _precisions(PipelineConfig.from_dict({"name": "p", "stages": both})) == "32-true"
    both["glue"]["train"]["precision"] = "bf16-mixed"
    assert _precisions(PipelineConfig.from_dict({"name": "p", "stages": both})) == "pretrain: 32-true, glue: bf16-mixed"
