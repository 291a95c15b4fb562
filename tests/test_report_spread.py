"""Paired differences with no spread never give a confident verdict by accident, and the comparison with published
numbers names what a number is read at.

A metric that moves in steps (accuracy over RTE's 277 dev examples) can repeat a paired difference exactly: every
seed 3/277 up on the baseline. The t-test is then degenerate (sd 0, t infinite, p 0) and a zero-width interval
"excludes zero"; two seeds would call the variant better. Such pairs are tested with the exact sign-flip test (Fisher
1935, The Design of Experiments, section 21): n equal non-zero differences give p = 2 / 2^n, so two seeds are
inconclusive and only six or more can be significant at 0.05. The report, the comparison and the smallest detectable
difference say so.

The comparison with published numbers names the evaluation context and which model is reported: nanoGPT's Tiny
Shakespeare number is the best validation loss over training at a context of 256 characters, over the whole
validation split; ours is the final model's at task.seq_len, on the split's first task.eval_tokens tokens. A
Measurement carries its context and the part of the split it covers; published.csv's `context` and `selection` are
validated.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
from scipy import stats

matplotlib.use("Agg")

from study.report.collect import load_results  # noqa: E402
from study.report import published as published_module  # noqa: E402
from study.report.compare import compare_effects, compare_numbers, run_compare  # noqa: E402
from study.report.figures import plot_paired_differences  # noqa: E402
from study.report.family import paired_family  # noqa: E402
from study.report.markdown import build_doc  # noqa: E402
from study.report.measure import Measurement, run_measurements, sweep_measurements  # noqa: E402
from study.report.published import load_effects, load_published, validate_published  # noqa: E402
from study.report.stats import (  # noqa: E402
    ALPHA,
    NO_SPREAD_TEST,
    T_TEST,
    mean_ci,
    paired_difference,
    paired_differences,
    paired_t_pvalue,
)
from synthetic_sweep import SEQ_LEN, make_synthetic_sweep  # noqa: E402

RTE_DEV = 277
# RTE accuracies (fractions) of the baseline and of a variant 3 examples up, per seed: in float64 the differences
# 150/277 - 147/277 and 250/277 - 247/277 differ in their last bits, as real records' would
CORRECT = [147, 247, 100, 180, 200, 120]  # the baseline's correct answers per seed
BASE = [k / RTE_DEV for k in CORRECT]
UP3 = [(k + 3) / RTE_DEV for k in CORRECT]


def _table(base: list[float], variant: list[float]) -> pd.DataFrame:
    rows = [{"label": "base", "seed": s, "m": v} for s, v in enumerate(base)]
    return pd.DataFrame(rows + [{"label": "var", "seed": s, "m": v} for s, v in enumerate(variant)])


def _exact_sign_flip_p(diffs: list[float]) -> float:
    """The two-sided exact sign-flip p by enumeration: the share of the 2^n sign assignments whose |mean| is at least
    the observed one."""
    observed = abs(np.mean(diffs))
    means = [abs(np.mean([s * d for s, d in zip(signs, diffs)])) for signs in itertools.product((1, -1),
                                                                                                  repeat=len(diffs))]
    return sum(m >= observed - 1e-12 for m in means) / len(means)


# -- statistics --------------------------------------------------------------------------------------------------------
def test_two_seeds_with_the_same_difference_are_inconclusive_with_p_one_half():
    d = paired_difference(_table(BASE[:2], UP3[:2]), "m", "var", "base", "maximize")
    diffs = [v - b for v, b in zip(UP3[:2], BASE[:2])]
    assert diffs[0] != diffs[1]  # the rounding a real record carries: the t-test would see sd ~ 1e-17 and p ~ 0
    assert d.no_spread and d.test == NO_SPREAD_TEST
    assert d.p_value == 0.5 == _exact_sign_flip_p([3 / RTE_DEV] * 2)
    assert d.verdict == "inconclusive"
    assert d.diff.mean == pytest.approx(3 / RTE_DEV) and d.diff.sd == 0
    assert not d.diff.has_ci and math.isnan(d.diff.lo) and math.isnan(d.diff.hi)  # no zero-width interval
    assert math.isnan(d.mde)  # no spread: no power estimate, never 0


def test_five_seeds_with_the_same_difference_are_still_inconclusive():
    d = paired_difference(_table(BASE[:5], UP3[:5]), "m", "var", "base", "maximize")
    assert d.p_value == 0.0625 and d.verdict == "inconclusive"


def test_six_seeds_with_the_same_difference_follow_the_exact_sign_flip_p():
    up = paired_difference(_table(BASE, UP3), "m", "var", "base", "maximize")
    assert up.p_value == 0.03125 == _exact_sign_flip_p([3 / RTE_DEV] * 6) and up.p_value < ALPHA
    assert up.verdict == "better" and up.test == NO_SPREAD_TEST
    # the same six differences on a metric where lower is better, and the other way round
    assert paired_difference(_table(BASE, UP3), "m", "var", "base", "minimize").verdict == "worse"
    assert paired_difference(_table(UP3, BASE), "m", "var", "base", "minimize").verdict == "better"


@pytest.mark.parametrize("n", range(2, 9))
def test_the_no_spread_p_is_the_exact_sign_flip_test(n):
    assert paired_t_pvalue(mean_ci([0.25] * n)) == pytest.approx(_exact_sign_flip_p([0.25] * n)) == 2.0 ** (1 - n)


def test_identical_zero_differences_have_p_one_and_are_inconclusive():
    same = paired_difference(_table(BASE[:3], BASE[:3]), "m", "var", "base")
    assert same.no_spread and same.p_value == 1.0 and same.verdict == "inconclusive"
    # differences that are zero up to rounding are zero: (0.1 + 0.2) - 0.3 is 5.6e-17 in float64
    rounded = paired_difference(_table([0.3, 0.3], [0.1 + 0.2, 0.3]), "m", "var", "base")
    assert rounded.diff.mean == 0 and rounded.p_value == 1.0 and rounded.verdict == "inconclusive"


def test_differences_with_spread_keep_the_paired_t_test():
    base = [1.0, 2.0, 3.0, 4.0]
    var = [1.5, 2.1, 3.9, 4.3]
    d = paired_difference(_table(base, var), "m", "var", "base", "minimize")
    assert not d.no_spread and d.test == T_TEST
    assert d.p_value == pytest.approx(stats.ttest_rel(var, base).pvalue, rel=1e-12)
    assert d.diff.has_ci and d.diff.lo < d.diff.mean < d.diff.hi and math.isfinite(d.mde) and d.mde > 0
    assert d.verdict == "inconclusive"  # p 0.08: the interval contains zero
    tight = [1.2, 2.21, 3.19, 4.2]
    t = paired_difference(_table(base, tight), "m", "var", "base", "minimize")
    assert t.p_value == pytest.approx(stats.ttest_rel(tight, base).pvalue, rel=1e-12) and t.p_value < ALPHA
    assert t.verdict == "worse" and t.test == T_TEST


# -- the report --------------------------------------------------------------------------------------------------------
def _two_seed_sweep(root):
    """A two-seed sweep whose layernorm variant is 3/277 above the baseline on both seeds (valid_loss, so worse)."""
    root = make_synthetic_sweep(root, axes={"norm": ["rmsnorm", "layernorm"]}, seeds=(0, 1), partial=False,
                                problems=False, with_runs=False)
    table = pd.read_parquet(root / "results.parquet")
    for seed, (b, v) in enumerate(((BASE[0], UP3[0]), (BASE[1], UP3[1]))):
        table.loc[(table["label"] == "baseline") & (table["seed"] == seed), "metric.valid_loss"] = 1 + b
        table.loc[(table["label"] == "norm=layernorm") & (table["seed"] == seed), "metric.valid_loss"] = 1 + v
    table.to_parquet(root / "results.parquet", index=False)
    table.to_csv(root / "results.csv", index=False)
    return load_results(root)


def test_the_report_gives_no_confident_verdict_for_two_seeds_without_spread(tmp_path):
    results = _two_seed_sweep(tmp_path / "s")
    loss = next(t for t in paired_family(results) if t.column == "metric.valid_loss").table.set_index("label")
    row = loss.loc["norm=layernorm"]
    assert row["test"] == NO_SPREAD_TEST and row["p_value"] == 0.5
    assert row["verdict"] == "inconclusive" and row["verdict_holm"] == "inconclusive"
    md = build_doc(results, [], tmp_path / "out").to_markdown()
    lines = [line for line in md.splitlines() if line.startswith("| norm=layernorm | 2 (seeds 0,1) | +0.01083 |")]
    assert len(lines) == 1, lines
    assert "**better**" not in lines[0] and "**worse**" not in lines[0] and "**inconclusive**" in lines[0]
    assert "none: no spread (2 equal differences)" in lines[0] and "0.5000 (exact sign-flip)" in lines[0]
    assert "[+0.01083, +0.01083]" not in md
    assert "*No spread*" in md and "2¹⁻ⁿ" in md


# -- the comparison with published numbers -------------------------------------------------------------------------
def test_a_published_effect_without_spread_is_tested_by_sign_flip_and_says_so(tmp_path):
    """ALiBi 0.05 nats below RoPE on each of three seeds: no interval, p = 1/4, inconclusive before and after Holm,
    and no smallest detectable difference (never 0)."""
    root = make_synthetic_sweep(tmp_path / "s", axes={"position": ["rope", "alibi"]}, partial=False, problems=False,
                                with_runs=False)
    table = pd.read_parquet(root / "results.parquet")
    rope = table["label"] == "baseline"
    for seed in (0, 1, 2):
        base = table.loc[rope & (table["seed"] == seed), "metric.valid_loss"].iloc[0]
        table.loc[~rope & (table["seed"] == seed), "metric.valid_loss"] = base - 0.05
    table.to_parquet(root / "results.parquet", index=False)
    table.to_csv(root / "results.csv", index=False)
    results = load_results(root)
    tested, _ = compare_effects(results, load_effects())
    row = tested.set_index("effect_id").loc["alibi-vs-rope-train-length"]
    assert row["our_test"] == NO_SPREAD_TEST and row["p_value"] == 0.25 and math.isnan(row["our_mde"])
    assert row["verdict"] == "inconclusive" and row["holm_verdict"] == "inconclusive"
    md = run_compare(results, tmp_path / "out").markdown.read_text()
    assert "0.250 (exact sign-flip)" in md and "(no spread: 3 equal differences, no interval)" in md
    assert "no smallest detectable difference: the 3 paired differences are equal (no spread)" in md
    assert "*No spread*" in md


def test_the_kv_cache_effect_keeps_its_direction_by_construction(tmp_path):
    """A cost computed from the config differs alike on every seed (no spread): its direction is the sign of the
    difference, never the sign-flip test's 'inconclusive'."""
    root = make_synthetic_sweep(tmp_path / "mqa", axes={"attention": ["mha", "mqa"]}, partial=False, problems=False,
                                with_runs=False, noise=0.002)
    tested, _ = compare_effects(load_results(root), load_effects())
    kv = tested.set_index("effect_id").loc["mqa-decode-cost"]
    assert kv["verdict"] == "by construction" and kv["our_direction"] == "better" and kv["our_test"] == ""
    md = run_compare(load_results(root), tmp_path / "out").markdown.read_text()
    assert "better: cost.kv_cache_bytes_per_token variant/baseline 1/4" in md
    assert "(equal on every seed: computed from the config)" in md


