"""Translation corpora: Multi30k (Task 1, raw cased text) and WMT14 newstest2014 (SGML, for scoring only)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from study.config.task import MULTI30K_NOT_IN
from study.tasks.data.errors import DataError, MalformedDataError
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

MULTI30K_LANGS = ("en", "de", "fr", "cs")
# Split name -> file stem in the Multi30k release (`data/task1/raw/{stem}.{lang}.gz`).
MULTI30K_SPLITS = {
    "train": "train",
    "valid": "val",
    "test_2016_flickr": "test_2016_flickr",
    "test_2017_flickr": "test_2017_flickr",
    "test_2017_mscoco": "test_2017_mscoco",
    "test_2018_flickr": "test_2018_flickr",
}
MULTI30K_OPTIONAL_SPLITS = ("test_2018_flickr",)


def multi30k_splits(src: str, tgt: str) -> dict[str, str]:
    """Split -> file stem, for the splits the release has in both languages."""
    absent = {split for lang in (src, tgt) for split in MULTI30K_NOT_IN.get(lang, ())}
    return {split: stem for split, stem in MULTI30K_SPLITS.items() if split not in absent}

MULTI30K = DatasetSource(
    name="multi30k",
    subdirs=("multi30k",),
    hub_id="bentrevett/multi30k",
    hub_note="Note: the hub copy (bentrevett/multi30k) is en-de only and has train, valid and test_2016_flickr; "
    "the 2017/2018 test sets need the local files.",
)

NEWSTEST2014 = DatasetSource(
    name="wmt14-newstest2014",
    subdirs=("wmt14-newstest2014", "newstest2014", "wmt14"),
    hub_id="wmt/wmt14",
    hub_config="de-en",
)


@dataclass(frozen=True)
class TranslationCorpus:
    """Parallel text, raw (detokenized, cased).

    Fields:
      name: "multi30k" or "newstest2014".
      src, tgt: language codes.
      splits: split name -> list of (source sentence, target sentence) pairs. Multi30k: "train", "valid",
        "test_2016_flickr", "test_2017_flickr", "test_2017_mscoco" and, when present, "test_2018_flickr"
        (from the hub: only train, valid, test_2016_flickr). newstest2014: the single split "test".
      fingerprint: where the data came from (see `study.tasks.data.sources`).
    """

    name: str
    src: str
    tgt: str
    splits: dict[str, list[tuple[str, str]]]
    fingerprint: dict[str, Any]

    @property
    def train(self) -> list[tuple[str, str]]:
        return self.splits["train"]

    @property
    def valid(self) -> list[tuple[str, str]]:
        return self.splits["valid"]

    def sources(self, split: str) -> list[str]:
        return [s for s, _ in self.splits[split]]

    def targets(self, split: str) -> list[str]:
        return [t for _, t in self.splits[split]]

    def texts(self, split: str = "train", sides: tuple[str, ...] = ("src", "tgt")) -> Iterator[str]:
        """Sentences of one split, source side then target side (for tokenizer training)."""
        for side in sides:
            if side not in ("src", "tgt"):
                raise ValueError(f"side must be 'src' or 'tgt', not {side!r}")
            yield from (self.sources(split) if side == "src" else self.targets(split))


def _check_langs(src: str, tgt: str, allowed: tuple[str, ...], what: str) -> None:
    if src not in allowed or tgt not in allowed or src == tgt:
        raise DataError(f"{what}: src/tgt must be two different languages from {list(allowed)}, got {src!r}/{tgt!r}")


# --------------------------------------------------------------------------------------------------------------------
# Multi30k


def _multi30k_files(src: str, tgt: str, needed: tuple[str, ...] | None = None) -> dict[str, LocalFile]:
    """The release's files, each required when its split is `needed` (None: every split but the optional ones)."""
    files = {}
    for split, stem in multi30k_splits(src, tgt).items():
        for lang in (src, tgt):
            name = f"{stem}.{lang}"
            files[f"{split}.{lang}"] = LocalFile(
                display=f"raw/{name}.gz",
                candidates=(f"raw/{name}.gz", f"raw/{name}", f"{name}.gz", name),
                required=split in needed if needed is not None else split not in MULTI30K_OPTIONAL_SPLITS,
            )
    return files


def _read_sentences(path: Path) -> tuple[list[str], str]:
    text, digest = read_text(path)
    return [line.strip() for line in split_lines(text)], digest


