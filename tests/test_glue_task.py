"""GLUE fine-tuning: TSV quirks reaching the model's inputs, the unavailable-task path, config and init_from
errors before training, the submission format, and a tiny pretrain -> fine-tune suite (several tasks, two
seeds, MNLI matched/mismatched) through run_experiment; the diagnostic set (AX) as an optional test split of MNLI
(local and hub) and its AX.tsv submission. Plus real-data smoke tests (marked realdata)."""

from __future__ import annotations

import copy
import json
import platform
import random
import statistics
from pathlib import Path

import pytest
import torch

from study.config import ConfigError, ExperimentConfig
from study.run import environment, run_experiment
from study.tasks.data import DatasetUnavailable, glue_task_info, load_glue
from study.tasks import family
from study.tasks.glue.data import GlueDataModule
from study.tasks.glue.module import GlueModule
from study.tasks.glue.pretrained import pretrained_config
from study.tasks.glue.submission import format_prediction
from study.tasks.pretrain import CLS, SEP
from test_data import FakeSplit
from test_pretrain_task import BASE as PRETRAIN_BASE
from test_pretrain_task import write_wikitext

REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def resolve_model(cfg):
    """The suite's config with its model taken from the pretrained run (the GLUE family's `resolve` hook)."""
    return family("glue").resolve(cfg)


GOOD = "good great fine lovely superb".split()
BAD = "bad awful poor dull boring".split()
FILL = "the film movie plot was a with and very".split()


