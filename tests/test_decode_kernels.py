"""What beam search's speed rests on (issue 21) computes what the plain formulas compute:

- the C++ candidate selection (study/axes/kernels/log_softmax_topk.cpp) is log_softmax followed by a row-wise top-k;
- the time-major KV cache holds, appends, reorders and rolls exactly as concatenation and index_select would;
- cross-attention with one memory row per sentence, shared by its k hypotheses, equals the memory copied k times.

tests/test_generate.py holds beam search to the per-sentence loop it replaced through both candidate paths.
"""

from __future__ import annotations

import pytest
import torch

import study.axes.cpu_kernels as cpu_kernels
import study.model.generate as generate
from study.axes.cpu_kernels import cpu_ops
from study.config import ModelConfig
from study.model import KVCache, build_model


def _logits(rows: int, vocab: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(rows, vocab, generator=g)).to(dtype)


def test_the_kernel_is_built_on_a_cpu_and_beam_search_calls_it():
    assert cpu_ops("log_softmax_topk") is not None  # a machine that runs the suite has a compiler
    model = build_model(ModelConfig(arch="encoder-decoder", vocab_size=20, d_model=16, n_layers=1, n_heads=2,
                                    d_ff=32, max_seq_len=32)).eval()
    with torch.profiler.profile() as prof:
        generate.beam_search(model, torch.randint(3, 20, (2, 5)), None, bos=1, eos=2, beam_size=3)
    assert "study_log_softmax_topk::forward" in {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab, k", [(7, 8000, 10), (3, 100, 4), (2, 5, 5), (1, 1000, 1)])
def test_values_are_log_softmax_and_ids_its_top_k(dtype, rows, vocab, k):
    """Values agree with torch's log_softmax in float32 to a few ulp (the sum runs in another order); ids are the
    top-k ids (the logits here have no ties); max and log-sum rebuild any token's log-probability."""
    logits = _logits(rows, vocab, dtype)
    values, ids, row_max, row_logsum = cpu_ops("log_softmax_topk").forward(logits, k)
    logp = torch.log_softmax(logits.float(), dim=-1)
    want_values, want_ids = logp.topk(k, dim=-1)
    assert values.dtype == torch.float32 and ids.dtype == torch.long
    if dtype == torch.float32:  # bf16/fp16 logits tie often: the ids of equal values may come in another order
        assert torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want_values, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close((logits.float() - row_max[:, None]) - row_logsum[:, None], logp, atol=2e-6, rtol=1e-6)


def test_ties_keep_the_smaller_id_first_and_missing_entries_are_minus_infinity():
    values, ids, _, _ = cpu_ops("log_softmax_topk").forward(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]), 7)
    assert ids[0, :4].tolist() == [1, 2, 4, 3]
    assert values[0, 0] == values[0, 1] == values[0, 2] > values[0, 3]
    assert torch.isinf(values[0, 5:]).all() and (values[0, 5:] < 0).all()


def test_the_eager_path_is_the_same_selection(monkeypatch):
    """Without the kernel (no compiler, STUDY_CPU_KERNELS=0, a GPU) _top_log_probs is log_softmax and topk; rows at
    their length limit hold EOS alone in both."""
    logits, at_limit, eos = _logits(6, 300), torch.tensor([False, True, False, False, True, False]), 2
    ours = generate._top_log_probs(logits, 8, at_limit, eos)
    monkeypatch.setattr(cpu_kernels, "_loaded", {"log_softmax_topk": None})
    eager = generate._top_log_probs(logits, 8, at_limit, eos)
    assert torch.equal(ours[1], eager[1])
    torch.testing.assert_close(ours[0], eager[0], atol=2e-6, rtol=1e-6)
    assert (eager[1][at_limit, 0] == eos).all() and torch.isinf(eager[0][at_limit, 1:]).all()
    torch.testing.assert_close(eager[0][at_limit, 0], torch.log_softmax(logits, -1)[at_limit, eos])


