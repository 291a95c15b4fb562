"""One trial in its own process: `python -m study.sweep.trial --config POINT.yaml --seed K --run-dir DIR`.

A fresh process per trial gives every trial a fresh RNG state and returns all of its memory
when it ends. The worker that starts it owns the queue bookkeeping; this process only trains
and writes its run directory (atomically, through `study.run.run_experiment`, which resumes
from the directory's last checkpoint when a previous attempt was interrupted), holding the run
directory's lock (`study.run.pipeline.run_dir_lock`), so that no other sweep's trial of the same point
runs it at once. A point that is a pipeline keeps its shared stages beside every other run directory
(results/runs/), where a plain sweep of that stage's config would put them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Callable

DEFAULT_RUNNER = "study.run:run_experiment"


def load_runner(spec: str) -> Callable:
    """The function that runs a trial: the run layer's, or a stand-in named `module:function` (the sweep tests
    replace training with scripted runs this way)."""
    if spec == DEFAULT_RUNNER:
        from study.run import run_experiment

        return run_experiment
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.sweep.trial")
    parser.add_argument("--config", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--data-dir")
    parser.add_argument("--cache-dir")
    parser.add_argument("--runner", default=DEFAULT_RUNNER, help="module:function(cfg, run_dir, data_dir, cache_dir)")
    args = parser.parse_args(argv)
    if int(os.environ.get("LOCAL_RANK", 0)) > 0:  # a DDP rank Lightning started for a trial: it dies with the trial
        from study.sweep.zygote import die_with_parent  # (rank zero, its parent), which dies with its worker

        die_with_parent()

    from study.config import PipelineConfig, load_experiment
    from study.run.pipeline import run_dir_lock

    cfg = load_experiment(Path(args.config)).with_seed(args.seed)
    # the shared stages' root as an absolute path: later stages record it in task.init_from (study.run.pipeline)
    extra = {"stage_root": Path(args.run_dir).resolve().parent.parent} if isinstance(cfg, PipelineConfig) else {}
    # two sweeps that share a point each hand out this run directory (each has its own queue): the second trial
    # waits here for the first, then finds the run finished (the runner hands a finished run back untrained)
    with run_dir_lock(args.run_dir):
        load_runner(args.runner)(cfg, args.run_dir, data_dir=args.data_dir, cache_dir=args.cache_dir, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
