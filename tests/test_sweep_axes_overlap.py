"""Every swept value reaches the trained model, or the spec is refused before anything runs; the results table
labels each trial by what ran. Three ways that broke: two axes setting one field (the later silently replaced the
earlier, whose label then named a value that never ran), a value the config coerces (YAML's `2e-3` is a string)
labelled '?' though it ran as planned, and a `model.preset` axis that crashed planning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_sweep_refusals import EXPERIMENTS, LM, plan_of, refused

from study.io import atomic_write_text
from study.record import RunDir, make_record
from study.sweep import SweepSpecError, expand, load_spec
from study.sweep.plan import check
from study.sweep.results import trial_row

ATTENTION = {"mha": {"model.n_kv_heads": 4}, "mqa": {"model.n_kv_heads": 1}}


# -- two axes that set one field ------------------------------------------------------------------


@pytest.mark.parametrize("design", ["grid", "ofat"])
def test_two_axes_that_set_the_same_field_in_one_point_are_refused_naming_both_and_the_field(tmp_path, design):
    text = refused(tmp_path, **LM, design=design,
                   axes={"attention": ATTENTION, "model.n_kv_heads": [4, 2], "task.beam_size": [4, 5]})
    assert "axes.attention and axes.n_kv_heads both set model.n_kv_heads" in text
    assert "axes.beam_size: task.beam_size does not reach" in text  # collected with the other problems
    # the same two fields on axes whose conditions keep them apart: no point combines them
    plan = plan_of(tmp_path, **LM, design=design, axes={
        "model.norm": ["rmsnorm", "layernorm"],
        "attention": {"values": ATTENTION, "when": {"norm": "rmsnorm"}},
        "kv": {"field": "model.n_kv_heads", "values": [2, 1], "when": {"norm": "layernorm"}}})
    check(plan)
    assert {p.config.model.n_kv_heads for p in plan.points} >= {4, 2}


def test_a_conditional_axis_may_refine_only_the_field_of_the_axis_its_condition_names(tmp_path):
    plan = plan_of(tmp_path, **LM, design="grid", axes={
        "span": {"global": {"model.window": None}, "local": {"model.window": 4}},
        "window": {"field": "model.window", "values": [4, 8], "when": {"span": "local"}}})
    check(plan)  # window refines span=local
    assert sorted(str(p.config.model.window) for p in plan.points) == ["4", "8", "None"]
    text = refused(tmp_path, **LM, design="grid", axes={
        "model.norm": ["rmsnorm", "layernorm"], "attention": ATTENTION,
        "kv": {"field": "model.n_kv_heads", "values": [2], "when": {"norm": "layernorm"}}})
    assert "axes.attention and axes.kv both set model.n_kv_heads" in text


@pytest.mark.parametrize("design", ["grid", "ofat"])
def test_a_conditional_axis_that_refines_values_which_differ_in_its_field_is_refused(tmp_path, design):
    """`window` when `span: [global, local]` replaced global's null window too: the "global" baseline trained with a
    window and span=local was skipped as its duplicate, so the sweep had no global-attention point at all."""
    text = refused(tmp_path, **LM, design=design, axes={
        "span": {"global": {"model.window": None}, "local": {"model.window": 4}},
        "window": {"field": "model.window", "values": [4, 8], "when": {"span": ["global", "local"]}}})
    assert "axes.window refines axes.span where it is global, local, which set model.window differently " \
           "(global: none, local: 4)" in text
    # values that agree in the field may share a refinement
    plan = plan_of(tmp_path, **LM, design="grid", axes={
        "span": {"local": {"model.window": 4}, "local_rms": {"model.window": 4, "model.norm": "layernorm"}},
        "window": {"field": "model.window", "values": [4, 8], "when": {"span": ["local", "local_rms"]}}})
    check(plan)


def test_one_field_spelled_two_ways_in_a_study_in_stages_is_refused(tmp_path):
    """In a study in stages `model.nsp` is the first stage's (`pretrain.model.nsp`): the same field, however spelled."""
    spec = yaml.safe_load((EXPERIMENTS / "sweeps" / "nsp_glue.yaml").read_text())
    for stage in spec["stages"].values():
        stage["base"] = str(EXPERIMENTS / "sweeps" / stage["base"])
    spec.pop("name", None)
    spec.pop("seeds", None)
    head = {"on": {"pretrain.model.nsp": True}, "off": {"pretrain.model.nsp": False}}
    text = refused(tmp_path, **{**spec, "design": "grid", "axes": {"model.nsp": [True, False], "head": head}})
    assert "axes.nsp and axes.head both set model.nsp" in text


