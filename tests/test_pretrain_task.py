"""BERT-style pretraining: masking statistics, NSP pair construction across documents, FULL-SENTENCES packing,
WikiText sentence splitting, the time-budgeted schedule, and a tiny end-to-end run (NSP on and off) whose run
directory carries the tokenizer. Plus a real-data smoke test on WikiText-2 (marked realdata)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from study.config import ConfigError, ExperimentConfig
from study.run import run_experiment
from study.tasks.base import TimeAwareSchedule, lr_multiplier
from study.tasks.pretrain import (
    CLS,
    IGNORE,
    MASK,
    N_SPECIAL,
    PAD,
    SEP,
    PretrainDataModule,
    full_sentences,
    mask_tokens,
    nsp_pairs,
    wikitext_sentences,
)

REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TOPICS = {
    "Ships": "the ship sailed across the sea with her crew and cargo".split(),
    "Birds": "the bird sang in the tall tree near the river bank at dawn".split(),
    "Kings": "the king ruled the old kingdom from his castle on the hill".split(),
    "Games": "the game was released for the console and sold many copies".split(),
    "Songs": "the song reached number one on the chart after its release".split(),
    "Towns": "the town grew around the market and the railway station".split(),
}


def write_wikitext(data_dir: Path, articles_per_split=(6, 3, 3), seed: int = 0) -> Path:
    """WikiText-2's format: ` = Title = ` articles, ` = = Section = = ` headings, space-tokenized sentences."""
    rng = random.Random(seed)
    folder = data_dir / "wikitext-2"
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in zip(("train", "valid", "test"), articles_per_split):
        lines = [" \n"]
        for k in range(n):
            title, words = list(TOPICS.items())[(k + (split == "valid")) % len(TOPICS)]
            lines += [f" = {title} {split} {k} = \n", " \n"]
            for section in range(2):
                if section:
                    lines += [" = = History = = \n", " \n"]
                for _ in range(4):
                    sents = [" ".join(rng.sample(words, rng.randint(4, 8))) + rng.choice([" .", " ?", " !"])
                             for _ in range(rng.randint(2, 4))]
                    lines += [" " + " ".join(sents).replace("sea", "sea @-@ side") + " \n", " \n"]
        (folder / f"{split}.txt").write_text("".join(lines))
    return folder


BASE = {
    "name": "tiny-bert",
    "model": {"arch": "encoder", "objective": "mlm", "nsp": True, "type_vocab_size": 2, "d_model": 32,
              "n_layers": 2, "n_heads": 2, "max_seq_len": 32, "norm_position": "pre"},
    "task": {"name": "pretrain", "dataset": "wikitext-2", "seq_len": 32, "vocab_size": 120},
    "train": {"max_steps": 6, "batch_size": 8, "lr": 2e-3, "warmup_steps": 1, "eval_every": 3, "eval_batches": 2,
              "log_every": 2, "grad_norm_every": 0, "progress_bar": False, "accelerator": "cpu"},
}


def make_cfg(nsp: bool = True, **task) -> ExperimentConfig:
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    d["model"]["nsp"] = nsp
    d["task"].update(task)
    return ExperimentConfig.from_dict(d)


# offline: missing files must not send the loaders to the hub; one thread: tiny models run faster on one
pytestmark = pytest.mark.usefixtures("offline_hub", "one_torch_thread")


# --- masking ------------------------------------------------------------------------------------------------------


def test_masking_statistics_on_a_large_sample():
    vocab = 1000
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(N_SPECIAL, vocab, (400, 256), generator=g)
    ids[:, 0], ids[:, 100], ids[:, -1] = CLS, SEP, SEP
    ids[::7, 200:] = PAD  # padding
    inputs, labels = mask_tokens(ids, vocab, 0.15, torch.Generator().manual_seed(1))
    maskable = ids >= N_SPECIAL
    selected = labels != IGNORE
    n = int(selected.sum())
    assert abs(n / int(maskable.sum()) - 0.15) < 0.005  # 15% of the maskable tokens (about 90k draws)
    assert not bool((selected & ~maskable).any())  # [CLS], [SEP], [PAD] never selected
    assert torch.equal(inputs[~maskable], ids[~maskable])  # ... nor changed
    assert torch.equal(labels[selected], ids[selected])  # labels are the original ids
    to_mask = int((inputs[selected] == MASK).sum())
    unchanged = int((inputs[selected] == ids[selected]).sum())
    random_ = n - to_mask - unchanged
    # a random replacement can draw the original id (1 in 995), counted as unchanged
    assert abs(to_mask / n - 0.8) < 0.01
    assert abs(unchanged / n - 0.1 - 0.1 / (vocab - N_SPECIAL)) < 0.01
    assert abs(random_ / n - 0.1) < 0.01
    assert int(inputs[selected].min()) >= N_SPECIAL - 1  # replacements are [MASK] (4) or non-special tokens
    assert not bool(((inputs < N_SPECIAL) & (inputs != MASK) & selected).any())
    assert not bool((inputs[selected & (inputs != MASK)] < N_SPECIAL).any())
    # different generators give different masks; the same one the same
    again, _ = mask_tokens(ids, vocab, 0.15, torch.Generator().manual_seed(1))
    other, _ = mask_tokens(ids, vocab, 0.15, torch.Generator().manual_seed(2))
    assert torch.equal(again, inputs) and not torch.equal(other, inputs)


