"""Seaborn figures for a sweep, written as PNG and SVG into <out>/figures/.

Every plot function returns a matplotlib Figure (built without pyplot, so no global backend state)
whose `_study_series` attribute lists the series drawn; `make_figures` saves them and returns a
`FigureInfo` per figure. One palette maps each variant label to one colour in every figure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib import ticker
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from study.record import COSTS as RECORD_COSTS
from study.report.collect import SPLIT_WORDS, Declaration, SweepResults, by_length_columns, metric_column
from study.report.family import paired_family
from study.report.figure_layout import (
    BASELINE_COLOUR,
    N_DISTINCT,
    bulk_limits,
    distinct_colours,
    label_points,
    pin_beyond,
    readable_axes,
)
from study.report.stats import (
    NO_SPREAD_TEST,
    Interval,
    finite,
    mean_ci,
    no_spread_text,
    pareto_front,
    summarize,
)

COSTS = (  # column, axis label, better (from study.record.COSTS' declared direction)
    ("cost.train_tokens_per_s", "training throughput"),
    ("cost.parameters", "parameters"),
    ("cost.kv_cache_bytes_per_token", "KV cache growth per token (0: bounded by a window)"),
)


def metric_label(metric: str, scale: str | None = None) -> str:
    """An axis label: the metric's name with its declared scale ('valid_loss (nats/token)')."""
    name = metric.split(".", 1)[1] if metric.startswith("metric.") else metric
    return f"{name} ({scale})" if scale else name


def cost_axis(cost: str, label: str) -> tuple[str, str]:
    """(axis label with the declared unit, 'lower' | 'higher' is better) of a study.record.COSTS column."""
    direction, unit, _ = RECORD_COSTS[cost.removeprefix("cost.")]
    return f"{label} ({unit})", "lower" if direction == "minimize" else "higher"


def curve_metric(results: SweepResults, task: str, column: str, stage: str | None = None) -> Declaration | None:
    """The declared validation metric a curve column logs (`val/mlm_loss` is `valid_mlm_loss`, of `stage` in a study
    in stages); None where no metric of that name is declared."""
    stem = column.split("/", 1)[-1]
    return results.declaration(f"{stage + '.' if stage else ''}valid_{stem}", task)


def curve_label(results: SweepResults, task: str, column: str, stage: str | None = None) -> str:
    """A curve column's axis label: the declared scale of the validation metric it logs, or the bare column when
    no metric of that name is declared."""
    spec = curve_metric(results, task, column, stage)
    return f"{column} ({spec.scale})" if spec is not None else column


def _not_comparable_curve(results: SweepResults, task: str, column: str, stage: str | None,
                          labels: list[str]) -> str:
    """'' where the variants `labels` measure the validation curve `column` (and so its training twin, the same
    quantity on the training batches) alike; else the fields that define it differently, with their values
    (SweepResults.defined_differently: pretraining's MLM loss is each model's own input format, so with and without
    NSP its curves are of different quantities)."""
    spec = curve_metric(results, task, column, stage)
    differ = results.defined_differently(spec.column, task, labels) if spec is not None else {}
    return "; ".join(f"{f} ({', '.join(v)})" for f, v in differ.items())


def variant_palette(labels: list[str], baseline: str | None = None) -> dict[str, tuple]:
    """One colour per variant, fixed by the variant's place in the plan and distinct for up to N_DISTINCT variants
    besides the baseline, which is always dark grey."""
    colours = distinct_colours(N_DISTINCT)
    others = [label for label in labels if label != baseline]
    palette = {label: colours[i % len(colours)] for i, label in enumerate(others)}
    return {label: BASELINE_COLOUR if label == baseline else palette[label] for label in labels}


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(text)).strip("-") or "x"


@dataclass
class FigureInfo:
    name: str
    title: str
    kind: str
    task: str
    axis: str | None
    series: list[str]
    paths: list[Path] = field(default_factory=list)
    reason: str | None = None  # why it was not drawn (then `paths` is empty)

    @property
    def n_series(self) -> int:
        return len(self.series)

    @property
    def png(self) -> Path:
        """The file the report embeds: the PNG, else the first format drawn (`--formats svg`)."""
        return next((p for p in self.paths if p.suffix == ".png"), self.paths[0])


def _new(ncols: int = 1, width: float = 6.4, height: float = 4.2) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)  # a renderer to measure text with, without pyplot's global state
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _finish(fig: Figure, series: list[str]) -> Figure:
    readable_axes(fig)
    fig._study_series = list(series)
    return fig


def _n_text(ci: Interval) -> str:
    """The n beside a variant's mean, and why it has no interval where it has none (one seed; n equal values)."""
    if ci.n == 1:
        return "n=1, no CI"
    return f"n={ci.n}" if ci.has_ci or ci.n == 0 else no_spread_text(ci.n)


# -- 1. metric per variant with 95% CIs ----------------------------------------------------------------
def _values_by_variant(done: pd.DataFrame, variants: list[tuple[str, str]], metric_col: str) -> dict[str, pd.Series]:
    """Each variant's finite per-seed values of `metric_col` (empty for a variant without a completed trial)."""
    return {label: pd.to_numeric(done.loc[done["label"] == label, metric_col], errors="coerce").dropna()
            if metric_col in done else pd.Series(dtype=float) for _, label in variants}


