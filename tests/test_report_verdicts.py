"""A report never says more than its data supports: the verdicts it draws and counts are the ones its tables give
after Holm's correction; a variant that blew up on a seed is never 'better' on the seeds it survived; a direction
nobody declared correctly is refused, not guessed; equal values have no interval, never '± 0'; every number of a
summary row is over the row's seeds; and a withdrawn disagreement is not relabelled 'consistent'.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
from matplotlib.colors import to_hex

matplotlib.use("Agg")

import study.report.figures as figures_module  # noqa: E402
from study.report import build_report  # noqa: E402
from study.report.collect import UndeclaredMetric, load_results  # noqa: E402
from study.report.compare import run_compare  # noqa: E402
from study.report.figures import VERDICT_COLOURS, make_figures  # noqa: E402
from study.report.stats import PairedDifference, mean_ci, paired_difference, summarize  # noqa: E402
from synthetic_sweep import make_synthetic_sweep  # noqa: E402

TWO_AXES = {"norm": ["rmsnorm", "layernorm"], "span": ["global", "local"]}
# paired differences of valid_loss per seed: each worse at 95% on its own (t-test p 0.029 and 0.039), neither after
# Holm over the report's two tests (the smaller p must be below 0.05 / 2)
WORSE_ALONE = {"norm=layernorm": [1.4, 2.0, 2.6], "span=local": [1.3, 2.0, 2.7]}


def _rewrite(root: Path, edit) -> Path:
    table = edit(pd.read_parquet(root / "results.parquet"))
    table.to_parquet(root / "results.parquet", index=False)
    (root / "results.csv").unlink(missing_ok=True)
    return root


def _sweep(tmp_path: Path, edit=None) -> Path:
    root = make_synthetic_sweep(tmp_path / "s", axes=TWO_AXES, partial=False, problems=False, with_runs=False)
    return _rewrite(root, edit) if edit else root


def worse_alone(t: pd.DataFrame) -> pd.DataFrame:
    """Two variants each worse at 95% on its own (p 0.029 and 0.039, three pairs), on the objective alone."""
    t = t.drop(columns=[c for c in t.columns if "_ppl_" in c])  # the objective alone: a family of two
    for label, diffs in WORSE_ALONE.items():
        for seed, x in enumerate(diffs):
            t.loc[(t["label"] == label) & (t["seed"] == seed), "metric.valid_loss"] = 1.0 + seed + x
    t.loc[t["label"] == "baseline", "metric.valid_loss"] = 1.0 + t["seed"].astype(float)
    return t


def _drawn_figures(monkeypatch) -> dict:
    """Capture every figure make_figures saves, by name."""
    drawn = {}
    save = figures_module.save_figure

    def keep(fig, directory, name, formats=("png", "svg")):
        drawn[name] = fig
        return save(fig, directory, name, formats)

    monkeypatch.setattr(figures_module, "save_figure", keep)
    return drawn


# -- 1. the headline figure and the glance show the verdicts after Holm -------------------------------------------
def test_the_paired_figure_colours_and_labels_a_variant_holm_withdraws_as_inconclusive(tmp_path, monkeypatch):
    results = load_results(_sweep(tmp_path, worse_alone))
    drawn = _drawn_figures(monkeypatch)
    make_figures(results, tmp_path / "out", formats=("png",), kinds=("paired",))
    fig = drawn["lm-valid_loss-paired-differences"]
    texts = [t.get_text() for t in fig.axes[0].texts]
    row_of = {t.get_text(): t.get_position()[1] for t in fig.axes[0].get_yticklabels()}
    for label in WORSE_ALONE:  # each variant's own label: the one on its row
        (text,) = [t.get_text() for t in fig.axes[0].texts if t.xy[1] == row_of[label]]
        assert text.startswith("inconclusive") and "n=3" in text, (label, text)
    assert not any(t.startswith("worse") for t in texts)
    colours = {to_hex(line.get_color()) for line in fig.axes[0].lines if line.get_marker() == "o"}
    assert colours == {to_hex(VERDICT_COLOURS["inconclusive"])}
    assert "after Holm" in fig.axes[0].get_title()


def _glance_counts(md: str) -> dict[str, int]:
    line = next(line for line in md.splitlines() if line.startswith("At a glance"))
    head = line.split(" of ", 1)[0]
    return {v: int(n) for n, v in re.findall(r"\*\*(\d+) ([a-z ]+)\*\*", head)}


def _holm_column_counts(md: str) -> dict[str, int]:
    """The counts of the last column ('Holm (family of m)') of the compare's first table."""
    lines = md.split("At a glance", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| effect |"))
    counts: dict[str, int] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cell = line.strip().strip("|").split("|")[-1].strip()
        counts[cell] = counts.get(cell, 0) + 1
    return counts


def test_the_compare_glance_counts_the_verdicts_after_holm(tmp_path):
    comparison = run_compare(load_results(_sweep(tmp_path, worse_alone)), tmp_path / "out")
    effects = comparison.effects
    withdrawn = effects[effects["verdict"].isin(["agree", "disagree"]) & (effects["holm_verdict"] == "inconclusive")]
    assert len(withdrawn), "the premise: an agree/disagree at 95% that Holm's correction withdraws"
    md = comparison.markdown.read_text()
    assert _glance_counts(md) == _holm_column_counts(md) == effects["holm_verdict"].value_counts().to_dict()


def test_the_default_studys_glance_agrees_with_its_holm_column(tmp_path, monkeypatch):
    repo = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(repo)
    md = run_compare(load_results(Path("results") / "default"), tmp_path / "out").markdown.read_text()
    assert _glance_counts(md) == _holm_column_counts(md)


# -- 2. a side that diverged is never the better one ----------------------------------------------------------------
def _diverged_table(base_diverged: bool = False) -> pd.DataFrame:
    """Baseline valid_loss on seeds 0-3, the variant lower on seeds 0-2 and diverged on seed 3 (or, mirrored, the
    variant higher and the baseline diverged on seed 3)."""
    base, var = [2.00, 2.10, 2.05, 2.02], [1.90, 2.00, 1.94]
    if base_diverged:
        base, var = [1.90, 2.00, 1.94], [2.00, 2.10, 2.05, 2.02]
    rows = [{"label": "baseline", "seed": s, "status": "completed", "m": v} for s, v in enumerate(base)]
    rows += [{"label": "variant", "seed": s, "status": "completed", "m": v} for s, v in enumerate(var)]
    side = "baseline" if base_diverged else "variant"
    rows.append({"label": side, "seed": 3, "status": "diverged", "m": math.nan})
    return pd.DataFrame(rows)


def test_a_variant_that_diverged_on_a_seed_the_baseline_finished_is_not_better():
    d = paired_difference(_diverged_table(), "m", "variant", "baseline", "minimize")
    assert d.diff.n == 3 and d.p_value < 0.01  # the surviving pairs alone would say better
    assert d.verdict != "better"
    assert d.divergence == "variant diverged on 1 of 4 seeds (the baseline did not diverge there)"


def test_a_baseline_that_diverged_on_a_seed_the_variant_finished_does_not_make_the_variant_worse():
    d = paired_difference(_diverged_table(base_diverged=True), "m", "variant", "baseline", "minimize")
    assert d.diff.n == 3 and d.p_value < 0.01
    assert d.verdict != "worse"
    assert "baseline diverged on 1 of 4 seeds" in d.divergence


def test_the_report_names_the_divergence_in_the_verdict_cell(tmp_path):
    def edit(t):
        t = t.drop(columns=[c for c in t.columns if "_ppl_" in c])
        t.loc[t["label"] == "baseline", "metric.valid_loss"] = 2.0 + 0.05 * t["seed"].astype(float)
        better = t["label"] == "span=local"
        t.loc[better, "metric.valid_loss"] = 1.9 + 0.05 * t.loc[better, "seed"].astype(float) \
            + t.loc[better, "seed"].map({0: 0.0, 1: 0.004, 2: -0.003})
        blew_up = better & (t["seed"] == 2)
        t.loc[blew_up, ["status", "diverged_at_step"]] = ["diverged", 120]
        t.loc[blew_up, "metric.valid_loss"] = math.nan
        return t

    out = build_report(_sweep(tmp_path, edit), tmp_path / "out", kinds=())
    md = out.markdown.read_text()
    row = [line for line in md.splitlines() if line.startswith("| span=local |")][1]
    assert "better" not in row and "variant diverged on 1 of 3 seeds" in row
    paired = pd.read_csv(out.out / "paired.csv").set_index("label")
    assert paired.loc["span=local", "verdict"] == paired.loc["span=local", "verdict_holm"] == "inconclusive"


# -- 3. a direction other than minimize / maximize is refused -------------------------------------------------------
def _edit_plan(root: Path, edit) -> Path:
    plan = json.loads((root / "plan.json").read_text())
    edit(plan)
    (root / "plan.json").write_text(json.dumps(plan))
    return root


def test_an_objective_declared_min_is_refused_naming_the_metric_the_file_and_the_valid_values(tmp_path):
    root = _edit_plan(_sweep(tmp_path), lambda plan: plan["objective"].update(direction="min"))
    with pytest.raises(UndeclaredMetric) as err:
        load_results(root)
    text = str(err.value)
    assert "valid_loss" in text and str(root / "plan.json") in text and "'minimize'" in text and "'maximize'" in text


def test_a_metric_declared_min_is_refused(tmp_path):
    root = _edit_plan(_sweep(tmp_path), lambda plan: plan["tasks"]["lm"]["metrics"]["valid_loss"].update(
        direction="min"))
    with pytest.raises(UndeclaredMetric, match="valid_loss"):
        load_results(root)


def test_a_verdict_with_an_unknown_direction_raises():
    d = paired_difference(_diverged_table().query("status == 'completed'"), "m", "variant", "baseline", "min")
    with pytest.raises(ValueError, match="min"):
        d.verdict  # noqa: B018


# -- 4. equal values have no interval -------------------------------------------------------------------------------
def test_three_equal_values_have_no_interval():
    ci = mean_ci([2.5, 2.5, 2.5])
    assert (ci.n, ci.mean, ci.sd) == (3, 2.5, 0.0) and not ci.has_ci
    assert math.isnan(ci.lo) and math.isnan(ci.hi) and math.isnan(ci.half_width)
    row = summarize(pd.DataFrame({"label": ["a"] * 3, "m": [2.5] * 3}), "m").iloc[0]
    assert math.isnan(row["ci_lo"]) and math.isnan(row["ci_hi"]) and math.isnan(row["ci_half"])


def test_the_report_says_no_spread_never_plus_minus_zero(tmp_path):
    def edit(t):
        t.loc[t["label"] == "span=local", "metric.valid_loss"] = 2.5
        return t

    md = build_report(_sweep(tmp_path, edit), tmp_path / "out", kinds=()).markdown.read_text()
    assert "± 0 " not in md and "± 0 |" not in md and "[2.5, 2.5]" not in md
    assert "| 2.5, no spread (3 equal values) | – |" in md


# -- 5. a summary row is one set of seeds ----------------------------------------------------------------------------
def test_an_extra_column_missing_on_a_seed_of_the_row_is_left_empty_not_averaged_over_fewer():
    table = pd.DataFrame({"label": ["a"] * 3, "m": [2.0, 2.1, 2.2], "x": [10.0, math.nan, 40.0]})
    row = summarize(table, "m", extra=["x"]).iloc[0]
    assert row["n"] == 3 and math.isnan(row["x"])
    full = summarize(table.assign(x=[10.0, 20.0, 40.0]), "m", extra=["x"]).iloc[0]
    assert full["x"] == pytest.approx(70 / 3)


def test_the_summary_table_leaves_a_cost_one_seed_lacks_empty_and_says_why(tmp_path):
    def edit(t):
        t.loc[(t["label"] == "span=local") & (t["seed"] == 1), "cost.train_tokens_per_s"] = math.nan
        return t

    md = build_report(_sweep(tmp_path, edit), tmp_path / "out", kinds=()).markdown.read_text()
    table = md.split("| variant | n / planned |", 1)[1]
    header = "| variant | n / planned |" + table.split("\n", 1)[0]
    column = [h.strip() for h in header.strip("|").split("|")].index("train tokens/s")
    row = [line for line in table.splitlines() if line.startswith("| span=local |")][0]
    assert [c.strip() for c in row.strip("|").split("|")][column] == "–"
    assert "a seed of the row has no value of that column" in md


# -- 6. a withdrawn disagreement with a published 'same' is not 'consistent' ---------------------------------------
def test_a_disagreement_holm_withdraws_is_inconclusive_even_where_the_publication_reports_no_difference():
    from study.report.compare import add_holm

    tested = pd.DataFrame({"our_baseline_label": ["baseline", "baseline"], "our_variant_label": ["a", "b"],
                           "our_metric": ["valid_loss", "valid_loss"], "p_value": [0.03, 0.04],
                           "published_direction": ["same", "better"], "verdict": ["disagree", "disagree"]})
    holm = add_holm(tested)  # two tests: 0.03 x 2 and 0.04 x 1 (carried up to 0.06) are not below 0.05
    assert holm["holm_verdict"].tolist() == ["inconclusive", "inconclusive"]


def test_effects_that_are_one_paired_test_count_once_in_the_holm_family(tmp_path, monkeypatch):
    repo = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(repo)
    effects = run_compare(load_results(Path("results") / "default"), tmp_path / "out").effects.set_index("effect_id")
    lm, mt = effects.loc["mqa-vs-mha-lm"], effects.loc["mqa-vs-mha-mt"]
    assert (lm["our_variant_label"], lm["our_metric"]) == (mt["our_variant_label"], mt["our_metric"])
    assert lm["holm_p"] == mt["holm_p"]
    tests = {(frozenset((r["our_baseline_label"], r["our_variant_label"])), r["our_metric"])
             for _, r in effects[effects["p_value"].notna()].iterrows()}
    assert int(effects["holm_family"].iloc[0]) == len(tests)


def test_a_paired_difference_without_divergence_says_nothing_of_it():
    d = paired_difference(_diverged_table().query("status == 'completed'"), "m", "variant", "baseline")
    assert d.divergence == "" and d.verdict == "better"
    assert isinstance(d, PairedDifference)
