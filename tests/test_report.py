"""study.report: statistics against hand-computed values, figures from a synthetic results table, the report's
lists of failed and missing trials, the partial-sweep banner, and the command line."""

from __future__ import annotations

import math
import re

import matplotlib
import numpy as np
import pandas as pd
import pytest

matplotlib.use("Agg")

from study.report import build_report  # noqa: E402
from study.report.cli import main  # noqa: E402
from study.report.collect import load_results  # noqa: E402
from study.report.figures import (  # noqa: E402
    BASELINE_COLOUR,
    make_figures,
    plot_curves,
    plot_extrapolation,
    plot_grad_norms,
    plot_metric_by_variant,
    variant_palette,
)
from study.report.stats import mean_ci, paired_difference, pareto_front, summarize, t_critical  # noqa: E402
from study.report.synthetic import make_synthetic_sweep  # noqa: E402

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
    # test perplexity at 2x the training length (64 -> 128); learned positions have none
    learned = r.completed().query("label == 'position=learned'")
    assert learned["metric.test_ppl_at_2x"].isna().all()
    base = r.completed().query("label == 'baseline'")
    assert (base["metric.test_ppl_at_2x"] == base["metric.test_ppl_by_length.128"]).all()


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
    fig = plot_metric_by_variant(r.completed(), variants, "metric.valid_loss", palette, "t", baseline="baseline")
    ax = fig.axes[0]
    assert len(ax.containers) == 3  # one error bar per variant
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rope\n(baseline)", "alibi", "learned"]
    # the error bar is the 95% t interval of the baseline's seeds
    base = r.completed().query("label == 'baseline'")["metric.valid_loss"]
    ci = mean_ci(base)
    seg = ax.containers[0].lines[2][0].get_segments()[0]
    assert (seg[0][1], seg[1][1]) == (pytest.approx(ci.lo), pytest.approx(ci.hi))
    assert "nats" in ax.get_ylabel()


def test_curves_extrapolation_and_grad_norm_artists(partial_sweep):
    r = load_results(partial_sweep)
    palette = variant_palette(r.variant_order, r.baseline_label)
    labels = [lbl for _, lbl in r.axis_labels("position")]
    rows = r.table[r.table["status"].isin(["completed", "diverged"])]
    fig = plot_curves(r, rows, labels, palette, "t")
    train_ax, val_ax = fig.axes[:2]
    assert len(train_ax.get_lines()) == 3 and len(val_ax.get_lines()) == 3
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
    assert not [f for f in figs if f.kind == "curves"]  # no run directories: no curves, no failure


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
    row = paired.set_index("label").loc["position=alibi"]
    assert row["diff"] == pytest.approx(diffs.mean())
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
