"""The report's family of paired tests: every variant against the baseline on each task's objective (and, for
language models, the perplexity at twice the training length), with Holm's correction over all of them.

One module computes them, so that every place that shows a paired verdict (the report's tables, paired.csv, the
headline figure) shows the same Holm-corrected one: a verdict the correction withdraws is withdrawn everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from study.report.collect import SweepResults, at_2x_column, metric_column, metric_name
from study.report.stats import holm_adjust, holm_withdrawn, paired_differences

NOT_COMPARABLE = "not comparable"  # the verdict of a pair that measures its metric differently on each side


@dataclass
class PairedTest:
    """One table of the report's paired differences: every variant against the baseline on one metric of a task,
    with each test's p-value adjusted (Holm) over the report's whole family of such tests."""

    task: str
    column: str
    name: str
    direction: str
    table: pd.DataFrame  # paired_differences' columns, then p_holm and verdict_holm


def holm_paired_verdict(verdict: str, p_holm: float) -> str:
    """A better/worse whose Holm-adjusted p-value is not below 0.05 is withdrawn (inconclusive); others stand."""
    return holm_withdrawn(verdict, p_holm, ("better", "worse"))


def paired_family(results: SweepResults) -> list[PairedTest]:
    """The paired tests of the report's main sections (each task's objective and, for language models, the
    perplexity at twice the training length; every variant against the baseline), Holm-adjusted together: the
    family is every test with a p-value (two or more pairs) in the report, so 'better' after Holm keeps the chance
    of any false verdict among them at 5%, however many variants and metrics there are. Pairs are drawn from the
    finished trials, so that a side that diverged where the other did not is named (stats.paired_difference)."""
    tests = []
    for task in results.tasks:
        done, finished = results.completed(task), results.finished(task)
        metric, direction = results.objective(task)
        mcol, labels = metric_column(metric), results.labels_for(task)
        targets = [(mcol, metric, direction)]
        extra = at_2x_column(done)
        if extra and extra != mcol and done[extra].notna().any():
            targets.append((extra, metric_name(extra), results.declared(extra, task).direction))
        tests += [PairedTest(task, col, name, dirn, paired_differences(finished, col, results.baseline_label, labels,
                                                                         dirn)) for col, name, dirn in targets]
    for t in tests:
        _withhold_not_comparable(results, t)
    adjusted = iter(holm_adjust([p for t in tests for p in t.table["p_value"]]))
    for t in tests:
        t.table["p_holm"] = [next(adjusted) for _ in range(len(t.table))]
        t.table["verdict_holm"] = [holm_paired_verdict(v, p) for v, p in zip(t.table["verdict"], t.table["p_holm"])]
    return tests


def _withhold_not_comparable(results: SweepResults, test: PairedTest) -> None:
    """A variant that measures the metric differently from the baseline (SweepResults.defined_differently: another
    tokenizer under a per-token loss) is not tested: its difference, interval and p-value are left out (the table,
    paired.csv and the figure show the verdict alone), its verdict is 'not comparable', and it leaves the Holm
    family. (The plan refuses such an objective; a plan written before it did may still pair them.)"""
    blank = ["diff", "ci_lo", "ci_hi", "p_value", "mde"]
    for i, label in test.table["label"].items():
        if results.defined_differently(test.column, test.task, [results.baseline_label, str(label)]):
            test.table.loc[i, blank] = float("nan")
            test.table.loc[i, ["test", "verdict"]] = ["", NOT_COMPARABLE]


def family_size(family: list[PairedTest]) -> int:
    return int(sum(t.table["p_value"].notna().sum() for t in family))
