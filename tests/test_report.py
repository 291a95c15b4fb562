"""study.report: statistics against hand-computed values (intervals, paired t-tests, Holm's correction, the minimum
detectable difference), directions and scales read from the declarations (never guessed, never another column),
figures from a synthetic results table, the report's lists of failed and missing trials, the partial-sweep banner,
and the command line."""

from __future__ import annotations

import json
import math
import re

import matplotlib
import numpy as np
import pandas as pd
import pytest

matplotlib.use("Agg")

from study.report import build_report  # noqa: E402
from study.report.cli import main  # noqa: E402
from study.report.collect import UndeclaredMetric, load_results  # noqa: E402
from study.report.figures import (  # noqa: E402
    BASELINE_COLOUR,
    make_figures,
    metric_label,
    plot_curves,
    plot_extrapolation,
    plot_grad_norms,
    plot_metric_by_variant,
    variant_palette,
)
from study.report.markdown import secondary_columns  # noqa: E402
from study.report.stats import (  # noqa: E402
    holm_adjust,
    holm_reject,
    mean_ci,
    minimum_detectable_difference,
    paired_difference,
    paired_t_pvalue,
    pareto_front,
    summarize,
    t_critical,
)
from synthetic_sweep import DECLARED, make_pretrain_sweep, make_synthetic_sweep  # noqa: E402

SMALL_AXES = {"norm_position": ["pre", "post"], "position": ["rope", "alibi", "learned"], "attention": ["mha", "mqa"]}
# 1 baseline + 1 + 2 + 1 variants; with partial=True the last (attention=mqa) never ran.
T975 = {2: 12.706204736174707, 3: 4.302652729911275, 4: 3.182446305284263}  # t_{0.975, n-1}, from tables


@pytest.fixture(scope="module")
def partial_sweep(tmp_path_factory):
    return make_synthetic_sweep(tmp_path_factory.mktemp("partial"), axes=SMALL_AXES, partial=True, problems=True)


@pytest.fixture(scope="module")
def report(partial_sweep, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return build_report(partial_sweep, out, formats=("png",))


# -- statistics --------------------------------------------------------------------------------------------------------
def test_t_critical_values_match_the_tables():
    for n, t in T975.items():
        assert t_critical(n) == pytest.approx(t, rel=1e-9)


def test_mean_ci_matches_hand_computation():
    ci = mean_ci([1.0, 2.0, 3.0, 4.0])
    sd = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 3)  # 1.2910
    half = T975[4] * sd / 2
    assert (ci.n, ci.mean, ci.sd) == (4, 2.5, pytest.approx(sd))
    assert (ci.lo, ci.hi) == (pytest.approx(2.5 - half), pytest.approx(2.5 + half))
    assert half == pytest.approx(2.0542, abs=1e-4)


def test_mean_ci_single_value_has_no_interval_and_ignores_nan():
    one = mean_ci([3.0, float("nan"), None])
    assert one.n == 1 and one.mean == 3.0 and not one.has_ci and math.isnan(one.lo)
    none = mean_ci([])
    assert none.n == 0 and math.isnan(none.mean)


def _table(values: dict[str, dict[int, float]]) -> pd.DataFrame:
    return pd.DataFrame([{"label": label, "seed": s, "m": v} for label, per in values.items() for s, v in per.items()])


def test_paired_difference_pairs_by_seed_and_matches_hand_computation():
    # seed 3 only in the baseline and seed 9 only in the variant: both left out of the pairs
    t = _table({"base": {0: 1.0, 1: 2.0, 2: 3.0, 3: 7.0}, "var": {0: 1.5, 1: 2.1, 2: 3.9, 9: 0.0}})
    d = paired_difference(t, "m", "var", "base", "minimize")
    diffs = [0.5, 0.1, 0.9]  # mean 0.5, sd 0.4
    half = T975[3] * 0.4 / math.sqrt(3)  # 0.99366
    assert d.seeds == (0, 1, 2)
    assert d.diff.mean == pytest.approx(np.mean(diffs))
    assert (d.diff.lo, d.diff.hi) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))
    assert d.verdict == "inconclusive"  # the interval [-0.49, 1.49] contains zero


