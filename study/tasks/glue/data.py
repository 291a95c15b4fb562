"""GLUE inputs: `[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]` with segment ids 0/1, truncated longest-first to
`task.seq_len`, and the DataModule of one GLUE task (length-grouped training batches, length-sorted evaluation)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from study.config import ExperimentConfig
from study.io import atomic_write
from study.record import started_from
from study.tasks.base import StepIndexedBatches, StudyDataModule, length_grouped_batches, seeded_generator, spread_order
from study.tasks.data import GlueTaskInfo, TrainedTokenizer, build_tokenizer, glue_task_info, load_glue
from study.tasks.glue.pretrained import pretrained_config, pretrained_tokenizer
from study.tasks.pretrain import CLS, PAD, SEP, SPECIALS, TOKENIZER_FILE


def encode_example(tok: TrainedTokenizer, a: str, b: str | None, seq_len: int) -> tuple[list[int], list[int]]:
    """[CLS] a [SEP] (b [SEP]) with segment ids, the longer text trimmed from its end until it fits (BERT's
    run_classifier.py: _truncate_seq_pair)."""
    ids, types, _ = encode_and_count(tok, a, b, seq_len)
    return ids, types


def encode_and_count(tok: TrainedTokenizer, a: str, b: str | None, seq_len: int) -> tuple[list[int], list[int], bool]:
    """encode_example, and whether the example was cut to fit."""
    ids_a = tok.encode(a)
    if b is None:
        cut = len(ids_a) > seq_len - 2
        ids_a = ids_a[: seq_len - 2]
        return [CLS, *ids_a, SEP], [0] * (len(ids_a) + 2), cut
    ids_b = tok.encode(b)
    cut = len(ids_a) + len(ids_b) > seq_len - 3
    while len(ids_a) + len(ids_b) > seq_len - 3:
        (ids_a if len(ids_a) > len(ids_b) else ids_b).pop()
    return [CLS, *ids_a, SEP, *ids_b, SEP], [0] * (len(ids_a) + 2) + [1] * (len(ids_b) + 1), cut


def collate(examples: Sequence[tuple[list[int], list[int]]], labels: Sequence | None, regression: bool) -> dict[str, torch.Tensor]:
    width = max(len(x) for x, _ in examples)
    ids = torch.full((len(examples), width), PAD, dtype=torch.long)
    types = torch.zeros((len(examples), width), dtype=torch.long)
    for k, (x, t) in enumerate(examples):
        ids[k, : len(x)] = torch.tensor(x)
        types[k, : len(t)] = torch.tensor(t)
    batch = {"input_ids": ids, "token_type_ids": types}
    if bool((ids == PAD).any()):
        batch["padding_mask"] = ids != PAD
    if labels is not None:
        batch["labels"] = torch.tensor(list(labels), dtype=torch.float32 if regression else torch.long)
    return batch


class GlueDataModule(StudyDataModule):
    def __init__(self, cfg: ExperimentConfig, data_dir: str | Path | None = None, cache_dir: str | Path | None = None):
        super().__init__(cfg)
        self.data_dir, self.cache_dir = data_dir, cache_dir
        self.info: GlueTaskInfo = glue_task_info(cfg.task.dataset)
        self._epoch: tuple[int, list[list[int]]] | None = None  # (epoch, its batches), built on first use

    def prepare(self) -> None:
        task = self.cfg.task
        if task.dataset == "glue":
            raise ValueError("task.dataset: 'glue' is a suite of runs, one per task: run the experiment, not this "
                             "DataModule")
        self.data = load_glue(self.info.name, self.data_dir)
        if task.init_from:
            pretrained_config(task.init_from)
            self.tokenizer = pretrained_tokenizer(task.init_from)
            origin = {**started_from(task.init_from), "pretrained_weights": task.pretrained_weights}
        else:
            self.tokenizer = self._new_tokenizer(self.data)
            origin = {"init_from": None}
        counted = {split: [encode_and_count(self.tokenizer, e.text_a, e.text_b, task.seq_len) for e in examples]
                   for split, examples in self.data.splits.items()}
        self.encoded = {split: [(ids, types) for ids, types, _ in rows] for split, rows in counted.items()}
        # examples cut to task.seq_len, per split: what part of each split was scored on part of its text
        self.truncated = {split: sum(cut for _, _, cut in rows) for split, rows in counted.items()}
        self.labels = {split: [e.label for e in examples] for split, examples in self.data.splits.items()}
        self.n_train = len(self.encoded[self.info.train_split])
        if self.n_train == 0:
            raise ValueError(f"GLUE {self.info.name}: the training split is empty")
        self.fingerprint = {**self.data.fingerprint, "tokenizer": self.tokenizer.key,
                            "vocab_sha256": self.tokenizer.vocab_sha256, **origin,
                            "examples": {k: len(v) for k, v in self.encoded.items()},
                            "unavailable_splits": list(self.data.unavailable_splits)}
        self.train_stream = StepIndexedBatches(self._train_batch)

    def check(self) -> None:
        """From scratch, the task's tokenizer is trained here, into the cache its `prepare` reads back: a suite finds a
        vocabulary one task's text cannot fill (WNLI's 2,787 words) before its first part trains, not after every
        part before that task has. A pretrained tokenizer was checked when the config was resolved."""
        if self.cfg.task.init_from is None:
            self._new_tokenizer(load_glue(self.info.name, self.data_dir))

    def _new_tokenizer(self, data):
        task = self.cfg.task
        texts = [t for e in data[self.info.train_split] for t in (e.text_a, e.text_b) if t]
        fp = {"glue": data.fingerprint, "split": self.info.train_split}
        return build_tokenizer(task.tokenizer, texts, task.vocab_size, SPECIALS, self.cache_dir, fp,
                               lowercase=task.lowercase)

    def model_overrides(self) -> dict[str, Any]:
        return {"vocab_size": self.tokenizer.vocab_size, "pad_token_id": PAD}

    def save_artifacts(self, run_dir: Path) -> None:
        atomic_write(Path(run_dir) / TOKENIZER_FILE, lambda p: self.tokenizer.tokenizer.save(str(p)))

    def _train_batch(self, i: int) -> dict[str, torch.Tensor]:
        """Batch i of the training stream: length-grouped (GLUE sentences range from 3 to 128 tokens, so random
        batches padded to their longest are two-thirds padding on SST-2), reshuffled every epoch."""
        bs, split = self.cfg.train.batch_size, self.info.train_split
        epoch, pos = divmod(i, math.ceil(self.n_train / bs))
        if self._epoch is None or self._epoch[0] != epoch:
            lengths = [len(ids) for ids, _ in self.encoded[split]]
            self._epoch = (epoch, length_grouped_batches(lengths, bs, seeded_generator(self.cfg.train.seed, -1 - epoch)))
        idx = self._epoch[1][pos]
        return collate([self.encoded[split][j] for j in idx], [self.labels[split][j] for j in idx], self.info.is_regression)

    def batches(self, split: str, batch_size: int = 128, with_labels: bool = True) -> tuple[list[dict], list[int]]:
        """Length-sorted batches of a split and the order they hold the examples in."""
        enc = self.encoded[split]
        order = sorted(range(len(enc)), key=lambda j: len(enc[j][0]))
        labels = self.labels[split]
        out = []
        for k in range(0, len(order), batch_size):
            chunk = order[k : k + batch_size]
            out.append(collate([enc[j] for j in chunk], [labels[j] for j in chunk] if with_labels else None,
                               self.info.is_regression))
        return out, order

    def val_dataloader(self):
        batches = spread_order(self.batches(self.info.eval_splits[0], self.cfg.train.batch_size)[0])
        return self._loader(batches, batch_size=None)  # (train.eval_batches: a sample of the dev set, not its shortest)