def _txt(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _sentence(rng: random.Random, positive: bool) -> str:
    words = [rng.choice(FILL) for _ in range(rng.randint(2, 5))] + [rng.choice(GOOD if positive else BAD)]
    rng.shuffle(words)
    return " ".join(words)


def write_glue(root: Path, n: int = 48, seed: int = 0) -> Path:
    """Tiny GLUE folders with the release's quirks: headerless CoLA train/dev (dev without a final newline),
    MRPC train/dev with a BOM, unbalanced quotes (read with QUOTE_NONE), MNLI matched/mismatched, QNLI without
    its training split, no QQP."""
    rng = random.Random(seed)
    g = root / "glue"

    def rows(k, make):
        return "".join(make(i) + "\n" for i in range(k))

    def lab(i):
        return i % 2

    cola = lambda i: f"gj04\t{lab(i)}\t{'' if lab(i) else '*'}\t{_sentence(rng, bool(lab(i)))} ."  # noqa: E731
    _txt(g / "CoLA/train.tsv", rows(n, cola))
    _txt(g / "CoLA/dev.tsv", rows(12, cola).rstrip("\n"))  # no trailing newline
    _txt(g / "CoLA/test.tsv", "index\tsentence\n" + rows(5, lambda i: f"{i}\t{_sentence(rng, True)}"))
    sst = lambda i: f'{_sentence(rng, bool(lab(i)))} " \t{lab(i)}'  # noqa: E731  (an unbalanced quote)
    _txt(g / "SST-2/train.tsv", "sentence\tlabel\n" + rows(n, sst))
    _txt(g / "SST-2/dev.tsv", "sentence\tlabel\n" + rows(12, sst))
    _txt(g / "SST-2/test.tsv", "index\tsentence\n" + rows(7, lambda i: f"{i}\t{_sentence(rng, False)}"))
    hdr = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    mrpc = lambda i: f"{lab(i)}\t{i}\t{i + 1}\t{_sentence(rng, True)}\t{_sentence(rng, bool(lab(i)))}"  # noqa: E731
    _txt(g / "MRPC/train.tsv", "\ufeff" + hdr + rows(n, mrpc))
    _txt(g / "MRPC/dev.tsv", "\ufeff" + hdr + rows(12, mrpc))
    _txt(g / "MRPC/test.tsv", "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n" + rows(4, lambda i: f"{i}\t1\t2\ta b\tc d"))
    sts = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
    stsr = lambda i: f"{i}\tmain\tMSRvid\t2012\t0001\tnone\tnone\t{_sentence(rng, True)}\t{_sentence(rng, lab(i))}\t{2.5 * lab(i) + (i % 3):.2f}"  # noqa: E731,E501
    _txt(g / "STS-B/train.tsv", sts + "\tscore\n" + rows(n, stsr))
    _txt(g / "STS-B/dev.tsv", sts + "\tscore\n" + rows(12, stsr))
    _txt(g / "STS-B/test.tsv", sts + "\n" + rows(3, lambda i: f"{i}\tmain\tMSRvid\t2012\t0024\tnone\tnone\ta b\tc d"))
    mn = "\t".join(["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                    "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"])
    names = ["entailment", "neutral", "contradiction"]
    mrow = lambda i: f"{i}\t1\t1e\tgov\tb\tb\tp\tp\t{_sentence(rng, True)}\t{_sentence(rng, i % 3 == 0)}"  # noqa: E731
    _txt(g / "MNLI/train.tsv", mn + "\tlabel1\tgold_label\n" + rows(n, lambda i: mrow(i) + f"\tx\t{names[i % 3]}"))
    dev_h = mn + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n"
    for split in ("dev_matched", "dev_mismatched"):
        _txt(g / f"MNLI/{split}.tsv", dev_h + rows(9, lambda i: mrow(i) + f"\tx\tx\tx\tx\tx\t{names[i % 3]}"))
    for split in ("test_matched", "test_mismatched"):
        _txt(g / f"MNLI/{split}.tsv", mn + "\n" + rows(4, mrow))
    _txt(g / "QNLI/dev.tsv", "index\tquestion\tsentence\tlabel\n0\tWhat?\tThat.\tnot_entailment\n")
    _txt(g / "QNLI/test.tsv", "index\tquestion\tsentence\n0\tWho?\tHim.\n")
    return root


def write_diagnostic(root: Path, n: int = 6, seed: int = 1) -> Path:
    """The diagnostic set (AX) as released: `glue/diagnostic/diagnostic.tsv`, index/sentence1/sentence2, no labels,
    no final newline; one unbalanced quote (read with QUOTE_NONE)."""
    rng = random.Random(seed)
    quote = lambda i: ' "' if i == 1 else ""  # noqa: E731
    rows = [f"{i}\t{_sentence(rng, True)}{quote(i)}\t{_sentence(rng, i % 2 == 0)}" for i in range(n)]
    _txt(root / "glue" / "diagnostic" / "diagnostic.tsv", "index\tsentence1\tsentence2\n" + "\n".join(rows))
    return root


MODEL = {"arch": "encoder", "objective": "mlm", "type_vocab_size": 2, "d_model": 32, "n_layers": 2, "n_heads": 2,
         "max_seq_len": 32, "norm_position": "pre", "dropout": 0.1}
TRAIN = {"max_steps": 4, "batch_size": 8, "lr": 1e-3, "warmup_steps": 1, "eval_every": 1000, "log_every": 2,
         "grad_norm_every": 0, "progress_bar": False, "accelerator": "cpu"}


def glue_cfg(**task) -> ExperimentConfig:
    t = {"name": "glue", "dataset": "glue", "seq_len": 32, "vocab_size": 90, **task}
    return ExperimentConfig.from_dict({"name": "glue-tiny", "model": dict(MODEL), "task": t, "train": dict(TRAIN)})


# offline: missing files must not send the loaders to the hub; one thread: tiny models run faster on one
pytestmark = pytest.mark.usefixtures("offline_hub", "one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("glue") / "data"
    write_glue(root)
    write_wikitext(root)
    return root


@pytest.fixture(scope="module")
def pretrained(data, tmp_path_factory) -> Path:
    """A tiny finished pretrain run (MLM + NSP)."""
    d = copy.deepcopy(PRETRAIN_BASE)
    d["train"]["max_steps"] = 3
    out = tmp_path_factory.mktemp("pre") / "run"
    m = run_experiment(ExperimentConfig.from_dict(d), out, data_dir=data, cache_dir=out.parent / "cache")
    assert m["status"] == "completed"
    return out


# --- data ---------------------------------------------------------------------------------------------------------


def test_tsv_quirks_reach_the_inputs(data, tmp_path):
    def prepared(task):
        dm = GlueDataModule(glue_cfg(dataset=task), data_dir=data, cache_dir=tmp_path)
        dm.prepare()
        return dm

    cola = prepared("CoLA")  # headerless train/dev: no row lost to a header, the last dev row (no newline) kept
    assert len(cola.encoded["train"]) == 48 and len(cola.encoded["dev"]) == 12
    assert cola.labels["train"][:4] == [0, 1, 0, 1] and cola.data["dev"][-1].text_a.endswith(" .")
    mrpc = prepared("mrpc")  # BOM before the header: the Quality column is still found
    assert mrpc.labels["train"][:2] == [0, 1] and len(mrpc.encoded["dev"]) == 12
    ids, types = mrpc.encoded["train"][0]
    assert ids[0] == CLS and ids.count(SEP) == 2 and set(types) == {0, 1} and types[0] == 0 and types[-1] == 1
    sst = prepared("SST-2")  # an unbalanced quote stays in the text and does not swallow the next rows
    assert len(sst.encoded["train"]) == 48 and all('"' in e.text_a for e in sst.data["train"])
    assert sst.tokenizer.token_to_id('"') in sst.encoded["train"][0][0]
    ids, types = sst.encoded["train"][0]
    assert ids[0] == CLS and ids[-1] == SEP and set(types) == {0}
    assert sst.fingerprint["source"] == "local" and "SST-2/train.tsv" in str(sst.fingerprint["files"])


def test_long_pairs_are_truncated_longest_first(data, tmp_path):
    from study.tasks.glue.data import encode_example

    dm = GlueDataModule(glue_cfg(dataset="mrpc"), data_dir=data, cache_dir=tmp_path)
    dm.prepare()
    ids, types = encode_example(dm.tokenizer, "good " * 40, "bad " * 3, 16)
    short = len(dm.tokenizer.encode("bad " * 3))
    assert short <= 6 and len(ids) == 16 and types.count(1) == short + 1  # the short side is kept whole, with its [SEP]
    ids, _ = encode_example(dm.tokenizer, "good " * 40, None, 16)
    assert len(ids) == 16 and ids[-1] == SEP


def test_the_examples_cut_to_seq_len_are_counted_per_split(data, tmp_path):
    """BERT cuts a pair longer than its sequence to fit; the record says how many were cut, as translation's
    truncated_pairs does: a seq_len sweep changes how much text each example shows the model."""
    from study.tasks.glue.data import encode_and_count

    def prepared(seq_len):
        dm = GlueDataModule(glue_cfg(dataset="mrpc", seq_len=seq_len), data_dir=data, cache_dir=tmp_path)
        dm.prepare()
        return dm

    wide, narrow = prepared(32), prepared(8)
    for dm, seq_len in ((wide, 32), (narrow, 8)):
        for split, examples in dm.data.splits.items():
            cut = sum(encode_and_count(dm.tokenizer, e.text_a, e.text_b, 1000)[0].__len__() > seq_len
                      for e in examples)
            assert dm.truncated[split] == cut
    assert sum(narrow.truncated.values()) > sum(wide.truncated.values())
    assert sum(narrow.truncated.values()) > 0


def test_training_stream_is_length_grouped_covers_each_epoch_and_reshuffles(data, tmp_path):
    def stream(seed=0):
        cfg = glue_cfg(dataset="SST-2")
        dm = GlueDataModule(cfg.replace(train=cfg.train.replace(seed=seed)), data_dir=data, cache_dir=tmp_path)
        dm.prepare()
        return dm

    def rows(batch):  # (input ids without padding, label) of every example in a batch
        ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
        return [(tuple(t for t in x if t != 0), y) for x, y in zip(ids, labels)]

    dm = stream()
    per_epoch = 48 // 8
    epoch0 = [rows(dm._train_batch(i)) for i in range(per_epoch)]
    expected = sorted((tuple(ids), y) for (ids, _), y in zip(dm.encoded["train"], dm.labels["train"]))
    assert sorted(r for b in epoch0 for r in b) == expected
    epoch1 = [rows(dm._train_batch(i)) for i in range(per_epoch, 2 * per_epoch)]
    assert sorted(r for b in epoch1 for r in b) == expected and epoch1 != epoch0
    fresh = stream()  # batch i depends only on (seed, i): a resumed run sees the same batches
    assert [rows(fresh._train_batch(i)) for i in (per_epoch + 2, 1)] == [epoch1[2], epoch0[1]]
    assert [rows(stream(seed=1)._train_batch(i)) for i in range(per_epoch)] != epoch0


def test_unavailable_tasks_are_reported_and_the_others_run(data, tmp_path):
    cfg = glue_cfg(glue_tasks=("sst2", "qnli", "mnli", "qqp"))
    cfg = cfg.replace(task=cfg.task.replace(glue_tasks=("sst2", "qnli", "qqp")))
    m = run_experiment(cfg, tmp_path / "run", data_dir=data, cache_dir=tmp_path / "cache")
    r = m["metrics"]
    assert m["status"] == "completed" and r["unavailable_tasks"] == ["QNLI", "QQP"]
    assert "glue/QNLI/train.tsv" in m["unavailable"]["QNLI"] and "nyu-mll/glue" in m["unavailable"]["QNLI"]
    assert "glue/QQP/train.tsv" in m["unavailable"]["QQP"] and "--data-dir" in m["unavailable"]["QQP"]
    assert list(m["parts"]) == ["SST-2"] and r["glue_score_tasks"] == ["SST-2"] and not r["glue_score_complete"]
    # a single named task that is unavailable fails the run, with the same message
    with pytest.raises(DatasetUnavailable, match="QNLI"):
        run_experiment(glue_cfg(dataset="qnli"), tmp_path / "qnli", data_dir=data, cache_dir=tmp_path / "cache")


def test_diagnostic_split_is_loaded_with_mnli_when_present(tmp_path):
    root = write_glue(tmp_path / "data")
    mnli = load_glue("MNLI", data_dir=root)  # no diagnostic file: MNLI loads, the split is listed as unavailable
    assert mnli.unavailable_splits == ("diagnostic",) and "diagnostic" not in mnli.splits
    assert len(mnli["test_matched"]) == 4 and len(mnli["dev_mismatched"]) == 9
    with pytest.raises(DatasetUnavailable, match="glue/diagnostic/diagnostic.tsv"):  # named explicitly: required
        load_glue("MNLI", data_dir=root, splits=["diagnostic"])
    write_diagnostic(root)
    mnli = load_glue("MNLI", data_dir=root)
    diag = mnli["diagnostic"]
    assert mnli.unavailable_splits == () and "diagnostic" in mnli.test_splits
    assert [e.idx for e in diag] == list(range(6)) and all(e.label is None and e.text_b for e in diag)
    assert diag[1].text_a.endswith(' "') and diag[-1].text_b  # the quote and the last row (no newline) are kept
    assert "diagnostic/diagnostic.tsv" in mnli.fingerprint["files"]
    assert "diagnostic" not in glue_task_info("RTE").all_splits  # only MNLI predicts the diagnostic set


def test_diagnostic_split_from_the_hub(monkeypatch):
    """On the hub the diagnostic set is config "ax", split "test" (labels -1); without that config MNLI still loads."""
    from study.tasks.data import glue as glue_data
    from study.tasks.data import sources

    def split(n, label):
        return FakeSplit(premise=["p"] * n, hypothesis=["h"] * n, label=[label] * n, idx=list(range(n)))

    mnli = {s: split(2, 1) for s in ("train", "validation_matched", "validation_mismatched")}
    mnli |= {s: split(2, -1) for s in ("test_matched", "test_mismatched")}
    served = {"mnli": mnli, "ax": {"test": split(3, -1)}}

    def load(hub_id, config, revision):  # like hub_load_dataset, every failure is a HubUnavailable
        if config not in served:
            raise sources.HubUnavailable(f"no config {config!r}")
        return served[config]

    monkeypatch.delenv("STUDY_DATA_DIR", raising=False)
    monkeypatch.setattr(sources, "hub_revision", lambda hub_id: "rev0")
    monkeypatch.setattr(glue_data, "hub_load_dataset", load)
    task = load_glue("MNLI")
    assert task.fingerprint["source"] == "hub" and task.unavailable_splits == ()
    assert [(e.idx, e.label) for e in task["diagnostic"]] == [(0, None), (1, None), (2, None)]
    assert task["train"][0].label == 1 and task["test_matched"][0].label is None
    del served["ax"]
    task = load_glue("MNLI")
    assert task.unavailable_splits == ("diagnostic",) and len(task["train"]) == 2
    with pytest.raises(DatasetUnavailable, match="no config 'ax'"):  # named explicitly: required
        load_glue("MNLI", splits=["diagnostic"])


# --- errors before training ---------------------------------------------------------------------------------------


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="glue_tasks: unknown GLUE task"):
        glue_cfg(glue_tasks=("sst2", "squad"))
    with pytest.raises(ConfigError, match="dataset"):
        glue_cfg(dataset="squad")
    with pytest.raises(ConfigError, match="finetune_seeds"):
        glue_cfg(finetune_seeds=(1, 1))
    with pytest.raises(ConfigError, match="glue_tasks: only applies to dataset='glue'"):
        glue_cfg(dataset="sst2", glue_tasks=("cola",))
    assert glue_cfg(dataset="SST-2").task.dataset == "sst2"


def test_per_task_settings_are_checked_when_the_config_is_built():
    cfg = glue_cfg(per_task={"CoLA": {"train.lr": 1e-4, "task.epochs": 6, "model.dropout": 0.0},
                             "STS-B": {"task.pooling": "mean"}})
    assert cfg.task.per_task == {"cola": {"train.lr": 1e-4, "task.epochs": 6, "model.dropout": 0.0},
                                 "stsb": {"task.pooling": "mean"}}
    cola, sst = cfg.for_glue_task("CoLA"), cfg.for_glue_task("SST-2")
    assert (cola.train.lr, cola.task.epochs, cola.model.dropout, cola.task.per_task) == (1e-4, 6, 0.0, {})
    assert glue_cfg(per_task={"rte": {"model.attention_dropout": 0.0}}).for_glue_task("RTE").model.attention_dropout == 0.0
    assert (sst.train.lr, sst.task.epochs, sst.task.pooling, sst.model.dropout) == (
        cfg.train.lr, cfg.task.epochs, "cls", cfg.model.dropout)
    assert cfg.for_glue_task("stsb").task.pooling == "mean"
    assert ExperimentConfig.from_yaml(cfg.to_yaml()) == cfg
    for per_task, message in (
        ({"squad": {"train.lr": 1e-4}}, r"per_task: unknown GLUE task\(s\) \['squad'\]"),
        ({"cola": {"train.seed": 3}}, r"per_task.cola: 'train.seed' cannot be set per task.*finetune_seeds"),
        ({"cola": {"task.dataset": "sst2"}}, r"per_task.cola: 'task.dataset' cannot be set per task"),
        # resolved once for the suite (precision: auto): per task, 'auto' would reach Lightning after earlier parts ran
        ({"sst2": {"train.precision": "auto"}}, r"per_task.sst2: 'train.precision' cannot be set per task.*hardware"),
        ({"sst2": {"train.devices": 2}}, r"per_task.sst2: 'train.devices' cannot be set per task"),
        ({"cola": {"model.d_model": 64}}, r"per_task.cola: 'model.d_model' cannot be set per task.*model.\{dropout"),
        ({"cola": {"model.dropout": 1.5}}, r"task.per_task.cola: model.dropout: must be in \[0, 1\)"),
        ({"cola": {"train.lr": "fast"}}, r"task.per_task.cola: train.lr: 'fast' is not a valid float"),
        ({"cola": {"train.warmup": 3}}, r"task.per_task.cola: train.warmup: unknown field"),
        ({"cola": {"task.epochs": -1}}, r"task.per_task.cola: .*epochs: must be > 0"),
        (["cola"], r"per_task: must map GLUE task names"),
    ):
        with pytest.raises(ConfigError, match=message):
            glue_cfg(per_task=per_task)
    with pytest.raises(ConfigError, match=r"per_task: only applies to task.name='glue'"):
        ExperimentConfig.from_dict({"task": {"per_task": {"cola": {"train.lr": 1e-4}}}})


def test_per_task_settings_apply_to_that_task_only(data, pretrained, tmp_path):
    cfg = glue_cfg(glue_tasks=("sst2", "cola"), init_from=str(pretrained), epochs=1,
                   per_task={"CoLA": {"train.lr": 3e-4, "task.epochs": 2, "train.warmup_steps": 0, "model.dropout": 0.0}})
    cfg = cfg.replace(train=cfg.train.replace(max_steps=100))
    run = tmp_path / "ft"
    m = run_experiment(cfg, run, data_dir=data, cache_dir=tmp_path / "cache")
    tasks = m["parts"]
    assert tasks["SST-2"]["seeds"]["0"]["steps"] == 6 and tasks["CoLA"]["seeds"]["0"]["steps"] == 12  # 48 / 8 a pass
    sst = ExperimentConfig.from_yaml((run / "SST-2" / "seed0" / "config.yaml").read_text())
    cola = ExperimentConfig.from_yaml((run / "CoLA" / "seed0" / "config.yaml").read_text())
    assert (sst.train.lr, sst.train.max_steps, sst.train.warmup_steps) == (1e-3, 6, 0)  # warm-up: at most a tenth
    assert (cola.train.lr, cola.train.max_steps, cola.task.epochs) == (3e-4, 12, 2)
    assert (sst.model.dropout, cola.model.dropout) == (cfg.model.dropout, 0.0) and cfg.model.dropout > 0
    assert cola.model == sst.model.replace(dropout=0.0)  # else the pretrained encoder's architecture, as for SST-2
    assert sst.task.per_task == cola.task.per_task == {}
    assert ExperimentConfig.from_yaml((run / "config.yaml").read_text()).task.per_task == cfg.task.per_task


def test_task_epochs_count_the_examples_every_device_takes_in_a_step(data):
    """Under DDP each device takes its own batch_size examples per optimizer step: two devices pass over the
    training set in half the steps, so task.epochs passes are half as many steps."""
    from study.tasks import family

    cfg = glue_cfg(glue_tasks=("sst2",), epochs=1)
    cfg = cfg.replace(train=cfg.train.replace(max_steps=100))
    (one,) = family("glue").sub_runs(cfg, data)
    (two,) = family("glue").sub_runs(cfg.replace(train=cfg.train.replace(devices=2, strategy="ddp")), data)
    assert one.config.train.max_steps == 6 and two.config.train.max_steps == 3  # 48 examples, 8 a batch


def test_a_seed_without_a_score_gets_no_mean_and_is_never_the_submitted_one():
    """STS-B's Pearson of a constant prediction is NaN: the task has no score (as a diverged seed leaves it), and the
    best seed is one with a score."""
    from study.tasks.glue import _aggregate

    runs = {"0": {"status": "completed", "steps": 5, "score": float("nan"), "pearson": float("nan")},
            "1": {"status": "completed", "steps": 5, "score": 60.0, "pearson": 60.0}}
    for order in (runs, dict(reversed(runs.items()))):
        out = _aggregate("stsb", order)
        assert out["best_seed"] == "1" and out["score_mean"] is None


def test_init_from_missing_or_incompatible_fails_before_training(data, tmp_path):
    with pytest.raises(ValueError, match="task.init_from: .* does not exist"):
        run_experiment(glue_cfg(init_from=str(tmp_path / "nope")), tmp_path / "a", data_dir=data)
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.yaml").write_text("name: x\n")
    with pytest.raises(ValueError, match=r"task.init_from: .*\(missing \['model.pt', 'tokenizer.json', 'metrics.json'\]"):
        run_experiment(glue_cfg(init_from=str(half)), tmp_path / "b", data_dir=data)
    lm = tmp_path / "lm"  # a finished run of another task family
    lm.mkdir()
    lm_cfg = ExperimentConfig.from_dict({"model": {"arch": "decoder", "d_model": 16, "n_heads": 2}})
    (lm / "config.yaml").write_text(lm_cfg.to_yaml())
    for f in ("model.pt", "tokenizer.json"):
        (lm / f).write_bytes(b"")
    (lm / "metrics.json").write_text('{"status": "completed"}')
    with pytest.raises(ValueError, match="task.init_from: .* decoder/clm model"):
        run_experiment(glue_cfg(init_from=str(lm)), tmp_path / "c", data_dir=data)
    assert not (tmp_path / "c").exists()  # nothing written, nothing trained


def test_pooling_reads_the_first_token_or_the_mean_of_the_real_tokens(pretrained):
    from study.tasks.glue.data import collate

    module = GlueModule(resolve_model(glue_cfg(dataset="sst2", init_from=str(pretrained), pooling="mean")))
    model = module.model.eval()
    batch = collate([([CLS, 7, 8, SEP], [0, 0, 0, 0]), ([CLS, 9, SEP], [0, 0, 0])], [1, 0], regression=False)
    h = model(batch["input_ids"], token_type_ids=batch["token_type_ids"], padding_mask=batch["padding_mask"])
    short_alone = model(torch.tensor([[CLS, 9, SEP]]), token_type_ids=torch.zeros(1, 3, dtype=torch.long))
    mean = model.pooled(h, batch["padding_mask"], "mean")
    # the padded position is left out of the mean: the short sentence pools as it does unpadded
    torch.testing.assert_close(mean[1], model.pooled(short_alone, None, "mean")[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mean[0], torch.tanh(model.pooler(h[0].mean(0))))
    torch.testing.assert_close(model.pooled(h, batch["padding_mask"], "cls"), torch.tanh(model.pooler(h[:, 0])))
    assert not torch.allclose(mean, model.pooled(h, batch["padding_mask"], "cls"))
    with torch.no_grad():  # the classifier reads what task.pooling names
        torch.testing.assert_close(module.eval().logits(batch), module.head(mean).float())
    with pytest.raises(ConfigError, match="pooling: .*'cls', 'mean'"):
        glue_cfg(pooling="max")
    with pytest.raises(ConfigError, match="pooling: only applies to task.name='glue'"):
        ExperimentConfig.from_dict({"model": {"arch": "encoder", "objective": "mlm"},
                                    "task": {"name": "pretrain", "dataset": "wikitext-2", "vocab_size": 100,
                                             "pooling": "mean"}})


def test_submission_format():
    assert format_prediction(glue_task_info("rte"), 1) == "not_entailment"
    assert format_prediction(glue_task_info("mnli"), 2) == "contradiction"
    assert format_prediction(glue_task_info("qnli"), 0) == "entailment"
    assert format_prediction(glue_task_info("wnli"), 1) == "1"
    assert format_prediction(glue_task_info("cola"), 0) == "0"
    assert format_prediction(glue_task_info("stsb"), 6.2) == "5.000"
    assert format_prediction(glue_task_info("stsb"), 2.34567) == "2.346"


def test_the_submission_folder_holds_this_runs_predictions_only(tmp_path):
    """A forced rerun whose SST-2 seeds all diverged has no best seed there: the earlier run's SST-2.tsv must not stay
    beside the new record as if it were this model's."""
    from study.tasks import family

    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "SST-2.tsv").write_text("index\tprediction\n0\t1\n")  # the earlier run's
    for seed in (0, 1):
        (tmp_path / "CoLA" / f"seed{seed}" / "predictions").mkdir(parents=True)
        (tmp_path / "CoLA" / f"seed{seed}" / "predictions" / "CoLA.tsv").write_text(f"index\tprediction\n0\t{seed}\n")
    part = {"status": "completed", "steps": 2}
    results = {"CoLA/seed0": {**part, "metrics": {"score": 10.0, "mcc": 10.0}},
               "CoLA/seed1": {**part, "metrics": {"score": 20.0, "mcc": 20.0}},
               "SST-2/seed0": {**part, "status": "diverged", "metrics": {}}}
    family("glue").save_suite_outputs(glue_cfg(), tmp_path, results)
    assert [f.name for f in (tmp_path / "submission").iterdir()] == ["CoLA.tsv"]
    assert (tmp_path / "submission" / "CoLA.tsv").read_text().endswith("0\t1\n")  # the best seed's


# --- pretrain -> fine-tune ----------------------------------------------------------------------------------------


def test_module_starts_from_the_pretrained_encoder(pretrained):

    cfg = resolve_model(glue_cfg(dataset="sst2", init_from=str(pretrained)))
    pre = pretrained_config(pretrained)
    assert cfg.model.d_model == pre.model.d_model and not cfg.model.nsp and cfg.model.dropout == 0.1
    state = torch.load(pretrained / "model.pt", weights_only=True)
    module = GlueModule(cfg)
    for k, v in module.model.state_dict().items():
        assert torch.equal(v, state[k]), k
    scratch = GlueModule(resolve_model(glue_cfg(dataset="sst2", init_from=str(pretrained), pretrained_weights=False)))
    assert not torch.equal(scratch.model.token_embedding.weight, state["token_embedding.weight"])


def test_every_trained_parameter_gets_a_gradient_in_each_step_as_ddp_requires(pretrained):
    """The MLM head stays in the fine-tuned encoder (the pretrained weights' shape) but no loss reaches it: frozen,
    or DDP stops on the second step; its decoder weight is the token embedding's, which trains."""
    from study.tasks.glue.data import collate

    module = GlueModule(resolve_model(glue_cfg(dataset="sst2", init_from=str(pretrained))))
    batch = collate([([CLS, 7, 8, SEP], [0, 0, 0, 0]), ([CLS, 9, SEP], [0, 0, 0])], [1, 0], regression=False)
    module.training_loss(batch)[0].backward()
    assert [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None] == []
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith("model.mlm_head.") for n in frozen)
    assert module.model.token_embedding.weight.requires_grad


def test_pretrain_then_finetune_suite_with_seeds(data, pretrained, tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "_malloc_set", {})  # as a fresh process: no malloc setting made yet
    cfg = glue_cfg(glue_tasks=("sst2", "stsb", "mnli", "cola"), init_from=str(pretrained), finetune_seeds=(0, 1), epochs=1)
    cfg = cfg.replace(train=cfg.train.replace(max_steps=100))  # one epoch (6 steps) decides
    run = tmp_path / "ft"
    m = run_experiment(cfg, run, data_dir=data, cache_dir=tmp_path / "cache")
    assert m["status"] == "completed"
    if platform.libc_ver()[0] == "glibc":  # the suite's env.json records the process settings its parts trained with
        assert json.loads((run / "env.json").read_text())["malloc"] == environment.CPU_MALLOC
    r, parts = m["metrics"], m["parts"]
    assert list(parts) == ["SST-2", "STS-B", "MNLI", "CoLA"] and r["seeds"] == [0, 1]
    sst = parts["SST-2"]
    accs = [sst["seeds"][s]["accuracy"] for s in ("0", "1")]
    assert sst["mean"]["accuracy"] == pytest.approx(statistics.fmean(accs))
    assert sst["std"]["accuracy"] == pytest.approx(statistics.stdev(accs))
    assert r["SST-2/accuracy"] == sst["mean"]["accuracy"] and "SST-2/accuracy_std" in r
    assert set(parts["STS-B"]["mean"]) == {"pearson", "spearman"}
    assert set(parts["MNLI"]["mean"]) == {"accuracy_m", "accuracy_mm"} and "CoLA/mcc" in r
    # one scale everywhere: every GLUE number is on 0-100, a task score is the mean of its metrics
    assert all(0 <= parts[t]["mean"][k] <= 100 or k in ("pearson", "spearman", "mcc") for t in parts
               for k in parts[t]["mean"])
    assert sst["score_mean"] == pytest.approx(sst["mean"]["accuracy"])
    assert 1 < max(abs(v) for t in parts for v in parts[t]["mean"].values())  # not fractions
    scores = [parts[t]["score_mean"] for t in parts]
    assert r["glue_score"] == pytest.approx(sum(scores) / 4)
    assert sst["seeds"]["0"]["steps"] == 6  # one epoch: 48 examples / 8
    # every (task, seed) is a complete run directory, started from the pretrained run
    sub = run / "SST-2" / "seed1"
    for f in ("config.yaml", "model.pt", "classifier.pt", "metrics.json", "data.json", "predictions/SST-2.tsv"):
        assert (sub / f).is_file(), f
    sub_cfg = ExperimentConfig.from_yaml((sub / "config.yaml").read_text())
    assert sub_cfg.train.seed == 1 and sub_cfg.task.dataset == "sst2" and sub_cfg.task.init_from == str(pretrained)
    assert (sub / "tokenizer.json").read_bytes() == (pretrained / "tokenizer.json").read_bytes()
    # test predictions in the GLUE server's format, from the best seed
    for name, rows, allowed in (("SST-2", 7, {"0", "1"}), ("MNLI-m", 4, {"entailment", "neutral", "contradiction"}),
                                ("MNLI-mm", 4, {"entailment", "neutral", "contradiction"}), ("CoLA", 5, {"0", "1"})):
        lines = (run / "submission" / f"{name}.tsv").read_text().splitlines()
        assert lines[0] == "index\tprediction" and len(lines) == rows + 1
        assert [ln.split("\t")[0] for ln in lines[1:]] == [str(i) for i in range(rows)]
        assert {ln.split("\t")[1] for ln in lines[1:]} <= allowed
    sts = (run / "submission" / "STS-B.tsv").read_text().splitlines()[1:]
    assert all(0.0 <= float(ln.split("\t")[1]) <= 5.0 for ln in sts)
    assert not (run / "submission" / "AX.tsv").exists()  # no diagnostic file here: MNLI ran without it
    # the suite's config records the pretrained architecture; a rerun is not repeated
    top = ExperimentConfig.from_yaml((run / "config.yaml").read_text())
    assert top.model.d_model == 32 and not top.model.nsp
    again = run_experiment(cfg, run, data_dir=data, cache_dir=tmp_path / "cache")
    assert again["metrics"]["glue_score"] == r["glue_score"]


def test_mnli_run_writes_the_diagnostic_submission(tmp_path):
    data = write_diagnostic(write_glue(tmp_path / "data"))
    run = tmp_path / "run"
    m = run_experiment(glue_cfg(dataset="mnli"), run, data_dir=data, cache_dir=tmp_path / "cache")
    assert m["status"] == "completed" and list(m["parts"]) == ["MNLI"]
    assert (run / "MNLI" / "seed0" / "predictions" / "AX.tsv").is_file()
    lines = (run / "submission" / "AX.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 7  # one row per diagnostic example, in index order
    assert [ln.split("\t")[0] for ln in lines[1:]] == [str(i) for i in range(6)]
    assert {ln.split("\t")[1] for ln in lines[1:]} <= {"entailment", "neutral", "contradiction"}
    assert {"MNLI-m.tsv", "MNLI-mm.tsv", "AX.tsv"} == {f.name for f in (run / "submission").iterdir()}


@pytest.mark.realdata
@pytest.mark.skipif(not (REAL_DATA / "glue").is_dir(), reason=f"real GLUE data not found at {REAL_DATA}")
def test_real_diagnostic_set():
    diag = load_glue("MNLI", data_dir=REAL_DATA, splits=["diagnostic"])["diagnostic"]  # MNLI itself is not here
    assert len(diag) == 1104 and [e.idx for e in diag] == list(range(1104))
    assert diag[0].text_a == "The cat sat on the mat." and diag[0].text_b == "The cat did not sit on the mat."
    assert all(e.text_a and e.text_b and e.label is None for e in diag)


@pytest.mark.realdata
@pytest.mark.skipif(not (REAL_DATA / "glue").is_dir(), reason=f"real GLUE data not found at {REAL_DATA}")
def test_real_glue_suite_smoke(tmp_path):
    cfg = glue_cfg(glue_tasks=("wnli", "qnli", "mnli"), vocab_size=400)
    cfg = cfg.replace(train=cfg.train.replace(max_steps=2))
    m = run_experiment(cfg, tmp_path / "run", data_dir=REAL_DATA, cache_dir=tmp_path / "cache")
    r = m["metrics"]
    assert r["unavailable_tasks"] == ["MNLI", "QNLI"] and list(m["parts"]) == ["WNLI"]
    assert m["parts"]["WNLI"]["seeds"]["0"]["n_dev"] == {"dev": 71}
    assert r["WNLI/accuracy_std"] is None  # one seed has no spread: never a standard deviation of 0
    lines = (tmp_path / "run" / "submission" / "WNLI.tsv").read_text().splitlines()
    assert len(lines) == 147 and lines[0] == "index\tprediction"
    for task, n_train, n_dev in (("CoLA", 8551, 1043), ("MRPC", 3668, 408)):
        dm = GlueDataModule(glue_cfg(dataset=task, vocab_size=400), data_dir=REAL_DATA, cache_dir=tmp_path / "cache")
        dm.prepare()
        assert (len(dm.encoded["train"]), len(dm.encoded["dev"])) == (n_train, n_dev)


def test_the_validation_loss_curve_weights_each_batch_by_its_examples():
    """A GLUE loss is a mean per example: `val/loss` averages batches by their examples, not their tokens (the dev set
    is length-sorted, so token weights would let the long-sentence batches dominate the curve and the pruner)."""
    from types import SimpleNamespace

    from study.tasks.glue.module import GlueModule

    module = SimpleNamespace(training_loss=lambda batch: (torch.tensor(0.5), torch.tensor(57)))  # 57 real tokens
    batch = {"labels": torch.zeros(3, dtype=torch.long), "padding_mask": torch.ones(3, 19, dtype=torch.bool)}
    loss, weight = GlueModule.validation_loss(module, batch)
    assert loss.item() == 0.5 and weight == 3
