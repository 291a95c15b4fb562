"""The registry-backed design axes: every value a class that declares its implementation, its parameter count, its
rules for the rest of the config and its description (`study.axes.registry`).

This package imports nothing from the rest of `study`: the config validates against it and the model builds from
it, so dependencies point one way (axes <- config <- model).
"""

from study.axes.activation import ACTIVATIONS, Activation, default_d_ff
from study.axes.norm import NORMS, NormType, make_norm
from study.axes.norm_position import NORM_POSITIONS, ResidualRecipe
from study.axes.position import POSITIONS, PositionScheme, make_position
from study.axes.registry import AxisRegistry

# ModelConfig field -> the registry of its values
AXES: dict[str, AxisRegistry] = {
    "norm": NORMS,
    "norm_position": NORM_POSITIONS,
    "position": POSITIONS,
    "activation": ACTIVATIONS,
}

__all__ = ["ACTIVATIONS", "AXES", "Activation", "AxisRegistry", "NORMS", "NORM_POSITIONS", "NormType", "POSITIONS",
           "PositionScheme", "ResidualRecipe", "default_d_ff", "make_norm", "make_position"]