def _draw_variant(ax, x: int, vals: pd.Series, colour, is_baseline: bool, limits, rng) -> float:
    """One variant's seeds (jittered dots), mean and 95% t interval at `x`; whatever lies beyond `limits` (an
    outlying seed, the interval it widens) is pinned to the edge with its value. Returns the mean."""
    ci = mean_ci(vals)
    lo, hi = limits or (-math.inf, math.inf)
    inside = vals[(vals >= lo) & (vals <= hi)]
    ax.scatter(x + rng.uniform(-0.12, 0.12, len(vals))[: len(inside)], inside, s=18, color=colour, alpha=0.45,
               linewidths=0, zorder=2)
    yerr = None if not ci.has_ci else [[ci.mean - ci.lo], [ci.hi - ci.mean]]
    ax.errorbar([x], [ci.mean], yerr=yerr, fmt="D" if is_baseline else "o", color=colour, ms=7, capsize=5,
                elinewidth=1.8, zorder=3)
    top = ci.hi if ci.has_ci else ci.mean
    if limits:
        beyond = [("seed", v) for v in vals if not lo <= v <= hi] + [("mean", ci.mean)]
        beyond += [("95% CI to", ci.lo), ("95% CI to", ci.hi)] if ci.has_ci else []
        pin_beyond(ax, x, beyond, limits, colour)
    if top > hi:  # the pinned values' labels stand right of the edge marker: n goes left of it, inside the axes
        ax.annotate(_n_text(ci), (x, hi), textcoords="offset points", xytext=(-7, -9), ha="right", va="center",
                    fontsize=7, color="0.35")
    else:
        ax.annotate(_n_text(ci), (x, top), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7,
                    color="0.35")
    return ci.mean


