"""GLUE's official metrics (Wang et al. 2018), from scikit-learn and scipy, and the GLUE score.

Per task (`GlueTaskInfo.metrics`): CoLA Matthews correlation; SST-2, QNLI, RTE, WNLI accuracy; MRPC and QQP F1 (of
the positive class: equivalent / duplicate) and accuracy; STS-B Pearson and Spearman correlation; MNLI accuracy on
the matched and the mismatched dev sets. The metric functions return what scikit-learn and scipy return (fractions:
accuracy 0.87, MCC 0.52); `compute_metrics` puts them on the leaderboard's 0-100 scale, the one scale every GLUE
number is recorded and reported in.

The GLUE score, as the benchmark defines it (and the leaderboard computes it): a task's score is the mean of its
metrics (MRPC: F1 and accuracy; STS-B: Pearson and Spearman; QQP: F1 and accuracy; MNLI: matched and mismatched
accuracy), and the GLUE score is the unweighted mean of the nine task scores. (BERT's Table 1 "Average" differs: it
drops WNLI, counts MNLI-m and MNLI-mm as two entries, and takes only F1 / Spearman for the two-metric tasks.)
A correlation of constant predictions is undefined; it is scored 0, as scikit-learn scores the MCC of constant
predictions.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

GLUE_TASK_COUNT = 9


def _constant(x: np.ndarray) -> bool:
    return bool(x.size == 0 or np.all(x == x.flat[0]))


def mcc(labels: Sequence[int], preds: Sequence[int]) -> float:
    return float(matthews_corrcoef(labels, preds))


def accuracy(labels: Sequence[int], preds: Sequence[int]) -> float:
    return float(accuracy_score(labels, preds))


def f1(labels: Sequence[int], preds: Sequence[int]) -> float:
    return float(f1_score(labels, preds, pos_label=1, average="binary", zero_division=0.0))


def pearson(labels: Sequence[float], preds: Sequence[float]) -> float:
    x, y = np.asarray(labels, dtype=np.float64), np.asarray(preds, dtype=np.float64)
    if _constant(x) or _constant(y):
        return 0.0
    return float(pearsonr(x, y)[0])


def spearman(labels: Sequence[float], preds: Sequence[float]) -> float:
    x, y = np.asarray(labels, dtype=np.float64), np.asarray(preds, dtype=np.float64)
    if _constant(x) or _constant(y):
        return 0.0
    return float(spearmanr(x, y)[0])


METRICS = {"mcc": mcc, "accuracy": accuracy, "f1": f1, "pearson": pearson, "spearman": spearman}


def compute_metrics(names: Sequence[str], labels: Sequence, preds: Sequence) -> dict[str, float]:
    """{metric: value on the 0-100 scale} for each of `names` (keys of METRICS)."""
    if len(labels) != len(preds):
        raise ValueError(f"{len(labels)} labels but {len(preds)} predictions")
    return {name: 100.0 * METRICS[name](labels, preds) for name in names}


def task_score(per_split: Mapping[str, Mapping[str, float]]) -> float:
    """A task's GLUE score (0-100): the mean of all its metrics (0-100) over its dev splits (MNLI: m and mm)."""
    values = [v for split in per_split.values() for v in split.values()]
    if not values:
        raise ValueError("no metrics to score")
    return sum(values) / len(values)


def glue_score(task_scores: Mapping[str, float]) -> float:
    """Unweighted mean of the task scores (complete only when all nine tasks are present). A task without a number
    (None, NaN: e.g. non-finite STS-B predictions) makes the mean NaN, read downstream as no result: left out, the
    mean would score the other tasks only, an easier benchmark than the one asked for."""
    if not task_scores:
        raise ValueError("no task scores to average")
    values = [math.nan if v is None else float(v) for v in task_scores.values()]
    return sum(values) / len(values)
