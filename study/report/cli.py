"""`study report RESULTS` and `study compare RESULTS`: registered on the `study` command line by
`add_commands(subparsers)`; also runnable alone as `python -m study.report.cli report|compare ...`."""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

DEFAULT_RUNS = "bench/results/run-*.json"


def _formats(text: str) -> str:
    """argparse type: figure formats matplotlib writes, png first where given (an unknown one failed after the
    figures were drawn; svg or pdf alone failed at the first figure)."""
    formats = [f for f in text.split(",") if f]
    unknown = sorted(set(formats) - {"png", "svg", "pdf"})
    if unknown or not formats:
        raise argparse.ArgumentTypeError(f"{unknown or text!r}: formats are png, svg, pdf, comma-separated")
    return ",".join(formats)


def _cmd_report(args: argparse.Namespace) -> int:
    from study.report import UnwritableOut, build_report
    from study.report.collect import UndeclaredMetric, UnreadableTable

    try:
        output = build_report(args.results, args.out, formats=tuple(f for f in args.formats.split(",") if f))
    except (FileNotFoundError, UndeclaredMetric, UnreadableTable, UnwritableOut) as err:
        print(f"study report: {err}", file=sys.stderr)
        return 2
    from study.report.collect import load_results
    from study.report.markdown import status_sentence

    results = load_results(args.results)
    print(f"study report: {status_sentence(results)}" + (" (partial: the sweep is still running or incomplete)"
                                                        if results.is_partial else ""))
    drawn = [f for f in output.figures if f.paths]
    print(f"  {output.markdown}\n  {output.html}\n  {len(drawn)} figures in {output.out / 'figures'}"
          + (f"; {len(output.figures) - len(drawn)} not drawn (report.md says why)" if len(drawn) < len(output.figures)
             else ""))
    return 0


def _runs(args: argparse.Namespace) -> tuple[list[str], set[str]]:
    """The recorded runs to compare, and those of them the user named one by one: `--runs` (a pattern's matches
    are read as the default's are); with no results directory, every recorded run. A sweep's comparison is the
    sweep's alone unless runs are named, so `make compare` regenerates its committed compare.md whatever else
    bench/results holds."""
    if args.no_runs:
        return [], set()
    if args.runs:
        paths, named = [], set()
        for pattern in args.runs:
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else []
            paths += matches or [pattern]
            named |= set() if matches else {pattern}
        return paths, named
    return ([] if args.results else sorted(glob.glob(DEFAULT_RUNS))), set()


def _run_problems(runs: list[str], named: set[str]) -> list[str]:
    """What is wrong with the recorded runs to compare, before anything is written: one that is not there, or a
    file that cannot be read as one (it was skipped without a word, or a traceback). A path that holds no run (a
    run directory with no result yet, a JSON of something else) is a problem where the user named it, and left out
    where a pattern or the default found it."""
    import yaml

    from study.report.measure import UnreadableRun, load_run

    missing = [r for r in runs if not Path(r).exists()]
    problems = [f"no such run file or directory: {', '.join(missing)}"] if missing else []
    for run in (r for r in runs if r not in missing):
        try:
            if load_run(run) is None and run in named:
                problems.append(f"{run} is neither a recorded run (run-*.json) nor a run directory with a readable "
                                "result (metrics.json)")
        except UnreadableRun as err:  # (it names the file)
            problems.append(str(err))
        except (ValueError, yaml.YAMLError) as err:  # a record of a newer schema, a config.yaml that is no YAML
            problems.append(f"{run}: {' '.join(str(err).split())}")
    if problems and not named:
        problems.append(f"(read by default from {DEFAULT_RUNS}: name the runs with --runs, or give --no-runs)")
    return problems


def _cmd_compare(args: argparse.Namespace) -> int:
    from study.report import UnwritableOut, build_compare
    from study.report.collect import UndeclaredMetric, UnreadableTable

    runs, named = _runs(args)
    if problems := _run_problems(runs, named):
        print("study compare: " + "; ".join(problems), file=sys.stderr)
        return 2
    if not args.results and not runs:
        print("study compare: give a results directory or --runs", file=sys.stderr)
        return 2
    try:
        comparison = build_compare(args.results, args.out, runs=runs)
    except (FileNotFoundError, UndeclaredMetric, UnreadableTable, UnwritableOut) as err:
        print(f"study compare: {err}", file=sys.stderr)
        return 2
    effects = comparison.effects
    verdicts = effects["verdict"].value_counts().to_dict() if len(effects) else {}
    holm = effects["holm_verdict"].value_counts().to_dict() if len(effects) else {}
    print("study compare: effects " + (", ".join(f"{n} {v}" for v, n in verdicts.items()) or "none tested")
          + (f" (after Holm over {int(effects['holm_family'].iloc[0])} tests: "
             + ", ".join(f"{n} {v}" for v, n in holm.items()) + ")" if len(effects) else "")
          + f"; {len(comparison.numbers)} number pairs "
          f"({int(comparison.numbers['comparable'].sum()) if len(comparison.numbers) else 0} comparable)")
    print(f"  {comparison.markdown}")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `report` and `compare` on the `study` command line's subparsers."""
    rep = subparsers.add_parser("report", help="figures, report.md and report.html for a sweep's results",
                                description="Render a sweep's results directory (results/<sweep>/) into figures "
                                            "(PNG and SVG), report.md and a standalone report.html. Works on a "
                                            "sweep that is still running, and says so.")
    rep.add_argument("results", help="the sweep's results directory, e.g. results/<sweep>")
    rep.add_argument("--out", help="output directory (default: reports/<sweep>)")
    rep.add_argument("--formats", default="png,svg", type=_formats,
                     help="figure formats, comma-separated, among png, svg, pdf (default: png,svg)")
    rep.set_defaults(func=_cmd_report)

    cmp = subparsers.add_parser("compare", help="our results beside the published ones, with citations",
                                description="Write compare.md / compare.csv: published effects beside our paired "
                                            "differences (agree / disagree / inconclusive), and our numbers beside "
                                            "published numbers with their comparability stated.")
    cmp.add_argument("results", nargs="?", help="the sweep's results directory (optional when --runs is given)")
    which = cmp.add_mutually_exclusive_group()
    which.add_argument("--runs", nargs="+", metavar="RUN",
                       help="recorded runs (run-*.json) or run directories to compare too (default: none with a "
                            f"results directory, else {DEFAULT_RUNS})")
    which.add_argument("--no-runs", action="store_true", help="compare the sweep only")
    cmp.add_argument("--out", help="output directory (default: reports/<sweep>; reports/runs for runs alone)")
    cmp.set_defaults(func=_cmd_compare)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="study")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
