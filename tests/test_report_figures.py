"""study.report's figures as a reader sees them: one distinct colour per variant (up to 20) that a variant keeps in
every figure, point labels of the cost/Pareto figure that never collide, an outlying seed shown without squashing the
rest, no empty panels, and axis numbers that read (thousands separators; no '1e-17' on constant data)."""

from __future__ import annotations

import io
from itertools import combinations

import matplotlib
import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

matplotlib.use("Agg")

from study.report.collect import load_results  # noqa: E402
from study.report.figure_layout import POINT_LABEL, ReadableFormatter, _lab, bulk_limits  # noqa: E402
from study.report.figures import (  # noqa: E402
    BASELINE_COLOUR,
    make_figures,
    plot_curves,
    plot_grad_norms,
    plot_metric_by_variant,
    plot_quality_vs_cost,
    variant_palette,
)
from synthetic_sweep import make_synthetic_sweep  # noqa: E402

METRIC = "metric.valid_loss"


def _drawn(fig):
    """Draw `fig` as save_figure does (PNG at 150 dpi) and return its renderer, to measure what was drawn."""
    canvas = FigureCanvasAgg(fig)
    fig.savefig(io.BytesIO(), format="png", dpi=150)
    return canvas.get_renderer()


def _table(values: dict[str, list[float]], **costs: dict[str, float]) -> pd.DataFrame:
    """Completed trials: one row per (variant, seed) with `METRIC`, and each cost column as given per variant."""
    rows = [{"label": label, "seed": seed, METRIC: v, **{f"cost.{c}": per[label] for c, per in costs.items()}}
            for label, vals in values.items() for seed, v in enumerate(vals)]
    return pd.DataFrame(rows)


def _rgb(colour) -> tuple:
    return tuple(round(c, 6) for c in matplotlib.colors.to_rgb(colour))


# -- one colour per variant ----------------------------------------------------------------------------------------
def test_twenty_variants_get_twenty_distinct_colours_and_the_baseline_keeps_its_grey():
    labels = ["baseline", *[f"axis=v{i}" for i in range(20)]]
    palette = variant_palette(labels, "baseline")
    others = [palette[lbl] for lbl in labels[1:]]
    assert palette["baseline"] == BASELINE_COLOUR
    assert len({_rgb(c) for c in others}) == 20 and _rgb(BASELINE_COLOUR) not in {_rgb(c) for c in others}
    # distinct to the eye, not merely unequal: every pair (and each against the grey) apart in CIE L*a*b*
    closest = min(np.linalg.norm(_lab(a) - _lab(b)) for a, b in combinations([BASELINE_COLOUR, *others], 2))
    assert closest > 15
    # the first ten keep tab10's familiar order, so small studies look as they always did
    assert _rgb(palette["axis=v0"]) == _rgb("tab:blue") and _rgb(palette["axis=v1"]) == _rgb("tab:orange")


def test_a_variant_has_the_same_colour_in_every_figure():
    labels = ["baseline", *[f"a={i}" for i in range(12)]]
    palette = variant_palette(labels, "baseline")
    done = _table({lbl: [2.0 + i / 10, 2.01 + i / 10] for i, lbl in enumerate(labels)},
                  parameters={lbl: 1000 * (i + 1) for i, lbl in enumerate(labels)})
    metric = plot_metric_by_variant(done, [(lbl, lbl) for lbl in labels], METRIC, palette, "t", baseline="baseline")
    cost = plot_quality_vs_cost(done, labels, METRIC, "minimize", palette, "t", baseline="baseline")
    in_metric = [_rgb(c.lines[0].get_color()) for c in metric.axes[0].containers]
    in_cost = [_rgb(c.lines[0].get_color()) for c in cost.axes[0].containers]
    assert in_metric == in_cost == [_rgb(palette[lbl]) for lbl in labels]
    assert in_metric[0] == _rgb(BASELINE_COLOUR) and len(set(in_metric)) == len(labels)  # 12 others: none repeats


