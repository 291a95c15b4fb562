"""Reports for a sweep: figures, report.md / report.html and the comparison with published results.

    study report RESULTS [--out reports/<sweep>]     figures/, report.md, report.html, summary.csv, paired.csv
    study compare RESULTS [--runs ...] [--out ...]    compare.md, compare.html, compare.csv, compare_effects.csv

`build_report` and `build_compare` are the library entry points; `study.report.cli.add_commands`
registers both subcommands on the `study` command line.
"""

from __future__ import annotations

from pathlib import Path


class UnwritableOut(ValueError):
    """The output folder is a file, lies under one, or cannot be written: said before anything is drawn."""


def default_out(results, out: str | Path | None) -> Path:
    """The output folder: `out`, else reports/<sweep> (reports/runs for recorded runs alone); UnwritableOut where it
    cannot be written."""
    from study.io import out_dir_problems

    path = Path(out) if out else Path("reports") / (results.sweep if results is not None else "runs")
    if problems := out_dir_problems("--out" if out else "the output folder", str(path)):
        raise UnwritableOut("; ".join(problems) + ("" if out else "; give --out DIR"))
    return path


def build_report(results_dir: str | Path, out: str | Path | None = None, formats=("png", "svg"), kinds=None):
    """Load results_dir, render every figure (or those of `kinds`) and write report.md / report.html;
    returns a ReportOutput."""
    from study.report.collect import load_results
    from study.report.figures import KINDS, make_figures
    from study.report.markdown import write_report

    results = load_results(results_dir)
    out = default_out(results, out)
    figures = make_figures(results, out, formats=formats, kinds=KINDS if kinds is None else kinds)
    return write_report(results, out, figures)


def build_compare(results_dir: str | Path | None, out: str | Path | None = None, runs=()):
    """Write compare.md / compare.csv for a sweep (and/or recorded runs); returns a Comparison."""
    from study.report.collect import load_results
    from study.report.compare import run_compare

    results = load_results(results_dir) if results_dir else None
    return run_compare(results, default_out(results, out), runs=list(runs))
