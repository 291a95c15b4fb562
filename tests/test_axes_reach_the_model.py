"""Every swept value reaches the trained model: each task family swept over each model axis at tiny size.

For every (family, axis), the sweep planner builds the points (one factor at a time from a baseline), each point
trains for a few steps on tiny synthetic data, and the test reads back what ran: the swept field differs between
the point and the baseline in the trials' resolved config.yaml (for a pretrain -> GLUE pipeline, in the pretraining
stage's, whose model GLUE fine-tunes), and so do the trials' objective values. A value that a task ignored, or that
resolution replaced, fails here."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from study.config import ExperimentConfig, PipelineConfig
from study.record import RunDir, metric_value
from study.run import run_experiment
from study.sweep import expand, load_spec
from study.sweep.plan import check
from test_glue_task import TRAIN as GLUE_TRAIN
from test_glue_task import write_glue
from test_lm_task import write_corpus
from test_pretrain_task import BASE as PRETRAIN_BASE
from test_pretrain_task import write_wikitext
from test_translation_task import write_multi30k

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("offline_hub", "one_torch_thread")]

FAST = {"max_steps": 3, "batch_size": 8, "lr": 3e-3, "warmup_steps": 1, "eval_every": 3, "eval_batches": 2,
        "log_every": 1, "grad_norm_every": 0, "progress_bar": False, "accelerator": "cpu"}
# model axes every family shares (the sweep's baseline is each list's first value)
MODEL_AXES = {
    "model.norm": ["layernorm", "rmsnorm"],
    "model.norm_position": ["pre", "post"],
    "model.position": ["alibi", "rope"],
    "model.activation": ["gelu", "swiglu"],
    "attention": {"mha": {"model.n_kv_heads": 2}, "mqa": {"model.n_kv_heads": 1}},
    "span": {"global": {"model.window": None}, "local": {"model.window": 3}},
}
SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 64}


def lm() -> dict:
    return {"base": {"model": {"arch": "decoder", **SMALL},
                     "task": {"name": "lm", "dataset": "tinyshakespeare", "seq_len": 16, "eval_lengths": [1]},
                     "train": FAST}}


def translation() -> dict:
    return {"base": {"model": {"arch": "encoder-decoder", **SMALL, "n_layers": 1},
                     "task": {"name": "translation", "dataset": "multi30k", "tokenizer": "bpe", "vocab_size": 320,
                              "seq_len": 32, "beam_size": 1, "test_sets": ["test_2016_flickr"]},
                     "train": FAST}}


def pretrain() -> dict:
    base = copy.deepcopy(PRETRAIN_BASE)
    base["train"] = {**base["train"], **FAST}
    base["model"].update(SMALL)
    # the same input format with NSP and without: the MLM loss in each model's own format measures two things
    return {"base": base, "objective": {"metric": "valid_mlm_loss_full_sentences"}}


def pipeline() -> dict:
    pre = pretrain()["base"]
    glue = {"model": {"arch": "encoder", "objective": "mlm", "dropout": 0.0},
            "task": {"name": "glue", "dataset": "glue", "glue_tasks": ["sst2"], "seq_len": 32},
            "train": {**GLUE_TRAIN, "max_steps": 3}}
    return {"stages": {"pretrain": {"base": pre}, "glue": {"base": glue, "init_from": "pretrain"}}}


def logged_valid_loss(run: RunDir, record: dict) -> float:
    """The validation loss the run logged last (BLEU after three steps is 0 for every variant)."""
    import csv

    with open(run.curves, newline="") as f:
        values = [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]
    return values[-1]


# family -> (spec, axes, the output compared: a function of (run, record))
FAMILIES = {
    "lm": (lm, MODEL_AXES, lambda run, record: metric_value(record, "valid_loss")),
    "translation": (translation, MODEL_AXES, logged_valid_loss),
    "pretrain": (pretrain, {**MODEL_AXES, "model.nsp": [True, False]},
                 lambda run, record: metric_value(record, "valid_mlm_loss")),
    "pretrain->glue": (pipeline, {**MODEL_AXES, "model.nsp": [True, False]},
                       lambda run, record: metric_value(record, "pretrain.valid_mlm_loss")),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reach") / "data"
    write_corpus(root)
    write_multi30k(root)
    write_wikitext(root)
    write_glue(root)
    return root


def resolved(run: RunDir, cfg) -> ExperimentConfig:
    """What ran: the run directory's config.yaml (a pipeline: its pretraining stage's, which holds the model)."""
    if isinstance(cfg, PipelineConfig):
        run = RunDir(run.finished()["stages"]["pretrain"]["run_dir"])
    return ExperimentConfig.from_yaml(run.config.read_text())


def field(cfg: ExperimentConfig, path: str):
    section, _, name = path.partition(".")
    return getattr(getattr(cfg, section), name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_model_axis_reaches_the_trained_model_of_every_task_family(name, data, tmp_path):
    make, axes, output = FAMILIES[name]
    spec = {"name": "reach", **make(), "axes": axes, "seeds": [0]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    plan = expand(*load_spec(path))
    check(plan)  # nothing refused: every axis reaches this family's model
    runs = {}
    for p in plan.points:
        run = RunDir(tmp_path / "runs" / p.point / "seed-0")
        record = run_experiment(p.config.with_seed(0), run.path, data_dir=data, cache_dir=tmp_path / "cache",
                                stage_root=tmp_path / "runs" if isinstance(p.config, PipelineConfig) else None)
        assert record["status"] == "completed", (name, p.label)
        assert metric_value(record, plan.objective["metric"]) is not None, (name, p.label)
        runs[p.varied] = (p, run, output(run, record))
    base_point, base_run, base_value = runs["baseline"]
    base_cfg = resolved(base_run, base_point.config)
    for axis in plan.axes:
        point, run, value = runs[axis.name]
        ran = resolved(run, point.config)
        for path in axis.values[axis.labels[1]]:
            section_field = path.split(".", 1)[1] if path.startswith(("pretrain.", "glue.")) else path
            assert field(ran, section_field) == axis.values[axis.labels[1]][path], (name, axis.name)
            assert field(ran, section_field) != field(base_cfg, section_field), (name, axis.name)
        assert value is not None and base_value is not None and value != base_value, (name, axis.name)
        if isinstance(point.config, PipelineConfig):  # GLUE fine-tuned the pretrained model, axis value included
            glue = ExperimentConfig.from_yaml((run.path / "glue" / "config.yaml").read_text())
            for path, wanted in axis.values[axis.labels[1]].items():
                if path != "model.nsp":  # the NSP head is dropped for fine-tuning
                    assert field(glue, path) == wanted, (name, axis.name)