# -- the cost/Pareto figure: labels never collide -----------------------------------------------------------------------
def _crowded_costs(n: int = 20) -> tuple[pd.DataFrame, list[str]]:
    """`n` variants whose points sit almost on top of each other: one parameter count, KV cache in two values, and
    metrics a hair apart, as a study of attention-free changes gives."""
    labels = ["baseline", *[f"position=scheme{i}" for i in range(n - 1)]]
    far = len(labels) - 1  # one variant far off, as failed post-norm is, so that the rest crowd together
    done = _table({lbl: [2.0 + 0.0005 * i, 2.001 + 0.0005 * i] if i < far else [2.5, 2.6]
                   for i, lbl in enumerate(labels)},
                  parameters={lbl: 812_000 for lbl in labels},
                  kv_cache_bytes_per_token={lbl: 4096 if i % 2 else 1024 for i, lbl in enumerate(labels)},
                  train_tokens_per_s={lbl: 14_000 + 3 * i if i < far else 20_000 for i, lbl in enumerate(labels)})
    return done, labels


def test_the_cost_figure_labels_every_point_and_no_two_labels_overlap():
    done, labels = _crowded_costs()
    fig = plot_quality_vs_cost(done, labels, METRIC, "minimize", variant_palette(labels, "baseline"), "t",
                               baseline="baseline")
    renderer = _drawn(fig)
    panels = [ax for ax in fig.axes if ax.has_data()]
    assert len(panels) == 3
    for ax in panels:
        texts = [t for t in ax.texts if t.get_gid() == POINT_LABEL]
        assert sorted(t.get_text() for t in texts) == sorted(str(i + 1) for i in range(len(labels)))
        boxes = [t.get_window_extent(renderer) for t in texts]
        # the points themselves crowd (a label at one fixed offset would collide) ...
        centres = ax.transData.transform([t.xy for t in texts])
        assert min(np.linalg.norm(a - b) for a, b in combinations(centres, 2)) < 5
        # ... and yet no two labels overlap, and each stays inside its panel
        overlapping = [(a.get_text(), b.get_text()) for (a, p), (b, q) in combinations(zip(texts, boxes), 2)
                       if p.overlaps(q)]
        assert overlapping == []
        frame = ax.get_window_extent(renderer)
        assert all(frame.x0 - 1 <= b.x0 and b.x1 <= frame.x1 + 1 and frame.y0 - 1 <= b.y0 and b.y1 <= frame.y1 + 1
                   for b in boxes)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:2] == ["1  baseline", "2  position=scheme0"]  # the numbers are named beside the panels


def test_the_cost_figure_tick_labels_are_separated_and_never_collide():
    done, labels = _crowded_costs(4)
    done["cost.parameters"] = done["label"].map({lbl: 6_700_000 + 300_000 * i for i, lbl in enumerate(labels)})
    fig = plot_quality_vs_cost(done, labels, METRIC, "minimize", variant_palette(labels, "baseline"), "t")
    renderer = _drawn(fig)
    params = next(ax for ax in fig.axes if ax.get_xlabel().startswith("parameters"))
    ticks = [t for t in params.get_xticklabels() if t.get_text()]
    assert any(t.get_text().count(",") == 2 for t in ticks)  # '7,000,000'
    assert params.xaxis.get_offset_text().get_text() == ""  # no '1e6' beside the axis
    boxes = [t.get_window_extent(renderer) for t in ticks]
    assert not any(a.overlaps(b) for a, b in combinations(boxes, 2))


# -- empty panels are dropped ----------------------------------------------------------------------------------------
def test_a_cost_nobody_recorded_gets_no_panel_and_no_cost_no_figure(tmp_path):
    done, labels = _crowded_costs(3)
    palette = variant_palette(labels, "baseline")
    fig = plot_quality_vs_cost(done.drop(columns=["cost.kv_cache_bytes_per_token", "cost.train_tokens_per_s"]),
                               labels, METRIC, "minimize", palette, "t")
    assert [ax.get_xlabel().split(" (")[0] for ax in fig.axes] == ["parameters"]
    no_cost = done[["label", "seed", METRIC]]
    assert plot_quality_vs_cost(no_cost, labels, METRIC, "minimize", palette, "t")._study_series == []

    root = make_synthetic_sweep(tmp_path / "s", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False, seeds=(0, 1))
    t = pd.read_parquet(root / "results.parquet")
    t.drop(columns=[c for c in t.columns if c.startswith("cost.")]).to_parquet(root / "results.parquet")
    (figure,) = make_figures(load_results(root), tmp_path / "out", formats=("png",), kinds=("cost",))
    assert not figure.paths and "no completed trial recorded both valid_loss and a cost" in figure.reason


