"""`study` command line: `study run CONFIG.yaml [--set section.field=value ...]`, `study axes`, `study presets`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _cmd_run(args: argparse.Namespace) -> int:
    from study.config import ConfigError, ExperimentConfig

    try:
        cfg = ExperimentConfig.load(args.config, args.set or [])
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"study run: {err}", file=sys.stderr)
        return 2
    from study.run import RunDirConflict, run_experiment
    from study.tasks.data import DataError

    out = Path(args.out) if args.out else Path("runs") / cfg.name
    try:
        metrics = run_experiment(cfg, out, data_dir=args.data_dir, cache_dir=args.cache_dir, force=args.force)
    except (DataError, RunDirConflict, ConfigError, ValueError) as err:
        print(f"study run: {err}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in metrics["metrics"].items() if not isinstance(v, dict)}
    print(json.dumps({"run_dir": str(out), "status": metrics["status"], "steps": metrics["steps"], **summary}, indent=2))
    return 0


def _cmd_axes(args: argparse.Namespace) -> int:
    from study.config import axis_choices
    from study.model import ACTIVATIONS, NORMS, POSITIONS, RESIDUALS

    registries = {r.axis: r for r in (NORMS, RESIDUALS, POSITIONS, ACTIVATIONS)}
    for axis, values in axis_choices().items():
        print(f"{axis}: {', '.join(values)}")
        if axis in registries:
            for value in values:
                print(f"    {value:12s} {registries[axis].doc(value)}")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    from study.config import PRESETS, preset

    for name in PRESETS:
        cfg = preset(name)
        print(f"{name:8s} {cfg.arch:16s} {cfg.norm_position:5s} {cfg.norm:9s} {cfg.position:10s} "
              f"{cfg.activation:9s} {cfg.attention_kind} window={cfg.window}")
    return 0


def main(argv: list[str] | None = None) -> int:
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
    sub.add_parser("axes", help="list every design axis and its values").set_defaults(func=_cmd_axes)
    sub.add_parser("presets", help="list the architecture presets").set_defaults(func=_cmd_presets)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
