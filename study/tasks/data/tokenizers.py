"""Tokenizers trained with Hugging Face `tokenizers`, cached on disk.

Kinds:
  "bpe":       byte-level BPE (GPT-2 style). Lossless: `decode(encode(text)) == text`, so decoded output is
               detokenized text ready for sacreBLEU. Options: lowercase.
  "wordpiece": BERT-style WordPiece (BERT normalizer and pre-tokenizer, "##" continuation prefix).
               Options: lowercase (also strips accents, like uncased BERT); unk_token (default "[UNK]").
  "char":      character level: every character of the training text gets an id (sorted by code point, after the
               special tokens); unseen characters map to unk_token (default "<unk>"). The data decides the size:
               a `vocab_size` other than None (or the size found) is refused, not ignored.
  "word":      whitespace word level for pre-tokenized corpora with a closed vocabulary (WikiText-2).
               vocab_size None keeps every word; unk_token defaults to "<unk>" (WikiText-2's own token);
               newline_token (e.g. "<eos>") turns each "\\n" into that token, so encoding a whole split yields
               the usual word + <eos> stream. Decoding joins tokens with spaces.

Ids are contiguous: special tokens first (in the order given), then unk/newline tokens if not among them, then the
learned vocabulary. A special token spelled out in the training text (pretraining's `[UNK]` for WikiText's `<unk>`)
encodes as its id, and bpe and wordpiece learn no pieces from its spelling. The trained tokenizer is saved as
`<cache_dir>/<kind>-<vocab>-<hash>.json` where the hash covers (kind, vocab_size, special tokens, options, data
fingerprint); a later call with the same inputs loads that file and does not retrain (nor read `texts`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from study.tasks.data.errors import DataError
from study.tasks.data.sources import lines_with_ends

if TYPE_CHECKING:  # pragma: no cover
    from study.tasks.data.lm import LMCorpus
    from study.tasks.data.translation import TranslationCorpus

log = logging.getLogger(__name__)

TOKENIZER_KINDS = ("bpe", "wordpiece", "char", "word")
CACHE_FORMAT_VERSION = 1
# Kinds whose training changed since CACHE_FORMAT_VERSION 1, so their cached files (and keys) are not reused: 2 = bpe
# and wordpiece learn nothing from a special token's spelling in the text (`_outside_specials`). Per kind, so char
# and word tokenizers, trained as before, keep their keys (a run's data fingerprint holds the key: resume is refused).
_KIND_FORMAT_VERSION = {"bpe": 2, "wordpiece": 2}
_DEFAULT_UNK = {"bpe": None, "wordpiece": "[UNK]", "char": "<unk>", "word": "<unk>"}
_DEFAULT_MIN_FREQ = {"bpe": 2, "wordpiece": 2, "char": 0, "word": 0}


@dataclass
class TrainedTokenizer:
    """A `tokenizers.Tokenizer` plus how it was made.

    Fields: tokenizer (the HF object; use it directly for anything not wrapped here), kind, key (cache hash),
    path (cache file, None when not cached), from_cache (True if loaded without training), special_tokens,
    unk_token, options (the options that went into the key).
    """

    tokenizer: Tokenizer
    kind: str
    key: str
    path: Path | None
    from_cache: bool
    special_tokens: tuple[str, ...]
    unk_token: str | None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_sha256(self) -> str:
        """A digest of the id map (token -> id): `key` names what the tokenizer was trained from, this what came out,
        which a data fingerprint needs (a cache entry written before WordPiece ids were canonical, or a tie broken
        otherwise, maps the same key to other ids)."""
        items = sorted(self.tokenizer.get_vocab(with_added_tokens=True).items())
        return hashlib.sha256(_canonical(items).encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        if self.kind == "char" and self.tokenizer.normalizer is None and self.unk_token is not None:
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            # A character tokenizer maps each code point to its id, so a dict lookup gives its output 20x faster
            # (Tiny Shakespeare's 1M characters: 0.1 s against 2 s through the per-character regex split). Text
            # holding a multi-character vocabulary entry (e.g. "<unk>") goes through the tokenizer, which would
            # match that entry as one token.
            if not any(len(t) > 1 and t in text for t in vocab):
                unk = vocab[self.unk_token]
                return [vocab.get(ch, unk) for ch in text]
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return self.tokenizer.decode_batch([list(b) for b in batch], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.tokenizer.id_to_token(idx)

    @property
    def special_ids(self) -> dict[str, int]:
        """Special token -> id, e.g. {"<pad>": 0, "<s>": 1, ...}."""
        out = {}
        for t in self.special_tokens:
            i = self.tokenizer.token_to_id(t)
            if i is not None:
                out[t] = i
        return out


# --------------------------------------------------------------------------------------------------------------------
# Cache key


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)


def tokenizer_cache_key(
    kind: str, vocab_size: int | None, special_tokens: Sequence[str], options: dict[str, Any], fingerprint: Any
) -> str:
    """sha256 of (format version, kind, vocab_size, special tokens, options, data fingerprint)."""
    payload = {
        "format": _KIND_FORMAT_VERSION.get(kind, CACHE_FORMAT_VERSION),
        "kind": kind,
        "vocab_size": vocab_size,
        "special_tokens": list(special_tokens),
        "options": options,
        "fingerprint": fingerprint,
    }
    return hashlib.sha256(_canonical(payload).encode("utf-8")).hexdigest()


def texts_fingerprint(texts: Iterable[str]) -> dict[str, Any]:
    """A fingerprint of the texts themselves (used when the caller gives none)."""
    h = hashlib.sha256()
    n = 0
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\x00")
        n += 1
    return {"texts_sha256": h.hexdigest(), "num_texts": n}


# --------------------------------------------------------------------------------------------------------------------
# Training


def _with(tokens: Sequence[str], *extra: str | None) -> list[str]:
    out = list(dict.fromkeys(tokens))
    for t in extra:
        if t is not None and t not in out:
            out.append(t)
    return out


def _check_contiguous(tok: Tokenizer, kind: str) -> None:
    ids = sorted(tok.get_vocab(with_added_tokens=True).values())
    if ids != list(range(len(ids))):
        raise DataError(f"{kind} tokenizer: vocabulary ids are not contiguous (internal error)")


def _word_level(vocab_in_order: Sequence[str], unk: str) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(dict.fromkeys(vocab_in_order))}
    return Tokenizer(models.WordLevel(vocab, unk_token=unk))


def _outside_specials(texts: Iterable[str], specials: Sequence[str]) -> Iterator[str]:
    """The pieces of each text between its special tokens' spellings (e.g. pretraining's `[UNK]` for WikiText's
    `<unk>`), for a subword trainer. Encoding cuts a text at its special tokens before normalising (they are added
    unnormalised) and gives each its id, but training runs the text through the normaliser and pre-tokenizer
    whole, so the trainer would learn `[`, `unk`/`UNK` and `]` (vocabulary entries no encoded text uses) from the
    placeholder. Trained on these pieces, it sees the words encoding sees; the trainers count words, so the cuts
    between pieces change nothing else. Longest spelling first, as the added vocabulary matches."""
    spellings = sorted((t for t in specials if t), key=len, reverse=True)  # an empty one would cut everywhere
    if not spellings:
        yield from texts
        return
    cut = re.compile("|".join(map(re.escape, spellings)))
    for text in texts:
        yield from (piece for piece in cut.split(text) if piece)


def _train_bpe(texts: Iterable[str], vocab_size: int, specials: list[str], min_freq: int, lowercase: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_freq,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_outside_specials(texts, specials), trainer=trainer)
    return tok


def _train_wordpiece(
    texts: Iterable[str], vocab_size: int, specials: list[str], min_freq: int, lowercase: bool, unk: str
) -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token=unk, continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_freq,
        special_tokens=specials,
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(_outside_specials(texts, specials), trainer=trainer)
    return _canonical_wordpiece_ids(tok, specials, unk)


def _canonical_wordpiece_ids(tok: Tokenizer, specials: list[str], unk: str) -> Tokenizer:
    """`tok` with its special tokens first, as trained, and every other token numbered in sorted order.

    WordPiece training numbers its tokens in a per-process hash order (huggingface/tokenizers#1794): the same text
    gives the same tokens under other ids in another process, so a run resumed or repeated on another machine (or
    with another cache folder) would read its weights with other tokens' ids. Renumbering changes no segmentation
    (WordPiece matches strings, not ids) and makes the id map a function of the token set."""
    vocab = tok.get_vocab(with_added_tokens=False)
    head = [t for t in specials if t in vocab]
    order = head + sorted(set(vocab) - set(head))
    tok.model = models.WordPiece({t: i for i, t in enumerate(order)}, unk_token=unk, continuing_subword_prefix="##")
    return tok


def _train_char(texts: Iterable[str], specials: list[str], unk: str, lowercase: bool) -> Tokenizer:
    chars: set[str] = set()
    for t in texts:
        chars.update(t.lower() if lowercase else t)
    head = _with(specials, unk)
    tok = _word_level(head + sorted(c for c in chars if c not in head), unk)
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def _word_normalizer(lowercase: bool, newline_token: str | None) -> normalizers.Normalizer | None:
    parts = []
    if newline_token:
        parts.append(normalizers.Replace("\n", f" {newline_token} "))
    if lowercase:
        parts.append(normalizers.Lowercase())
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else normalizers.Sequence(parts)


def _train_word(
    texts: Iterable[str],
    vocab_size: int | None,
    specials: list[str],
    min_freq: int,
    lowercase: bool,
    unk: str,
    newline_token: str | None,
) -> Tokenizer:
    norm = _word_normalizer(lowercase, newline_token)
    # Train with the Rust trainer (fast counting), then renumber: the trainer can leave holes in the ids when a
    # special token also occurs as a word (e.g. "<unk>" in WikiText-2).
    tmp = Tokenizer(models.WordLevel(unk_token=unk))
    if norm is not None:
        tmp.normalizer = norm
    tmp.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    head = _with(specials, unk, newline_token)
    trainer = trainers.WordLevelTrainer(
        vocab_size=(vocab_size if vocab_size is not None else 1 << 31),
        min_frequency=min_freq,
        special_tokens=[],
        show_progress=False,
    )
    tmp.train_from_iterator(texts, trainer=trainer)
    learned = [t for t, _ in sorted(tmp.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])]
    learned = [t for t in learned if t not in head]
    if vocab_size is not None:
        learned = learned[: max(0, vocab_size - len(head))]
    tok = _word_level(head + learned, unk)
    if norm is not None:
        tok.normalizer = norm
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def build_tokenizer(
    kind: str,
    texts: Iterable[str],
    vocab_size: int | None = None,
    special_tokens: Sequence[str] = (),
    cache_dir: str | os.PathLike[str] | None = None,
    fingerprint: Any = None,
    *,
    lowercase: bool = False,
    unk_token: str | None = None,
    min_frequency: int | None = None,
    newline_token: str | None = None,
) -> TrainedTokenizer:
    """Train (or load from cache) a tokenizer on `texts` (the training split; an iterator or a list).

    kind: "bpe" | "wordpiece" | "char" | "word" (see the module docstring).
    vocab_size: target vocabulary size including special tokens; required for bpe and wordpiece; None for char (the
      characters found decide); None for word means every word. A size the data cannot give is refused.
    special_tokens: registered as special tokens (ids 0.., in this order); skipped by `decode` by default.
    cache_dir: where to keep `<kind>-<vocab>-<hash>.json` (+ `.meta.json`); None disables caching.
    fingerprint: identifies the training data (e.g. a loader's `fingerprint` plus the split); it goes into the cache
      key. If None and cache_dir is set, the texts are read once and hashed instead.
    lowercase / unk_token / min_frequency (defaults: bpe 2, wordpiece 2, char and word 0) / newline_token (word):
      options, all part of the cache key.
    """
    if kind not in TOKENIZER_KINDS:
        raise DataError(f"unknown tokenizer kind {kind!r}; choose one of {list(TOKENIZER_KINDS)}")
    if kind in ("bpe", "wordpiece") and (vocab_size is None or vocab_size <= 0):
        raise DataError(f"{kind} tokenizer needs a positive vocab_size, got {vocab_size!r}")
    if newline_token is not None and kind != "word":
        raise DataError("newline_token is only supported by the 'word' tokenizer")
    # char: the size asked is checked against the characters found, and left out of the key (the data decides it)
    asked, vocab_size = vocab_size, (None if kind == "char" else vocab_size)
    unk = unk_token if unk_token is not None else _DEFAULT_UNK[kind]
    min_freq = min_frequency if min_frequency is not None else _DEFAULT_MIN_FREQ[kind]
    specials = list(dict.fromkeys(special_tokens))
    if kind == "wordpiece":
        specials = _with(specials, unk)
    if kind == "bpe" and vocab_size < 256 + len(specials):  # byte-level BPE starts from all 256 bytes
        raise DataError(f"vocab_size={vocab_size} is below the smallest byte-level BPE vocabulary, 256 bytes + "
                        f"{len(specials)} special tokens = {256 + len(specials)}; the tokenizer would ignore it")
    options = {"lowercase": lowercase, "unk_token": unk, "min_frequency": min_freq, "newline_token": newline_token}
    if cache_dir is not None and fingerprint is None:
        texts = list(texts)
        fingerprint = texts_fingerprint(texts)
    key = tokenizer_cache_key(kind, vocab_size, specials, options, fingerprint)
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{kind}-{vocab_size if vocab_size is not None else 'all'}-{key[:20]}.json"
        cached = _cached(path)
        if cached is not None:
            _check_size_reached(kind, asked, cached, min_freq)  # a cache written before the check too
            return TrainedTokenizer(cached, kind, key, path, True, tuple(specials), unk, options)
    tok = _train(kind, texts, vocab_size, specials, min_freq, lowercase, unk, newline_token)
    _check_size_reached(kind, asked, tok, min_freq)
    if path is not None:
        tok = _publish(tok, path, {"kind": kind, "vocab_size_requested": vocab_size, "special_tokens": specials,
                                   "options": options, "fingerprint": fingerprint, "key": key})
    return TrainedTokenizer(tok, kind, key, path, False, tuple(specials), unk, options)


def _check_size_reached(kind: str, vocab_size: int | None, tok: Tokenizer, min_freq: int) -> None:
    """A vocabulary of another size than asked trains a model of another size than the config names, so a sweep over
    sizes would train one model under several labels: refused. A trainer never goes below its alphabet and special
    tokens, and stops early when the data holds no more merges (bpe, wordpiece) or distinct words (word) at
    `min_frequency`; a character vocabulary is every character of the training text, whatever the size asked."""
    got = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is None or got == vocab_size:
        return
    if kind == "char":
        raise DataError(f"vocab_size={vocab_size} cannot size a char tokenizer: it takes every character of the "
                        f"training text ({got} here, special tokens included) and would ignore the size; leave "
                        f"vocab_size null (task.vocab_size: null) or use a subword tokenizer ('bpe')")
    if got > vocab_size:
        raise DataError(f"vocab_size={vocab_size} is below the smallest {kind} vocabulary of this data ({got}: its "
                        f"alphabet and special tokens); the tokenizer would ignore it: use vocab_size >= {got}")
    found = "distinct words" if kind == "word" else "pairs"
    raise DataError(f"vocab_size={vocab_size} is more than this data yields: the {kind} tokenizer stops at {got} "
                    f"(no more {found} seen {max(min_freq, 1)}+ times); a model of {vocab_size} would be labelled "
                    f"with a vocabulary it does not have: use vocab_size <= {got} or more training text")


def _cached(path: Path) -> Tokenizer | None:
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - a corrupt cache file is retrained and replaced
        log.warning("tokenizer cache %s unreadable (%s); retraining", path, e)
        return None


def _train(kind: str, texts: Iterable[str], vocab_size: int | None, specials: list[str], min_freq: int,
           lowercase: bool, unk: str | None, newline_token: str | None) -> Tokenizer:
    if kind == "bpe":
        tok = _train_bpe(texts, int(vocab_size or 0), specials, min_freq, lowercase)
    elif kind == "wordpiece":
        assert unk is not None
        tok = _train_wordpiece(texts, int(vocab_size or 0), specials, min_freq, lowercase, unk)
    elif kind == "char":
        assert unk is not None
        tok = _train_char(texts, specials, unk, lowercase)
    else:
        assert unk is not None
        tok = _train_word(texts, vocab_size, specials, min_freq, lowercase, unk, newline_token)
    if specials:
        tok.add_special_tokens(specials)
    _check_contiguous(tok, kind)
    return tok


def _publish(tok: Tokenizer, path: Path, meta: dict[str, Any]) -> Tokenizer:
    """Put `tok` in the cache unless another process got there first, and return the tokenizer the cache holds.

    The first writer wins and everyone uses its file: WordPiece training numbers (and, on ties, picks) its tokens in
    a per-process hash order, so two trials that trained the same key at once hold different id maps. Were the last
    writer to win, a trial would keep training with its own map while the cache held another one, and on resume
    (or in a later trial) the same key would give its weights other tokens' ids without a word said."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    tok.save(str(tmp))
    try:
        os.link(tmp, path)  # atomic, and fails when the file exists: the first writer's stays
    except FileExistsError:
        published = _cached(path)
        if published is not None:
            tmp.unlink()
            return published
        os.replace(tmp, path)  # an unreadable cache file: replaced
    except OSError:  # a filesystem without hard links: renamed into place (readers never see half a file)
        os.replace(tmp, path)
    else:
        tmp.unlink()
    meta_path = path.with_name(path.name[: -len(".json")] + ".meta.json")
    meta_tmp = meta_path.with_name(f"{meta_path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    meta = {**meta, "vocab_size": tok.get_vocab_size(with_added_tokens=True)}
    meta_tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str, ensure_ascii=False) + "\n")
    os.replace(meta_tmp, meta_path)
    return tok


# --------------------------------------------------------------------------------------------------------------------
# Helpers for the corpora


def translation_texts(
    corpus: TranslationCorpus, split: str = "train", sides: Sequence[str] = ("src", "tgt")
) -> Iterator[str]:
    """Sentences of both sides (or the chosen sides) of a translation split, for joint tokenizer training."""
    return corpus.texts(split, tuple(sides))


def build_translation_tokenizers(
    kind: str,
    corpus: TranslationCorpus,
    vocab_size: int | None,
    special_tokens: Sequence[str] = (),
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    joint: bool = True,
    split: str = "train",
    **options: Any,
) -> tuple[TrainedTokenizer, TrainedTokenizer]:
    """(source tokenizer, target tokenizer) trained on `split` of a translation corpus.

    joint=True: one shared vocabulary trained on both sides; the same object is returned twice (share embeddings).
    joint=False: separate vocabularies, each trained on its own side (vocab_size each).
    `options` are passed on to `build_tokenizer` (lowercase, unk_token, min_frequency)."""
    base = {"corpus": corpus.fingerprint, "name": corpus.name, "split": split}
    if joint:
        fp = {**base, "sides": [corpus.src, corpus.tgt]}
        tok = build_tokenizer(
            kind, translation_texts(corpus, split), vocab_size, special_tokens, cache_dir, fp, **options
        )
        return tok, tok
    src = build_tokenizer(
        kind, translation_texts(corpus, split, ("src",)), vocab_size, special_tokens, cache_dir,
        {**base, "sides": [corpus.src]}, **options,
    )
    tgt = build_tokenizer(
        kind, translation_texts(corpus, split, ("tgt",)), vocab_size, special_tokens, cache_dir,
        {**base, "sides": [corpus.tgt]}, **options,
    )
    return src, tgt


def build_lm_tokenizer(
    kind: str,
    corpus: LMCorpus,
    vocab_size: int | None = None,
    special_tokens: Sequence[str] = (),
    cache_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> TrainedTokenizer:
    """A tokenizer trained on the train split of an LM corpus. For "word", unk_token defaults to the corpus' own
    (`<unk>` for WikiText-2). Texts are the split's lines with their newlines (the whole split for "char")."""
    if kind == "word" and corpus.unk_token and "unk_token" not in options:
        options["unk_token"] = corpus.unk_token
    train = corpus.splits["train"]
    texts: list[str] = [train] if kind == "char" else lines_with_ends(train)
    fp = {"corpus": corpus.fingerprint, "name": corpus.name, "split": "train"}
    return build_tokenizer(kind, texts, vocab_size, special_tokens, cache_dir, fp, **options)
