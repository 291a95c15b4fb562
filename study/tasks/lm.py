"""Causal language modelling: WikiText-2 (word level) and Tiny Shakespeare (character level).

Training batches are random windows of the training stream (as nanoGPT samples
them). Evaluation is perplexity over non-overlapping windows of each split the
corpus has, at the training length and at multiples of it (length extrapolation;
Press et al. 2022 evaluate ALiBi this way) on its last split (test, or valid for
Tiny Shakespeare, which has no test split: no metric calls validation "test").
A scheme with a fixed position table (learned) is reported as not applicable
beyond `max_seq_len`, not crashed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from study.axes import POSITIONS
from study.config import ExperimentConfig
from study.record import NOT_APPLICABLE
from study.tasks.base import StepIndexedBatches, StudyDataModule, StudyModule, seeded_generator
from study.tasks.families import LanguageModelling  # noqa: F401 - its declaration, importable from here too
from study.tasks.data import build_lm_tokenizer, load_lm_corpus
from study.tasks.data.sources import lines_with_ends

class LMDataModule(StudyDataModule):
    def __init__(self, cfg: ExperimentConfig, data_dir: str | Path | None = None, cache_dir: str | Path | None = None):
        super().__init__(cfg)
        self.data_dir, self.cache_dir = data_dir, cache_dir
        self.ids: dict[str, torch.Tensor] = {}

    def prepare(self) -> None:
        task = self.cfg.task
        corpus = load_lm_corpus(task.dataset, self.data_dir)
        options: dict[str, Any] = {"lowercase": task.lowercase}
        if task.tokenizer == "word":
            options["newline_token"] = "<eos>"  # the standard WikiText-2 setup: each line ends with <eos>
        self.tokenizer = build_lm_tokenizer(task.tokenizer, corpus, task.vocab_size, (), self.cache_dir, **options)
        for split, text in corpus.splits.items():
            if task.tokenizer == "char":
                ids = self.tokenizer.encode(text)
            else:
                ids = [i for line in self.tokenizer.encode_batch(lines_with_ends(text)) for i in line]
            self.ids[split] = torch.tensor(ids, dtype=torch.long)
        if len(self.ids["train"]) <= task.seq_len:
            raise ValueError(f"task.seq_len={task.seq_len} is not shorter than the {task.dataset} training split "
                             f"({len(self.ids['train'])} tokens)")
        for split in sorted(set(self.ids) - {"train"}):  # a truncated or empty file would score a perfect or no loss
            if len(self.ids[split]) <= task.seq_len:
                raise ValueError(f"the {task.dataset} {split} split holds {len(self.ids[split])} tokens, fewer than "
                                 f"one window of task.seq_len={task.seq_len} + 1 to evaluate; check its file "
                                 f"({self.data_dir or 'the hub copy'})")
        self.fingerprint = {**corpus.fingerprint, "tokenizer": self.tokenizer.key,
                            "vocab_sha256": self.tokenizer.vocab_sha256,
                            "tokens": {k: len(v) for k, v in self.ids.items()}}
        self.train_stream = StepIndexedBatches(self._train_batch)

    def model_overrides(self) -> dict[str, Any]:
        return {"vocab_size": self.tokenizer.vocab_size, "pad_token_id": 0}

    def _train_batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, b = self.cfg.task.seq_len, self.cfg.train.batch_size
        data = self.ids["train"]
        starts = torch.randint(0, len(data) - t, (b,), generator=seeded_generator(self.cfg.train.seed, i))
        idx = starts[:, None] + torch.arange(t + 1)
        window = data[idx]
        return window[:, :-1], window[:, 1:]

    def eval_token_count(self, split: str) -> int:
        """How many tokens an evaluation of `split` predicts (its first task.eval_tokens, or all of them)."""
        n = len(self.ids[split]) - 1
        return n if self.cfg.task.eval_tokens is None else min(n, self.cfg.task.eval_tokens)

    def windows(self, split: str, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Non-overlapping windows covering the split (or its first task.eval_tokens tokens; the
        last window shorter), batched to about batch_size * seq_len tokens."""
        data = self.ids[split]
        if self.cfg.task.eval_tokens is not None:
            data = data[: self.cfg.task.eval_tokens + 1]
        per_batch = max(1, self.cfg.train.batch_size * self.cfg.task.seq_len // length)
        n_full = (len(data) - 1) // length
        xs = data[: n_full * length].view(n_full, length)
        ys = data[1 : n_full * length + 1].view(n_full, length)
        batches = [(xs[i : i + per_batch], ys[i : i + per_batch]) for i in range(0, n_full, per_batch)]
        rest = len(data) - 1 - n_full * length
        if rest > 0:
            batches.append((data[n_full * length : -1][None], data[n_full * length + 1 :][None]))
        return batches

    def val_dataloader(self):
        return self._loader(self.windows("valid", self.cfg.task.seq_len), batch_size=None)


class LMModule(StudyModule):
    def training_loss(self, batch) -> tuple[torch.Tensor, int]:
        x, y = batch
        smoothing = self.cfg.train.label_smoothing
        if smoothing == 0 and self._compiled is None:
            return self.model.loss(x, y), y.numel()  # fused: no (tokens, vocab) logits in memory
        loss = F.cross_entropy(self.forward_model(x).flatten(0, 1).float(), y.flatten(), label_smoothing=smoothing)
        return loss, y.numel()

    def validation_loss(self, batch) -> tuple[torch.Tensor, int]:
        x, y = batch
        return F.cross_entropy(self.forward_model(x).flatten(0, 1).float(), y.flatten()), y.numel()

    @torch.no_grad()
    def split_loss(self, batches) -> float:
        """Mean next-token negative log-likelihood (nats) over every token of the batches."""
        self.model.eval()
        total, count = 0.0, 0
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with self.precision_context():
                logits = self.forward_model(x)
            total += float(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum"))
            count += y.numel()
        return total / max(count, 1)

    def final_metrics(self, dm: LMDataModule) -> dict[str, Any]:
        """Loss and perplexity at the training length on every evaluation split the corpus has (valid, and test
        where there is one), and on the last of them perplexity at each multiple of the training length (length
        extrapolation), named by that split: `test_ppl_by_length` on WikiText-2, `valid_ppl_by_length` on Tiny
        Shakespeare."""
        cfg = self.cfg
        out: dict[str, Any] = {}
        t = cfg.task.seq_len
        splits = [s for s in ("valid", "test") if s in dm.ids]
        for split in splits:
            loss = self.split_loss(dm.windows(split, t))
            out[f"{split}_loss"] = loss
            out[f"{split}_ppl"] = math.exp(loss)
        last = splits[-1]
        extrapolates = POSITIONS[cfg.model.position].extrapolates
        curve = {}
        for k in cfg.task.eval_lengths:
            length = k * t
            if k == 1:
                curve[str(length)] = out[f"{last}_ppl"]
            elif not extrapolates and length > cfg.model.max_seq_len:
                curve[str(length)] = NOT_APPLICABLE
            elif dm.eval_token_count(last) < length:  # not one window of that length: the label would not be true
                curve[str(length)] = NOT_APPLICABLE
            else:
                curve[str(length)] = math.exp(self.split_loss(dm.windows(last, length)))
        out[f"{last}_ppl_by_length"] = curve
        if str(2 * t) in curve:
            out[f"{last}_ppl_at_2x"] = curve[str(2 * t)]
        return out

