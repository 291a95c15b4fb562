"""Decoding with the KV cache: greedy and beam search for encoder-decoder models,
and sampling for decoder-only models.

Every decoder step feeds one token per hypothesis and reuses cached K/V; with
`use_cache=False` the whole prefix is recomputed each step (the reference that
tests compare the cached path against).
"""

from __future__ import annotations

import functools

import torch

from study.axes import POSITIONS
from study.axes.cpu_kernels import eager_cpu_ops
from study.model.attention import KVCache
from study.model.transformer import DecoderLM, EncoderDecoderLM


def _decoding(search):
    """Run `search` without autograd and outside inference mode, which Lightning's evaluation loops enter: there
    autocast does not cache its casts of the weights, so a bf16 decode cast every weight again at every step (about
    a tenth of a Multi30k decode step on a Xeon with AMX)."""

    @functools.wraps(search)
    def run(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return search(*args, **kwargs)

    return run


class _Decoder:
    """Steps an encoder-decoder model one target token at a time, cached or not."""

    def __init__(self, model: EncoderDecoderLM, memory, memory_mask, use_cache: bool):
        self.model, self.memory, self.memory_mask = model, memory, memory_mask
        self.cache = KVCache() if use_cache else None
        self.peak_cache_bytes = 0  # beam search drops finished sentences, so the cache is largest mid-way

    def step(self, prefix: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after `prefix` (rows, t): (rows, V) in the model's compute dtype."""
        tokens = prefix[:, -1:] if self.cache is not None else prefix
        logits = self.model.decode(tokens, self.memory, self.memory_mask, cache=self.cache)[:, -1]
        if self.cache is not None:
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache.nbytes())
        return logits

    def reorder(self, index: torch.Tensor, sentences: torch.Tensor | None) -> None:
        """Keep rows `index` of what depends on each hypothesis (its self-attention K/V). What depends only on the
        source (memory, mask, cross-attention K/V) has one row per sentence, shared by its k hypotheses (the model's
        cross-attention groups them), so it need not follow the beams: it keeps the rows `sentences` (those still
        searching, in place), or all when None."""
        if self.cache is not None:
            self.cache.select_self(index)
        if sentences is None:
            return
        self.memory = self.memory.index_select(0, sentences)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, sentences)
        if self.cache is not None:
            self.cache.select_cross(sentences)


def _requested_lengths(src_mask: torch.Tensor | None, src: torch.Tensor, a: float, b: int) -> torch.Tensor:
    """a * |src| + b per sentence: the length limit the task asks for."""
    src_len = src_mask.sum(1) if src_mask is not None else torch.full((src.shape[0],), src.shape[1], device=src.device)
    return (a * src_len.double() + b).long()  # in double, as fairseq: float32 rounds 1.3 * 90 + 10 down to 126


def _max_lengths(model, src_mask: torch.Tensor | None, src: torch.Tensor, a: float, b: int) -> torch.Tensor:
    """a * |src| + b per sentence, capped so that the decoder never feeds a position it cannot embed: with
    learned positions (which do not extrapolate) BOS + max_len tokens must fit in max_seq_len."""
    max_len = _requested_lengths(src_mask, src, a, b)
    cfg = getattr(model, "config", None)  # None: a stand-in model with no position table
    if cfg is not None and not POSITIONS[cfg.position].extrapolates:
        max_len = max_len.clamp(max=cfg.max_seq_len - 1)
    return max_len


def _note_length_limits(stats: dict | None, forced: torch.Tensor, max_len: torch.Tensor, requested: torch.Tensor):
    """Add to `stats` how many returned hypotheses ended because EOS was forced at their length limit (`forced`,
    one flag a sentence) and how many of those limits the position cap lowered below a * |src| + b: a cut
    translation lowers BLEU, and without these counts nothing would say why. Read once, after decoding."""
    if stats is None:
        return
    at_limit, capped = torch.stack([forced.sum(), (forced & (max_len < requested)).sum()]).tolist()
    stats["hypotheses_at_length_limit"] = stats.get("hypotheses_at_length_limit", 0) + at_limit
    stats["length_capped_by_positions"] = stats.get("length_capped_by_positions", 0) + capped