def _multi30k_local(src: str, tgt: str, local: LocalFiles) -> TranslationCorpus:
    """Every split whose files are there (a run reads the same folder the same way, whichever test sets it scores)."""
    splits, digests = {}, {}
    for split in multi30k_splits(src, tgt):
        ps, pt = local.found.get(f"{split}.{src}"), local.found.get(f"{split}.{tgt}")
        if ps is None and pt is None:  # (not required: load_translation's `needed` made those a missing file)
            continue
        if ps is None or pt is None:
            have, lack = (ps, f"{split}.{tgt}") if ps is not None else (pt, f"{split}.{src}")
            raise DataError(f"multi30k: found {have} but not its counterpart {lack}.* in {local.root}")
        s_lines, ds = _read_sentences(ps)
        t_lines, dt = _read_sentences(pt)
        if len(s_lines) != len(t_lines):
            raise MalformedDataError(
                ps,
                f"line counts differ between the two languages of split {split!r}: "
                f"{ps} has {len(s_lines)} lines, {pt} has {len(t_lines)} lines",
            )
        splits[split] = list(zip(s_lines, t_lines))
        digests[ps], digests[pt] = ds, dt
    return TranslationCorpus("multi30k", src, tgt, splits, local_fingerprint(MULTI30K.name, local, digests))


def _multi30k_hub(src: str, tgt: str, revision: str, needed: tuple[str, ...] | None) -> TranslationCorpus:
    if {src, tgt} != {"en", "de"}:
        raise HubUnavailable(f"{MULTI30K.hub_id} has only English and German")
    names = {"train": "train", "valid": "validation", "test_2016_flickr": "test"}
    if lacking := sorted(set(needed or ()) - set(names)):
        raise HubUnavailable(f"{MULTI30K.hub_id} has only {sorted(names)}, not {lacking}")
    ds = hub_load_dataset(MULTI30K.hub_id, None, revision)
    splits = {}
    for split, hub_split in names.items():
        if hub_split not in ds:
            raise HubUnavailable(f"{MULTI30K.hub_id}: no split {hub_split!r}")
        require_keys(ds[hub_split].column_names, [src, tgt], MULTI30K.hub_id)
        splits[split] = [(s.strip(), t.strip()) for s, t in zip(ds[hub_split][src], ds[hub_split][tgt])]
    return TranslationCorpus("multi30k", src, tgt, splits, hub_fingerprint(MULTI30K, revision))


def load_translation(
    name: str = "multi30k", src: str = "de", tgt: str = "en", data_dir: str | os.PathLike[str] | None = None,
    needed: tuple[str, ...] | None = None,
) -> TranslationCorpus:
    """Load a translation corpus as raw (detokenized, cased) sentence pairs.

    Only "multi30k" is supported (Task 1). Local files: `multi30k/raw/{train,val,test_2016_flickr,test_2017_flickr,
    test_2017_mscoco,test_2018_flickr}.{lang}.gz` as published (`test_2018_flickr` optional, the 2017 test sets
    not read for Czech, which has none; uncompressed files are accepted too). Line counts of the two languages
    must agree (else MalformedDataError naming both files). `needed`: the splits the caller reads (train, valid and
    its test sets); only their files are required, each other split is read where its files are there. Default:
    every split but the optional ones.
    Hub fallback: `bentrevett/multi30k` (train, valid, test_2016_flickr only). Sentences are stripped of surrounding
    whitespace. For newstest2014 use `load_newstest2014`.
    """
    key = name.strip().lower()
    if key != "multi30k":
        if key in ("newstest2014", "wmt14"):
            raise DataError("use load_newstest2014(src, tgt, data_dir) for newstest2014 (it is a test set only)")
        raise DataError(f"unknown translation corpus {name!r}; choose 'multi30k'")
    _check_langs(src, tgt, MULTI30K_LANGS, "multi30k")
    if needed is not None and (unknown := sorted(set(needed) - set(multi30k_splits(src, tgt)))):
        raise DataError(f"multi30k {src}-{tgt} has no split {unknown}; its splits: {list(multi30k_splits(src, tgt))}")
    files = _multi30k_files(src, tgt, needed)
    return load_from_sources(
        MULTI30K,
        files,
        data_dir,
        lambda local: _multi30k_local(src, tgt, local),
        lambda rev: _multi30k_hub(src, tgt, rev, needed),
    )


# --------------------------------------------------------------------------------------------------------------------
# newstest2014 (SGML)

_SEG_RE = re.compile(r"^\s*<seg\b[^>]*?\bid\s*=\s*\"?([^\">\s]+)\"?[^>]*>(.*)</seg>\s*$")
_DOC_RE = re.compile(r"<doc\b[^>]*?\bdocid\s*=\s*\"([^\"]*)\"")
_ENTITY_RE = re.compile(r"&(#[0-9]+|#[xX][0-9a-fA-F]+|amp|lt|gt|quot|apos);")
_NAMED = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}


