"""Causal language modelling: WikiText-2 (word level) and Tiny Shakespeare (character level).

Training batches are random windows of the training stream (as nanoGPT samples
them). Evaluation is perplexity over non-overlapping windows of the whole split,
at the training length and at multiples of it (length extrapolation; Press et al.
2022 evaluate ALiBi this way). A scheme with a fixed position table (learned) is
reported as not applicable beyond `max_seq_len`, not crashed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from study.config import ExperimentConfig
from study.model.positions import POSITIONS
from study.tasks.base import StepIndexedBatches, StudyDataModule, StudyModule, seeded_generator
from study.tasks.data import build_lm_tokenizer, load_lm_corpus

NOT_APPLICABLE = "n/a"


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
        for split in ("train", "valid", "test"):
            text = corpus.splits[split]
            if task.tokenizer == "char":
                ids = self.tokenizer.encode(text)
            else:
                ids = [i for line in self.tokenizer.encode_batch(text.splitlines(keepends=True)) for i in line]
            self.ids[split] = torch.tensor(ids, dtype=torch.long)
        if len(self.ids["train"]) <= task.seq_len:
            raise ValueError(f"task.seq_len={task.seq_len} is not shorter than the {task.dataset} training split "
                             f"({len(self.ids['train'])} tokens)")
        self.fingerprint = {**corpus.fingerprint, "tokenizer": self.tokenizer.key, "tokens": {k: len(v) for k, v in self.ids.items()}}
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
        loss = F.cross_entropy(self.net(x).flatten(0, 1).float(), y.flatten(), label_smoothing=smoothing)
        return loss, y.numel()

    def validation_loss(self, batch) -> tuple[torch.Tensor, int]:
        x, y = batch
        return F.cross_entropy(self.net(x).flatten(0, 1).float(), y.flatten()), y.numel()

    @torch.no_grad()
    def split_loss(self, batches) -> float:
        """Mean next-token negative log-likelihood (nats) over every token of the batches."""
        self.model.eval()
        total, count = 0.0, 0
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with self.precision_context():
                logits = self.net(x)
            total += float(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum"))
            count += y.numel()
        return total / max(count, 1)

    def final_metrics(self, dm: LMDataModule) -> dict[str, Any]:
        """Validation and test loss/perplexity at the training length, and perplexity at each
        multiple of it (length extrapolation)."""
        cfg = self.cfg
        out: dict[str, Any] = {}
        t = cfg.task.seq_len
        for split in ("valid", "test"):
            if split == "test" and torch.equal(dm.ids["test"], dm.ids["valid"]):
                loss = out["valid_loss"]  # Tiny Shakespeare has no test split: it reuses valid
            else:
                loss = self.split_loss(dm.windows(split, t))
            out[f"{split}_loss"] = loss
            out[f"{split}_ppl"] = math.exp(loss)
        extrapolates = POSITIONS[cfg.model.position].extrapolates
        curve = {}
        for k in cfg.task.eval_lengths:
            length = k * t
            if k == 1:
                curve[str(length)] = out["test_ppl"]
            elif not extrapolates and length > cfg.model.max_seq_len:
                curve[str(length)] = NOT_APPLICABLE
            else:
                curve[str(length)] = math.exp(self.split_loss(dm.windows("test", length)))
        out["test_ppl_by_length"] = curve
        return out

