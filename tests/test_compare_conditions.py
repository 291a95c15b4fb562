"""A published effect is compared only under the conditions it was published under: on a metric the publication
states its direction for (Vaswani et al. 2017: label smoothing hurts perplexity but helps BLEU), and with the other
axes held where the publication held them, checked against the cells' configs when the sweep does not vary them
(Xiong et al. 2020: post- vs pre-norm without warm-up)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from study.report import published as published_module
from study.report.collect import SweepResults, load_results
from study.report.compare import compare_effects
from study.report.published import load_effects, validate_effects
from synthetic_sweep import make_synthetic_sweep

ROOT = Path(__file__).resolve().parents[1]
BLEU = {"direction": "maximize", "scale": "BLEU (0-100)", "constant": "-", "objective": True, "description": ""}


@pytest.fixture(scope="module")
def effects():
    return load_effects()


def _by_id(table: pd.DataFrame, effect_id: str) -> pd.DataFrame:
    return table[table["effect_id"] == effect_id] if not table.empty else table


# -- the metric a published direction is about ----------------------------------------------------------------------
def _label_smoothing_sweep(bleu_with: float = 25.8, bleu_without: float = 25.3) -> SweepResults:
    """experiments/sweeps/multi30k_vaswani_gpu.yaml's label-smoothing axis (0.1 -> 0.0) scored by BLEU, each cell at
    Vaswani et al.'s own BLEU (plus a little seed noise, another in each cell: paired differences with no spread at
    all are no t-test, study.report.stats): the paper reproduced exactly."""
    rows = [{"label": label, "seed": s, "is_baseline": base, "axis.label_smoothing": ls, "status": "completed",
             "task": "translation", "dataset": "multi30k", "metric.bleu": bleu + noise}
            for label, ls, base, bleu, noises in (("baseline", "0.1", True, bleu_with, (0.0, 0.05, -0.03)),
                                                  ("label_smoothing=0", "0", False, bleu_without, (0.02, -0.01, 0.04)))
            for s, noise in enumerate(noises)]
    plan = {"sweep": "ls", "design": "ofat", "seeds": [0, 1, 2], "stages": [], "points": [],
            "axes": {"label_smoothing": ["0.1", "0"]},
            "objective": {"metric": "bleu", "direction": "maximize", "scale": "BLEU (0-100)", "task": "translation"},
            "tasks": {"translation": {"metrics": {"bleu": BLEU}, "default_objective": "bleu"}}}
    return SweepResults(Path("ls"), pd.DataFrame(rows), plan)


def test_a_direction_published_on_perplexity_is_not_compared_on_bleu(effects):
    """Vaswani et al. report removing label smoothing as better in dev perplexity (4.92 -> 4.67) and worse in BLEU
    (25.8 -> 25.3): a BLEU sweep that reproduces the paper is compared with the BLEU direction and agrees; the
    perplexity direction is listed as not compared, with the reason, never as a disagreement."""
    tested, untested = compare_effects(_label_smoothing_sweep(), effects[effects["axis"] == "label_smoothing"])
    assert _by_id(tested, "vaswani-ls0").empty
    reasons = _by_id(untested, "vaswani-ls0")["reason"].tolist()
    assert reasons == ["published on WMT14 En-De dev perplexity per wordpiece; this sweep's metric is bleu"]
    bleu = _by_id(tested, "vaswani-ls0-bleu")
    assert len(bleu) == 1 and bleu["verdict"].iloc[0] == "agree" and bleu["our_diff"].iloc[0] < 0
    assert bleu["holm_family"].iloc[0] == 1  # the perplexity row is no test of the family


def test_vaswani_label_smoothing_records_both_directions_of_table_3(effects):
    rows = effects.set_index("effect_id")
    ppl, bleu = rows.loc["vaswani-ls0"], rows.loc["vaswani-ls0-bleu"]
    assert (ppl["metric"], ppl["published_baseline"], ppl["published_variant"], ppl["published_direction"]) == \
        ("cross-entropy", 4.92, 4.67, "better")
    assert (bleu["metric"], bleu["published_baseline"], bleu["published_variant"], bleu["published_direction"]) == \
        ("bleu", 25.8, 25.3, "worse")
    assert bleu["published_ids"] == "vaswani17-t3-base-bleu;vaswani17-t3-ls0-bleu"
    assert "lowers BLEU" not in ppl["note"]  # label smoothing raises BLEU (25.3 without it, 25.8 with it)


def test_every_effect_names_a_known_metric_and_a_typo_fails_when_loading(effects, monkeypatch):
    assert set(effects["metric"]) <= set(published_module.EFFECT_METRICS)
    typo = effects.assign(metric=effects["metric"].where(effects["effect_id"] != "vaswani-ls0", "perplexty"))
    assert any("vaswani-ls0" in p and "perplexty" in p for p in validate_effects(typo))
    monkeypatch.setattr(published_module, "_read", lambda name: typo.astype(str))
    with pytest.raises(ValueError, match="perplexty"):
        published_module.load_effects()


# -- a condition on an axis the sweep does not vary -------------------------------------------------------------
def _norm_position_sweep(tmp_path: Path, **train) -> SweepResults:
    """An OFAT sweep of norm position alone (like the default sweep's norm_position axis); every cell's config gets
    the `train` fields given."""
    root = make_synthetic_sweep(tmp_path / "np", axes={"norm_position": ["pre", "post"]}, partial=False,
                                problems=False, with_runs=False, noise=0.002)
    results = load_results(root)
    for point in results.plan["points"]:
        point["config"]["train"].update(train)
    return results


def _xiong_on_loss(effects: pd.DataFrame) -> pd.DataFrame:
    """postln-no-warmup (held: warmup=none) restated on our loss, so that only its held condition decides."""
    return effects[effects["effect_id"] == "postln-no-warmup"].assign(metric="cross-entropy")


def test_cells_with_warmup_are_not_compared_with_an_effect_published_without_it(tmp_path, effects):
    tested, untested = compare_effects(_norm_position_sweep(tmp_path, warmup_steps=30), _xiong_on_loss(effects))
    assert _by_id(tested, "postln-no-warmup").empty  # so not in the Holm family either
    assert untested["reason"].tolist() == ["published at warmup=none; this sweep's cells have train.warmup_steps=30"]


def test_cells_without_warmup_are_compared_and_say_they_hold_the_condition(tmp_path, effects):
    tested, untested = compare_effects(_norm_position_sweep(tmp_path, warmup_steps=0), _xiong_on_loss(effects))
    row = _by_id(tested, "postln-no-warmup")
    assert len(row) == 1 and untested.empty and row["holm_family"].iloc[0] == 1
    assert "published at warmup=none; this sweep does not vary warmup: its cells hold it (train.warmup_steps=0)" \
        in row["comparability"].iloc[0]


def test_a_condition_that_cannot_be_resolved_is_not_tested(tmp_path, effects):
    """The synthetic configs set no train.warmup_steps: a field left unset is not taken for a default."""
    tested, untested = compare_effects(_norm_position_sweep(tmp_path), _xiong_on_loss(effects))
    assert _by_id(tested, "postln-no-warmup").empty
    (reason,) = untested["reason"].tolist()
    assert reason.startswith("published at warmup=none; not checked: ") and "train.warmup_steps" in reason


def test_the_shipped_default_sweep_does_not_test_xiongs_no_warmup_effect(effects):
    """results/default trains every cell with 30 warm-up steps."""
    results = load_results(ROOT / "results" / "default")
    tested, untested = compare_effects(results, effects)
    assert "postln-no-warmup" not in set(tested["effect_id"])
    assert _by_id(untested, "postln-no-warmup")["reason"].tolist() == [
        "published at warmup=none; this sweep's cells have train.warmup_steps=30"]
    with_p = tested[tested["p_value"].notna()]  # one family member per test: the same cells and metric count once
    distinct = {(frozenset((r["our_baseline_label"], r["our_variant_label"])), r["our_metric"])
                for _, r in with_p.iterrows()}
    assert tested["holm_family"].iloc[0] == len(distinct) < len(with_p)
