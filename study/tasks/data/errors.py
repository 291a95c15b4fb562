"""Errors raised by the data layer.

Every error is a `DataError` (a `ValueError`), so callers can catch one type:

- `DatasetUnavailable`: the data could not be found, neither in a local folder nor on the Hugging Face hub. The
  message names the dataset, the files expected under the data folder, the hub id, and both ways to give a local
  folder (`--data-dir` / `STUDY_DATA_DIR`). A multi-task run catches it to skip and report the task.
- `MalformedDataError`: a file was found but could not be parsed; the message names the file and, where it applies,
  the 1-based line number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


class DataError(ValueError):
    """Base class of every error raised by `study.tasks.data`."""


class DatasetUnavailable(DataError):
    """A dataset (or a GLUE task) could not be loaded from any source.

    Attributes: `dataset` (display name), `hub_id`, `expected_files` (paths relative to the data folder),
    `missing_files` (absolute paths that were looked for and not found, if a local folder was given) and
    `reasons` (one line per source that was tried).
    """

    def __init__(
        self,
        dataset: str,
        *,
        hub_id: str | None,
        expected_files: Sequence[str],
        missing_files: Sequence[str] = (),
        reasons: Sequence[str] = (),
        hint: str | None = None,
    ):
        self.dataset = dataset
        self.hub_id = hub_id
        self.expected_files = tuple(expected_files)
        self.missing_files = tuple(missing_files)
        self.reasons = tuple(reasons)
        lines = [f"dataset {dataset!r} is not available."]
        for r in self.reasons:
            lines.append(f"  - {r}")
        if hub_id:
            lines.append(f"Hugging Face hub id: {hub_id}")
        lines.append(
            "To use a local copy, pass --data-dir DIR on the command line (data_dir=DIR in Python) "
            "or set the environment variable STUDY_DATA_DIR=DIR, where DIR contains:"
        )
        for f in self.expected_files:
            lines.append(f"    {f}")
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


class MalformedDataError(DataError):
    """A data file exists but its content is not in the expected format."""

    def __init__(self, path: str | Path, message: str, line: int | None = None):
        self.path = Path(path)
        self.line = line
        where = f"{self.path}, line {line}" if line is not None else f"{self.path}"
        super().__init__(f"malformed data file {where}: {message}")
