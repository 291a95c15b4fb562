"""Building the C++ CPU kernels survives a build that was killed: torch's build lock is a file whose existence is
the lock, so one killed while it held it (Ctrl-C during a first run, a sweep trial killed as it compiled) would make
every later run wait on it forever, silently. The compiler is not run here (a build takes minutes on two cores):
torch's `load` is replaced by a probe of the state it is called in."""

from __future__ import annotations

import fcntl

import pytest
from torch.utils import cpp_extension

from study.axes import cpu_kernels


def test_a_lock_left_by_a_killed_build_is_removed_while_this_process_holds_the_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen = {}

    def probe(name, sources, build_directory=None, **kwargs):
        build = tmp_path / name
        seen["build_directory"] = build_directory == str(build)
        seen["stale lock"] = (build / "lock").exists()
        with open(build / "study-build.flock") as other:  # another process's attempt to build now must wait
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)

    monkeypatch.setattr(cpp_extension, "load", probe)
    name = f"study_kernels_{cpu_kernels.torch.backends.cpu.get_cpu_capability().lower()}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "lock").write_text("")  # what a build killed mid-way leaves
    with pytest.warns(UserWarning, match="left by a build of the C\\+\\+ CPU kernels that was killed"):
        cpu_kernels._build()
    assert seen == {"build_directory": True, "stale lock": False}
    with open(tmp_path / name / "study-build.flock") as after:  # released once the build returned
        fcntl.flock(after, fcntl.LOCK_EX | fcntl.LOCK_NB)
