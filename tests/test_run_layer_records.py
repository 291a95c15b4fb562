"""The run layer's records of experiments made of several runs (a GLUE suite, a pretrain -> fine-tune pipeline): what
their time costs add up, when a finished part or stage is handed back, and that a result fine-tuned from a pretrained
model that has since been replaced is never handed back as one of the model on disk.

Real runs on the tiny synthetic WikiText and GLUE folders of tests/test_pretrain_task.py and tests/test_glue_task.py,
a few steps each."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from study.config import ExperimentConfig, PipelineConfig
from study.io import read_json
from study.record import RunDir
from study.run import RunDirConflict, run_experiment
from test_glue_task import write_glue
from test_pretrain_task import write_wikitext
from test_review_pipeline import glue_stage, pretrain_stage

pytestmark = pytest.mark.usefixtures("offline_hub", "one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("records") / "data"
    write_glue(root)
    write_wikitext(root)
    return root


def pipeline(glue_lr: float = 1e-3, seeds=(0, 1), checkpoint_every: int | None = None) -> PipelineConfig:
    pre = pretrain_stage()
    if checkpoint_every:
        pre["train"]["checkpoint_every"] = checkpoint_every
    glue = glue_stage(finetune_seeds=list(seeds))
    glue["train"]["lr"] = glue_lr
    return PipelineConfig.from_dict({"name": "records", "stages": {"pretrain": pre, "glue": glue}})


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def started_from(part: Path) -> str:
    """The digest of the pretrained model.pt a fine-tuning run started from, as its data.json records it."""
    return read_json(Path(part) / "data.json")["model_sha256"]


# -- time costs ---------------------------------------------------------------------------------------------------

def test_a_pipelines_time_costs_add_up_every_stage_as_its_steps_do_and_each_stage_keeps_its_own(data, tmp_path):
    """`steps` and `train_tokens` count every stage; so do `fit_seconds` and `final_eval_seconds` (a pipeline that
    pretrains for an hour and fine-tunes for a minute trained for an hour and a minute, not a minute). What describes
    the model (parameters, FLOPs, memory) is the last stage's, and every stage's own cost, the last one's included,
    is under its name."""
    m = run_experiment(pipeline(), tmp_path / "p", data_dir=data, cache_dir=tmp_path / "c",
                       stage_root=tmp_path / "runs")
    stages = {name: RunDir(s["run_dir"]).read() for name, s in m["stages"].items()}
    assert m["steps"] == sum(r["steps"] for r in stages.values())
    assert m["train_tokens"] == sum(r["train_tokens"] for r in stages.values())
    for field in ("fit_seconds", "final_eval_seconds"):
        assert m["cost"][field] == pytest.approx(sum(r["cost"][field] for r in stages.values())), field
    assert m["cost"]["pretrain"] == stages["pretrain"]["cost"] and m["cost"]["glue"] == stages["glue"]["cost"]
    assert m["cost"]["parameters"] == stages["glue"]["cost"]["parameters"] != stages["pretrain"]["cost"]["parameters"]
    assert m["cost"]["wall_seconds"] >= m["cost"]["fit_seconds"] + m["cost"]["final_eval_seconds"]
    # a suite's time costs are its parts' (SST-2 with two seeds), summed the same way
    parts = [RunDir(p).read() for p in sorted((tmp_path / "p" / "glue" / "SST-2").glob("seed*"))]
    assert len(parts) == 2
    for field in ("fit_seconds", "final_eval_seconds"):
        assert stages["glue"]["cost"][field] == pytest.approx(sum(r["cost"][field] for r in parts)), field


def test_a_pipeline_stopped_by_a_diverged_stage_counts_the_time_of_every_stage_that_ran():
    from study.record import COMPLETED, DIVERGED, make_record
    from study.run.pipeline import _pipeline_record

    pre = make_record(COMPLETED, {"valid_mlm_loss": 4.0}, {"parameters": 10, "fit_seconds": 7.0,
                                                           "final_eval_seconds": 0.5, "wall_seconds": 8.0}, steps=3)
    glue = make_record(DIVERGED, {}, {"parameters": 9, "fit_seconds": 2.0, "wall_seconds": 2.5}, steps=1,
                       diverged_at_step=1)
    record = _pipeline_record(pipeline(), {"pretrain": (Path("pre"), pre), "glue": (Path("glue"), glue)}, wall=11.0)
    assert record["status"] == DIVERGED and record["diverged_in_stage"] == "glue" and record["steps"] == 4
    assert record["cost"] == {"parameters": 9, "fit_seconds": 9.0, "final_eval_seconds": 0.5, "wall_seconds": 11.0,
                              "pretrain": pre["cost"], "glue": glue["cost"]}


def test_a_pipeline_that_found_its_pretraining_finished_costs_the_time_that_stage_took():
    """A pretraining stage another trial of the sweep ran is handed back at once: the trial's own clock (3 s) said
    it cost a fraction of the trial that trained it. Its wall time is at least its stages' own (8 + 2.5 s)."""
    from study.record import COMPLETED, make_record
    from study.run.pipeline import _pipeline_record

    pre = make_record(COMPLETED, {"valid_mlm_loss": 4.0}, {"parameters": 10, "fit_seconds": 7.0,
                                                           "wall_seconds": 8.0}, steps=3)
    glue = make_record(COMPLETED, {}, {"parameters": 9, "fit_seconds": 2.0, "wall_seconds": 2.5}, steps=1)
    ran = {"pretrain": (Path("pre"), pre), "glue": (Path("glue"), glue)}
    assert _pipeline_record(pipeline(), ran, wall=3.0)["cost"]["wall_seconds"] == 10.5
    assert _pipeline_record(pipeline(), ran, wall=11.0)["cost"]["wall_seconds"] == 11.0  # both ran: its own clock