def plot_metric_by_variant(done: pd.DataFrame, variants: list[tuple[str, str]], metric_col: str, palette: dict,
                           title: str, baseline: str | None = None, xlabel: str = "variant",
                           ylabel: str | None = None) -> Figure:
    """Per-seed points and the mean with its 95% t interval for each (tick, label) in `variants`.
    Variants without a completed trial keep their tick, marked 'no completed run'. An outlying seed does not
    squash the rest: the axis keeps to the bulk (`bulk_limits`) and the outlier is pinned to its edge."""
    fig, (ax,) = _new(width=max(5.0, 1.1 * len(variants) + 2))
    values = _values_by_variant(done, variants, metric_col)
    limits = bulk_limits(values)
    series = []
    rng = np.random.default_rng(0)
    for x, (tick, label) in enumerate(variants):
        if values[label].empty:  # completed runs without a value are not "no run": the report names their seeds
            ran = int((done["label"] == label).sum()) if "label" in done else 0
            ax.annotate(f"{ran} completed,\nno value" if ran else "no completed\nrun", (x, 0.5),
                        xycoords=("data", "axes fraction"), ha="center", va="center", fontsize=8, color="0.4")
            continue
        mean = _draw_variant(ax, x, values[label], palette.get(label, BASELINE_COLOUR), label == baseline, limits,
                             rng)
        series.append(label)
        if label == baseline:
            ax.axhline(mean, color=BASELINE_COLOUR, lw=0.8, ls="--", zorder=1)
    ticks = [t.replace("=", "=\n").replace(",", ",\n") for t, _ in variants]
    ticks = [f"{t}\n(baseline)" if lbl == baseline and t != "baseline" else t for t, (_, lbl) in zip(ticks, variants)]
    ax.set_xticks(range(len(variants)), ticks, fontsize=8 if len(variants) > 6 else None)
    if limits:
        ax.set_ylim(*limits)
    else:
        ax.margins(y=0.12)
    ax.set_xlim(-0.6, len(variants) - 0.4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel or metric_label(metric_col))
    note = "\n▲▼: beyond the axis, value written" if limits else ""
    ax.set_title(f"{title}\nmean and 95% t interval over seeds; dots are single seeds{note}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return _finish(fig, series)


# -- 1b. the verdicts: paired differences against the baseline ---------------------------------------------------
VERDICT_COLOURS = {"better": "#1b7837", "worse": "#b2182b", "inconclusive": "0.45"}


def _shown_verdict(r: pd.Series) -> str:
    """The verdict a paired row is drawn with: after Holm's correction where the row carries it (as the report's
    tables do), else the uncorrected 95% one (the figure's title then says so)."""
    holm = r.get("verdict_holm")
    return str(holm) if isinstance(holm, str) and holm else str(r["verdict"])


def _paired_text(r: pd.Series) -> str:
    """A paired row's label beside its point: the verdict and n, the uncorrected verdict where Holm's correction
    withdrew it, for differences with no spread the test the verdict follows instead of an interval ('inconclusive
    (n=2, no spread: sign-flip p 0.5)'), and what diverged where the other side did not."""
    n, verdict = int(r["n_pairs"]), _shown_verdict(r)
    parts = [f"n={n}"]
    if verdict != r["verdict"]:
        parts.append(f"{r['verdict']} at 95% before Holm")
    if r.get("test") == NO_SPREAD_TEST:
        parts.append(f"no spread: sign-flip p {r['p_value']:.3g}")
    diverged = r.get("diverged")
    if isinstance(diverged, str) and diverged:
        parts.append(diverged)
    return f"{verdict} ({', '.join(parts)})"


def plot_paired_differences(paired: pd.DataFrame, title: str, xlabel: str, direction: str) -> Figure:
    """Each variant's mean paired difference from the baseline (same seeds) with its 95% t interval: the verdicts'
    own numbers, drawn. Coloured by the verdict after Holm's correction where `paired` has it (`verdict_holm`, as
    the report's tables show it), else by the uncorrected 95% verdict, and the title says which. Green: better, red:
    worse, grey: inconclusive; a variant without pairs or with one pair (no interval) is named at zero. Pairs whose
    differences are all equal (`test` is stats.NO_SPREAD_TEST) have no interval either: the point stands alone,
    labelled 'no spread' with the exact sign-flip p its verdict follows (2^(1-n): green or red only from 6 pairs
    on)."""
    rows = paired.reset_index(drop=True)
    fig, (ax,) = _new(width=7.2, height=max(2.4, 0.42 * len(rows) + 1.4))
    series, texts = [], []
    for y, r in rows.iterrows():
        label = str(r["label"])
        if not np.isfinite(r["diff"]):
            ax.annotate(_shown_verdict(r), (0, y), ha="center", va="center", fontsize=7, color="0.4")
            continue
        colour = VERDICT_COLOURS.get(_shown_verdict(r), "0.45")
        has_ci = np.isfinite(r["ci_lo"]) and np.isfinite(r["ci_hi"])
        xerr = [[r["diff"] - r["ci_lo"]], [r["ci_hi"] - r["diff"]]] if has_ci else None
        ax.errorbar([r["diff"]], [y], xerr=xerr, fmt="o", color=colour, ms=6, capsize=4, elinewidth=1.8)
        texts.append(ax.annotate(_paired_text(r), (r["ci_hi"] if has_ci else r["diff"], y),
                                 textcoords="offset points", xytext=(6, 0), va="center", fontsize=7, color=colour))
        series.append(label)
    ax.axvline(0, color=BASELINE_COLOUR, lw=0.9, ls="--")
    ax.set_yticks(range(len(rows)), [str(v) for v in rows["label"]], fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.25)
    better = "lower" if direction == "minimize" else "higher"
    ax.set_xlabel(f"{xlabel} (variant − baseline; {better} is better)")
    which = ("colour: verdict after Holm's correction, as in the report" if "verdict_holm" in rows
             else "colour: 95% verdict, not corrected for multiple tests")
    ax.set_title(f"{title}\npaired difference against the baseline:\nmean and 95% t interval over seed pairs\n"
                 f"{which}", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    _labels_inside(fig, ax, texts)
    return _finish(fig, series)


def _labels_inside(fig: Figure, ax, texts: list) -> None:
    """Widen the x range until every label written right of its point ends inside the axes: constrained layout
    makes room for it in the figure, not in the data range, so a label beside the rightmost interval ran across the
    frame. (The label's anchor moves left as the range grows: a few passes settle it.)"""
    for _ in range(4):
        if not texts:
            return
        fig.draw_without_rendering()
        renderer = fig.canvas.get_renderer()
        over = max(t.get_window_extent(renderer).x1 for t in texts) + 8 - ax.bbox.x1
        if over <= 0:
            return
        lo, hi = ax.get_xlim()
        ax.set_xlim(lo, hi + over * (hi - lo) / max(ax.bbox.width - over, 1.0))


# -- 2. training and validation curves -----------------------------------------------------------------
def _curve_frame(results: SweepResults, rows: pd.DataFrame, column: str, stage: str | None = None) -> pd.DataFrame:
    parts = []
    for _, row in rows.iterrows():
        log = results.curves(row, stage)
        if log is None or column not in log:
            continue
        c = log[["step", column]].dropna()
        if len(c):
            parts.append(c.groupby("step", as_index=False)[column].mean().assign(
                seed=row["seed"], label=row["label"], diverged=row.get("status") == "diverged"))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
        columns=["step", column, "seed", "label", "diverged"])


def _draw_variant_curves(ax, sub: pd.DataFrame, column: str, label: str, colour, marker: str | None) -> bool:
    """One variant's mean over its completed seeds with their range shaded, and each diverged trial dashed on its
    own: a diverged trial is in no mean (as in every table), but its curve shows where it went. Whether anything
    was drawn."""
    done, diverged = sub[~sub["diverged"].astype(bool)], sub[sub["diverged"].astype(bool)]
    if len(done):
        agg = done.groupby("step")[column].agg(["mean", "min", "max"]).reset_index()
        # a curve of one logged point is no line: a marker shows it
        ax.plot(agg["step"], agg["mean"], color=colour, lw=1.6, label=f"{label} (n={done['seed'].nunique()})",
                marker=marker or ("o" if len(agg) == 1 else None), ms=3)
        ax.fill_between(agg["step"], agg["min"], agg["max"], color=colour, alpha=0.15, lw=0)
    seeds = list(dict.fromkeys(diverged["seed"]))
    for i, seed in enumerate(seeds):
        one = diverged[diverged["seed"] == seed].sort_values("step")
        name = f"{label}: diverged (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"
        ax.plot(one["step"], one[column], color=colour, lw=1.0, ls="--", alpha=0.8, marker=marker, ms=2,
                label=name if i == 0 else "_nolegend_")
    return bool(len(done) or seeds)


def plot_curves(results: SweepResults, rows: pd.DataFrame, labels: list[str], palette: dict, title: str,
                smooth: int = 5, task: str | None = None, stage: str | None = None) -> Figure:
    """Training (rolling mean over `smooth` logged points) and validation curves against step per variant: the
    columns the task declares comparable across its variants (pretraining: the MLM loss, so a model trained with
    NSP is not drawn with its NSP loss added), the mean over seeds with the range over seeds shaded."""
    task = task or (str(rows["task"].dropna().iloc[0]) if "task" in rows and rows["task"].notna().any()
                    else results.tasks[0])
    curves = results.curve_columns(task)
    panels = []
    for column, name in ((curves["train"], "training"), (curves["valid"], "validation")):
        frame = _curve_frame(results, rows, column, stage)
        frame = frame[frame["label"].isin(labels)]
        if smooth > 1 and column == curves["train"] and len(frame):
            frame[column] = frame.groupby(["label", "seed"])[column].transform(
                lambda s: s.rolling(smooth, min_periods=1).mean())
        if len(frame):  # a column none of these variants logged gets no panel
            panels.append((column, name, frame))
    fig, axes = _new(ncols=max(1, len(panels)), width=5.6)
    series, differ = set(), _not_comparable_curve(results, task, curves["valid"], stage, labels)
    for ax, (column, name, frame) in zip(axes, panels):
        for label in labels:
            sub = frame[frame["label"] == label]
            marker = "o" if column == curves["valid"] else None
            if len(sub) and _draw_variant_curves(ax, sub, column, label, palette.get(label, BASELINE_COLOUR), marker):
                series.add(label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(curve_label(results, task, column, stage))
        ax.set_title(f"{name}: {column}" + (" †" if differ else "")
                     + (f" (rolling mean of {smooth} logs)" if column == curves["train"] and smooth > 1 else ""),
                     fontsize=10)
        ax.grid(alpha=0.3)
    handles, names = axes[-1].get_legend_handles_labels()  # validation: the curves every variant logs
    if handles:
        fig.legend(handles, names, fontsize=7, loc="outside right upper")  # beside the panels, never on data
    dashed = any(frame["diverged"].astype(bool).any() for _, _, frame in panels)
    fig.suptitle(f"{title}\nmean over completed seeds; band: min to max over them"
                 + ("\ndashed: diverged trials (in no mean)" if dashed else "")
                 + (f"\n† not comparable across these variants: the curves are defined by {differ}" if differ
                    else ""), fontsize=10)
    fig._study_columns, fig._study_not_comparable = (curves["train"], curves["valid"]), differ
    return _finish(fig, [lbl for lbl in labels if lbl in series])


# -- 3. quality against cost with the Pareto front ------------------------------------------------------
def _cost_points(done: pd.DataFrame, labels: list[str], metric_col: str, cost: str) -> pd.DataFrame:
    """Per variant with a completed trial and the cost recorded: the metric's mean and 95% t interval (`mean`,
    `ci_lo`, `ci_hi`) and the cost's (`x`, `x_lo`, `x_hi`); empty when no variant has both."""
    if metric_col not in done or cost not in done:
        return pd.DataFrame()
    done = done[finite(done, metric_col)]  # the cost over the same seeds as the metric
    s = summarize(done, metric_col, order=labels, extra=[cost])
    xs = summarize(done, cost, order=labels)
    s = s.assign(x=s[cost], x_lo=xs["ci_lo"], x_hi=xs["ci_hi"])
    return s[s["n"] > 0].dropna(subset=["x", "mean"])


def _cost_panel(ax, s: pd.DataFrame, cost: str, name: str, x_better: str, y_better: str, palette: dict) -> None:
    """One cost's panel: each variant's mean with its intervals on both axes, the Pareto front ringed and joined."""
    front = pareto_front(s["x"], s["mean"], x_better, y_better)
    for (_, r), on_front in zip(s.iterrows(), front):
        colour = palette.get(r["label"], BASELINE_COLOUR)
        yerr = [[r["mean"] - r["ci_lo"]], [r["ci_hi"] - r["mean"]]] if pd.notna(r["ci_lo"]) else None
        xerr = [[r["x"] - r["x_lo"]], [r["x_hi"] - r["x"]]] if pd.notna(r["x_lo"]) and r["x_hi"] > r["x_lo"] else None
        ax.errorbar([r["x"]], [r["mean"]], yerr=yerr, xerr=xerr, fmt="o", color=colour, ms=6, capsize=3, zorder=3)
        if on_front:
            ax.scatter([r["x"]], [r["mean"]], s=180, facecolors="none", edgecolors="black", linewidths=1.2, zorder=4)
    f = s[front].sort_values("x")
    if len(f) > 1:
        ax.plot(f["x"], f["mean"], color="black", lw=1, ls="--", zorder=2)
    ax.set_xlabel(f"{cost_axis(cost, name)[0]} ({x_better} is better)")
    ax.margins(0.08)  # room inside the frame for the labels of points on its edge
    ax.grid(alpha=0.3)
    if cost == "cost.parameters" and s["x"].max() / max(s["x"].min(), 1) > 20:
        ax.set_xscale("log")
    else:  # few ticks: a cost's numbers are long ('7,200,000') and must not run into each other
        ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=4))


