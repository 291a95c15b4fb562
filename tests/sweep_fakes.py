"""Stand-in trial runners for the sweep tests: the queue, the processes and the files are
real, only the training is replaced by something fast and scripted by the config."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from study.io import atomic_write_json, atomic_write_text


def fake_run(cfg, run_dir, data_dir=None, cache_dir=None):
    """Writes a finished run directory. The config scripts the behaviour:
    train.lr >= 1 diverges; model.d_model == 24 always fails; model.d_model == 40 fails on its
    first attempt only; model.d_model == 48 completes without writing valid_loss (a task that broke its
    declaration); env STUDY_FAKE_SLEEP sleeps (so a test can kill workers mid-trial)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "executions.log", "a") as f:  # every start, to count repeats
        f.write(f"start {os.getpid()}\n")
    time.sleep(float(os.environ.get("STUDY_FAKE_SLEEP", "0")))
    if cfg.model.d_model == 24:
        raise RuntimeError("scripted failure (d_model=24)")
    first_try = run_dir / "first-attempt-failed"
    if cfg.model.d_model == 40 and not first_try.exists():
        first_try.write_text("")
        raise RuntimeError("scripted transient failure (d_model=40)")
    if os.environ.get("STUDY_FAKE_CURVE"):  # a validation curve, logged as Lightning's CSV logger does
        (run_dir / "logs").mkdir(exist_ok=True)
        with open(run_dir / "logs" / "metrics.csv", "w") as f:
            f.write("step,val/loss\n")
            for step in range(1, 5):
                f.write(f"{step},{2.0 + 0.3 * abs(math.log10(cfg.train.lr) + 3) + 1.0 / step}\n")
                f.flush()
                time.sleep(0.5)
    atomic_write_text(run_dir / "config.yaml", cfg.to_yaml())
    diverged = cfg.train.lr >= 1
    # best at lr = 1e-3 (a bowl in log lr), worse for post-norm, a little noise by seed
    loss = (2.0 + 0.01 * cfg.train.seed + (0.1 if cfg.model.norm_position == "post" else 0.0)
            + 0.1 * (math.log10(cfg.train.lr) + 3) ** 2)
    metrics = {"status": "diverged" if diverged else "completed", "diverged_at_step": 3 if diverged else None,
               "steps": 3 if diverged else 10, "stopped_by": None, "train_tokens": 100,
               "metrics": {} if diverged else {"valid_loss": loss, "valid_ppl_by_length": {
                   "8": 7.0, "16": "n/a" if cfg.model.position == "learned" else 7.5}},
               "cost": {"parameters": cfg.model.d_model * 100, "train_tokens_per_s": 1000.0}}
    if cfg.model.d_model == 48:
        del metrics["metrics"]["valid_loss"]
    atomic_write_json(run_dir / "metrics.json", metrics)
    with open(run_dir / "completions.log", "a") as f:
        f.write(f"done {os.getpid()}\n")
    return metrics