def test_a_pipeline_or_suite_with_a_part_its_time_budget_cut_short_says_so():
    """A reader of the top-level row must see that a stage (or a suite's part) ended at its time budget."""
    from study.record import COMPLETED, make_record, stopped_by_any
    from study.run.pipeline import _pipeline_record

    pre = make_record(COMPLETED, {"valid_mlm_loss": 4.0}, {"parameters": 10}, steps=3, stopped_by="time")
    glue = make_record(COMPLETED, {"glue_score": 50.0}, {"parameters": 9}, steps=2)
    record = _pipeline_record(pipeline(), {"pretrain": (Path("pre"), pre), "glue": (Path("glue"), glue)}, wall=1.0)
    assert record["stopped_by"] == "time" and record["stages"]["pretrain"]["stopped_by"] == "time"
    assert stopped_by_any([glue, glue]) is None and stopped_by_any([glue, pre]) == "time"


# -- reuse on other data: the rule of a plain run ----------------------------------------------------------------

def test_shared_stages_and_suite_parts_meet_other_data_as_a_plain_run_does(data, tmp_path, monkeypatch):
    """A plain run's rule (tests/test_lm_task.py): a finished run is its result and is handed back without its data
    being read again; an unfinished one is not resumed on other data (RunDirConflict, naming what differs). A
    pipeline's shared stage and a suite's part are run directories like any other and follow that rule."""
    from study.tasks.glue.module import GlueModule
    from study.tasks.pretrain import PretrainDataModule, PretrainModule

    class Killed(Exception):
        pass

    def killed(self, dm):
        raise Killed()

    other = tmp_path / "other"  # the same file names, other contents (another seed's sentences)
    write_glue(other, seed=1)
    write_wikitext(other, seed=1)
    kw = dict(cache_dir=tmp_path / "c", stage_root=tmp_path / "runs")

    # a shared stage killed after its last checkpoint, then met on other data
    cfg = pipeline(seeds=(0,), checkpoint_every=1)
    with monkeypatch.context() as mp:
        mp.setattr(PretrainModule, "final_metrics", killed)
        with pytest.raises(Killed):
            run_experiment(cfg, tmp_path / "a", data_dir=data, **kw)
    with pytest.raises(RunDirConflict, match=r"seed-0 holds a run trained on other data \(files\.test\.txt: "):
        run_experiment(cfg, tmp_path / "a", data_dir=other, **kw)
    a = run_experiment(cfg, tmp_path / "a", data_dir=data, **kw)
    pre = Path(a["stages"]["pretrain"]["run_dir"])

    # finished, the shared stage is handed back to another pipeline, also on other data, without reading it
    stamp = digest(pre / "model.pt"), (pre / "metrics.json").stat().st_mtime_ns
    with monkeypatch.context() as mp:
        mp.setattr(PretrainDataModule, "prepare", lambda self: pytest.fail("a finished stage read its data again"))
        b = run_experiment(pipeline(glue_lr=3e-4, seeds=(0,), checkpoint_every=1), tmp_path / "b", data_dir=other,
                           **kw)
    assert b["stages"]["pretrain"]["run_dir"] == str(pre)
    assert (digest(pre / "model.pt"), (pre / "metrics.json").stat().st_mtime_ns) == stamp

    # a suite's part killed after its last checkpoint, then met on other data
    suite = ExperimentConfig.from_dict(glue_stage(init_from=str(pre), finetune_seeds=[0]))
    suite = suite.replace(train=suite.train.replace(checkpoint_every=1))
    with monkeypatch.context() as mp:
        mp.setattr(GlueModule, "final_metrics", killed)
        with pytest.raises(Killed):
            run_experiment(suite, tmp_path / "s", data_dir=data, cache_dir=tmp_path / "c")
    with pytest.raises(RunDirConflict, match=r"seed0 holds a run trained on other data \(files\."):
        run_experiment(suite, tmp_path / "s", data_dir=other, cache_dir=tmp_path / "c")
    assert run_experiment(suite, tmp_path / "s", data_dir=data, cache_dir=tmp_path / "c")["status"] == "completed"


