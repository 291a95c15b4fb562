"""What a run ran on: code version, packages, device, precision, attention kernels."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.metadata
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from study.model.precision import (enable_tf32, native_bf16, resolve_precision, tf32_enabled, trains_on_cpu,
                                   trains_on_cuda)

PACKAGES = ("torch", "lightning", "optuna", "tokenizers", "datasets", "sacrebleu", "transformers", "numpy", "pandas")


def git_state() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        # --no-optional-locks: a status killed by the timeout would leave .git/index.lock behind, blocking git
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform's answer: numbers from two CPU kinds of the same
    architecture (an AVX2 EPYC, a Zen 4, a Xeon with AMX) differ several-fold, so every record names its kind."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def cpu_flags() -> dict[str, bool]:
    """Which of the instruction sets that decide this project's CPU speed the CPU has (/proc/cpuinfo; empty off
    Linux): AVX2 only emulates bf16 (~100x slower), AVX-512 BF16 runs it natively, AMX-BF16 adds tile matmuls."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {flag: flag in flags for flag in CPU_FLAGS}


def attention_kernels(accelerator: str = "auto") -> dict[str, Any]:
    """Which SDPA kernels this process may use (GPU: flash / memory-efficient / math)."""
    if trains_on_cuda(accelerator):
        return {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "memory_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
    return {"cpu": "fused SDPA (flash-style CPU kernel; math fallback); half-precision training below 256 keys: "
                   "its forward, our backward (bf16: batched GEMMs and C++ passes; fp16: its float32 backward; "
                   "study.model.attention)"}


def cpu_kernels(model: Any, accelerator: str, precision: str = "32-true") -> dict[str, str]:
    """Which C++ CPU kernel each axis value of `model` (a ModelConfig) that declares one runs, the fused loss's (every
    model's vocabulary projection), the attention backward's (bf16 training: study.model.attention) and beam search's
    (encoder-decoders): "c++", or "eager" where it could not be built. Built here, before training, so that a first
    build's seconds are not timed as training or decoding."""
    from study.axes import ACTIVATIONS, NORMS, POSITIONS
    from study.axes.cpu_kernels import cpu_ops

    if not trains_on_cpu(accelerator):
        return {}
    values = (NORMS[model.norm], POSITIONS[model.position], ACTIVATIONS[model.activation])
    names = [value.cpu_kernel for value in values if value.cpu_kernel]
    names.append("cross_entropy_grad")  # study.model.loss's chunks of logits
    if resolve_precision(precision, accelerator) == "bf16-mixed":
        names.append("attention_grad")  # short attention's bf16 backward
    if model.arch == "encoder-decoder":
        names.append("log_softmax_topk")  # study.model.generate's candidate selection
    return {name: "c++" if cpu_ops(name) is not None else "eager" for name in names}


def bench_provenance(on_cpu: bool = True) -> dict[str, Any]:
    """What a benchmark record needs to say what ran: the code (commit, uncommitted changes) and, for a CPU run,
    whether the C++ CPU kernels were built and loaded ("c++") or their eager fallbacks ran ("eager":
    STUDY_CPU_KERNELS=0, no compiler), which a row labelled by the kernel would otherwise hide."""
    if not on_cpu:
        return git_state()
    from study.axes.cpu_kernels import cpu_ops

    return {**git_state(), "cpu_kernels": "c++" if cpu_ops("cross_entropy_grad") is not None else "eager"}


# glibc's mallopt parameters (malloc.h) and what a CPU training process sets: every block from the heap, none mapped
# alone, and the heap's free top kept up to 2 GiB (mallopt takes an int).
_MALLOPT = {"mmap_max": -4, "trim_threshold": -1}
CPU_MALLOC = {"mmap_max": 0, "trim_threshold": 2**31 - 1}
_malloc_set: dict[str, int] = {}


def reuse_freed_memory(accelerator: str) -> dict[str, int]:
    """Keep the memory a CPU training step frees in this process for the next step to reuse.

    glibc's malloc maps each block above its mmap threshold (128 KiB, raised as such blocks are freed, at most 32 MiB)
    on its own and unmaps it when freed, and trims the heap's free top above twice that threshold, so every step of CPU
    training allocates its activations in fresh pages, each a page fault the kernel serves and zeroes: 25-110 thousand
    faults a step for the 20M decoders of bench/throughput.py, 130-820 thousand for Hugging Face's, a few hundred with
    these settings, which made steps 2-10% faster for ours and up to 1.6x for Hugging Face's (bench/README.md, "Freed
    memory kept for reuse"). PyTorch's CPU tuning guide gets the same reuse by preloading jemalloc or tcmalloc, which
    must happen before the process starts; mallopt works inside a trial's process, which returns the memory when it
    exits. Returns the settings made (env.json's `malloc`): none off the CPU, or where the C library is not glibc."""
    if not trains_on_cpu(accelerator) or platform.libc_ver()[0] != "glibc":
        return {}
    import ctypes

    mallopt = ctypes.CDLL(None).mallopt
    for name, value in CPU_MALLOC.items():
        if mallopt(_MALLOPT[name], value) == 1:
            _malloc_set[name] = value
    return dict(_malloc_set)


def prepare_training_process(accelerator: str) -> None:
    """The process settings a training run makes before its env.json records them (a single run, a suite or a
    pipeline, whose parts then train in the same process): TF32 on a GPU that has it, memory reuse on a CPU."""
    enable_tf32(accelerator)
    reuse_freed_memory(accelerator)


def snapshot(precision: str | None = None, accelerator: str = "auto") -> dict[str, Any]:
    """env.json: what a run with `train.precision` and `train.accelerator` ran on (a CPU run on a GPU machine
    records the CPU, its bf16 and its kernels)."""
    on_gpu = trains_on_cuda(accelerator)
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    device = torch.cuda.get_device_name(0) if on_gpu else platform.processor() or platform.machine()
    return {
        "git": git_state(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "device": device,
        "cuda": torch.version.cuda,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # a sweep worker gives its GPUs this way
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "precision": precision,
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # e.g. AVX2, AVX512
        "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        "native_bf16": native_bf16(accelerator),
        "tf32_matmul": on_gpu and tf32_enabled(),  # float32 matmuls on TF32 tensor cores (precision.enable_tf32)
        "attention_kernels": attention_kernels(accelerator),
        "malloc": dict(_malloc_set),  # glibc thresholds set for CPU training (reuse_freed_memory); {}: the defaults
    }


def reset_peak_memory(accelerator: str) -> None:
    """Start a run's peak-memory count here: a suite's parts and a pipeline's stages train one after another in one
    process, and each records its own peak (`peak_memory_bytes`). On Linux writing 5 to /proc/self/clear_refs resets
    the process's peak resident set (VmHWM); getrusage's ru_maxrss cannot be reset."""
    if trains_on_cuda(accelerator):
        torch.cuda.reset_peak_memory_stats()
        return
    # the peak restarts from the resident set now, which holds what an earlier run freed: a CPU training process
    # keeps freed memory in its heap (CPU_MALLOC), so it is handed back to the system first
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)  # glibc
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_bytes(accelerator: str) -> int:
    """The most memory this run held since `reset_peak_memory`: the GPU's allocated bytes, or the process's peak
    resident set on the CPU (VmHWM; ru_maxrss, the lifetime peak, where /proc is not there)."""
    if trains_on_cuda(accelerator):
        return int(torch.cuda.max_memory_allocated())
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