def test_a_metric_no_variant_has_is_not_drawn(tmp_path):
    root = make_synthetic_sweep(tmp_path / "s", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False, seeds=(0, 1))
    t = pd.read_parquet(root / "results.parquet")
    t.assign(**{METRIC: np.nan}).to_parquet(root / "results.parquet")
    figures = make_figures(load_results(root), tmp_path / "out", formats=("png",), kinds=("metric",))
    assert figures and all(not f.paths and "no completed trial has a value of valid_loss" in f.reason
                           for f in figures)
    assert not list((tmp_path / "out" / "figures").glob("*.png"))


def test_regenerating_a_figure_rewrites_the_same_svg_bytes(tmp_path):
    """A committed report's figures do not change when nothing they show changed: no date, no random element ids."""
    root = make_synthetic_sweep(tmp_path / "s", axes={"norm": ["rmsnorm", "layernorm"]}, partial=False,
                                problems=False, with_runs=False, seeds=(0, 1))
    drawn = []
    for out in ("a", "b"):
        (figure,) = make_figures(load_results(root), tmp_path / out, formats=("svg",), kinds=("paired",))
        (path,) = figure.paths
        drawn.append(path.read_bytes())
    assert drawn[0] == drawn[1]
    assert b"<dc:date>" not in drawn[0]


class _CurvesOnlyTraining:
    """Results whose logs hold training losses and one gradient-norm step only: no validation curve at all."""

    def curve_columns(self, task):
        return {"train": "train/loss", "valid": "val/loss"}

    def declaration(self, name, task):
        return None

    def curves(self, row, stage=None):
        steps = np.arange(0, 50, 10)
        return pd.DataFrame({"step": steps, "train/loss": 3.0 - steps / 100 - row["seed"] / 50,
                             "grad_norm/decoder.0": 1.0, "grad_norm/decoder.1": 2.0}).iloc[: 5 if row["seed"] else 1]


def test_a_curve_no_variant_logged_gets_no_panel():
    rows = pd.DataFrame({"label": ["baseline", "baseline", "norm=layernorm"], "seed": [0, 1, 0], "task": "lm"})
    palette = variant_palette(["baseline", "norm=layernorm"], "baseline")
    fig = plot_curves(_CurvesOnlyTraining(), rows, ["baseline", "norm=layernorm"], palette, "t")
    assert len(fig.axes) == 1 and fig.axes[0].get_title().startswith("training")
    assert fig._study_series == ["baseline", "norm=layernorm"]
    # gradient norms logged at one step only (seed 0): the 'mean over training' panel is dropped
    fig = plot_grad_norms(_CurvesOnlyTraining(), rows[rows["seed"] == 0], [("pre", "baseline")], palette, "t")
    assert [ax.get_title() for ax in fig.axes] == ["at the first logged step (initialisation)"]


def test_a_training_curve_of_one_logged_point_is_drawn_as_a_marker():
    """A run short enough to log once drew a line of one point: an empty panel listed as drawn."""
    rows = pd.DataFrame({"label": ["baseline"], "seed": [0], "task": "lm"})
    fig = plot_curves(_CurvesOnlyTraining(), rows, ["baseline"], variant_palette(["baseline"], "baseline"), "t")
    line = next(line for line in fig.axes[0].get_lines() if line.get_label().startswith("baseline"))
    assert len(line.get_xdata()) == 1 and line.get_marker() == "o"


