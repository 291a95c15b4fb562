"""BERT-style pretraining on WikiText-2: masked language modelling with next-sentence prediction on or off.

Documents are WikiText-2's articles (split at their ` = Title = ` headings), each cut into sentences (section
headings and blank lines dropped, WikiText's ` @-@ ` escapes undone, `<unk>` read as `[UNK]`). A WordPiece (or BPE)
vocabulary with `[PAD] [UNK] [CLS] [SEP] [MASK]` (ids 0-4) is trained on the training split.

Inputs (`task.seq_len` tokens at most, [CLS] and [SEP]s included):

- `model.nsp: true`, BERT's segment pairs (Devlin et al. 2018; `create_pretraining_data.py`): sentences of one
  document are packed up to the target length (10% of the time a shorter random one), cut at a random sentence
  boundary into A and B; half the time B is replaced by sentences from a *different* document (label 1, "random";
  0 is "B is the true continuation", Hugging Face's convention), and the unused sentences go back to be read
  again. `[CLS] A [SEP] B [SEP]`, segment ids 0 for A and 1 for B; the longer side is trimmed at a random end.
- `model.nsp: false`, RoBERTa's FULL-SENTENCES (Liu et al. 2019, section 4.2): whole sentences read contiguously,
  packed up to the length, crossing document boundaries with an extra [SEP]; one segment.

The pairs (and the document order of the packs) are rebuilt every epoch from (seed, epoch), and masking is dynamic
(drawn per batch from (seed, batch), as RoBERTa): `task.mlm_probability` (15%) of the non-special tokens are
selected; of those 80% become [MASK], 10% a random non-special token and 10% stay. The MLM loss is computed on the
selected positions only, with the output projection fused into the cross-entropy (`study.model.loss`), so the
(tokens, vocabulary) logits of the 85% unselected positions are never computed. Loss = MLM + NSP, as BERT's;
`task.nsp_weight` scales the NSP term.

The validation split is built once with fixed seeds, so every run is scored on the same inputs and masks (each
example masked from its own seed, whatever the batch size).
Final metrics: MLM loss / perplexity on the validation split, NSP loss / accuracy (with NSP), and the MLM loss of
the validation text in the FULL-SENTENCES format, which is the same input for a model trained with NSP or without.

The run directory also holds `tokenizer.json` (a Hugging Face `tokenizers` file), which GLUE fine-tuning reads
together with `model.pt` and `config.yaml` (`task.init_from: RUN_DIR`).
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from study.config import ExperimentConfig
from study.io import atomic_write
from study.model.loss import linear_cross_entropy
from study.tasks.base import StepIndexedBatches, StudyDataModule, StudyModule, seeded_generator
from study.tasks.families import Pretraining  # noqa: F401 - its declaration, importable from here too
from study.tasks.data import build_tokenizer, load_lm_corpus
from study.tasks.data.lm import is_wikitext_title

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD, UNK, CLS, SEP, MASK = range(5)
N_SPECIAL = len(SPECIALS)
IGNORE = -100
SHORT_SEQ_PROB = 0.1  # BERT: 10% of the pairs get a shorter random target length
TOKENIZER_FILE = "tokenizer.json"
VALID_SEED = 12345

_SENTENCE_END = re.compile(r"(?<= [.!?]) ")
_ESCAPES = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))


# --------------------------------------------------------------------------------------------------------------------
# documents


def wikitext_sentences(article: str) -> list[str]:
    """The sentences of one WikiText article (its title, section headings and blank lines dropped)."""
    out: list[str] = []
    for line in article.split("\n"):
        s = line.strip()
        if not s or is_wikitext_title(line) or (s.startswith("= ") and s.endswith(" =")):
            continue
        for a, b in _ESCAPES:
            s = s.replace(a, b)
        s = s.replace("<unk>", "[UNK]")
        out.extend(x.strip() for x in _SENTENCE_END.split(s) if x.strip())
    return out


# --------------------------------------------------------------------------------------------------------------------
# masking


def mask_tokens(
    ids: torch.Tensor, vocab_size: int, probability: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of a batch of ids (B, T): returns (inputs, labels). Tokens with ids >= N_SPECIAL are selected
    with `probability`; a selected token becomes [MASK] (80%), a random non-special token (10%) or stays (10%).
    labels hold the original id at selected positions and IGNORE elsewhere; specials are never selected."""
    maskable = ids >= N_SPECIAL
    selected = (torch.rand(ids.shape, generator=generator) < probability) & maskable
    labels = torch.where(selected, ids, torch.full_like(ids, IGNORE))
    action = torch.rand(ids.shape, generator=generator)
    random_ids = torch.randint(N_SPECIAL, vocab_size, ids.shape, generator=generator)
    inputs = torch.where(selected & (action < 0.8), torch.full_like(ids, MASK), ids)
    inputs = torch.where(selected & (action >= 0.8) & (action < 0.9), random_ids, inputs)
    return inputs, labels


