"""The dry run's cost estimate says what it rests on: FLOPs at task.seq_len are exact where the task packs its data
to seq_len (language modelling) and an upper bound where it pads each batch only to its longest example
(translation, GLUE), which the dry run cannot measure without reading the data."""

from __future__ import annotations

from pathlib import Path

from study.sweep import expand, load_spec
from study.sweep.estimate import basis_sentence, estimate, length_basis

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "experiments" / "sweeps"


def _estimate(spec: Path) -> tuple:
    plan = expand(*load_spec(spec))
    return plan, estimate(plan, rate_flops=1e12)


def test_a_language_model_sweep_is_exact_at_seq_len():
    plan, cost = _estimate(REPO / "experiments" / "ablation_default.yaml")
    assert {length_basis(p.config) for p in plan.points} == {"exact"}
    assert cost["length_basis"] == "exact" and cost["upper_bound_points"] == []
    assert "exact" in basis_sentence(cost) and "UPPER BOUND" not in basis_sentence(cost)


def test_a_translation_sweep_is_labelled_an_upper_bound_with_its_reason():
    plan, cost = _estimate(SWEEPS / "multi30k_warmup_gqa.yaml")
    assert cost["length_basis"] == "upper bound" and cost["upper_bound_tasks"] == ["translation"]
    assert cost["upper_bound_points"] == [p.label for p in plan.points]  # every point pads per batch
    sentence = basis_sentence(cost)
    assert sentence.startswith("an UPPER BOUND") and "translation pad each batch only to its longest example" \
        in sentence


def test_a_pipeline_is_as_loose_as_its_loosest_stage():
    """NSP pretraining fills seq_len; its GLUE fine-tuning stage pads per batch: the trial is an upper bound."""
    plan, cost = _estimate(SWEEPS / "nsp_glue.yaml")
    assert {length_basis(p.config) for p in plan.points} == {"upper bound"}
    assert cost["upper_bound_tasks"] == ["glue"]  # pretrain is not named: its pairs fill seq_len

