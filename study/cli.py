"""`study` command line.

    study run CONFIG.yaml [--set section.field=value ...]   one experiment
    study sweep SPEC.yaml [--workers N] [--storage URL]      a sweep (make ablation)
    study status results/<sweep>                             its progress
    study results results/<sweep>                            its results table
    study report results/<sweep>                             figures and report.md (make report)
    study compare results/<sweep>                            beside published numbers (make compare)
    study score-mt MODEL --src de --tgt en                   a hub model's sacreBLEU on newstest2014
    study axes | study presets                               what can be varied
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from study.io import close_sweep_folders, out_dir_problems


def _path_problems(data_dir: str | None = None, *out_dirs: tuple[str, str | None]) -> list[str]:
    """What is wrong with the folders a command was given, before it reads or writes anything: a --data-dir that is a
    file or does not exist (a typo would otherwise read the hub's copy instead, after a warning), a folder it writes
    (--out, --results, --cache-dir) that is a file, under a file, or in a folder this user cannot write."""
    problems = []
    if data_dir and Path(data_dir).exists() and not Path(data_dir).is_dir():
        problems.append(f"--data-dir {data_dir} is a file; give the folder that holds the datasets")
    elif data_dir and not Path(data_dir).exists():
        problems.append(f"--data-dir {data_dir} does not exist; give the folder that holds the datasets, or none to "
                        "read the Hugging Face hub")
    for out_dir in out_dirs:
        problems += out_dir_problems(*out_dir)
    return problems


def _cannot_write(command: str, err: OSError) -> int:
    """A folder that turned out unwritable (e.g. read-only for everyone, root included) is bad input, not a crash."""
    print(f"study {command}: cannot write {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
    return 2


def _cmd_run(args: argparse.Namespace) -> int:
    from study.config import ConfigError, load_experiment

    problems = _path_problems(args.data_dir, ("--out", args.out), ("--cache-dir", args.cache_dir))
    if Path(args.config).is_dir():
        problems.insert(0, f"{args.config} is a folder; give an experiment YAML (e.g. experiments/*.yaml)")
    if problems:
        print("study run: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        cfg = load_experiment(args.config, args.set or [])  # one experiment, or a pipeline of stages
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"study run: {err}", file=sys.stderr)
        return 2
    if problems := _overridden_sets(cfg, args.set or []):
        print("study run: " + "; ".join(problems), file=sys.stderr)
        return 2
    from study.run import RunDirConflict, run_experiment
    from study.tasks.data import DataError

    _say_progress()
    out = Path(args.out) if args.out else Path("runs") / cfg.name
    if not args.out and (problems := out_dir_problems("run directory", str(out))):
        print("study run: " + "; ".join(problems) + "; give --out DIR", file=sys.stderr)
        return 2
    try:
        with _held(out):
            metrics = run_experiment(cfg, out, data_dir=args.data_dir, cache_dir=args.cache_dir, force=args.force)
    except (DataError, RunDirConflict, ConfigError, ValueError) as err:
        print(f"study run: {err}", file=sys.stderr)
        return 2
    except PermissionError as err:
        return _cannot_write("run", err)
    except KeyboardInterrupt:
        print(f"study run: interrupted; {_resumes_from(out, args.force)}", file=sys.stderr)
        return 130
    summary = {k: v for k, v in metrics["metrics"].items() if not isinstance(v, dict)}
    print(json.dumps({"run_dir": str(out), "status": metrics["status"], "steps": metrics["steps"], **summary}, indent=2))
    return 0


def _overridden_sets(cfg, sets: list[str]) -> list[str]:
    """The `--set` fields the task replaces when it resolves the config (GLUE with task.init_from: the architecture
    is the pretrained run's): the run would drop what the user asked for in silence, as `study sweep` refuses it in
    a spec's `set`. A value that reaches part of a suite (tasks with their own per-task value) is kept, as there."""
    from study.config import PipelineConfig
    from study.config.base import parse_overrides
    from study.sweep.reach import asked_and_run, stage_config

    problems = []
    for key in parse_overrides(sets):
        stage, _, path = key.partition(".") if isinstance(cfg, PipelineConfig) else (None, "", key)
        if (isinstance(cfg, PipelineConfig) and stage not in cfg.stages) or "." not in path:
            continue
        try:
            asked, runs = asked_and_run(cfg, stage, path)
        except (ValueError, KeyError):
            return problems  # the run says what is wrong with the config itself
        if asked != runs:
            problems.append(f"--set {key}: replaced when the task resolves the config (asked {asked!r}, runs "
                            f"{runs!r}){_why(stage_config(cfg, stage), path)}")
    return problems


def _why(exp, path: str) -> str:
    from study.tasks import family

    why = family(exp.task.name).overridden_fields(exp).get(path)
    return f": {why}" if why else ""


class _ToStderr(logging.StreamHandler):
    """Writes to the sys.stderr of the moment: a caller in the same process (a test) may replace and close it."""

    stream = property(lambda self: sys.stderr, lambda self, _: None)


def _say_progress() -> None:
    """study's own INFO lines on stderr (a finished run handed back, a suite's or a pipeline's next part), as a
    sweep prints its trials; other libraries' loggers keep their levels."""
    logger = logging.getLogger("study")
    if not any(isinstance(h, _ToStderr) for h in logger.handlers):
        handler = _ToStderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _held(run_dir: Path):
    """The run directory's lock (the one a sweep's trial and a pipeline's stage take: study.run.pipeline.run_dir_lock)
    while `study run` runs it: two processes training into one directory would interleave their checkpoints, logs
    and records. A second `study run` is refused at once rather than left waiting."""
    from study.run import RunDirConflict
    from study.run.pipeline import run_dir_lock

    run_dir = Path(os.path.abspath(run_dir))

    def taken() -> None:
        raise RunDirConflict(f"{run_dir} is being run by another process (a `study run` or a sweep's trial); wait for "
                             "it to end, or choose another --out")

    return run_dir_lock(run_dir, on_wait=taken)


def _resumes_from(run_dir: Path, forced: bool = False) -> str:
    """What an interrupted `study run` left in its run directory, and how to go on (`forced`: it ran with --force,
    which given again would discard the checkpoint, and a pipeline's finished stages, once more)."""
    from study.record import RunDir

    run = RunDir(run_dir)
    if run.finished():
        return (f"{run_dir} still holds the run it held (--force had not replaced it yet); the same command replaces "
                "it" if forced else f"{run_dir} holds the finished run")
    if not run.path.is_dir():
        return "nothing was written"
    again = "the same command without --force" if forced else "the same command"
    # a suite's or a pipeline's parts and stages: those finished are handed back, the others resumed or started
    done = sum(1 for p in run.path.rglob("metrics.json") if p.parent != run.path and RunDir(p.parent).finished())
    kept = f" (its {done} finished run(s) inside are kept)" if done else ""
    if next(run.path.rglob("last.ckpt"), None) is not None:
        return f"no result recorded; {again} resumes {run_dir} from its last checkpoint{kept}" + (
            " (with --force it would start again from scratch)" if forced else "")
    if done:
        return f"no result recorded; {again} goes on with {run_dir}{kept}, starting the rest"
    return f"no result recorded; {again} runs {run_dir} again (no checkpoint had been written)"


def _cmd_sweep(args: argparse.Namespace) -> int:
    from study.config import ConfigError
    from study.config.base import parse_overrides
    from study.sweep import StorageError, SweepInterrupted, SweepOptions, SweepSpecError, run_sweep

    from study.interrupts import deliver_interrupts

    # `kill PID` (and a batch scheduler's SIGTERM) stop the sweep like Ctrl-C: workers give their
    # trials back to the queue instead of leaving them to the heartbeat timeout
    deliver_interrupts(sigterm=True, once=True)  # the first stops the sweep; those after it let it give trials back
    # the in-process worker (--workers 1) reports each trial as the worker processes do
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("study.sweep").setLevel(logging.INFO)
    if problems := _path_problems(args.data_dir, ("--results", args.results), ("--cache-dir", args.cache_dir)):
        print("study sweep: " + "; ".join(problems), file=sys.stderr)
        return 2
    opts = SweepOptions(results=args.results, storage=args.storage, workers=args.workers, threads=args.threads,
                        data_dir=args.data_dir, cache_dir=args.cache_dir, dry_run=args.dry_run,
                        runner=args.runner, estimate_rate=args.peak_flops,
                        storage_retry_s=args.storage_retry_s, launcher=args.launcher)
    try:
        overrides = parse_overrides(args.set or [])
        final = run_sweep(args.spec, opts, overrides=overrides)
    except (SweepSpecError, StorageError, ConfigError, ValueError, FileNotFoundError) as err:
        print(f"study sweep: {err}", file=sys.stderr)
        return 2
    except SweepInterrupted as err:
        print(f"study sweep: {err}", file=sys.stderr)
        return err.exit_code
    except PermissionError as err:
        return _cannot_write("sweep", err)
    return 1 if final.get("failed") else 0


def _cmd_status(args: argparse.Namespace) -> int:
    """0: the queue and the run directories were read; 1: the queue could not be (unreachable, refused), the run
    directories were; 2: bad input (no such sweep, a storage URL of no known scheme)."""
    from study.sweep import StorageError, status

    try:
        report = status(_sweep_dir(args.sweep, args.results), args.storage)
    except (FileNotFoundError, ValueError, StorageError) as err:
        print(f"study status: {err}", file=sys.stderr)
        return 2
    print(report.text)
    return 1 if report.queue_error else 0


def _cmd_results(args: argparse.Namespace) -> int:
    from study.io import read_json
    from study.sweep.results import summary, write_table

    try:
        sweep_dir = _sweep_dir(args.sweep, args.results)
    except ValueError as err:
        print(f"study results: {err}", file=sys.stderr)
        return 2
    if not (sweep_dir / "plan.json").is_file():
        print(f"study results: {sweep_dir} holds no sweep (no plan.json)", file=sys.stderr)
        return 2
    try:  # a damaged or newer-schema record (or plan) is named, not a traceback
        df = write_table(sweep_dir)
        objective = read_json(sweep_dir / "plan.json")["objective"]["metric"]
    except (ValueError, OSError, KeyError, TypeError) as err:
        print(f"study results: {sweep_dir}: {err}", file=sys.stderr)
        return 2
    print(summary(df, objective))
    print(f"\nwritten: {sweep_dir / 'results.parquet'}, {sweep_dir / 'results.csv'}")
    return 0


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (0 or -1 workers would start nothing and exit 0)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _rate(text: str) -> float:
    """argparse type: a positive, finite rate (0 divided a time estimate by zero; -1 or nan printed one)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def _seconds(text: str) -> float:
    """argparse type: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _sweep_dir(sweep: str, results: str) -> Path:
    """A sweep folder given as a path, a sweep name (under --results), or the spec YAML it came from. A folder that
    is not there is named as given, with the sweeps beside it whose names are close (a mistyped path was looked
    for as a name under --results: `results/results/defualt`)."""
    path = Path(sweep).expanduser()
    if path.is_dir():
        return path
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ValueError(f"no spec file {path}; give the sweep's spec YAML, its results folder, or its name")
        folder = Path(results) / _spec_name(path)
        if not folder.is_dir():
            raise ValueError(f"no sweep folder {folder} (the sweep {path} names): run `study sweep {path}` first, or "
                             "give --results the folder it ran into")
        return folder
    if os.sep not in sweep and not sweep.startswith((".", "~")):  # a name (a path holds a / or starts with . or ~)
        path = Path(results) / sweep
    if not path.exists():
        close = close_sweep_folders(path, results)
        raise ValueError(f"no sweep folder {path}; " + (f"did you mean {', '.join(close)}?" if close else
                                                         "run `study sweep SPEC` first, or give the sweep's folder"))
    return path


def _spec_name(spec: Path) -> str:
    """The sweep name a spec YAML gives (its file name's stem when it names none); ValueError naming the file when it
    cannot be read as a spec."""
    import yaml

    from study.io import load_yaml

    try:
        data = load_yaml(spec.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"{spec}: not valid YAML: {' '.join(str(err).split())}") from None
    from study.config.pipeline import is_experiment_mapping

    if is_experiment_mapping(data):
        raise ValueError(f"{spec} is an experiment config (for `study run`), not a sweep spec; give a sweep's spec "
                         "(experiments/ablation_default.yaml, experiments/sweeps/), its results folder, or its name")
    name = data.get("name", spec.stem) if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{spec}: not a sweep spec (a mapping whose `name` is the sweep's name); give the spec, "
                         "its results folder, or the sweep's name")
    return name


def _cmd_score_mt(args: argparse.Namespace) -> int:
    from study.io import atomic_write_json
    from study.tasks.data import DataError
    from study.tasks.score_mt import score_newstest2014

    # the beam and a --limit in the name: a quick check on a few sentences must not replace a full score
    limit = f"-first{args.limit}" if args.limit else ""
    default = Path("runs") / f"newstest2014-{args.src}-{args.tgt}-{Path(args.model).name}-beam{args.beam}{limit}.json"
    out = Path(args.out) if args.out else default
    # checked before the model decodes for minutes, whose scores an unwritable --out would lose
    problems = _path_problems(args.data_dir)
    if out.is_dir():
        problems.append(f"--out {out} is a folder; give the result JSON's file name")
    elif not out.exists():
        problems += out_dir_problems("--out", str(out))  # the folders it would be written in
    if problems:
        print("study score-mt: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        result = score_newstest2014(args.model, args.src, args.tgt, args.data_dir, beam_size=args.beam,
                                    batch_size=args.batch_size, limit=args.limit)
    except DataError as err:
        print(f"study score-mt: {err}", file=sys.stderr)
        return 2
    atomic_write_json(out, result)
    print(json.dumps({k: result[k] for k in ("model", "sentences", "bleu", "bleu_signature", "chrf", "decode_seconds")},
                     indent=2))
    print(f"written: {out}")
    return 0


def _cmd_axes(args: argparse.Namespace) -> int:
    """Every enumerated axis and its values; the registry-backed ones with each value's own description."""
    from study.axes import AXES
    from study.config import axis_choices

    for axis, values in axis_choices().items():
        print(f"{axis}: {', '.join(values)}")
        if axis in AXES:
            for value in values:
                print(f"    {value:12s} {AXES[axis].describe(value)}")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    from study.config import PRESETS, preset

    # the columns are model fields (a preset sets them; `--set model.<field>=...` changes one), but attention: MHA,
    # GQA or MQA as model.n_kv_heads makes it
    row = "{:8s} {:16s} {:13s} {:9s} {:10s} {:10s} {:9s} {}"
    print(row.format("preset", "arch", "norm_position", "norm", "position", "activation", "attention", "window"))
    for name in PRESETS:
        cfg = preset(name)
        print(row.format(name, cfg.arch, cfg.norm_position, cfg.norm, cfg.position, cfg.activation,
                         cfg.attention_kind, "null" if cfg.window is None else str(cfg.window)))
    return 0


def _add_sweep_command(sub) -> None:
    sweep = sub.add_parser("sweep", help="run (or continue) a sweep: every (point, seed) exactly once")
    sweep.add_argument("spec", help="sweep spec YAML (see experiments/ablation_default.yaml)")
    sweep.add_argument("--workers", type=_positive_int, help="local worker processes (default: the spec's workers)")
    sweep.add_argument("--threads", type=_positive_int, help="CPU threads per trial (default: cores / workers)")
    sweep.add_argument("--storage", default=os.environ.get("STUDY_STORAGE"),
                       help="Optuna storage URL: sqlite:///..., journal:///..., postgresql://... "
                            "(default: $STUDY_STORAGE, else sqlite under results/<sweep>/)")
    sweep.add_argument("--results", default="results", help="results folder (default: results)")
    sweep.add_argument("--launcher", choices=("fork", "spawn"), default="fork",
                       help="how trials start: forked from a process that imported torch and Lightning once (fork, "
                            "the default), or a fresh interpreter each (spawn)")
    sweep.add_argument("--storage-retry-s", type=_seconds, default=300.0, metavar="S",
                       help="how long workers wait out an unreachable storage before stopping (default: 300)")
    sweep.add_argument("--data-dir", default=os.environ.get("STUDY_DATA_DIR"),
                       help="local dataset folder (default: $STUDY_DATA_DIR; else the Hugging Face hub)")
    sweep.add_argument("--cache-dir", help="tokenizer cache (default: $STUDY_CACHE_DIR or .cache/study)")
    sweep.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a spec field (seeds=[0]) or a base config field (train.max_steps=50)")
    sweep.add_argument("--dry-run", action="store_true", help="validate and print the plan; run nothing")
    sweep.add_argument("--peak-flops", type=_rate, metavar="FLOP/S",
                       help="for the plan's time estimate: the matmul rate of the machine that will run it "
                            "(e.g. 9.9e14 for an H100 in bf16) instead of this machine's, measured")
    sweep.add_argument("--runner", default="study.run:run_experiment",
                       help="module:function(cfg, run_dir, data_dir, cache_dir) that runs one trial "
                            "(default: study.run:run_experiment)")
    sweep.set_defaults(func=_cmd_sweep)


def main(argv: list[str] | None = None) -> int:
    from study.interrupts import deliver_interrupts

    deliver_interrupts(sigterm=False)  # a Ctrl-C that lands in a finalizer still interrupts
    try:
        args = _parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C while starting up (imports, reading data): one line, not a traceback
        print("study: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `study axes | head`: the reader left; Python's documented way out (signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="study", description="Ablation studies of transformer design choices")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and evaluate one experiment config")
    run.add_argument("config", help="experiment YAML (see experiments/)")
    run.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="override a config field")
    run.add_argument("--data-dir", default=os.environ.get("STUDY_DATA_DIR"),
                     help="local dataset folder (default: $STUDY_DATA_DIR; else the Hugging Face hub)")
    run.add_argument("--out", help="run directory (default: runs/<name>)")
    run.add_argument("--cache-dir", help="tokenizer cache (default: $STUDY_CACHE_DIR or .cache/study)")
    run.add_argument("--force", action="store_true", help="rerun even if the run directory holds a finished run")
    run.set_defaults(func=_cmd_run)
    _add_sweep_command(sub)
    for name, func, text in (("status", _cmd_status, "progress of a sweep"),
                             ("results", _cmd_results, "rebuild and summarise a sweep's results table")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("sweep", help="results/<sweep> folder, sweep name, or its spec YAML")
        cmd.add_argument("--results", default="results", help="results folder (default: results)")
        if name == "status":
            cmd.add_argument("--storage", default=os.environ.get("STUDY_STORAGE"), help="the sweep's storage URL")
        cmd.set_defaults(func=func)
    score = sub.add_parser("score-mt", help="score a Hugging Face seq2seq model on WMT14 newstest2014 (sacreBLEU)")
    score.add_argument("model", help="hub id or local folder of a seq2seq checkpoint with its tokenizer")
    score.add_argument("--src", default="de", choices=["de", "en"], help="source language (default: de)")
    score.add_argument("--tgt", default="en", choices=["de", "en"], help="target language (default: en)")
    score.add_argument("--beam", type=_positive_int, default=4, help="beam size (default: 4)")
    score.add_argument("--batch-size", type=_positive_int, default=16,
                       help="sentences decoded at once (default: 16)")
    score.add_argument("--limit", type=_positive_int,
                       help="score only the first N segments (the JSON says it is partial)")
    score.add_argument("--data-dir", default=os.environ.get("STUDY_DATA_DIR"),
                       help="local dataset folder (default: $STUDY_DATA_DIR; else the Hugging Face hub)")
    score.add_argument("--out", help="result JSON (default: runs/newstest2014-SRC-TGT-MODEL-beamB[-firstN].json)")
    score.set_defaults(func=_cmd_score_mt)
    from study.report.cli import add_commands as add_report_commands

    add_report_commands(sub)  # study report RESULTS, study compare RESULTS
    sub.add_parser("axes", help="list every design axis and its values").set_defaults(func=_cmd_axes)
    sub.add_parser("presets", help="list the architecture presets").set_defaults(func=_cmd_presets)
    return parser


if __name__ == "__main__":
    sys.exit(main())
