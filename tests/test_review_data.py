"""Review of the data layer and the tasks that read it: each test names a way a study could report something that is
not what happened (a cut test sentence, a tokenizer another trial replaced, a corpus copy read differently), and
specifies that it does not. Offline: the Hugging Face hub is never contacted."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
import torch

from study.config import ExperimentConfig


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("STUDY_DATA_DIR", raising=False)


# --------------------------------------------------------------------------------------------------------------------
# Translation: what task.seq_len cuts, and that the record says so

WORDS = ["Hund", "Katze", "Mann", "Frau", "Kind", "Ball", "Baum", "Haus", "rot", "blau", "groß", "klein"]
SPLIT_SIZES = {"train": 60, "val": 8, "test_2016_flickr": 6, "test_2017_flickr": 2, "test_2017_mscoco": 2}


def write_long_multi30k(root: Path) -> Path:
    """Multi30k-format files whose sentences run from 2 to 40 words: with a small task.seq_len many are too long."""
    rng = random.Random(0)
    raw = root / "multi30k" / "raw"
    raw.mkdir(parents=True)
    for stem, n in SPLIT_SIZES.items():
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) + "." for _ in range(n)]
        for lang in ("de", "en"):
            (raw / f"{stem}.{lang}.gz").write_bytes(gzip.compress("".join(s + "\n" for s in lines).encode()))
    return root


def translation_config(position: str = "sinusoidal", **task) -> ExperimentConfig:
    return ExperimentConfig.from_dict({
        "name": "review-translation",
        "model": {"arch": "encoder-decoder", "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32,
                  "max_seq_len": 24, "position": position},
        "task": {"name": "translation", "dataset": "multi30k", "tokenizer": "char", "seq_len": 16, "beam_size": 1,
                 "test_sets": ["test_2016_flickr"], **task},
        "train": {"max_steps": 1, "batch_size": 4, "accelerator": "cpu", "progress_bar": False},
    })


def prepared(cfg: ExperimentConfig, root: Path, cache: Path):
    from study.tasks.translation import TranslationDataModule

    dm = TranslationDataModule(cfg, data_dir=root, cache_dir=cache)
    dm.prepare()
    return dm, cfg.replace(model=cfg.model.replace(**dm.model_overrides()))


def test_a_training_target_cut_at_seq_len_is_not_closed_with_eos(tmp_path):
    """`BOS + the first seq_len tokens + EOS` would teach the model that sentences end where the cut fell; a cut
    target keeps no EOS, a whole one keeps its EOS, and the record counts the cut pairs."""
    from study.tasks.translation import BOS, EOS

    dm, _ = prepared(translation_config(), write_long_multi30k(tmp_path / "data"), tmp_path / "cache")
    n = dm.cfg.task.seq_len
    targets = dm.tgt_tok.encode_batch(dm.corpus.targets("train"))
    sources = dm.src_tok.encode_batch(dm.corpus.sources("train"))
    for (src, tgt_ids), full, full_src in zip(dm.encoded["train"], targets, sources):
        assert tgt_ids[0] == BOS and src == full_src[:n]
        if len(full) > n:
            assert tgt_ids == [BOS, *full[:n]]  # cut: no EOS
        else:
            assert tgt_ids == [BOS, *full, EOS]
    cut = sum(len(s) > n or len(t) > n for s, t in zip(sources, targets))
    assert cut > 0 and dm.truncated["train"] == cut


def test_test_sources_are_translated_whole_and_any_cut_is_recorded(tmp_path):
    """task.seq_len bounds the training sentences, not the test set: BLEU of a translation of part of a source
    would be a lower score with no word said. A source is cut only where the positions cannot reach (a learned
    table of model.max_seq_len rows), and metrics.json's test_sets.<set>.truncated_sources counts those."""
    from study.tasks.translation import TranslationModule

    root = write_long_multi30k(tmp_path / "data")
    for position, limit in (("sinusoidal", None), ("learned", 24)):
        dm, cfg = prepared(translation_config(position), root, tmp_path / f"cache-{position}")
        module = TranslationModule(cfg)
        seen: list[int] = []
        original = module.model.encode

        def encode(src, mask=None, original=original):
            seen.extend(int(n) for n in mask.sum(1))
            return original(src, mask)

        module.model.encode = encode
        sources = dm.corpus.sources("test_2016_flickr")
        lengths = [len(s) for s in dm.src_tok.encode_batch(sources)]
        assert max(lengths) > dm.cfg.task.seq_len  # the corpus holds test sources longer than seq_len
        stats: dict = {}
        module.translate(sources, dm, stats=stats)
        expected = lengths if limit is None else [min(n, limit) for n in lengths]
        assert sorted(seen) == sorted(expected)
        assert stats["truncated_sources"] == sum(n > (limit or 10**9) for n in lengths)
        metrics = module.final_metrics(dm)
        assert metrics["test_sets"]["test_2016_flickr"]["truncated_sources"] == stats["truncated_sources"]
        assert metrics["truncated_pairs"]["train"] == dm.truncated["train"] > 0
        for key in ("test_sets.test_2016_flickr.truncated_sources", "truncated_pairs.train"):
            assert _declared(key)