def _ours_loss(source: str = "run ts", **setting) -> Measurement:
    return Measurement(source, "tinyshakespeare:loss", "validation", "metric.valid_loss", "xent-nats:char",
                       "cross-entropy in nats per char token", [1.5, 1.6, 1.55], params=10.7e6,
                       model_variant="from-scratch", **setting)


def test_nanogpt_best_val_at_context_256_is_not_our_final_loss_at_ours():
    published = load_published()
    nano = published[published["id"] == "nanogpt-shakespeare-char-val"]
    assert (nano["context"].iloc[0], nano["selection"].iloc[0]) == ("256", "best")
    row = compare_numbers([_ours_loss(context=128)], nano).iloc[0]
    assert row["same_size"] and row["same_metric_variant"] and row["same_split"]  # only the setting differs
    assert not row["comparable"] and not row["same_context"] and not row["same_selection"]
    assert (row["our_context"], row["published_context"]) == (128, 256)
    assert (row["our_selection"], row["published_selection"]) == ("final", "best")
    assert "different evaluation context (ours: 128 tokens per window; published: 256)" in row["comparability"]
    assert "different model reported (ours: the model at the end of training; published: the best validation " \
           "value over training" in row["comparability"]
    unknown = compare_numbers([_ours_loss()], nano).iloc[0]  # a context we do not know is never called the same
    assert "evaluation context not known on our side (published: 256 tokens per window)" in unknown["comparability"]
    assert not unknown["comparable"] and unknown["same_context"] is None
    # ... and not comparable for it alone, where the model reported is the same
    final = nano.assign(selection="final")
    unknown = compare_numbers([_ours_loss()], final).iloc[0]
    assert not unknown["comparable"] and "evaluation context not known" in unknown["comparability"]
    assert compare_numbers([_ours_loss(context=256)], final).iloc[0]["comparable"]


