"""The configurable transformer: one file per design axis, then blocks and models."""

from study.axes import ACTIVATIONS, NORM_POSITIONS, NORMS, POSITIONS
from study.model.attention import KVCache
from study.model.transformer import (
    DecoderLM,
    EncoderDecoderLM,
    EncoderModel,
    SequenceClassificationHead,
    build_model,
)

__all__ = [
    "ACTIVATIONS",
    "NORMS",
    "POSITIONS",
    "NORM_POSITIONS",
    "KVCache",
    "DecoderLM",
    "EncoderDecoderLM",
    "EncoderModel",
    "SequenceClassificationHead",
    "build_model",
]