def test_masking_probability_is_the_configured_one():
    ids = torch.randint(N_SPECIAL, 500, (200, 200), generator=torch.Generator().manual_seed(0))
    _, labels = mask_tokens(ids, 500, 0.4, torch.Generator().manual_seed(0))
    assert abs(float((labels != IGNORE).float().mean()) - 0.4) < 0.01


# --- pair construction --------------------------------------------------------------------------------------------


def _docs(n_docs=40, seed=0):
    """Documents whose tokens say where they come from: 100000 * (doc + 1) + 100 * sentence + position."""
    rng = random.Random(seed)
    return [[[100000 * (d + 1) + 100 * s + k for k in range(rng.randint(3, 12))] for s in range(rng.randint(4, 30))]
            for d in range(n_docs)]


def test_nsp_pairs_negatives_come_from_another_document_and_positives_continue():
    docs = _docs(150)
    pairs = nsp_pairs(docs, 61, random.Random(0))
    assert len(pairs) > 400
    for a, b, label, da, db in pairs:
        assert a and b and len(a) + len(b) <= 61
        assert {t // 100000 - 1 for t in a} == {da}  # A is from one document
        assert {t // 100000 - 1 for t in b} == {db}
        if label == 1:
            assert db != da  # a random B never comes from A's document
        else:
            assert db == da and max(a) < min(b)  # the true continuation follows A in the same document
    share = sum(p[2] for p in pairs) / len(pairs)
    assert 0.42 < share < 0.6  # half random (a bit more: single-sentence chunks must take a random B, as in BERT)


def test_nsp_pairs_are_deterministic_per_seed_and_need_two_documents():
    docs = _docs(10)
    assert nsp_pairs(docs, 30, random.Random(3)) == nsp_pairs(docs, 30, random.Random(3))
    assert nsp_pairs(docs, 30, random.Random(3)) != nsp_pairs(docs, 30, random.Random(4))
    with pytest.raises(ValueError, match="two documents"):
        nsp_pairs(docs[:1], 30, random.Random(0))


def test_full_sentences_packs_whole_sentences_across_documents():
    docs = _docs(8)
    packs = full_sentences(docs, 40)
    flat_in = [t for d in docs for s in d for t in s]
    flat_out = [t for p in packs for t in p if t != SEP]
    assert flat_out == flat_in  # every token once, in order
    assert all(1 <= len(p) <= 40 for p in packs)
    # a document boundary inside a pack is marked by [SEP]
    crossing = [p for p in packs if len({t // 100000 for t in p if t != SEP}) > 1]
    assert crossing and all(SEP in p for p in crossing)
    # sentences are not cut (each is shorter than the pack)
    starts = {s[0] for d in docs for s in d}
    assert all(p[0] in starts for p in packs)


def test_wikitext_sentences():
    article = " = Title = \n \n The ship @-@ side crew sailed . It was <unk> ! Why ? \n \n = = History = = \n A b .\n"
    assert wikitext_sentences(article) == ["The ship-side crew sailed .", "It was [UNK] !", "Why ?", "A b ."]


# --- schedule -----------------------------------------------------------------------------------------------------


def test_time_aware_schedule_decays_by_time_when_time_runs_out_first():
    cfg = make_cfg().train.replace(max_steps=1000, warmup_steps=10, max_time_s=100.0, schedule="linear", min_lr_ratio=0.0)
    elapsed = [0.0]
    mult = TimeAwareSchedule(cfg, lambda: elapsed[0])
    assert mult(0) == lr_multiplier(0, cfg)  # warm-up by steps
    assert mult(10) == pytest.approx(1.0)
    elapsed[0] = 50.0  # half the time spent, 1% of the steps
    assert mult(20) == pytest.approx(0.5, abs=0.01)
    elapsed[0] = 100.0
    assert mult(30) == pytest.approx(0.0, abs=1e-3)
    elapsed[0] = 1.0  # steps run out first: the step schedule
    assert mult(505) == pytest.approx(lr_multiplier(505, cfg))
    untimed = TimeAwareSchedule(cfg.replace(max_time_s=None), lambda: 99.0)
    assert untimed(500) == lr_multiplier(500, cfg)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_time_limited_schedule_goes_on_from_its_peak_where_a_long_warm_up_ends(schedule):
    """Warm-up took a third of the time budget: the decay shares out the two thirds left, so the rate is at its peak
    on both sides of warm-up's end (not cut at once to where a third of the budget would put it), and a run resumed
    with the time warm-up ended (the checkpoint keeps it) takes the same rates."""
    cfg = make_cfg().train.replace(max_steps=10_000, warmup_steps=100, max_time_s=90.0, schedule=schedule,
                                   min_lr_ratio=0.0)
    elapsed = [29.9]
    mult = TimeAwareSchedule(cfg, lambda: elapsed[0])
    assert mult(99) == pytest.approx(1.0)  # warm-up's last step
    elapsed[0] = 30.0
    assert mult(100) == pytest.approx(1.0, abs=1e-3)
    elapsed[0] = 60.0  # half of what warm-up left, 1% of the steps: half-way through the decay
    half = lr_multiplier(100 + (10_000 - 100) // 2, cfg)
    assert mult(110) == pytest.approx(half, abs=1e-3)
    resumed = TimeAwareSchedule(cfg, lambda: elapsed[0])
    resumed.warmup_end_s = mult.warmup_end_s
    assert resumed(110) == mult(110)
    elapsed[0] = 90.0
    assert mult(120) == pytest.approx(0.0, abs=1e-6)


# --- config -------------------------------------------------------------------------------------------------------


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="mlm_probability"):
        make_cfg(mlm_probability=1.5)
    with pytest.raises(ConfigError, match="tokenizer"):
        make_cfg(tokenizer="word")
    with pytest.raises(ConfigError, match="init_from: only applies to task.name='glue'"):
        make_cfg(init_from="runs/x")
    assert make_cfg().task.tokenizer == "wordpiece"
    with pytest.raises(ConfigError, match="nsp_weight: must be > 0"):
        make_cfg(nsp_weight=0.0)
    with pytest.raises(ConfigError, match="nsp_weight: weights the NSP loss, which model.nsp=false leaves out"):
        make_cfg(nsp=False, nsp_weight=2.0)
    from study.config import TaskConfig

    with pytest.raises(ConfigError, match="nsp_weight: only applies to task.name='pretrain'"):
        TaskConfig(name="lm", nsp_weight=2.0)


def module_and_data(cfg: ExperimentConfig, data_dir, cache_dir):
    """A PretrainModule of `cfg` (seed 0) and its prepared data module."""
    from study.tasks.pretrain import PretrainModule

    dm = PretrainDataModule(cfg, data_dir=data_dir, cache_dir=cache_dir)
    dm.prepare()
    d = cfg.to_dict()
    d["model"].update(dm.model_overrides())
    torch.manual_seed(0)
    return PretrainModule(ExperimentConfig.from_dict(d)), dm


def test_the_loss_is_mlm_plus_the_weighted_nsp_loss(wikitext, tmp_path):
    def losses(weight: float) -> dict[str, torch.Tensor]:
        module, dm = module_and_data(make_cfg(nsp=True, nsp_weight=weight), wikitext, tmp_path)
        with torch.no_grad():
            return module.losses(dm._train_batch(0))

    bert, weighted = losses(1.0), losses(3.0)
    assert torch.allclose(bert["loss"], bert["mlm_loss"] + bert["nsp_loss"])  # BERT's unweighted sum
    assert torch.allclose(weighted["mlm_loss"], bert["mlm_loss"]) and torch.allclose(weighted["nsp_loss"], bert["nsp_loss"])
    assert torch.allclose(weighted["loss"], bert["mlm_loss"] + 3.0 * bert["nsp_loss"])


def test_a_batch_with_nothing_masked_adds_no_mlm_loss_and_no_nan(wikitext, tmp_path):
    """A short last batch can draw no masked token: its MLM loss is 0 and counts 0 tokens, so an evaluation's mean
    over batches is that of the others (a mean over nothing would be NaN, poisoning the mean and, in training,
    stopping the run as diverged)."""
    from study.tasks.pretrain import masked_batch

    module, dm = module_and_data(make_cfg(nsp=True), wikitext, tmp_path)
    masked = dm._train_batch(0)
    plain = {k: v for k, v in masked.items() if k not in ("labels", "mlm_positions")}
    none = masked_batch(plain, dm.tokenizer.vocab_size, 0.0, torch.Generator().manual_seed(0))
    assert none["mlm_positions"].numel() == 0
    with torch.no_grad():
        out = module.losses(none)
    assert out["mlm_count"] == 0 and out["mlm_loss"].item() == 0.0 and torch.isfinite(out["loss"])
    alone, with_empty = module.evaluate([masked]), module.evaluate([masked, none])
    assert with_empty["mlm_loss"] == pytest.approx(alone["mlm_loss"]) and math.isfinite(with_empty["mlm_loss"])


@pytest.mark.parametrize("nsp", [True, False])
def test_every_trained_parameter_gets_a_gradient_in_each_step_as_ddp_requires(wikitext, tmp_path, nsp):
    """Under DDP a parameter that requires a gradient and gets none stops Lightning on the second step: without NSP
    the pooler (it feeds only the NSP head) is frozen; with NSP every parameter trains."""
    from study.tasks.pretrain import PretrainModule

    cfg = make_cfg(nsp=nsp)
    dm = PretrainDataModule(cfg, data_dir=wikitext, cache_dir=tmp_path)
    dm.prepare()
    d = cfg.to_dict()
    d["model"].update(dm.model_overrides())
    module = PretrainModule(ExperimentConfig.from_dict(d))
    module.training_loss(dm._train_batch(0))[0].backward()
    assert [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None] == []
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    assert frozen == ([] if nsp else ["model.pooler.weight", "model.pooler.bias"])


# --- end to end ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wikitext(tmp_path_factory):
    root = tmp_path_factory.mktemp("wt") / "data"
    write_wikitext(root)
    return root


def test_datamodule_batches(wikitext, tmp_path):
    dm = PretrainDataModule(make_cfg(nsp=True), data_dir=wikitext, cache_dir=tmp_path)
    dm.prepare()
    b = dm._train_batch(0)
    assert set(b) >= {"input_ids", "token_type_ids", "labels", "nsp_labels"}
    assert b["input_ids"].shape[1] <= 32 and bool((b["input_ids"][:, 0] == CLS).all())
    assert torch.equal(dm._train_batch(3)["input_ids"], dm._train_batch(3)["input_ids"])  # batch i is fixed
    assert (b["token_type_ids"] == 1).any()
    dm_off = PretrainDataModule(make_cfg(nsp=False), data_dir=wikitext, cache_dir=tmp_path)
    dm_off.prepare()
    b = dm_off._train_batch(0)
    assert "nsp_labels" not in b and not bool(b["token_type_ids"].any())
    assert dm_off.fingerprint["format"] == "full-sentences"


def test_every_run_is_scored_on_the_same_validation_masks_whatever_its_batch_size(wikitext, tmp_path):
    """A sweep over train.batch_size compares validation losses: each example's masks depend on the example alone,
    not on the batch it lands in or how wide that batch is padded."""
    def masked_examples(batch_size):
        cfg = make_cfg(nsp=True)
        dm = PretrainDataModule(cfg.replace(train=cfg.train.replace(batch_size=batch_size)), data_dir=wikitext,
                                cache_dir=tmp_path)
        dm.prepare()
        rows = []
        for b in dm.eval_batches("valid", nsp=True):
            for ids, labels, keep in zip(b["input_ids"], b["labels"], b["input_ids"] != PAD):
                rows.append((ids[keep].tolist(), labels[keep].tolist()))
        return rows

    four, two = masked_examples(4), masked_examples(2)
    assert len(four) > 4 and four == two
    assert any(label != IGNORE for _, labels in four for label in labels)  # something is masked


@pytest.mark.parametrize("nsp", [True, False])
def test_pretrain_end_to_end(wikitext, tmp_path, nsp):
    cfg = make_cfg(nsp=nsp)
    m = run_experiment(cfg, tmp_path / "run", data_dir=wikitext, cache_dir=tmp_path / "cache")
    assert m["status"] == "completed" and m["steps"] == 6
    r = m["metrics"]
    assert 0 < r["valid_mlm_loss"] < 10 and r["valid_masked_tokens"] > 0
    assert ("valid_nsp_accuracy" in r) == nsp
    if nsp:
        assert 0 <= r["valid_nsp_accuracy"] <= 1
    else:
        assert r["valid_mlm_loss_full_sentences"] == r["valid_mlm_loss"]
    for f in ("config.yaml", "model.pt", "tokenizer.json", "metrics.json", "data.json"):
        assert (tmp_path / "run" / f).is_file()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json"))
    resolved = ExperimentConfig.from_yaml((tmp_path / "run" / "config.yaml").read_text())
    assert tok.token_to_id("[MASK]") == MASK and tok.get_vocab_size() == resolved.model.vocab_size
    # the cost counts the MLM head on the selected 15% only, as it runs
    from study.model.accounting import flops_per_token

    seq = resolved.task.seq_len
    assert m["cost"]["train_flops_per_token"] == flops_per_token(resolved.model, seq, predicted_fraction=0.15)
    assert m["cost"]["train_flops_per_token"] < flops_per_token(resolved.model, seq)


def test_nsp_is_learned_where_the_documents_tell_apart(tmp_path):
    # The synthetic articles have disjoint vocabularies, so "is B from A's article?" is answerable from the words
    # alone; a wiring fault (labels not matching their pairs, the head reading the wrong position) stays at chance
    # (ln 2 = 0.693). 12 articles of 6 topics: a negative from the same-topic article is the rare unlearnable case.
    data = tmp_path / "data"
    write_wikitext(data, (12, 6, 3))
    d = make_cfg(nsp=True).to_dict()
    d["model"].update(d_model=64, n_heads=4)
    # One binary label per pair makes the NSP gradient noisy: at batch 8 seeds 0-5 ended at loss 0.15-0.52 after
    # 1,000 steps and another CPU's numerics gave 0.66 (a failed CI run); at batch 32, seeds 0-11 give 0.05-0.32
    # after 500 steps (accuracy 0.87-1.0), in the same time.
    d["train"].update(max_steps=500, batch_size=32, lr=1e-3, eval_every=100000, eval_batches=None)
    m = run_experiment(ExperimentConfig.from_dict(d), tmp_path / "run", data_dir=data, cache_dir=tmp_path / "cache")
    r = m["metrics"]
    assert r["valid_nsp_loss"] < 0.6 and r["valid_nsp_accuracy"] > 0.7, r


@pytest.mark.realdata
@pytest.mark.skipif(not (REAL_DATA / "wikitext-2").is_dir(), reason=f"real data not found at {REAL_DATA}")
def test_real_wikitext2_pairs_and_masks(tmp_path):
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    d["model"]["max_seq_len"] = 128
    d["task"].update(vocab_size=2000, seq_len=128)
    cfg = ExperimentConfig.from_dict(d)
    dm = PretrainDataModule(cfg, data_dir=REAL_DATA, cache_dir=tmp_path)
    dm.prepare()
    assert dm.fingerprint["documents"] == {"train": 600, "valid": 60, "test": 60}  # WikiText-2's articles
    pairs = nsp_pairs(dm.docs["train"], 125, random.Random(0))
    share = sum(p[2] for p in pairs) / len(pairs)
    assert 0.45 < share < 0.55 and all(p[3] != p[4] for p in pairs if p[2] == 1)
    b = dm._train_batch(0)
    selected = b["labels"] != IGNORE
    assert 0.1 < float(selected.sum()) / float((b["input_ids"] != PAD).sum()) < 0.2


def test_batches_walk_into_later_epochs(wikitext, tmp_path):
    cfg = make_cfg(nsp=True)
    dm = PretrainDataModule(cfg, data_dir=wikitext, cache_dir=tmp_path)
    dm.prepare()
    n0 = len(dm._epoch_examples(0)[0]) // cfg.train.batch_size
    late = dm._train_batch(n0 + 1)  # the second batch of epoch 1
    assert dm._epoch[0] == 1 and set(dm._epoch_batches) == {0, 1}
    fresh = PretrainDataModule(cfg, data_dir=wikitext, cache_dir=tmp_path)
    fresh.prepare()
    assert torch.equal(fresh._train_batch(n0 + 1)["input_ids"], late["input_ids"])  # batch i depends on i only
    assert not torch.equal(dm._train_batch(1)["input_ids"], late["input_ids"])  # epochs are built afresh
