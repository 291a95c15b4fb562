"""The configurable transformer: one file per design axis, then blocks and models."""

from study.model.attention import KVCache
from study.model.ffn import ACTIVATIONS
from study.model.norms import NORMS
from study.model.positions import POSITIONS
from study.model.residual import RESIDUALS
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
    "RESIDUALS",
    "KVCache",
    "DecoderLM",
    "EncoderDecoderLM",
    "EncoderModel",
    "SequenceClassificationHead",
    "build_model",
]