def test_paired_verdicts_follow_the_direction_and_the_interval():
    t = _table({"base": {0: 1.0, 1: 2.0, 2: 3.0}, "var": {0: 1.2, 1: 2.21, 2: 3.19}})  # +0.2 +- tiny
    assert paired_difference(t, "m", "var", "base", "minimize").verdict == "worse"
    assert paired_difference(t, "m", "var", "base", "maximize").verdict == "better"
    one = _table({"base": {0: 1.0}, "var": {0: 5.0}})
    assert paired_difference(one, "m", "var", "base").verdict == "no CI (n=1)"
    assert paired_difference(one, "m", "missing", "base").verdict == "no pairs"


def test_summarize_keeps_variants_without_runs():
    t = _table({"a": {0: 1.0, 1: 3.0}})
    s = summarize(t, "m", order=["a", "b"])
    assert list(s["n"]) == [2, 0]
    assert s.loc[0, "ci_half"] == pytest.approx(T975[2] * math.sqrt(2) / math.sqrt(2))
    assert math.isnan(s.loc[1, "mean"])


def test_pareto_front():
    # cost (lower better), loss (lower better): (1, 3) (2, 2) (3, 1) on the front; (3, 3) dominated; NaN never
    front = pareto_front([1, 2, 3, 3, np.nan], [3, 2, 1, 3, 0], "lower", "lower")
    assert list(front) == [True, True, True, False, False]
    # throughput: higher is better
    assert list(pareto_front([10, 5], [1.0, 1.0], "higher", "lower")) == [True, False]


def test_paired_t_pvalue_matches_hand_computation():
    # diffs [0.5, 0.1, 0.9]: mean 0.5, sd 0.4, t = 0.5 / (0.4 / sqrt 3) = 2.1651; with 2 degrees of freedom the t
    # distribution's CDF is 1/2 + t / (2 sqrt(t^2 + 2)), so the two-sided p is 1 - t / sqrt(t^2 + 2) = 0.16278
    d = mean_ci([0.5, 0.1, 0.9])
    t = 0.5 / (0.4 / math.sqrt(3))
    assert paired_t_pvalue(d) == pytest.approx(1 - t / math.sqrt(t**2 + 2))
    assert paired_t_pvalue(d) == pytest.approx(0.16278, abs=1e-5)
    from scipy import stats

    assert paired_t_pvalue(d) == pytest.approx(stats.ttest_1samp([0.5, 0.1, 0.9], 0.0).pvalue)
    assert math.isnan(paired_t_pvalue(mean_ci([1.0])))  # one pair: no test


