"""The axis contract: every value of a registry-backed axis is a class that declares its parameter count, its rules
for the rest of the config and its description, and a class that leaves part of it out is refused when it is
registered (not after a trial has trained)."""

from __future__ import annotations

import pytest
import torch

from study.axes import AXES, NORMS, POSITIONS, AxisRegistry, NormType, PositionScheme
from study.config import ConfigError, ModelConfig
from study.config.base import Problems
from study.model import build_model
from study.model.accounting import parameter_count


def test_a_norm_without_its_parameter_count_is_refused_when_registered():
    registry = AxisRegistry("norm", NormType)  # a throwaway registry: the real one stays as it is

    class Forgetful(NormType):
        """Forgets to state its parameter count."""

        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="num_parameters"):
        registry.register("forgetful")(Forgetful)
    assert "forgetful" not in registry


@pytest.mark.parametrize("axis", list(AXES))
def test_every_axis_refuses_a_value_that_leaves_its_abstract_methods_out(axis):
    contract = AXES[axis].contract
    registry = AxisRegistry(axis, contract)
    empty = type("Empty", (contract,), {"__doc__": "Implements nothing of its contract."})
    with pytest.raises(TypeError) as err:
        registry.register("empty")(empty)
    message = str(err.value)
    assert "Empty" in message and contract.__abstractmethods__  # the class, and every method it left out
    assert all(method in message for method in contract.__abstractmethods__), message
    assert "empty" not in registry


def test_a_value_needs_a_description_a_unique_name_and_the_axis_contract():
    registry = AxisRegistry("norm", NormType)

    class Bare(NormType):
        num_parameters = staticmethod(lambda dim, bias: 0)

        def forward(self, x):
            return x

    Bare.__doc__ = None
    with pytest.raises(TypeError, match="no description"):
        registry.register("bare")(Bare)
    registry.register("bare", "an identity, for this test")(Bare)
    with pytest.raises(KeyError, match="registered twice"):
        registry.register("bare", "again")(Bare)

    class NotANorm(torch.nn.Module):
        """Not a NormType."""

    with pytest.raises(TypeError, match="is not a NormType"):
        registry.register("plain", "a module")(NotANorm)


def test_an_activation_must_say_whether_it_gates():
    from study.axes.activation import Activation

    registry = AxisRegistry("activation", Activation)

    class Ungated(Activation):
        """Says nothing about gating."""

        fn = staticmethod(torch.relu)

    with pytest.raises(TypeError, match="gated"):
        registry.register("ungated")(Ungated)


def test_ropes_even_head_dimension_rule_lives_on_rope():
    from types import SimpleNamespace

    odd = SimpleNamespace(n_heads=2, head_dim=15, d_model=30, resolved_head_dim=15)
    p = Problems()
    POSITIONS["rope"].validate(odd, p)  # the rule is RoPE's own
    assert len(p.items) == 1 and p.items[0].startswith("position: rope rotates pairs")
    p = Problems()
    POSITIONS["alibi"].validate(odd, p)
    assert not p.items  # no other scheme has it
    cfg = dict(arch="decoder", d_model=30, n_heads=2, n_layers=1, vocab_size=10, max_seq_len=8)  # head_dim 15
    with pytest.raises(ConfigError, match="position: rope rotates pairs"):  # ModelConfig asks the class
        ModelConfig(**cfg, position="rope")
    ModelConfig(**cfg, position="alibi")


def test_sinusoidal_and_t5_bias_rules_live_on_their_classes():
    base = dict(arch="decoder", n_heads=1, n_layers=1, vocab_size=10, max_seq_len=8)
    with pytest.raises(ConfigError, match="position: sinusoidal needs an even d_model"):
        ModelConfig(**base, d_model=15, position="sinusoidal")
    ModelConfig(**base, d_model=15, position="learned")
    with pytest.raises(ConfigError) as err:
        ModelConfig(**base, d_model=16, position="t5_bias", rel_buckets=2, rel_max_distance=1)
    assert {p.split(":")[0] for p in err.value.problems} == {"rel_buckets", "rel_max_distance"}
    # only t5_bias reads them: under another scheme they are refused as unread, not by t5_bias's bounds
    with pytest.raises(ConfigError) as err:
        ModelConfig(**base, d_model=16, position="rope", rel_buckets=2, rel_max_distance=1)
    assert all("only position 't5_bias' reads it, not 'rope'" in p for p in err.value.problems)