# --------------------------------------------------------------------------------------------------------------------
# inputs


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """BERT's truncate_seq_pair: trim the longer side, from the front or the back at random."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def nsp_pairs(
    docs: Sequence[Sequence[Sequence[int]]], max_tokens: int, rng: random.Random, short_seq_prob: float = SHORT_SEQ_PROB
) -> list[tuple[list[int], list[int], int, int, int]]:
    """BERT's sentence-pair instances: (A, B, label, document of A, document of B), label 1 when B comes from
    another document. `docs` are lists of sentences (token ids); `max_tokens` excludes [CLS] and two [SEP]s."""
    if len(docs) < 2:
        raise ValueError("next-sentence prediction needs at least two documents")
    out = []
    for di, doc in enumerate(docs):
        target = max_tokens if rng.random() >= short_seq_prob else rng.randint(2, max_tokens)
        chunk: list[Sequence[int]] = []
        length, i = 0, 0
        while i < len(doc):
            chunk.append(doc[i])
            length += len(doc[i])
            if i == len(doc) - 1 or length >= target:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                a = [t for s in chunk[:a_end] for t in s]
                b: list[int] = []
                if len(chunk) == 1 or rng.random() < 0.5:
                    label = 1
                    other = rng.randrange(len(docs) - 1)
                    other += other >= di  # never the same document
                    rdoc = docs[other]
                    j = rng.randrange(len(rdoc))
                    while j < len(rdoc) and len(b) < max(1, target - len(a)):
                        b.extend(rdoc[j])
                        j += 1
                    i -= len(chunk) - a_end  # the sentences not used go back
                else:
                    label, other = 0, di
                    b = [t for s in chunk[a_end:] for t in s]
                _truncate_pair(a, b, max_tokens, rng)
                if a and b:
                    out.append((a, b, label, di, other))
                chunk, length = [], 0
                target = max_tokens if rng.random() >= short_seq_prob else rng.randint(2, max_tokens)
            i += 1
    rng.shuffle(out)
    return out


def full_sentences(docs: Sequence[Sequence[Sequence[int]]], max_tokens: int) -> list[list[int]]:
    """RoBERTa's FULL-SENTENCES packs: whole sentences read in order, packed up to `max_tokens` (which excludes
    [CLS] and the final [SEP]), crossing document boundaries with a [SEP]; a longer sentence is cut."""
    packs: list[list[int]] = []
    cur: list[int] = []
    for doc in docs:
        if cur and len(cur) < max_tokens:
            cur.append(SEP)  # document boundary
        for sent in doc:
            sent = list(sent)
            if cur and len(cur) + len(sent) > max_tokens:
                packs.append(cur)
                cur = []
            while len(sent) > max_tokens:
                packs.append(sent[:max_tokens])
                sent = sent[max_tokens:]
            cur.extend(sent)
    if cur:
        packs.append(cur)
    return [p[:-1] if p and p[-1] == SEP else p for p in packs]


def collate(examples: Sequence[tuple[list[int], list[int]]], labels: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """(ids, segment ids) examples padded to the longest; `labels` become nsp_labels."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), PAD, dtype=torch.long)
    types = torch.zeros((len(examples), width), dtype=torch.long)
    for k, (x, t) in enumerate(examples):
        ids[k, : len(x)] = torch.tensor(x, dtype=torch.long)
        types[k, : len(t)] = torch.tensor(t, dtype=torch.long)
    batch = {"input_ids": ids, "token_type_ids": types}
    if labels is not None:
        batch["nsp_labels"] = torch.tensor(list(labels), dtype=torch.long)
    return batch


