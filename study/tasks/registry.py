"""Task family name -> (DataModule, LightningModule). The one place tasks are chosen."""

from __future__ import annotations

from study.tasks.lm import LMDataModule, LMModule
from study.tasks.translation import TranslationDataModule, TranslationModule

TASK_FAMILIES = {
    "lm": (LMDataModule, LMModule),
    "translation": (TranslationDataModule, TranslationModule),
}


def task_family(name: str):
    try:
        return TASK_FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"task.name: {name!r} has no implementation yet; implemented: {sorted(TASK_FAMILIES)}"
        ) from None
