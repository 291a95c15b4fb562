"""Configuration: frozen, validated dataclasses and presets. Everything else reads these."""

from study.config.base import Config, ConfigError, parse_overrides
from study.config.model import ModelConfig, axis_choices
from study.config.presets import PRESETS, preset

__all__ = ["Config", "ConfigError", "ModelConfig", "PRESETS", "axis_choices", "parse_overrides", "preset"]
