"""The dtype computations run in under autocast (shared by attention masks and the fused loss)."""

from __future__ import annotations

import torch


def host_reads_are_free(device: torch.device) -> bool:
    """Whether reading a tensor's value on the host (`.item()`, `bool()`, `.tolist()`) costs nothing on `device`: on
    the CPU there is no queue of kernels to wait for; on a GPU each read stalls the host until the device catches up.
    Code that branches on a value takes the branch only where this holds (tests patch it to run the device path)."""
    return device.type == "cpu"


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for `device_type`, or None when autocast is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4
        if device_type == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    return None


def native_bf16(accelerator: str = "auto") -> bool:
    """Whether the device a run trains on multiplies bf16 natively: a CUDA GPU with bf16 (Ampere and later), or a
    CPU with AVX-512 BF16 or AMX. Elsewhere bf16 matmuls are emulated, 90 to 200x slower than float32 on an AVX2 CPU
    (0.9-1.0 against 90-184 GFLOP/s for a 1024^3 GEMM on AVX2 EPYCs: bench/results/throughput-2026-11-22.json,
    throughput-2026-11-2[57]-avx2-fp32.json)."""
    if trains_on_cuda(accelerator):
        try:  # without including_emulation=False a pre-Ampere GPU (V100, T4) answers True: it can *store* bf16
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.4
            return torch.cuda.get_device_capability() >= (8, 0)
    if accelerator not in ("auto", "cpu"):
        return False  # mps: bf16 autocast is partial there
    cpu = getattr(torch, "cpu", None)
    checks = (getattr(cpu, "_is_avx512_bf16_supported", None), getattr(cpu, "_is_amx_tile_supported", None))
    return any(bool(check()) for check in checks if check is not None)


def emulated_bf16(precision: str, accelerator: str = "auto") -> str | None:
    """Why a run at this (resolved) precision would compute bf16 by emulation, or None: bf16 on a CPU without AVX-512
    BF16 or AMX. `auto` never resolves to that; a precision named outright can."""
    if not precision.startswith("bf16") or not trains_on_cpu(accelerator) or native_bf16(accelerator):
        return None
    return (f"train.precision {precision} on this CPU, which has no AVX-512 BF16 or AMX, emulates bf16: its matmuls "
            "run 90 to 200x slower than float32 (0.9-1.0 against 90-184 GFLOP/s on AVX2 EPYCs)")


def enable_tf32(accelerator: str = "auto") -> bool:
    """Let float32 matmuls and convolutions use TF32 on a CUDA GPU that has it (Ampere and later), as nanoGPT and
    litgpt do: float32 training on an A100/H100 otherwise runs its matmuls at a fraction of the tensor cores' rate, for
    precision (10-bit mantissa products, float32 accumulation) that training does not need. Returns whether it is on
    (recorded in env.json). CPUs are left as they are."""
    if not trains_on_cuda(accelerator) or torch.cuda.get_device_capability() < (8, 0):
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def tf32_enabled() -> bool:
    return bool(torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32)


def trains_on_cuda(accelerator: str) -> bool:
    """Whether a run with this `train.accelerator` trains on a CUDA GPU (`auto` does where torch sees one)."""
    return accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def trains_on_cpu(accelerator: str) -> bool:
    """Whether a run with this `train.accelerator` trains on the CPU (`auto` does where torch sees no CUDA device)."""
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def resolve_precision(precision: str, accelerator: str = "auto") -> str:
    """The Lightning precision a run uses: `auto` becomes `bf16-mixed` where bf16 is native, else `32-true`; `16-mixed`
    on a CPU becomes `bf16-mixed`, which is what Lightning runs there (CPU autocast has no float16)."""
    if precision == "16-mixed" and trains_on_cpu(accelerator):
        return "bf16-mixed"
    if precision != "auto":
        return precision
    return "bf16-mixed" if native_bf16(accelerator) else "32-true"
