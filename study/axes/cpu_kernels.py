"""C++ CPU kernels for axis values that eager PyTorch runs as composites, for the fused loss's chunks of logits
(study/model/loss.py) and for beam search's candidate selection (study/model/generate.py), built on first use.

Why by hand: an ablation must time every value at its best kernel, and torch (2.13) has no fused CPU RMSNorm, where
LayerNorm gets one fused kernel each way (bench/README.md, "RMSNorm at its best kernel"), nor a fused CPU rotary
embedding or gated unit (SwiGLU, GEGLU; where ReLU and GELU get one kernel each way), its tanh-form GELU is
slower than its erf form, and its cross-entropy makes several passes over each chunk of logits; no maintained library
ships them for CPU tensors (Apex's, FlashAttention's and Liger's, whose fused linear cross-entropy is the model for
study/model/loss.py, are CUDA/Triton).
`torch.utils.cpp_extension.load` compiles every `kernels/*.cpp` into one library, once per machine, into torch's
extension cache (an flock guards concurrent builds; see `_building`): ninja compiles the files in parallel, where one
extension per kernel was built one after another as each was first used (15-30 s each on two cores, mostly parsing
torch's headers). Each file registers its own `torch.ops.study_<name>`; OpenMP threads are sized to `torch.get_num_threads()`
at each call, as TorchInductor's CPU kernels do.

Where no compiler or ninja is found, or STUDY_CPU_KERNELS=0, the callers keep their eager path after one warning: the
same function (tests/test_norm_kernels.py, tests/test_rotary_kernel.py, tests/test_activation_kernels.py,
tests/test_loss_kernel.py and tests/test_decode_kernels.py hold both paths to the eager formulas).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # (Windows: no flock; torch's own lock alone guards a build there)
    fcntl = None

import torch

KERNELS = Path(__file__).with_name("kernels")
_ISA_FLAGS = {  # what the build may assume: the capability torch itself dispatches to on this CPU
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
# -fno-trapping-math lets GCC evaluate both sides of a select (the kernels' `u < 0 ? a : b`) in a vector loop: without
# it, on AVX2 (no AVX-512 masks) GCC 12 would not if-convert a division that might trap, and left the activation
# kernels' loops scalar: the GELU-tanh kernel took 1.8x torch's own time forward + backward on a 2-vCPU AVX2 EPYC
# (bench/README.md). Nothing the kernels compute changes: no reassociation, and infinities and NaN behave as before
# (the option only drops floating-point exception flags, which nothing here reads).
_VALUE_SAFE_FLAGS = ["-fno-trapping-math"]
_loaded: dict[str, Any] = {}  # name -> its ops, or None: the eager path


def _ninja_on_path() -> None:
    """The `ninja` wheel installs its binary beside the interpreter, which need not be on PATH (an unactivated venv)."""
    if shutil.which("ninja") is None:
        os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


def _build() -> None:
    """Compile (or load from torch's cache) the one library of every kernel: its ops are registered as it loads."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", "-std=c++17", f"-DSTUDY_HEADERS={_headers_digest()}", *_VALUE_SAFE_FLAGS]
    flags += _ISA_FLAGS.get(capability, [])
    name = f"study_kernels_{capability.lower()}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))  # (where load() builds by default)
    with _building(build_dir):
        cpp_extension.load(
            name=name, sources=[str(p) for p in sorted(KERNELS.glob("*.cpp"))], extra_cflags=flags,
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False, build_directory=str(build_dir),
        )


@contextlib.contextmanager
def _building(build_dir: Path) -> Iterator[None]:
    """Hold the build directory for this process (an flock, which the kernel releases however the process ends) and
    remove a `lock` file torch's own build lock left there. That lock is a file whose existence is the lock: a build
    killed while it held it (Ctrl-C during a first run, a sweep trial killed as it compiled) leaves it behind, and
    every later load would wait on it forever without a word. Under the flock no other process of study is
    building, so such a file is stale."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "study-build.flock", "w") as held:
        if fcntl is not None:
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            warnings.warn(f"study: removing {stale}, left by a build of the C++ CPU kernels that was killed",
                          stacklevel=4)
            stale.unlink(missing_ok=True)
        yield


def _headers_digest() -> str:
    """A hash of the kernels' shared headers: torch rebuilds an extension when its source or flags change, not when a
    header it includes does, so the flags carry this."""
    digest = hashlib.sha256()
    for header in sorted(KERNELS.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def cpu_ops(name: str) -> Any | None:
    """`torch.ops.study_<name>` from kernels/<name>.cpp, or None where the kernels cannot be built (warned once)."""
    if name not in _loaded:
        built = os.environ.get("STUDY_CPU_KERNELS", "1") != "0" and _library_built()
        _loaded[name] = getattr(torch.ops, f"study_{name}") if built else None
    return _loaded[name]


@functools.cache
def _library_built() -> bool:
    """Whether the kernels' library is built and loaded: tried once per process."""
    try:
        _build()
        return True
    except Exception as e:  # no compiler, no ninja, a failed build: the eager path computes the same
        warnings.warn(f"study: the C++ CPU kernels could not be built ({type(e).__name__}: {str(e)[:300]}); "
                      "using the eager PyTorch paths", stacklevel=3)
        return False


def eager_cpu_ops(name: str, x: torch.Tensor) -> Any | None:
    """`cpu_ops(name)` for a CPU tensor outside torch.compile (which traces the eager path), else None."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return cpu_ops(name)
