"""Test-set predictions in the GLUE server's format: `index<TAB>prediction` per line, one file per task.

File names as the server expects them (MNLI-m.tsv / MNLI-mm.tsv; AX.tsv: the MNLI model's predictions on the
diagnostic set); label names for MNLI, QNLI and RTE, 0/1 otherwise; STS-B a score clipped to [0, 5].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from study.io import atomic_write_text
from study.tasks.data import GlueTaskInfo

# test split -> file name the GLUE server expects; the diagnostic set (AX) is predicted by the MNLI model
SUBMISSION_FILES = {
    ("MNLI", "test_matched"): "MNLI-m",
    ("MNLI", "test_mismatched"): "MNLI-mm",
    ("MNLI", "diagnostic"): "AX",
}


def submission_name(task: str, split: str) -> str:
    return SUBMISSION_FILES.get((task, split), task)


def format_prediction(info: GlueTaskInfo, pred) -> str:
    if info.is_regression:
        return f"{min(5.0, max(0.0, float(pred))):.3f}"
    if info.label_map is not None and info.label_names is not None:  # MNLI, QNLI, RTE: label names
        return info.label_names[int(pred)]
    return str(int(pred))


def write_submission(path: Path, info: GlueTaskInfo, rows: Sequence[tuple[int, Any]]) -> None:
    lines = ["index\tprediction"] + [f"{idx}\t{format_prediction(info, p)}" for idx, p in rows]
    atomic_write_text(path, "\n".join(lines) + "\n")
