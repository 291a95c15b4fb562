"""Task families: what is trained on which data, and measured how.

Each family is one `TaskFamily` (`study.tasks.contract`) declaring its metrics, the fields it reads and its hooks;
`family(name)` imports it on first use, and a declaration imports no Lightning and no data code (`implementation()`
does), so planning a sweep reads declarations cheaply and a run pays only for its own family's imports (GLUE's
metrics pull in scikit-learn and scipy, translation's sacreBLEU: seconds of start-up for an experiment that never
uses them).
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from study.config import ExperimentConfig, PipelineConfig
    from study.tasks.contract import TaskFamily

# task.name -> "module:TaskFamily subclass"
FAMILIES = {
    "lm": "study.tasks.families:LanguageModelling",
    "translation": "study.tasks.families:Translation",
    "pretrain": "study.tasks.families:Pretraining",
    "glue": "study.tasks.glue:Glue",
}


@functools.cache
def family(name: str) -> "TaskFamily":
    """The task family `task.name` names (a ValueError listing the families for an unknown name)."""
    from study.tasks.contract import TaskFamily

    if name not in FAMILIES:
        raise ValueError(f"task.name: {name!r} has no implementation; implemented: {sorted(FAMILIES)}")
    module, _, cls_name = FAMILIES[name].partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, TaskFamily)) or cls.name != name:
        raise TypeError(f"{FAMILIES[name]} is not the TaskFamily of task {name!r}")
    return cls()


def resolved_stage(cfg: "PipelineConfig", name: str) -> "ExperimentConfig":
    """The config stage `name` of a pipeline will run, resolved by its task family before any data is read: a later
    stage against the resolved config of the stage it starts from (its task.init_from), as the pipeline will resolve
    it against that stage's trained config. Both the checks before a pipeline trains (study.run.pipeline) and the
    check that a swept value reaches the model (study.sweep.reach) resolve stages here."""
    from study.config.pipeline import stage_ref

    stage = cfg.stages[name]
    ref = stage_ref(stage.task.init_from)
    return family(stage.task.name).resolve(stage, pretrained=resolved_stage(cfg, ref) if ref is not None else None)
