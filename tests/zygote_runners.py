"""A trial runner for tests/test_zygote.py, scripted by $STUDY_ZYGOTE_MODE: ok (record what the child sees), fail,
sleep (until killed), exit-quietly (sys.exit()), exit-with-text (sys.exit("..."))."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

print("a module that prints when imported (the zygote preloads it): this must not reach the worker's replies")


def _write_at_once(path: Path, text: str) -> None:
    """The test polls for the file: written in place, it could be read while still empty."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run(cfg, run_dir, data_dir=None, cache_dir=None):
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mode = os.environ.get("STUDY_ZYGOTE_MODE", "ok")
    print("hello from the trial")
    if mode == "fail":
        raise RuntimeError("scripted failure")
    if mode == "exit-quietly":
        sys.exit()
    if mode == "exit-with-text":
        sys.exit("scripted reason")
    if mode == "ddp-command":  # what Lightning's DDP launcher would start for the other ranks
        from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd

        (run_dir / "command.txt").write_text("\n".join(_basic_subprocess_cmd()))
        return
    if mode in ("rank-left", "rank-sleep"):  # as Lightning's DDP launcher starts rank 1: a plain Popen
        import subprocess

        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        _write_at_once(run_dir / "rank.pid", str(rank.pid))
        if mode == "rank-left":
            return
        time.sleep(600)
    if mode == "rank-trial":  # rank 1 as Lightning's launcher starts it: the trial's command, LOCAL_RANK=1
        import subprocess

        env = {**os.environ, "LOCAL_RANK": "1", "STUDY_ZYGOTE_MODE": "sleep"}
        rank = subprocess.Popen([sys.executable, "-m", "study.sweep.trial", *sys.argv[1:]], env=env)
        _write_at_once(run_dir / "rank.pid", str(rank.pid))
        time.sleep(600)
    if mode == "sleep":
        (run_dir / "sleeping").write_text("")
        time.sleep(600)
    import torch

    threads = torch.get_num_threads()
    draws = f"torch={torch.rand(1).item()!r} python={random.random()!r}"
    zygote = f"zygote_threads={len(os.listdir(f'/proc/{os.getppid()}/task'))}"  # as it forked: it has done nothing since
    (run_dir / "out.txt").write_text(f"seed={cfg.train.seed} mode={mode} threads={threads} {draws} {zygote}\n")
