"""Data layer tests on tiny synthetic files written in the published formats (no network: offline mode)."""

from __future__ import annotations

import gzip
import hashlib
import os
import time
from pathlib import Path

import pytest

from study.tasks.data import (
    GLUE_TASK_NAMES,
    DataError,
    DatasetUnavailable,
    MalformedDataError,
    build_lm_tokenizer,
    build_tokenizer,
    build_translation_tokenizers,
    glue_task_info,
    load_glue,
    load_glue_suite,
    load_lm_corpus,
    load_newstest2014,
    load_translation,
    split_wikitext_documents,
)
from study.tasks.data import tokenizers as tokmod


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("STUDY_DATA_DIR", raising=False)


# --------------------------------------------------------------------------------------------------------------------
# Synthetic data in the published formats

WIKI_TRAIN = (
    " \n"
    " = Alpha Article = \n"
    " \n"
    " Alpha is a <unk> word . \n"
    " \n"
    " = = History = = \n"
    " \n"
    " It was <unk> in 1900 . \n"
    " \n"
    " = = = Early days = = = \n"
    " Early text here . \n"
    " \n"
    " = Beta Article = \n"
    " \n"
    " Beta follows alpha . \n"
)
WIKI_VALID = " \n = Gamma = \n \n Gamma text . \n"
WIKI_TEST = " \n = Delta = \n \n Delta text is short . \n"

M30K = {
    "train": (["Ein Hund läuft.", "Zwei Männer, die reden."], ["A dog runs.", "Two men talking."]),
    "val": (["Eine Katze."], ["A cat."]),
    "test_2016_flickr": (["Ein Kind spielt."], ["A child plays."]),
    "test_2017_flickr": (["Ein Mann."], ["A man."]),
    "test_2017_mscoco": (["Ein Bus."], ["A bus."]),
}


def _gz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode("utf-8")))


def _txt(path: Path, text: str, encoding: str = "utf-8") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding))


def write_wikitext(root: Path) -> None:
    _gz(root / "wikitext-2" / "train.txt.gz", WIKI_TRAIN)
    _txt(root / "wikitext-2" / "valid.txt", WIKI_VALID)
    _txt(root / "wikitext-2" / "test.txt", WIKI_TEST)


def write_multi30k(root: Path) -> None:
    for stem, (de, en) in M30K.items():
        _gz(root / "multi30k" / "raw" / f"{stem}.de.gz", "".join(s + "\n" for s in de))
        _gz(root / "multi30k" / "raw" / f"{stem}.en.gz", "".join(s + "\n" for s in en))


