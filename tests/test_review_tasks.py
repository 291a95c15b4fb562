"""Review of the tasks and their data: what a run trains on and what a sweep may rank by.

A GLUE objective naming a task the suite does not run, or a metric its task does not have, was accepted and failed
after every trial had fine-tuned the whole suite. `task.pretrained_weights: false` without `task.init_from` trained
the same random model as `true`. WordPiece numbered its tokens in a per-process hash order, and nothing in data.json
told two id maps apart, so a resume with another cache read its weights with other tokens' ids. WikiText-2 was cut into
629 "articles" at table legends shaped like titles, so NSP's "random next" could come from the same article."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pretrain_task import make_cfg, write_wikitext
from test_sweep_refusals import GLUE, plan_of, refused

from study.config import ConfigError, ExperimentConfig
from study.run.conflict import data_differences
from study.sweep.plan import check
from study.tasks.pretrain import PretrainDataModule

REPO = Path(__file__).resolve().parents[1]
SUITE = {**GLUE, "set": {**GLUE["set"], "task.per_task": {}, "task.glue_tasks": ["sst2", "mnli"]}}
LR = {"train.lr": [1e-3, 3e-4]}


@pytest.mark.parametrize("metric, why", [
    ("SST-2/f1", "SST-2 writes ['SST-2/score', 'SST-2/accuracy']"),  # SST-2 has no F1
    ("MNLI/accuracy", "MNLI writes ['MNLI/score', 'MNLI/accuracy_m', 'MNLI/accuracy_mm']"),  # two dev splits
    ("CoLA/mcc", "the suite runs ['SST-2', 'MNLI']"),  # a task the suite does not run
    ("SST2/accuracy", "the suite runs ['SST-2', 'MNLI']"),  # spelled otherwise than the record spells it
])
def test_a_glue_objective_the_suite_never_writes_is_refused_before_training(tmp_path, metric, why):
    text = refused(tmp_path, **SUITE, axes=LR, objective={"metric": metric})
    assert f"{metric} is never written" in text and why in text


@pytest.mark.parametrize("metric", ["SST-2/accuracy", "MNLI/accuracy_mm", "MNLI/score", "glue_score"])
def test_a_glue_objective_the_suite_writes_is_accepted(tmp_path, metric):
    check(plan_of(tmp_path, **SUITE, axes=LR, objective={"metric": metric}))


def test_random_weights_without_a_pretrained_run_are_refused_as_a_setting_that_changes_nothing():
    d = {"model": {"arch": "encoder", "objective": "mlm"},
         "task": {"name": "glue", "dataset": "sst2", "vocab_size": 1000, "pretrained_weights": False}}
    with pytest.raises(ConfigError, match="pretrained_weights: false only applies with task.init_from"):
        ExperimentConfig.from_dict(d)
    d["task"]["init_from"] = "runs/pretrained"  # the pretrained run's shape and tokenizer, random weights: valid
    ExperimentConfig.from_dict(d)


def test_a_glue_sequence_too_short_for_a_pair_and_its_text_is_refused():
    d = {"model": {"arch": "encoder", "objective": "mlm"}, "task": {"name": "glue", "dataset": "rte", "seq_len": 3}}
    with pytest.raises(ConfigError, match="seq_len: glue needs >= 4, got 3"):
        ExperimentConfig.from_dict(d)


def test_a_pretraining_batch_larger_than_an_epoch_is_refused_while_preparing(tmp_path):
    data = tmp_path / "data"
    write_wikitext(data, articles_per_split=(3, 2, 2))
    cfg = make_cfg(nsp=True, vocab_size=60)
    cfg = cfg.replace(train=cfg.train.replace(batch_size=512))
    with pytest.raises(ValueError, match="train.batch_size=512 exceeds the .* training examples of an epoch"):
        PretrainDataModule(cfg, data_dir=data, cache_dir=tmp_path / "cache").prepare()


def test_wordpiece_ids_depend_on_the_tokens_not_on_the_order_training_met_them():
    """huggingface/tokenizers#1794: WordPiece's trainer numbers tokens in a per-process hash order. Ours renumbers
    them (specials first, the rest sorted), so the same tokens get the same ids in any process, and segmentation is
    unchanged. (Ties can still pick other tokens in another process: data.json's vocab_sha256 tells those apart.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from study.tasks.data.tokenizers import _canonical_wordpiece_ids

    specials = ["[PAD]", "[UNK]", "[CLS]"]
    tokens = ["the", "cat", "##s", "sat", "##ting", "on", "mat", "c", "##at", "s", "##a", "##t"]

    def trained(order):
        tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(specials + order)}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        return tok

    one, two = trained(tokens), trained(tokens[::-1])
    pieces = one.encode("the cats sat sitting").tokens
    assert one.get_vocab() != two.get_vocab()
    one, two = (_canonical_wordpiece_ids(t, specials, "[UNK]") for t in (one, two))
    assert one.get_vocab() == two.get_vocab()
    assert [one.get_vocab()[t] for t in specials] == [0, 1, 2]
    assert one.encode("the cats sat sitting").tokens == pieces


def test_a_resume_onto_another_id_map_of_the_same_tokenizer_key_is_refused():
    """data.json names the id map (vocab_sha256) beside the tokenizer's cache key, which names only what it was
    trained from: one key, two id maps (a cache entry from before the ids were canonical) is other data. A record
    written before the digest existed says nothing about it and still resumes."""
    stored = {"source": "local", "tokenizer": "abc", "vocab_sha256": "111", "tokens": {"train": 10}}
    assert data_differences(stored, {**stored, "vocab_sha256": "222"}) == ["vocab_sha256: '111' there, '222' here"]
    older = {k: v for k, v in stored.items() if k != "vocab_sha256"}
    assert data_differences(older, {**stored, "vocab_sha256": "222"}) == []


def test_a_length_penalty_axis_under_greedy_decoding_is_refused(tmp_path):
    """At task.beam_size 1 the task decodes greedily and no length penalty applies: the points would be one model
    under several labels, and a report would find the penalty has no effect."""
    mt = {"base": str(REPO / "experiments" / "multi30k_de_en.yaml"), "set": {"train.precision": "32-true"}}
    penalty = {"task.length_penalty": [0.6, 1.0]}
    text = refused(tmp_path, **{**mt, "set": {**mt["set"], "task.beam_size": 1}}, axes=penalty)
    assert "task.length_penalty" in text and "greedy decoding" in text
    check(plan_of(tmp_path, **mt, axes=penalty))  # beam search ranks by it


def test_the_decode_length_limit_is_computed_as_fairseq_does_in_double():
    import torch

    from study.model.generate import _requested_lengths

    src = torch.ones(1, 90, dtype=torch.long)
    assert int(_requested_lengths(None, src, 1.3, 10)[0]) == int(1.3 * 90 + 10) == 127
