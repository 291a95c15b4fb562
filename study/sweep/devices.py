"""Which GPUs each local worker's trials may use: every worker its own, none shared.

Without an assignment every trial of every worker sees all GPUs and Lightning puts each one on GPU 0: N workers train
on one GPU while the others idle. Each worker is given `CUDA_VISIBLE_DEVICES` with its own `gpus_per_trial` GPUs
(the points' `train.devices`: a DDP trial needs that many), taken in order from the GPUs this process may use (its
own CUDA_VISIBLE_DEVICES, else every GPU the driver lists). Counting GPUs reads /proc/driver/nvidia (or asks
`nvidia-smi`), never CUDA itself: the sweep's processes must not hold a CUDA context (a forked trial could not use
it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


class DeviceError(ValueError):
    pass


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPU ids this process may hand out: its CUDA_VISIBLE_DEVICES when set (an empty value: none), else
    0..n-1 for the n GPUs the NVIDIA driver lists."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i in range(_driver_gpu_count())]


def _driver_gpu_count() -> int:
    listed = Path("/proc/driver/nvidia/gpus")
    if listed.is_dir():
        return sum(1 for _ in listed.iterdir())
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return 0
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return 0


def assign(workers: int, gpus_per_trial: int, gpus: list[str]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each of `workers` workers (None each when there is no GPU: CPU trials); a
    DeviceError when the GPUs cannot give every worker its own."""
    if not gpus or gpus_per_trial == 0:
        return [None] * workers
    need = workers * gpus_per_trial
    if need > len(gpus):
        raise DeviceError(f"{workers} worker(s) x {gpus_per_trial} GPU(s) per trial need {need} GPUs, but "
                          f"{len(gpus)} are visible ({','.join(gpus)}): use --workers {len(gpus) // gpus_per_trial or 1}"
                          + ("" if len(gpus) >= gpus_per_trial else f" and train.devices <= {len(gpus)}"))
    return [",".join(gpus[w * gpus_per_trial:(w + 1) * gpus_per_trial]) for w in range(workers)]


def gpus_per_trial(plan: dict) -> int:
    """The most GPUs one trial of the plan uses: the largest `train.devices` of its points (a study in stages: of any
    stage) that do not train on the CPU (`train.accelerator: cpu`); 0 when none uses a GPU."""
    most = 0
    for point in plan.get("points", []):
        cfg = point.get("config") or {}
        for section in list((cfg.get("stages") or {}).values()) or [cfg]:
            train = section.get("train") or {}
            if train.get("accelerator", "auto") != "cpu":
                most = max(most, int(train.get("devices", 1)))
    return most