def unescape_xml(text: str) -> str:
    """Replace the XML entities (&amp; &lt; &gt; &quot; &apos; &#N; &#xN;); a bare '&' is left as is."""

    def sub(m: re.Match[str]) -> str:
        ent = m.group(1)
        if ent[0] == "#":
            try:
                return chr(int(ent[2:], 16) if ent[1] in "xX" else int(ent[1:]))
            except (ValueError, OverflowError):
                return m.group(0)
        return _NAMED[ent]

    return _ENTITY_RE.sub(sub, text)


def read_sgm_segments(path: Path) -> tuple[list[tuple[str, str]], list[str], str]:
    """Parse a WMT SGML file: ([(docid, segid)], [segment text], sha256). Segments are un-escaped and stripped."""
    text, digest = read_text(path)
    ids: list[tuple[str, str]] = []
    segs: list[str] = []
    doc = ""
    for lineno, line in enumerate(split_lines(text), start=1):
        m = _DOC_RE.search(line)
        if m:
            doc = m.group(1)
        if "<seg" not in line:
            continue
        m = _SEG_RE.match(line)
        if m is None:
            raise MalformedDataError(path, "expected one '<seg id=\"N\">...</seg>' element on the line", line=lineno)
        ids.append((doc, m.group(1)))
        segs.append(unescape_xml(m.group(2)).strip())
    if not segs:
        raise MalformedDataError(path, "no <seg> elements found")
    return ids, segs, digest


def _newstest_files(src: str, tgt: str) -> dict[str, LocalFile]:
    pair = "deen"  # WMT names the de-en test set "deen" for both directions
    return {
        side: LocalFile(display=name, candidates=(name,))
        for side, name in (
            ("src", f"newstest2014-{pair}-src.{src}.sgm"),
            ("ref", f"newstest2014-{pair}-ref.{tgt}.sgm"),
        )
    }


def _newstest_local(src: str, tgt: str, local: LocalFiles) -> TranslationCorpus:
    ps, pr = local.found["src"], local.found["ref"]
    ids_s, segs_s, ds = read_sgm_segments(ps)
    ids_r, segs_r, dr = read_sgm_segments(pr)
    if len(segs_s) != len(segs_r):
        raise MalformedDataError(
            ps, f"segment counts differ: {ps} has {len(segs_s)} <seg> elements, {pr} has {len(segs_r)}"
        )
    for i, (a, b) in enumerate(zip(ids_s, ids_r)):
        if a != b:
            raise MalformedDataError(
                ps, f"segment {i + 1} is (doc {a[0]!r}, seg {a[1]}) in {ps} but (doc {b[0]!r}, seg {b[1]}) in {pr}"
            )
    fp = local_fingerprint(NEWSTEST2014.name, local, {ps: ds, pr: dr})
    return TranslationCorpus("newstest2014", src, tgt, {"test": list(zip(segs_s, segs_r))}, fp)


def _newstest_hub(src: str, tgt: str, revision: str) -> TranslationCorpus:
    ds = hub_load_dataset(NEWSTEST2014.hub_id, NEWSTEST2014.hub_config, revision, split="test")
    require_keys(ds.column_names, ["translation"], NEWSTEST2014.hub_id)
    pairs = [(row[src].strip(), row[tgt].strip()) for row in ds["translation"]]
    return TranslationCorpus("newstest2014", src, tgt, {"test": pairs}, hub_fingerprint(NEWSTEST2014, revision))


def newstest2014_release(segments: int) -> str:
    """Which newstest2014 a corpus of `segments` segments is: both releases use the same file names, and their BLEU
    differ. The full set (3,003) is what Vaswani et al. and tensor2tensor score; sacreBLEU's `-t wmt14` is the
    filtered one (2,737), its `wmt14/full` the full one."""
    return {3003: "full", 2737: "filtered"}.get(segments, f"neither release ({segments} segments, not 3,003 or 2,737)")


def load_newstest2014(
    src: str = "de", tgt: str = "en", data_dir: str | os.PathLike[str] | None = None
) -> TranslationCorpus:
    """WMT14 newstest2014 German-English (full, 3,003 segments) for scoring only; the single split is "test".

    Local files (WMT SGML release): `wmt14-newstest2014/newstest2014-deen-src.{src}.sgm` and
    `newstest2014-deen-ref.{tgt}.sgm`. The text is the content of each `<seg>` element with XML entities
    un-escaped; document and segment ids must align between the two files. Hub fallback: `wmt/wmt14` (de-en), test.
    """
    _check_langs(src, tgt, ("de", "en"), "newstest2014")
    return load_from_sources(
        NEWSTEST2014,
        _newstest_files(src, tgt),
        data_dir,
        lambda local: _newstest_local(src, tgt, local),
        lambda rev: _newstest_hub(src, tgt, rev),
    )
