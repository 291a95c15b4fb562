"""Decoding with the KV cache: greedy and beam search for encoder-decoder models,
and sampling for decoder-only models.

Every decoder step feeds one token per hypothesis and reuses cached K/V; with
`use_cache=False` the whole prefix is recomputed each step (the reference that
tests compare the cached path against).
"""

from __future__ import annotations

import torch

from study.axes import POSITIONS
from study.model.attention import KVCache
from study.model.transformer import DecoderLM, EncoderDecoderLM


class _Decoder:
    """Steps an encoder-decoder model one target token at a time, cached or not."""

    def __init__(self, model: EncoderDecoderLM, memory, memory_mask, use_cache: bool):
        self.model, self.memory, self.memory_mask = model, memory, memory_mask
        self.cache = KVCache() if use_cache else None
        self.peak_cache_bytes = 0  # beam search drops finished sentences, so the cache is largest mid-way

    def step(self, prefix: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the next token after `prefix` (rows, t)."""
        tokens = prefix[:, -1:] if self.cache is not None else prefix
        logits = self.model.decode(tokens, self.memory, self.memory_mask, cache=self.cache)[:, -1]
        if self.cache is not None:
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache.nbytes())
        return torch.log_softmax(logits.float(), dim=-1)

    def reorder(self, index: torch.Tensor, sentence_rows: torch.Tensor | None) -> None:
        """Keep rows `index` of what depends on each hypothesis (its self-attention K/V). What depends only on the
        source (memory, mask, cross-attention K/V) is the same in the k rows of a sentence, so it need not follow
        the beams: it keeps `sentence_rows` (the rows of the sentences still searching, in place), or all rows
        when None. Half of the bytes beam search moved each step were these copies."""
        if self.cache is not None:
            self.cache.select_self(index)
        if sentence_rows is None:
            return
        self.memory = self.memory.index_select(0, sentence_rows)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, sentence_rows)
        if self.cache is not None:
            self.cache.select_cross(sentence_rows)


def _max_lengths(model, src_mask: torch.Tensor | None, src: torch.Tensor, a: float, b: int) -> torch.Tensor:
    """a * |src| + b per sentence, capped so that the decoder never feeds a position it cannot embed: with
    learned positions (which do not extrapolate) BOS + max_len tokens must fit in max_seq_len."""
    src_len = src_mask.sum(1) if src_mask is not None else torch.full((src.shape[0],), src.shape[1], device=src.device)
    max_len = (a * src_len.float() + b).long()
    cfg = getattr(model, "config", None)  # None: a stand-in model with no position table
    if cfg is not None and not POSITIONS[cfg.position].extrapolates:
        max_len = max_len.clamp(max=cfg.max_seq_len - 1)
    return max_len


@torch.no_grad()
def _note_cache(dec: _Decoder, stats: dict | None) -> None:
    """Record the most bytes the KV cache held during decoding in `stats`."""
    if stats is not None and dec.cache is not None:
        stats["kv_cache_bytes"] = max(stats.get("kv_cache_bytes", 0), dec.peak_cache_bytes)


def greedy_decode(
    model: EncoderDecoderLM, src, src_mask, *, bos: int, eos: int, max_len_a: float = 1.2, max_len_b: int = 10,
    use_cache: bool = True, stats: dict | None = None,
) -> list[list[int]]:
    """Most probable next token at each step, up to a * |src| + b tokens (then EOS is forced, as in
    fairseq; with learned positions at most max_seq_len - 1 tokens); EOS is not returned. `stats`, when given,
    receives `kv_cache_bytes`: the most bytes the KV cache held (the largest over calls sharing the dict)."""
    max_len = _max_lengths(model, src_mask, src, max_len_a, max_len_b)
    dec = _Decoder(model, model.encode(src, src_mask), src_mask, use_cache)
    prefix = torch.full((src.shape[0], 1), bos, dtype=torch.long, device=src.device)
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    for t in range(int(max_len.max()) + 1):  # one extra step for the EOS
        nxt = dec.step(prefix).argmax(-1)
        nxt = torch.where(done | (t >= max_len), torch.full_like(nxt, eos), nxt)
        prefix = torch.cat([prefix, nxt[:, None]], dim=1)
        done |= nxt == eos
        if bool(done.all()):
            break
    _note_cache(dec, stats)
    out = []
    for row in prefix[:, 1:].tolist():
        out.append(row[: row.index(eos)] if eos in row else row)
    return out


def length_normalise(score: float, length: int, alpha: float) -> float:
    """GNMT length penalty: score / ((5 + |Y|) / 6)^alpha (Wu et al. 2016, eq. 14); `score` may be a tensor."""
    return score / (((5 + length) / 6) ** alpha) if alpha else score


@torch.no_grad()
def beam_search(
    model: EncoderDecoderLM, src, src_mask, *, bos: int, eos: int, beam_size: int = 5, length_penalty: float = 1.0,
    max_len_a: float = 1.2, max_len_b: int = 10, use_cache: bool = True, stats: dict | None = None,
) -> list[list[int]]:
    """Batched beam search on the KV cache (`stats`: as in greedy_decode). A sentence is finished once it holds
    `beam_size` hypotheses ending in EOS (fairseq's stopping rule); after a * |src| + b
    tokens (capped as in greedy_decode) EOS is forced. Hypotheses are scored by the log-probability
    of their tokens and the EOS, length-normalised over both (GNMT, Wu et al. 2016, eq. 14); the best is
    returned, without EOS. As in fairseq, only an EOS among the `beam_size` best candidates of a step finishes a
    hypothesis (the other k of the 2k candidates only refill the beam).

    The bookkeeping is tensor operations over all sentences at once, and a finished sentence leaves the batch
    (its rows of the memory, mask, KV cache and prefix are dropped), so later steps run on fewer rows."""
    n, k = src.shape[0], beam_size
    max_len = _max_lengths(model, src_mask, src, max_len_a, max_len_b)  # (n,)
    steps = int(max_len.max()) + 1  # one extra step for the EOS
    rows = torch.arange(n, device=src.device).repeat_interleave(k)  # (n*k,) the sentence of each hypothesis
    memory = model.encode(src, src_mask)  # (n, S, d)
    dec = _Decoder(model, memory.index_select(0, rows), None if src_mask is None else src_mask.index_select(0, rows),
                   use_cache)
    beams = _Beams.start(n, k, bos, max_len)
    finished = _Finished(n, k, steps, eos, length_penalty, src.device)
    for t in range(steps):
        at_limit = t >= beams.max_len  # (m,) m: the sentences still searching
        logp = _only_eos_at_limit(dec.step(beams.prefix), at_limit.repeat_interleave(k), eos)  # (m*k, V)
        searching = beams.advance(logp, finished, at_limit, t, eos)
        if searching is None:
            break
        dec.reorder(*searching)
    _note_cache(dec, stats)
    return finished.best()


def _only_eos_at_limit(logp: torch.Tensor, at_limit: torch.Tensor, eos: int) -> torch.Tensor:
    """Hypotheses at their length limit may only end now: every token but EOS gets -inf."""
    if not bool(at_limit.any()):
        return logp
    only_eos = torch.full_like(logp, float("-inf"))
    only_eos[:, eos] = logp[:, eos]
    return torch.where(at_limit[:, None], only_eos, logp)


class _Beams:
    """The k live hypotheses of each sentence still searching: m sentences, rows m*k in sentence order."""

    def __init__(self, sentence, scores, prefix, max_len):
        self.sentence = sentence  # (m,) index of each searching sentence in the batch given to beam_search
        self.scores = scores  # (m, k) summed log-probs: float32, never bf16 (bf16-true)
        self.prefix = prefix  # (m*k, t + 1) BOS and the tokens so far
        self.max_len = max_len  # (m,)

    @classmethod
    def start(cls, n: int, k: int, bos: int, max_len: torch.Tensor) -> "_Beams":
        device = max_len.device
        scores = torch.zeros(n, k, device=device, dtype=torch.float32)
        scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
        prefix = torch.full((n * k, 1), bos, dtype=torch.long, device=device)
        return cls(torch.arange(n, device=device), scores, prefix, max_len)

    def advance(self, logp, finished: "_Finished", at_limit, t: int, eos: int):
        """One step of fairseq's rule on each sentence's 2k best candidates: an EOS among the k best finishes a
        hypothesis (until the sentence holds k); the first k other candidates continue. A sentence with k finished
        hypotheses, at its length limit, or with no candidate left is done and leaves the batch. Returns the
        decoder rows each new hypothesis continues (m'*k,) and the rows of the sentences kept, in place (None when
        all are), for _Decoder.reorder; None when every sentence is done."""
        m, k = self.scores.shape
        vocab = logp.shape[-1]
        cand = (self.scores[:, :, None] + logp.view(m, k, vocab)).view(m, k * vocab)
        top_scores, top_ids = cand.topk(2 * k, dim=1)  # (m, 2k): 2k so k survive even if k end in EOS
        rows = torch.arange(m, device=cand.device)[:, None] * k + top_ids // vocab  # (m, 2k) rows of self.prefix
        tokens = top_ids % vocab  # (m, 2k)
        # the old loop stopped at the first -inf candidate; topk sorts, so those are a suffix
        valid = top_scores > float("-inf")
        is_eos = tokens == eos
        ending = valid & is_eos & (torch.arange(2 * k, device=cand.device) < k)
        finished.add(self.sentence, ending, top_scores, self.prefix, rows, t)
        going_on = valid & ~is_eos
        kept = going_on & (going_on.cumsum(1) <= k)  # the first k candidates that do not end
        done = (finished.count[self.sentence] >= k) | at_limit | ~kept.any(1)  # (m,)
        # the kept candidates first, in rank order (a stable sort keeps the order of ties)
        order = torch.sort((~kept).to(torch.uint8), dim=1, stable=True).indices[:, :k]  # (m, k)
        scores = torch.where(kept.gather(1, order), top_scores.gather(1, order), float("-inf"))
        stay = (~done).nonzero().squeeze(1)  # (m',)
        if stay.numel() == 0:
            return None
        index = rows.gather(1, order).index_select(0, stay).view(-1)  # (m'*k,)
        self.prefix = torch.cat([self.prefix.index_select(0, index),
                                 tokens.gather(1, order).index_select(0, stay).view(-1, 1)], dim=1)
        self.scores, self.sentence = scores.index_select(0, stay), self.sentence.index_select(0, stay)
        self.max_len = self.max_len.index_select(0, stay)
        if stay.numel() == m:
            return index, None
        return index, (stay[:, None] * k + torch.arange(k, device=stay.device)).view(-1)


class _Finished:
    """Finished hypotheses in tensors: up to k per sentence, in the order they finished, read once at the end."""

    def __init__(self, n: int, k: int, steps: int, eos: int, length_penalty: float, device):
        self.k, self.length_penalty = k, length_penalty
        self.count = torch.zeros(n, dtype=torch.long, device=device)  # (n,)
        self.scores = torch.full((n, k), float("-inf"), dtype=torch.float64, device=device)  # (n, k)
        self.tokens = torch.full((n, k, steps), eos, dtype=torch.long, device=device)  # (n, k, steps)
        self.lengths = torch.zeros(n, k, dtype=torch.long, device=device)  # (n, k)

    def add(self, sentence, ending, top_scores, prefix, rows, t: int) -> None:
        """Store the candidates marked `ending` (m, 2k) in rank order, up to k per sentence; the hypothesis is
        the prefix without BOS (t tokens), its score normalised over t + 1 tokens (with the EOS)."""
        slot = self.count[sentence][:, None] + ending.cumsum(1) - 1  # (m, 2k)
        ending = ending & (slot < self.k)
        if not bool(ending.any()):
            return
        which = sentence[:, None].expand_as(ending)[ending]  # (a,)
        where = slot[ending]  # (a,)
        # in float64, as the per-hypothesis Python floats of the loop this replaced: the same scores, the same ties
        self.scores[which, where] = length_normalise(top_scores[ending].double(), t + 1, self.length_penalty)
        self.tokens[which, where, :t] = prefix.index_select(0, rows[ending])[:, 1:]
        self.lengths[which, where] = t
        self.count.index_add_(0, sentence, ending.sum(1))

    def best(self) -> list[list[int]]:
        """Each sentence's best hypothesis (the first of equal scores, as Python's max), [] where none finished."""
        best = self.scores.argmax(1, keepdim=True)  # (n, 1)
        tokens = self.tokens.gather(1, best[:, :, None].expand(-1, -1, self.tokens.shape[2]))[:, 0]  # (n, steps)
        lengths = torch.where(self.count > 0, self.lengths.gather(1, best)[:, 0], 0)
        return [row[:length] for row, length in zip(tokens.tolist(), lengths.tolist())]


@torch.no_grad()
def sample(
    model: DecoderLM, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Autoregressive sampling from a decoder-only model with the KV cache (temperature 0: greedy)."""
    cache = KVCache()
    logits = model(prompt, cache=cache)[:, -1]
    out = prompt
    for _ in range(max_new_tokens):
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits.float() / temperature
            if top_k is not None:
                kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        out = torch.cat([out, nxt], dim=1)
        logits = model(nxt, cache=cache)[:, -1]
    return out