# --------------------------------------------------------------------------------------------------------------------
# The KV cache against concatenation and index_select


class ListCache:
    """The cache as a concatenation of each step's K/V: the formula the time-major buffer must equal."""

    def __init__(self):
        self.k = self.v = None

    def append(self, k, v, keep):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        seen = self.k, self.v
        if keep is not None:
            first = max(0, self.k.shape[2] - keep)
            self.k, self.v = self.k[:, :, first:], self.v[:, :, first:]
        return seen

    def select(self, index):
        self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


@pytest.mark.parametrize("keep", [None, 5, 1, 0])
def test_the_cache_appends_reorders_and_rolls_as_concatenation_does(keep):
    """60 steps (past the buffer's first capacities, so it moves to larger ones), a prompt of 3, each row repeated
    twice after it (beam search's one-row first step), then rows dropped and permuted as beam search does, a rolling
    window (`keep`) in some cases."""
    g = torch.Generator().manual_seed(1)
    cache, ref, rows = KVCache(), ListCache(), 3
    for step in range(60):
        t = 3 if step == 0 else 1
        k, v = torch.randn(rows, 2, t, 4, generator=g), torch.randn(rows, 2, t, 4, generator=g)
        got, want = cache.append(0, k, v, keep=keep), ref.append(k, v, keep)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        if step == 0:
            index = torch.arange(rows).repeat_interleave(2)
            cache.select_self(index)
            ref.select(index)
            rows *= 2
        elif step % 3 == 2:
            new_rows = rows - 1 if step % 9 == 8 and rows > 2 else rows
            index = torch.randint(0, rows, (new_rows,), generator=g)
            cache.select_self(index)
            ref.select(index)
            rows = new_rows
        assert all(torch.equal(a, b) for a, b in zip(cache.held(0), (ref.k, ref.v)))
        assert cache.nbytes() == 2 * ref.k.numel() * 4


# --------------------------------------------------------------------------------------------------------------------
# Cross-attention with one memory row per sentence


@pytest.mark.parametrize("position", ["sinusoidal", "rope", "t5_bias"])
@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_hypotheses_sharing_one_memory_row_equal_the_memory_copied(position, n_kv_heads):
    torch.manual_seed(0)
    cfg = ModelConfig(arch="encoder-decoder", vocab_size=30, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                      d_ff=64, max_seq_len=64, position=position)
    model = build_model(cfg).eval()
    src = torch.randint(3, 30, (3, 7))
    src[1, 4:] = 0
    mask = src != 0
    k, tgt = 4, torch.randint(3, 30, (12, 5))
    with torch.no_grad():
        memory = model.encode(src, mask)
        shared = model.decode(tgt, memory, mask)  # (12, 5, V): rows 4i..4i+3 read memory row i
        copied = model.decode(tgt, memory.repeat_interleave(k, 0), mask.repeat_interleave(k, 0))
        cache_shared, cache_copied = KVCache(), KVCache()
        for t in range(tgt.shape[1]):  # and step by step on the cache
            step_shared = model.decode(tgt[:, t : t + 1], memory, mask, cache=cache_shared)
            step_copied = model.decode(tgt[:, t : t + 1], memory.repeat_interleave(k, 0), mask.repeat_interleave(k, 0),
                                       cache=cache_copied)
            torch.testing.assert_close(step_shared, step_copied, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared, copied, atol=1e-5, rtol=1e-5)
    assert cache_shared.cross_kv[0][0].shape[0] == 3 and cache_copied.cross_kv[0][0].shape[0] == 12


def test_target_rows_that_cannot_share_the_memory_rows_are_refused():
    model = build_model(ModelConfig(arch="encoder-decoder", vocab_size=30, d_model=16, n_layers=1, n_heads=2,
                                    d_ff=32, max_seq_len=32)).eval()
    memory = model.encode(torch.randint(3, 30, (3, 4)))
    with pytest.raises(ValueError, match="7 target rows cannot share 3 memory rows"):
        model.decode(torch.randint(3, 30, (7, 2)), memory)