# -- labels of values the config coerces ------------------------------------------------------------


def finish(tmp_path: Path, plan, point, config_yaml: str) -> dict:
    """The results row of `point`'s seed-0 trial after a run that wrote `config_yaml`, with the plan read back
    from JSON as the results command reads plan.json."""
    stored = json.loads(json.dumps(plan.to_dict(), default=str))
    entry = next(p for p in stored["points"] if p["point"] == point.point)
    run = RunDir(tmp_path / "runs" / point.point / "seed-0")
    atomic_write_text(run.config, config_yaml)
    run.write(make_record("completed", {"valid_loss": 1.0}, {}, steps=1))
    return trial_row(stored, entry, 0, run.path)


def lr_plan(tmp_path: Path):
    path = tmp_path / "spec.yaml"  # by hand: 2e-3 (no dot) is a number in YAML 1.2, a string in PyYAML's YAML 1.1
    path.write_text(f"name: lr\nbase: {LM['base']}\naxes:\n  train.lr: [2e-3, 1e-3]\nseeds: [0]\n")
    plan = expand(*load_spec(path))
    check(plan)
    assert [p.config.train.lr for p in plan.points] == [0.002, 0.001]
    return plan


def test_a_value_the_config_coerces_is_labelled_with_the_specs_text_and_ran_as_planned(tmp_path):
    plan = lr_plan(tmp_path)
    for point in plan.points:
        row = finish(tmp_path, plan, point, point.config.with_seed(0).to_yaml())
        assert (row["axis.lr"], row["ran_as_planned"], row["label"]) == (point.axes["lr"], True, point.label)


def test_a_coerced_value_that_did_not_run_is_labelled_from_what_ran(tmp_path):
    plan = lr_plan(tmp_path)
    baseline = plan.points[0]
    ran_other = baseline.config.replace(train=baseline.config.train.replace(lr=0.001)).with_seed(0)
    row = finish(tmp_path, plan, baseline, ran_other.to_yaml())
    assert (row["axis.lr"], row["ran_as_planned"], row["label"]) == ("0.001", False, "baseline (ran: lr=0.001)")
    ran_neither = baseline.config.replace(train=baseline.config.train.replace(lr=0.005)).with_seed(0)
    row = finish(tmp_path, plan, baseline, ran_neither.to_yaml())
    assert (row["axis.lr"], row["ran_as_planned"]) == ("?", False)


def test_a_value_the_config_normalises_counts_as_planned(tmp_path):
    spec = {"base": {"model": {"preset": "bert", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32,
                               "vocab_size": 1000},
                     "task": {"name": "glue", "dataset": "SST-2", "vocab_size": 1000, "seq_len": 32},
                     "train": {"precision": "32-true"}},
            "axes": {"task.dataset": ["SST-2", "CoLA"]}}
    plan = plan_of(tmp_path, **spec)
    assert [p.config.task.dataset for p in plan.points] == ["sst2", "cola"]
    for point in plan.points:
        row = finish(tmp_path, plan, point, point.config.with_seed(0).to_yaml())
        assert (row["axis.dataset"], row["ran_as_planned"]) == (point.axes["dataset"], True)


# -- a preset axis ---------------------------------------------------------------------------------


@pytest.mark.parametrize("axes", [{"model.preset": ["llama2", "gpt2"]},
                                  {"arch": {"llama": {"model.preset": "llama2"}, "gpt": {"model.preset": "gpt2"}}},
                                  {"arch": {"field": "model.preset", "values": ["llama2", "gpt2"]}}])
def test_a_preset_axis_is_refused_before_planning_saying_what_to_do_instead(tmp_path, axes):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "p", **LM, "axes": axes, "seeds": [0]}))
    with pytest.raises(SweepSpecError) as err:
        expand(*load_spec(path))
    assert "model.preset" in str(err.value) and "named variants" in str(err.value)