def _declared(metric: str) -> bool:
    from study.tasks.translation import Translation

    spec = Translation.metric(metric)
    return spec is not None and not spec.objective


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer cache: one key, one id map

PANGRAMS = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
            "sphinx of black quartz judge my vow", "how vexingly quick daft zebras jump"] * 20


def test_a_tokenizer_another_trial_cached_first_is_the_one_every_trial_uses(tmp_path, monkeypatch):
    """Trials of a sweep start together and train the same tokenizer at once. WordPiece numbers its tokens in a
    per-process hash order, so their id maps differ. The first to reach the cache wins: a later one adopts that
    file instead of replacing it, so the trial that wrote it first, this one and any resumed or later trial all
    read a token the same id."""
    from tokenizers import Tokenizer

    from study.tasks.data import build_tokenizer
    from study.tasks.data import tokenizers as tokmod

    specials, fp = ["[PAD]", "[UNK]"], {"corpus": "pangrams"}
    name = build_tokenizer("wordpiece", PANGRAMS, 120, specials, tmp_path / "probe", fp).path.name
    cache = tmp_path / "cache"
    real_train, rival = tokmod._train, {}

    def train_while_another_trial_publishes(*args, **kwargs):
        tok = real_train(*args, **kwargs)
        other = json.loads(tok.to_str())  # the other trial's map: two tokens numbered the other way round
        vocab = other["model"]["vocab"]
        a, b = sorted(t for t in vocab if t.startswith("##"))[:2]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        cache.mkdir(exist_ok=True)
        (cache / name).write_text(json.dumps(other))
        rival.update(vocab)
        return tok

    monkeypatch.setattr(tokmod, "_train", train_while_another_trial_publishes)
    got = build_tokenizer("wordpiece", PANGRAMS, 120, specials, cache, fp)
    assert not got.from_cache and got.path == cache / name
    assert Tokenizer.from_file(str(cache / name)).get_vocab() == rival  # the first writer's file stays
    assert got.tokenizer.get_vocab() == rival  # and this trial uses it
    again = build_tokenizer("wordpiece", PANGRAMS, 120, specials, cache, fp)
    assert again.from_cache and again.encode("quick jugs") == got.encode("quick jugs")
    assert not [p for p in cache.iterdir() if ".tmp" in p.name]  # no temporary file left behind


# --------------------------------------------------------------------------------------------------------------------
# Language-modelling corpora: a copy with other line ends is the same corpus

SHAKESPEARE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 3
WIKI = " \n = Alpha = \n \n Alpha is a <unk> word . \n \n = = History = = \n It was . \n"


