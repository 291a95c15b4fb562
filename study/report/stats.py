"""Statistics that do not overclaim: means with t-distribution confidence intervals over seeds, differences against
the baseline paired by seed, their paired t-test p-values (exact sign-flip p-values where the differences have no
spread), Holm's correction for testing several effects at once, the smallest difference a set of seeds could have
detected, and Pareto fronts.

n = 1 gives no interval (reported as such, never as +-0), nor do n equal values (no spread); a paired difference
whose interval contains zero is `inconclusive`, whatever its mean says, and so is one whose better side diverged on a
seed where the other did not. Paired differences with no spread (n identical differences: a discrete metric such as
accuracy on a small dev set moves in steps) make the t-test degenerate (sd 0, p 0); they are tested with the exact
sign-flip test instead, whose p is never below 2^(1-n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats as _st

from study.record import DIRECTIONS

CONFIDENCE = 0.95
POWER = 0.80  # the conventional power of a minimum detectable difference (Cohen 1988's convention)
ALPHA = 1 - CONFIDENCE
# Values that agree to this fraction of their magnitude are equal: float32, the coarsest precision a task computes
# a metric in, resolves 1.2e-7 of a value (its machine epsilon, IEEE 754), so a difference of two such values is
# known to a few of those; a smaller spread among paired differences is rounding, not spread (in float64,
# 3/277 - 0/277 and 150/277 - 147/277 differ in the last bits: two seeds each 3 RTE dev examples up on the
# baseline would otherwise show an sd of 1e-17 and a t-test p of about 0).
SPREAD_RTOL = 1e-6
NO_SPREAD_TEST = "exact sign-flip (no spread)"  # PairedDifference.test where the differences have no spread
T_TEST = "paired t"
# Why a row with no spread has no interval and which p it carries, for the reports' notes (markdown.py, compare.py)
NO_SPREAD_WHY = ("where every pair differs by the same amount (a metric that moves in steps, such as accuracy on a "
                 "small dev set, can repeat a difference exactly), the t-test is degenerate (sd 0: an infinite t, a p "
                 "of 0) and a zero-width interval would claim a certainty that n equal differences do not give, so "
                 "there is no interval; the p-value is the exact two-sided sign-flip test's (Fisher 1935, *The Design "
                 "of Experiments*, §21): of the 2ⁿ sign assignments only the 2 with every sign alike reach that mean, "
                 "so p = 2¹⁻ⁿ (0.5 for 2 pairs, 0.0625 for 5; below 0.05 only from 6 pairs on)")


@dataclass(frozen=True)
class Interval:
    """Mean of n values with a two-sided t interval (NaN bounds when n < 2, and when n >= 2 equal values have no
    spread: sd 0)."""

    n: int
    mean: float
    sd: float
    lo: float
    hi: float
    confidence: float = CONFIDENCE

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2 if self.has_ci else math.nan

    @property
    def has_ci(self) -> bool:
        return self.n >= 2 and not math.isnan(self.lo)

    def crosses_zero(self) -> bool:
        return not self.has_ci or (self.lo <= 0 <= self.hi)


def t_critical(n: int, confidence: float = CONFIDENCE) -> float:
    """The two-sided t quantile for n values (n - 1 degrees of freedom); NaN when n < 2."""
    return float(_st.t.ppf(0.5 + confidence / 2, n - 1)) if n >= 2 else math.nan


def no_spread(x: np.ndarray, scale: float | None = None) -> bool:
    """Do two or more values agree to within rounding (SPREAD_RTOL of `scale`: the magnitude of the numbers they
    were computed from; default their own largest magnitude)? Exactly equal values always do."""
    if x.size < 2:
        return False
    scale = float(np.max(np.abs(x))) if scale is None else scale
    return float(np.ptp(x)) <= SPREAD_RTOL * scale


def mean_ci(values, confidence: float = CONFIDENCE, scale: float | None = None) -> Interval:
    """Mean and t interval of the finite values: mean +- t_{n-1} * sd / sqrt(n), sd with ddof=1. Two or more values
    that agree to within rounding (no_spread, relative to `scale`) have sd 0 exactly and no interval (NaN bounds)."""
    x = np.asarray(pd.to_numeric(pd.Series(values, dtype=object), errors="coerce"), dtype=float)
    x = x[np.isfinite(x)]
    n = int(x.size)
    if n == 0:
        return Interval(0, math.nan, math.nan, math.nan, math.nan, confidence)
    mean = float(x.mean())
    if n == 1:
        return Interval(1, mean, math.nan, math.nan, math.nan, confidence)
    if no_spread(x, scale):
        # n equal values: a zero-width interval would claim a certainty that n repeats of one value do not give
        # (as paired_interval refuses one for equal differences): no interval, sd 0 (no_spread_text says so)
        return Interval(n, mean, 0.0, math.nan, math.nan, confidence)
    sd = float(x.std(ddof=1))
    half = t_critical(n, confidence) * sd / math.sqrt(n)
    return Interval(n, mean, sd, mean - half, mean + half, confidence)


def no_spread_text(n: int) -> str:
    """What a set of n >= 2 equal values shows in place of an interval (never '± 0')."""
    return f"no spread ({n} equal values)"


def finite(table: pd.DataFrame, col: str) -> pd.Series:
    """Which rows hold a finite number in `col` (all False when the table lacks the column)."""
    if col not in table:
        return pd.Series(False, index=table.index)
    return pd.Series(np.isfinite(pd.to_numeric(table[col], errors="coerce").astype(float)), index=table.index)


def summarize(table: pd.DataFrame, metric_col: str, by: str = "label", order: list[str] | None = None,
              extra: list[str] = ()) -> pd.DataFrame:
    """One row per variant: n (rows with a finite `metric_col`), n_rows (every row given: pass completed trials,
    so n_rows - n completed without a value), mean, sd, CI bounds of `metric_col`, and the mean of each `extra`
    column over the same n rows, so that every number of a row describes one set of seeds (NaN where one of them has
    no value of it: never a mean over fewer seeds beside the row's n)."""
    rows = []
    groups = dict(tuple(table.groupby(by, sort=False))) if len(table) else {}
    for key in (order if order is not None else list(groups)):
        sub = groups.get(key, table.iloc[0:0])
        valued = sub[finite(sub, metric_col)]
        ci = mean_ci(valued[metric_col]) if metric_col in sub else mean_ci([])
        row = {by: key, "n": ci.n, "n_rows": len(sub), "mean": ci.mean, "sd": ci.sd, "ci_lo": ci.lo,
               "ci_hi": ci.hi, "ci_half": ci.half_width}
        for col in extra:
            row[col] = _mean_of_all(valued[col]) if col in valued else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def _mean_of_all(values: pd.Series) -> float:
    """The mean of a summary row's extra column, only where every one of the row's n seeds has a finite value: a
    mean over fewer would stand beside the row's n as if it were over all of them (NaN, shown empty, instead)."""
    x = pd.to_numeric(values, errors="coerce").astype(float)
    return float(x.mean()) if len(x) and bool(np.isfinite(x).all()) else math.nan


@dataclass(frozen=True)
class PairedDifference:
    variant: str
    baseline: str
    diff: Interval            # variant - baseline, paired by seed (no interval, sd 0, where they have no spread)
    seeds: tuple[int, ...]    # the seeds present (with a finite value) in both
    direction: str            # 'minimize' | 'maximize': which sign is an improvement
    # Seeds on which one side diverged and the other did not: left out of the pairs, yet evidence against the side
    # that blew up, so that side is never called the better one on the seeds it survived
    variant_diverged: tuple[int, ...] = ()
    baseline_diverged: tuple[int, ...] = ()
    variant_finished: int = 0   # seeds the variant finished (a value or a divergence): the 'of n' of the note
    baseline_finished: int = 0

    @property
    def no_spread(self) -> bool:
        """Two or more pairs whose differences are all the same (to within rounding): the t-test is degenerate."""
        return self.diff.n >= 2 and self.diff.sd == 0

    @property
    def test(self) -> str:
        """The test behind p_value: T_TEST, NO_SPREAD_TEST where the differences have no spread, '' below 2 pairs."""
        return "" if self.diff.n < 2 else NO_SPREAD_TEST if self.no_spread else T_TEST

    @property
    def p_value(self) -> float:
        """Two-sided p-value of the mean difference: the paired t-test's, or the exact sign-flip test's where the
        differences have no spread (see paired_t_pvalue); NaN below 2 pairs."""
        return paired_t_pvalue(self.diff)

    @property
    def mde(self) -> float:
        """The smallest difference these pairs could have detected (see minimum_detectable_difference; NaN with no
        spread: the t approximation has nothing to scale)."""
        return minimum_detectable_difference(self.diff.sd, self.diff.n)

    @property
    def divergence(self) -> str:
        """'variant diverged on 1 of 4 seeds (the baseline did not diverge there)': what the pairs leave out; '' when
        neither side diverged where the other did not. (Not diverging there is all it says: the other side may have
        completed, failed or not run on that seed.)"""
        parts = [f"{side} diverged on {len(seeds)} of {finished} seed{'s' if finished != 1 else ''} (the {other} "
                 "did not diverge there)" for side, other, seeds, finished in
                 (("variant", "baseline", self.variant_diverged, self.variant_finished),
                  ("baseline", "variant", self.baseline_diverged, self.baseline_finished)) if seeds]
        return "; ".join(parts)

    @property
    def verdict(self) -> str:
        """The verdict of the pairs (pairs_verdict), except that a side which diverged on a seed where the other did
        not is never the better one: a variant that blew up on a seed is not 'better' on the seeds it survived, nor
        does a baseline's divergence make the variant 'worse' (inconclusive instead; `divergence` says why)."""
        verdict = self.pairs_verdict
        if (verdict == "better" and self.variant_diverged) or (verdict == "worse" and self.baseline_diverged):
            return "inconclusive"
        return verdict

    @property
    def pairs_verdict(self) -> str:
        """'better' / 'worse' than the baseline when the interval excludes zero, 'inconclusive' when it contains
        zero, 'no CI (n=1)' / 'no pairs' when it cannot be computed. With no spread there is no interval: the
        verdict follows the exact sign-flip p at ALPHA (n identical differences: better/worse from n = 6 on)."""
        if self.diff.n == 0:
            return "no pairs"
        if self.diff.n == 1:
            return "no CI (n=1)"
        if self.no_spread:
            if not self.p_value < ALPHA:
                return "inconclusive"
            lower = self.diff.mean < 0
        elif self.diff.lo <= 0 <= self.diff.hi:
            return "inconclusive"
        else:
            lower = self.diff.hi < 0
        return "better" if lower == lower_is_better(self.direction) else "worse"


def lower_is_better(direction: str) -> bool:
    """Whether a declared direction makes lower better; an unknown direction is an error: reading anything but
    'minimize' as maximize would flip every verdict on a misspelt declaration ('min')."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not one of {', '.join(DIRECTIONS)}")
    return direction == "minimize"


def sign_flip_pvalue_no_spread(n: int, mean: float) -> float:
    """Two-sided p of the exact paired sign-flip (permutation) test for n identical differences: under H0 each
    difference's sign is + or - with probability 1/2 (Fisher 1935, The Design of Experiments, section 21; Good 2005,
    Permutation, Parametric and Bootstrap Tests of Hypotheses, ch. 3), and of the 2^n sign assignments only the
    two with every sign alike reach a |mean| as large, so p = 2 / 2^n = 2^(1-n); 1 when the differences are 0."""
    return 1.0 if mean == 0 else 2.0 ** (1 - n)


def paired_t_pvalue(diff: Interval) -> float:
    """Two-sided p-value of H0 'mean difference = 0' for n paired differences: t = mean / (sd / sqrt(n)) with
    n - 1 degrees of freedom (Student's paired t-test; the same test as 'the 95% interval excludes zero').
    NaN below two pairs. With no spread (sd 0) t is infinite and the t-test says nothing true: p is the exact
    sign-flip test's instead (sign_flip_pvalue_no_spread: 2^(1-n), 1 when the differences are 0)."""
    if diff.n < 2 or not math.isfinite(diff.sd):
        return math.nan
    if diff.sd == 0:
        return sign_flip_pvalue_no_spread(diff.n, diff.mean)
    t = diff.mean / (diff.sd / math.sqrt(diff.n))
    return float(2 * _st.t.sf(abs(t), diff.n - 1))


def holm_adjust(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979, "A simple sequentially rejective multiple test
    procedure", Scand. J. Statist. 6:65-70): sort the m p-values, multiply the i-th smallest by (m - i + 1),
    carry the running maximum forward and cap at 1. Rejecting where the adjusted value is below alpha keeps the
    family-wise error rate (any false rejection among the m tests) at most alpha. NaN entries (effects that
    were not tested) stay NaN and do not count in m."""
    p = [float(x) if x is not None else math.nan for x in pvalues]
    tested = sorted((v, i) for i, v in enumerate(p) if math.isfinite(v))
    m = len(tested)
    out = [math.nan] * len(p)
    running = 0.0
    for rank, (value, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * value))
        out[i] = running
    return out


def holm_withdrawn(verdict: str, p_holm: float, claims: tuple[str, ...]) -> str:
    """`verdict` after Holm's correction: one of `claims` (the verdicts that assert a difference) whose adjusted
    p-value is not below ALPHA is withdrawn, 'inconclusive'; every other verdict stands."""
    if verdict not in claims or (math.isfinite(p_holm) and p_holm < ALPHA):
        return verdict
    return "inconclusive"


def holm_reject(pvalues, alpha: float = ALPHA) -> list[bool]:
    """Which hypotheses Holm's procedure rejects at family-wise level alpha (NaN: never)."""
    return [math.isfinite(a) and a < alpha for a in holm_adjust(pvalues)]


def minimum_detectable_difference(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference a two-sided paired t-test at level `alpha` detects with probability
    `power`, given the sd of the n paired differences: (t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / sqrt(n).
    The standard power-analysis approximation for a t test (Cohen 1988, Statistical Power Analysis for the
    Behavioral Sciences, 2nd ed., ch. 2; written as a minimum detectable effect with the t multiplier
    t_{1-alpha/2} + t_{power} by Bloom 1995, Evaluation Review 19(5):547-556). NaN below two pairs, and NaN with no
    spread (sd 0): the formula would claim any difference detectable, while such pairs are tested by the exact
    sign-flip test, whose p is 2^(1-n) whatever the difference (below 0.05 only from n = 6 pairs on)."""
    if n < 2 or sd is None or not math.isfinite(sd) or sd == 0:
        return math.nan
    t_alpha = float(_st.t.ppf(1 - alpha / 2, n - 1))
    t_power = float(_st.t.ppf(power, n - 1))
    return (t_alpha + t_power) * sd / math.sqrt(n)


def paired_difference(table: pd.DataFrame, metric_col: str, variant: str, baseline: str,
                      direction: str = "minimize", by: str = "label") -> PairedDifference:
    """Mean over seeds of (variant - baseline), pairing trials that share a seed, with its t interval.
    Seeds where either side has no finite value (failed, diverged, not run) are left out. Diverged trials in `table`
    (status 'diverged': pass every finished trial) are named: a seed where one side diverged and the other did not
    keeps the side that diverged from being called better (PairedDifference.verdict). Differences that agree
    to within rounding of the values they come from have no spread (see paired_interval)."""
    (a, a_div), (b, b_div) = _per_seed(table, metric_col, variant, by), _per_seed(table, metric_col, baseline, by)
    seeds = tuple(sorted(set(a) & set(b)))
    diffs = [a[s] - b[s] for s in seeds]
    scale = max((max(abs(a[s]), abs(b[s])) for s in seeds), default=0.0)
    return PairedDifference(variant, baseline, paired_interval(diffs, scale), seeds, direction,
                            tuple(sorted(a_div - b_div)), tuple(sorted(b_div - a_div)), len(set(a) | a_div),
                            len(set(b) | b_div))


def _per_seed(table: pd.DataFrame, metric_col: str, label: str, by: str) -> tuple[dict[int, float], set[int]]:
    """({seed: finite value} of the trials of `label` that did not diverge, {seeds on which it diverged})."""
    sub = table[table[by] == label]
    diverged = (sub["status"] == "diverged") if "status" in sub else pd.Series(False, index=sub.index)
    div_seeds = {int(s) for s in sub.loc[diverged, "seed"] if pd.notna(s)}
    if metric_col not in sub:
        return {}, div_seeds
    kept = sub[~diverged]
    vals = pd.to_numeric(kept[metric_col], errors="coerce")
    return {int(s): float(v) for s, v in zip(kept["seed"], vals) if pd.notna(s) and np.isfinite(v)}, div_seeds


def paired_interval(diffs: list[float], scale: float) -> Interval:
    """mean_ci of the paired differences, rounding judged against `scale` (the largest magnitude of the values they
    are differences of). With no spread it has no interval (NaN bounds, sd 0): a zero-width t interval would claim
    certainty that n equal differences do not give; a mean within rounding of zero is zero."""
    ci = mean_ci(diffs, scale=scale)
    if ci.n < 2 or ci.sd != 0:
        return ci
    mean = 0.0 if abs(ci.mean) <= SPREAD_RTOL * scale else ci.mean
    return Interval(ci.n, mean, 0.0, math.nan, math.nan, ci.confidence)


def paired_differences(table: pd.DataFrame, metric_col: str, baseline: str, variants: list[str],
                       direction: str = "minimize", by: str = "label") -> pd.DataFrame:
    """One row per variant: its paired difference against the baseline, interval, p-value and the `test` behind it
    (T_TEST, or NO_SPREAD_TEST where the differences have no spread and hence no interval), MDE, verdict and what
    diverged where the other side did not (`diverged`: PairedDifference.divergence, '' when nothing did)."""
    rows = []
    for v in variants:
        if v == baseline:
            continue
        d = paired_difference(table, metric_col, v, baseline, direction, by)
        rows.append({by: v, "n_pairs": d.diff.n, "diff": d.diff.mean, "ci_lo": d.diff.lo, "ci_hi": d.diff.hi,
                     "p_value": d.p_value, "test": d.test, "mde": d.mde, "verdict": d.verdict,
                     "seeds": ",".join(map(str, d.seeds)), "diverged": d.divergence})
    return pd.DataFrame(rows, columns=[by, "n_pairs", "diff", "ci_lo", "ci_hi", "p_value", "test", "mde", "verdict",
                                       "seeds", "diverged"])


def pareto_front(x, y, x_better: str = "lower", y_better: str = "lower") -> np.ndarray:
    """Boolean mask of the points no other point dominates (at least as good on both, better on one).
    Points with a NaN coordinate are never on the front."""
    x = np.asarray(x, dtype=float) * (1 if x_better == "lower" else -1)
    y = np.asarray(y, dtype=float) * (1 if y_better == "lower" else -1)
    ok = np.isfinite(x) & np.isfinite(y)
    front = np.zeros(len(x), dtype=bool)
    for i in np.flatnonzero(ok):
        dominated = ok & (x <= x[i]) & (y <= y[i]) & ((x < x[i]) | (y < y[i]))
        front[i] = not dominated.any()
    return front


def small_n_note(n: int, n_max: int | None = None, confidence: float = CONFIDENCE) -> str:
    """A sentence on what n seeds can support; with `n_max` above `n`, for variants with n to n_max seeds (the
    range, never the largest alone: most variants may have fewer)."""
    if n_max is not None and n_max > n:
        return _seed_range_note(n, n_max, confidence)
    if n <= 0:
        return "No completed seeds: nothing can be concluded."
    if n == 1:
        return "One seed per variant: no confidence interval can be computed, and no difference is significant."
    t = t_critical(n, confidence)
    text = (f"{n} seeds per variant: the {confidence:.0%} interval is mean ± {t:.2f} × sd/√{n} "
            f"(t with {n - 1} degrees of freedom)")
    if n < 5:
        text += "; with this few seeds intervals are wide and only large effects can be told apart from noise"
    return text + "."


def _seed_range_note(lo: int, hi: int, confidence: float) -> str:
    ts = ", ".join(f"{t_critical(k, confidence):.2f} for n = {k}" for k in range(max(lo, 2), hi + 1)[:4])
    text = (f"From {lo} to {hi} seeds per variant (each row's n): the {confidence:.0%} interval is "
            f"mean ± t × sd/√n with t for n − 1 degrees of freedom" + (f" ({ts})" if ts else ""))
    if lo <= 1:
        text += "; a variant with one seed has no interval and no significant difference"
    if lo < 5:
        text += "; with this few seeds intervals are wide and only large effects can be told apart from noise"
    return text + "."