def plot_quality_vs_cost(done: pd.DataFrame, labels: list[str], metric_col: str, direction: str, palette: dict,
                         title: str, baseline: str | None = None, ylabel: str | None = None) -> Figure:
    """Mean metric (95% t interval) against each recorded cost per variant; the Pareto front (no variant is both
    cheaper and better) ringed and joined. Every point carries its variant's number, placed where it collides with
    no other label (`label_points`); the legend beside the panels names the numbers. A cost no variant recorded
    gets no panel; with none recorded the figure has no series."""
    panels = [(cost, name, s) for cost, name in COSTS if len(s := _cost_points(done, labels, metric_col, cost))]
    longest = max((len(lbl) for lbl in labels), default=0)
    fig, axes = _new(ncols=max(1, len(panels)), width=4.6, height=4.4)
    # room for the two-line title over one panel, and for the legend beside the panels
    fig.set_figwidth(max(fig.get_figwidth(), 6.4) + 0.75 + 0.055 * longest)
    series, points = set(), []
    numbers = {lbl: i + 1 for i, lbl in enumerate(labels)}
    y_better = "lower" if direction == "minimize" else "higher"
    for ax, (cost, name, s) in zip(axes, panels):
        _cost_panel(ax, s, cost, name, cost_axis(cost, name)[1], y_better, palette)
        ax.set_ylabel(f"{ylabel or metric_label(metric_col)} ({y_better} is better)")
        points.append((ax, [(r["x"], r["mean"], str(numbers[r["label"]]), palette.get(r["label"], BASELINE_COLOUR))
                            for _, r in s.iterrows()]))
        series |= set(s["label"])
    drawn = [lbl for lbl in labels if lbl in series]
    if not drawn:
        return _finish(fig, [])
    handles = [Line2D([], [], marker="o", ls="", color=palette.get(lbl, BASELINE_COLOUR),
                      label=f"{numbers[lbl]}  {lbl}" + (" (baseline)" if lbl == baseline and lbl != "baseline" else ""))
               for lbl in drawn]
    handles.append(Line2D([], [], marker="o", ms=11, mfc="none", mec="black", ls="--", color="black",
                          label="Pareto front"))
    fig.legend(handles=handles, loc="outside right center", fontsize=7)  # clear of the centred title
    fig.suptitle(f"{title}\nquality against cost: mean and 95% t interval; ringed points are on the Pareto front",
                 fontsize=10)
    readable_axes(fig)  # the tick labels the labels are placed around
    label_points(fig, points)
    return _finish(fig, drawn)