def test_a_published_row_stating_our_setting_is_comparable():
    row = load_published().query("id == 'nanogpt-shakespeare-char-val'").assign(context="128", selection="final")
    out = compare_numbers([_ours_loss(context=128)], row).iloc[0]
    assert out["comparable"] and out["same_context"] and out["same_selection"] and out["same_eval_subset"]
    assert out["comparability"].startswith("same metric variant, split, model variant and size")


def test_our_number_on_a_prefix_of_the_split_is_not_the_published_whole_split_number():
    row = load_published().query("id == 'nanogpt-shakespeare-char-val'").assign(context="128", selection="final")
    ours = _ours_loss(context=128, eval_tokens=32768, split_tokens=111539)
    out = compare_numbers([ours], row).iloc[0]
    assert not out["comparable"] and not out["same_eval_subset"]
    assert out["our_eval_subset"] == "the first 32,768 of the validation split's 111,539 tokens"
    assert ("NOT directly comparable: only part of the split evaluated (ours: the first 32,768 of the validation "
            "split's 111,539 tokens, as task.eval_tokens sets; published: the whole split)") in out["comparability"]


def _set_task_fields(root, **fields) -> None:
    plan = json.loads((root / "plan.json").read_text())
    for point in plan["points"]:
        point["config"]["task"].update(fields)
    (root / "plan.json").write_text(json.dumps(plan))


