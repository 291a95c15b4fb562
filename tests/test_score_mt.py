"""Scoring a seq2seq checkpoint trained elsewhere on newstest2014 (the real SGML files), with a
tiny randomly initialised BART saved locally standing in for a hub model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu

from study.cli import main
from study.tasks.data import load_newstest2014
from study.tasks.score_mt import ModelUnavailable, score_newstest2014

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
pytestmark = [pytest.mark.realdata,
              pytest.mark.skipif(not DATA.is_dir(), reason="real benchmark data not found at ../shared/data")]


@pytest.fixture(scope="module")
def tiny_bart(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tokenizers import ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("bart")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["Ein Mann geht nach Hause.", "A man goes home.", "Die Katze schläft."] * 10,
                            vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>")
    cfg = transformers.BartConfig(vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=256, pad_token_id=1, bos_token_id=0,
                                  eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None)
    import torch

    torch.manual_seed(0)  # one random model every time: whether it ends sentences early is a property of its weights
    transformers.BartForConditionalGeneration(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_local_checkpoint_is_scored_with_sacrebleu_and_its_signature(tiny_bart):
    result = score_newstest2014(str(tiny_bart), "de", "en", str(DATA), beam_size=2, limit=6, max_new_tokens=8)
    assert result["sentences"] == 6 and not result["complete"] and len(result["hypotheses"]) == 6
    assert result["release"] == "full"  # the 3,003-segment set, not sacreBLEU's filtered wmt14 (same file names)
    references = [ref for _, ref in load_newstest2014("de", "en", str(DATA)).splits["test"][:6]]
    assert [e["reference"] for e in result["examples"]] == references[:5]
    expected = sacrebleu.metrics.BLEU().corpus_score(result["hypotheses"], [references]).score
    assert result["bleu"] == pytest.approx(expected)
    assert result["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert result["chrf_signature"].startswith("nrefs:1|case:mixed")
    # a random model rarely ends a sentence within 8 tokens: its outputs are stopped there, and counted
    assert result["max_new_tokens"] == 8 and result["outputs_at_max_new_tokens"] >= 5
    assert result["truncated_sources"] == 0
    # the checkpoint's own generation settings, which generate() applied, are recorded with the score
    assert result["generation_config"]["decoder_start_token_id"] == 2 and "num_beams" not in result["generation_config"]


def test_sources_over_the_tokenizers_limit_are_counted_as_cut(tiny_bart):
    import transformers

    from study.tasks.score_mt import translate

    net = transformers.AutoModelForSeq2SeqLM.from_pretrained(tiny_bart).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_bart, model_max_length=6)
    _, cuts = translate(net, tokenizer, ["Ein Mann geht nach Hause, und die Katze schläft.", "Ein"], beam_size=1,
                        max_new_tokens=4)
    assert cuts["truncated_sources"] == 1


def test_an_unloadable_model_is_a_clear_error_naming_both_ways_to_give_one(tmp_path):
    with pytest.raises(ModelUnavailable, match="no local folder .*missing-model: give the folder .* or a hub id"):
        score_newstest2014(str(tmp_path / "missing-model"), "de", "en", str(DATA), limit=2)


def test_the_cli_writes_the_result_json(tiny_bart, tmp_path, capsys):
    out = tmp_path / "score.json"
    assert main(["score-mt", str(tiny_bart), "--data-dir", str(DATA), "--limit", "3", "--beam", "1",
                 "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["sentences"] == 3 and len(saved["hypotheses"]) == 3


def test_a_checkpoint_told_its_direction_by_codes_or_a_prefix_is_refused_not_scored():
    """mBART, M2M-100 and NLLB take language codes, T5 a task prefix; score-mt sets neither, so such a model would
    translate in its default direction and be reported as a weak model."""
    from types import SimpleNamespace

    from study.tasks.score_mt import direction_problem

    def net(kind):
        return SimpleNamespace(config=SimpleNamespace(model_type=kind))

    plain = SimpleNamespace(src_lang=None)
    assert "language codes" in direction_problem(net("m2m_100"), plain, "facebook/m2m100_418M")
    assert "a task prefix" in direction_problem(net("t5"), plain, "t5-small")
    assert "language codes" in direction_problem(net("bart"), SimpleNamespace(src_lang="de_DE"), "x")
    assert direction_problem(net("marian"), plain, "Helsinki-NLP/opus-mt-de-en") is None


def test_the_two_newstest2014_releases_are_told_apart_by_their_segment_count():
    from study.tasks.data.translation import newstest2014_release

    assert (newstest2014_release(3003), newstest2014_release(2737)) == ("full", "filtered")
    assert "neither release (6 segments" in newstest2014_release(6)
