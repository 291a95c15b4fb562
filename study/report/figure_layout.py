"""Layout rules every report figure follows, kept apart from what the figures draw: one distinct colour per variant,
readable axis numbers, point labels that never collide, and axis limits an outlying seed cannot squash."""

from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib import patheffects, ticker
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from study.report.stats import mean_ci

BASELINE_COLOUR = (0.15, 0.15, 0.15)
N_DISTINCT = 20  # variants that get a colour of their own; past that the colours repeat


def _lab(rgb) -> np.ndarray:
    """CIE L*a*b* of an sRGB colour (D65): distances there follow what the eye tells apart, unlike RGB's."""
    c = np.asarray(rgb, float)
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ c
    f = np.cbrt(xyz / np.array([0.95047, 1.0, 1.08883]))
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def distinct_colours(n: int = N_DISTINCT) -> list[tuple]:
    """`n` colours that differ from each other and from the baseline's grey: tab10's nine hues first (its grey is the
    baseline's), then, as in Glasbey et al. 2007, repeatedly the colour of matplotlib's qualitative palettes farthest
    (in L*a*b*) from every colour already chosen; near-white colours, unreadable on white, are left out."""
    chosen = [tuple(c) for i, c in enumerate(sns.color_palette("tab10", 10)) if i != 7]
    pool = [tuple(c) for name in ("tab20", "tab20b", "Set1", "Dark2", "Paired")
            for c in sns.color_palette(name) if _lab(c)[0] < 80]
    taken = [_lab(c) for c in [BASELINE_COLOUR, *chosen]]
    while len(chosen) < n:
        distance = [min(np.linalg.norm(_lab(c) - t) for t in taken) for c in pool]
        best = pool[int(np.argmax(distance))]
        chosen.append(best)
        taken.append(_lab(best))
    return chosen[:n]


# -- axis numbers ------------------------------------------------------------------------------------------------------
def number(value: float) -> str:
    """A value as a label: thousands separated when large (720,000), three significant digits otherwise."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


class ReadableFormatter(ticker.Formatter):
    """Tick labels with thousands separators and as many decimals as the ticks need, never an offset or a power of
    ten written beside the axis ('720,000', not '7.2' under a '1e5')."""

    def __call__(self, x, pos=None) -> str:
        return self.format_ticks([x])[0]

    def format_ticks(self, values) -> list[str]:
        values = np.asarray(values, float)
        tolerance = 1e-9 * max(1.0, float(np.abs(values).max())) if len(values) else 0
        decimals = next((d for d in range(9) if np.allclose(np.round(values, d), values, rtol=0, atol=tolerance)), 9)
        return [f"{v + 0.0:,.{decimals}f}".replace("-", "\N{MINUS SIGN}") for v in values]


def _constant(lo: float, hi: float) -> bool:
    """Whether lo..hi is one value up to float noise (relative 1e-9; absolute 1e-12 around zero)."""
    return hi - lo <= max(1e-9 * max(abs(lo), abs(hi)), 1e-12)


def readable_axes(fig: Figure) -> None:
    """Every linear numeric axis of `fig` gets the readable tick labels; an axis whose data are constant (to float
    noise) gets a range of ±5% around the value, not matplotlib's range of the noise with a '1e-17' beside it."""
    for ax in fig.axes:
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            if axis.get_scale() != "linear" or type(axis.get_major_formatter()) is not ticker.ScalarFormatter:
                continue  # log axes and categorical (fixed) tick labels keep theirs
            axis.set_major_formatter(ReadableFormatter())
            lo, hi = ax.dataLim.intervalx if name == "x" else ax.dataLim.intervaly
            auto = ax.get_autoscalex_on() if name == "x" else ax.get_autoscaley_on()
            if auto and np.isfinite([lo, hi]).all() and _constant(lo, hi):
                mid = (lo + hi) / 2
                pad = 1.0 if _constant(0.0, abs(mid)) else 0.05 * abs(mid)
                getattr(ax, f"set_{name}lim")(mid - pad, mid + pad)


# -- point labels that never collide ---------------------------------------------------------------------------------
# Offsets (points) tried in turn for a label: nearest first, up-right first, then round the point.
LABEL_OFFSETS = [(r * np.cos(np.radians(a)), r * np.sin(np.radians(a)))
                 for r in (8, 13, 19, 26, 34, 44, 56) for a in (45, 0, 90, -45, 135, 180, -90, -135)]
MARKER_RADIUS_PT = 7  # the Pareto front's ring
HALO = patheffects.withStroke(linewidth=2.5, foreground="white")  # a label stays legible over a line
POINT_LABEL = "point-label"  # the gid of a point's label, so that tests and readers can find them