# -- a pretrained run forced anew ----------------------------------------------------------------------------------

def test_a_suite_fine_tuned_from_a_pretrained_run_since_forced_anew_is_fine_tuned_again(data, tmp_path, caplog):
    """Forcing the pretrained run replaces its model.pt. A suite fine-tuned from the old one holds GLUE scores of a
    model that is no longer there: run again, it fine-tunes every part from the model now on disk, as a forced
    rerun of the pretraining leads one to expect, instead of handing back the old scores as the new model's."""
    pre_cfg = ExperimentConfig.from_dict(pretrain_stage())
    pre = tmp_path / "pre"
    run_experiment(pre_cfg, pre, data_dir=data, cache_dir=tmp_path / "c")
    suite = ExperimentConfig.from_dict(glue_stage(glue_tasks=["sst2", "cola"], init_from=str(pre),
                                                  finetune_seeds=[0]))
    run_experiment(suite, tmp_path / "s", data_dir=data, cache_dir=tmp_path / "c")
    parts = [tmp_path / "s" / "SST-2" / "seed0", tmp_path / "s" / "CoLA" / "seed0"]
    old = digest(pre / "model.pt")
    assert [started_from(p) for p in parts] == [old, old]

    # the same architecture, trained otherwise: the suite's resolved config is unchanged
    run_experiment(pre_cfg.replace(train=pre_cfg.train.replace(lr=1e-2)), pre, data_dir=data,
                   cache_dir=tmp_path / "c", force=True)
    new = digest(pre / "model.pt")
    assert new != old
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="study.run"):
        again = run_experiment(suite, tmp_path / "s", data_dir=data, cache_dir=tmp_path / "c")
    assert again["status"] == "completed"
    said = [r.getMessage() for r in caplog.records if str(tmp_path / "s") in r.getMessage()]
    assert any("fine-tuned from another model" in m for m in said)  # and never that it had nothing to do
    assert not any(m.startswith(f"{tmp_path / 's'} already finished") for m in said)
    assert [started_from(p) for p in parts] == [new, new]
    assert {d["model_sha256"] for d in read_json(tmp_path / "s" / "data.json")["parts"].values()} == {new}
    # and, run once more, the suite fine-tuned from the model on disk is handed back as it is
    stamp = (tmp_path / "s" / "metrics.json").stat().st_mtime_ns
    assert run_experiment(suite, tmp_path / "s", data_dir=data, cache_dir=tmp_path / "c") == again
    assert (tmp_path / "s" / "metrics.json").stat().st_mtime_ns == stamp


