"""A study never lies: every model value the config states reaches the built model, or the config is refused naming
the field; and the costs it publishes (parameters, KV-cache bytes) are the built model's, over random valid configs
of every axis value combined."""

import copy
import random

import pytest
import torch

from study.axes import AXES
from study.config import ConfigError, ModelConfig, TrainConfig, content_hash, preset
from study.model import KVCache, build_model
from study.model.accounting import kv_cache_bytes, kv_cache_bytes_per_token, parameter_count
from study.tasks.base import lr_multiplier

TINY = dict(vocab_size=20, d_model=16, n_heads=2, max_seq_len=16)


def fields_refused(**fields) -> set[str]:
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**TINY, **fields})
    return {p.split(":")[0] for p in err.value.problems}


# --- window and window_pattern reach a layer ---------------------------------------------------------------------
def test_a_pattern_whose_local_layers_fall_past_the_depth_is_refused_as_an_unused_window():
    # 'GL' over one layer builds one global layer: the window would reach no layer
    assert fields_refused(n_layers=1, window=4, window_pattern="GL") == {"window_pattern"}
    assert ModelConfig(**TINY, n_layers=2, window=4, window_pattern="GL").layer_spans() == ["global", "local"]


def test_a_pattern_whose_global_layers_fall_past_the_depth_is_refused_as_all_local():
    # 'LLLG' over three layers builds three local layers: the same model as window_pattern=null, under another name
    assert fields_refused(n_layers=3, window=4, window_pattern="LLLG") == {"window_pattern"}
    assert ModelConfig(**TINY, n_layers=4, window=4, window_pattern="LLLG").layer_spans().count("global") == 1


def test_an_encoder_decoder_pattern_counts_the_layers_of_both_stacks():
    # the pattern restarts in each stack: the encoder's second layer is local, so the window is read
    cfg = ModelConfig(**TINY, arch="encoder-decoder", n_layers=1, n_encoder_layers=2, window=4, window_pattern="GL")
    model = build_model(cfg)
    assert [b.attention_span for b in model.encoder.blocks] == ["global", "local"]
    assert fields_refused(arch="encoder-decoder", n_layers=1, window=4, window_pattern="GL") == {"window_pattern"}


def test_a_window_no_shorter_than_a_learned_table_is_refused_as_masking_nothing():
    # learned positions stop at max_seq_len, so a window of max_seq_len keys hides no key from any query
    assert fields_refused(n_layers=1, position="learned", window=16) == {"window"}
    ModelConfig(**TINY, n_layers=1, position="learned", window=15)
    ModelConfig(**TINY, n_layers=1, position="rope", window=16)  # RoPE reaches past max_seq_len: the window can bite


# --- fields one position scheme reads ---------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, owner", [("rope_theta", 5e5, "rope"), ("rel_buckets", 16, "t5_bias"),
                                                 ("rel_max_distance", 64, "t5_bias")])
def test_a_position_detail_set_under_a_scheme_that_ignores_it_is_refused(field, value, owner):
    for position in AXES["position"].names():
        if position == owner:
            ModelConfig(**TINY, n_layers=1, position=position, **{field: value})
        else:
            assert fields_refused(n_layers=1, position=position, **{field: value}) == {field}


def test_every_preset_still_takes_every_position_scheme_as_an_override():
    # the presets keep the details of the schemes they do not use at their defaults, so a position sweep over a
    # preset base stays valid
    for name in ("vaswani", "bert", "gpt2", "t5", "llama2", "mistral"):
        for position in AXES["position"].names():
            preset(name, position=position, d_model=64, n_heads=4, n_kv_heads=None, max_seq_len=32768)


# --- the training schedule --------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["constant", "inverse_sqrt"])
def test_a_decay_floor_under_a_schedule_without_decay_is_refused(schedule):
    # lr_multiplier never reads min_lr_ratio for these schedules: 0.5 would be stated and not trained
    base = dict(schedule=schedule, warmup_steps=4, max_steps=50)
    cfg = TrainConfig(**base)
    unread = copy.copy(cfg)
    object.__setattr__(unread, "min_lr_ratio", 0.5)  # past validation, to show the schedule never reads it
    assert [lr_multiplier(s, cfg) for s in range(60)] == [lr_multiplier(s, unread) for s in range(60)]
    with pytest.raises(ConfigError, match="min_lr_ratio: only applies to schedule cosine or linear"):
        TrainConfig(**base, min_lr_ratio=0.5)
    TrainConfig(**{**base, "schedule": "linear"}, min_lr_ratio=0.5)


# --- declared costs against the built model, over random configs -----------------------------------------------
def random_configs(n: int, seed: int = 0) -> list[ModelConfig]:
    """`n` valid configs drawing every axis value and every shape option independently."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        arch, heads = rng.choice(["encoder", "decoder", "encoder-decoder"]), rng.choice([1, 2, 4])
        kw = dict(arch=arch, vocab_size=23, d_model=rng.choice([8, 16]), n_layers=rng.choice([1, 2, 3]),
                  n_heads=heads, n_kv_heads=rng.choice([None, 1, heads // 2 or 1]), head_dim=rng.choice([None, 4, 6]),
                  d_ff=rng.choice([None, 10]), max_seq_len=16, bias=rng.random() < .5,
                  tie_embeddings=rng.random() < .5, embedding_norm=rng.random() < .3, embed_scale=rng.random() < .3,
                  **{axis: rng.choice(registry.names()) for axis, registry in AXES.items()})
        if kw["position"] == "t5_bias":
            kw.update(rel_buckets=8, rel_max_distance=16)
        if rng.random() < .4:
            kw.update(window=rng.choice([2, 3]), window_pattern=rng.choice([None, "LG", "GL"]))
        if arch == "encoder":
            kw["type_vocab_size"] = rng.choice([0, 2])
            kw["nsp"] = kw["type_vocab_size"] == 2 and rng.random() < .5
        if arch == "encoder-decoder" and rng.random() < .5:
            kw["n_encoder_layers"] = rng.choice([1, 2])
        try:
            out.append(ModelConfig(**kw))
        except ConfigError:
            continue  # a refused combination (an odd RoPE head dimension, a pattern cut off by the depth)
    return out


CONFIGS = random_configs(60)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: content_hash(c))
def test_declared_parameters_are_the_built_models_and_the_config_survives_yaml(cfg):
    assert parameter_count(cfg) == build_model(cfg).num_parameters()  # tied matrices once
    back = ModelConfig.from_yaml(cfg.to_yaml())
    assert back == cfg and content_hash(back) == content_hash(cfg)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.arch != "encoder"][:20], ids=lambda c: content_hash(c))
def test_declared_kv_cache_bytes_are_what_a_filled_cache_holds(cfg):
    """2 (K and V) x n_kv_heads x head_dim x bytes per position in each layer, a windowed layer holding window - 1;
    an encoder-decoder's layers also hold the K/V of its source (here as long as the target), which do not grow."""
    model, t = build_model(cfg).eval(), 12
    x, cache = torch.randint(0, cfg.vocab_size, (1, t)), KVCache()
    with torch.no_grad():
        memory = model.encode(x) if cfg.arch == "encoder-decoder" else None
        step = (lambda ids: model(ids, cache=cache)) if memory is None else (
            lambda ids: model.decode(ids, memory, cache=cache))
        step(x)
        held = cache.nbytes()
        step(x[:, :1])
    assert held == kv_cache_bytes(cfg, t, bytes_per_element=4)
    grown = cache.nbytes() - held
    assert grown == kv_cache_bytes_per_token(cfg, bytes_per_element=4)