@torch.no_grad()
def _note_cache(dec: _Decoder, stats: dict | None) -> None:
    """Record the most bytes the KV cache held during decoding in `stats`."""
    if stats is not None and dec.cache is not None:
        stats["kv_cache_bytes"] = max(stats.get("kv_cache_bytes", 0), dec.peak_cache_bytes)


@_decoding
def greedy_decode(
    model: EncoderDecoderLM, src, src_mask, *, bos: int, eos: int, max_len_a: float = 1.2, max_len_b: int = 10,
    use_cache: bool = True, stats: dict | None = None, never: tuple[int, ...] = (),
) -> list[list[int]]:
    """Most probable next token at each step, up to a * |src| + b tokens (then EOS is forced, as in
    fairseq; with learned positions at most max_seq_len - 1 tokens); EOS is not returned. The tokens `never` (PAD
    and BOS in translation) are never chosen, as fairseq never chooses PAD. `stats`, when given,
    receives `kv_cache_bytes`: the most bytes the KV cache held (the largest over calls sharing the dict), and adds
    `hypotheses_at_length_limit`: outputs ended by the forced EOS where the model's argmax was another token, and
    `length_capped_by_positions`: those of them whose limit the position cap lowered below a * |src| + b."""
    max_len = _max_lengths(model, src_mask, src, max_len_a, max_len_b)
    limits = set(max_len.tolist())  # the steps at which some sentence's EOS is forced
    dec = _Decoder(model, model.encode(src, src_mask), src_mask, use_cache)
    prefix = torch.full((src.shape[0], 1), bos, dtype=torch.long, device=src.device)
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    forced = torch.zeros_like(done)
    banned = _token_ids(never, src.device)
    for t in range(max(limits) + 1):  # one extra step for the EOS
        logits = dec.step(prefix)
        nxt = (logits if banned is None else logits.index_fill(-1, banned, float("-inf"))).argmax(-1)
        if t in limits:  # only there: the other steps do no more work than before
            forced |= ~done & (max_len == t) & (nxt != eos)
        nxt = torch.where(done | (t >= max_len), torch.full_like(nxt, eos), nxt)
        prefix = torch.cat([prefix, nxt[:, None]], dim=1)
        done |= nxt == eos
        if bool(done.all()):
            break
    _note_cache(dec, stats)
    _note_length_limits(stats, forced, max_len, _requested_lengths(src_mask, src, max_len_a, max_len_b))
    out = []
    for row in prefix[:, 1:].tolist():
        out.append(row[: row.index(eos)] if eos in row else row)
    return out


def _token_ids(tokens: tuple[int, ...], device) -> torch.Tensor | None:
    return torch.tensor(sorted(set(tokens)), dtype=torch.long, device=device) if tokens else None


def length_normalise(score: float, length: int, alpha: float) -> float:
    """GNMT length penalty: score / ((5 + |Y|) / 6)^alpha (Wu et al. 2016, eq. 14); `score` may be a tensor."""
    return score / (((5 + length) / 6) ** alpha) if alpha else score


