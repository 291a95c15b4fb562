"""Run `study run` end to end in a fresh process and record its numbers under bench/results/.

    python bench/record_run.py experiments/shakespeare_char_gpt2.yaml --data-dir ../shared/data [--set k=v ...]

Records the wall time of the whole command (process start, imports, data, training,
evaluation, writing), the run's metrics.json and resolved config, and the machine,
in bench/results/run-<name>.json. The run directory goes to bench/runs/<name>
(not committed) and is replaced on each call. A record already there is never replaced unless
--replace says so (a second seed needs its own name: --label or --set name=...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from study.io import atomic_write_text  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--data-dir", default=os.environ.get("STUDY_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--label", help="name of the record (default: the experiment name)")
    parser.add_argument("--replace", action="store_true", help="replace the record of that name if there is one")
    args = parser.parse_args()

    name = yaml.safe_load(Path(args.config).read_text()).get("name", "experiment")
    for override in args.set:
        if override.startswith("name="):
            name = override.split("=", 1)[1]
    label = args.label or name
    out = ROOT / "bench" / "results" / f"run-{label}.json"
    if out.exists() and not args.replace:  # before anything runs or is deleted
        parser.error(f"{out} holds an earlier record: name this one with --label (or --set name=...), "
                     "or pass --replace to replace it")
    run_dir = ROOT / "bench" / "runs" / label
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "study.cli", "run", args.config, "--data-dir", args.data_dir, "--out", str(run_dir)]
    for override in args.set:
        cmd += ["--set", override]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        print(f"study run failed with exit code {proc.returncode}", file=sys.stderr)
        return proc.returncode
    metrics = json.loads((run_dir / "metrics.json").read_text())
    environment = json.loads((run_dir / "env.json").read_text())
    record = {
        "label": label,
        "command": " ".join(["study", "run", args.config] + [f"--set {o}" for o in args.set]),
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": environment.get("cpu_model") or platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "flags": environment.get("cpu_flags"),
                    "device": environment.get("device")},  # the GPU's name where the run trained on one
        "end_to_end_wall_seconds": wall,
        "metrics": metrics,
        "config": yaml.safe_load((run_dir / "config.yaml").read_text()),
        "environment": environment,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(record, indent=2, default=str) + "\n")
    summary = {k: v for k, v in metrics["metrics"].items() if not isinstance(v, (dict, list))}
    print(json.dumps({"label": label, "wall_s": round(wall, 1), "steps": metrics["steps"], **summary}, indent=2))
    print(f"recorded {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
