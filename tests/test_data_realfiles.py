"""Data layer on the real benchmark files in ../shared/data (skipped when that folder is absent)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from study.tasks.data import (
    DatasetUnavailable,
    build_lm_tokenizer,
    build_translation_tokenizers,
    load_glue,
    load_glue_suite,
    load_lm_corpus,
    load_newstest2014,
    load_translation,
)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

pytestmark = [
    pytest.mark.realdata,
    pytest.mark.skipif(not DATA.is_dir(), reason=f"real benchmark data not found at {DATA} (../shared/data)"),
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("STUDY_DATA_DIR", raising=False)


@pytest.fixture(scope="module")
def wikitext():
    return load_lm_corpus("wikitext-2", data_dir=DATA)


@pytest.fixture(scope="module")
def multi30k():
    return load_translation("multi30k", "de", "en", data_dir=DATA)


def test_multi30k_sizes_and_fingerprint(multi30k):
    sizes = {k: len(v) for k, v in multi30k.splits.items()}
    assert sizes == {
        "train": 29_000,
        "valid": 1_014,
        "test_2016_flickr": 1_000,
        "test_2017_flickr": 1_000,
        "test_2017_mscoco": 461,
        "test_2018_flickr": 1_071,
    }
    assert multi30k.train[0] == (
        "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
        "Two young, White males are outside near many bushes.",
    )
    fp = multi30k.fingerprint
    assert fp["source"] == "local" and len(fp["files"]) == 12
    # sha256 of the file on disk, as listed in multi30k/README.md
    assert fp["files"]["raw/train.de.gz"] == "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6"


def test_multi30k_joint_bpe_roundtrip(multi30k, tmp_path):
    src, tgt = build_translation_tokenizers("bpe", multi30k, 1000, ["<pad>", "<s>", "</s>"], tmp_path)
    assert src is tgt and src.vocab_size == 1000
    test = multi30k.splits["test_2016_flickr"]
    assert all(src.decode(src.encode(s)) == s and tgt.decode(tgt.encode(t)) == t for s, t in test)


def test_wikitext2_counts_documents_and_vocab(wikitext, tmp_path):
    assert [len(wikitext.lines(s)) for s in ("train", "valid", "test")] == [36_718, 3_760, 4_358]
    # tokens including one <eos> per line (wikitext-2/README.md)
    assert [wikitext.num_words_with_eos(s) for s in ("train", "valid", "test")] == [2_088_628, 217_646, 245_569]
    docs = wikitext.documents
    # WikiText-2's 600 / 60 / 60 articles (Merity et al. 2016), not the 629 / 60 / 62 title-shaped lines: table
    # legends such as ' = Goals ; A = ' inside an article are not its end
    assert {s: len(d) for s, d in docs.items()} == {"train": 600, "valid": 60, "test": 60}
    assert all("".join(docs[s]) == wikitext.splits[s] for s in docs)
    assert docs["train"][0].startswith(" \n = Valkyria Chronicles III = \n")
    assert wikitext.fingerprint["files"]["train.txt.gz"] == (
        "0dfccdbaa1b65cee8fe0caee5f086de10dfb53a9d10266efde2df0efbf7c5ac3"
    )
    tok = build_lm_tokenizer("word", wikitext, None, ["<eos>"], tmp_path, newline_token="<eos>")
    assert tok.vocab_size == 33_278  # the standard WikiText-2 vocabulary, <eos> and <unk> included
    assert len(tok.encode(wikitext.valid)) == 217_646


def test_tinyshakespeare(tmp_path):
    c = load_lm_corpus("tinyshakespeare", data_dir=DATA)
    full = c.train + c.valid
    assert len(full) == 1_115_394 and len(set(full)) == 65
    assert (len(c.train), len(c.valid)) == (1_003_854, 111_540)  # nanoGPT's 90/10 split
    assert "test" not in c.splits  # no test split: a "test" number would be the validation split renamed
    digest = hashlib.sha256((DATA / "tinyshakespeare/input.txt").read_bytes()).hexdigest()
    assert c.fingerprint["files"]["input.txt"] == digest
    tok = build_lm_tokenizer("char", c, None, (), tmp_path)
    assert tok.vocab_size == 65 + 1  # 65 characters (all occur in train) + <unk>
    assert tok.decode(tok.encode(c.valid)) == c.valid


@pytest.mark.parametrize(
    "task, split, size",
    [
        ("SST-2", "dev", 872),
        ("SST-2", "train", 67_349),
        ("CoLA", "dev", 1_043),
        ("CoLA", "train", 8_551),
        ("MRPC", "dev", 408),
        ("MRPC", "train", 3_668),
        ("STS-B", "dev", 1_500),
        ("RTE", "dev", 277),
        ("WNLI", "dev", 71),
    ],
)
def test_glue_sizes(task, split, size):
    assert len(load_glue(task, data_dir=DATA, splits=[split])[split]) == size


def test_glue_details():
    sts = load_glue("STS-B", data_dir=DATA)
    assert all(isinstance(e.label, float) and 0.0 <= e.label <= 5.0 for e in sts["dev"])
    assert len(sts["test"]) == 1_379 and all(e.label is None for e in sts["test"])
    mrpc = load_glue("MRPC", data_dir=DATA)
    assert mrpc["dev"][0].text_a.startswith("He said the foodservice pie business")
    assert {e.label for e in mrpc["train"]} == {0, 1}
    cola = load_glue("CoLA", data_dir=DATA)
    assert cola["dev"][0].text_a == "The sailors rode the breeze clear of the rocks." and cola.metrics == ("mcc",)
    assert [e.idx for e in cola["test"][:3]] == [0, 1, 2]


def test_glue_unavailable_tasks_reported():
    with pytest.raises(DatasetUnavailable) as ei:
        load_glue("QNLI", data_dir=DATA)
    assert "glue/QNLI/train.tsv" in str(ei.value) and "nyu-mll/glue" in str(ei.value)
    assert len(load_glue("QNLI", data_dir=DATA, splits=["dev"])["dev"]) == 5_463
    loaded, skipped = load_glue_suite(["QNLI", "MNLI", "QQP", "RTE"], data_dir=DATA)
    assert set(skipped) == {"QNLI", "MNLI", "QQP"} and set(loaded) == {"RTE"}


def test_newstest2014():
    de_en = load_newstest2014("de", "en", data_dir=DATA)
    assert len(de_en.splits["test"]) == 3_003
    assert de_en.splits["test"][0] == (
        "Gutach: Noch mehr Sicherheit für Fußgänger",
        "Gutach: Increased safety for pedestrians",
    )
    en_de = load_newstest2014("en", "de", data_dir=DATA)
    assert len(en_de.splits["test"]) == 3_003
    assert any("Standard & Poor's" in s for s in en_de.sources("test"))
