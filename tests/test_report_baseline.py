"""study.report: the baseline is the planned baseline point as it ran. A baseline trial whose resolved config differs
from the plan is relabelled by what ran (study.sweep.results.trial_row) and is a variant of its own: it never defines
the baseline, never joins its pairs, and never stands in for it. Directions, the per-GLUE-task ones included, come
from the task's declarations."""

from __future__ import annotations

import json

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

from study.report import build_report  # noqa: E402
from study.report.collect import load_results  # noqa: E402
from study.report.stats import paired_differences  # noqa: E402
from synthetic_sweep import GLUE_TASKS, make_nsp_glue_sweep, make_synthetic_sweep  # noqa: E402

AXES = {"norm": ["rmsnorm", "layernorm"], "position": ["rope", "alibi"]}
OFF_PLAN = "baseline (ran: norm=layernorm)"


def _sweep_with_baseline_off_plan(root, seeds_off: tuple[int, ...], csv_only: bool = False):
    """A complete sweep in which the baseline point's `seeds_off` trials ran norm=layernorm: their rows as
    study.sweep.results.trial_row writes them (relabelled by what ran, is_baseline kept, ran_as_planned false)."""
    root = make_synthetic_sweep(root, axes=AXES, partial=False, problems=False, with_runs=False)
    table = pd.read_parquet(root / "results.parquet")
    off = (table["label"] == "baseline") & table["seed"].isin(seeds_off)
    assert off.sum() == len(seeds_off)
    table.loc[off, ["label", "axis.norm", "ran_as_planned"]] = [OFF_PLAN, "layernorm", False]
    table.to_csv(root / "results.csv", index=False)
    if csv_only:  # results.csv's ran_as_planned is read back from text
        (root / "results.parquet").unlink()
    else:
        table.to_parquet(root / "results.parquet", index=False)
    return root


def _paired(results) -> pd.DataFrame:
    done = results.completed("lm")
    return paired_differences(done, "metric.valid_loss", results.baseline_label, results.labels_for("lm"),
                              "minimize").set_index("label")


@pytest.mark.parametrize("csv_only", [False, True])
def test_a_baseline_trial_that_ran_off_plan_is_its_own_variant_not_the_baseline(tmp_path, csv_only):
    r = load_results(_sweep_with_baseline_off_plan(tmp_path / "s", seeds_off=(0,), csv_only=csv_only))
    assert r.baseline_label == "baseline"
    assert r.variant_order[0] == "baseline" and OFF_PLAN in r.variant_order
    assert r.baseline_values() == {"norm": "rmsnorm", "position": "rope"}  # the plan's, not what seed 0 ran
    paired = _paired(r)
    # the baseline is its two planned seeds, which pair every variant; the off-plan trial is a variant of its own,
    # whose seed (0) the baseline lacks
    assert "baseline" not in paired.index
    assert paired.loc["norm=layernorm", "n_pairs"] == 2 and paired.loc["norm=layernorm", "seeds"] == "1,2"
    assert paired.loc[OFF_PLAN, "n_pairs"] == 0 and paired.loc[OFF_PLAN, "verdict"] == "no pairs"


def test_the_report_pairs_against_the_planned_baseline_and_lists_the_off_plan_trial(tmp_path):
    root = _sweep_with_baseline_off_plan(tmp_path / "s", seeds_off=(0,))
    out = build_report(root, tmp_path / "out", kinds=())
    md = out.markdown.read_text()
    assert "### Paired differences against the baseline (baseline)" in md
    assert f"they are listed under the label of what ran: {OFF_PLAN}." in md
    paired = pd.read_csv(out.out / "paired.csv").query("metric == 'valid_loss'").set_index("label")
    assert "baseline" not in paired.index and paired.loc[OFF_PLAN, "n_pairs"] == 0
    assert paired.loc["position=alibi", "n_pairs"] == 2 and paired.loc["position=alibi", "seeds"] == "1,2"


def test_when_no_baseline_trial_ran_as_planned_nothing_stands_in_for_it(tmp_path):
    root = _sweep_with_baseline_off_plan(tmp_path / "s", seeds_off=(0, 1, 2))
    r = load_results(root)
    assert r.baseline_label == "baseline" and r.variant_order[0] == "baseline"  # the planned point, with no trials
    paired = _paired(r)
    assert (paired["n_pairs"] == 0).all() and set(paired["verdict"]) == {"no pairs"}
    assert OFF_PLAN in paired.index  # still reported, as the variant it is
    out = build_report(root, tmp_path / "out", kinds=())
    assert "### Paired differences against the baseline (baseline)" in out.markdown.read_text()
    assert (pd.read_csv(out.out / "paired.csv")["n_pairs"] == 0).all()


def test_per_glue_task_verdicts_follow_the_declared_direction_of_the_task_score(tmp_path):
    """The fixture's NSP adds 3 points to every task: without NSP is *worse* when a score is declared higher-better
    (test_report.py checks that) and *better* when the same score is declared lower-better, as here."""
    root = make_nsp_glue_sweep(tmp_path / "nsp", nsp_effect=3.0)
    plan = json.loads((root / "plan.json").read_text())
    assert plan["tasks"]["glue"]["metrics"]["*/score"]["direction"] == "maximize"
    plan["tasks"]["glue"]["metrics"]["*/score"]["direction"] = "minimize"
    (root / "plan.json").write_text(json.dumps(plan))
    md = build_report(root, tmp_path / "out", kinds=()).markdown.read_text()
    per_task = md[md.index("### Per GLUE task"):]
    paired = per_task[per_task.index("| task | variant | pairs | Δ score"):].split("\n\n")[0]
    assert paired.count("**better**") == len(GLUE_TASKS) and "**worse**" not in paired


@pytest.mark.parametrize("csv_only", [False, True])
def test_an_off_plan_trial_never_takes_the_planned_variants_place_in_the_per_axis_figures(tmp_path, csv_only):
    """Baseline seed 0 ran norm=layernorm: its row came first and stood for "layernorm" in every per-axis figure,
    where the planned three-seed point norm=layernorm vanished."""
    r = load_results(_sweep_with_baseline_off_plan(tmp_path / "s", seeds_off=(0,), csv_only=csv_only))
    assert r.axis_labels("norm") == [("rmsnorm", "baseline"), ("layernorm", "norm=layernorm")]


def test_axis_values_read_from_results_csv_are_the_plans_labels(tmp_path):
    """Without results.parquet the table is read from results.csv, whose type guessing read `true` as True: the
    baseline's value matched no plan value, and it was no longer first in its axis's figure."""
    root = make_nsp_glue_sweep(tmp_path / "s")
    from_parquet = load_results(root)
    (root / "results.parquet").unlink()
    from_csv = load_results(root)
    assert list(from_csv.table["axis.nsp"]) == list(from_parquet.table["axis.nsp"])
    assert from_csv.axis_labels("nsp") == [("true", "baseline"), ("false", "nsp=false")]
