"""Decoding counts the translations it cut: a returned hypothesis that ended because EOS was forced at its length
limit (a * |src| + b, or fewer where a learned position table ends), not because the model chose to end, is counted
in `stats`, and so is each such limit the position cap lowered. A cut translation lowers BLEU; without the counts
nothing in a run's record would say so."""

from __future__ import annotations

import pytest

from study.model.generate import beam_search, greedy_decode
from test_generate import BOS, EOS, EOSBias, batch, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

DECODERS = {"greedy": lambda m, s, k, **kw: greedy_decode(m, s, k, **kw),
            "beam": lambda m, s, k, **kw: beam_search(m, s, k, beam_size=3, **kw)}


def decode(name: str, model, src, mask, **kw) -> tuple[list[list[int]], dict]:
    stats: dict = {}
    return DECODERS[name](model, src, mask, bos=BOS, eos=EOS, stats=stats, **kw), stats


def eos_from(step: int, model):
    """The model with EOS impossible before target position `step` and certain from it on."""
    return EOSBias(model, bias=-1e4 * (step - 0.5), slope=1e4)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_outputs_cut_where_learned_positions_end_are_counted_as_cut_by_the_position_cap(name, use_cache):
    # a * |src| + b = 22 and 13 tokens, but a learned table of 12 positions holds BOS + 11: both are cut at 11
    model = EOSBias(tiny_model(8, position="learned", max_seq_len=12), bias=-1e4)  # never ends by itself
    src, mask = batch(8, lengths=(10, 3))
    hyps, stats = decode(name, model, src, mask, max_len_a=1.2, max_len_b=10, use_cache=use_cache)
    assert [len(h) for h in hyps] == [11, 11]
    assert stats["hypotheses_at_length_limit"] == 2
    assert stats["length_capped_by_positions"] == 2


@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_outputs_cut_at_the_requested_limit_are_counted_but_not_as_capped(name):
    model = EOSBias(tiny_model(8, position="rope", max_seq_len=12), bias=-1e4)  # rotary: no position cap
    src, mask = batch(8, lengths=(10, 3))
    hyps, stats = decode(name, model, src, mask, max_len_a=1.2, max_len_b=10)
    assert [len(h) for h in hyps] == [22, 13]
    assert (stats["hypotheses_at_length_limit"], stats["length_capped_by_positions"]) == (2, 0)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_outputs_the_model_ended_itself_are_not_counted(name, use_cache):
    model = eos_from(3, tiny_model(5))  # every sentence ends after 3 tokens, well inside its limit of 10
    src, mask = batch(5, lengths=(6, 4, 6))
    hyps, stats = decode(name, model, src, mask, max_len_a=1.0, max_len_b=4, use_cache=use_cache)
    assert [len(h) for h in hyps] == [3, 3, 3]
    assert (stats["hypotheses_at_length_limit"], stats["length_capped_by_positions"]) == (0, 0)


@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_an_eos_the_model_chose_at_the_limit_is_not_a_cut_but_one_it_was_denied_is(name):
    src, mask = batch(5, lengths=(4, 4))  # limit 1 * 4 + 2 = 6 tokens; EOS is forced at target position 6
    kw = dict(max_len_a=1.0, max_len_b=2)
    chosen, stats = decode(name, eos_from(6, tiny_model(5)), src, mask, **kw)
    assert [len(h) for h in chosen] == [6, 6] and stats["hypotheses_at_length_limit"] == 0
    forced, stats = decode(name, eos_from(7, tiny_model(5)), src, mask, **kw)
    assert [len(h) for h in forced] == [6, 6] and stats["hypotheses_at_length_limit"] == 2


def test_the_counts_add_up_over_calls_sharing_the_dict():
    """translate() decodes a test set in batches and passes one dict: its counts are the test set's."""
    model = EOSBias(tiny_model(8, position="learned", max_seq_len=12), bias=-1e4)
    src, mask = batch(8, lengths=(10, 3))
    stats: dict = {}
    for _ in range(2):
        greedy_decode(model, src, mask, bos=BOS, eos=EOS, max_len_a=1.2, max_len_b=10, stats=stats)
    assert (stats["hypotheses_at_length_limit"], stats["length_capped_by_positions"]) == (4, 4)
