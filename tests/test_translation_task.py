"""The translation task end to end: Multi30k-format data -> BPE -> encoder-decoder -> beam search -> sacreBLEU,
through `study.run.run_experiment` and the run directory it writes.

The synthetic corpus is German -> English word by word from a small dictionary ("Ein roter Hund läuft." ->
"A red dog runs."), in the published file layout (multi30k/raw/{split}.{de,en}.gz), so a tiny model learns
something within ~150 steps. Everything is offline: the Hugging Face hub is never contacted.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import math
import random
from pathlib import Path

import pytest
import sacrebleu
import torch

from study.config import ConfigError, ExperimentConfig

DE_EN = {
    "det": {"Ein": "A", "Der": "The"},
    "adj": {"kleiner": "small", "großer": "big", "roter": "red", "alter": "old", "junger": "young"},
    "noun": {"Hund": "dog", "Mann": "man", "Junge": "boy", "Vogel": "bird", "Fisch": "fish"},
    "verb": {"läuft": "runs", "schläft": "sleeps", "springt": "jumps", "singt": "sings", "schwimmt": "swims"},
}
SIZES = {"train": 400, "val": 48, "test_2016_flickr": 30, "test_2017_flickr": 30, "test_2017_mscoco": 30}
TEST_SETS = ("test_2016_flickr", "test_2017_flickr", "test_2017_mscoco")
REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# The models are tiny: on a shared 2-core machine a second intra-op thread only adds contention.
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(autouse=True, scope="module")
def _offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.delenv("STUDY_DATA_DIR", raising=False)
        yield


def sentence_pairs(n: int, rng: random.Random) -> list[tuple[str, str]]:
    pairs = []
    for _ in range(n):
        words = [rng.choice(list(DE_EN["det"]))]
        if rng.random() < 0.7:
            words.append(rng.choice(list(DE_EN["adj"])))
        words += [rng.choice(list(DE_EN["noun"])), rng.choice(list(DE_EN["verb"]))]
        english = [next(d[w] for d in DE_EN.values() if w in d) for w in words]
        pairs.append((" ".join(words) + ".", " ".join(english) + "."))
    return pairs


def write_multi30k(root: Path, seed: int = 0) -> Path:
    raw = root / "multi30k" / "raw"
    raw.mkdir(parents=True)
    rng = random.Random(seed)
    for stem, n in SIZES.items():
        pairs = sentence_pairs(n, rng)
        for lang, side in (("de", 0), ("en", 1)):
            (raw / f"{stem}.{lang}.gz").write_bytes(gzip.compress("".join(p[side] + "\n" for p in pairs).encode()))
    return root


def config(**sections) -> ExperimentConfig:
    """A tiny encoder-decoder on the synthetic corpus; `sections` update model/task/train fields."""
    data = {
        "name": "tiny-multi30k",
        "model": {"arch": "encoder-decoder", "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64,
                  "max_seq_len": 64},
        # Byte-level BPE always holds the 256 byte symbols (+ 4 specials): vocab_size 320 leaves ~60 merges, which
        # makes whole words of this corpus; at vocab_size 200 the tokenizer would be character-level.
        "task": {"name": "translation", "dataset": "multi30k", "tokenizer": "bpe", "vocab_size": 320, "seq_len": 32,
                 "beam_size": 3},
        "train": {"max_steps": 150, "batch_size": 16, "lr": 5e-3, "warmup_steps": 10, "weight_decay": 0.0,
                  "label_smoothing": 0.1, "eval_every": 50, "eval_batches": None, "log_every": 5,
                  "grad_norm_every": 0, "accelerator": "cpu", "progress_bar": False},
    }
    for section, fields in sections.items():
        data[section] = {**data[section], **fields}
    return ExperimentConfig.from_dict(data)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return write_multi30k(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def trained(data_root, tmp_path_factory):
    """One 150-step run shared by the run-directory, metric and learning checks."""
    from study.run import run_experiment

    base = tmp_path_factory.mktemp("trained")
    cfg = config()
    metrics = run_experiment(cfg, base / "run", data_dir=data_root, cache_dir=base / "cache")
    return {"cfg": cfg, "run_dir": base / "run", "cache_dir": base / "cache", "metrics": metrics}


def reload(trained, data_root):
    """The run's final model inside a fresh TranslationModule, and a DataModule with the run's tokenizers."""
    from study.run import load_model
    from study.tasks.translation import TranslationDataModule, TranslationModule

    model, cfg = load_model(trained["run_dir"])
    dm = TranslationDataModule(cfg, data_dir=data_root, cache_dir=trained["cache_dir"] / "tokenizers")
    dm.prepare()
    module = TranslationModule(cfg)
    module.model = model
    return module.eval(), dm, cfg


def mean_validation_loss(module, dm) -> float:
    """Token-weighted cross-entropy over the whole validation split."""
    total = tokens = 0.0
    with torch.no_grad():
        for b in dm.val_dataloader():
            loss, n = module.validation_loss(b)
            total, tokens = total + float(loss) * n, tokens + n
    return total / tokens


# --------------------------------------------------------------------------------------------------------------------
# The run directory and its metrics


def test_run_directory_holds_every_artifact(trained, data_root):
    run_dir, metrics = trained["run_dir"], trained["metrics"]
    for name in ("config.yaml", "env.json", "data.json", "metrics.json", "model.pt", "checkpoints/last.ckpt"):
        assert (run_dir / name).is_file(), name
    csvs = list((run_dir / "logs").rglob("metrics.csv"))
    assert len(csvs) == 1

    assert json.loads((run_dir / "metrics.json").read_text()) == json.loads(json.dumps(metrics))
    assert metrics["status"] == "completed" and metrics["steps"] == 150 and metrics["stopped_by"] is None
    assert metrics["train_tokens"] > 0

    # config.yaml is the resolved experiment: the given one plus the vocabulary the tokenizer produced
    saved = ExperimentConfig.from_yaml((run_dir / "config.yaml").read_text())
    assert saved.task == trained["cfg"].task and saved.train == trained["cfg"].train
    assert saved.model == trained["cfg"].model.replace(vocab_size=saved.model.vocab_size)
    assert saved.model.vocab_size >= 260  # 256 byte symbols + 4 specials at least

    env = json.loads((run_dir / "env.json").read_text())
    assert {"git", "packages", "device", "precision"} <= set(env) and "sacrebleu" in env["packages"]
    data = json.loads((run_dir / "data.json").read_text())
    train_de = data_root / "multi30k" / "raw" / "train.de.gz"
    assert data["files"]["raw/train.de.gz"] == hashlib.sha256(train_de.read_bytes()).hexdigest()
    assert len(data["tokenizer"]) == 2 and data["tokenizer"][0] == data["tokenizer"][1]  # one joint vocabulary

    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert state["token_embedding.weight"].shape == (saved.model.vocab_size, 32)
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 150 and "study" in ckpt


def test_metrics_report_bleu_and_chrf_per_test_set_with_signatures(trained):
    final = trained["metrics"]["metrics"]
    assert set(final["test_sets"]) == set(TEST_SETS)
    for split in TEST_SETS:
        r = final["test_sets"][split]
        assert 0.0 <= r["bleu"] <= 100.0 and 0.0 < r["chrf"] <= 100.0
        assert "tok:13a" in r["bleu_signature"] and "case:mixed" in r["bleu_signature"]
        assert "nrefs:1" in r["bleu_signature"] and "version:" in r["bleu_signature"]
        assert "case:mixed" in r["chrf_signature"]
        assert r["sentences"] == SIZES[split] and len(r["examples"]) == 5
    assert final["bleu"] == final["test_sets"]["test_2016_flickr"]["bleu"]
    assert final["chrf"] == final["test_sets"]["test_2016_flickr"]["chrf"]


def test_reported_bleu_is_sacrebleu_on_the_models_own_translations(trained, data_root):
    module, dm, cfg = reload(trained, data_root)
    final = trained["metrics"]["metrics"]["test_sets"]
    some_words = False
    for split in TEST_SETS:
        sources, refs = dm.corpus.sources(split), dm.corpus.targets(split)
        hyps = module.translate(sources, dm)  # beam search with the run's settings, detokenized
        assert len(hyps) == len(refs) and all(isinstance(h, str) for h in hyps)
        assert final[split]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
        assert final[split]["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
        examples = final[split]["examples"]
        assert [e["hypothesis"] for e in examples] == hyps[:5]
        assert [e["reference"] for e in examples] == refs[:5] and [e["source"] for e in examples] == sources[:5]
        some_words |= any(h.split() for h in hyps)
    assert some_words
    # and the agreement is not the trivial 0 == 0: the model has learned some of the word mapping
    assert trained["metrics"]["metrics"]["bleu"] > 0.0


def test_the_sacrebleu_command_line_rescores_the_saved_hypotheses(trained, data_root, tmp_path):
    """hypotheses/<test set>.en holds the detokenized translations; the `sacrebleu` CLI on them against the
    references gives the recorded score and signature."""
    import subprocess
    import sys

    _, dm, _ = reload(trained, data_root)
    final = trained["metrics"]["metrics"]["test_sets"]
    for split in TEST_SETS:
        hyp_file = trained["run_dir"] / "hypotheses" / f"{split}.en"
        assert len(hyp_file.read_text().splitlines()) == SIZES[split]
        ref_file = tmp_path / f"{split}.ref.en"
        ref_file.write_text("".join(r + "\n" for r in dm.corpus.targets(split)))
        out = subprocess.run([sys.executable, "-m", "sacrebleu", str(ref_file), "-i", str(hyp_file), "-m", "bleu",
                              "chrf", "-w", "6"], capture_output=True, text=True, check=True).stdout
        bleu, chrf = json.loads(out)
        assert bleu["score"] == pytest.approx(final[split]["bleu"], abs=1e-5)
        assert chrf["score"] == pytest.approx(final[split]["chrf"], abs=1e-5)
        assert bleu["signature"] == final[split]["bleu_signature"]
        assert chrf["signature"] == final[split]["chrf_signature"]


def test_decoding_records_the_kv_cache_it_measured(trained, data_root):
    """kv_cache_peak_bytes is read off the cache's tensors while the test set is decoded: K and V of 2 heads in
    float32 for every position held (each beam's tokens, each sentence's memory once), and decoding again measures
    the same."""
    module, dm, cfg = reload(trained, data_root)
    recorded = trained["metrics"]["metrics"]["test_sets"]["test_2016_flickr"]["kv_cache_peak_bytes"]
    per_position = 2 * cfg.model.resolved_n_kv_heads * cfg.model.resolved_head_dim * 4  # K and V, float32
    assert recorded > 0 and recorded % per_position == 0
    stats = {}
    module.translate(dm.corpus.sources("test_2016_flickr"), dm, stats=stats)
    assert stats["kv_cache_bytes"] == recorded


def test_training_reduced_the_validation_loss(trained, data_root):
    import lightning as L

    from study.tasks.translation import TranslationModule

    module, dm, cfg = reload(trained, data_root)
    trained_loss = mean_validation_loss(module, dm)
    L.seed_everything(cfg.train.seed, verbose=False)  # as run_experiment does before building the model
    untrained_loss = mean_validation_loss(TranslationModule(cfg).eval(), dm)
    assert untrained_loss > 0.8 * math.log(cfg.model.vocab_size)  # near uniform at initialisation
    assert trained_loss < 0.5 * untrained_loss

    # the logged curve: evaluations at steps 50, 100, 150 on the whole validation split, falling, and the last
    # one is the (unsmoothed) cross-entropy recomputed here from model.pt
    rows = list(csv.DictReader(next((trained["run_dir"] / "logs").rglob("metrics.csv")).open()))
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(val) == 3 and val[0] > val[-1]
    assert val[-1] == pytest.approx(trained_loss, rel=1e-4)
    train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert train[0] > train[-1]


def test_the_run_writes_the_validation_loss_a_tuning_may_choose_by(trained, data_root):
    """valid_loss is the final model's mean token cross-entropy over the whole validation split, as validation
    computes it: the objective a tuning may choose by, since BLEU and chrF are measured on the test sets."""
    recorded = trained["metrics"]["metrics"]["valid_loss"]
    assert math.isfinite(recorded) and recorded > 0
    module, dm, _ = reload(trained, data_root)
    assert recorded == pytest.approx(mean_validation_loss(module, dm), rel=1e-5)
    assert trained["metrics"]["declared"]["valid_loss"]["split"] == "valid"
    assert trained["metrics"]["declared"]["bleu"]["split"] == "test"


def test_decoding_records_the_translations_cut_at_their_length_limit(trained, data_root):
    """Beside the sources cut to the positions, each test set records how many translations ended because EOS was
    forced at their length limit (and how many of those limits the position table lowered): cut translations."""
    final = trained["metrics"]["metrics"]["test_sets"]
    for split in TEST_SETS:
        r = final[split]
        assert 0 <= r["length_capped_by_positions"] <= r["hypotheses_at_length_limit"] <= r["sentences"]
    # a limit of a * |src| + b = 1 token cuts every greedy translation: each reference has four words and a full
    # stop (beam search may prefer an empty hypothesis the model chose to end, which is no cut)
    module, dm, cfg = reload(trained, data_root)
    module.cfg = cfg.replace(task=cfg.task.replace(max_len_a=0.0, max_len_b=1))
    stats: dict = {}
    module.translate(dm.corpus.sources("test_2016_flickr"), dm, beam_size=1, stats=stats)
    assert (stats["hypotheses_at_length_limit"], stats["length_capped_by_positions"]) == (SIZES["test_2016_flickr"], 0)


def test_a_finished_run_is_not_repeated(trained, data_root):
    from study.run import run_experiment

    model_pt = trained["run_dir"] / "model.pt"
    before = model_pt.stat().st_mtime_ns
    again = run_experiment(trained["cfg"], trained["run_dir"], data_dir=data_root, cache_dir=trained["cache_dir"])
    assert again == json.loads(json.dumps(trained["metrics"]))
    assert model_pt.stat().st_mtime_ns == before


# --------------------------------------------------------------------------------------------------------------------
# The loss


def test_label_smoothing_is_applied_to_the_training_loss_only(trained, data_root):
    from study.tasks.translation import IGNORE, TranslationModule

    trained_module, dm, cfg = reload(trained, data_root)  # trained weights: far from uniform predictions
    batch = dm.train_stream.make_batch(0)
    modules = {}
    for eps in (0.0, 0.1):
        modules[eps] = TranslationModule(cfg.replace(train=cfg.train.replace(label_smoothing=eps))).eval()
        modules[eps].model.load_state_dict(trained_module.model.state_dict())

    with torch.no_grad():
        plain, n = modules[0.0].training_loss(batch)
        smoothed, n2 = modules[0.1].training_loss(batch)
        logp = torch.log_softmax(modules[0.0].model(batch["src"], batch["tgt_in"], batch["src_mask"]).float(), -1)
    labels = batch["labels"]
    real = labels != IGNORE
    assert n == n2 == int(real.sum()) and bool((~real).any())  # padding is ignored, and there is some
    nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0][real]
    uniform = -logp.mean(-1)[real]  # cross-entropy against the uniform distribution over the vocabulary
    assert float(plain) == pytest.approx(float(nll.mean()), rel=1e-5)
    # Szegedy et al. 2016: target (1 - eps) one-hot + eps uniform
    assert float(smoothed) == pytest.approx(float((0.9 * nll + 0.1 * uniform).mean()), rel=1e-5)
    assert float(smoothed) > float(plain) + 0.05  # confident predictions pay for the smoothing
    # validation reports the plain cross-entropy whatever the training smoothing
    with torch.no_grad():
        assert float(modules[0.1].validation_loss(batch)[0]) == pytest.approx(float(plain), rel=1e-6)


def test_the_training_loss_is_fused_and_equals_smoothed_cross_entropy_of_the_models_logits():
    """Without train.compile the training loss is the model's fused loss (study.model.loss): the output projection
    never runs as a layer, and loss and gradients are those of cross-entropy with label smoothing on forward's
    logits, padding ignored."""
    from study.tasks.translation import BOS, EOS, IGNORE, TranslationModule, collate

    torch.manual_seed(0)
    cfg = config(model={"vocab_size": 50})
    module = TranslationModule(cfg)
    rng = random.Random(0)

    def words():
        return [rng.randrange(4, 50) for _ in range(rng.randint(2, 9))]

    batch = collate([(words(), [BOS, *words(), EOS]) for _ in range(6)])  # sentences of several lengths: padding
    assert bool((batch["labels"] == IGNORE).any()) and not bool(batch["src_mask"].all())
    params = list(module.model.parameters())

    projections = []
    hook = module.model.lm_head.register_forward_hook(lambda *args: projections.append(1))
    loss, count = module.training_loss(batch)
    hook.remove()
    assert projections == [] and int(count) == int((batch["labels"] != IGNORE).sum())
    grads = torch.autograd.grad(loss, params)

    logits = module.model(batch["src"], batch["tgt_in"], batch["src_mask"])
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                              ignore_index=IGNORE, label_smoothing=cfg.train.label_smoothing)
    assert cfg.train.label_smoothing == 0.1
    torch.testing.assert_close(loss, plain, atol=1e-6, rtol=1e-5)
    for (name, _), got, expected in zip(module.model.named_parameters(), grads, torch.autograd.grad(plain, params)):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


# --------------------------------------------------------------------------------------------------------------------
# Budgets, configuration errors and data errors


def test_time_budget_stops_the_run_early(data_root, tmp_path):
    from study.run import run_experiment

    cfg = config(train={"max_steps": 100_000, "max_time_s": 1.0, "eval_every": 100_000, "log_every": 50},
                 task={"test_sets": ["test_2017_mscoco"], "beam_size": 1})
    metrics = run_experiment(cfg, tmp_path / "run", data_dir=data_root, cache_dir=tmp_path / "cache")
    assert metrics["stopped_by"] == "time" and metrics["status"] == "completed"
    assert 0 < metrics["steps"] < 100_000
    assert metrics["cost"]["fit_seconds"] < 30
    assert set(metrics["metrics"]["test_sets"]) == {"test_2017_mscoco"}  # a stopped run is still evaluated
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["stopped_by"] == "time"


@pytest.mark.parametrize("where", ["missing-folder", "no-folder-given"])
def test_missing_data_names_the_dataset_files_and_both_ways_to_provide_them(where, tmp_path):
    from study.run import run_experiment
    from study.tasks.data import DataError

    data_dir = tmp_path / "nowhere" if where == "missing-folder" else None
    with pytest.raises(DataError) as ei:
        run_experiment(config(), tmp_path / "run", data_dir=data_dir, cache_dir=tmp_path / "cache")
    msg = str(ei.value)
    assert "multi30k" in msg and "--data-dir" in msg and "STUDY_DATA_DIR" in msg
    for stem in ("train", "val", *TEST_SETS):
        for lang in ("de", "en"):
            assert f"multi30k/raw/{stem}.{lang}.gz" in msg
    assert "offline" in msg  # the hub was not tried
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


@pytest.mark.parametrize("split", ["test_2099_flickr", "test_2018_flickr"])
def test_an_unknown_test_set_fails_before_training(split, data_root, tmp_path, monkeypatch):
    import lightning as L

    from study.run import run_experiment

    def no_fit(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(L.Trainer, "fit", no_fit)
    with pytest.raises(ValueError) as ei:  # an unknown name: refused by the config; a known one absent: by the data
        run_experiment(config(task={"test_sets": ["test_2016_flickr", split]}), tmp_path / "run", data_dir=data_root,
                       cache_dir=tmp_path / "cache")
    msg = str(ei.value)
    if split == "test_2018_flickr":  # a real Multi30k test set, optional in the release and absent from this folder
        assert "missing file(s)" in msg and "multi30k/raw/test_2018_flickr.de.gz" in msg  # names the files it needs
    else:
        assert "task.test_sets" in msg and split in msg and "test_2017_mscoco" in msg  # names what is available
    assert not (tmp_path / "run" / "model.pt").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_separate_vocabularies_with_untied_embeddings(data_root, tmp_path):
    from study.run import load_model, run_experiment

    with pytest.raises(ConfigError, match="tie_embeddings"):
        config(task={"joint_vocab": False})  # tied embeddings need one joint vocabulary

    cfg = config(model={"tie_embeddings": False}, task={"joint_vocab": False, "vocab_size": 300,
                                                        "test_sets": ["test_2016_flickr"]},
                 train={"max_steps": 20, "eval_every": 10})
    metrics = run_experiment(cfg, tmp_path / "run", data_dir=data_root, cache_dir=tmp_path / "cache")
    assert metrics["status"] == "completed" and metrics["steps"] == 20
    r = metrics["metrics"]["test_sets"]["test_2016_flickr"]
    assert "tok:13a" in r["bleu_signature"] and r["chrf"] >= 0.0
    src_key, tgt_key = json.loads((tmp_path / "run" / "data.json").read_text())["tokenizer"]
    assert src_key != tgt_key  # one tokenizer per language
    model, saved = load_model(tmp_path / "run")
    assert not saved.model.tie_embeddings and not saved.task.joint_vocab
    enc, dec = model.encoder.token_embedding.weight, model.decoder.token_embedding.weight
    assert enc.data_ptr() != dec.data_ptr() and model.lm_head.proj.weight.data_ptr() != dec.data_ptr()


# --------------------------------------------------------------------------------------------------------------------
# Real data


@pytest.mark.realdata
@pytest.mark.skipif(not (REAL_DATA / "multi30k").is_dir(), reason=f"real Multi30k not found under {REAL_DATA}")
def test_real_multi30k_prepares_and_a_short_run_completes(tmp_path, monkeypatch):
    from study.run import run_experiment
    from study.tasks.translation import TranslationDataModule

    prepared = []  # the DataModule run_experiment builds (preparing it a second time would cost seconds)
    original = TranslationDataModule.prepare

    def recording_prepare(self):
        original(self)
        prepared.append(self)

    monkeypatch.setattr(TranslationDataModule, "prepare", recording_prepare)
    # learned positions with max_seq_len 64: long test sentences ask for 1.2 * |src| + 10 > 63 target tokens,
    # which decoding must cap rather than fail on
    cfg = config(task={"vocab_size": 1000, "seq_len": 48, "test_sets": ["test_2016_flickr"], "beam_size": 2},
                 train={"max_steps": 5, "eval_every": 5, "eval_batches": 2})
    metrics = run_experiment(cfg, tmp_path / "run", data_dir=REAL_DATA, cache_dir=tmp_path / "cache")

    (dm,) = prepared
    sizes = {split: len(pairs) for split, pairs in dm.corpus.splits.items()}
    assert sizes["train"] == 29_000 and sizes["valid"] == 1_014
    assert sizes["test_2016_flickr"] == 1_000 and sizes["test_2017_flickr"] == 1_000
    assert sizes["test_2017_mscoco"] == 461
    assert len(dm.encoded["train"]) == 29_000 and len(dm.encoded["valid"]) == 1_014
    assert dm.src_tok.key == dm.tgt_tok.key and 900 <= dm.src_tok.vocab_size <= 1000  # one joint BPE vocabulary
    assert dm.corpus.train[0][0].startswith("Zwei junge weiße Männer")  # raw, cased text

    assert metrics["status"] == "completed" and metrics["steps"] == 5
    r = metrics["metrics"]["test_sets"]["test_2016_flickr"]
    assert r["sentences"] == 1_000 and "tok:13a" in r["bleu_signature"] and "case:mixed" in r["bleu_signature"]
    data = json.loads((tmp_path / "run" / "data.json").read_text())
    assert "raw/train.de.gz" in data["files"]
    assert (tmp_path / "run" / "model.pt").is_file()


def test_the_validation_curve_samples_the_whole_split_not_its_shortest_sentences(data_root, tmp_path):
    """The validation batches are grouped by length (little padding); train.eval_batches then evaluates the first
    few: in one fixed order over the whole split, not the shortest sentences' batches."""
    from study.tasks.translation import TranslationDataModule

    dm = TranslationDataModule(config(train={"batch_size": 4}), data_dir=data_root, cache_dir=tmp_path)
    dm.prepare()
    batches = list(dm.val_dataloader())
    lengths = [float((b["src_mask"].sum(1) + (b["labels"] != -100).sum(1)).float().mean()) for b in batches]
    assert len(batches) >= 4 and lengths != sorted(lengths)  # not in length order
    again = list(dm.val_dataloader())
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(batches, again))  # the same order every time


def test_a_model_that_prefers_pad_and_bos_still_translates_into_words(trained, data_root, monkeypatch):
    """PAD and BOS are never targets, so the decoder never chooses them: were they chosen, detokenizing would strip
    them and leave empty or holed translations (an untrained model can rank them first). Greedy decoding, whose
    argmax is unmoved by the other tokens' shared normaliser, translates exactly as without the bias."""
    from study.tasks.translation import BOS, PAD

    module, dm, _ = reload(trained, data_root)
    sources = dm.corpus.sources("test_2016_flickr")[:20]
    plain = module.translate(sources, dm, beam_size=1)
    decode, preferred = module.model.decode, []

    def prefers_pad_and_bos(*args, **kwargs):
        logits = decode(*args, **kwargs).clone()
        logits[..., [PAD, BOS]] += 50.0
        preferred.append(set(logits[:, -1].argmax(-1).tolist()) <= {PAD, BOS})  # (the bias does take effect)
        return logits

    monkeypatch.setattr(module.model, "decode", prefers_pad_and_bos)
    assert module.translate(sources, dm, beam_size=1) == plain
    assert preferred and all(preferred)
    assert all(h.strip() for h in plain) and all(h.strip() for h in module.translate(sources, dm))  # beam search
