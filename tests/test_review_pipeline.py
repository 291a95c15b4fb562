"""Review: pipelines and GLUE suites refuse what cannot run before any training, and record what ran."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from study.config import ConfigError, PipelineConfig
from study.run import run_experiment
from test_glue_task import TRAIN as GLUE_TRAIN
from test_glue_task import write_glue
from test_pretrain_task import BASE as PRETRAIN_BASE
from test_pretrain_task import write_wikitext

pytestmark = pytest.mark.usefixtures("offline_hub", "one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("review") / "data"
    write_glue(root)
    write_wikitext(root)
    return root


def glue_stage(**task) -> dict:
    return {"model": {"arch": "encoder", "objective": "mlm", "dropout": 0.1},
            "task": {"name": "glue", "dataset": "glue", "glue_tasks": ["sst2"], "seq_len": 32,
                     "init_from": "stage:pretrain", "epochs": 1, **task},
            "train": {**GLUE_TRAIN, "max_steps": 4}}


def pretrain_stage(**model) -> dict:
    pre = copy.deepcopy(PRETRAIN_BASE)
    pre["model"].update(model)
    pre["train"]["max_steps"] = 2
    return pre


def nothing_trained(root: Path) -> bool:
    return not list(root.rglob("model.pt"))


def test_a_stage_that_starts_from_a_glue_stage_is_refused_before_training(data, tmp_path):
    """A GLUE suite's directory holds one model per task and seed: nothing a later stage could start from, which
    used to surface only after the pretraining and the first fine-tuning had trained."""
    cfg = PipelineConfig.from_dict({"name": "stilts", "stages": {
        "pretrain": pretrain_stage(), "sst2": glue_stage(),
        "cola": glue_stage(glue_tasks=["cola"], init_from="stage:sst2")}})
    with pytest.raises(ValueError, match=r"stages\.cola: task\.init_from: .* is a 'glue' run"):
        run_experiment(cfg, tmp_path / "t", data_dir=data, cache_dir=tmp_path / "c")
    assert nothing_trained(tmp_path)


def test_a_finetuning_seq_len_the_pretrained_positions_cannot_hold_is_refused_before_training(data, tmp_path):
    cfg = PipelineConfig.from_dict({"name": "long", "stages": {
        "pretrain": pretrain_stage(), "glue": glue_stage(seq_len=64)}})
    with pytest.raises(ConfigError, match=r"stages\.glue\.task\.seq_len: 64 exceeds model\.max_seq_len=32"):
        run_experiment(cfg, tmp_path / "t", data_dir=data, cache_dir=tmp_path / "c")
    assert nothing_trained(tmp_path)


@pytest.fixture(scope="module")
def pretrained(data, tmp_path_factory) -> Path:
    from study.config import ExperimentConfig

    out = tmp_path_factory.mktemp("review-pre") / "pre"
    run_experiment(ExperimentConfig.from_dict(pretrain_stage()), out, data_dir=data,
                   cache_dir=tmp_path_factory.mktemp("review-cache"))
    return out


def diverge(monkeypatch, task: str, seed: int) -> None:
    """The fine-tuning of `task` with `seed` diverges at its first step (a non-finite training loss)."""
    from study.tasks.glue.module import GlueModule

    trained = GlueModule.training_loss

    def training_loss(self, batch):
        loss, tokens = trained(self, batch)
        hit = self.info.name == task and self.cfg.train.seed == seed
        return (loss * float("nan") if hit else loss), tokens

    monkeypatch.setattr(GlueModule, "training_loss", training_loss)


def test_a_suite_with_a_diverged_part_gives_no_glue_score_over_what_survived(data, pretrained, tmp_path, monkeypatch):
    """A GLUE score over the tasks (or seeds) that happened not to diverge ranks a trial on an easier benchmark than
    its neighbours': a sweep would tell it to the tuner as a result. The parts stay in the record, each with its
    status; the aggregates are left unset."""
    from study.config import ExperimentConfig

    diverge(monkeypatch, "CoLA", seed=1)
    cfg = ExperimentConfig.from_dict({**glue_stage(glue_tasks=["sst2", "cola"], init_from=str(pretrained),
                                                   finetune_seeds=[0, 1]), "name": "suite"})
    m = run_experiment(cfg, tmp_path / "suite", data_dir=data, cache_dir=tmp_path / "c")
    assert m["status"] == "diverged"
    assert m["metrics"]["glue_score"] is None and m["metrics"]["glue_score_tasks"] == ["SST-2"]
    assert "CoLA/score" not in m["metrics"] and "CoLA/mcc" not in m["metrics"]  # not CoLA's seed-0 number alone
    assert m["metrics"]["SST-2/score"] is not None  # a task all of whose seeds finished keeps its aggregate
    seeds = m["parts"]["CoLA"]["seeds"]
    assert seeds["0"]["status"] == "completed" and "score" in seeds["0"] and seeds["1"]["status"] == "diverged"


@pytest.mark.parametrize("tasks", [["qqp"], ["qqp", "qnli"]])
def test_a_finetuning_stage_whose_tasks_are_all_unavailable_is_refused_before_pretraining(data, tmp_path, tasks):
    """The test data has no QQP and no QNLI training split: a fine-tuning stage of only those could not run (or
    would "complete" with no task run), which used to surface only once the pretraining stage had trained."""
    from study.tasks.data import DatasetUnavailable

    cfg = PipelineConfig.from_dict({"name": "nodata", "stages": {
        "pretrain": pretrain_stage(), "glue": glue_stage(glue_tasks=tasks)}})
    with pytest.raises(DatasetUnavailable, match="QQP"):
        run_experiment(cfg, tmp_path / "t", data_dir=data, cache_dir=tmp_path / "c")
    assert nothing_trained(tmp_path)


def test_a_task_score_that_is_not_a_number_leaves_the_glue_score_without_one():
    """Dropping STS-B's NaN would report SST-2's 90 as the GLUE score of both tasks."""
    import math

    from study.tasks.glue.metrics import glue_score

    assert math.isnan(glue_score({"SST-2": 90.0, "STS-B": float("nan")}))
    assert math.isnan(glue_score({"SST-2": 90.0, "STS-B": None}))
    assert glue_score({"SST-2": 90.0, "STS-B": 70.0}) == 80.0


def test_a_diverged_pretraining_stage_is_the_pipelines_result_and_nothing_is_finetuned(data, tmp_path, monkeypatch):
    from study.tasks.pretrain import PretrainModule

    trained = PretrainModule.training_loss
    monkeypatch.setattr(PretrainModule, "training_loss",
                        lambda self, batch: (lambda out: (out[0] * float("nan"), *out[1:]))(trained(self, batch)))
    cfg = PipelineConfig.from_dict({"name": "div", "stages": {"pretrain": pretrain_stage(), "glue": glue_stage()}})
    m = run_experiment(cfg, tmp_path / "t", data_dir=data, cache_dir=tmp_path / "c")
    assert m["status"] == "diverged" and m["diverged_in_stage"] == "pretrain"
    assert "glue" not in m["stages"] and not (tmp_path / "t" / "glue").exists()
    assert "glue_score" not in m["metrics"]  # no objective: a sweep ranks it as no result
    # and a fine-tuning run pointed at it by hand is refused before training
    from study.config import ExperimentConfig

    glue = ExperimentConfig.from_dict(glue_stage(init_from=m["stages"]["pretrain"]["run_dir"]))
    with pytest.raises(ValueError, match="did not complete"):
        run_experiment(glue, tmp_path / "g", data_dir=data)


def test_a_forced_suite_keeps_its_old_record_on_bad_input_and_drops_it_once_it_reruns(data, pretrained, tmp_path,
                                                                                      monkeypatch):
    """--force replaces a run: once the rerun rewrites config.yaml the old metrics.json must go (a rerun killed later
    would otherwise hand it back as the new config's result), but a rerun refused for its input has replaced nothing."""
    from study.config import ExperimentConfig
    from study.tasks.data import DatasetUnavailable

    glue = glue_stage(init_from=str(pretrained), finetune_seeds=[0])
    suite = tmp_path / "suite"
    run_experiment(ExperimentConfig.from_dict(glue), suite, data_dir=data, cache_dir=tmp_path / "c")
    old = (suite / "metrics.json").read_text()
    with pytest.raises(DatasetUnavailable):
        run_experiment(ExperimentConfig.from_dict(glue_stage(init_from=str(pretrained), glue_tasks=["qqp"])), suite,
                       data_dir=data, cache_dir=tmp_path / "c", force=True)
    assert (suite / "metrics.json").read_text() == old

    import study.run.suite as suite_module

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite_module, "run_single", killed)  # killed in its first part
    with pytest.raises(KeyboardInterrupt):
        run_experiment(ExperimentConfig.from_dict({**glue, "train": {**glue["train"], "lr": 1e-2}}), suite,
                       data_dir=data, cache_dir=tmp_path / "c", force=True)
    assert not (suite / "metrics.json").exists()