def test_holm_matches_hand_computation():
    # sorted 0.01, 0.03, 0.04, 0.5 times 4, 3, 2, 1 = 0.04, 0.09, 0.08 -> 0.09 (running max), 0.5
    assert holm_adjust([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert holm_reject([0.01, 0.04, 0.03, 0.5]) == [True, False, False, False]  # at 0.05 only the first
    # untested effects (NaN) are not in the family: m = 2 here, and the adjusted value is capped at 1
    adjusted = holm_adjust([0.02, float("nan"), 0.8])
    assert adjusted[0] == pytest.approx(0.04) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.8)
    assert holm_adjust([0.6, 0.7]) == pytest.approx([1.0, 1.0])


def test_minimum_detectable_difference_matches_hand_computation():
    from scipy import stats

    expected = (stats.t.ppf(0.975, 2) + stats.t.ppf(0.8, 2)) / math.sqrt(3)
    assert minimum_detectable_difference(1.0, 3) == pytest.approx(expected)
    assert expected == pytest.approx((4.302653 + 1.060660) / math.sqrt(3), abs=1e-5)  # t tables: 3.0965
    assert minimum_detectable_difference(2.0, 3) == pytest.approx(2 * expected)  # linear in sd
    assert math.isnan(minimum_detectable_difference(1.0, 1))
    assert math.isnan(minimum_detectable_difference(float("nan"), 3))
    t = _table({"base": {0: 1.0, 1: 2.0, 2: 3.0}, "var": {0: 1.5, 1: 2.1, 2: 3.9}})  # diffs sd 0.4
    assert paired_difference(t, "m", "var", "base").mde == pytest.approx(0.4 * expected)


# -- collect -----------------------------------------------------------------------------------------------------------
def test_collect_adds_never_run_trials_from_the_plan(partial_sweep):
    r = load_results(partial_sweep)
    assert r.is_partial
    missing = r.table[r.table["label"] == "attention=mqa"]
    assert len(missing) == 3 and set(missing["status"]) == {"pending"}
    assert r.status_counts["failed"] == 1 and r.status_counts["diverged"] == 1 and r.status_counts["running"] == 1
    assert r.axis_labels("position") == [("rope", "baseline"), ("alibi", "position=alibi"),
                                         ("learned", "position=learned")]
    assert r.objective("lm") == ("valid_loss", "minimize")
    # Tiny Shakespeare has no test split: perplexity at 2x the training length (64 -> 128) is the validation
    # split's, as the record names it (the report computes nothing of its own); learned positions have none
    assert not [c for c in r.table.columns if c.startswith("metric.test_")]
    learned = r.completed().query("label == 'position=learned'")
    assert learned["metric.valid_ppl_at_2x"].isna().all()
    base = r.completed().query("label == 'baseline'")
    assert (base["metric.valid_ppl_at_2x"] == base["metric.valid_ppl_by_length.128"]).all()


def test_collect_reads_csv_only_and_plan_only(tmp_path):
    root = make_synthetic_sweep(tmp_path / "s", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False)
    (root / "results.parquet").unlink()
    r = load_results(root)
    assert r.source == "results.csv" and not r.is_partial
    (root / "results.csv").unlink()
    r = load_results(root)
    assert r.source == "plan.json only" and set(r.table["status"]) == {"pending"} and len(r.table) == 6
    with pytest.raises(FileNotFoundError):
        load_results(tmp_path / "nowhere")


# -- figures -----------------------------------------------------------------------------------------------------------
def test_figures_exist_and_are_not_empty(report):
    kinds = {f.kind for f in report.figures}
    assert {"metric", "curves", "cost", "extrapolation", "grad_norms"} <= kinds
    assert all(f.paths for f in report.figures)  # every run directory is there: every figure drawn
    for f in report.figures:
        for p in f.paths:
            assert p.is_file() and p.stat().st_size > 1000, p
        assert f.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figures_are_written_as_png_and_svg_by_default(tmp_path):
    root = make_synthetic_sweep(tmp_path / "s", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False, seeds=(0, 1))
    figs = make_figures(load_results(root), tmp_path / "out", kinds=("metric",))
    assert len(figs) == 2 and all(sorted(p.suffix for p in f.paths) == [".png", ".svg"] for f in figs)
    for f in figs:
        svg = f.paths[1].read_text()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg


def test_figures_draw_the_expected_series(report):
    by_name = {f.name: f for f in report.figures}
    # attention=mqa never ran: 4 of the 5 variants have data
    assert by_name["lm-valid_loss-all-variants"].series == ["baseline", "norm_position=post", "position=alibi",
                                                            "position=learned"]
    assert by_name["lm-valid_loss-by-position"].n_series == 3
    assert by_name["lm-valid_loss-by-attention"].series == ["baseline"]
    assert by_name["lm-extrapolation"].n_series == 3
    assert by_name["lm-grad-norms-norm_position"].series == ["baseline", "norm_position=post"]
    assert by_name["lm-curves-position"].n_series == 3
    assert by_name["lm-valid_loss-vs-cost"].n_series == 4


def test_metric_figure_artists(partial_sweep):
    r = load_results(partial_sweep)
    palette = variant_palette(r.variant_order, r.baseline_label)
    variants = r.axis_labels("position")
    ylabel = metric_label("metric.valid_loss", r.declared("valid_loss", "lm").scale)
    fig = plot_metric_by_variant(r.completed(), variants, "metric.valid_loss", palette, "t", baseline="baseline",
                                 ylabel=ylabel)
    ax = fig.axes[0]
    assert len(ax.containers) == 3  # one error bar per variant
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rope\n(baseline)", "alibi", "learned"]
    # the error bar is the 95% t interval of the baseline's seeds
    base = r.completed().query("label == 'baseline'")["metric.valid_loss"]
    ci = mean_ci(base)
    seg = ax.containers[0].lines[2][0].get_segments()[0]
    assert (seg[0][1], seg[1][1]) == (pytest.approx(ci.lo), pytest.approx(ci.hi))
    assert ax.get_ylabel() == "valid_loss (nats/token)"  # the declared scale


def test_curves_extrapolation_and_grad_norm_artists(partial_sweep):
    r = load_results(partial_sweep)
    palette = variant_palette(r.variant_order, r.baseline_label)
    labels = [lbl for _, lbl in r.axis_labels("position")]
    rows = r.table[r.table["status"].isin(["completed", "diverged"])]
    fig = plot_curves(r, rows, labels, palette, "t")
    train_ax, val_ax = fig.axes[:2]
    for ax in (train_ax, val_ax):  # a mean per variant, alibi's diverged seed 0 dashed after its mean
        assert [ln.get_linestyle() for ln in ax.get_lines()] == ["-", "-", "--", "-"]
    # colours: the same label has the same colour here and in the palette; the baseline is dark grey
    assert matplotlib.colors.to_rgb(val_ax.get_lines()[0].get_color()) == pytest.approx(BASELINE_COLOUR)
    assert matplotlib.colors.to_rgb(val_ax.get_lines()[1].get_color()) == pytest.approx(palette["position=alibi"])

    fig = plot_extrapolation(r.completed(), r.axis_labels("position"), palette, "t", train_len=64)
    lines = [ln for ln in fig.axes[0].get_lines() if len(ln.get_xdata()) > 1 or ln.get_marker() == "o"]
    xs = {ln.get_label().split(" ")[0]: list(ln.get_xdata()) for ln in lines if not ln.get_label().startswith("_")}
    assert xs["rope"] == [64, 128, 256, 512] and xs["learned"] == [64]  # learned stops at its table

    fig = plot_grad_norms(r, rows, r.axis_labels("norm_position"), palette, "t")
    init = fig.axes[0]
    assert len(init.get_lines()) == 2 and len(init.get_xticks()) == 4  # 4 decoder layers
    post = [ln for ln in init.get_lines() if ln.get_label().startswith("post")][0]
    assert post.get_ydata()[-1] > post.get_ydata()[0]  # the synthetic post-norm grows toward the output


def test_palette_is_stable_and_distinct():
    labels = ["baseline", *[f"a={i}" for i in range(12)]]
    p1, p2 = variant_palette(labels, "baseline"), variant_palette(labels, "baseline")
    assert p1 == p2 and p1["baseline"] == BASELINE_COLOUR
    assert len({p1[lbl] for lbl in labels}) == len(labels)


def test_grid_design_gets_a_heatmap(tmp_path):
    root = make_synthetic_sweep(tmp_path / "g", design="grid", partial=False, problems=False, with_runs=False)
    r = load_results(root)
    figs = make_figures(r, tmp_path / "out", formats=("png",), kinds=("heatmap", "curves"))
    heat = [f for f in figs if f.kind == "heatmap"]
    assert len(heat) == 1 and heat[0].n_series == 6  # 2 norm positions x 3 position schemes
    curves = [f for f in figs if f.kind == "curves"]  # no run directories: no curves, no failure, and a reason
    assert curves and all(not f.paths and "no logged curves" in f.reason for f in curves)


def test_a_clean_clone_draws_the_curves_from_the_committed_curves_file(tmp_path):
    """No run directory is committed; results/<sweep>/curves.parquet (written by `study results`) holds the curves,
    and the report draws the same curve and gradient-norm figures from it."""
    import shutil

    from study.sweep.results import curves_table

    root = make_synthetic_sweep(tmp_path / "s", partial=False, problems=False, seeds=(0, 1))
    with_runs = load_results(root)
    kinds = ("curves", "grad_norms")
    drawn = make_figures(with_runs, tmp_path / "a", formats=("png",), kinds=kinds)
    curves_table(with_runs.table, root).to_parquet(root / "curves.parquet", index=False)
    shutil.rmtree(root / "runs")
    clone = load_results(root)
    redrawn = make_figures(clone, tmp_path / "b", formats=("png",), kinds=kinds)
    assert [(f.name, f.series) for f in redrawn] == [(f.name, f.series) for f in drawn]
    assert all(f.paths for f in redrawn) and len(redrawn) >= 3
    row = clone.table.iloc[0]
    pd.testing.assert_frame_equal(clone.curves(row)[with_runs.curves(row).columns], with_runs.curves(row),
                                  check_dtype=False)


def test_a_report_removes_stale_figures_and_names_those_it_cannot_draw(tmp_path):
    root = make_synthetic_sweep(tmp_path / "s", partial=False, problems=False, with_runs=False, seeds=(0, 1))
    stale = tmp_path / "out" / "figures" / "lm-curves-renamed-axis.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    stale.with_suffix(".svg").write_bytes(b"old")
    (tmp_path / "out" / "report.md").write_text("![curves](figures/lm-curves-renamed-axis.png)\n")  # the earlier report
    mine = [stale.parent / "mine.png", stale.parent / "notes.txt"]  # a user's own files: never a report's to remove
    for p in mine:
        p.write_bytes(b"mine")
    output = build_report(root, tmp_path / "out", formats=("png",))
    assert not stale.exists() and not stale.with_suffix(".svg").exists()
    assert sorted(p.name for p in stale.parent.iterdir()) == sorted(
        [p.name for f in output.figures for p in f.paths] + ["mine.png", "notes.txt"])
    md = output.markdown.read_text()
    not_drawn = md.split("Figures not drawn, and why:", 1)[1]
    assert "training and validation curves, position (lm): no logged curves" in not_drawn
    assert "per-layer gradient norms, post- vs pre-norm (lm): no logged curves" in not_drawn


# -- report.md / report.html -------------------------------------------------------------------------------------------
def test_report_lists_failed_diverged_running_and_never_run_trials(report):
    md = report.markdown.read_text()
    section = md.split("## Trials that did not complete", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    statuses = [row.split("|")[3].strip() for row in rows]
    assert statuses == ["failed", "diverged", "running", "pending", "pending", "pending"]
    assert "RuntimeError: out of memory" in section and "Traceback" not in section  # first line of the error only
    assert section.count("attention=mqa") == 3 and "never ran" in section
    assert "| norm_position=post | 2 | failed |" in section


def test_report_has_partial_banner_tables_and_links_every_figure(report):
    md = report.markdown.read_text()
    assert "**Partial results: this sweep is still running or incomplete.**" in md
    assert "9 of 15 planned trials completed" in md
    assert "| attention=mqa | 0 / 3 | no completed run |" in md
    # paired difference row: alibi diverged on seed 0, so it pairs on seeds 1 and 2 only
    assert re.search(r"\| position=alibi \| 2 \(seeds 1,2\) \| [-+]", md)
    for f in report.figures:
        for p in f.paths:
            assert f"({p.relative_to(report.out).as_posix()})" in md
    html = report.html.read_text()
    assert html.startswith("<!DOCTYPE html>") and "<table>" in html
    srcs = re.findall(r'<img src="([^"]+)"', html)
    assert srcs and all((report.out / s).is_file() for s in srcs)
    assert (report.out / "summary.csv").is_file() and (report.out / "paired.csv").is_file()


def test_report_statistics_match_the_table(report, partial_sweep):
    paired = pd.read_csv(report.out / "paired.csv")
    r = load_results(partial_sweep)
    done = r.completed()
    b = done.query("label == 'baseline'").set_index("seed")["metric.valid_loss"]
    v = done.query("label == 'position=alibi'").set_index("seed")["metric.valid_loss"]
    diffs = (v - b).dropna()
    row = paired[paired["metric"] == "valid_loss"].set_index("label").loc["position=alibi"]
    assert row["diff"] == pytest.approx(diffs.mean())
    # every table of Holm's family is in the file, so its adjustment can be checked from it
    assert set(paired["metric"]) == {"valid_loss", "valid_ppl_at_2x"}
    assert paired["p_value"].notna().sum() == paired["holm_family"].iloc[0]
    half = T975[len(diffs)] * diffs.std(ddof=1) / math.sqrt(len(diffs))
    assert (row["ci_lo"], row["ci_hi"]) == (pytest.approx(diffs.mean() - half), pytest.approx(diffs.mean() + half))


def test_complete_sweep_has_no_banner(tmp_path):
    root = make_synthetic_sweep(tmp_path / "c", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False, problems=False,
                                with_runs=False, seeds=(0,))
    out = build_report(root, tmp_path / "out", kinds=())
    md = out.markdown.read_text()
    assert "Partial results" not in md and "Every planned trial completed." in md
    assert "no confidence interval can be computed" in md and "no CI (n=1)" in md


def test_report_survives_all_nan_metrics_and_missing_costs(tmp_path):
    root = make_synthetic_sweep(tmp_path / "n", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False)
    t = pd.read_parquet(root / "results.parquet")
    t["metric.valid_loss"] = np.nan
    t = t.drop(columns=[c for c in t.columns if c.startswith("cost.")])
    t.to_parquet(root / "results.parquet")
    out = build_report(root, tmp_path / "out", formats=("png",), kinds=("metric", "cost"))
    assert "## Trials" in out.markdown.read_text()


# -- command line ------------------------------------------------------------------------------------------------------
def test_cli_report_and_compare(tmp_path, capsys):
    root = make_synthetic_sweep(tmp_path / "s", axes={"attention": ["mha", "mqa"]}, with_runs=False)
    assert main(["report", str(root), "--out", str(tmp_path / "r"), "--formats", "png"]) == 0
    assert "partial" in capsys.readouterr().out
    assert (tmp_path / "r" / "report.md").is_file()
    assert main(["compare", str(root), "--no-runs", "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "compare.md").is_file()
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "study report:" in capsys.readouterr().err


def test_add_commands_registers_on_a_parent_parser():
    import argparse

    from study.report.cli import add_commands

    parser = argparse.ArgumentParser(prog="study")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compare", "results/x", "--runs", "a.json", "b.json"])
    assert args.command == "compare" and args.runs == ["a.json", "b.json"] and callable(args.func)


def test_a_sweeps_comparison_is_the_sweeps_alone_unless_runs_are_named(tmp_path, monkeypatch):
    """So `make compare` regenerates a study's committed compare.md whatever else bench/results holds."""
    import argparse

    from study.report.cli import _runs, add_commands

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "run-x.json").write_text("{}")
    parser = argparse.ArgumentParser(prog="study")
    add_commands(parser.add_subparsers(dest="command", required=True))
    assert _runs(parser.parse_args(["compare", "results/x"]))[0] == []
    assert _runs(parser.parse_args(["compare", "results/x", "--runs", "bench/results/run-*.json"]))[0] == \
        ["bench/results/run-x.json"]
    assert _runs(parser.parse_args(["compare", "--runs", "bench/results/run-*.json"])) == \
        (["bench/results/run-x.json"], set())  # (a pattern's matches are read as the default's: none is named)


# -- declarations: never guessed, never another column -----------------------------------------------------------
def test_declarations_of_the_fixture_are_the_task_families():
    """The synthetic plan.json carries the task families' own declarations (skipped where study.tasks does not
    import, e.g. mid-refactor)."""
    try:
        from study.tasks import family
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"study.tasks does not import: {err}")
    def kept(d: dict) -> tuple:
        return d["direction"], d["scale"], d["objective"], tuple(d.get("defined_by", ()))

    for task, declared in DECLARED.items():
        assert {k: kept(v) for k, v in declared.items()} == {k: kept(v) for k, v in family(task).declared().items()}


def test_directions_and_scales_come_from_the_declarations(partial_sweep):
    r = load_results(partial_sweep)
    assert r.declared("valid_ppl_by_length.256", "lm").declared_as == "*_ppl_by_length.*"  # a pattern
    assert not r.declared("valid_ppl_by_length.256", "lm").objective
    kv = r.declared("cost.kv_cache_bytes_per_token")
    assert (kv.direction, kv.scale, kv.by_construction) == ("minimize", "bytes/token", True)
    assert not r.declared("cost.train_tokens_per_s").by_construction
    # a name that sounds like a loss is not declared by sounding like one
    assert r.declaration("metric.mystery_loss", "lm") is None
    with pytest.raises(UndeclaredMetric, match="no declaration"):
        r.declared("metric.mystery_loss", "lm")


def test_undeclared_columns_are_marked_not_ranked(tmp_path):
    root = make_synthetic_sweep(tmp_path / "u", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False)
    t = pd.read_parquet(root / "results.parquet")
    t["metric.mystery_loss"] = 1.0
    t.to_parquet(root / "results.parquet")
    md = build_report(root, tmp_path / "out", kinds=()).markdown.read_text()
    assert "direction not declared" in md and "`mystery_loss`" in md
    assert "mystery_loss (" not in md  # never a column of the summary with a guessed direction


@pytest.fixture(scope="module")
def pretrain_sweep(tmp_path_factory):
    return make_pretrain_sweep(tmp_path_factory.mktemp("pretrain"))


def test_pretrain_report_uses_the_declared_objective_never_a_count(pretrain_sweep, tmp_path):
    r = load_results(pretrain_sweep)
    assert r.objective("pretrain") == ("valid_mlm_loss", "minimize")
    done = r.completed("pretrain")
    secondary = [c for c, _ in secondary_columns(r, "pretrain", done, "metric.valid_mlm_loss")]
    assert "metric.valid_masked_tokens" not in secondary and "metric.valid_nsp_pairs" not in secondary
    out = build_report(pretrain_sweep, tmp_path / "out", formats=("png",), kinds=("metric",))
    md = out.markdown.read_text()
    assert "**valid_mlm_loss** (nats/masked token; lower is better" in md
    assert "valid_masked_tokens" not in md and "+694" not in md
    assert set(pd.read_csv(out.out / "paired.csv")["metric"]) == {"valid_mlm_loss"}
    assert [f.name for f in out.figures][0] == "pretrain-valid_mlm_loss-all-variants"


def _rewrite_plan(root, **objective):
    plan = json.loads((root / "plan.json").read_text())
    plan["objective"].update(objective)
    (root / "plan.json").write_text(json.dumps(plan))


def test_an_undeclared_or_bookkeeping_objective_is_an_error_not_a_fallback(tmp_path):
    root = make_pretrain_sweep(tmp_path / "p", with_runs=False)
    _rewrite_plan(root, metric="valid_loss")  # pretraining writes no valid_loss: no other column stands in
    with pytest.raises(UndeclaredMetric, match="valid_loss"):
        load_results(root).objective("pretrain")
    _rewrite_plan(root, metric="valid_masked_tokens")  # declared objective: false (a count)
    with pytest.raises(UndeclaredMetric, match="bookkeeping"):
        load_results(root).objective("pretrain")


def test_a_plan_that_predates_declared_metrics_is_refused_with_what_to_do(tmp_path, capsys):
    root = make_synthetic_sweep(tmp_path / "old", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False)
    plan = json.loads((root / "plan.json").read_text())
    plan["objective"] = {"metric": "valid_loss", "direction": "minimize"}  # what study sweep wrote before
    del plan["tasks"]
    (root / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(UndeclaredMetric, match="predates declared metrics.*Re-run the sweep"):
        load_results(root)
    assert main(["report", str(root), "--out", str(tmp_path / "r")]) == 2
    assert "predates declared metrics" in capsys.readouterr().err
    (root / "plan.json").unlink()  # a results table without its plan: nothing declares its metrics either
    with pytest.raises(UndeclaredMetric, match="plan.json is missing"):
        load_results(root)


def test_pretrain_curves_plot_the_mlm_loss_not_mlm_plus_nsp(pretrain_sweep):
    """The synthetic NSP runs log train/loss = MLM + 0.67 (their NSP loss); the MLM columns are the same for both."""
    r = load_results(pretrain_sweep)
    labels = [lbl for _, lbl in r.axis_labels("nsp")]
    rows = r.completed("pretrain")
    fig = plot_curves(r, rows, labels, variant_palette(r.variant_order, r.baseline_label), "t", task="pretrain")
    assert fig._study_columns == ("train/mlm_loss", "val/mlm_loss")
    train_ax, val_ax = fig.axes[:2]
    assert "mlm_loss" in train_ax.get_ylabel() and "(nats/masked token)" in val_ax.get_ylabel()
    finals = {ln.get_label().split(" ")[0]: ln.get_ydata()[-1] for ln in val_ax.get_lines()}
    assert set(finals) == {"baseline", "nsp=false"}
    assert abs(finals["baseline"] - finals["nsp=false"]) < 0.1  # not 0.67 apart by construction
    # each model's own input format (segment pairs with NSP, full sentences without): marked, with the field
    assert train_ax.get_title().startswith("training: train/mlm_loss †") and "val/mlm_loss †" in val_ax.get_title()
    assert "† not comparable across these variants: the curves are defined by model.nsp (" in fig._suptitle.get_text()
    alike = plot_curves(r, rows, labels[:1], variant_palette(r.variant_order, r.baseline_label), "t", task="pretrain")
    assert "†" not in alike.axes[1].get_title() + alike._suptitle.get_text()


def test_extrapolation_names_the_split_the_corpus_has(tmp_path):
    for dataset, split in (("tinyshakespeare", "validation"), ("wikitext-2", "test")):
        root = make_synthetic_sweep(tmp_path / dataset, axes={"position": ["rope", "alibi"]}, partial=False,
                                    problems=False, with_runs=False, dataset=dataset)
        r = load_results(root)
        fig = plot_extrapolation(r.completed(), r.axis_labels("position"), {}, "t", train_len=64)
        assert fig.axes[0].get_ylabel() == f"{split} perplexity"
        has_test = any(c.startswith("metric.test_") for c in r.table.columns)
        assert has_test == (dataset == "wikitext-2")


def test_a_single_seed_never_shows_a_standard_deviation_of_zero(tmp_path):
    root = make_synthetic_sweep(tmp_path / "one", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False, seeds=(0,))
    out = build_report(root, tmp_path / "out", kinds=())
    md = out.markdown.read_text()
    assert "(n=1, no CI)" in md and "± 0 " not in md and "±0" not in md
    summary = pd.read_csv(out.out / "summary.csv")
    assert summary["sd"].isna().all() and summary["ci_half"].isna().all()  # missing, never 0


def test_a_study_in_stages_reports_its_unit_and_every_stage_declared(tmp_path):
    from synthetic_sweep import make_nsp_glue_sweep

    root = make_nsp_glue_sweep(tmp_path / "nsp")
    r = load_results(root)
    assert r.objective("glue") == ("glue_score", "maximize")
    spec = r.declared("pretrain.valid_nsp_accuracy")  # an earlier stage's metric, declared by that stage's task
    assert (spec.task, spec.direction, spec.scale) == ("pretrain", "maximize", "fraction (0-1)")
    assert r.declared("SST-2/accuracy_std", "glue").objective is False  # '*_std' before '*/accuracy': order
    md = build_report(root, tmp_path / "out", kinds=()).markdown.read_text()
    assert "so n counts pretrain runs, each GLUE number the mean over its record's fine-tuning seeds" in md
    assert "glue_score (0-100; higher is better; 95% CI)" in md
    assert "pretrain.valid_mlm_loss † (nats/masked token; lower is better)" in md  # († its format follows NSP)
    assert "direction not declared" not in md  # the flags and lists of a GLUE record are not measurements


def test_a_glue_study_reports_every_task_with_its_fine_tuning_spread_and_the_pretraining_stage(tmp_path):
    from synthetic_sweep import GLUE_TASKS, make_nsp_glue_sweep

    root = make_nsp_glue_sweep(tmp_path / "nsp", nsp_effect=3.0)
    md = build_report(root, tmp_path / "out", kinds=()).markdown.read_text()
    per_task = md[md.index("### Per GLUE task"):]
    for task in GLUE_TASKS:  # one row per (task, variant), the fine-tuning sd beside the interval over trials
        assert f"| {task} | baseline | 3 |" in per_task and f"| {task} | nsp=false | 3 |" in per_task
    assert "| fine-tuning sd |" in per_task and "| 0.5 |" in per_task
    # NSP adds 3 points to every task in the fixture: each task's paired difference says worse without it
    paired = per_task[per_task.index("| task | variant | pairs | Δ score"):]
    assert paired.count("**worse**") == len(GLUE_TASKS)
    stage = md[md.index("### The pretrain stage"):]
    assert "valid_mlm_loss_full_sentences" in stage and "valid_nsp_accuracy" in stage
    assert "valid_masked_tokens" not in stage  # bookkeeping is not a quality metric


def test_the_report_states_the_sweeps_measured_wall_time_and_each_trials(tmp_path):
    root = make_synthetic_sweep(tmp_path / "s", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False, seeds=(0, 1))
    (root / "invocations.json").write_text(json.dumps([
        {"wall_seconds": 200.0, "workers": 2, "threads": 1}, {"wall_seconds": 100.0, "workers": 2, "threads": 1}]))
    md = build_report(root, tmp_path / "out", formats=("png",), kinds=("metric",)).markdown.read_text()
    assert "Wall-clock time of the sweep: 5.0 min over 2 `study sweep` command(s) (2 worker(s) x 1 thread(s)" in md
    header = next(line for line in md.splitlines() if line.startswith("| variant | n / planned"))
    assert header.rstrip(" |").endswith("wall time per trial (min)")
    assert "| 2.3 |" in md  # 140 s a trial


def test_the_headline_figure_is_the_verdicts_paired_differences(report):
    """First figure of every task: each variant's paired difference from the baseline with its interval, the numbers
    paired.csv and the verdict table hold; a variant that never ran is not drawn."""
    lm = [f for f in report.figures if f.task == "lm"]
    assert lm[0].kind == "paired" and lm[0].name == "lm-valid_loss-paired-differences"
    paired = pd.read_csv(report.out / "paired.csv").query("metric == 'valid_loss'")
    drawn = paired[paired["diff"].notna()]["label"].tolist()
    assert lm[0].series == drawn and "attention=mqa" not in drawn and len(drawn) >= 3
    md = report.markdown.read_text()
    assert md.index("paired difference of each variant against the baseline") < md.index("for every variant")
