"""What a sweep costs per trial beyond training and evaluation: forked trials (the default launcher) against a fresh
interpreter per trial, and against `study run` of the same trial.

    python bench/sweep_overhead.py --data-dir ../shared/data [--trials 4] [--rounds 2] [--steps 20]

The same short trials (the default sweep's baseline, `--steps` steps, one seed each) run three ways, in alternating
order each round:

* `study run` of each trial in its own process (what a user would otherwise script): the command's wall time;
* `study sweep --launcher spawn`: one worker, a fresh `python -m study.sweep.trial` per trial;
* `study sweep --launcher fork` (the default): one worker whose zygote imported torch and Lightning once.

For every trial the run record gives its training (`fit_seconds`) and final evaluation (`final_eval_seconds`); the
rest of the trial's wall time is the fixed cost. For a sweep the trial's wall time is the worker's (trial.json: from
the claim's bookkeeping to the outcome recorded), so the fixed cost includes process start, imports, data and
tokenizer loading, writing the run directory and the queue's bookkeeping; with the fork launcher the imports are the
zygote's, paid once per worker before its first claim, and so in no trial's fixed cost (they are the ~5 s a sweep of
any length pays once per worker). Prints the per-trial fixed cost of each way,
its ratio to the spawn launcher's measured in the same run, and writes bench/results/sweep-overhead-<date>.json with
the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from study.io import atomic_write_text, dump_yaml, unused_path

ROOT = Path(__file__).resolve().parents[1]


def _spec(folder: Path, trials: int, steps: int) -> Path:
    """The default sweep's base, one point (norm type at its baseline value), `trials` seeds, `steps` steps."""
    spec = {"name": "overhead", "base": str(ROOT / "experiments" / "ablation_base.yaml"), "design": "ofat",
            "axes": {"model.norm": ["rmsnorm"]}, "seeds": list(range(trials)), "workers": 1,
            "objective": {"metric": "valid_loss", "direction": "minimize"},
            "set": {"train.max_steps": steps, "train.eval_every": steps, "train.checkpoint_every": steps}}
    path = folder / "overhead.yaml"
    path.write_text(dump_yaml(spec))
    return path


def _records(results: Path) -> list[dict]:
    """Per finished trial of a sweep: worker wall time, fit and final evaluation seconds."""
    rows = []
    for trial in sorted((results / "runs").glob("*/seed-*/trial.json")):
        attempt = json.loads(trial.read_text())["attempts"][-1]
        cost = json.loads((trial.parent / "metrics.json").read_text())["cost"]
        rows.append({"wall": attempt["ended"] - attempt["started"], "fit": cost["fit_seconds"],
                     "eval": cost.get("final_eval_seconds", 0.0)})
    return rows


def run_sweep(spec: Path, work: Path, launcher: str, data_dir: str, threads: int) -> list[dict]:
    results = work / f"results-{launcher}"
    shutil.rmtree(results, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "study.cli", "sweep", str(spec), "--results", str(results), "--workers", "1",
                    "--threads", str(threads), "--launcher", launcher, "--data-dir", data_dir],
                   check=True, capture_output=True, cwd=ROOT)
    return _records(results)


def run_single(work: Path, trials: int, steps: int, data_dir: str, threads: int) -> list[dict]:
    """`study run` of the same trials, each command timed from outside."""
    rows = []
    for seed in range(trials):
        out = work / f"run-{seed}"
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "study.cli", "run", str(ROOT / "experiments" / "ablation_base.yaml"),
                        "--data-dir", data_dir, "--out", str(out), "--set", f"train.seed={seed}",
                        "--set", f"train.max_steps={steps}", "--set", f"train.eval_every={steps}",
                        "--set", f"train.checkpoint_every={steps}", "--set", "train.progress_bar=false"],
                       check=True, capture_output=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        cost = json.loads((out / "metrics.json").read_text())["cost"]
        rows.append({"wall": time.perf_counter() - started, "fit": cost["fit_seconds"],
                     "eval": cost.get("final_eval_seconds", 0.0)})
    return rows


def _fixed(rows: list[dict]) -> float:
    return statistics.mean(r["wall"] - r["fit"] - r["eval"] for r in rows)


def _machine() -> dict:
    import torch  # here, not at the top: the benchmark times processes that import it, not its own start

    from study.run.environment import cpu_flags, cpu_model

    return {"cpu": cpu_model(), **cpu_flags(), "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_at_start": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("STUDY_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/sweep-overhead-<date>.json)")
    args = parser.parse_args()
    ways = ("study run", "spawn", "fork")
    per_round: list[dict[str, float]] = []
    means: dict[str, list[dict[str, float]]] = {}  # per way, per round: mean wall, fit and final-eval seconds
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec = _spec(work, args.trials, args.steps)
        for r in range(args.rounds):
            order = ways[r % 3:] + ways[:r % 3]  # a different way goes first each round
            fixed = {}
            for way in order:
                rows = (run_single(work, args.trials, args.steps, args.data_dir, args.threads) if way == "study run"
                        else run_sweep(spec, work, way, args.data_dir, args.threads))
                fixed[way] = _fixed(rows)
                means.setdefault(way, []).append({k: statistics.mean(x[k] for x in rows) for k in ("wall", "fit", "eval")})
                print(f"round {r}: {way:9s} fixed cost {fixed[way]:6.2f} s/trial "
                      f"(wall {statistics.mean(x['wall'] for x in rows):.2f}, fit "
                      f"{statistics.mean(x['fit'] for x in rows):.2f}, final eval "
                      f"{statistics.mean(x['eval'] for x in rows):.2f})", flush=True)
            per_round.append(fixed)
    summary = {way: statistics.median(f[way] for f in per_round) for way in ways}
    ratio = statistics.median(f["fork"] / f["spawn"] for f in per_round)
    print(f"median fixed cost per trial: " + ", ".join(f"{w} {summary[w]:.2f} s" for w in ways)
          + f"; fork / spawn {ratio:.2f}")
    record = {"benchmark": "sweep_overhead", "date": str(datetime.date.today()), "machine": _machine(),
              "trials": args.trials, "steps": args.steps, "threads": args.threads, "rounds": per_round,
              "median_fixed_seconds_per_trial": summary, "median_ratio_fork_to_spawn": ratio,
              "mean_seconds_per_trial_by_round": means}
    out = Path(args.out) if args.out else unused_path(ROOT / "bench" / "results" / f"sweep-overhead-{datetime.date.today()}.json")
    atomic_write_text(out, json.dumps(record, indent=2) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