def test_a_forced_pipeline_rerun_replaces_its_record(data, tmp_path):
    """--force on a finished pipeline reruns it, every stage: its old record is removed as the rerun starts, each
    stage trains again (a new model.pt) and a new record is written."""
    cfg = PipelineConfig.from_dict({"name": "again", "stages": {
        "pretrain": pretrain_stage(), "glue": glue_stage(finetune_seeds=[0])}})
    first = run_experiment(cfg, tmp_path / "p", data_dir=data, cache_dir=tmp_path / "c")
    weights = {name: Path(stage["run_dir"]) / "model.pt" for name, stage in first["stages"].items()}
    weights["glue"] = next(Path(first["stages"]["glue"]["run_dir"]).rglob("model.pt"))  # (a suite: in its part)
    before = {name: p.stat().st_mtime_ns for name, p in weights.items()}
    written = (tmp_path / "p" / "metrics.json").stat().st_mtime_ns
    record = run_experiment(cfg, tmp_path / "p", data_dir=data, cache_dir=tmp_path / "c", force=True)
    assert record["status"] == "completed" and (tmp_path / "p" / "metrics.json").stat().st_mtime_ns > written
    assert all(p.stat().st_mtime_ns > before[name] for name, p in weights.items())


def test_a_suite_whose_pretrained_model_is_replaced_between_its_parts_writes_no_result(data, pretrained, tmp_path,
                                                                                       monkeypatch):
    """Another pipeline forcing the shared pretraining stage anew while this suite runs: its earlier parts were
    fine-tuned from the old model, its later ones from the new. Combined, that is no model's result: the suite
    says so and writes no record; run again, it fine-tunes the stale parts from the model there now."""
    import shutil

    import torch

    import study.run.suite as suite_module
    from study.config import ExperimentConfig
    from study.record import started_from_digests

    pre = tmp_path / "pre"
    shutil.copytree(pretrained, pre)
    glue = ExperimentConfig.from_dict(glue_stage(init_from=str(pre), finetune_seeds=[0, 1]))
    real, parts = suite_module.run_single, []

    def then_pretrained_anew(cfg, run_dir, **kwargs):
        record = real(cfg, run_dir, **kwargs)
        parts.append(run_dir)
        if len(parts) == 1:  # between the suite's two parts
            state = torch.load(pre / "model.pt", map_location="cpu")
            torch.save({k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}, pre / "model.pt")
        return record

    monkeypatch.setattr(suite_module, "run_single", then_pretrained_anew)
    with pytest.raises(suite_module.StartReplaced, match="was replaced while this suite ran"):
        run_experiment(glue, tmp_path / "suite", data_dir=data, cache_dir=tmp_path / "c")
    assert not (tmp_path / "suite" / "metrics.json").exists()
    second = (tmp_path / "suite" / "SST-2" / "seed1" / "metrics.json").read_text()
    record = run_experiment(glue, tmp_path / "suite", data_dir=data, cache_dir=tmp_path / "c")
    assert record["status"] == "completed"  # the first part fine-tuned again; the second, of this model, handed back
    assert (tmp_path / "suite" / "SST-2" / "seed1" / "metrics.json").read_text() == second
    assert len(started_from_digests(json.loads((tmp_path / "suite" / "data.json").read_text()))) == 1
