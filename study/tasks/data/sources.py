"""Where data comes from: a local folder or the Hugging Face hub.

Resolution order for every loader:

1. A local folder, when one is given: the `data_dir` argument (the CLI passes `--data-dir`), else the environment
   variable `STUDY_DATA_DIR`. Local takes precedence over the hub. Each dataset lives in its own sub-folder
   (`DIR/wikitext-2/`, `DIR/multi30k/`, `DIR/glue/`, ...); pointing `data_dir` straight at that sub-folder also works.
2. The Hugging Face hub, used when no local folder is given, or when the local folder lacks the dataset's files.
   The hub is skipped at once when `HF_HUB_OFFLINE` or `HF_DATASETS_OFFLINE` is set, and the first request (resolving
   the dataset's current revision) uses a short timeout (`STUDY_HUB_TIMEOUT` seconds, default 5), so an unreachable
   hub fails fast. The revision found is pinned for the download and recorded in the fingerprint.
3. Otherwise one `DatasetUnavailable` error names the dataset, the expected local files, the hub id and both ways
   to give a local folder.

Every loader returns a `fingerprint` dict: ``{"source": "local", "dataset": ..., "files": {relpath: sha256}}`` or
``{"source": "hub", "dataset": hub_id, "config": ..., "revision": sha}``, plus loader-specific keys.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

from study.tasks.data.errors import DataError, DatasetUnavailable, MalformedDataError

log = logging.getLogger(__name__)

T = TypeVar("T")

DATA_DIR_ENV = "STUDY_DATA_DIR"
HUB_TIMEOUT_ENV = "STUDY_HUB_TIMEOUT"
DEFAULT_HUB_TIMEOUT_S = 5.0
_OFFLINE_ENVS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = {"1", "true", "yes", "on"}


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The local data folder: `data_dir` if given, else `$STUDY_DATA_DIR`, else None (use the hub)."""
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser()
    env = os.environ.get(DATA_DIR_ENV, "")
    return Path(env).expanduser() if env else None


def hub_offline_reason() -> str | None:
    """Why the hub must not be contacted (offline mode), or None. Read at call time, not import time."""
    for name in _OFFLINE_ENVS:
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return f"offline mode ({name}={os.environ[name]}), so the hub was not contacted"
    return None


def hub_timeout() -> float:
    try:
        return float(os.environ.get(HUB_TIMEOUT_ENV, DEFAULT_HUB_TIMEOUT_S))
    except ValueError:
        return DEFAULT_HUB_TIMEOUT_S


# --------------------------------------------------------------------------------------------------------------------
# Reading files


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bytes(path: Path) -> tuple[bytes, str]:
    """Raw file bytes (gunzipped for `.gz`) and the sha256 of the file *on disk*."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    digest = sha256_bytes(raw)
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise MalformedDataError(path, f"not a valid gzip file ({e})") from None
    return raw, digest


def decode_utf8(path: Path, data: bytes, *, bom: bool = False) -> str:
    """Decode UTF-8 strictly; on failure name the file and the line of the first bad byte."""
    try:
        return data.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise MalformedDataError(path, f"invalid UTF-8 at byte {e.start} ({e.reason})", line=line) from None


def read_text(path: Path, *, bom: bool = False) -> tuple[str, str]:
    """Text of a (possibly gzipped) UTF-8 file and the sha256 of the file on disk."""
    data, digest = read_bytes(path)
    return decode_utf8(path, data, bom=bom), digest


def split_lines(text: str) -> list[str]:
    """Lines split on '\\n' only (a trailing '\\r' is dropped), without the empty string after a final newline.

    Unlike `str.splitlines`, this does not split on form feeds, U+2028 and friends, so line numbers agree with
    `wc -l` and with aligned parallel files."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