# -- an outlying seed is shown, not allowed to squash the rest ---------------------------------------------------------
def test_an_outlying_seed_is_pinned_to_the_edge_and_the_axis_keeps_to_the_bulk():
    labels = ["baseline", "norm_position=post", "norm=layernorm", "position=alibi"]
    values = {"baseline": [1.99, 2.01, 2.00], "norm_position=post": [2.12, 2.13, 9.5],  # one failed post-norm seed
              "norm=layernorm": [1.97, 1.98, 1.99], "position=alibi": [2.40, 2.42, 2.41]}
    fig = plot_metric_by_variant(_table(values), [(lbl, lbl) for lbl in labels], METRIC,
                                 variant_palette(labels, "baseline"), "t", baseline="baseline")
    _drawn(fig)
    lo, hi = fig.axes[0].get_ylim()
    assert 1.85 < lo < 1.97 and 2.42 < hi < 2.6  # the bulk fills the axis: 9.5 would have squashed it
    pinned = [t.get_text() for t in fig.axes[0].texts if t.get_gid() == "pinned"]
    assert "seed 9.5" in pinned  # shown, with its value
    assert any(text.startswith("95% CI to") for text in pinned)  # the interval it widens runs off the edge too
    edge = [c for c in fig.axes[0].collections if c.get_offsets().size and
            np.allclose(c.get_offsets()[:, 1], hi)]
    assert edge  # a marker on the top edge where the outlier passed


def test_spread_seeds_without_an_outlier_keep_the_full_axis():
    """Wide intervals from honest spread (Multi30k's BLEU over 3 seeds) are not 'outliers': everything is drawn."""
    groups = {"a": [17.9, 18.0, 21.1], "b": [16.1, 13.9, 16.8], "c": [20.2, 21.6, 15.0], "d": [3.0, 3.7, 4.0],
              "e": [19.6, 24.3, 16.6]}
    assert bulk_limits({k: pd.Series(v) for k, v in groups.items()}) is None
    assert bulk_limits({"a": pd.Series([2.0, 2.0]), "b": pd.Series([2.1, 2.1])}) is None


# -- readable axis numbers -------------------------------------------------------------------------------------------
def test_axis_numbers_have_thousands_separators_and_only_the_decimals_they_need():
    fmt = ReadableFormatter()
    assert fmt.format_ticks([0, 250_000, 500_000]) == ["0", "250,000", "500,000"]
    assert fmt.format_ticks([0.1, 0.2, 0.30000000000000004]) == ["0.1", "0.2", "0.3"]
    assert fmt.format_ticks([-2.5, 0, 2.5]) == ["\N{MINUS SIGN}2.5", "0.0", "2.5"]
    assert fmt.format_ticks([1200.5, 1201.0]) == ["1,200.5", "1,201.0"]


@pytest.mark.parametrize("value", [2.0, 0.0, 812_000.0])
def test_constant_data_get_a_sensible_range_not_a_float_noise_axis(value):
    noise = [value + k * 1e-14 * max(1, value) for k in range(3)]  # equal to float noise, as sums of floats are
    labels = ["baseline", "norm=layernorm"]
    fig = plot_metric_by_variant(_table({lbl: noise for lbl in labels}), [(lbl, lbl) for lbl in labels], METRIC,
                                 variant_palette(labels, "baseline"), "t", baseline="baseline")
    _drawn(fig)
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    assert lo < value < hi and hi - lo >= 0.05 * max(abs(value), 1)
    assert ax.yaxis.get_offset_text().get_text() == ""
    labels_drawn = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert len(set(labels_drawn)) == len(labels_drawn) > 2 and not any("e" in t for t in labels_drawn)


def test_a_grid_curves_figure_of_more_variants_than_it_draws_says_which_it_draws(tmp_path):
    """A grid's curves figure draws the first 12 variants (more lines than its palette tells apart): its heading
    says so, instead of calling 12 of 16 'all'."""
    from study.report.figures import make_figures

    axes = {"norm_position": ["pre", "post"], "position": ["rope", "alibi", "learned", "sinusoidal"],
            "norm": ["rmsnorm", "layernorm"]}
    root = make_synthetic_sweep(tmp_path / "grid", design="grid", axes=axes, partial=False, problems=False)
    figures = make_figures(load_results(root), tmp_path / "out", formats=("png",), kinds=("curves",))
    (curves,) = [f for f in figures if f.kind == "curves"]
    assert curves.title.endswith("training and validation curves, the first 12 of 16 variants"), curves.title
    small = make_synthetic_sweep(tmp_path / "small", design="grid", partial=False, problems=False)
    (curves,) = [f for f in make_figures(load_results(small), tmp_path / "out2", formats=("png",), kinds=("curves",))
                 if f.kind == "curves"]
    assert curves.title.endswith("training and validation curves, all")
