"""Translation: Multi30k (De<->En) with an encoder-decoder, scored with sacreBLEU.

Training batches are sentences grouped by length (shuffled batch order per epoch),
teacher forcing with label smoothing (Szegedy et al. 2016; Vaswani et al. 2017 use
0.1). Test sets are decoded with beam search on the KV cache, detokenized, and
scored with sacreBLEU (BLEU and chrF on detokenized text, cased unless task.lowercase); the
signature is stored with each score so numbers are comparable across papers (Post 2018).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import sacrebleu
import torch
import torch.nn.functional as F

from study.axes import POSITIONS
from study.config import ExperimentConfig
from study.io import atomic_write_text
from study.model.generate import beam_search, greedy_decode
from study.tasks.base import StepIndexedBatches, StudyDataModule, StudyModule, seeded_generator, spread_order
from study.tasks.families import Translation  # noqa: F401 - its declaration, importable from here too
from study.tasks.data import build_translation_tokenizers, load_translation

log = logging.getLogger(__name__)


SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
PAD, BOS, EOS = 0, 1, 2
IGNORE = -100


def pad_batch(seqs: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(seqs), max(len(s) for s in seqs)), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate(pairs: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    src = pad_batch([s for s, _ in pairs])
    tgt = pad_batch([t for _, t in pairs])
    labels = tgt[:, 1:].clone()
    labels[labels == PAD] = IGNORE
    return {"src": src, "src_mask": src != PAD, "tgt_in": tgt[:, :-1], "labels": labels}


class TranslationDataModule(StudyDataModule):
    def __init__(self, cfg: ExperimentConfig, data_dir: str | Path | None = None, cache_dir: str | Path | None = None):
        super().__init__(cfg)
        self.data_dir, self.cache_dir = data_dir, cache_dir
        self.truncated: dict[str, int] = {}  # split -> pairs with a side cut to task.seq_len

    def prepare(self) -> None:
        task = self.cfg.task
        self.corpus = load_translation(task.dataset, task.src_lang, task.tgt_lang, self.data_dir,
                                       needed=("train", "valid", *task.test_sets))
        missing = [s for s in task.test_sets if s not in self.corpus.splits]
        if missing:
            raise ValueError(f"task.test_sets: {missing} not in {task.dataset}; available: {sorted(self.corpus.splits)}")
        self.src_tok, self.tgt_tok = build_translation_tokenizers(
            task.tokenizer, self.corpus, task.vocab_size, SPECIALS, self.cache_dir, joint=task.joint_vocab,
            lowercase=task.lowercase,
        )
        for tok in {id(self.src_tok): self.src_tok, id(self.tgt_tok): self.tgt_tok}.values():
            ids = [tok.token_to_id(s) for s in SPECIALS[:3]]
            if ids != [PAD, BOS, EOS]:
                raise ValueError(f"tokenizer special ids {ids} are not [pad, bos, eos] = [0, 1, 2]")
        self.encoded = {split: self.encode(split) for split in ("train", "valid")}
        self._batches = self._length_grouped(self.encoded["train"], self.cfg.train.batch_size)
        self.fingerprint = {**self.corpus.fingerprint, "tokenizer": [self.src_tok.key, self.tgt_tok.key],
                            "vocab_sha256": [self.src_tok.vocab_sha256, self.tgt_tok.vocab_sha256]}
        self.train_stream = StepIndexedBatches(self._train_batch)

    def encode(self, split: str) -> list[tuple[list[int], list[int]]]:
        """(source ids, BOS + target ids [+ EOS]) per pair, each side cut to task.seq_len tokens. A cut target gets
        no EOS: "BOS + first n tokens + EOS" would teach the model to end a sentence where the cut fell. How many
        pairs were cut is kept in `truncated[split]` (written into the metrics)."""
        n = self.cfg.task.seq_len
        src = self.src_tok.encode_batch(self.corpus.sources(split))
        tgt = self.tgt_tok.encode_batch(self.corpus.targets(split))
        self.truncated[split] = sum(len(s) > n or len(t) > n for s, t in zip(src, tgt))
        return [(s[:n], [BOS] + t[:n] + ([EOS] if len(t) <= n else [])) for s, t in zip(src, tgt)]

    def model_overrides(self) -> dict[str, Any]:
        return {"vocab_size": max(self.src_tok.vocab_size, self.tgt_tok.vocab_size), "pad_token_id": PAD}

    @staticmethod
    def _length_grouped(pairs, batch_size: int) -> list[list[int]]:
        order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]) + len(pairs[i][1]), i))
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def _train_batch(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self._batches)
        epoch, pos = divmod(i, n)
        perm = torch.randperm(n, generator=seeded_generator(self.cfg.train.seed, -1 - epoch))
        return collate([self.encoded["train"][j] for j in self._batches[int(perm[pos])]])

    def val_dataloader(self):
        groups = spread_order(self._length_grouped(self.encoded["valid"], self.cfg.train.batch_size))
        return self._loader([collate([self.encoded["valid"][j] for j in b]) for b in groups], batch_size=None)


def decoder_sources(cfg: ExperimentConfig, dm: TranslationDataModule, sentences: list[str]) -> tuple[list, int]:
    """(token ids of each source, how many were cut) as a test set is translated: a source is cut only where the
    position scheme cannot address it (a learned table of model.max_seq_len rows), not at task.seq_len, else BLEU
    would score translations of part of it."""
    ids = dm.src_tok.encode_batch(sentences)
    limit = POSITIONS[cfg.model.position].max_positions(cfg.model)
    cut = 0 if limit is None else sum(len(s) > limit for s in ids)
    if cut:
        ids = [s[:limit] for s in ids]
        log.warning("%d of %d sources are longer than the %d positions model.position=%r addresses; cut to it",
                    cut, len(ids), limit, cfg.model.position)
    return ids, cut


class TranslationModule(StudyModule):
    output_paths = ("hypotheses",)

    def __init__(self, cfg: ExperimentConfig):
        super().__init__(cfg)
        self.hypotheses: dict[str, list[str]] = {}  # test set -> detokenized translations, in corpus order

    def save_outputs(self, run_dir: Path) -> None:
        """hypotheses/<test set>.<target language>: one detokenized translation per line, in the test set's order,
        so that the `sacrebleu` command line rescores the run (`sacrebleu REF -i HYP -m bleu chrf`)."""
        for split, hyps in self.hypotheses.items():
            text = "".join(h.replace("\n", " ") + "\n" for h in hyps)
            atomic_write_text(Path(run_dir) / "hypotheses" / f"{split}.{self.cfg.task.tgt_lang}", text)

    def training_loss(self, batch) -> tuple[torch.Tensor, int]:
        labels, smoothing = batch["labels"], self.cfg.train.label_smoothing
        if not self.cfg.train.compile:
            # fused with the output projection: no (tokens, vocab) logits, log-probabilities or smoothing terms
            loss = self.model.loss(batch["src"], batch["tgt_in"], labels, batch["src_mask"], IGNORE, smoothing)
        else:  # inductor fuses the plain path itself
            logits = self.forward_model(batch["src"], batch["tgt_in"], batch["src_mask"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                                   label_smoothing=smoothing)
        return loss, (labels != IGNORE).sum()  # a tensor: read at logging steps (study.tasks.ledger)

    def validation_loss(self, batch) -> tuple[torch.Tensor, int]:
        logits = self.forward_model(batch["src"], batch["tgt_in"], batch["src_mask"])
        labels = batch["labels"]
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE), int((labels != IGNORE).sum())

    @torch.no_grad()
    def split_validation_loss(self, dm: TranslationDataModule) -> float:
        """Mean token cross-entropy (nats, no label smoothing) of the model over the whole validation split, as
        `validation_loss` computes it per batch: the metric a tuning may choose by, since BLEU is measured on the
        test sets its seeds are then scored on."""
        self.model.eval()
        total, tokens = 0.0, 0
        for batch in dm.val_dataloader():
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self.precision_context():
                loss, n = self.validation_loss(batch)
            total, tokens = total + float(loss) * n, tokens + n
        return total / max(tokens, 1)

    @torch.no_grad()
    def translate(self, sentences: list[str], dm: TranslationDataModule, beam_size: int | None = None,
                  batch_size: int = 100, stats: dict | None = None) -> list[str]:
        """Detokenized translations, decoded in length-sorted batches; `stats` receives the largest KV cache a
        batch held (`kv_cache_bytes`, measured from the cache's tensors), how many sources were cut
        (`truncated_sources`), and how many translations ended at their length limit
        (`hypotheses_at_length_limit`, `length_capped_by_positions`: see study.model.generate). A source is cut
        only where the position scheme cannot address it (a learned table of model.max_seq_len rows), not at
        task.seq_len: a test sentence is translated whole, else BLEU would score translations of part of it."""
        task = self.cfg.task
        beam = task.beam_size if beam_size is None else beam_size
        self.model.eval()
        ids, cut = decoder_sources(self.cfg, dm, sentences)
        if stats is not None:  # this call's counts, to which generate adds each batch's
            stats.update(truncated_sources=cut, hypotheses_at_length_limit=0, length_capped_by_positions=0)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: list[list[int]] = [[] for _ in ids]
        with self.precision_context():
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                src = pad_batch([ids[i] or [EOS] for i in chunk]).to(self.device)
                mask = src != PAD
                kw = dict(bos=BOS, eos=EOS, max_len_a=task.max_len_a, max_len_b=task.max_len_b, stats=stats,
                          never=(PAD, BOS))  # never targets: emitted, they would be stripped, leaving holes
                if beam == 1:
                    hyps = greedy_decode(self.model, src, mask, **kw)
                else:
                    hyps = beam_search(self.model, src, mask, beam_size=beam, length_penalty=task.length_penalty, **kw)
                for i, h in zip(chunk, hyps):
                    out[i] = h
        return dm.tgt_tok.decode_batch(out)

    def final_metrics(self, dm: TranslationDataModule) -> dict[str, Any]:
        """sacreBLEU BLEU and chrF (detokenized, 13a; cased unless task.lowercase) on each test set, with signatures,
        and the validation loss (`valid_loss`)."""
        valid_loss = self.split_validation_loss(dm)
        results: dict[str, Any] = {}
        for split in self.cfg.task.test_sets:
            refs = dm.corpus.targets(split)
            started, stats = time.perf_counter(), {}
            hyps = self.translate(dm.corpus.sources(split), dm, stats=stats)
            seconds = time.perf_counter() - started
            self.hypotheses[split] = hyps
            # a lowercased model is scored case-insensitively, and the signature says so (case:lc)
            bleu = sacrebleu.metrics.BLEU(lowercase=self.cfg.task.lowercase)
            chrf = sacrebleu.metrics.CHRF(lowercase=self.cfg.task.lowercase)
            scores = (bleu.corpus_score(hyps, [refs]).score, chrf.corpus_score(hyps, [refs]).score)  # before the
            results[split] = {  # signatures, which name the number of references only once a corpus was scored
                "bleu": scores[0],
                "chrf": scores[1],
                "bleu_signature": str(bleu.get_signature()),
                "chrf_signature": str(chrf.get_signature()),
                "decode_seconds": seconds,
                "kv_cache_peak_bytes": stats.get("kv_cache_bytes"),
                "sentences": len(refs),
                "truncated_sources": stats["truncated_sources"],
                "hypotheses_at_length_limit": stats["hypotheses_at_length_limit"],
                "length_capped_by_positions": stats["length_capped_by_positions"],
                "examples": [{"source": s, "reference": r, "hypothesis": h}
                             for s, r, h in list(zip(dm.corpus.sources(split), refs, hyps))[:5]],
            }
        first = self.cfg.task.test_sets[0]
        return {"valid_loss": valid_loss, "bleu": results[first]["bleu"], "chrf": results[first]["chrf"],
                "test_sets": results,
                "truncated_pairs": dict(dm.truncated)}
