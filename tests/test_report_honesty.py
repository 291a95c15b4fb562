"""study.report says what ran and no more: a heatmap cell is one config over its seeds (never other configs pooled as
seeds), a completed trial without a value of the primary metric is named (not taken for one that never ran, not
averaged in its other columns), planned counts come from the plan, the seeds note gives the range of n, the paired
verdicts are corrected for how many the report makes, the training curves leave diverged trials out of their means,
bytes are headed in the unit they are printed in, and GLUE F1 reaches `study compare`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
from scipy import stats

matplotlib.use("Agg")

from study.report import build_report  # noqa: E402
from study.report.collect import load_results  # noqa: E402
from study.report.figures import holding_baseline, make_figures, plot_curves, plot_grad_norms  # noqa: E402
from study.report.figures import plot_heatmap, plot_metric_by_variant, variant_palette  # noqa: E402
from study.report.measure import _schema1_glue_row, glue_columns, sweep_measurements  # noqa: E402
from study.report.stats import small_n_note  # noqa: E402
from synthetic_sweep import make_nsp_glue_sweep, make_synthetic_sweep  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TWO_AXES = {"norm": ["rmsnorm", "layernorm"], "span": ["global", "local"]}
GRID = {"norm_position": ["pre", "post"], "position": ["rope", "alibi"], "attention": ["mha", "mqa"]}


def _rewrite(root: Path, edit) -> Path:
    """Apply `edit` to the results table and write it back (parquet only: the CSV would be a stale second copy)."""
    table = pd.read_parquet(root / "results.parquet")
    table = edit(table)
    table.to_parquet(root / "results.parquet", index=False)
    (root / "results.csv").unlink(missing_ok=True)
    return root


def _sweep(tmp_path, axes=TWO_AXES, **kw) -> Path:
    return make_synthetic_sweep(tmp_path / "s", axes=axes, partial=False, problems=False, with_runs=False, **kw)


def _section(md: str, heading: str) -> str:
    return md.split(heading, 1)[1].split("\n## ", 1)[0]


def _row(md: str, label: str) -> list[str]:
    """The cells of the first table row of `label` (the summary table comes before the paired ones)."""
    line = next(line for line in md.splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


# -- 1. heatmaps: one config per cell ------------------------------------------------------------------------------
def _heatmap(results, rows=None):
    rows = results.completed() if rows is None else rows
    return plot_heatmap(rows, "norm_position", "position", GRID["norm_position"], GRID["position"],
                        "metric.valid_loss", "minimize", "t", {"attention": "mha"})


def _cell_texts(fig) -> list[str]:
    return [t.get_text().replace("\n", " ") for t in fig.axes[0].texts]


def test_a_heatmap_cell_is_one_config_over_its_seeds_never_other_configs_pooled_as_seeds(tmp_path):
    """A grid of three axes: the norm_position x position heatmap holds attention at the baseline's mha. Each cell is
    that one point over its 3 seeds (the mqa trials would double n and mix in another config); a cell whose
    point never ran says 'no run', even though the same cell ran at attention=mqa."""
    root = _rewrite(_sweep(tmp_path, GRID, design="grid"),
                    lambda t: t[t["label"] != "norm_position=post,position=alibi,attention=mha"])
    r = load_results(root)
    fig = _heatmap(r)
    texts = _cell_texts(fig)
    assert sorted(t.split(" n=")[1] for t in texts if "n=" in t) == ["3", "3", "3"]
    assert texts.count("no run") == 1
    base = r.completed().query("label == 'norm_position=pre,position=rope,attention=mha'")["metric.valid_loss"]
    assert texts[0].startswith(f"{base.mean():.4g} ")  # the (pre, rope) cell: the baseline point's seeds alone
    assert fig.axes[0].get_title().endswith("held: attention=mha")
    assert fig._study_series == ["pre|rope", "pre|alibi", "post|rope"]


def test_a_cell_where_a_held_axis_does_not_apply_holds_it_only_when_its_config_does(tmp_path):
    """n/a (a conditional axis left out): such a trial holds the axis as the baseline does only when its config
    sets the axis's fields as the baseline's does (here the (post, alibi) point's config sets attention=mha; the
    (post, rope, mqa) point's sets mqa, so it never joins the (post, rope) cell's seeds)."""
    relabel = ["norm_position=post,position=alibi,attention=mha", "norm_position=post,position=rope,attention=mqa"]

    def edit(t):
        t.loc[t["label"].isin(relabel), "axis.attention"] = "n/a"
        return t

    r = load_results(_rewrite(_sweep(tmp_path, GRID, design="grid"), edit))
    assert "no run" in _cell_texts(_heatmap(r))  # by axis values alone, (post, alibi) has no mha trial
    texts = _cell_texts(_heatmap(r, holding_baseline(r, r.completed(), ["attention"])))
    assert "no run" not in texts and all(t.endswith("n=3") for t in texts)


def test_an_empty_cell_says_when_trials_ran_there_with_one_of_its_axes_not_applying(tmp_path):
    """A trial whose `position` does not apply (n/a: its config leaves the axis's fields unset) joins no cell of the
    position column, but its row did run: its empty cells say so instead of 'no run'."""
    def edit(t):
        t = t[t["label"] != "norm_position=post,position=alibi,attention=mha"].copy()
        t.loc[t["label"] == "norm_position=post,position=rope,attention=mha", "axis.position"] = "n/a"
        return t

    texts = _cell_texts(_heatmap(load_results(_rewrite(_sweep(tmp_path, GRID, design="grid"), edit))))
    assert texts.count("ran: position not applied") == 2 and "no run" not in texts


def test_a_heatmap_with_fewer_than_two_cells_at_the_held_setting_is_named_not_drawn(tmp_path):
    """The Multi30k study varies attention on the pre-norm, warmed-up recipe only; its other cells leave n_kv_heads
    unset, which ran as MHA (the baseline's attention), so at attention=mha all four norm_position x warmup cells
    are drawn. Where the cells at the held setting did not run (here: the post-norm trials and the no-warm-up ones
    removed from the table), that heatmap is not drawn and the report says why."""
    from dataclasses import replace

    r = load_results(REPO / "results" / "multi30k-warmup-gqa")
    figs = {f.name: f for f in make_figures(r, tmp_path / "all", formats=("png",), kinds=("heatmap",))}
    drawn = figs["translation-bleu-heatmap-norm_position-warmup"]
    assert drawn.paths and drawn.title.endswith("at attention=mha")
    # post-norm leaves attention unset, which ran as MHA: its cell is drawn (test_review_report)
    assert figs["translation-bleu-heatmap-norm_position-attention"].series == ["pre|mha", "pre|gqa", "pre|mqa",
                                                                               "post|mha"]

    kept = r.table[(r.table["axis.norm_position"] == "pre") & (r.table["axis.warmup"] == "with")]
    few = replace(r, table=kept.reset_index(drop=True))
    figs = {f.name: f for f in make_figures(few, tmp_path / "few", formats=("png",), kinds=("heatmap",))}
    skipped = figs["translation-bleu-heatmap-norm_position-warmup"]
    assert not skipped.paths and "attention=mha" in skipped.reason and "1 of its 4 cells ran" in skipped.reason


# -- 2. completed without a value ------------------------------------------------------------------------------------
def test_a_completed_trial_without_the_primary_metric_is_named_and_its_row_is_one_set_of_seeds(tmp_path):
    def edit(t):
        t.loc[(t["label"] == "norm=layernorm") & (t["seed"] == 1), "metric.valid_loss"] = np.nan
        t.loc[t["label"] == "span=local", "metric.valid_loss"] = np.nan
        return t

    root = _rewrite(_sweep(tmp_path), edit)
    out = build_report(root, tmp_path / "out", kinds=())
    md = out.markdown.read_text()
    assert _row(md, "norm=layernorm")[1] == "2 / 3 (1 completed without a value)"
    assert _row(md, "span=local")[1:3] == ["0 / 3 (3 completed without a value)", "not written by its 3 completed runs"]
    assert "no completed run" not in md
    problems = _section(md, "## Trials that did not complete")
    assert "Every planned trial completed." not in problems
    assert "| norm=layernorm | 1 | lm | valid_loss |" in problems and "| span=local | 0, 1, 2 | lm | valid_loss |" \
        in problems
    assert "**4 completed trial(s) wrote no value of the primary metric** (valid_loss)" in md
    # ... and the note claims only what holds: a table of another metric counts every seed that wrote it
    assert "left out of the main table's means and of the primary metric's paired differences" in md
    assert "in no mean and no paired difference" not in md and "left out of every mean" not in md
    # the row's other columns are over the seeds its primary metric is: layernorm's valid_ppl over seeds 0 and 2
    done = load_results(root).completed()
    ppl = done.query("label == 'norm=layernorm' and seed != 1")["metric.valid_ppl"].mean()
    summary = pd.read_csv(out.out / "summary.csv").set_index("label")
    assert summary.loc["norm=layernorm", "metric.valid_ppl"] == pytest.approx(ppl)
    assert (summary.loc["norm=layernorm", "n"], summary.loc["norm=layernorm", "n_completed"]) == (2, 3)
    assert math.isnan(summary.loc["span=local", "metric.valid_ppl"])


def test_the_metric_figure_says_completed_without_a_value_not_no_run(tmp_path):
    r = load_results(_rewrite(_sweep(tmp_path), lambda t: t.assign(**{"metric.valid_loss": t["metric.valid_loss"]
                                                                       .where(t["label"] != "span=local")})))
    fig = plot_metric_by_variant(r.completed(), [(lbl, lbl) for lbl in r.labels_for("lm")], "metric.valid_loss",
                                 {}, "t", baseline="baseline")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "3 completed,\nno value" in texts and "no completed\nrun" not in texts


def test_a_metric_a_variant_never_writes_is_not_written_not_a_failure(tmp_path):
    """NSP accuracy without NSP: the pretrain stage of nsp=false completed and wrote no NSP metric. The report says
    so, and lists no problem: it is not the primary metric."""
    md = build_report(make_nsp_glue_sweep(tmp_path / "nsp"), tmp_path / "out", kinds=()).markdown.read_text()
    stage = md[md.index("### The pretrain stage"):]
    nsp = [line for line in stage.splitlines() if line.startswith("| pretrain.valid_nsp_accuracy |")]
    assert "| nsp=false | 0 | not written by its 3 completed runs | – |" in nsp[1]
    assert "no completed run" not in md
    assert _section(md, "## Trials that did not complete").strip() == "Every planned trial completed."


# -- 6. planned counts from the plan ------------------------------------------------------------------------------
def test_planned_counts_come_from_the_plan_and_an_off_plan_trial_is_planned_nowhere(tmp_path):
    def edit(t):
        off = (t["label"] == "baseline") & (t["seed"] == 2)
        t.loc[off, ["label", "axis.norm", "ran_as_planned"]] = ["baseline (ran: norm=layernorm)", "layernorm", False]
        return t

    md = build_report(_rewrite(_sweep(tmp_path), edit), tmp_path / "out", kinds=()).markdown.read_text()
    assert _row(md, "baseline")[1] == "2 / 3"
    assert _row(md, "baseline (ran: norm=layernorm)")[1] == "1 / 0 (not in the plan)"
    assert "Every planned trial completed (1 of them not as planned" in md


# -- 7. the seeds note gives the range -------------------------------------------------------------------------------
def test_the_seeds_note_gives_the_range_of_n_never_the_largest_alone(tmp_path):
    root = _rewrite(_sweep(tmp_path), lambda t: t[(t["label"] == "baseline") | (t["seed"] == 0)])
    md = build_report(root, tmp_path / "out", kinds=()).markdown.read_text()
    assert "From 1 to 3 seeds per variant (each row's n)" in md and "3 seeds per variant:" not in md
    assert "a variant with one seed has no interval" in md
    assert small_n_note(3, 3) == small_n_note(3)


# -- 4. multiplicity ------------------------------------------------------------------------------------------------
def test_paired_verdicts_are_holm_adjusted_over_the_reports_family_and_say_how_many(tmp_path):
    """Two variants, each worse at 95% on its own (p 0.029 and 0.039, three pairs); the report makes two tests, so
    Holm compares the smaller p with 0.05 / 2 and withdraws both. The per-test verdict stays beside it."""
    from test_report_verdicts import WORSE_ALONE as diffs, worse_alone  # (the same two variants)

    out = build_report(_rewrite(_sweep(tmp_path), worse_alone), tmp_path / "out", kinds=())
    md = out.markdown.read_text()
    p = {label: stats.ttest_1samp(d, 0.0).pvalue for label, d in diffs.items()}
    assert all(0.025 < v < 0.05 for v in p.values())
    assert "**Multiplicity: this report makes 2 paired tests**" in md
    for label in diffs:
        cells = [line for line in md.splitlines() if line.startswith(f"| {label} |")][1].split("|")
        assert cells[6].strip() == "**worse**" and cells[8].strip() == "**inconclusive**"
    paired = pd.read_csv(out.out / "paired.csv").set_index("label")
    assert paired.loc["norm=layernorm", "p_holm"] == pytest.approx(2 * p["norm=layernorm"])
    assert list(paired["verdict"]) == ["worse", "worse"] and list(paired["verdict_holm"]) == ["inconclusive"] * 2
    assert set(paired["holm_family"]) == {2}


# -- 5. diverged trials in the curves --------------------------------------------------------------------------------
def test_the_curves_mean_leaves_diverged_trials_out_and_draws_them_dashed(tmp_path):
    """The synthetic sweep's position=alibi diverged on seed 0: its mean curve and n are over seeds 1 and 2."""
    root = make_synthetic_sweep(tmp_path / "p", axes={"norm_position": ["pre", "post"], "position": ["rope", "alibi"]},
                                partial=False)
    r = load_results(root)
    rows = r.table[r.table["status"].isin(["completed", "diverged"])]
    fig = plot_curves(r, rows, ["baseline", "position=alibi"], variant_palette(r.variant_order, "baseline"), "t")
    val = fig.axes[1]
    names = {ln.get_label(): ln for ln in val.get_lines()}
    assert set(names) == {"baseline (n=3)", "position=alibi (n=2)", "position=alibi: diverged (seed 0)"}
    assert names["position=alibi: diverged (seed 0)"].get_linestyle() == "--"
    alibi = rows[rows["label"] == "position=alibi"]
    completed = [r.curves(row).dropna(subset=["val/loss"]).set_index("step")["val/loss"]
                 for _, row in alibi.iterrows() if row["status"] == "completed"]
    mean = names["position=alibi (n=2)"]
    assert list(mean.get_ydata()) == pytest.approx(list(pd.concat(completed, axis=1).mean(axis=1)))
    assert "dashed: diverged trials (in no mean)" in fig._suptitle.get_text()


def test_the_gradient_norms_mean_leaves_diverged_trials_out(tmp_path):
    """Post-norm's seed 2 failed; here its seed 0 diverged too: one completed seed is left to average."""
    root = make_synthetic_sweep(tmp_path / "p", axes={"norm_position": ["pre", "post"]}, partial=False)
    root = _rewrite(root, lambda t: t.assign(status=t["status"].mask((t["label"] == "norm_position=post")
                                                                      & (t["seed"] == 0), "diverged")))
    r = load_results(root)
    rows = r.table[r.table["status"].isin(["completed", "diverged"])]
    fig = plot_grad_norms(r, rows, r.axis_labels("norm_position"), {}, "t")
    assert sorted(ln.get_label() for ln in fig.axes[0].get_lines()) == ["post (n=1)", "pre (n=3)"]


# -- 8. units ------------------------------------------------------------------------------------------------------
def test_bytes_are_headed_mib_the_unit_they_are_printed_in(tmp_path):
    """8.5e8 bytes is 811 MiB (2**20 bytes each), not 850 MB."""
    md = build_report(_sweep(tmp_path), tmp_path / "out", kinds=()).markdown.read_text()
    header = next(line for line in md.splitlines() if line.startswith("| variant | n / planned"))
    assert "peak memory (MiB)" in header and "(MB)" not in md
    assert "811" in _row(md, "baseline")


# -- 3. GLUE F1 ----------------------------------------------------------------------------------------------------
def test_glue_f1_reaches_the_comparison_and_schema_1_f1_is_put_on_0_100():
    cols = ["metric.MRPC/f1", "metric.MRPC/accuracy", "metric.QQP/f1", "metric.QQP/f1_std"]
    assert glue_columns(cols) == {"glue:mrpc:f1": "metric.MRPC/f1", "glue:mrpc:accuracy": "metric.MRPC/accuracy",
                                  "glue:qqp:f1": "metric.QQP/f1"}
    row = _schema1_glue_row({"metric.MRPC/f1": 0.8, "metric.MRPC/f1_std": 0.01, "metric.MRPC/score": 75.0})
    assert row == {"metric.MRPC/f1": pytest.approx(80.0), "metric.MRPC/f1_std": pytest.approx(1.0),
                   "metric.MRPC/score": 75.0}


def test_a_glue_sweeps_mrpc_f1_is_measured(tmp_path):
    keys = {m.key for m in sweep_measurements(load_results(make_nsp_glue_sweep(tmp_path / "nsp")))}
    assert {"glue:mrpc:f1", "glue:mrpc:accuracy"} <= keys


# -- 6. a metric the variants define differently ---------------------------------------------------------------------
def _vocab_sweep(tmp_path) -> Path:
    """The synthetic language model with its `norm` axis read as if it also set the BPE vocabulary (rmsnorm ran 8000
    merges, layernorm 16000), recorded as a sweep's table records what ran (`config.<field>`)."""
    root = _sweep(tmp_path, axes={"norm": ["rmsnorm", "layernorm"]})
    plan = json.loads((root / "plan.json").read_text())
    plan["axis_fields"]["norm"] += ["task.vocab_size"]
    (root / "plan.json").write_text(json.dumps(plan))
    return _rewrite(root, lambda t: t.assign(**{"config.task.vocab_size": t["axis.norm"].map(
        {"rmsnorm": "8000", "layernorm": "16000"})}))


def test_a_metric_the_variants_define_differently_is_marked_and_never_given_a_verdict(tmp_path):
    """A per-token loss over another vocabulary measures another quantity: the plan refuses to rank by it, and a
    plan written before it did (or any table showing such a column) marks it and withholds the paired verdict."""
    root = _vocab_sweep(tmp_path)
    r = load_results(root)
    assert r.defined_differently("metric.valid_ppl", "lm", ["baseline", "norm=layernorm"]) == {
        "task.vocab_size": ["8000", "16000"]}
    assert r.defined_differently("metric.valid_ppl", "lm", ["baseline"]) == {}
    out = build_report(root, tmp_path / "out", kinds=())
    md = out.markdown.read_text()
    assert "valid_loss † (nats/token" in md and "valid_ppl † (perplexity" in md
    assert "**† Not comparable across these variants:** `valid_loss` is defined by `task.vocab_size`" in md
    paired = pd.read_csv(out.out / "paired.csv").query("metric == 'valid_loss'").set_index("label")
    assert paired.loc["norm=layernorm", "verdict"] == "not comparable"
    assert paired.loc[["norm=layernorm"], ["diff", "ci_lo", "ci_hi", "p_value", "mde"]].isna().all(axis=None)
    assert "this report makes 0 paired tests" in md


def test_an_earlier_stages_metric_defined_by_the_swept_field_is_marked_and_the_shared_format_one_is_not(tmp_path):
    """NSP on/off changes the pretraining input format: the MLM loss in each model's own format measures different
    inputs (defined by model.nsp, which the axis `model.nsp` sets in the first stage); the full-sentences one is the
    same input for both."""
    root = make_nsp_glue_sweep(tmp_path / "nsp")
    md = build_report(root, tmp_path / "out", kinds=()).markdown.read_text()
    stage = md[md.index("### The pretrain stage"):]
    assert "| pretrain.valid_mlm_loss † |" in stage and "| pretrain.valid_mlm_loss_full_sentences |" in stage
    assert "`pretrain.valid_mlm_loss` is defined by `model.nsp`, which the variants ran differently " \
           "(`model.nsp`: false, true)" in stage
    assert "valid_mlm_loss_full_sentences` is defined" not in stage


def test_a_stage_metric_is_marked_where_tuning_chose_its_defining_field_per_variant_or_the_table_predates_it(tmp_path):
    """Tuning `pretrain.task.mlm_probability` by the GLUE score gives each variant its own masking share: the
    full-sentences MLM loss (defined by it) then differs in meaning too. A table written before `config.*` columns
    existed is read through the planned configs (model.nsp is set in each point's)."""
    root = make_nsp_glue_sweep(tmp_path / "nsp")
    plan = json.loads((root / "plan.json").read_text())
    plan["tune"] = {"field": "pretrain.task.mlm_probability", "low": 0.1, "high": 0.3, "trials": 2}
    (root / "plan.json").write_text(json.dumps(plan))
    _rewrite(root, lambda t: t.drop(columns=["config.model.nsp"]).assign(**{
        "tuned.pretrain.task.mlm_probability": t["label"].map({"baseline": 0.15, "nsp=false": 0.2})}))
    r = load_results(root)
    both = ["baseline", "nsp=false"]
    assert r.defined_differently("metric.pretrain.valid_mlm_loss_full_sentences", "glue", both) == {
        "task.mlm_probability": ["0.15", "0.2"]}
    assert r.defined_differently("metric.pretrain.valid_mlm_loss", "glue", both) == {
        "task.mlm_probability": ["0.15", "0.2"], "model.nsp": ["false", "true"]}


def test_a_point_skipped_as_another_points_config_is_named_beside_the_axes(tmp_path):
    """`n_kv_heads: [null, 4]` at four heads: the value 4 builds the baseline's model and never runs as itself,
    though the axis table lists it; the Sweep section says so."""
    root = _sweep(tmp_path)
    plan = json.loads((root / "plan.json").read_text())
    plan["duplicates"] = [["attention=mha-named", "baseline"]]
    (root / "plan.json").write_text(json.dumps(plan))
    md = build_report(root, tmp_path / "out", kinds=()).markdown.read_text()
    assert ("**1 point(s) of the design were not run**: each builds the same config as another point, whose trials "
            "stand for both: attention=mha-named (as baseline).") in _section(md, "## Sweep")
    assert "were not run" not in build_report(_sweep(tmp_path / "b"), tmp_path / "out-b", kinds=()).markdown.read_text()
