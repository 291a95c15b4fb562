"""Review: a special token spelled out in the training text is that token, not text to learn from.

Pretraining reads WikiText's `<unk>` as `[UNK]` and trains its WordPiece (or BPE) vocabulary on that text. Encoding
finds `[UNK]` before normalising and gives it its id; training must see the text the same way, or the vocabulary
spends entries on `[`, `unk`/`UNK` and `]` that no encoded text uses. Tokenizers trained before this was so must not
come back from the cache."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from study.tasks.data import build_tokenizer, tokenizer_cache_key
from study.tasks.pretrain import SPECIALS, UNK, PretrainDataModule, wikitext_sentences

WORDS = ("the cat dog ship river king castle town market railway station song chart game console bird tree "
         "dawn crew cargo sailed sang ruled grew reached released sold across near from with after around").split()


def article(seed: int = 0, n_lines: int = 60, unk_word: str | None = None) -> str:
    """A WikiText-style article whose sentences hold `<unk>` (and, if given, `unk_word` as an ordinary word)."""
    rng = random.Random(seed)
    lines = [" = Title = \n", " \n"]
    for _ in range(n_lines):
        words = rng.sample(WORDS, 6)
        words.insert(rng.randint(0, 6), "<unk>")
        if unk_word is not None and rng.random() < 0.5:
            words.insert(rng.randint(0, 7), unk_word)
        lines.append(" " + " ".join(words) + " . \n")
    return "".join(lines) + " \n"  # a blank line before the next article's title


def pretrain_texts(**kw) -> list[str]:
    """The training text as pretraining gives it to the tokenizer: sentences with `[UNK]` for `<unk>`."""
    return wikitext_sentences(article(**kw))


def learned_from_placeholder(vocab: dict[str, int]) -> list[str]:
    """Vocabulary entries only the spelled-out placeholder could have taught (the corpus has no brackets and no
    word holding "unk"): `[UNK]` itself is the special token."""
    bare = {t: t.removeprefix("##").replace("Ġ", "") for t in vocab if t != "[UNK]"}
    return sorted(t for t, b in bare.items() if "unk" in b.lower() or (len(t) > 1 and b in ("[", "]")))


CASES = [("wordpiece", 150, True), ("wordpiece", 150, False), ("bpe", 300, True), ("bpe", 300, False)]


@pytest.mark.parametrize("kind,vocab_size,lowercase", CASES)
def test_the_placeholder_encodes_as_the_unk_id(kind, vocab_size, lowercase):
    tok = build_tokenizer(kind, pretrain_texts(), vocab_size, SPECIALS, None, lowercase=lowercase)
    ids = tok.encode("the [UNK] cat")
    assert ids.count(UNK) == 1 and tok.decode(ids, skip_special_tokens=False) == "the [UNK] cat"


@pytest.mark.parametrize("kind,vocab_size,lowercase", CASES)
def test_the_placeholder_teaches_the_vocabulary_no_pieces(kind, vocab_size, lowercase):
    tok = build_tokenizer(kind, pretrain_texts(), vocab_size, SPECIALS, None, lowercase=lowercase)
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
    assert learned_from_placeholder(vocab) == []
    if kind == "wordpiece":  # bpe starts from all 256 bytes, brackets included; wordpiece from the text's characters
        assert "[" not in vocab and "]" not in vocab


def test_unk_as_an_ordinary_word_of_the_text_is_still_learned():
    texts = pretrain_texts(unk_word="Unk")
    tok = build_tokenizer("wordpiece", texts, 150, SPECIALS, None, lowercase=True)
    assert tok.token_to_id("unk") is not None and tok.encode("unk [UNK]") == [tok.token_to_id("unk"), UNK]


def test_a_placeholder_glued_to_words_cuts_them_as_encoding_does():
    texts = [f"foo{i % 3}[UNK]bar and [UNK][UNK] baz" for i in range(40)]
    tok = build_tokenizer("wordpiece", texts, 30, SPECIALS, None)
    assert learned_from_placeholder(tok.tokenizer.get_vocab(with_added_tokens=True)) == []
    ids = tok.encode("foo1[UNK]bar")
    assert ids.count(UNK) == 1 and tok.decode(ids, skip_special_tokens=False) == "foo1 [UNK] bar"


def _format_1_key(kind, vocab_size, specials, options, fingerprint) -> str:
    """The cache key as written before subword training left special tokens out (format 1)."""
    payload = {"format": 1, "kind": kind, "vocab_size": vocab_size, "special_tokens": list(specials),
               "options": options, "fingerprint": fingerprint}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.mark.parametrize("kind,changed", [("wordpiece", True), ("bpe", True), ("word", False), ("char", False)])
def test_subword_tokenizers_cached_before_the_fix_are_not_reused(kind, changed):
    """bpe and wordpiece train otherwise now, so their old cache files (named by the key) are not read back; char
    and word train as before and keep their keys (a run's data fingerprint holds the key)."""
    args = (kind, 150, SPECIALS, {"lowercase": True, "unk_token": "[UNK]"}, {"corpus": "x"})
    assert (tokenizer_cache_key(*args) != _format_1_key(*args)) is changed


def test_pretraining_on_wikitext_with_unk_gives_the_placeholder_its_id_and_no_pieces(tmp_path):
    folder = tmp_path / "data" / "wikitext-2"
    folder.mkdir(parents=True)
    for k, split in enumerate(("train", "valid", "test")):
        arts = [article(seed=10 * k + j, n_lines=20).replace("Title", f"T {split} {j}") for j in range(3)]
        (folder / f"{split}.txt").write_text(" \n" + "".join(arts))
    from study.config import ExperimentConfig

    cfg = ExperimentConfig.from_dict({
        "name": "unk", "model": {"arch": "encoder", "objective": "mlm", "nsp": False, "d_model": 32, "n_layers": 1,
                                 "n_heads": 2, "max_seq_len": 32},
        "task": {"name": "pretrain", "dataset": "wikitext-2", "seq_len": 32, "vocab_size": 120, "lowercase": True},
        "train": {"batch_size": 2, "accelerator": "cpu", "progress_bar": False},
    })
    dm = PretrainDataModule(cfg, data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    dm.prepare()
    assert learned_from_placeholder(dm.tokenizer.tokenizer.get_vocab(with_added_tokens=True)) == []
    sentence = dm.docs["train"][0][0]  # every sentence holds one <unk>
    assert sentence.count(UNK) == 1