def pair_example(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    return [CLS, *a, SEP, *b, SEP], [0] * (len(a) + 2) + [1] * (len(b) + 1)


def single_example(x: list[int]) -> tuple[list[int], list[int]]:
    return [CLS, *x, SEP], [0] * (len(x) + 2)


def masked_batch(batch: dict[str, torch.Tensor], vocab_size: int, probability: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return _with_masks(batch, *mask_tokens(batch["input_ids"], vocab_size, probability, generator))


def each_masked_alone(examples: Sequence[tuple[list[int], list[int]]], labels: Sequence[int] | None, first: int,
                      vocab_size: int, probability: float) -> dict[str, torch.Tensor]:
    """A batch whose example k is masked from (VALID_SEED, first + k) over its own tokens: its masks do not depend on
    which batch it is in, or on how wide that batch is padded (the batch size)."""
    batch = collate(examples, labels)
    inputs, targets = batch["input_ids"].clone(), torch.full_like(batch["input_ids"], IGNORE)
    for k, (ids, _) in enumerate(examples):
        x, y = mask_tokens(torch.tensor([ids]), vocab_size, probability, seeded_generator(VALID_SEED, first + k))
        inputs[k, : len(ids)], targets[k, : len(ids)] = x[0], y[0]
    return _with_masks(batch, inputs, targets)


def _with_masks(batch: dict[str, torch.Tensor], inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    # where the MLM head runs, as indices into the flattened (B*T) positions, found here on the host: selecting them
    # on the device with the boolean mask would make every training step wait for the device to count them
    positions = (labels.flatten() != IGNORE).nonzero().squeeze(1)
    out = {**batch, "input_ids": inputs, "labels": labels, "mlm_positions": positions}
    pad = batch["input_ids"] == PAD
    if bool(pad.any()):
        out["padding_mask"] = ~pad
    return out


# --------------------------------------------------------------------------------------------------------------------
# Lightning


class PretrainDataModule(StudyDataModule):
    def __init__(self, cfg: ExperimentConfig, data_dir: str | Path | None = None, cache_dir: str | Path | None = None):
        super().__init__(cfg)
        self.data_dir, self.cache_dir = data_dir, cache_dir
        self._epoch: tuple[int, Any] | None = None  # the examples of the epoch last read
        self._epoch_batches: dict[int, int] = {}  # batches per epoch, as learned

    @property
    def nsp(self) -> bool:
        return self.cfg.model.nsp

    def prepare(self) -> None:
        task = self.cfg.task
        corpus = load_lm_corpus(task.dataset, self.data_dir)
        if corpus.documents is None:
            raise ValueError(f"task.dataset: {task.dataset!r} has no document structure; pretraining needs documents")
        sentences = {s: [wikitext_sentences(d) for d in corpus.documents[s]] for s in ("train", "valid", "test")}
        fp = {"corpus": corpus.fingerprint, "name": corpus.name, "split": "train", "sentences": "wikitext_sentences/v1"}
        self.tokenizer = build_tokenizer(
            task.tokenizer, (s for doc in sentences["train"] for s in doc), task.vocab_size, SPECIALS,
            self.cache_dir, fp, lowercase=task.lowercase,
        )
        ids = [self.tokenizer.token_to_id(s) for s in SPECIALS]
        if ids != list(range(N_SPECIAL)):
            raise ValueError(f"tokenizer special ids {ids} are not {list(range(N_SPECIAL))}")
        self.docs = {split: self.encode_documents(docs) for split, docs in sentences.items()}
        if len(self.docs["train"]) < 2:
            raise ValueError("the training split has fewer than two documents")
        self.max_tokens = task.seq_len - 3 if self.nsp else task.seq_len - 2
        if self.max_tokens < 2:
            raise ValueError(f"task.seq_len={task.seq_len} leaves no room for text after [CLS]/[SEP]")
        self.valid_batches = self.eval_batches("valid", self.nsp)
        if (n := len(self._epoch_examples(0)[0])) < self.cfg.train.batch_size:  # now, not at the first batch of the fit
            raise ValueError(f"train.batch_size={self.cfg.train.batch_size} exceeds the {n} training examples of an "
                             "epoch")
        self.fingerprint = {
            **corpus.fingerprint, "tokenizer": self.tokenizer.key, "vocab_sha256": self.tokenizer.vocab_sha256,
            "documents": {k: len(v) for k, v in self.docs.items()},
            "tokens": {k: sum(len(s) for d in v for s in d) for k, v in self.docs.items()},
            "format": "segment-pair+nsp" if self.nsp else "full-sentences",
        }
        self.train_stream = StepIndexedBatches(self._train_batch)

    def encode_documents(self, docs: list[list[str]]) -> list[list[list[int]]]:
        flat = [s for d in docs for s in d]
        enc = self.tokenizer.encode_batch(flat)
        out, k = [], 0
        for d in docs:
            sents = [e for e in enc[k : k + len(d)] if e]
            k += len(d)
            if sents:
                out.append(sents)
        return out

    def model_overrides(self) -> dict[str, Any]:
        return {"vocab_size": self.tokenizer.vocab_size, "pad_token_id": PAD}

    def save_artifacts(self, run_dir: Path) -> None:
        """The tokenizer beside the weights, so fine-tuning finds both in the run directory."""
        atomic_write(Path(run_dir) / TOKENIZER_FILE, lambda p: self.tokenizer.tokenizer.save(str(p)))

    # --- examples ---------------------------------------------------------------------------------------------
    def examples(self, split: str, nsp: bool, rng: random.Random, shuffle_docs: bool = False):
        """[(ids, segment ids)] and NSP labels (None without NSP) for one pass over a split."""
        docs = self.docs[split]
        if nsp:
            pairs = nsp_pairs(docs, self.cfg.task.seq_len - 3, rng)
            return [pair_example(a, b) for a, b, *_ in pairs], [p[2] for p in pairs]
        if shuffle_docs:
            docs = list(docs)
            rng.shuffle(docs)
        packs = full_sentences(docs, self.cfg.task.seq_len - 2)
        if shuffle_docs:
            rng.shuffle(packs)
        return [single_example(p) for p in packs], None

    def _epoch_examples(self, epoch: int):
        if self._epoch is None or self._epoch[0] != epoch:
            rng = random.Random(self.cfg.train.seed * 1_000_003 + epoch)
            self._epoch = (epoch, self.examples("train", self.nsp, rng, shuffle_docs=True))
        return self._epoch[1]

    def _train_batch(self, i: int) -> dict[str, torch.Tensor]:
        bs = self.cfg.train.batch_size
        epoch, pos = 0, i
        while True:  # epochs differ in size by a few examples; walk to the one holding batch i
            if epoch not in self._epoch_batches:
                n = len(self._epoch_examples(epoch)[0]) // bs
                if n == 0:
                    raise ValueError(f"train.batch_size={bs} exceeds the {len(self._epoch_examples(epoch)[0])} "
                                     "training examples")
                self._epoch_batches[epoch] = n
            if pos < self._epoch_batches[epoch]:
                break
            pos -= self._epoch_batches[epoch]
            epoch += 1
        examples, labels = self._epoch_examples(epoch)
        sl = slice(pos * bs, (pos + 1) * bs)
        batch = collate(examples[sl], labels[sl] if labels is not None else None)
        return masked_batch(batch, self.tokenizer.vocab_size, self.cfg.task.mlm_probability,
                            seeded_generator(self.cfg.train.seed, i))

    def eval_batches(self, split: str, nsp: bool) -> list[dict[str, torch.Tensor]]:
        """Fixed inputs and masks for a split: the same for every run with this data, seq_len and mlm_probability,
        whatever its batch size (each example masked alone)."""
        examples, labels = self.examples(split, nsp, random.Random(VALID_SEED))
        bs, vocab, p = self.cfg.train.batch_size, self.tokenizer.vocab_size, self.cfg.task.mlm_probability
        return [each_masked_alone(examples[k : k + bs], None if labels is None else labels[k : k + bs], k, vocab, p)
                for k in range(0, len(examples), bs)]

    def val_dataloader(self):
        return self._loader(self.valid_batches, batch_size=None)


class PretrainModule(StudyModule):
    def unused_heads(self) -> tuple[str, ...]:
        return () if self.cfg.model.nsp else ("pooler.",)  # the pooler feeds only the NSP head

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = self.forward_model(batch["input_ids"], token_type_ids=batch["token_type_ids"], padding_mask=batch.get("padding_mask"))
        positions = batch["mlm_positions"]  # (N,) indices into the B*T positions: the masked ones
        head = self.model.mlm_head
        selected = h.flatten(0, 1).index_select(0, positions)  # (N, C)
        z = head.norm(head.activation(head.dense(selected)))  # the MLM head on the masked positions only
        proj = head.decoder.proj
        n = positions.numel()  # (a shape: known on the host without waiting for the device)
        targets = batch["labels"].flatten().index_select(0, positions)
        # a batch with nothing masked (a short last batch can draw none) has no MLM loss: 0, not the NaN of a mean
        # over nothing, which would stop training as diverged and poison an evaluation's mean
        mlm_loss = linear_cross_entropy(z, proj.weight, targets, proj.bias) if n else h.sum() * 0.0
        out = {"mlm_loss": mlm_loss, "mlm_count": n}
        if "nsp_labels" in batch and self.model.nsp_head is not None:
            logits = self.model.nsp_logits(h).float()
            out["nsp_loss"] = F.cross_entropy(logits, batch["nsp_labels"])
            out["nsp_correct"] = (logits.argmax(-1) == batch["nsp_labels"]).sum()
        out["loss"] = out["mlm_loss"] + self.cfg.task.nsp_weight * out.get("nsp_loss", 0.0)
        return out

    @staticmethod
    def _real_tokens(batch) -> torch.Tensor | int:
        """The batch's non-padding tokens (a tensor: the ledger reads it at logging steps)."""
        return (batch["input_ids"] != PAD).sum() if "padding_mask" in batch else batch["input_ids"].numel()

    def training_loss(self, batch) -> tuple[torch.Tensor, int]:
        out = self.losses(batch)
        self.step_logs["train/mlm_loss"] = out["mlm_loss"].detach()
        if "nsp_loss" in out:
            self.step_logs["train/nsp_loss"] = out["nsp_loss"].detach()
            self.step_logs["train/nsp_acc"] = out["nsp_correct"].float() / len(batch["nsp_labels"])
        return out["loss"], self._real_tokens(batch)

    def validation_step(self, batch, batch_idx: int) -> None:
        out = self.losses(batch)
        n = out["mlm_count"]
        if n:  # (weighted by masked tokens: a batch with none has no MLM loss to count)
            self.log("val/loss", out["loss"], prog_bar=True, batch_size=n, sync_dist=True)
            self.log("val/mlm_loss", out["mlm_loss"], batch_size=n, sync_dist=True)
        if "nsp_loss" in out:
            b = len(batch["nsp_labels"])
            self.log("val/nsp_acc", out["nsp_correct"].float() / b, batch_size=b, sync_dist=True)

    @torch.no_grad()
    def evaluate(self, batches) -> dict[str, float]:
        """MLM loss over every selected token; NSP loss and accuracy over every pair."""
        self.model.eval()
        mlm_sum, mlm_n, nsp_sum, nsp_correct, nsp_n = 0.0, 0, 0.0, 0, 0
        for batch in batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self.precision_context():
                out = self.losses(batch)
            n = out["mlm_count"]
            mlm_sum += float(out["mlm_loss"]) * n
            mlm_n += n
            if "nsp_loss" in out:
                b = len(batch["nsp_labels"])
                nsp_sum += float(out["nsp_loss"]) * b
                nsp_correct += int(out["nsp_correct"])
                nsp_n += b
        res = {"mlm_loss": mlm_sum / max(1, mlm_n), "masked_tokens": mlm_n}
        res["mlm_ppl"] = math.exp(res["mlm_loss"])
        if nsp_n:
            res.update(nsp_loss=nsp_sum / nsp_n, nsp_accuracy=nsp_correct / nsp_n, nsp_pairs=nsp_n)
        return res

    def final_metrics(self, dm: PretrainDataModule) -> dict[str, Any]:
        """The whole validation split (fixed pairs/packs and masks), and the MLM loss of the validation text in
        the FULL-SENTENCES format, the same input for a model trained with NSP or without."""
        out: dict[str, Any] = {f"valid_{k}": v for k, v in self.evaluate(dm.valid_batches).items()}
        if dm.nsp:
            out["valid_mlm_loss_full_sentences"] = self.evaluate(dm.eval_batches("valid", nsp=False))["mlm_loss"]
        else:
            out["valid_mlm_loss_full_sentences"] = out["valid_mlm_loss"]
        out["format"] = "segment-pair+nsp" if dm.nsp else "full-sentences"
        return out
