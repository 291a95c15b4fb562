"""The beam search study/model/generate.py shipped before it was vectorised (issue 21), kept verbatim as the
reference the new one must equal (tests/test_generate.py, bench/decode_speed.py): a Python loop over sentences and
candidates with `.tolist()` each step, and finished sentences left in the batch to the end; with it, the KVCache of
study/model/attention.py of that time (each step concatenated the past with the new K/V, and a reorder copied every
row's past), so that the decode benchmark measures against what shipped, not against today's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from study.model.generate import _max_lengths, length_normalise


@dataclass
class KVCache:
    """Keys and values of past positions for incremental decoding.

    Stores `n_kv_heads` heads per layer, so MQA/GQA shrink it by n_heads / n_kv_heads.
    Self-attention entries grow by one step per call, except in sliding-window layers, which
    keep only the `window - 1` most recent positions (all a later query can see; Mistral's
    rolling cache, Jiang et al. 2023), so their memory stops growing. Cross-attention entries
    (the encoder memory projected once) are computed on the first decoding step.
    """

    self_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cross_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    seen: int = 0  # positions processed so far: the position of the next token

    @property
    def length(self) -> int:
        return self.seen

    def kept(self, window: int | None) -> int:
        """How many past positions a layer with this window (None: global) holds now."""
        return self.seen if window is None else min(self.seen, window - 1)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's keys/values; returns past + new for this step's attention, and stores
        only the `keep` most recent positions when `keep` is set (a sliding-window layer)."""
        if layer in self.self_kv:
            past_k, past_v = self.self_kv[layer]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        stored = (k, v) if keep is None else (k[:, :, k.shape[2] - min(keep, k.shape[2]):],
                                              v[:, :, v.shape[2] - min(keep, v.shape[2]):])
        self.self_kv[layer] = stored
        return k, v

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows of both stores (beam search keeps the surviving hypotheses)."""
        self.select_self(index)
        self.select_cross(index)

    def select_self(self, index: torch.Tensor) -> None:
        """Select batch rows of the self-attention K/V (what depends on each hypothesis)."""
        self.self_kv = {layer: (k.index_select(0, index), v.index_select(0, index))
                        for layer, (k, v) in self.self_kv.items()}

    def select_cross(self, index: torch.Tensor) -> None:
        """Select batch rows of the cross-attention K/V (what depends only on the source sentence)."""
        self.cross_kv = {layer: (k.index_select(0, index), v.index_select(0, index))
                         for layer, (k, v) in self.cross_kv.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in (self.self_kv, self.cross_kv) for kv in s.values() for t in kv)


class _Decoder:
    """Steps an encoder-decoder model one target token at a time, cached or not."""

    def __init__(self, model, memory, memory_mask, use_cache: bool):
        self.model, self.memory, self.memory_mask = model, memory, memory_mask
        self.cache = KVCache() if use_cache else None

    def step(self, prefix: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the next token after `prefix` (rows, t)."""
        tokens = prefix[:, -1:] if self.cache is not None else prefix
        logits = self.model.decode(tokens, self.memory, self.memory_mask, cache=self.cache)[:, -1]
        return torch.log_softmax(logits.float(), dim=-1)

    def reorder(self, index: torch.Tensor) -> None:
        self.memory = self.memory.index_select(0, index)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)


def _only_eos_at_limit(logp: torch.Tensor, at_limit: torch.Tensor, eos: int) -> torch.Tensor:
    """Hypotheses at their length limit may only end now: every token but EOS gets -inf."""
    if not bool(at_limit.any()):
        return logp
    only_eos = torch.full_like(logp, float("-inf"))
    only_eos[:, eos] = logp[:, eos]
    return torch.where(at_limit[:, None], only_eos, logp)


def _note_cache(dec, stats: dict | None) -> None:
    """Record the KV cache's bytes at the end of decoding (its largest: it only grows) in `stats`."""
    if stats is not None and dec.cache is not None:
        stats["kv_cache_bytes"] = max(stats.get("kv_cache_bytes", 0), dec.cache.nbytes())


