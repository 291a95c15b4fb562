"""A spec whose swept value would not reach the trained model, or whose objective the task does not declare, is
refused before anything runs, with one message naming the axis and why (the cases a new user met: two identical
GLUE scores for `model.nsp: [true, false]`, one architecture trained under `task.init_from` for every `model.norm`,
`valid_loss` stored as inf for GLUE, a count "maximized" as a pretraining objective)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from study.sweep import SweepOptions, SweepSpecError, expand, load_spec, run_sweep
from study.sweep.plan import check

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
GLUE = {"base": str(EXPERIMENTS / "glue_finetune.yaml"),
        "set": {"task.init_from": None, "train.precision": "32-true", "task.vocab_size": 1000,
                "model.type_vocab_size": 2, "task.finetune_seeds": []}}
PRETRAIN = {"base": str(EXPERIMENTS / "wikitext2_bert_pretrain_nsp.yaml"), "set": {"train.precision": "32-true"}}
LM = {"base": str(EXPERIMENTS / "ablation_base.yaml")}


def plan_of(tmp_path: Path, **spec):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "seeds": [0], **spec}, sort_keys=False))
    return expand(*load_spec(path))


def refused(tmp_path: Path, **spec) -> str:
    with pytest.raises(SweepSpecError) as err:
        check(plan_of(tmp_path, **spec))
    return str(err.value)


def test_nsp_in_a_glue_sweep_is_refused_because_the_nsp_head_is_never_trained(tmp_path):
    text = refused(tmp_path, **GLUE, axes={"model.nsp": [True, False]})
    assert "axes.nsp: model.nsp does not reach the trained model" in text and "pretraining stage" in text


def test_tied_embeddings_in_a_glue_sweep_from_scratch_are_refused_because_the_classifier_reads_no_projection(
        tmp_path):
    """Tied or not, a GLUE classifier from scratch is one architecture: only the embedding's first draw differs, so
    such an axis would measure seed noise. And a from-scratch run records (and builds) no next-sentence head."""
    from study.config import ExperimentConfig
    from study.tasks import family

    text = refused(tmp_path, **GLUE, axes={"model.tie_embeddings": [True, False]})
    assert "axes.tie_embeddings: model.tie_embeddings does not reach the trained model" in text
    cfg = ExperimentConfig.from_dict({"model": {"preset": "bert", "d_model": 16, "n_heads": 2, "n_layers": 1},
                                      "task": {"name": "glue", "dataset": "sst2", "vocab_size": 100, "seq_len": 64}})
    assert cfg.model.nsp and not family("glue").resolve(cfg).model.nsp


def test_model_axes_under_init_from_are_refused_naming_each(tmp_path):
    spec = {**GLUE, "set": {**GLUE["set"], "task.init_from": "runs/some-pretrain-run"}}
    text = refused(tmp_path, **spec, axes={"model.norm": ["rmsnorm", "layernorm"], "model.position": ["rope", "alibi"]})
    assert "axes.norm: model.norm does not reach" in text and "axes.position: model.position does not reach" in text
    assert "task.init_from takes the architecture from the pretrained run" in text
    # the fine-tuning regularisation is this config's and reaches the model; what stops this spec is only that the
    # pretrained run it names does not exist, which the dry run finds by resolving the config
    spec["set"]["task.per_task"] = {}  # (the shipped config sets CoLA's dropout itself)
    text = refused(tmp_path, **spec, axes={"model.dropout": [0.1, 0.0]})
    assert "task.init_from: runs/some-pretrain-run does not exist" in text and "does not reach" not in text


def test_a_glue_sweep_of_fine_tuning_settings_is_accepted(tmp_path):
    plan = plan_of(tmp_path, **{**GLUE, "set": {**GLUE["set"], "task.per_task": {}}},
                   axes={"model.dropout": [0.1, 0.0], "train.lr": [1e-3, 3e-4]})
    check(plan)
    assert plan.objective == {"metric": "glue_score", "direction": "maximize", "scale": "0-100", "task": "glue"}


def test_a_setting_per_task_overrides_is_refused_and_so_are_seeds_the_task_does_not_read(tmp_path):
    text = refused(tmp_path, **{**GLUE, "set": {**GLUE["set"], "task.finetune_seeds": [0, 1]}},
                   axes={"train.lr": [1e-3, 3e-4]})
    assert "task.per_task sets it for cola, mrpc, rte" in text
    assert "seeds: the sweep's seeds set train.seed, which task 'glue' does not read here" in text


@pytest.mark.parametrize("base, objective, message", [
    (GLUE, {"metric": "valid_loss"}, "'valid_loss' is not a metric task 'glue' writes"),
    (PRETRAIN, {"metric": "valid_loss"}, "'valid_loss' is not a metric task 'pretrain' writes"),
    (PRETRAIN, {"metric": "valid_masked_tokens"}, "bookkeeping, not a quality measure"),
    (LM, {"metric": "bleu"}, "'bleu' is not a metric task 'lm' writes"),
    (LM, {"metric": "test_loss"}, "tinyshakespeare has no test split"),
    (LM, {"metric": "valid_loss", "direction": "maximize"}, "declared minimize"),
])
def test_an_objective_the_task_does_not_declare_is_refused(tmp_path, base, objective, message):
    axis = {"model.norm": ["layernorm", "rmsnorm"]}
    assert message in refused(tmp_path, **base, axes=axis, objective=objective)


@pytest.mark.parametrize("base, metric, direction", [
    (LM, "valid_loss", "minimize"), (PRETRAIN, "valid_mlm_loss", "minimize"), (GLUE, "glue_score", "maximize"),
])
def test_each_task_family_has_its_own_default_objective_with_its_declared_direction(tmp_path, base, metric,
                                                                                      direction):
    axes = {"train.weight_decay": [0.1, 0.01]}
    if base is GLUE:
        base = {**GLUE, "set": {**GLUE["set"], "task.per_task": {}}}
    plan = plan_of(tmp_path, **base, axes=axes)
    check(plan)
    assert (plan.objective["metric"], plan.objective["direction"]) == (metric, direction)


def test_a_field_the_task_never_reads_is_refused(tmp_path):
    text = refused(tmp_path, **LM, axes={"task.beam_size": [4, 5], "train.label_smoothing": [0.0, 0.1]})
    assert "axes.beam_size: task.beam_size does not reach the trained model: task 'lm' does not read it" in text
    assert "label_smoothing" not in text  # language modelling reads it
    text = refused(tmp_path, **PRETRAIN, axes={"train.label_smoothing": [0.0, 0.1]})
    assert "train.label_smoothing does not reach the trained model: task 'pretrain' does not read it" in text
    assert "model.vocab_size" in refused(tmp_path, **LM, axes={"model.vocab_size": [100, 200]})


def test_a_refused_spec_writes_nothing(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "t", **GLUE, "axes": {"model.nsp": [True, False]}, "seeds": [0]}))
    with pytest.raises(SweepSpecError, match="nothing was run"):
        run_sweep(path, SweepOptions(results=tmp_path / "results", estimate_rate=1e11), say=lambda s: None)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("axis, values, runs", [
    ("train.max_steps", [3, 100], "runs CoLA: 5, SST-2: 5"),  # 3 passes over 48 examples at 32 a step: 5 steps
    ("train.warmup_steps", [0, 2], "runs CoLA: 0, SST-2: 0"),  # at most a tenth of 5 steps
])
def test_a_suite_field_its_data_caps_per_task_is_refused_as_an_axis_where_a_value_misses_a_task(
        tmp_path, axis, values, runs):
    """GLUE caps each task's steps at task.epochs passes over its training set and its warm-up at a tenth of them:
    an axis value some task never runs would label all of them with it. The sizes come from the data, which
    `study sweep` reads before anything runs."""
    from test_glue_task import write_glue

    from study.sweep.runner import prepare

    data = write_glue(tmp_path / "data")
    spec = {"name": "t", "seeds": [0], **GLUE,
            "set": {**GLUE["set"], "task.per_task": {}, "task.glue_tasks": ["CoLA", "SST-2"]}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**spec, "axes": {axis: values}}, sort_keys=False))
    options = SweepOptions(results=tmp_path / "results", data_dir=str(data), dry_run=True)
    with pytest.raises(SweepSpecError) as err:
        prepare(path, options, say=lambda _: None)
    assert f"{axis} does not reach every part of the suite (asked {values[1]}; {runs})" in str(err.value)
    assert "task.epochs passes over its training set" in str(err.value)
    path.write_text(yaml.safe_dump({**spec, "axes": {"train.lr": [1e-3, 3e-4]}}, sort_keys=False))
    prepare(path, options, say=lambda _: None)  # a field no task caps


def test_a_setting_the_task_never_reads_in_the_base_config_is_refused_before_any_point_trains(tmp_path):
    """The base (not an axis, not `set`) sets a field the task never reads: every trial's config.yaml would record a
    beam size a language model never used; the spec is refused naming it, once (a `set` one is said as a `set`)."""
    base = yaml.safe_load((EXPERIMENTS / "ablation_base.yaml").read_text())
    base["task"]["beam_size"] = 3
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    text = refused(tmp_path, base=str(tmp_path / "base.yaml"), axes={"model.norm": ["layernorm", "rmsnorm"]})
    assert "base: task.beam_size: task 'lm' does not read it, so 3 would never run" in text
    text = refused(tmp_path, base=str(tmp_path / "base.yaml"), set={"task.beam_size": 4},
                   axes={"model.norm": ["layernorm", "rmsnorm"]})
    assert text.count("task.beam_size") == text.count("set: task.beam_size does not reach") >= 1


def test_study_run_refuses_a_setting_its_task_never_reads_before_reading_any_data(tmp_path):
    """`study run` (run_experiment) and a pipeline's stages: label smoothing on BERT pretraining is refused, naming
    the field (and the stage), before the data folder, which does not exist here, is read."""
    from study.config import ConfigError, ExperimentConfig, PipelineConfig
    from study.run import run_experiment

    pretrain = yaml.safe_load((EXPERIMENTS / "wikitext2_bert_pretrain_nsp.yaml").read_text())
    pretrain["train"]["label_smoothing"] = 0.1
    with pytest.raises(ConfigError, match=r"train.label_smoothing: task 'pretrain' does not read it, so 0.1 would"):
        run_experiment(ExperimentConfig.from_dict(pretrain), tmp_path / "run", data_dir=tmp_path / "absent")
    pipeline = yaml.safe_load((EXPERIMENTS / "pretrain_then_glue.yaml").read_text())
    first = next(iter(pipeline["stages"]))
    pipeline["stages"][first].setdefault("train", {})["label_smoothing"] = 0.1
    with pytest.raises(ConfigError, match=rf"stages.{first}.train.label_smoothing: task 'pretrain' does not read"):
        run_experiment(PipelineConfig.from_dict(pipeline), tmp_path / "pipe", data_dir=tmp_path / "absent")
    assert not (tmp_path / "run").exists() and not (tmp_path / "pipe" / "stages").exists()


def test_a_set_of_a_field_an_axis_sets_at_every_point_is_refused(tmp_path):
    """`--set model.position=alibi` on the default sweep ran its RoPE baseline and said nothing: the axis's values
    replace the set at every point. Under a conditional axis the set holds where the axis does not apply."""
    text = refused(tmp_path, **LM, set={"model.norm": "layernorm"}, axes={"model.norm": ["rmsnorm", "scalenorm"]})
    assert "set: model.norm: axes.norm sets it at every point (its values rmsnorm, scalenorm)" in text
    plan = plan_of(tmp_path, **LM, set={"model.norm": "layernorm"}, axes={
        "attention": {"mha": {"model.n_kv_heads": 4}, "gqa": {"model.n_kv_heads": 2}},
        "norm": {"field": "model.norm", "values": ["rmsnorm", "scalenorm"], "when": {"attention": ["gqa"]}}})
    assert not any("every point" in p for p in plan.refused), plan.refused


@pytest.mark.parametrize("base", [{}, {"base": ""}])
def test_a_spec_without_a_base_is_refused_rather_than_sweeping_the_default_experiment(tmp_path, base):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "t", **base, "axes": {"model.norm": ["layernorm", "rmsnorm"]}}))
    with pytest.raises(SweepSpecError, match=r"base: missing: name the experiment every point starts from") as err:
        expand(*load_spec(path))
    assert "axes" not in str(err.value)  # the axes are fine: the one problem named is the base


def test_a_pipeline_experiment_given_as_a_spec_is_named_an_experiment_for_study_run():
    path = EXPERIMENTS / "pretrain_then_glue.yaml"
    with pytest.raises(SweepSpecError, match=r"is an experiment config: run it with `study run"):
        load_spec(path)


def test_a_suite_with_none_of_its_tasks_names_each_once():
    from study.tasks.data import DatasetUnavailable
    from study.tasks.glue import _none_available

    missing = [DatasetUnavailable(f"GLUE {t}", hub_id=None, expected_files=[f"glue/{t}/train.tsv"]) for t in
               ("RTE", "MRPC")]
    assert str(_none_available(missing)).startswith("dataset 'GLUE RTE, GLUE MRPC' is not available.")