@_decoding
def beam_search(
    model: EncoderDecoderLM, src, src_mask, *, bos: int, eos: int, beam_size: int = 5, length_penalty: float = 1.0,
    max_len_a: float = 1.2, max_len_b: int = 10, use_cache: bool = True, stats: dict | None = None,
    never: tuple[int, ...] = (),
) -> list[list[int]]:
    """Batched beam search on the KV cache (`stats`, `never`: as in greedy_decode; a returned hypothesis counts as
    ended at its limit where the model's most probable token there was not EOS). A sentence is finished once it holds
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
    dec = _Decoder(model, model.encode(src, src_mask), src_mask, use_cache)  # memory (n, S, d): one row a sentence
    beams = _Beams.start(n, k, bos, max_len)
    finished = _Finished(n, k, steps, eos, length_penalty, src.device)
    banned = _token_ids(never, src.device)
    for t in range(steps):
        at_limit = t >= beams.max_len  # (m,) m: the sentences still searching
        rows_at_limit = at_limit.repeat_interleave(beams.scores.shape[1])  # (m*b,) b beams a sentence
        logits = dec.step(beams.prefix)
        logp, tokens, forced = _top_log_probs(logits, 2 * k, rows_at_limit, eos, banned)  # (m*b, 2k) x 2
        searching = beams.advance(logp, tokens, finished, at_limit, t, eos, forced)
        if searching is None:
            break
        dec.reorder(*searching)
    _note_cache(dec, stats)
    slot = finished.best_slot()
    _note_length_limits(stats, finished.forced.gather(1, slot)[:, 0] & (finished.count > 0), max_len,
                        _requested_lengths(src_mask, src, max_len_a, max_len_b))
    return finished.best(slot)


def _top_log_probs(logits: torch.Tensor, k: int, at_limit: torch.Tensor, eos: int, banned: torch.Tensor | None = None):
    """Each row's k most probable next tokens: log-probabilities (rows, k) float32 in descending order and token ids
    (rows, k); and (rows,) which rows are at their length limit with a token other than EOS most probable, whose EOS
    is forced, not chosen (None when no row is at its limit: counted only there, so other steps cost nothing more).
    Tokens `banned` are never among them; their probability stays in the normaliser (fairseq sets PAD's
    log-probability to -inf after the log-softmax: the other tokens' scores are those of the model).
    A hypothesis at its length limit may only end now: its row holds EOS alone (the rest -inf). A sentence's k best
    candidates are among the k best of each of its beams, so beam search adds the beam scores to these
    (sentences, beams * k) values only, not to all (sentences, beams * V). On CPU one C++ pass over the logits
    computes them (study/axes/kernels/log_softmax_topk.cpp: log_softmax's formula, its sum in another order)."""
    k = min(k, logits.shape[-1])
    wide = min(k + (0 if banned is None else banned.numel()), logits.shape[-1])  # k left once the banned are out
    ops = eager_cpu_ops("log_softmax_topk", logits)
    if ops is not None:
        values, tokens, row_max, row_logsum = ops.forward(logits, wide)
        eos_logp = (logits[:, eos].float() - row_max) - row_logsum
    else:
        logp = torch.log_softmax(logits.float(), dim=-1)  # (rows, V)
        values, tokens = logp.topk(wide, dim=-1)
        eos_logp = logp[:, eos]
    if banned is not None:
        values = values.masked_fill(torch.isin(tokens, banned), float("-inf"))
        order = values.sort(dim=-1, descending=True, stable=True).indices[:, :k]  # (a stable sort keeps ties' order)
        values, tokens = values.gather(-1, order), tokens.gather(-1, order)
    if not bool(at_limit.any()):
        return values, tokens, None
    only_eos = torch.full_like(values, float("-inf"))
    only_eos[:, 0] = eos_logp
    return (torch.where(at_limit[:, None], only_eos, values),
            torch.where(at_limit[:, None], torch.full_like(tokens, eos), tokens), at_limit & (tokens[:, 0] != eos))


class _Beams:
    """The live hypotheses of each sentence still searching: m sentences, b beams each (one at the first step, as
    all k would be the same BOS; then k), rows m*b in sentence order."""

    def __init__(self, k: int, sentence, scores, prefix, max_len):
        self.k = k  # the beam size
        self.sentence = sentence  # (m,) index of each searching sentence in the batch given to beam_search
        self.scores = scores  # (m, b) summed log-probs: float32, never bf16 (bf16-true)
        self.prefix = prefix  # (m*b, t + 1) BOS and the tokens so far
        self.max_len = max_len  # (m,)

    @classmethod
    def start(cls, n: int, k: int, bos: int, max_len: torch.Tensor) -> "_Beams":
        device = max_len.device
        scores = torch.zeros(n, 1, device=device, dtype=torch.float32)
        prefix = torch.full((n, 1), bos, dtype=torch.long, device=device)
        return cls(k, torch.arange(n, device=device), scores, prefix, max_len)

    def advance(self, logp, token_ids, finished: "_Finished", at_limit, t: int, eos: int, forced=None):
        """One step of fairseq's rule on each sentence's 2k best candidates: an EOS among the k best finishes a
        hypothesis (until the sentence holds k); the first k other candidates continue. A sentence with k finished
        hypotheses, at its length limit, or with no candidate left is done and leaves the batch. Returns the
        decoder rows each new hypothesis continues (m'*k,) and the sentences kept (m',), in place (None when all
        are), for _Decoder.reorder; None when every sentence is done. `forced` (m*b,): the rows whose EOS is forced
        at the length limit (_top_log_probs), None when there are none."""
        (m, beams), k = self.scores.shape, self.k
        per_beam = logp.shape[-1]  # each beam's best next tokens: logp, token_ids (m*b, per_beam)
        cand = (self.scores[:, :, None] + logp.view(m, beams, per_beam)).view(m, beams * per_beam)
        # 2k so that k survive even if k end in EOS (fewer only where the vocabulary is smaller than 2k)
        top_scores, top_ids = cand.topk(min(2 * k, cand.shape[1]), dim=1)  # (m, 2k)
        rows = torch.arange(m, device=cand.device)[:, None] * beams + top_ids // per_beam  # (m, 2k) rows of prefix
        tokens = token_ids.view(m, beams * per_beam).gather(1, top_ids)  # (m, 2k)
        # the old loop stopped at the first -inf candidate; topk sorts, so those are a suffix
        valid = top_scores > float("-inf")
        is_eos = tokens == eos
        ending = valid & is_eos & (torch.arange(top_ids.shape[1], device=cand.device) < k)
        finished.add(self.sentence, ending, top_scores, self.prefix, rows, t, forced)
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
        return index, (None if stay.numel() == m else stay)


class _Finished:
    """Finished hypotheses in tensors: up to k per sentence, in the order they finished, read once at the end."""

    def __init__(self, n: int, k: int, steps: int, eos: int, length_penalty: float, device):
        self.k, self.length_penalty = k, length_penalty
        self.count = torch.zeros(n, dtype=torch.long, device=device)  # (n,)
        self.scores = torch.full((n, k), float("-inf"), dtype=torch.float64, device=device)  # (n, k)
        self.tokens = torch.full((n, k, steps), eos, dtype=torch.long, device=device)  # (n, k, steps)
        self.lengths = torch.zeros(n, k, dtype=torch.long, device=device)  # (n, k)
        self.forced = torch.zeros(n, k, dtype=torch.bool, device=device)  # (n, k) ended by an EOS forced at the limit

    def add(self, sentence, ending, top_scores, prefix, rows, t: int, forced=None) -> None:
        """Store the candidates marked `ending` (m, 2k) in rank order, up to k per sentence; the hypothesis is
        the prefix without BOS (t tokens), its score normalised over t + 1 tokens (with the EOS). `forced` (rows of
        prefix,): whose EOS the length limit forced."""
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
        if forced is not None:
            self.forced[which, where] = forced[rows[ending]]
        self.count.index_add_(0, sentence, ending.sum(1))

    def best_slot(self) -> torch.Tensor:
        """(n, 1) where each sentence's best hypothesis is (the first of equal scores, as Python's max)."""
        return self.scores.argmax(1, keepdim=True)

    def best(self, best: torch.Tensor | None = None) -> list[list[int]]:
        """Each sentence's best hypothesis (at `best`: best_slot()), [] where none finished."""
        best = self.best_slot() if best is None else best  # (n, 1)
        tokens = self.tokens.gather(1, best[:, :, None].expand(-1, -1, self.tokens.shape[2]))[:, 0]  # (n, steps)
        lengths = torch.where(self.count > 0, self.lengths.gather(1, best)[:, 0], 0)
        return [row[:length] for row, length in zip(tokens.tolist(), lengths.tolist())]


@torch.no_grad()
def sample(
    model: DecoderLM, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Autoregressive sampling from a decoder-only model with the KV cache (temperature 0: greedy). One forward
    pass per new token (the prompt's, then each drawn token's but the last, which nothing reads), so a prompt of P
    tokens feeds positions 0..P + max_new_tokens - 2: a learned table of max_seq_len rows predicts up to
    max_seq_len - P + 1 tokens, as many as a full forward of max_seq_len tokens does."""
    cache = KVCache()
    logits = model(prompt, cache=cache)[:, -1]
    out = prompt
    for i in range(max_new_tokens):
        if i:  # the previous token's logits; the first come from the prompt
            logits = model(out[:, -1:], cache=cache)[:, -1]
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits.float() / temperature
            if top_k is not None:
                kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        out = torch.cat([out, nxt], dim=1)
    return out
