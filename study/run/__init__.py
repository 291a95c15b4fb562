"""The run layer: every way an experiment becomes run directories (`study.record` describes what they hold).

    run_experiment(cfg, run_dir)    one experiment: a single run (`single`), a suite of runs its task family
                                    declares (`suite`: GLUE's tasks x seeds), or a pipeline of stages (`pipeline`:
                                    pretrain -> fine-tune)
    load_model(run_dir)             a finished run's trained model

Task families declare hooks (`study.tasks.contract`) and never import this package.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from study.config import ConfigError, ExperimentConfig, PipelineConfig
from study.model.precision import emulated_bf16, resolve_precision
from study.run.conflict import RunDirConflict

__all__ = ["RunDirConflict", "load_model", "refuse_unreadable_config", "run_experiment"]


def run_experiment(
    cfg: ExperimentConfig | PipelineConfig,
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
    stage_root: str | Path | None = None,
) -> dict[str, Any]:
    """Train and evaluate `cfg`, writing `run_dir`; returns its metrics.json record.

    `train.precision: auto` is resolved here, once, for this machine, and the task family resolves what the config
    leaves to it (GLUE: the model of the pretrained run task.init_from names): the run directory's config.yaml
    records what ran. `stage_root`: where a pipeline's shared stages live (see `study.run.pipeline`)."""
    from study.tasks import family

    refuse_unreadable_config(run_dir, type(cfg), force)
    if isinstance(cfg, PipelineConfig):
        from study.run.pipeline import run_pipeline

        return run_pipeline(cfg, run_dir, data_dir=data_dir, cache_dir=cache_dir, force=force, stage_root=stage_root)
    cfg = cfg.replace(train=cfg.train.replace(precision=resolve_precision(cfg.train.precision, cfg.train.accelerator)))
    if why := emulated_bf16(cfg.train.precision, cfg.train.accelerator):
        warnings.warn(f"study: {why}; train.precision 32-true (or auto) trains at the float32 rate", stacklevel=2)
    task = family(cfg.task.name)
    if problems := task.unread_settings(cfg):
        raise ConfigError("ExperimentConfig", problems)
    cfg = task.resolve(cfg)  # init_from problems surface here, before any data or training
    if task.suite:
        from study.run.suite import run_suite

        return run_suite(cfg, run_dir, data_dir=data_dir, cache_dir=cache_dir, force=force)
    from study.run.single import run_single

    return run_single(cfg, run_dir, data_dir=data_dir, cache_dir=cache_dir, force=force)


def refuse_unreadable_config(run_dir: str | Path, kind: type, force: bool) -> None:
    """Raise RunDirConflict, naming the file, when `run_dir` holds a config.yaml that is not a config of `kind`
    (damaged, or written by a version of study whose fields differ): the run there cannot be compared with this one,
    so it is neither resumed nor replaced without --force, and the problem is the directory's, not the user's config."""
    import yaml

    from study.config import ConfigError
    from study.record import RunDir

    path = RunDir(run_dir).config
    if force or not path.is_file():
        return
    try:
        kind.from_yaml(path.read_text())
    except (ConfigError, yaml.YAMLError, ValueError, TypeError) as err:
        why = " ".join(str(err).split())
        raise RunDirConflict(f"{path} cannot be read as the config of a run ({why[:300]}); choose another "
                             "directory, or --force to replace the run there") from None


def load_model(run_dir: str | Path):
    """The trained model of a run directory, loaded without executing pickled code."""
    from study.model import build_model
    from study.record import RunDir

    run = RunDir(run_dir)
    cfg = ExperimentConfig.from_yaml(run.config.read_text())
    model = build_model(cfg.model)
    model.load_state_dict(torch.load(run.weights, map_location="cpu", weights_only=True))
    return model.eval(), cfg
