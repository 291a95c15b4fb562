"""Configuration: frozen, validated dataclasses and presets. Everything else reads these."""

from study.config.base import Config, ConfigError, parse_overrides
from study.config.model import ModelConfig, axis_choices
from study.config.presets import PRESETS, preset

__all__ = ["Config", "ConfigError", "ModelConfig", "PRESETS", "axis_choices", "parse_overrides", "preset"]
from study.config.experiment import ExperimentConfig  # noqa: E402
from study.config.task import TaskConfig  # noqa: E402
from study.config.train import TrainConfig  # noqa: E402

__all__ += ["ExperimentConfig", "TaskConfig", "TrainConfig"]
from study.config.sweep import SweepConfig  # noqa: E402

__all__ += ["SweepConfig"]
from study.config.hashing import content_hash  # noqa: E402
from study.config.pipeline import PipelineConfig, experiment_from_dict, load_experiment  # noqa: E402

__all__ += ["PipelineConfig", "content_hash", "experiment_from_dict", "load_experiment"]
