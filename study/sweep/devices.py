"""Which GPUs each local worker's trials may use: every worker its own, none shared.

Without an assignment every trial of every worker sees all GPUs and Lightning puts each one on GPU 0: N workers train
on one GPU while the others idle. Each worker is given `CUDA_VISIBLE_DEVICES` with its own `gpus_per_trial` GPUs
(the points' `train.devices`: a DDP trial needs that many), taken in order from the GPUs this process may use (its
own CUDA_VISIBLE_DEVICES, else every GPU the driver lists). Counting GPUs reads /proc/driver/nvidia (or asks
`nvidia-smi`), never CUDA itself: the sweep's processes must not hold a CUDA context (a forked trial could not use
it).

Two `study sweep` commands on one host would otherwise both start from the first GPU: `claim` holds each GPU a sweep
uses host-wide (an flock on a file per GPU id in $STUDY_GPU_CLAIMS, else <tmp>/study-gpu-claims) and draws first from
the GPUs no other sweep holds. The kernel drops a dead process's flocks, so a killed sweep leaves no stale claim. When
too few GPUs are free the sweep shares held ones, saying so, rather than refusing (a one-GPU host may run two small
sweeps at once). A GPU is known by its id as CUDA_VISIBLE_DEVICES spells it: sweeps that name one GPU by index and by
UUID do not see each other's claims.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
CLAIMS_ENV = "STUDY_GPU_CLAIMS"


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


class GpuClaims:
    """The GPUs this process holds host-wide, until `release()` or its end."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def take(self, gpu: str) -> bool:
        """Hold `gpu` unless another process does; True when held. A claims folder this user cannot use claims
        nothing, and the GPU counts as free (as before claims existed), with one log line."""
        import fcntl

        folder = Path(os.environ.get(CLAIMS_ENV) or Path(tempfile.gettempdir()) / "study-gpu-claims")
        try:
            try:
                folder.mkdir(parents=True)
                folder.chmod(0o1777)  # every user's sweeps claim here (sticky: none deletes another's files)
            except FileExistsError:
                pass
            path = folder / f"gpu-{gpu.replace('/', '_')}.lock"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except PermissionError:  # another user's file: reading is enough to lock it
                fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            log.warning("cannot claim GPU %s host-wide (%s): other sweeps on this host may use it too", gpu, err)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.fds[gpu] = fd
        return True

    def release(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def claim(workers: int, gpus_per_trial: int, gpus: list[str]) -> tuple[list[str | None], GpuClaims]:
    """`assign`, drawing first from the GPUs of `gpus` that no other sweep on this host holds, and holding those;
    with too few free, held ones are shared (a warning names them). Release the claims when the sweep ends."""
    claims = GpuClaims()
    need = workers * gpus_per_trial
    if not gpus or not need or need > len(gpus):
        return assign(workers, gpus_per_trial, gpus), claims  # (no GPU, or too few: assign's error)
    free: list[str] = []
    for gpu in gpus:
        if len(free) == need:
            break
        if claims.take(gpu):
            free.append(gpu)
    shared = [g for g in gpus if g not in free][:need - len(free)]
    if shared:
        log.warning("GPU(s) %s are in use by another `study sweep` on this host; this sweep shares them (give it other "
                    "GPUs with CUDA_VISIBLE_DEVICES, or fewer --workers)", ",".join(shared))
    return assign(workers, gpus_per_trial, free + shared), claims