def label_points(fig: Figure, points_by_axes: list[tuple[object, list[tuple[float, float, str, object]]]]) -> None:
    """Write each (x, y, text, colour) beside its point, at the first of LABEL_OFFSETS where the label overlaps no
    label already placed, stays inside the axes and covers no point's marker (in that order of importance), so that
    labels never collide however the points crowd; the same figure always gets the same places. The layout is
    settled first, and the labels are left out of it, so the places computed are the places drawn."""
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    to_px = fig.dpi / 72
    for ax, points in points_by_axes:
        ax.set_autoscale_on(False)  # the limits of the draw above are the limits saved
        frame = ax.get_window_extent(renderer)
        centres = ax.transData.transform([(x, y) for x, y, *_ in points]) if points else []
        r = MARKER_RADIUS_PT * to_px
        markers = [Bbox.from_extents(px - r, py - r, px + r, py + r) for px, py in centres]
        placed: list[Bbox] = []
        for (x, y, text, colour), (px, py) in zip(points, centres):
            label = ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, 0), ha="center", va="center",
                                fontsize=7, fontweight="bold", color=colour, gid=POINT_LABEL, zorder=5,
                                path_effects=[HALO])
            label.set_in_layout(False)
            box = label.get_window_extent(renderer).padded(1)

            def clash(offset, box=box):
                moved = box.translated(offset[0] * to_px, offset[1] * to_px)
                inside = frame.x0 <= moved.x0 and moved.x1 <= frame.x1 and frame.y0 <= moved.y0 and moved.y1 <= frame.y1
                return (sum(moved.overlaps(b) for b in placed), not inside, sum(moved.overlaps(m) for m in markers))

            best = min(LABEL_OFFSETS, key=clash)  # min keeps the first of equals: nearest wins
            label.xyann = best
            placed.append(box.translated(best[0] * to_px, best[1] * to_px))


# -- an outlying seed does not squash the rest -------------------------------------------------------------------------
OUTLIER_FENCE = 3.0  # Tukey's 'far out' fence: 3 IQRs of the seeds' distances from their variant's median
SQUASH = 2.0  # the bulk's limits are used when drawing everything would need more than twice their span


def bulk_limits(groups: dict[str, pd.Series], margin: float = 0.12) -> tuple[float, float] | None:
    """Axis limits for per-seed values grouped by variant that an outlying seed cannot squash, or None when drawing
    everything squashes nothing. A seed is outlying when its distance from its variant's median lies beyond Tukey's
    far-out fence of those distances over all variants; its variant then contributes its median, not its seeds'
    extremes, mean or interval (which the outlier drags along). The bulk's limits are used only when everything
    drawn (seeds, means, 95% intervals) would span more than SQUASH times them."""
    groups = {k: v for k, v in groups.items() if len(v)}
    if not groups:
        return None
    residuals = pd.concat([v - v.median() for v in groups.values()])
    q1, q3 = residuals.quantile([0.25, 0.75])
    low, high = q1 - OUTLIER_FENCE * (q3 - q1), q3 + OUTLIER_FENCE * (q3 - q1)
    bulk, everything = [], []
    for vals in groups.values():
        ci = mean_ci(vals)
        drawn = [*vals, ci.mean, *([ci.lo, ci.hi] if ci.has_ci else [])]
        everything += drawn
        far = ((vals - vals.median()) < low) | ((vals - vals.median()) > high)
        bulk += [*vals[~far], vals.median()] if far.any() else drawn
    lo, hi = min(bulk), max(bulk)
    if _constant(lo, hi) or max(everything) - min(everything) <= SQUASH * (hi - lo):
        return None  # constant data are readable_axes' to range; nothing squashed needs nothing done
    pad = margin * (hi - lo)
    return lo - pad, hi + pad


def pin_beyond(ax, x: float, values: list[tuple[str, float]], limits: tuple[float, float], colour) -> None:
    """Each (what, value) beyond the y limits drawn as a triangle on the edge it passed, pointing out, with the value
    written beside it: shown, not dropped and not allowed to stretch the axis."""
    stacked = {True: 0, False: 0}
    for what, value in values:
        above = value > limits[1]
        if limits[0] <= value <= limits[1]:
            continue
        edge = limits[1] if above else limits[0]
        ax.scatter([x], [edge], marker="^" if above else "v", s=36, color=colour, clip_on=False, zorder=5)
        k = stacked[above]
        stacked[above] += 1
        ax.annotate(f"{what} {number(value)}", (x, edge), textcoords="offset points", fontsize=7, color=colour,
                    xytext=(7, -9 - 9 * k if above else 3 + 9 * k), ha="left", va="center", gid="pinned",
                    path_effects=[HALO], zorder=5)