def write_glue(root: Path) -> None:
    g = root / "glue"
    # CoLA: train/dev have NO header; test has one.
    _txt(g / "CoLA/train.tsv", "gj04\t1\t\tThe cat sat.\ngj04\t0\t*\tCat the sat.\n")
    _txt(g / "CoLA/dev.tsv", "gj04\t1\t\tIt rains.\ngj04\t0\t*\tRains it the.")  # no trailing newline
    _txt(g / "CoLA/test.tsv", "index\tsentence\n0\tBill whistled.\n1\tThe car honked.\n")
    _txt(g / "SST-2/train.tsv", 'sentence\tlabel\nhide new " secretions \t0\na great film \t1\n')
    _txt(g / "SST-2/dev.tsv", "sentence\tlabel\nit 's charming . \t1\n")
    _txt(g / "SST-2/test.tsv", "index\tsentence\n7\tuneasy mishmash .\n")
    # MRPC: train/dev start with a UTF-8 BOM; test has an index column and no BOM.
    hdr = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    _txt(g / "MRPC/train.tsv", "\ufeff" + hdr + '1\t1\t2\tHe said "yes.\tHe agreed.\n0\t3\t4\tA b.\tC d.\n')
    _txt(g / "MRPC/dev.tsv", "\ufeff" + hdr + "1\t5\t6\tSame.\tSame thing.\n")
    _txt(g / "MRPC/test.tsv", "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t7\t8\tX.\tY.\n")
    sts = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
    _txt(g / "STS-B/train.tsv", sts + "\tscore\n0\tmain\tMSRvid\t2012\t0001\tnone\tnone\tA plane.\tAn airplane.\t5.0\n")
    _txt(g / "STS-B/dev.tsv", sts + "\tscore\n0\tmain\tMSRvid\t2012\t0000\tnone\tnone\tA man.\tA guy.\t3.750\n")
    _txt(g / "STS-B/test.tsv", sts + "\n0\tmain\tMSRvid\t2012\t0024\tnone\tnone\tA girl.\tA kid.\n")
    _txt(g / "QQP/train.tsv", "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n10\t1\t2\tWhy?\tHow come?\t1\n")
    _txt(g / "QQP/dev.tsv", "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n11\t3\t4\tWho?\tWhat?\t0\n")
    _txt(g / "QQP/test.tsv", "id\tquestion1\tquestion2\n0\tWhen?\tWhere?\n")
    mn = "\t".join(
        ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse"]
        + ["sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]
    )
    row = "0\t1\t1e\tgov\tb\tb\tp\tp\t"
    _txt(g / "MNLI/train.tsv", mn + "\tlabel1\tgold_label\n" + row + "P one.\tH one.\tneutral\tneutral\n")
    dev_h = mn + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n"
    _txt(g / "MNLI/dev_matched.tsv", dev_h + row + "P m.\tH m.\tx\tx\tx\tx\tx\tcontradiction\n")
    _txt(g / "MNLI/dev_mismatched.tsv", dev_h + row + "P mm.\tH mm.\tx\tx\tx\tx\tx\tentailment\n")
    nli = "index\tsentence1\tsentence2\tlabel\n"
    _txt(g / "RTE/train.tsv", nli + "0\tA.\tB.\tnot_entailment\n1\tC.\tD.\tentailment\n")
    _txt(g / "RTE/dev.tsv", nli + "0\tE.\tF.\tentailment\n")
    _txt(g / "RTE/test.tsv", "index\tsentence1\tsentence2\n0\tG.\tH.\n")
    _txt(g / "WNLI/train.tsv", nli + "0\tI stuck a pin.\tThe pin.\t1\n")
    _txt(g / "WNLI/dev.tsv", nli + "0\tThe drain.\tThe hair.\t0\n")
    _txt(g / "WNLI/test.tsv", "index\tsentence1\tsentence2\n0\tMaude.\tDora.\n")
    # QNLI: dev and test only (like the shared copy).
    _txt(g / "QNLI/dev.tsv", "index\tquestion\tsentence\tlabel\n0\tWhat?\tThat.\tnot_entailment\n")
    _txt(g / "QNLI/test.tsv", "index\tquestion\tsentence\n0\tWho?\tHim.\n")


def _sgm(lang: str, segs: list[str], kind: str) -> str:
    out = [f'<{kind}set setid="newstest2014" srclang="any" trglang="{lang}">']
    out.append('<doc docid="d1" genre="news" origlang="de">')
    for i, s in enumerate(segs[:2], start=1):
        out.append(f'<seg id="{i}">{s}</seg>')
    out.append("</doc>")
    out.append('<doc docid="d2" genre="news" origlang="en">')
    for i, s in enumerate(segs[2:], start=1):
        out.append(f'<seg id="{i}">{s}</seg>')
    out.append("</doc>")
    out.append(f"</{kind}set>")
    return "\n".join(out) + "\n"


NT_DE = ["Gutach: Noch mehr Sicherheit", "Standard &amp; Poor&apos;s &lt;AG&gt;", "Er sagte &quot;ja&quot; &#228; & so"]
NT_EN = ["Gutach: Increased safety", "Standard & Poor's <AG>", "He said &#x22;yes&#x22;"]


def write_newstest(root: Path) -> None:
    d = root / "wmt14-newstest2014"
    _txt(d / "newstest2014-deen-src.de.sgm", _sgm("de", NT_DE, "src"))
    _txt(d / "newstest2014-deen-ref.en.sgm", _sgm("en", NT_EN, "ref"))
    _txt(d / "newstest2014-deen-src.en.sgm", _sgm("en", NT_EN, "src"))
    _txt(d / "newstest2014-deen-ref.de.sgm", _sgm("de", NT_DE, "ref"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "data"
    write_wikitext(r)
    _txt(r / "tinyshakespeare" / "input.txt", "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 2)
    write_multi30k(r)
    write_glue(r)
    write_newstest(r)
    return r


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------------------------
# Language modelling


def test_wikitext_local_splits_documents_fingerprint(root):
    c = load_lm_corpus("wikitext-2", data_dir=root)
    assert c.name == "wikitext-2" and c.level == "word" and c.unk_token == "<unk>"
    assert c.train == WIKI_TRAIN and c.valid == WIKI_VALID and c.test == WIKI_TEST
    assert len(c.lines("train")) == WIKI_TRAIN.count("\n")
    assert c.num_words_with_eos("valid") == sum(len(x.split()) + 1 for x in WIKI_VALID.split("\n")[:-1])
    docs = c.documents["train"]
    assert len(docs) == 2  # section headings " = = History = = " do not start an article
    assert docs[0].startswith(" \n = Alpha Article = \n") and "= = History = =" in docs[0]
    assert docs[1].startswith(" = Beta Article = \n")
    assert "".join(docs) == c.train
    assert [len(c.documents[s]) for s in ("valid", "test")] == [1, 1]
    fp = c.fingerprint
    assert fp["source"] == "local" and fp["dataset"] == "wikitext-2"
    assert fp["files"] == {
        "train.txt.gz": sha(root / "wikitext-2/train.txt.gz"),
        "valid.txt": sha(root / "wikitext-2/valid.txt"),
        "test.txt": sha(root / "wikitext-2/test.txt"),
    }


def test_split_wikitext_documents_edge_cases():
    assert split_wikitext_documents("") == []
    text = " \n = A = \n \n x \n \n = B = \n \n y"
    assert split_wikitext_documents(text) == [" \n = A = \n \n x \n \n", " = B = \n \n y"]


def test_title_shaped_lines_inside_an_article_do_not_end_it():
    """WikiText-2's articles hold table legends and formula lines shaped like a title (' = Goals ; A = '); a title
    stands between blank lines and is not one of a run of such rows, so the article goes on past them."""
    legend = " = Goals ; A = \n = Assists ; Pts = \n"
    text = (" \n = A = \n \n x . \n \n = = Stats = = \n \n" + legend + " y . \n \n"
            " = Points ; GP = \n \n = Games played = \n z . \n \n = B = \n \n w . \n")
    docs = split_wikitext_documents(text)
    assert len(docs) == 2 and "".join(docs) == text
    assert docs[1].startswith(" = B = ") and "y ." in docs[0] and "z ." in docs[0]


def test_wikitext_alternative_file_names_and_dataset_folder(tmp_path):
    d = tmp_path / "wt"
    _txt(d / "wiki.train.tokens", WIKI_TRAIN)
    _txt(d / "wiki.valid.tokens", WIKI_VALID)
    _gz(d / "wiki.test.tokens.gz", WIKI_TEST)
    c = load_lm_corpus("wikitext-2", data_dir=d)  # data_dir may point straight at the dataset folder
    assert c.test == WIKI_TEST
    assert set(c.fingerprint["files"]) == {"wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens.gz"}


def test_env_var_and_explicit_data_dir_precedence(root, tmp_path, monkeypatch):
    other = tmp_path / "other"
    _gz(other / "wikitext-2" / "train.txt.gz", " = Other = \n")
    _txt(other / "wikitext-2" / "valid.txt", " v \n")
    _txt(other / "wikitext-2" / "test.txt", " t \n")
    monkeypatch.setenv("STUDY_DATA_DIR", str(other))
    assert load_lm_corpus("wikitext-2").train == " = Other = \n"
    assert load_lm_corpus("wikitext-2", data_dir=root).train == WIKI_TRAIN  # explicit beats the env var


def test_tinyshakespeare_nanogpt_split(root):
    c = load_lm_corpus("tinyshakespeare", data_dir=root)
    full = (root / "tinyshakespeare/input.txt").read_text()
    cut = int(len(full) * 0.9)
    assert c.train == full[:cut] and c.valid == full[cut:]
    assert set(c.splits) == {"train", "valid"} and c.level == "char" and c.documents is None
    with pytest.raises(KeyError, match="no test split"):
        c.test
    assert "no test split" in c.fingerprint["split"]
    assert "there is no test split" in load_lm_corpus.__doc__.replace("**", "")


def test_unknown_corpus_names():
    with pytest.raises(DataError, match="unknown language-modelling corpus"):
        load_lm_corpus("ptb")
    with pytest.raises(DataError, match="unknown translation corpus"):
        load_translation("iwslt14")
    with pytest.raises(DataError, match="unknown GLUE task"):
        load_glue("SQuAD")


# --------------------------------------------------------------------------------------------------------------------
# Errors: offline hub, missing files, malformed files


@pytest.mark.parametrize(
    "load, name, expected, hub_id",
    [
        (lambda: load_lm_corpus("wikitext-2"), "wikitext-2", "wikitext-2/train.txt.gz", "Salesforce/wikitext"),
        (
            lambda: load_lm_corpus("tinyshakespeare"),
            "tinyshakespeare",
            "tinyshakespeare/input.txt",
            "karpathy/tiny_shakespeare",
        ),
        (lambda: load_translation("multi30k"), "multi30k", "multi30k/raw/train.de.gz", "bentrevett/multi30k"),
        (
            lambda: load_newstest2014("de", "en"),
            "wmt14-newstest2014",
            "wmt14-newstest2014/newstest2014-deen-src.de.sgm",
            "wmt/wmt14",
        ),
        (lambda: load_glue("SST-2"), "GLUE SST-2", "glue/SST-2/train.tsv", "nyu-mll/glue"),
    ],
)
def test_offline_hub_error_names_everything(load, name, expected, hub_id):
    t0 = time.monotonic()
    with pytest.raises(DatasetUnavailable) as ei:
        load()
    assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert name in msg and expected in msg and hub_id in msg
    assert "--data-dir" in msg and "STUDY_DATA_DIR" in msg and "offline" in msg
    assert isinstance(ei.value, DataError) and isinstance(ei.value, ValueError)
    assert ei.value.hub_id.startswith(hub_id) and any(expected in f for f in ei.value.expected_files)


def test_unreachable_hub_fails_fast(monkeypatch):
    # Not offline, but the endpoint is a closed local port: the hub attempt must fail within the short timeout.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("STUDY_HUB_TIMEOUT", "2")
    t0 = time.monotonic()
    with pytest.raises(DatasetUnavailable) as ei:
        load_lm_corpus("tinyshakespeare")
    assert time.monotonic() - t0 < 15
    assert "could not reach the hub for karpathy/tiny_shakespeare" in str(ei.value)


def test_missing_file_is_named(root):
    missing = root / "multi30k" / "raw" / "val.en.gz"
    missing.unlink()
    with pytest.raises(DatasetUnavailable) as ei:
        load_translation("multi30k", "de", "en", data_dir=root)
    assert str(missing) in str(ei.value) and str(missing) in ei.value.missing_files
    assert "multi30k/raw/val.en.gz" in str(ei.value)


def test_missing_data_dir_is_named(tmp_path):
    with pytest.raises(DatasetUnavailable, match="does not exist"):
        load_lm_corpus("wikitext-2", data_dir=tmp_path / "nope")


def test_malformed_utf8_names_file_and_line(root):
    p = root / "wikitext-2" / "valid.txt"
    p.write_bytes(b" \n = Gamma = \n bad \xff byte \n")
    with pytest.raises(MalformedDataError) as ei:
        load_lm_corpus("wikitext-2", data_dir=root)
    assert ei.value.path == p and ei.value.line == 3
    assert str(p) in str(ei.value) and "line 3" in str(ei.value)


def test_malformed_gzip_names_file(root):
    p = root / "wikitext-2" / "train.txt.gz"
    p.write_bytes(b"this is not gzip")
    with pytest.raises(MalformedDataError, match="not a valid gzip file") as ei:
        load_lm_corpus("wikitext-2", data_dir=root)
    assert str(p) in str(ei.value)


# --------------------------------------------------------------------------------------------------------------------
# Translation


def test_multi30k_local(root):
    c = load_translation("multi30k", "de", "en", data_dir=root)
    assert list(c.splits) == ["train", "valid", "test_2016_flickr", "test_2017_flickr", "test_2017_mscoco"]
    assert c.train == [("Ein Hund läuft.", "A dog runs."), ("Zwei Männer, die reden.", "Two men talking.")]
    assert c.sources("valid") == ["Eine Katze."] and c.targets("valid") == ["A cat."]
    assert list(c.texts("valid")) == ["Eine Katze.", "A cat."]
    assert c.fingerprint["source"] == "local" and len(c.fingerprint["files"]) == 10
    assert c.fingerprint["files"]["raw/train.de.gz"] == sha(root / "multi30k/raw/train.de.gz")
    rev = load_translation("multi30k", "en", "de", data_dir=root)
    assert rev.train[0] == ("A dog runs.", "Ein Hund läuft.")
    # test_2018_flickr is optional and loaded when present
    _gz(root / "multi30k/raw/test_2018_flickr.de.gz", "Ein Boot.\n")
    _gz(root / "multi30k/raw/test_2018_flickr.en.gz", "A boat.\n")
    c2 = load_translation("multi30k", "de", "en", data_dir=root)
    assert c2.splits["test_2018_flickr"] == [("Ein Boot.", "A boat.")]


def test_multi30k_requires_only_the_splits_a_run_reads(root):
    """A folder with train, val and the 2016 test set serves a run that scores only that test set (offline it was
    refused for the 2017 files, online replaced by the hub's copy); a test set it asks for and lacks is named."""
    for stem in ("test_2017_flickr", "test_2017_mscoco"):
        for lang in ("de", "en"):
            (root / f"multi30k/raw/{stem}.{lang}.gz").unlink()
    c = load_translation("multi30k", "de", "en", data_dir=root, needed=("train", "valid", "test_2016_flickr"))
    assert list(c.splits) == ["train", "valid", "test_2016_flickr"] and c.fingerprint["source"] == "local"
    with pytest.raises(DatasetUnavailable) as ei:
        load_translation("multi30k", "de", "en", data_dir=root, needed=("train", "valid", "test_2018_flickr"))
    assert "multi30k/raw/test_2018_flickr.de.gz" in str(ei.value)
    with pytest.raises(DatasetUnavailable):  # no `needed`: every split but the optional 2018 one, as before
        load_translation("multi30k", "de", "en", data_dir=root)


def test_czech_multi30k_has_no_2017_test_sets_and_loads_without_them(root):
    """Czech joined Multi30k in 2018: its release has train, val, test_2016_flickr and test_2018_flickr only."""
    for stem in ("train", "val", "test_2016_flickr", "test_2018_flickr"):
        _gz(root / f"multi30k/raw/{stem}.cs.gz", "".join("Pes.\n" for _ in M30K.get(stem, [["."]])[0]))
    _gz(root / "multi30k/raw/test_2018_flickr.en.gz", "A dog.\n")
    _gz(root / "multi30k/raw/test_2018_flickr.de.gz", "Ein Hund.\n")
    c = load_translation("multi30k", "en", "cs", data_dir=root)
    assert list(c.splits) == ["train", "valid", "test_2016_flickr", "test_2018_flickr"]
    assert not any(".cs" in f and "2017" in f for f in c.fingerprint["files"])
    assert "test_2017_flickr" in load_translation("multi30k", "en", "de", data_dir=root).splits  # de still has them


def test_multi30k_line_count_mismatch_names_both_files(root):
    de, en = root / "multi30k/raw/val.de.gz", root / "multi30k/raw/val.en.gz"
    _gz(de, "Eins.\nZwei.\n")
    with pytest.raises(MalformedDataError) as ei:
        load_translation("multi30k", "de", "en", data_dir=root)
    msg = str(ei.value)
    assert str(de) in msg and str(en) in msg and "2 lines" in msg and "1 lines" in msg


def test_multi30k_bad_languages():
    with pytest.raises(DataError):
        load_translation("multi30k", "de", "de")


def test_newstest2014_sgml(root):
    c = load_newstest2014("de", "en", data_dir=root)
    assert c.name == "newstest2014" and list(c.splits) == ["test"]
    assert c.sources("test") == ["Gutach: Noch mehr Sicherheit", "Standard & Poor's <AG>", 'Er sagte "ja" ä & so']
    assert c.targets("test") == ["Gutach: Increased safety", "Standard & Poor's <AG>", 'He said "yes"']
    r = load_newstest2014("en", "de", data_dir=root)
    assert r.splits["test"][1] == ("Standard & Poor's <AG>", "Standard & Poor's <AG>")
    assert set(r.fingerprint["files"]) == {"newstest2014-deen-src.en.sgm", "newstest2014-deen-ref.de.sgm"}


def test_newstest2014_malformed_and_misaligned(root):
    p = root / "wmt14-newstest2014" / "newstest2014-deen-ref.en.sgm"
    lines = p.read_text().split("\n")
    lines[3] = '<seg id="2">unterminated'
    p.write_text("\n".join(lines))
    with pytest.raises(MalformedDataError) as ei:
        load_newstest2014("de", "en", data_dir=root)
    assert ei.value.line == 4 and str(p) in str(ei.value)
    p.write_text(_sgm("en", NT_EN[:2], "ref"))
    with pytest.raises(MalformedDataError, match="segment counts differ"):
        load_newstest2014("de", "en", data_dir=root)


# --------------------------------------------------------------------------------------------------------------------
# GLUE


def test_glue_metadata():
    assert GLUE_TASK_NAMES == ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE", "WNLI")
    assert glue_task_info("cola").metrics == ("mcc",)
    assert glue_task_info("sst2").metrics == ("accuracy",)
    assert glue_task_info("MRPC").metrics == ("f1", "accuracy")
    assert glue_task_info("sts-b").metrics == ("pearson", "spearman")
    assert glue_task_info("stsb").is_regression and glue_task_info("STS-B").num_labels == 1
    assert glue_task_info("qqp").metrics == ("f1", "accuracy")
    mnli = glue_task_info("mnli")
    assert mnli.num_labels == 3 and mnli.eval_splits == ("dev_matched", "dev_mismatched")
    assert mnli.test_splits == ("test_matched", "test_mismatched", "diagnostic")
    for t in ("QNLI", "RTE", "WNLI"):
        assert glue_task_info(t).metrics == ("accuracy",) and glue_task_info(t).num_labels == 2


def test_glue_local_quirks(root):
    cola = load_glue("CoLA", data_dir=root)
    assert len(cola["train"]) == 2 and len(cola["dev"]) == 2  # no header row eaten, no trailing newline needed
    assert cola["train"][0].text_a == "The cat sat." and cola["train"][0].label == 1 and cola["train"][0].text_b is None
    assert cola["test"][1].label is None and cola["test"][1].idx == 1
    sst = load_glue("sst-2", data_dir=root)
    assert sst["train"][0].text_a == 'hide new " secretions ' and sst["train"][0].label == 0  # QUOTE_NONE
    assert sst["test"][0].idx == 7 and sst["test"][0].label is None
    mrpc = load_glue("mrpc", data_dir=root)  # BOM before the header
    assert mrpc["train"][0].text_a == 'He said "yes.' and mrpc["train"][0].text_b == "He agreed."
    assert [e.label for e in mrpc["train"]] == [1, 0] and mrpc["dev"][0].idx == 0
    sts = load_glue("STS-B", data_dir=root)
    assert sts["dev"][0].label == pytest.approx(3.75) and isinstance(sts["dev"][0].label, float)
    assert sts.is_regression and sts["test"][0].label is None
    qqp = load_glue("QQP", data_dir=root)
    assert qqp["train"][0].label == 1 and qqp["train"][0].idx == 10 and qqp["test"][0].text_b == "Where?"
    mnli = load_glue("MNLI", data_dir=root)
    assert mnli["train"][0].label == 1 and mnli["dev_matched"][0].label == 2 and mnli["dev_mismatched"][0].label == 0
    assert mnli.unavailable_splits == ("test_matched", "test_mismatched", "diagnostic")
    rte = load_glue("RTE", data_dir=root)
    assert [e.label for e in rte["train"]] == [1, 0] and rte.label_names == ("entailment", "not_entailment")
    wnli = load_glue("WNLI", data_dir=root)
    assert wnli["dev"][0].label == 0 and wnli.metrics == ("accuracy",)
    fp = wnli.fingerprint
    assert fp["source"] == "local" and fp["task"] == "WNLI"
    assert fp["files"]["WNLI/dev.tsv"] == sha(root / "glue/WNLI/dev.tsv")


def test_glue_missing_task_and_suite(root):
    with pytest.raises(DatasetUnavailable) as ei:
        load_glue("QNLI", data_dir=root)
    msg = str(ei.value)
    assert "QNLI" in msg and "glue/QNLI/train.tsv" in msg and "nyu-mll/glue" in msg
    assert "STUDY_DATA_DIR" in msg and "--data-dir" in msg
    assert str(root / "glue/QNLI/train.tsv") in ei.value.missing_files
    dev_only = load_glue("QNLI", data_dir=root, splits=["dev"])
    assert list(dev_only.splits) == ["dev"] and dev_only["dev"][0].label == 1
    (root / "glue/WNLI/train.tsv").unlink()
    loaded, skipped = load_glue_suite(data_dir=root)
    assert set(skipped) == {"QNLI", "WNLI"}
    assert set(loaded) == {"CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "RTE"}
    assert "glue/WNLI/train.tsv" in str(skipped["WNLI"])
    with pytest.raises(DataError, match="no split"):
        load_glue("RTE", data_dir=root, splits=["validation"])


def test_glue_test_split_optional(root):
    (root / "glue/RTE/test.tsv").unlink()
    rte = load_glue("RTE", data_dir=root)
    assert rte.unavailable_splits == ("test",) and set(rte.splits) == {"train", "dev"}
    with pytest.raises(DatasetUnavailable, match="RTE/test.tsv"):
        load_glue("RTE", data_dir=root, splits=["train", "test"])


def test_glue_malformed_rows_name_file_and_line(root):
    p = root / "glue/RTE/dev.tsv"
    p.write_text("index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n1\tC.\tD\textra\tentailment\n")
    with pytest.raises(MalformedDataError) as ei:
        load_glue("RTE", data_dir=root)
    assert ei.value.line == 3 and "line 3" in str(ei.value) and str(p) in str(ei.value)
    p.write_text("index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tmaybe\n")
    with pytest.raises(MalformedDataError, match="bad label 'maybe'") as ei:
        load_glue("RTE", data_dir=root)
    assert ei.value.line == 2
    p.write_text("idx\ts1\ts2\tlabel\n")
    with pytest.raises(MalformedDataError, match="missing column"):
        load_glue("RTE", data_dir=root)


# --------------------------------------------------------------------------------------------------------------------
# Tokenizers

TEXTS = [
    "Ein Hund läuft über die Straße.",
    "A dog runs across the street!",
    "Two men, talking; \"quoted\" text (with brackets) and 3.14 numbers.",
    "Zwei Männer reden über das Wetter.",
] * 5


def test_char_tokenizer_roundtrip_and_vocab(tmp_path):
    text = "Hello, World!\nSecond line: ünïcödé.\n"
    tok = build_tokenizer("char", [text], None, ["<pad>"], tmp_path, {"t": 1})
    assert tok.special_ids == {"<pad>": 0} and tok.token_to_id("<unk>") == 1
    assert all(tok.token_to_id(ch) is not None for ch in set(text))  # every character gets an id
    assert tok.vocab_size == len(set(text)) + 2
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.id_to_token(tok.encode("z")[0]) == "<unk>"  # unseen character
    assert tok.decode(tok.encode("Hz")) == "H<unk>"  # <unk> is a vocabulary entry, not a skipped special token


def test_char_tokenizer_lookup_gives_the_tokenizers_ids(tmp_path):
    # encode() looks characters up directly; it must give what the tokenizers pipeline gives, unseen characters,
    # newlines and non-BMP characters included, and hand text holding a special token's spelling to the pipeline
    tok = build_tokenizer("char", ["abc de\nf😀ü"], None, ["<pad>"], tmp_path, {"t": 2})
    for text in ("abc\n de", "zz 😀\tü\r\n", "a<pad>b<unk>c", "", "\u0130x"):
        assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids, text
    assert tok.encode("a<pad>b") == [tok.token_to_id("a"), 0, tok.token_to_id("b")]


def test_bpe_roundtrip_detokenized(tmp_path):
    tok = build_tokenizer("bpe", TEXTS, 300, ["<pad>", "<s>", "</s>"], tmp_path, {"t": 1})
    assert tok.special_ids == {"<pad>": 0, "<s>": 1, "</s>": 2}
    for s in TEXTS[:4] + ["unseen Wörter & symbols — ok?", "  leading and trailing  "]:
        assert tok.decode(tok.encode(s)) == s
    ids = [tok.special_ids["<s>"]] + tok.encode("A dog.") + [tok.special_ids["</s>"]]
    assert tok.decode(ids) == "A dog."
    assert tok.decode_batch([tok.encode("A dog."), tok.encode("Ein Hund.")]) == ["A dog.", "Ein Hund."]


def test_tokenizer_cache_reused_without_retraining(tmp_path, monkeypatch):
    fp = {"source": "local", "files": {"x": "abc"}}
    first = build_tokenizer("bpe", TEXTS, 300, ["<pad>"], tmp_path, fp)
    assert not first.from_cache and first.path is not None and first.path.is_file()
    assert first.path.parent == tmp_path and first.path.name.startswith("bpe-300-")
    assert first.path.with_name(first.path.name.replace(".json", ".meta.json")).is_file()
    mtime = first.path.stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("retrained despite a cache hit")

    def no_texts():
        raise AssertionError("texts were read despite a cache hit")
        yield ""  # pragma: no cover

    with monkeypatch.context() as m:
        m.setattr(tokmod, "_train_bpe", boom)
        second = build_tokenizer("bpe", no_texts(), 300, ["<pad>"], tmp_path, fp)
    assert second.from_cache and second.path == first.path and second.key == first.key
    assert first.path.stat().st_mtime_ns == mtime
    assert second.encode("A dog runs.") == first.encode("A dog runs.")
    # Any change to the key inputs gives a new file.
    other_vocab = build_tokenizer("bpe", TEXTS, 280, ["<pad>"], tmp_path, fp)
    other_data = build_tokenizer("bpe", TEXTS, 300, ["<pad>"], tmp_path, {**fp, "files": {"x": "def"}})
    other_special = build_tokenizer("bpe", TEXTS, 300, ["<pad>", "<s>"], tmp_path, fp)
    paths = {first.path, other_vocab.path, other_data.path, other_special.path}
    assert len(paths) == 4 and not any(t.from_cache for t in (other_vocab, other_data, other_special))


def test_tokenizer_cache_without_fingerprint_hashes_texts(tmp_path):
    a = build_tokenizer("char", iter(["abc"]), None, (), tmp_path)
    b = build_tokenizer("char", ["abc"], None, (), tmp_path)
    c = build_tokenizer("char", ["abd"], None, (), tmp_path)
    assert b.from_cache and b.path == a.path and c.path != a.path


def test_wordpiece_lowercase(tmp_path):
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = build_tokenizer("wordpiece", TEXTS, 120, specials, tmp_path, {"t": 1}, lowercase=True)
    assert tok.special_ids == {t: i for i, t in enumerate(specials)}
    assert tok.decode(tok.encode("A DOG runs")) == "a dog runs"
    cased = build_tokenizer("wordpiece", TEXTS, 120, specials, tmp_path, {"t": 1})
    assert cased.path != tok.path and "A" in cased.decode(cased.encode("A dog"))


def test_word_tokenizer_closed_vocab_with_eos(root, tmp_path):
    corpus = load_lm_corpus("wikitext-2", data_dir=root)
    tok = build_lm_tokenizer("word", corpus, None, ["<eos>"], tmp_path, newline_token="<eos>")
    words = {w for line in corpus.lines("train") for w in line.split()}
    assert tok.vocab_size == len(words) + 1  # "<unk>" is a corpus word; "<eos>" is added
    assert tok.special_ids == {"<eos>": 0} and tok.unk_token == "<unk>"
    ids = tok.encode(corpus.train)
    assert len(ids) == corpus.num_words_with_eos("train")
    assert tok.decode(tok.encode(" Alpha is unseenword . \n"), skip_special_tokens=False) == "Alpha is <unk> . <eos>"
    assert sorted(tok.tokenizer.get_vocab().values()) == list(range(tok.vocab_size))
    again = build_lm_tokenizer("word", corpus, None, ["<eos>"], tmp_path, newline_token="<eos>")
    assert again.from_cache
    small = build_tokenizer("word", ["a a a b b c"], 3, ["<pad>"], None, None)
    assert small.vocab_size == 3 and small.token_to_id("a") == 2 and small.token_to_id("c") is None


def test_tokenizer_argument_errors():
    with pytest.raises(DataError, match="unknown tokenizer kind"):
        build_tokenizer("sentencepiece", ["x"], 10)
    with pytest.raises(DataError, match="needs a positive vocab_size"):
        build_tokenizer("bpe", ["x"], None)
    with pytest.raises(DataError, match="newline_token"):
        build_tokenizer("char", ["x"], None, newline_token="<eos>")


def test_translation_tokenizers_joint_and_separate(root, tmp_path):
    corpus = load_translation("multi30k", "de", "en", data_dir=root)
    src, tgt = build_translation_tokenizers("bpe", corpus, 265, ["<pad>", "<s>", "</s>"], tmp_path)
    assert src is tgt
    for s, t in corpus.train:
        assert src.decode(src.encode(s)) == s and tgt.decode(tgt.encode(t)) == t
    s2, t2 = build_translation_tokenizers("char", corpus, None, ["<pad>"], tmp_path, joint=False)
    assert s2 is not t2 and s2.path != t2.path
    assert s2.token_to_id("ä") is not None and t2.token_to_id("ä") is None  # German-only character
    again, _ = build_translation_tokenizers("bpe", corpus, 265, ["<pad>", "<s>", "</s>"], tmp_path)
    assert again.from_cache and again.path == src.path
    assert os.path.dirname(again.path) == str(tmp_path)


# --------------------------------------------------------------------------------------------------------------------
# Hub code paths, with the hub replaced by in-memory fakes (nothing is downloaded)


class FakeSplit:
    def __init__(self, **columns):
        self._c = columns
        self.column_names = list(columns)

    def __getitem__(self, name):
        return self._c[name]

    def __len__(self):
        return len(next(iter(self._c.values())))


@pytest.fixture
def fake_hub(monkeypatch):
    """Pretend the hub is reachable: revision "rev123", and `hub_load_dataset` serves `served[(hub_id, config)]`."""
    from study.tasks.data import glue, lm, sources, translation

    served: dict = {}
    calls: list = []

    def fake_load(hub_id, config, revision, **kwargs):
        calls.append((hub_id, config, revision, kwargs))
        data = served[(hub_id, config)]
        return data[kwargs["split"]] if "split" in kwargs else data

    monkeypatch.setattr(sources, "hub_revision", lambda hub_id: "rev123")
    for mod in (lm, translation, glue):
        monkeypatch.setattr(mod, "hub_load_dataset", fake_load)
    return served, calls


def test_hub_wikitext_and_tinyshakespeare(fake_hub):
    served, calls = fake_hub
    rows = ["", " = A = \n", "", " a <unk> . \n"]
    served[("Salesforce/wikitext", "wikitext-2-v1")] = {
        s: FakeSplit(text=rows) for s in ("train", "validation", "test")
    }
    c = load_lm_corpus("wikitext-2")
    assert c.train == " \n = A = \n \n a <unk> . \n"  # the original file text, blank lines as " "
    assert c.fingerprint == {
        "source": "hub", "dataset": "Salesforce/wikitext", "config": "wikitext-2-v1", "revision": "rev123"
    }
    assert calls[-1][:3] == ("Salesforce/wikitext", "wikitext-2-v1", "rev123")
    served[("karpathy/tiny_shakespeare", None)] = {
        "train": FakeSplit(text=["x" * 90]), "validation": FakeSplit(text=["y" * 5]), "test": FakeSplit(text=["z" * 5])
    }
    ts = load_lm_corpus("tinyshakespeare")
    assert ts.train == "x" * 90 and ts.valid == "y" * 5 + "z" * 5 and "test" not in ts.splits


def test_hub_translation_and_glue(fake_hub):
    served, _ = fake_hub
    served[("bentrevett/multi30k", None)] = {
        "train": FakeSplit(en=["A dog. "], de=["Ein Hund."]),
        "validation": FakeSplit(en=["A cat."], de=["Eine Katze."]),
        "test": FakeSplit(en=["A man."], de=["Ein Mann."]),
    }
    m = load_translation("multi30k", "en", "de")
    assert m.train == [("A dog.", "Ein Hund.")] and set(m.splits) == {"train", "valid", "test_2016_flickr"}
    served[("wmt/wmt14", "de-en")] = {"test": FakeSplit(translation=[{"de": "Hallo", "en": "Hello"}])}
    assert load_newstest2014("en", "de").splits["test"] == [("Hello", "Hallo")]
    served[("nyu-mll/glue", "mnli")] = {
        s: FakeSplit(premise=["P"], hypothesis=["H"], label=[-1 if s.startswith("test") else 2], idx=[4])
        for s in ("train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched")
    }
    served[("nyu-mll/glue", "ax")] = {"test": FakeSplit(premise=["D"], hypothesis=["H"], label=[-1], idx=[0])}
    mnli = load_glue("MNLI")
    assert mnli["dev_mismatched"][0] == mnli["train"][0] and mnli["train"][0].label == 2
    assert mnli["test_matched"][0].label is None and mnli["test_matched"][0].idx == 4
    assert mnli.fingerprint["source"] == "hub" and mnli.fingerprint["config"] == "mnli"
    assert mnli["diagnostic"][0].text_a == "D" and mnli["diagnostic"][0].label is None
    served[("nyu-mll/glue", "stsb")] = {
        s: FakeSplit(sentence1=["a"], sentence2=["b"], label=[3.5], idx=[0]) for s in ("train", "validation", "test")
    }
    assert load_glue("STS-B")["dev"][0].label == 3.5


def test_local_folder_missing_files_falls_back_to_hub(fake_hub, root):
    served, _ = fake_hub
    served[("nyu-mll/glue", "qnli")] = {
        s: FakeSplit(question=["q"], sentence=["s"], label=[0], idx=[0]) for s in ("train", "validation", "test")
    }
    qnli = load_glue("QNLI", data_dir=root)  # local copy lacks train.tsv
    assert qnli.fingerprint["source"] == "hub" and len(qnli["train"]) == 1
    assert load_glue("RTE", data_dir=root).fingerprint["source"] == "local"  # complete local copy wins


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_a_vocab_size_below_what_the_tokenizer_can_have_is_refused(kind):
    """A trainer never goes below its alphabet and special tokens: a smaller vocab_size would be ignored, and a sweep
    over small sizes would train one model under many labels."""
    from study.tasks.data import DataError
    from study.tasks.data.tokenizers import build_tokenizer

    texts = ["the quick brown fox jumps over the lazy dog"] * 50
    with pytest.raises(DataError, match="vocab_size=16 is below the smallest"):
        build_tokenizer(kind, texts, vocab_size=16, special_tokens=["<pad>", "<unk>"])
    fits = 280 if kind == "bpe" else 60
    assert build_tokenizer(kind, texts, vocab_size=fits, special_tokens=["<pad>", "<unk>"]).vocab_size == fits


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_a_vocab_size_above_what_the_data_yields_is_refused(kind, tmp_path):
    """The trainer stops when no pair is left to merge: a larger vocab_size would silently train a smaller model under
    the larger size's label (and two sizes of a sweep would be one model). Refused, naming the size the data gives;
    a cached tokenizer meets the same check."""
    from study.tasks.data import DataError
    from study.tasks.data.tokenizers import build_tokenizer

    texts = ["the quick brown fox jumps over the lazy dog"] * 50
    with pytest.raises(DataError, match=r"vocab_size=2000 is more than this data yields: .* use vocab_size <= \d+"):
        build_tokenizer(kind, texts, vocab_size=2000, special_tokens=["<pad>", "<unk>"], cache_dir=tmp_path)
    assert not list(tmp_path.glob("*.json"))  # nothing cached under the size it does not have


def test_lm_text_is_cut_into_lines_at_newlines_only():
    """The word and subword tokenizers read an LM split line by line: a form feed, a file separator or U+2028 inside
    a line stays inside it (str.splitlines would cut there, and change the tokens and the perplexity's count)."""
    from study.tasks.data.sources import lines_with_ends

    plain = "a b\n\n c \r\nlast"
    assert lines_with_ends(plain) == plain.splitlines(keepends=True)
    assert lines_with_ends(plain + "\n") == (plain + "\n").splitlines(keepends=True)
    odd = "ab\x1ccd\x0cef\u2028gh\nnext\n"
    assert lines_with_ends(odd) == ["ab\x1ccd\x0cef\u2028gh\n", "next\n"] and "".join(lines_with_ends(odd)) == odd
    assert lines_with_ends("") == []
