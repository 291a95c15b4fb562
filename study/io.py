"""Atomic file writes: a reader (or a crash) never sees a half-written file; the lock processes that share a
file take turns under; and the YAML every config, spec and `--set` value is read and written with."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml


def _umask() -> int:
    """The process's umask: from /proc/self/status on Linux; elsewhere by setting it and straight back (a moment in
    which another thread's new file would get 022)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_path) for a temporary file beside `path`, fsync it, rename it over `path`, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes it 0600: give it the mode open() would have
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable: until the folder itself is synced, a power cut can undo the rename, and a
    run directory would come back with its metrics.json missing or an older one in its place."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # (a platform or filesystem where a folder cannot be opened: nothing to sync)
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (network mounts) refuse fsync on a folder; the rename stands regardless
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text))


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def unused_path(path: str | Path) -> Path:
    """`path`, or, where a file is already there, the first free one of `<stem>-2<suffix>`, `<stem>-3<suffix>`, ...:
    a benchmark's record named by its date never replaces one written earlier that day."""
    path = Path(path)
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def file_sha256(path: str | Path) -> str:
    """The SHA-256 hex digest of a file's bytes, read in 1 MiB blocks (a model.pt need not fit in memory twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def read_json_or_none(path: str | Path) -> Any:
    """The JSON in `path`, or None when it is missing or unreadable (never half-written: see atomic_write)."""
    try:
        return read_json(path)
    except (OSError, ValueError):  # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return None


@contextlib.contextmanager
def exclusive_lock(lock_file: str | Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive flock on `lock_file` (created if missing) for the block; `on_wait()` is called once if
    another process holds it first. The kernel releases a flock when its holder dies, so a killed process never
    leaves it held."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# YAML 1.2 core-schema scalars. PyYAML resolves plain scalars by YAML 1.1, where `010` is 8 (octal), `1:30` is 90
# (base 60), `no` and `off` are false (a language code `no` becomes a boolean), `2026-11-26` a date and `2e-3` a
# string. A config field given one of those would silently hold another value than the user wrote, so configs and
# specs are read (and written, so that what is written reads back the same) with the core schema's rules:
# true/false, decimal / 0o / 0x integers, decimal floats with an optional exponent, .inf/.nan, null/~.
_BOOL, _INT, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YAML11_ONLY = {_BOOL, _INT, _FLOAT, "tag:yaml.org,2002:timestamp"}
_CORE_RESOLVERS = [
    (_BOOL, r"true|True|TRUE|false|False|FALSE", "tTfF"),
    (_INT, r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    (_FLOAT, r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
     "-+0123456789."),
]


def _core_resolvers(cls: type, keep_yaml11: bool = False) -> None:
    cls.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if keep_yaml11 or tag not in _YAML11_ONLY]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for tag, pattern, first in _CORE_RESOLVERS:
        cls.add_implicit_resolver(tag, re.compile(f"^(?:{pattern})$"), list(first))


class _CoreLoader(yaml.SafeLoader):
    def construct_yaml_int(self, node: yaml.Node) -> int:
        text = self.construct_scalar(node)
        base = {"0o": 8, "0x": 16}.get(text[:2], 10)
        return int(text[2:] if base != 10 else text, base)

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        """A mapping whose key repeats is refused: PyYAML keeps the last value without a word, so a config with
        `model:` twice would drop the whole first section (YAML 1.2 requires keys to be unique)."""
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True) if key_node.tag != "tag:yaml.org,2002:merge" else None
                if key is not None and isinstance(key, Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"found the key {key!r} twice (first on line {seen[key].start_mark.line + 1}); YAML keeps only "
                        "the last, so the first would be dropped without a word", key_node.start_mark)
                seen.setdefault(key, key_node)
        return super().construct_mapping(node, deep=deep)


class _CoreDumper(yaml.SafeDumper):
    pass


_CoreLoader.add_constructor(_INT, _CoreLoader.construct_yaml_int)
_core_resolvers(_CoreLoader)
_core_resolvers(_CoreDumper, keep_yaml11=True)  # quote what either reader takes for a non-string: any tool reads it


def load_yaml(text: str) -> Any:
    """Parse YAML text with YAML 1.2 core-schema scalars (see above)."""
    return yaml.load(text, Loader=_CoreLoader)


def dump_yaml(data: Any) -> str:
    """Write `data` so that `load_yaml` (and a YAML 1.1 reader) reads it back equal: a string like "010", "1e5" or
    "no" is quoted."""
    return yaml.dump(data, Dumper=_CoreDumper, sort_keys=False)


def out_dir_problems(flag: str, path: str | None) -> list[str]:
    """What keeps a command from writing the folder `path` it was given as `flag` (--out, --results, ...): it is a
    file, it lies under a file, or this user cannot write where it would be created. Checked before the command
    reads or computes anything (a report drawn, a model decoded for minutes, then a traceback)."""
    problems = []
    if path:
        path = Path(path)
        existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
        if existing == path and not path.is_dir():
            problems.append(f"{flag} {path} is a file; give a folder (it is created if missing)")
        elif not existing.is_dir():
            problems.append(f"{flag} {path} lies under {existing}, which is a file")
        elif not os.access(existing, os.W_OK | os.X_OK):
            problems.append(f"{flag} {path}: this user cannot write in {existing}")
    return problems


def close_sweep_folders(path: str | Path, results: str | Path = "results") -> list[str]:
    """Sweep folders (those holding a plan.json) whose names are close to `path`'s, beside it or under `results`:
    what a command given a mistyped or bare sweep name suggests."""
    import difflib

    path = Path(path)
    found = []
    for parent in dict.fromkeys([path.parent, Path(results)]):
        sweeps = [p.parent.name for p in parent.glob("*/plan.json")] if parent.is_dir() else []
        found += [str(parent / c) for c in difflib.get_close_matches(path.name, sweeps)]
    return list(dict.fromkeys(found))