def test_a_sweeps_measurements_carry_its_seq_len_and_eval_tokens(tmp_path):
    root = make_synthetic_sweep(tmp_path / "ts", axes={"position": ["rope", "alibi"]}, partial=False, problems=False,
                                with_runs=False)
    whole = sweep_measurements(load_results(root))
    assert whole and {m.context for m in whole} == {SEQ_LEN} and {m.eval_subset for m in whole} == {""}
    _set_task_fields(root, seq_len=SEQ_LEN, eval_tokens=32768)
    cut = sweep_measurements(load_results(root))
    assert {(m.eval_tokens, m.split_tokens) for m in cut} == {(32768, None)}  # no run directory: length not known
    assert cut[0].eval_subset == "at most the first 32,768 tokens of the validation split"
    numbers = run_compare(load_results(root), tmp_path / "out").numbers
    nano = numbers[numbers["published_id"] == "nanogpt-shakespeare-char-val"]
    assert len(nano) and (nano["our_context"] == SEQ_LEN).all() and not nano["comparable"].any()
    assert nano["comparability"].str.contains(f"ours: {SEQ_LEN} tokens per window; published: 256").all()
    assert nano["comparability"].str.contains("only part of the split evaluated (ours: at most the first 32,768 "
                                              "tokens of the validation split, as task.eval_tokens sets; published: "
                                              "the whole split)", regex=False).all()


def test_the_split_length_data_json_records_decides_whether_eval_tokens_cut_it(tmp_path):
    root = make_synthetic_sweep(tmp_path / "ts", axes={"position": ["rope", "alibi"]}, partial=False, problems=False,
                                with_runs=True)
    _set_task_fields(root, eval_tokens=32768)
    for run_dir in (root / "runs").glob("*/seed-*"):
        (run_dir / "data.json").write_text(json.dumps({"tokens": {"train": 1003854, "valid": 111540}}))
    cut = sweep_measurements(load_results(root))
    assert {m.eval_subset for m in cut} == {"the first 32,768 of the validation split's 111,539 tokens"}
    _set_task_fields(root, eval_tokens=200000)  # longer than the split: the whole split was evaluated
    assert {m.eval_subset for m in sweep_measurements(load_results(root))} == {""}