def _write(path: Path, text: str, *, crlf: bool = False, bom: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = text.replace("\n", "\r\n") if crlf else text
    path.write_bytes(("\ufeff" if bom else "").encode() + text.encode())


@pytest.mark.parametrize("crlf, bom", [(True, False), (False, True), (True, True)])
def test_a_corpus_saved_with_crlf_or_a_bom_reads_as_the_published_text(tmp_path, crlf, bom):
    """Tiny Shakespeare and WikiText-2 are LF files without a byte-order mark (and so is the hub copy). A local copy
    saved with CRLF line ends or a BOM gives the same splits, documents and character vocabulary, not one with "\\r"
    and "\\ufeff" characters in it; its fingerprint still names the bytes on disk."""
    from study.tasks.data import build_lm_tokenizer, load_lm_corpus

    for name, variant in (("lf", {}), ("other", {"crlf": crlf, "bom": bom})):
        _write(tmp_path / name / "tinyshakespeare" / "input.txt", SHAKESPEARE, **variant)
        for split in ("train", "valid", "test"):
            _write(tmp_path / name / "wikitext-2" / f"{split}.txt", WIKI, **variant)
    for corpus in ("tinyshakespeare", "wikitext-2"):
        published, copy = (load_lm_corpus(corpus, data_dir=tmp_path / n) for n in ("lf", "other"))
        assert copy.splits == published.splits and copy.documents == published.documents
        assert copy.fingerprint["files"] != published.fingerprint["files"]  # the digests of what is on disk
    chars = build_lm_tokenizer("char", load_lm_corpus("tinyshakespeare", data_dir=tmp_path / "other"), None, ())
    assert "\r" not in chars.tokenizer.get_vocab() and "\ufeff" not in chars.tokenizer.get_vocab()


# --------------------------------------------------------------------------------------------------------------------
# A vocabulary size the tokenizer would not honour is refused, not ignored


def test_a_vocab_size_for_a_character_vocabulary_is_refused_not_ignored(tmp_path):
    """The characters of the training text decide a char vocabulary. task.vocab_size=512 with tokenizer 'char'
    used to be dropped: the record said 512 and the model had 40 entries, and a sweep over vocab_size trained the
    same model under every label. One error before training names the field and what would be valid."""
    from study.tasks.data import DataError, build_tokenizer

    with pytest.raises(DataError, match=r"vocab_size=512 cannot size a char tokenizer.*leave vocab_size null"):
        build_tokenizer("char", PANGRAMS, 512, ["<pad>"], tmp_path)
    exact = build_tokenizer("char", PANGRAMS, None, ["<pad>"], tmp_path)  # cached now: the cache meets the check
    with pytest.raises(DataError, match="cannot size a char tokenizer"):
        build_tokenizer("char", PANGRAMS, 512, ["<pad>"], tmp_path)
    assert build_tokenizer("char", PANGRAMS, exact.vocab_size, ["<pad>"], tmp_path).vocab_size == exact.vocab_size
    # an experiment config says so as it is read, before any data is (tests/test_config.py)
    from study.config import ConfigError

    with pytest.raises(ConfigError, match="vocab_size"):
        ExperimentConfig.from_dict({
            "model": {"arch": "decoder", "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_seq_len": 64},
            "task": {"name": "lm", "dataset": "tinyshakespeare", "tokenizer": "char", "vocab_size": 512, "seq_len": 16},
            "train": {"accelerator": "cpu"},
        })


def test_a_word_vocabulary_larger_than_the_distinct_words_is_refused(tmp_path):
    """A word vocabulary is cut to vocab_size (rarer words become <unk>); a size above the distinct words the training
    text holds cannot be filled and used to give a smaller vocabulary under the larger size's label."""
    from study.tasks.data import DataError, build_tokenizer

    distinct = len({w for t in PANGRAMS for w in t.split()}) + 1  # + <unk>
    assert build_tokenizer("word", PANGRAMS, distinct, ()).vocab_size == distinct
    assert build_tokenizer("word", PANGRAMS, 10, ()).vocab_size == 10  # a smaller closed vocabulary: allowed
    with pytest.raises(DataError, match=rf"vocab_size=5000 is more than this data yields.*stops at {distinct}"):
        build_tokenizer("word", PANGRAMS, 5000, (), tmp_path)