def test_a_suite_killed_midway_resumes_only_the_parts_fine_tuned_from_the_model_on_disk(data, tmp_path, monkeypatch):
    """A suite killed after its first part, whose pretrained run is then forced anew: the finished part started from
    the old model and is fine-tuned again, not mixed into a GLUE score with parts of the new one."""
    import study.run.suite as suite_module

    pre_cfg = ExperimentConfig.from_dict(pretrain_stage())
    pre = tmp_path / "pre"
    run_experiment(pre_cfg, pre, data_dir=data, cache_dir=tmp_path / "c")
    suite = ExperimentConfig.from_dict(glue_stage(init_from=str(pre), finetune_seeds=[0, 1]))
    single = suite_module.run_single

    def killed_at_the_second_part(cfg, run_dir, **kw):
        if Path(run_dir).name == "seed1":
            raise KeyboardInterrupt
        return single(cfg, run_dir, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(suite_module, "run_single", killed_at_the_second_part)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(suite, tmp_path / "s", data_dir=data, cache_dir=tmp_path / "c")
    first = tmp_path / "s" / "SST-2" / "seed0"
    assert RunDir(first).finished() and started_from(first) == digest(pre / "model.pt")

    run_experiment(pre_cfg.replace(train=pre_cfg.train.replace(lr=1e-2)), pre, data_dir=data,
                   cache_dir=tmp_path / "c", force=True)
    m = run_experiment(suite, tmp_path / "s", data_dir=data, cache_dir=tmp_path / "c")
    assert m["status"] == "completed"
    assert started_from(first) == started_from(tmp_path / "s" / "SST-2" / "seed1") == digest(pre / "model.pt")


def test_a_pipeline_whose_shared_pretraining_another_pipeline_forced_anew_fine_tunes_again(data, tmp_path,
                                                                                          monkeypatch):
    """Pipelines A and B share their pretraining stage; `study run B --force` trains it again (here the code changed
    in between, so the weights differ). A's record holds GLUE scores of the old weights: run again, A fine-tunes
    from the stage's model now on disk, and does not train the stage once more."""
    from study.tasks.pretrain import PretrainModule

    kw = dict(data_dir=data, cache_dir=tmp_path / "c", stage_root=tmp_path / "runs")
    a = run_experiment(pipeline(seeds=(0,)), tmp_path / "a", **kw)
    pre = Path(a["stages"]["pretrain"]["run_dir"])
    part = tmp_path / "a" / "glue" / "SST-2" / "seed0"
    old = digest(pre / "model.pt")
    assert started_from(part) == old

    trained = PretrainModule.training_loss
    with monkeypatch.context() as mp:  # another version of the pretraining code: the same config trains other weights
        mp.setattr(PretrainModule, "training_loss", lambda self, batch: (lambda out: (out[0] * 3, out[1]))(
            trained(self, batch)))
        b = run_experiment(pipeline(glue_lr=3e-4, seeds=(0,)), tmp_path / "b", force=True, **kw)
    assert b["stages"]["pretrain"]["run_dir"] == str(pre)
    new = digest(pre / "model.pt")
    assert new != old
    stamp = (pre / "metrics.json").stat().st_mtime_ns

    again = run_experiment(pipeline(seeds=(0,)), tmp_path / "a", **kw)
    assert again["status"] == "completed" and started_from(part) == new
    assert (pre / "metrics.json").stat().st_mtime_ns == stamp  # the shared stage is not trained once more
    assert again["metrics"]["pretrain"] == b["metrics"]["pretrain"]


def test_env_json_keeps_the_environments_of_the_attempts_a_run_continues_and_no_others(tmp_path):
    """A resumed run may have begun on another machine: each attempt it continues keeps its environment, oldest
    first. A run started afresh (forced, or its pretrained model replaced) continues nothing."""
    run = RunDir(tmp_path)
    for device in ("a", "b", "c"):
        run.write_env({"device": device}, continues=True)
    assert read_json(run.env) == {"device": "c", "earlier_attempts": [{"device": "a"}, {"device": "b"}]}
    run.write_env({"device": "d"}, continues=False)
    assert read_json(run.env) == {"device": "d"}