@torch.no_grad()
def reference_beam_search(
    model, src, src_mask, *, bos: int, eos: int, beam_size: int = 5, length_penalty: float = 1.0,
    max_len_a: float = 1.2, max_len_b: int = 10, use_cache: bool = True, stats: dict | None = None,
) -> list[list[int]]:
    """Batched beam search on the KV cache (`stats`: as in greedy_decode). A sentence is finished once it holds
    `beam_size` hypotheses ending in EOS (fairseq's stopping rule); after a * |src| + b
    tokens (capped as in greedy_decode) EOS is forced. Hypotheses are scored by the log-probability
    of their tokens and the EOS, length-normalised over both; the best is returned, without EOS.
    As in fairseq, only an EOS among the `beam_size` best candidates of a step finishes a
    hypothesis (the other k of the 2k candidates only refill the beam)."""
    n, k = src.shape[0], beam_size
    device = src.device
    max_len = _max_lengths(model, src_mask, src, max_len_a, max_len_b)  # (n,)
    rows = torch.arange(n, device=device).repeat_interleave(k)  # (n*k,) the sentence of each hypothesis
    memory = model.encode(src, src_mask)  # (n, S, d)
    dec = _Decoder(model, memory.index_select(0, rows), None if src_mask is None else src_mask.index_select(0, rows),
                   use_cache)
    prefix = torch.full((n * k, 1), bos, dtype=torch.long, device=device)  # (n*k, t + 1)
    scores = torch.zeros(n, k, device=device, dtype=torch.float32)  # summed log-probs: never in bf16 (bf16-true)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    search = _BeamState(n, k, eos, length_penalty)
    for t in range(int(max_len.max()) + 1):  # one extra step for the EOS
        logp = _only_eos_at_limit(dec.step(prefix), (t >= max_len).repeat_interleave(k), eos)  # (n*k, V)
        vocab = logp.shape[-1]
        cand = (scores[:, :, None] + logp.view(n, k, vocab)).view(n, k * vocab)
        top_scores, top_ids = cand.topk(2 * k, dim=1)  # (n, 2k): 2k so k survive even if k end in EOS
        new_scores, new_rows, new_tokens = search.advance(top_scores, top_ids // vocab, top_ids % vocab, prefix, t,
                                                          (t >= max_len).tolist())
        if all(search.done):
            break
        index = new_rows.view(-1)
        dec.reorder(index)
        prefix = torch.cat([prefix.index_select(0, index), new_tokens.view(-1, 1)], dim=1)
        scores = new_scores
    _note_cache(dec, stats)
    return [max(f, key=lambda x: x[0])[1] if f else [] for f in search.finished]


class _BeamState:
    """The finished hypotheses of each sentence and which sentences are done (fairseq's bookkeeping)."""

    def __init__(self, n: int, k: int, eos: int, length_penalty: float):
        self.n, self.k, self.eos, self.length_penalty = n, k, eos, length_penalty
        self.finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(n)]
        self.done = [False] * n

    def advance(self, top_scores, beam_of, token_of, prefix, t: int, last_step: list[bool]):
        """The next beam from each sentence's 2k best candidates: an EOS among the k best finishes a hypothesis;
        the first k live candidates continue. Returns (scores (n, k), rows into the prefix (n, k), tokens (n, k))."""
        n, k, device = self.n, self.k, top_scores.device
        new_scores = torch.full((n, k), float("-inf"), device=device, dtype=torch.float32)
        new_rows = torch.zeros(n, k, dtype=torch.long, device=device)
        new_tokens = torch.full((n, k), self.eos, dtype=torch.long, device=device)
        ts, bs, tk = top_scores.tolist(), beam_of.tolist(), token_of.tolist()
        for i in range(n):
            if self.done[i]:
                continue
            kept = 0
            for rank, (s, b, tok) in enumerate(zip(ts[i], bs[i], tk[i])):
                if s == float("-inf"):
                    break
                if tok == self.eos:
                    if rank < k:  # an EOS ranked below k live candidates does not finish a hypothesis
                        hyp = prefix[i * k + b, 1:].tolist()
                        self.finished[i].append((length_normalise(s, t + 1, self.length_penalty), hyp))
                        if len(self.finished[i]) >= k:
                            break
                    continue
                if kept < k:
                    new_scores[i, kept], new_rows[i, kept], new_tokens[i, kept] = s, i * k + b, tok
                    kept += 1
            if len(self.finished[i]) >= k or last_step[i] or kept == 0:
                self.done[i] = True
                new_scores[i] = float("-inf")
        return new_scores, new_rows, new_tokens