# -- 4. perplexity against evaluation length -------------------------------------------------------------
def length_columns(table: pd.DataFrame) -> list[tuple[int, str]]:
    """[(evaluation length, column)] of the `<split>_ppl_by_length.<L>` columns (the corpus's last split)."""
    return by_length_columns(table)[1]


def plot_extrapolation(done: pd.DataFrame, variants: list[tuple[str, str]], palette: dict, title: str,
                       train_len: int | None = None) -> Figure:
    """Perplexity on the corpus's last split (Tiny Shakespeare: validation; WikiText-2: test) against evaluation
    length per position scheme (mean, 95% t band); a scheme that cannot run past its table (learned positions)
    stops where its values stop."""
    fig, (ax,) = _new(width=6.8, height=4.6)
    cols = length_columns(done)
    series = []
    for tick, label in variants:
        sub = done[done["label"] == label]
        pts = [(n, mean_ci(sub[c])) for n, c in cols]
        pts = [(n, ci) for n, ci in pts if ci.n > 0]
        if not pts:
            continue
        colour = palette.get(label, BASELINE_COLOUR)
        xs = [n for n, _ in pts]
        ys = [ci.mean for _, ci in pts]
        stops = len(pts) < len(cols)
        ax.plot(xs, ys, marker="o", color=colour, lw=1.8,
                label=f"{tick} (n={max(ci.n for _, ci in pts)})" + (" - no values past its table" if stops else ""))
        lo = [ci.lo if ci.has_ci else ci.mean for _, ci in pts]
        hi = [ci.hi if ci.has_ci else ci.mean for _, ci in pts]
        ax.fill_between(xs, lo, hi, color=colour, alpha=0.15, lw=0)
        series.append(label)
    if train_len:
        ax.axvline(train_len, color="0.5", ls=":", lw=1)
        ax.annotate("training length", (train_len, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=7, color="0.4")
    if cols:
        ax.set_xscale("log", base=2)
        ax.set_xticks([n for n, _ in cols], [str(n) for n, _ in cols])
    ax.set_xlabel("evaluation length (tokens)")
    split = by_length_columns(done)[0]
    ax.set_ylabel(f"{SPLIT_WORDS.get(split, split)} perplexity" if split else "perplexity")
    ax.set_title(f"{title}\nlength extrapolation: mean and 95% t band over seeds", fontsize=10)
    ax.grid(alpha=0.3)
    if series:
        fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside right center")  # clear of the title
    return _finish(fig, series)


# -- 5. per-layer gradient norms --------------------------------------------------------------------------
def _layer_key(col: str) -> tuple:
    name = col.split("/", 1)[1]
    stack, _, idx = name.partition(".")
    return ({"encoder": 0, "decoder": 1}.get(stack, 2), int(idx) if idx.isdigit() else 99, name)


def plot_grad_norms(results: SweepResults, rows: pd.DataFrame, variants: list[tuple[str, str]], palette: dict,
                    title: str) -> Figure:
    """Gradient norm of each layer's parameters per variant: at the first logged step (initialisation,
    as in Xiong et al. 2020, Fig. 3) and averaged over the rest of training; mean over the completed seeds (a diverged
    trial is in no mean, as the report's banner says of every mean)."""
    if "status" in rows:
        rows = rows[rows["status"] == "completed"]
    series = []
    layer_names: list[str] = []
    per_variant = {}
    for tick, label in variants:
        first, rest = [], []
        for _, row in rows[rows["label"] == label].iterrows():
            log = results.curves(row)
            if log is None:
                continue
            cols = sorted([c for c in log.columns if c.startswith("grad_norm/") and c != "grad_norm/other"],
                          key=_layer_key)
            g = log[["step", *cols]].dropna(subset=cols, how="all") if cols else pd.DataFrame()
            if g.empty:
                continue
            first.append(g.iloc[0][cols])
            if len(g) > 1:
                rest.append(g.iloc[1:][cols].mean())
            layer_names = list(dict.fromkeys(layer_names + [c.split("/", 1)[1] for c in cols]))
        if first:
            per_variant[(tick, label)] = (pd.DataFrame(first), pd.DataFrame(rest) if rest else None)
    panels = [(0, "at the first logged step (initialisation)")]
    if any(rest is not None for _, rest in per_variant.values()):  # one logged step: no 'over training' panel
        panels.append((1, "mean over training"))
    fig, axes = _new(ncols=len(panels), width=5.4)
    for ax, (which, name) in zip(axes, panels):
        for (tick, label), frames in per_variant.items():
            frame = frames[which]
            if frame is None or frame.empty:
                continue
            frame.columns = [c.split("/", 1)[1] for c in frame.columns]
            mean = frame.reindex(columns=layer_names).mean()
            colour = palette.get(label, BASELINE_COLOUR)
            ax.plot(range(len(layer_names)), mean.values, marker="o", color=colour, lw=1.8,
                    label=f"{tick} (n={len(frame)})")
            if label not in series:
                series.append(label)
        ax.set_xticks(range(len(layer_names)), layer_names, rotation=45, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("layer (input side to output side)")
        ax.set_ylabel("gradient L2 norm")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, fontsize=7, loc="outside right upper")
    fig.suptitle(f"{title}\nper-layer gradient norms, mean over completed seeds", fontsize=10)
    return _finish(fig, series)


# -- 6. heatmap for two-axis grids --------------------------------------------------------------------------
NOT_APPLIED = "n/a"  # a conditional axis's value where its `when` leaves it out (the recipe's setting holds there)


def _held_text(held: dict[str, str]) -> str:
    return ", ".join(f"{a}={v}" for a, v in held.items()) if held else "no other axis"


def plot_heatmap(done: pd.DataFrame, axis_a: str, axis_b: str, values_a: list[str], values_b: list[str],
                 metric_col: str, direction: str, title: str, held: dict[str, str] | None = None,
                 label: str | None = None) -> Figure:
    """Mean ± 95% t half-width of `metric_col` per (axis_a, axis_b) cell over the trials that hold every other axis
    at `held` (the baseline's values): each cell is one config, so its n counts seeds, never other configs
    pooled as if they were seeds. A cell with no such trial says so in grey (seaborn writes nothing on an empty
    cell)."""
    held = dict(held or {})
    keep = pd.Series(True, index=done.index)
    for axis, value in held.items():
        keep &= done[f"axis.{axis}"].astype(str) == str(value) if f"axis.{axis}" in done else False
    rows = done[keep]
    fig, (ax,) = _new(width=1.3 * len(values_b) + 3, height=0.9 * len(values_a) + 2.2)
    mean = pd.DataFrame(np.nan, index=values_a, columns=values_b)
    annot = pd.DataFrame("", index=values_a, columns=values_b)
    for a in values_a:
        for b in values_b:
            sub = rows[(rows[f"axis.{axis_a}"] == a) & (rows[f"axis.{axis_b}"] == b)]
            ci = mean_ci(sub[metric_col]) if metric_col in sub else mean_ci([])
            if ci.n:
                mean.loc[a, b] = ci.mean
                spread = f"±{ci.half_width:.2g}" if ci.has_ci else "no CI" if ci.n == 1 else "no spread"
                annot.loc[a, b] = f"{ci.mean:.4g}\n{spread}\nn={ci.n}"
    cmap = "rocket_r" if direction == "maximize" else "rocket"
    ax.set_facecolor("0.93")  # an empty cell is left transparent by seaborn: grey, never a colour of the scale
    sns.heatmap(mean.astype(float), annot=annot, fmt="", cmap=cmap, ax=ax, linewidths=0.5, linecolor="white",
                cbar_kws={"label": label or metric_label(metric_col)}, annot_kws={"fontsize": 7})
    for i, a in enumerate(values_a):
        for j, b in enumerate(values_b):
            if pd.isna(mean.loc[a, b]):
                ax.text(j + 0.5, i + 0.5, _empty_cell_text(rows, axis_a, axis_b, a, b), ha="center", va="center",
                        fontsize=7, color="0.35")
    ax.set_xlabel(axis_b)
    ax.set_ylabel(axis_a)
    ax.set_title(f"{title}\nmean ± 95% t half-width over seeds; held: {_held_text(held)}", fontsize=10)
    return _finish(fig, [f"{a}|{b}" for a in values_a for b in values_b if pd.notna(mean.loc[a, b])])


def not_applied(column: pd.Series) -> pd.Series:
    """Where an axis column says the axis does not apply to a trial (n/a, or empty as results.csv writes it)."""
    return column.isna() | (column.astype(str) == NOT_APPLIED)


def _empty_cell_text(rows: pd.DataFrame, axis_a: str, axis_b: str, a: str, b: str) -> str:
    """Why a heatmap cell is empty: no trial ran there, or trials ran with one of its axes not applying and their
    having run that axis's fields otherwise than the baseline (holding_baseline)."""
    col_a, col_b = rows[f"axis.{axis_a}"], rows[f"axis.{axis_b}"]
    na_a, na_b = not_applied(col_a), not_applied(col_b)
    if ((col_a == a) & na_b).any():
        return f"ran: {axis_b}\nnot applied"
    if (na_a & (col_b == b)).any():
        return f"ran: {axis_a}\nnot applied"
    return "no run"


def holding_baseline(results: SweepResults, rows: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """`rows` with each of `axes` read as the baseline's value where the axis does not apply to a trial (n/a) but
    the trial ran every field the axis sets as the baseline did (`SweepResults.set_alike`: as they ran, an unset
    field resolved, where the table records it), so that such a trial holds the axis as the baseline does and no
    other trial seems to."""
    rows = rows.copy()
    base_value, base_label = results.baseline_values(), results.baseline_label
    fields = results.plan.get("axis_fields") or {}
    for axis in axes:
        col, want = f"axis.{axis}", base_value.get(axis)
        if col not in rows or want is None or not fields.get(axis):
            continue
        for label in rows.loc[not_applied(rows[col]), "label"].unique():
            if results.set_alike((str(label), base_label), fields[axis]):
                rows.loc[rows["label"] == label, col] = want
    return rows


# -- orchestration --------------------------------------------------------------------------------------------
def save_figure(fig: Figure, directory: Path, name: str, formats=("png", "svg")) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, ext in enumerate(formats):
        path = directory / f"{name}.{ext}"
        # No date and fixed element ids in an SVG: regenerating a committed report rewrites no unchanged figure.
        with matplotlib.rc_context({"svg.hashsalt": name}):
            fig.savefig(path, dpi=150 if ext == "png" else None, metadata={"Date": None} if ext == "svg" else None)
        paths.append(path)
        if i == 0:  # the layout is settled by the first draw; don't solve it again for the other formats
            try:
                fig.set_layout_engine("none")
            except RuntimeError:  # a colorbar under constrained layout: keep the engine
                pass
    return paths


KINDS = ("paired", "metric", "curves", "cost", "extrapolation", "grad_norms", "heatmap")
MAX_CURVES = 12  # variants one grid curves figure draws: more lines than its palette tells apart


@dataclass
class _TaskFigures:
    """What every figure of one task needs: its trials, objective and its declared label, and where to save."""

    results: SweepResults
    task: str
    palette: dict
    emit: object  # emit(fig, name, title, kind, task, axis=None)
    skip: object  # skip(name, title, kind, task, axis, reason): a figure the results cannot draw, and why
    family: list = field(default_factory=list)  # family.paired_family: the report's Holm-corrected paired tests

    def __post_init__(self) -> None:
        r, task = self.results, self.task
        self.done = r.completed(task)
        self.rows = r.table[(r.table["task"] == task) & r.table["status"].isin(("completed", "diverged"))]
        self.name, self.direction = r.objective(task)
        self.mcol = metric_column(self.name)
        self.ylabel = metric_label(self.mcol, r.declared(self.name, task).scale)
        dataset = r.datasets_for(task)
        self.head = f"{r.sweep}: {task}" + (f" on {dataset}" if dataset else "")
        self.prefix, self.labels, self.base = f"{task}-", r.labels_for(task), r.baseline_label
        one_factor = {axis: r.axis_labels(axis) for axis in r.axes}
        self.one_factor = {a: v for a, v in one_factor.items() if len(v) >= 2}

    def paired(self) -> None:
        """The headline: the verdicts' paired differences, every variant against the baseline."""
        others = [lbl for lbl in self.labels if lbl != self.base]
        if not others:
            return
        if self.mcol not in self.done:
            if len(self.done):  # completed trials that wrote no value of the objective: say so under the figures
                self.skip(f"{self.prefix}{self.name}-paired-differences", f"{self.name}: paired differences",
                          "paired", self.task, None, f"no completed trial has a value of {self.name}")
            return
        paired = next((t.table for t in self.family if t.task == self.task and t.column == self.mcol), None)
        if paired is None:
            return
        fig = plot_paired_differences(paired, f"{self.head}: {self.name}", f"Δ {self.ylabel}", self.direction)
        if fig._study_series:
            self.emit(fig, f"{self.prefix}{self.name}-paired-differences",
                      f"{self.name}: paired difference of each variant against the baseline", "paired", self.task)
        else:
            self.skip(f"{self.prefix}{self.name}-paired-differences", f"{self.name}: paired differences", "paired",
                      self.task, None, "no variant shares a completed seed with the baseline")

    def metric(self) -> None:
        """Every variant, then one figure per axis; one where no variant has a finite value is not drawn."""
        figures = [(None, [(lbl, lbl) for lbl in self.labels], "every variant", "all-variants", "for every variant")]
        figures += [(axis, variants, axis, f"by-{axis}", f"by {axis}") for axis, variants in self.one_factor.items()]
        for axis, variants, heading, suffix, words in figures:
            fig = plot_metric_by_variant(self.done, variants, self.mcol, self.palette, f"{self.head}: {heading}",
                                         baseline=self.base, xlabel=axis or "variant", ylabel=self.ylabel)
            name, title = f"{self.prefix}{self.name}-{suffix}", f"{self.name} {words}"
            if fig._study_series:
                self.emit(fig, name, title, "metric", self.task, axis)
            else:
                self.skip(name, title, "metric", self.task, axis, f"no completed trial has a value of {self.name}")

    def curves(self) -> None:
        """Per axis for one-factor slices, else all variants. A study in stages: each earlier stage's curves (the
        curves its own task declares, e.g. pretraining's MLM loss); the last stage of a suite (GLUE) has one curve
        per task and seed, none comparable across tasks, and is not drawn."""
        groups = ({a: [lbl for _, lbl in v] for a, v in self.one_factor.items()} if self.results.design == "ofat"
                  else {"all": self.labels[:MAX_CURVES]})
        shown = {"all": f"the first {MAX_CURVES} of {len(self.labels)} variants"} if len(self.labels) > MAX_CURVES \
            else {}  # more lines than a palette tells apart: the heading says which are drawn
        stages = [(s, self.results.stage_tasks.get(s)) for s in self.results.stages[:-1]] or [(None, self.task)]
        for stage, task in stages:
            if task is None:
                continue
            where = f"{stage} stage " if stage else ""
            for axis, group in groups.items():
                fig = plot_curves(self.results, self.rows, group, self.palette,
                                  f"{self.head}: {where}training curves, {shown.get(axis, axis)}", task=task,
                                  stage=stage)
                name = f"{self.prefix}{stage + '-' if stage else ''}curves-{axis}"
                title = f"{where}training and validation curves, {shown.get(axis, axis)}"
                if fig._study_series:
                    self.emit(fig, name, title + (f" († not comparable across them: the curves are defined by "
                                                  f"{fig._study_not_comparable})" if fig._study_not_comparable else ""),
                              "curves", self.task, axis)
                else:
                    self.skip(name, title, "curves", self.task, axis, NO_CURVES)

    def cost(self) -> None:
        fig = plot_quality_vs_cost(self.done, self.labels, self.mcol, self.direction, self.palette, self.head,
                                   baseline=self.base, ylabel=self.ylabel)
        name, title = f"{self.prefix}{self.name}-vs-cost", f"{self.name} against cost, Pareto front"
        if fig._study_series:
            self.emit(fig, name, title, "cost", self.task)
        else:
            self.skip(name, title, "cost", self.task, None, "no completed trial recorded both "
                      f"{self.name} and a cost ({', '.join(c for c, _ in COSTS)})")

    def extrapolation(self) -> None:
        if not length_columns(self.done):
            return
        pos = self.one_factor.get("position") or [(lbl, lbl) for lbl in self.labels]
        train_len = ((self.results.experiment_config(self.base).get("task") or {}).get("seq_len")
                     or length_columns(self.done)[0][0])
        fig = plot_extrapolation(self.done, pos, self.palette, f"{self.head}: perplexity by evaluation length",
                                 train_len=train_len)
        if fig._study_series:
            self.emit(fig, f"{self.prefix}extrapolation", "perplexity against evaluation length per position scheme",
                      "extrapolation", self.task, "position")

    def grad_norms(self) -> None:
        """Post- against pre-norm."""
        if "norm_position" not in self.one_factor:
            return
        fig = plot_grad_norms(self.results, self.rows, self.one_factor["norm_position"], self.palette,
                              f"{self.head}: norm position")
        name, title = f"{self.prefix}grad-norms-norm_position", "per-layer gradient norms, post- vs pre-norm"
        if fig._study_series:
            self.emit(fig, name, title, "grad_norms", self.task, "norm_position")
        else:
            self.skip(name, title, "grad_norms", self.task, "norm_position", NO_CURVES)

    def heatmap(self) -> None:
        """Grids: per pair of axes, the cells that hold every other axis at the baseline's value (named in the
        title). One with fewer than two cells run at that setting compares nothing and is not drawn."""
        r = self.results
        if r.design != "grid":
            return
        grid_axes = [a for a, v in r.axes.items() if len(v) >= 2 and f"axis.{a}" in self.done]
        base = r.baseline_values()
        for a, b in combinations(grid_axes, 2):
            held = {x: base[x] for x in grid_axes if x not in (a, b) and x in base}
            # (the plotted axes too: a trial the axis does not apply to sits in the baseline value's cell where it
            # ran that value's fields, as (post, mha) ran 4 KV heads)
            rows = holding_baseline(r, self.done, [a, b, *held])
            fig = plot_heatmap(rows, a, b, r.axes[a], r.axes[b], self.mcol, self.direction,
                               f"{self.head}: {self.name}", held, label=self.ylabel)
            name, title = f"{self.prefix}{self.name}-heatmap-{a}-{b}", f"{self.name} over {a} × {b}"
            if len(fig._study_series) >= 2:
                self.emit(fig, name, title + f" at {_held_text(held)}", "heatmap", self.task, f"{a}×{b}")
            else:
                self.skip(name, title, "heatmap", self.task, f"{a}×{b}",
                          f"at {_held_text(held)} (the baseline's) {len(fig._study_series)} of its "
                          f"{len(r.axes[a]) * len(r.axes[b])} cells ran: nothing to compare (cells at other "
                          "settings are never pooled as seeds; a trial an axis does not apply to holds it only where "
                          f"it ran that axis's fields as the baseline did{_unrecorded(r)})")


def _unrecorded(results: SweepResults) -> str:
    """What a table written before it recorded the fields each trial ran (`config.*`) leaves the heatmap: only the
    planned configs, in which the report cannot read an unset field as its default."""
    if any(str(c).startswith("config.") for c in results.table.columns):
        return ""
    return ("; this results table does not record the fields as they ran, so the planned configs are compared and "
            "an unset field is not read as its default: rebuild it with `study results`")


NO_CURVES = ("no logged curves: neither the trials' run directories nor the results folder's curves.parquet hold "
             "them")


def make_figures(results: SweepResults, out: str | Path, formats=("png", "svg"), kinds=KINDS) -> list[FigureInfo]:
    """Every figure the results allow, saved under <out>/figures/ (PNG and SVG by default); `kinds`
    restricts which families are drawn. A figure the results cannot draw is returned with its reason and no paths;
    figure files of an earlier report that this one did not draw are removed, so no stale figure is left behind."""
    out = Path(out) / "figures"
    palette = variant_palette(results.variant_order, results.baseline_label)
    infos: list[FigureInfo] = []

    def emit(fig: Figure, name: str, title: str, kind: str, task: str, axis: str | None = None):
        paths = save_figure(fig, out, slug(name), formats)
        infos.append(FigureInfo(slug(name), title, kind, task, axis, list(getattr(fig, "_study_series", [])), paths))

    def skip(name: str, title: str, kind: str, task: str, axis: str | None, reason: str):
        infos.append(FigureInfo(slug(name), title, kind, task, axis, [], [], reason))

    family = paired_family(results) if "paired" in kinds else []
    for task in results.tasks:
        figures = _TaskFigures(results, task, palette, emit, skip, family)
        for kind in KINDS:
            if kind in kinds:
                getattr(figures, kind)()
    if set(kinds) == set(KINDS) and out.is_dir():
        _remove_stale(out, {p for f in infos for p in f.paths})
    return infos


def _remove_stale(folder: Path, drawn: set[Path]) -> None:
    """Remove the figures the earlier report in this folder drew (its report.md links them) that this one did not:
    no stale figure is left behind, and a file of the user's own in the folder is never touched."""
    import re

    earlier = folder.parent / "report.md"
    linked = set(re.findall(r"figures/([^)\s\"'<>]+)\.(?:png|svg|pdf)", earlier.read_text(errors="replace"))
                 ) if earlier.is_file() else set()
    for stale in [p for p in folder.iterdir() if p.suffix in (".png", ".svg", ".pdf") and p.stem in linked
                  and p not in drawn]:
        stale.unlink()
