"""Task family name -> (DataModule, LightningModule). The one place tasks are chosen."""

from __future__ import annotations

from study.tasks.glue import GlueDataModule, GlueModule, run_glue
from study.tasks.lm import LMDataModule, LMModule
from study.tasks.pretrain import PretrainDataModule, PretrainModule
from study.tasks.translation import TranslationDataModule, TranslationModule

TASK_FAMILIES = {
    "lm": (LMDataModule, LMModule),
    "translation": (TranslationDataModule, TranslationModule),
    "pretrain": (PretrainDataModule, PretrainModule),
    "glue": (GlueDataModule, GlueModule),
}
# families whose experiment is several runs (GLUE: tasks x seeds); run_experiment hands them the whole experiment
SUITES = {"glue": run_glue}


def suite_runner(name: str):
    return SUITES.get(name)


def task_family(name: str):
    try:
        return TASK_FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"task.name: {name!r} has no implementation yet; implemented: {sorted(TASK_FAMILIES)}"
        ) from None
