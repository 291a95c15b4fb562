"""Language-modelling corpora: WikiText-2 (word level, `<unk>` version) and Tiny Shakespeare (character level)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from study.tasks.data.errors import DataError
from study.tasks.data.sources import (
    DatasetSource,
    HubUnavailable,
    LocalFile,
    LocalFiles,
    hub_fingerprint,
    hub_load_dataset,
    load_from_sources,
    local_fingerprint,
    read_text,
    require_keys,
    split_lines,
)

LM_CORPORA = ("wikitext-2", "tinyshakespeare")
LM_SPLITS = ("train", "valid", "test")
# the evaluation splits each corpus has (Tiny Shakespeare: nanoGPT's 90/10 cut, no test split)
EVAL_SPLITS = {"wikitext-2": ("valid", "test"), "tinyshakespeare": ("valid",)}

WIKITEXT2 = DatasetSource(
    name="wikitext-2",
    subdirs=("wikitext-2", "wikitext-2-v1"),
    hub_id="Salesforce/wikitext",
    hub_config="wikitext-2-v1",
)
WIKITEXT2_FILES = {
    split: LocalFile(
        display=f"{split}.txt.gz" if split == "train" else f"{split}.txt",
        candidates=(
            f"{split}.txt.gz",
            f"{split}.txt",
            f"wiki.{split}.tokens",
            f"wiki.{split}.tokens.gz",
        ),
    )
    for split in LM_SPLITS
}

TINYSHAKESPEARE = DatasetSource(
    name="tinyshakespeare",
    subdirs=("tinyshakespeare", "tiny_shakespeare"),
    hub_id="karpathy/tiny_shakespeare",
)
TINYSHAKESPEARE_FILES = {"input": LocalFile(display="input.txt", candidates=("input.txt", "input.txt.gz"))}
TINYSHAKESPEARE_TRAIN_FRACTION = 0.9


@dataclass(frozen=True)
class LMCorpus:
    """A language-modelling corpus as plain text.

    Fields:
      name: "wikitext-2" or "tinyshakespeare".
      splits: {"train", "valid"[, "test"]} -> the split's full text (lines end with "\\n"); Tiny Shakespeare has
        no test split.
      documents: WikiText-2 only: split -> list of articles, each the text of its lines (heading included), so
        `"".join(documents[s]) == splits[s]`; blank lines before the first heading belong to the first article.
        None for Tiny Shakespeare.
      fingerprint: where the data came from (see `study.tasks.data.sources`).
      level: "word" (WikiText-2: already tokenized, split on whitespace, closed vocabulary) or "char".
      unk_token: the corpus' own unknown-word token ("<unk>" for WikiText-2), else None.
    """

    name: str
    splits: dict[str, str]
    fingerprint: dict[str, Any]
    documents: dict[str, list[str]] | None = None
    level: str = "word"
    unk_token: str | None = None
    notes: str = field(default="", compare=False)

    @property
    def train(self) -> str:
        return self.splits["train"]

    @property
    def valid(self) -> str:
        return self.splits["valid"]

    @property
    def test(self) -> str:
        if "test" not in self.splits:
            raise KeyError(f"{self.name} has no test split (only {sorted(self.splits)})")
        return self.splits["test"]

    def lines(self, split: str) -> list[str]:
        """The split's lines without their newline."""
        return split_lines(self.splits[split])

    def num_words_with_eos(self, split: str) -> int:
        """Whitespace tokens plus one end-of-line token per line (the usual WikiText token count)."""
        return sum(len(line.split()) + 1 for line in self.lines(split))


def is_wikitext_title(line: str) -> bool:
    """True for a line shaped as a top-level heading ` = Title = ` (not ` = = Section = = `); table rows and formula
    lines inside articles can have that shape too (`wikitext_title_at` tells them apart)."""
    s = line.strip()
    return (
        len(s) >= 5
        and s.startswith("= ")
        and s.endswith(" =")
        and not s.startswith("= =")
        and not s.endswith("= =")
    )


def wikitext_title_at(lines: Sequence[str], i: int) -> bool:
    """Whether lines[i] opens an article: title-shaped, with a blank line before it (or none) and after it, and no
    title-shaped row after that blank. Inside articles some table legends (` = Goals ; A = `) and formula lines have
    the title's shape but sit between text lines or in a run of such rows; with this rule WikiText-2 splits into its
    600 / 60 / 60 articles (the shape alone gives 629 / 60 / 62)."""
    def blank(j: int) -> bool:
        return not 0 <= j < len(lines) or not lines[j].strip()

    return (is_wikitext_title(lines[i]) and (i == 0 or blank(i - 1)) and i + 1 < len(lines) and blank(i + 1)
            and not (i + 2 < len(lines) and is_wikitext_title(lines[i + 2])))


