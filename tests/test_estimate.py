"""The dry run's cost estimate says what it rests on: FLOPs at task.seq_len are exact where the task packs its data
to seq_len (language modelling) and an upper bound where it pads each batch only to its longest example
(translation, GLUE), which the dry run cannot measure without reading the data."""

from __future__ import annotations

from pathlib import Path

import pytest

from study.config import content_hash
from study.sweep import expand, load_spec
from study.sweep.estimate import basis_sentence, estimate, length_basis, training_flops

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
    assert sentence.startswith("an UPPER BOUND")
    assert "the translation task pads each batch only to its longest example" in sentence


def test_a_pipeline_is_as_loose_as_its_loosest_stage():
    """NSP pretraining fills seq_len; its GLUE fine-tuning stage pads per batch: the trial is an upper bound."""
    plan, cost = _estimate(SWEEPS / "nsp_glue.yaml")
    assert {length_basis(p.config) for p in plan.points} == {"upper bound"}
    assert cost["upper_bound_tasks"] == ["glue"]  # pretrain is not named: its pairs fill seq_len



@pytest.mark.parametrize("overrides", [
    {"axes": {"model.nsp": [True, False], "glue.train.weight_decay": [0.0, 0.01]}},  # points sharing a pretraining
    {"tune": {"field": "glue.train.weight_decay", "low": 0.0, "high": 0.3, "log": False, "trials": 4}},
    {"tune": {"field": "pretrain.train.lr", "low": 1e-4, "high": 3e-3, "trials": 4}},
])
def test_a_study_in_stages_is_charged_each_shared_stage_once_as_it_trains(overrides):
    """An earlier stage trains once per (stage config, seed), in a directory every trial with that stage shares;
    the tuned stage differs with each sampled value, and every point's seeds run its own chosen one."""
    plan = expand(*load_spec(SWEEPS / "nsp_glue.yaml", overrides))
    tune = plan.spec.tune_settings if plan.spec.tune else {"trials": 0, "field": ""}
    pretraining_tuned = tune["field"].startswith("pretrain.")  # each sampled (or chosen) value its own pretraining
    pretraining: dict = {}
    finetuning = 0.0
    for p in plan.points:
        runs = [(s, ("seed", s)) for s in plan.spec.seeds] + [(tune.get("seed"), ("tune", i))
                                                              for i in range(tune["trials"])]
        for seed, which in runs:
            stage = p.config.with_seed(seed).stages["pretrain"]
            key = (content_hash(stage), seed) + ((p.point, which) if pretraining_tuned else ())
            pretraining[key] = training_flops(stage)
            finetuning += training_flops(p.config.stages["glue"])
    assert estimate(plan, rate_flops=1e12)["train_flops"] == pytest.approx(sum(pretraining.values()) + finetuning)


def test_a_trial_on_two_devices_trains_twice_the_tokens_per_step():
    """train.batch_size is per device: under DDP each of train.devices ranks takes its own batch every step."""
    from study.config import load_experiment

    cfg = load_experiment(REPO / "experiments" / "ablation_base.yaml")
    two = cfg.replace(train=cfg.train.replace(devices=2, strategy="ddp"))
    assert training_flops(two) == 2 * training_flops(cfg)


@pytest.mark.parametrize("native", [False, True])
def test_a_dry_run_of_bf16_trials_on_a_cpu_that_emulates_bf16_warns_that_its_time_is_far_too_low(monkeypatch, native):
    """multi30k_warmup_gqa trains in bf16-mixed on the CPU; the time printed is at this machine's float32 matmul rate,
    which an AVX2 CPU's emulated bf16 reaches only about 1/100th of."""
    import study.model.precision as precision
    from study.sweep.plan import describe

    monkeypatch.setattr(precision, "native_bf16", lambda accelerator="auto": native)
    plan = expand(*load_spec(SWEEPS / "multi30k_warmup_gqa.yaml"))
    cost = estimate(plan)  # this machine's rate: the trials would run here
    text = describe(plan, cost)
    assert ("WARNING: train.precision bf16-mixed on this CPU" in text) is not native, text
    # the advice is a command the tool accepts: another folder than the committed bf16 study's (refused there)
    assert "--set train.precision=32-true --results DIR" in text or native
    assert estimate(plan, rate_flops=1e12)["emulated_bf16"] is None  # --peak-flops: the rate of another machine


def test_the_float32_advice_of_a_study_in_stages_names_each_stage(monkeypatch):
    """`--set train.precision=32-true` is refused in a study in stages ("name the stage"): the warning gives the
    stage-qualified keys the sweep accepts."""
    import study.model.precision as precision
    from study.sweep.plan import describe

    monkeypatch.setattr(precision, "native_bf16", lambda accelerator="auto": False)
    plan = expand(*load_spec(SWEEPS / "nsp_glue.yaml"))
    text = describe(plan, estimate(plan))
    assert "--set pretrain.train.precision=32-true --set glue.train.precision=32-true" in text, text
