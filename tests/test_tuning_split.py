"""A tuning never chooses by a test set. Tuning mode picks each point's value of the tuned field by the sweep's
objective, and the point's seeds are then scored by that objective: measured on a test split, the choice would be
made on the very sentences the results report (a separate tuning seed does not help: the test set is shared). Each
task declares the split each metric is measured on, and a spec that would tune by a test-set metric is refused before
anything runs, naming the metric, the split and the validation metric to use instead."""

from __future__ import annotations

import pytest
from test_sweep_refusals import EXPERIMENTS, LM, plan_of, refused

from study.sweep.plan import check
from study.tasks import family

MULTI30K = {"base": str(EXPERIMENTS / "multi30k_de_en.yaml"), "set": {"train.precision": "32-true"},
            "axes": {"model.norm_position": ["pre", "post"]}}
WIKITEXT = {"base": str(EXPERIMENTS / "wikitext2_llama2.yaml"), "set": {"train.precision": "32-true"},
            "axes": {"model.norm": ["rmsnorm", "layernorm"]}}
LR = {"field": "train.lr", "low": 3e-4, "high": 1e-2, "log": True, "trials": 4}


def test_tuning_a_translation_sweep_by_test_set_bleu_is_refused_naming_the_validation_loss(tmp_path):
    text = refused(tmp_path, **MULTI30K, objective={"metric": "bleu"}, tune=LR)
    assert "objective: bleu is measured on the test split" in text
    assert "tune would choose train.lr by it" in text
    assert "objective: {metric: valid_loss}" in text  # what to use instead


def test_tuning_a_translation_sweep_by_its_default_objective_is_refused_too(tmp_path):
    """The default objective (BLEU on the first test set) ranks a sweep without tuning; with tuning it is refused."""
    assert family("translation").default_objective == "bleu"
    assert "bleu is measured on the test split" in refused(tmp_path, **MULTI30K, tune=LR)


def test_tuning_a_translation_sweep_by_the_validation_loss_is_accepted(tmp_path):
    plan = plan_of(tmp_path, **MULTI30K, objective={"metric": "valid_loss"}, tune=LR)
    check(plan)
    assert plan.objective["metric"] == "valid_loss" and plan.objective["direction"] == "minimize"


def test_ranking_a_sweep_without_tuning_by_test_set_bleu_is_still_accepted(tmp_path):
    check(plan_of(tmp_path, **MULTI30K, objective={"metric": "bleu"}))


@pytest.mark.parametrize("metric", ["test_loss", "test_ppl", "test_ppl_at_2x"])
def test_tuning_a_wikitext_sweep_by_a_test_metric_is_refused(tmp_path, metric):
    text = refused(tmp_path, **WIKITEXT, objective={"metric": metric}, tune=LR)
    assert f"objective: {metric} is measured on the test split" in text
    assert "objective: {metric: valid_loss}" in text
    assert "valid_ppl_at_2x" not in text  # never written on WikiText-2 (the length curve is on its last split)


@pytest.mark.parametrize("metric", ["valid_loss", "valid_ppl"])
def test_tuning_a_wikitext_sweep_by_a_validation_metric_is_accepted(tmp_path, metric):
    check(plan_of(tmp_path, **WIKITEXT, objective={"metric": metric}, tune=LR))


def test_a_length_curve_on_the_validation_split_may_be_tuned_on(tmp_path):
    """Tiny Shakespeare has no test split: its length curve is measured on validation, and its key says so."""
    check(plan_of(tmp_path, **LM, axes={"model.norm": ["rmsnorm", "layernorm"]}, set={"train.precision": "32-true"},
                  objective={"metric": "valid_ppl_at_2x"}, tune=LR))


@pytest.mark.parametrize("task, metric, split", [
    ("lm", "valid_loss", "valid"), ("lm", "test_ppl", "test"), ("lm", "test_ppl_at_2x", "test"),
    ("lm", "valid_ppl_by_length.256", "valid"), ("lm", "test_ppl_by_length.256", "test"),
    ("translation", "valid_loss", "valid"), ("translation", "bleu", "test"), ("translation", "chrf", "test"),
    ("translation", "test_sets.test_2017_flickr.bleu", "test"), ("translation", "truncated_pairs.train", None),
    ("pretrain", "valid_mlm_loss", "valid"), ("pretrain", "valid_nsp_accuracy", "valid"),
    # GLUE's test labels are not public: its scores are on the dev (validation) splits
    ("glue", "glue_score", "valid"), ("glue", "SST-2/accuracy", "valid"), ("glue", "glue_score_std", None),
])
def test_every_metric_declares_the_split_it_is_measured_on(task, metric, split):
    assert family(task).metric(metric).split_of(metric) == split


def test_the_split_is_written_with_each_declaration():
    declared = family("translation").declared()
    assert declared["valid_loss"]["split"] == "valid" and declared["bleu"]["split"] == "test"