def _lines_keepends(text: str) -> list[str]:
    """Lines split on "\n" only, each keeping its newline."""
    parts = text.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def split_wikitext_documents(text: str) -> list[str]:
    """Split WikiText text into articles at their titles (`wikitext_title_at`). `"".join(result) == text`."""
    lines = _lines_keepends(text)
    starts = [i for i in range(len(lines)) if wikitext_title_at(lines, i)]
    bounds = [0, *starts[1:], len(lines)]  # text before the first title joins the first article
    return ["".join(lines[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def read_corpus_text(path: Path) -> tuple[str, str]:
    """A corpus file's text as published (LF line ends, no byte-order mark) and the sha256 of the file on disk.

    A copy saved with CRLF line ends or a BOM (an editor, git's autocrlf on Windows) would otherwise be a different
    corpus without a word said: every "\r" a character of Tiny Shakespeare's vocabulary and stream (40,000 more
    characters), a byte-level BPE token in WikiText-2; the hub copy has neither."""
    text, digest = read_text(path, bom=True)
    return text.replace("\r\n", "\n"), digest


def _wikitext_local(local: LocalFiles) -> LMCorpus:
    splits, digests = {}, {}
    for split in LM_SPLITS:
        path = local.found[split]
        text, digest = read_corpus_text(path)
        if text and not text.endswith("\n"):
            text += "\n"
        splits[split] = text
        digests[path] = digest
    return _wikitext_corpus(splits, local_fingerprint(WIKITEXT2.name, local, digests))


def _wikitext_hub(revision: str) -> LMCorpus:
    ds = hub_load_dataset(WIKITEXT2.hub_id, WIKITEXT2.hub_config, revision)
    names = {"train": "train", "valid": "validation", "test": "test"}
    splits = {}
    for split, hub_split in names.items():
        if hub_split not in ds:
            raise HubUnavailable(f"{WIKITEXT2.hub_id}: no split {hub_split!r}")
        require_keys(ds[hub_split].column_names, ["text"], WIKITEXT2.hub_id)
        # The hub has one row per line of wiki.*.tokens, with "\n" kept, except that blank lines (" " in the
        # file) are empty strings. Rebuild the original file text.
        out = []
        for row in ds[hub_split]["text"]:
            row = row[:-1] if row.endswith("\n") else row
            out.append((row if row else " ") + "\n")
        splits[split] = "".join(out)
    return _wikitext_corpus(splits, hub_fingerprint(WIKITEXT2, revision))


def _wikitext_corpus(splits: dict[str, str], fingerprint: dict) -> LMCorpus:
    documents = {s: split_wikitext_documents(t) for s, t in splits.items()}
    return LMCorpus(
        name="wikitext-2",
        splits=splits,
        fingerprint=fingerprint,
        documents=documents,
        level="word",
        unk_token="<unk>",
        notes="WikiText-2 v1 (tokenized, rare words replaced by <unk>).",
    )


def _tinyshakespeare_corpus(text: str, fingerprint: dict) -> LMCorpus:
    if not text:
        raise DataError("tinyshakespeare: the corpus is empty")
    cut = int(len(text) * TINYSHAKESPEARE_TRAIN_FRACTION)
    valid = text[cut:]
    return LMCorpus(
        name="tinyshakespeare",
        splits={"train": text[:cut], "valid": valid},
        fingerprint={**fingerprint, "split": "first 90% train, last 10% valid (nanoGPT); no test split"},
        documents=None,
        level="char",
        unk_token=None,
        notes="No official split: first 90% of characters train, last 10% valid (nanoGPT); no test split.",
    )


def _tinyshakespeare_local(local: LocalFiles) -> LMCorpus:
    path = local.found["input"]
    text, digest = read_corpus_text(path)
    return _tinyshakespeare_corpus(text, local_fingerprint(TINYSHAKESPEARE.name, local, {path: digest}))


def _tinyshakespeare_hub(revision: str) -> LMCorpus:
    ds = hub_load_dataset(TINYSHAKESPEARE.hub_id, None, revision)
    # The hub copy is the same text cut 90/5/5 into train/validation/test, one row each; re-join it and apply the
    # nanoGPT split so that both sources give identical splits.
    parts = []
    for hub_split in ("train", "validation", "test"):
        if hub_split not in ds:
            raise HubUnavailable(f"{TINYSHAKESPEARE.hub_id}: no split {hub_split!r}")
        require_keys(ds[hub_split].column_names, ["text"], TINYSHAKESPEARE.hub_id)
        parts.extend(ds[hub_split]["text"])
    return _tinyshakespeare_corpus("".join(parts), hub_fingerprint(TINYSHAKESPEARE, revision))


def load_lm_corpus(name: str, data_dir: str | os.PathLike[str] | None = None) -> LMCorpus:
    """Load a language-modelling corpus.

    name:
      "wikitext-2": WikiText-2 v1 (tokenized, `<unk>` version). Local files: `wikitext-2/train.txt.gz`,
        `valid.txt`, `test.txt` (the PyTorch word-language-model names; `wiki.{split}.tokens[.gz]` also accepted).
        Hub: `Salesforce/wikitext`, config `wikitext-2-v1`. `documents` gives the articles of each split.
      "tinyshakespeare": Karpathy's `input.txt`. It has no official split: train is the first 90% of the
        characters and valid the last 10% (nanoGPT's split); **there is no test split** (a test number would be the
        validation split under another name).
        Hub: `karpathy/tiny_shakespeare` (its three splits are re-joined, then split as above).

    data_dir: local data folder (else `$STUDY_DATA_DIR`, else the hub). Raises DatasetUnavailable if no source works,
    MalformedDataError for unreadable files.
    """
    key = name.strip().lower().replace("_", "-")
    if key in ("wikitext-2", "wikitext2", "wikitext-2-v1"):
        return load_from_sources(WIKITEXT2, WIKITEXT2_FILES, data_dir, _wikitext_local, _wikitext_hub)
    if key in ("tinyshakespeare", "tiny-shakespeare", "shakespeare"):
        return load_from_sources(
            TINYSHAKESPEARE, TINYSHAKESPEARE_FILES, data_dir, _tinyshakespeare_local, _tinyshakespeare_hub
        )
    raise DataError(f"unknown language-modelling corpus {name!r}; choose one of {list(LM_CORPORA)}")


__all__ = ["LMCorpus", "LM_CORPORA", "load_lm_corpus", "split_wikitext_documents", "is_wikitext_title"]
