"""Task family name -> (DataModule, LightningModule). The one place tasks are chosen.

Families are named by module path and imported on first use, so a run pays only for its own family's imports
(GLUE's metrics pull in scikit-learn and scipy, translation's pull in sacreBLEU: seconds of start-up for an
experiment that never uses them).
"""

from __future__ import annotations

import importlib

TASK_FAMILIES = {
    "lm": ("study.tasks.lm", "LMDataModule", "LMModule"),
    "translation": ("study.tasks.translation", "TranslationDataModule", "TranslationModule"),
    "pretrain": ("study.tasks.pretrain", "PretrainDataModule", "PretrainModule"),
    "glue": ("study.tasks.glue", "GlueDataModule", "GlueModule"),
}
# families whose experiment is several runs (GLUE: tasks x seeds); run_experiment hands them the whole experiment
SUITES = {"glue": ("study.tasks.glue", "run_glue")}


def suite_runner(name: str):
    if name not in SUITES:
        return None
    module, runner = SUITES[name]
    return getattr(importlib.import_module(module), runner)


def task_family(name: str):
    try:
        module, datamodule, lightning_module = TASK_FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"task.name: {name!r} has no implementation yet; implemented: {sorted(TASK_FAMILIES)}"
        ) from None
    loaded = importlib.import_module(module)
    return getattr(loaded, datamodule), getattr(loaded, lightning_module)


def predicted_fraction(cfg) -> float:
    """Share of token positions whose output head (vocabulary projection) a task family computes, for the FLOPs
    accounting: MLM pretraining runs it on the masked positions only, GLUE fine-tuning not at all (a pooled
    classifier replaces it), language modelling and translation on every position."""
    return {"pretrain": cfg.task.mlm_probability, "glue": 0.0}.get(cfg.task.name, 1.0)