def test_a_recorded_runs_measurements_read_its_config_and_data_json(tmp_path):
    from study.record import make_record

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps(make_record("completed", {"valid_loss": 1.5, "valid_ppl": 4.48},
                                                             {"parameters": 10.7e6}, steps=10)))
    (run / "config.yaml").write_text("name: ts\ntask: {name: lm, dataset: tinyshakespeare, seq_len: 256, "
                                     "tokenizer: char, eval_tokens: 32768}\n")
    (run / "data.json").write_text(json.dumps({"tokens": {"train": 1003854, "valid": 111540}}))
    (loss,) = [m for m in run_measurements([run]) if m.metric == "metric.valid_loss"]
    assert (loss.context, loss.eval_tokens, loss.split_tokens) == (256, 32768, 111539)
    # a task that does not read task.eval_tokens evaluates its whole split, whatever the config says
    (run / "config.yaml").write_text("name: ts\ntask: {name: pretrain, dataset: tinyshakespeare, seq_len: 256, "
                                     "tokenizer: char, eval_tokens: 32768}\n")
    assert all(m.eval_subset == "" for m in run_measurements([run]))


# -- the paired-differences figure ---------------------------------------------------------------------------------
def test_the_paired_figure_names_a_no_spread_row_and_its_sign_flip_p():
    table = pd.concat([_table(BASE[:2], UP3[:2]),
                       pd.DataFrame([{"label": "spread", "seed": s, "m": b + d}
                                     for s, (b, d) in enumerate(zip(BASE[:2], (0.01, 0.03)))])])
    paired = paired_differences(table, "m", "base", ["var", "spread"], "maximize")
    fig = plot_paired_differences(paired, "t", "Δ m", "maximize")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "inconclusive (n=2, no spread: sign-flip p 0.5)" in texts
    assert "inconclusive (n=2)" in texts  # the t-tested row keeps its plain label
    assert fig._study_series == ["var", "spread"]


# -- published.csv's context and selection -------------------------------------------------------------------------
def test_published_context_and_selection_are_validated_naming_the_row(monkeypatch):
    published = load_published()
    assert validate_published(published) == []
    assert {"context", "selection"} <= set(published_module.PUBLISHED_COLUMNS)
    broken = published.copy()
    nano = broken.index[broken["id"] == "nanogpt-shakespeare-char-val"][0]
    broken.loc[nano, "selection"] = "Best"
    broken.loc[broken.index[0], "context"] = "256.5"
    problems = validate_published(broken)
    assert "row nanogpt-shakespeare-char-val: selection 'Best' is not one of final, best or empty" in problems
    assert (f"row {broken.loc[broken.index[0], 'id']}: context '256.5' is not a positive whole number of tokens or "
            "empty") in problems
    for bad in ("0", "-3", "abc"):
        assert any("context" in p for p in validate_published(broken.assign(context=bad)))
    assert "missing column selection" in validate_published(published.drop(columns="selection"))
    monkeypatch.setattr(published_module, "_read", lambda name: broken.astype(str))
    with pytest.raises(ValueError, match="nanogpt-shakespeare-char-val: selection 'Best'"):
        load_published()


def test_a_mean_is_written_to_the_precision_its_interval_supports():
    """1.990 ± 0.063, not 1.99 ± 0.06288: the half-width to two significant digits, the mean and the interval's ends
    to the same decimal (digits past the uncertainty's say nothing; a dropped trailing zero hid one that does)."""
    from study.report.markdown import fmt_uncertain

    assert fmt_uncertain(0.06288, 1.99, 1.927, 2.053) == ["1.990", "1.927", "2.053", "0.063"]
    assert fmt_uncertain(1.744, 2.53, 0.7859) == ["2.5", "0.8", "1.7"]
    assert fmt_uncertain(240.3, 14417.2) == ["14,417", "240"]


def test_a_verdict_label_beside_the_widest_interval_ends_inside_the_axes():
    """Constrained layout makes room for a label in the figure, not in the data range: the label of the interval
    reaching furthest right ran across the frame (the default report's norm_position=post)."""
    paired = pd.read_csv(Path(__file__).resolve().parents[1] / "reports" / "default" / "paired.csv")
    fig = plot_paired_differences(paired[paired["metric"] == "valid_loss"], "t", "Δ m", "minimize")
    fig.draw_without_rendering()
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    assert max(t.get_window_extent(renderer).x1 for t in ax.texts) < ax.bbox.x1
