"""GLUE metrics against values computed by hand, and the GLUE score against the published leaderboard."""

from __future__ import annotations

import math

import pytest

from study.tasks.glue.metrics import accuracy, compute_metrics, f1, glue_score, mcc, pearson, spearman, task_score


def test_matthews_correlation_by_hand():
    labels = [1, 1, 1, 0, 0, 0, 1, 0]
    preds = [1, 1, 0, 0, 0, 1, 1, 0]
    # TP=3 TN=3 FP=1 FN=1: (3*3 - 1*1) / sqrt(4*4*4*4) = 8/16
    assert mcc(labels, preds) == pytest.approx(0.5)
    assert mcc(labels, [1 - p for p in labels]) == pytest.approx(-1.0)
    assert mcc(labels, [1] * 8) == 0.0  # constant predictions: undefined, scored 0 (as scikit-learn)


def test_accuracy_and_f1_by_hand():
    labels = [1, 1, 1, 1, 0, 0]
    preds = [1, 1, 0, 0, 1, 0]
    assert accuracy(labels, preds) == pytest.approx(3 / 6)
    # TP=2 FP=1 FN=2: precision 2/3, recall 1/2, F1 = 2PR/(P+R) = 4/7 (positive class 1)
    assert f1(labels, preds) == pytest.approx(4 / 7)
    assert f1([0, 0, 1], [0, 0, 0]) == 0.0


def test_pearson_and_spearman_by_hand():
    x, y = [1, 2, 3, 4], [2, 4, 5, 9]
    # deviations (-1.5, -.5, .5, 1.5) and (-3, -1, 0, 4): 11 / sqrt(5 * 26)
    assert pearson(x, y) == pytest.approx(11 / math.sqrt(130))
    # ranks (1, 2, 3, 4) vs (1, 3, 2, 4): 1 - 6 * 2 / (4 * (16 - 1))
    assert spearman(x, [1, 5, 3, 9]) == pytest.approx(0.8)
    assert pearson(x, [3.0] * 4) == 0.0 and spearman(x, [3.0] * 4) == 0.0


def test_compute_metrics_and_task_scores():
    m = compute_metrics(("f1", "accuracy"), [1, 0, 1, 1], [1, 0, 0, 1])
    assert m == pytest.approx({"f1": 80.0, "accuracy": 75.0})  # the 0-100 scale
    with pytest.raises(ValueError, match="predictions"):
        compute_metrics(("accuracy",), [1, 0], [1])
    assert task_score({"dev": m}) == pytest.approx(77.5)  # MRPC: mean of F1 and accuracy, 0-100
    assert task_score({"dev_matched": {"accuracy": 80.0}, "dev_mismatched": {"accuracy": 70.0}}) == pytest.approx(75.0)


def test_glue_score_matches_the_leaderboard_definition():
    # BERT-large on the GLUE leaderboard (Devlin et al. 2018): score 80.5 with WNLI, each task's metrics averaged
    tasks = {"CoLA": 60.5, "SST-2": 94.9, "MRPC": (89.3 + 85.4) / 2, "STS-B": (87.6 + 86.5) / 2,
             "QQP": (72.1 + 89.3) / 2, "MNLI": (86.7 + 85.9) / 2, "QNLI": 92.7, "RTE": 70.1, "WNLI": 65.1}
    assert round(glue_score(tasks), 1) == 80.5
    assert glue_score({"SST-2": 80.0, "CoLA": 20.0}) == 50.0
    with pytest.raises(ValueError):
        glue_score({})