def test_t5_bias_distance_bound_follows_the_stacks_direction():
    """T5's log-spaced buckets start past the exact offsets: rel_buckets // 2 of them in a causal stack, // 4 per
    direction in a bidirectional one, so an encoder-only model may use a shorter max distance than a decoder."""
    from study.axes.position import t5_relative_bucket

    small = dict(d_model=16, n_heads=2, n_layers=1, vocab_size=10, max_seq_len=64, position="t5_bias", rel_buckets=32)
    ModelConfig(**small, arch="encoder", objective="mlm", rel_max_distance=16)  # > 32 // 4
    buckets = t5_relative_bucket(torch.arange(-100, 101), True, 32, 16)
    assert buckets.min() >= 0 and buckets.max() <= 31  # every offset lands in the table
    for arch in ("decoder", "encoder-decoder"):  # a causal stack needs > 32 // 2
        with pytest.raises(ConfigError, match="rel_max_distance"):
            ModelConfig(**small, arch=arch, rel_max_distance=16)


def test_learned_positions_declare_how_far_they_reach():
    from study.config import ExperimentConfig

    cfg = ModelConfig(arch="decoder", d_model=32, n_heads=2, n_layers=1, vocab_size=10, max_seq_len=8)
    assert POSITIONS["learned"].max_positions(cfg) == 8
    assert all(POSITIONS[p].max_positions(cfg) is None for p in POSITIONS if POSITIONS[p].extrapolates)
    # the experiment asks the scheme how far it reaches: a learned table stops at model.max_seq_len
    model = {"arch": "decoder", "d_model": 32, "n_heads": 2, "n_layers": 1, "max_seq_len": 16}
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({"model": {**model, "position": "learned"}, "task": {"seq_len": 32}})
    [problem] = [p for p in err.value.problems if p.startswith("task.seq_len:")]
    assert "model.max_seq_len=16" in problem
    ExperimentConfig.from_dict({"model": {**model, "position": "rope"}, "task": {"seq_len": 32}})


@pytest.mark.parametrize("axis, value", [(a, v) for a, r in AXES.items() for v in r.names()])
@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
def test_every_registered_value_builds_and_its_declared_parameters_are_the_real_ones(axis, value, arch):
    assert issubclass(AXES[axis][value], AXES[axis].contract) and AXES[axis].describe(value)
    cfg = ModelConfig(**{"arch": arch, "d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 40,
                         "max_seq_len": 16, axis: value})
    model = build_model(cfg)
    real = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert parameter_count(cfg) == real, (axis, value, arch)


def test_every_norm_and_position_is_a_subclass_of_its_contract():
    assert all(issubclass(cls, NormType) for _, cls in NORMS.items())
    assert all(issubclass(cls, PositionScheme) for _, cls in POSITIONS.items())


def test_t5_bias_refuses_an_odd_bucket_count_where_a_bidirectional_stack_would_never_reach_a_bucket():
    """A bidirectional stack gives each direction rel_buckets // 2 buckets: with 33, bucket 32 is never looked up. A
    causal stack looks every bucket up, so a decoder may have 33."""
    from study.axes.position import t5_relative_bucket

    assert t5_relative_bucket(torch.arange(-500, 501), True, 33, 128).max() == 31
    assert t5_relative_bucket(torch.arange(-500, 1), False, 33, 128).unique().numel() == 33
    small = dict(d_model=16, n_heads=2, n_layers=1, vocab_size=10, max_seq_len=64, position="t5_bias", rel_buckets=33)
    for arch in ("encoder", "encoder-decoder"):
        with pytest.raises(ConfigError, match="rel_buckets: t5_bias in arch=.* needs an even rel_buckets, got 33"):
            ModelConfig(**small, arch=arch)
    ModelConfig(**small, arch="decoder")


def test_a_position_scheme_reading_a_field_modelconfig_lacks_is_named_not_an_attribute_error(monkeypatch):
    """A typo in `reads` broke every ModelConfig with "'ModelConfig' object has no attribute", naming neither the
    scheme nor the field."""
    class Typo(PositionScheme):
        reads = ("rope_thetaa",)

        @staticmethod
        def num_parameters(cfg) -> int:
            return 0

    monkeypatch.setitem(POSITIONS._items, "typo", Typo)
    with pytest.raises(TypeError, match=r"position 'typo' \(Typo\) reads \['rope_thetaa'\]: not ModelConfig fields"):
        ModelConfig()
