"""Cost formulas against the real modules."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from study.config import ModelConfig, preset
from study.model import KVCache, build_model
from study.model.accounting import (
    flops_per_token,
    inference_flops_per_token,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    parameter_count,
)

SMALL = dict(d_model=64, n_layers=2, n_heads=4, vocab_size=100, max_seq_len=32)
CONFIGS = {
    "bert": preset("bert", **SMALL, d_ff=96),
    "gpt2-sandwich": preset("gpt2", **SMALL, norm_position="sandwich"),
    "llama2-gqa": preset("llama2", **SMALL, n_kv_heads=2, d_ff=96),
    "mistral-window": preset("mistral", **SMALL, n_kv_heads=1, d_ff=96, window=4),
    "t5": preset("t5", **SMALL, n_encoder_layers=3, d_ff=96),
    "vaswani-untied": preset("vaswani", **SMALL, n_encoder_layers=1, d_ff=96, tie_embeddings=False),
    "geglu-headdim": ModelConfig(**SMALL, arch="encoder", activation="geglu", head_dim=8, type_vocab_size=2, bias=False),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_count_matches_the_module(name):
    cfg = CONFIGS[name]
    assert parameter_count(cfg) == build_model(cfg).num_parameters()


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_flops_match_torch_flop_counter(name):
    # The math SDPA backend decomposes attention into bmm, which the counter sees;
    # it computes the full T x T square, hence dense_attention=True.
    cfg = CONFIGS[name]
    model = build_model(cfg).eval()
    t = 16
    x = torch.randint(0, 100, (1, t))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        if cfg.arch == "encoder":
            model.mlm_logits(model(x))
        elif cfg.arch == "decoder":
            model(x)
        else:
            model(x, x)
    assert counter.get_total_flops() / t == flops_per_token(cfg, t, training=False, dense_attention=True)


def test_an_mlm_head_on_the_masked_positions_only_costs_that_fraction_of_its_flops():
    # MLM pretraining runs the head (transform + vocabulary projection) on the selected 15% only
    cfg = CONFIGS["bert"]
    model = build_model(cfg).eval()
    t, predicted = 16, 4
    x = torch.randint(0, 100, (1, t))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model.mlm_logits(model(x)[:, :predicted])
    expected = flops_per_token(cfg, t, training=False, dense_attention=True, predicted_fraction=predicted / t)
    assert counter.get_total_flops() / t == pytest.approx(expected)
    assert expected < flops_per_token(cfg, t, training=False, dense_attention=True)


def test_training_flops_are_three_forwards_and_causal_attention_counts_half():
    cfg = CONFIGS["gpt2-sandwich"]
    t = 32
    assert flops_per_token(cfg, t, training=True) == 3 * flops_per_token(cfg, t, training=False)
    dense = flops_per_token(cfg, t, training=False, dense_attention=True)
    visible = flops_per_token(cfg, t, training=False)
    width = cfg.n_heads * cfg.resolved_head_dim
    assert dense - visible == pytest.approx(cfg.n_layers * 4 * width * (t - (t + 1) / 2))


def test_window_caps_attention_flops():
    cfg = CONFIGS["mistral-window"]
    width = cfg.n_heads * cfg.resolved_head_dim
    long_ctx = inference_flops_per_token(cfg, 1000) - inference_flops_per_token(cfg, 10)
    assert long_ctx == 0  # every layer sees at most `window` keys
    glob = cfg.replace(window=None)
    assert inference_flops_per_token(glob, 1000) - inference_flops_per_token(glob, 10) == cfg.n_layers * 4 * width * 990


@pytest.mark.parametrize("name", ["gpt2-sandwich", "llama2-gqa", "mistral-window", "t5"])
def test_kv_cache_bytes_per_token_match_a_filled_cache(name):
    cfg = CONFIGS[name]
    model = build_model(cfg).eval()
    cache = KVCache()
    t = 9
    with torch.no_grad():
        if cfg.arch == "encoder-decoder":  # the source's K/V in every decoder layer, held for the whole decode
            memory = model.encode(torch.randint(0, 100, (1, 5)))
            model.decode(torch.randint(0, 100, (1, t)), memory, cache=cache)
            assert cache.cross_kv and cache.nbytes() == kv_cache_bytes(cfg, t, bytes_per_element=4, source_len=5)
            cache.cross_kv.clear()
        else:
            model(torch.randint(0, 100, (1, t)), cache=cache)
    assert cache.nbytes() == kv_cache_bytes(cfg, t, bytes_per_element=4, source_len=0)  # self-attention's alone
    before = cache.nbytes()
    with torch.no_grad():  # one more token: the cache grows by the per-token figure
        if cfg.arch == "encoder-decoder":
            model.decode(torch.randint(0, 100, (1, 1)), memory, cache=cache)
            cache.cross_kv.clear()
        else:
            model(torch.randint(0, 100, (1, 1)), cache=cache)
    assert cache.nbytes() - before == kv_cache_bytes_per_token(cfg, bytes_per_element=4)
    if cfg.window is None:
        assert cache.nbytes() == (t + 1) * kv_cache_bytes_per_token(cfg, bytes_per_element=4)


def test_sliding_window_layers_stop_growing_the_cache():
    cfg = CONFIGS["mistral-window"]  # every layer local, window 4
    assert kv_cache_bytes_per_token(cfg) == 0
    assert kv_cache_bytes(cfg, 1000) == kv_cache_bytes(cfg, 3) == 3 * kv_cache_bytes(cfg.replace(window=None), 1)
    mixed = cfg.replace(window_pattern="LG")  # half the layers global
    assert kv_cache_bytes_per_token(mixed) * 2 == kv_cache_bytes_per_token(cfg.replace(window=None))


def test_gqa_and_mqa_shrink_the_cache_by_the_sharing_ratio():
    mha = ModelConfig(**SMALL)
    assert kv_cache_bytes_per_token(mha.replace(n_kv_heads=2)) * 2 == kv_cache_bytes_per_token(mha)
    assert kv_cache_bytes_per_token(mha.replace(n_kv_heads=1)) * 4 == kv_cache_bytes_per_token(mha)
    assert kv_cache_bytes_per_token(CONFIGS["bert"]) == 0