def lines_with_ends(text: str) -> list[str]:
    """The text's lines, each with its '\n' (the last without one when the text does not end in '\n'): split on
    '\n' only, as `split_lines`, so a form feed or U+2028 inside a line stays inside its token."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


# --------------------------------------------------------------------------------------------------------------------
# Locating a dataset's local files


@dataclass(frozen=True)
class LocalFile:
    """One logical file of a dataset: the name to show in messages and the accepted relative names (first wins)."""

    display: str
    candidates: tuple[str, ...]
    required: bool = True


@dataclass(frozen=True)
class DatasetSource:
    """How to find one dataset locally and on the hub."""

    name: str  # display name, e.g. "WikiText-2"
    subdirs: tuple[str, ...]  # sub-folders of the data dir to look in, first is canonical ("" = the data dir itself)
    hub_id: str | None
    hub_config: str | None = None
    hub_note: str | None = None  # e.g. which splits the hub copy lacks

    @property
    def hub_label(self) -> str | None:
        if self.hub_id is None:
            return None
        return f"{self.hub_id} (config {self.hub_config!r})" if self.hub_config else self.hub_id

    def expected(self, files: Mapping[str, LocalFile]) -> list[str]:
        sub = self.subdirs[0]
        out = []
        for f in files.values():
            alts = [c for c in f.candidates if c != f.display]
            extra = f"  (or {', '.join(alts)})" if alts else ""
            opt = "  [optional]" if not f.required else ""
            out.append(f"{sub}/{f.display}{extra}{opt}" if sub else f"{f.display}{extra}{opt}")
        return out


@dataclass
class LocalFiles:
    root: Path  # the dataset folder actually used
    found: dict[str, Path] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # display paths of required files not found


def _probe(base: Path, files: Mapping[str, LocalFile]) -> LocalFiles:
    res = LocalFiles(root=base)
    for key, f in files.items():
        for cand in f.candidates:
            p = base / cand
            if p.is_file():
                res.found[key] = p
                break
        else:
            if f.required:
                res.missing.append(str(base / f.display))
    return res


def locate_local(data_dir: Path, source: DatasetSource, files: Mapping[str, LocalFile]) -> LocalFiles:
    """Find `files` under `data_dir/<subdir>` (or `data_dir` itself). Returns the best match; `missing` lists the
    required files that were not found there (absolute paths)."""
    bases = [data_dir / s if s else data_dir for s in source.subdirs]
    if "" not in source.subdirs:
        bases.append(data_dir)
    best: LocalFiles | None = None
    for base in bases:
        if not base.is_dir():
            continue
        res = _probe(base, files)
        if not res.missing:
            return res
        if res.found and (best is None or len(res.found) > len(best.found)):
            best = res
    if best is not None:
        return best
    # Nothing anywhere: report against the canonical folder.
    return _probe(bases[0], files)


def local_fingerprint(source_key: str, local: LocalFiles, digests: Mapping[Path, str], **extra: Any) -> dict:
    files = {p.relative_to(local.root).as_posix(): d for p, d in sorted(digests.items(), key=lambda kv: str(kv[0]))}
    return {"source": "local", "dataset": source_key, "files": files, **extra}


# --------------------------------------------------------------------------------------------------------------------
# The hub


class HubUnavailable(Exception):
    """Internal: the hub could not be used; the message says why."""


def hub_revision(hub_id: str) -> str:
    """Resolve the dataset's current commit on the hub with a short timeout, or raise HubUnavailable."""
    reason = hub_offline_reason()
    if reason:
        raise HubUnavailable(reason)
    try:
        from huggingface_hub import HfApi
    except ImportError as e:  # pragma: no cover - huggingface_hub ships with datasets
        raise HubUnavailable(f"huggingface_hub is not installed ({e})") from None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    timeout = hub_timeout()
    try:
        info = HfApi(endpoint=endpoint).dataset_info(hub_id, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - any failure means "not reachable / not usable"
        msg = str(e).splitlines()[0] if str(e) else ""
        raise HubUnavailable(
            f"could not reach the hub for {hub_id} within {timeout:g} s ({type(e).__name__}: {msg[:200]})"
        ) from None
    return str(info.sha)


def hub_load_dataset(hub_id: str, config: str | None, revision: str, **kwargs: Any) -> Any:
    """`datasets.load_dataset` pinned to `revision`; any failure becomes HubUnavailable."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover
        raise HubUnavailable(f"the `datasets` package is not installed ({e})") from None
    try:
        return datasets.load_dataset(hub_id, config, revision=revision, **kwargs)
    except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0] if str(e) else ""
        raise HubUnavailable(f"loading {hub_id} from the hub failed ({type(e).__name__}: {msg[:300]})") from None


def hub_fingerprint(source: DatasetSource, revision: str, **extra: Any) -> dict:
    return {"source": "hub", "dataset": source.hub_id, "config": source.hub_config, "revision": revision, **extra}


def load_from_sources(
    source: DatasetSource,
    files: Mapping[str, LocalFile],
    data_dir: str | os.PathLike[str] | None,
    load_local: Callable[[LocalFiles], T],
    load_hub: Callable[[str], T] | None,
    *,
    unavailable_hint: str | None = None,
) -> T:
    """Try the local folder (if given), then the hub; raise one DatasetUnavailable if neither works.

    `load_hub` receives the pinned revision; it should raise HubUnavailable on failure."""
    root = resolve_data_dir(data_dir)
    reasons: list[str] = []
    missing: list[str] = []
    if root is None:
        reasons.append(f"local: no data folder given (neither --data-dir / data_dir nor ${DATA_DIR_ENV} is set)")
    elif not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        reasons.append(f"local: the data folder {root} {what}")
        missing.append(str(root))
    else:
        local = locate_local(root, source, files)
        if not local.missing:
            return load_local(local)
        missing = list(local.missing)
        reasons.append("local: missing file(s) " + ", ".join(missing))

    if source.hub_id is None or load_hub is None:
        reasons.append("hub: this dataset has no Hugging Face hub copy")
    else:
        try:
            revision = hub_revision(source.hub_id)
            if root is not None:
                log.warning("%s: local files missing under %s (%s); using the hub copy %s", source.name, root,
                            ", ".join(missing), source.hub_id)
            return load_hub(revision)
        except HubUnavailable as e:
            reasons.append(f"hub: {e}")
    hint = unavailable_hint
    if source.hub_note:
        hint = f"{hint}\n{source.hub_note}" if hint else source.hub_note
    raise DatasetUnavailable(
        source.name,
        hub_id=source.hub_label,
        expected_files=source.expected(files),
        missing_files=missing,
        reasons=reasons,
        hint=hint,
    )


def require_keys(row_keys: Sequence[str], needed: Sequence[str], what: str) -> None:
    missing = [k for k in needed if k not in row_keys]
    if missing:
        raise HubUnavailable(f"{what}: hub data lacks column(s) {missing}; has {list(row_keys)}")
