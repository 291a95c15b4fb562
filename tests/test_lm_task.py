"""The LM task end to end on a tiny synthetic Tiny-Shakespeare folder: the run directory, weights-only
loading, perplexity against a hand computation, length extrapolation, divergence, exact resume, rerun,
conflicts. Plus one test on the real WikiText-2 and Tiny Shakespeare files (marked realdata)."""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import math
import random
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from study.config import ConfigError, ExperimentConfig
from study.model import build_model
from study.run import RunDirConflict, load_model, run_experiment
from study.tasks import family
from study.tasks.base import lr_multiplier
from study.tasks.lm import NOT_APPLICABLE, LanguageModelling, LMDataModule, LMModule

SEQ_LEN = 16
REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

SPEAKERS = ["KING HENRY", "QUEEN", "First Citizen", "GLOUCESTER", "ROMEO"]
WORDS = ("the my thou art hath not shall be to and of love death night day lord king crown sword "
         "sweet fair speak hear me what is this good").split()


def write_corpus(data_dir: Path, n_speeches: int = 60, seed: int = 0) -> Path:
    """A few KB of text in Tiny Shakespeare's format: `SPEAKER:` lines, verse, blank lines."""
    rng = random.Random(seed)
    speeches = []
    for _ in range(n_speeches):
        lines = []
        for _ in range(rng.randint(1, 3)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
            lines.append(" ".join(words).capitalize() + rng.choice([",", ".", "!", "?", ";"]))
        speeches.append(f"{rng.choice(SPEAKERS)}:\n" + "\n".join(lines) + "\n")
    folder = data_dir / "tinyshakespeare"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "input.txt"
    path.write_text("\n".join(speeches))
    return path


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for section, values in over.items():
        if isinstance(values, dict):
            out.setdefault(section, {}).update(values)
        else:
            out[section] = values
    return out


BASE: dict[str, Any] = {
    "name": "tiny-shakespeare",
    "model": {"preset": "gpt2", "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": SEQ_LEN, "dropout": 0.1},
    "task": {"name": "lm", "dataset": "tinyshakespeare", "seq_len": SEQ_LEN, "eval_lengths": [1, 2, 4]},
    "train": {
        "max_steps": 12, "batch_size": 8, "lr": 3e-3, "warmup_steps": 2, "schedule": "cosine",
        "eval_every": 6, "checkpoint_every": 6, "eval_batches": 2, "log_every": 3, "grad_norm_every": 4,
        "progress_bar": False, "accelerator": "cpu", "seed": 0,
    },
}


def make_cfg(**over) -> ExperimentConfig:
    return ExperimentConfig.from_dict(merge(BASE, over))


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def column_by_step(rows: list[dict[str, str]], column: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for row in rows:
        if row.get(column):
            step = int(row["step"])
            assert step not in out, f"{column} logged twice for step {step}"
            out[step] = row[column]
    return out


def hand_loss(model: torch.nn.Module, ids: torch.Tensor, length: int) -> tuple[float, int]:
    """Mean next-token NLL over non-overlapping windows of `length` (the last one shorter), one window at a
    time: every token but the first is predicted exactly once."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, length):
            x = ids[start : min(start + length, len(ids) - 1)]
            y = ids[start + 1 : start + 1 + len(x)]
            logits = model(x[None])[0]
            total += float(F.cross_entropy(logits.double(), y, reduction="sum"))
            count += len(y)
    return total / count, count


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These models are tiny: one intra-op thread is as fast, and much faster when another process is
    using the other core (OpenMP threads then wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    path = write_corpus(root / "data")
    return {"root": root, "data": root / "data", "cache": root / "cache", "input": path}


def run(corpus, cfg: ExperimentConfig, name: str, **kw):
    return run_experiment(cfg, corpus["root"] / name, data_dir=corpus["data"], cache_dir=corpus["cache"], **kw)


@pytest.fixture(scope="module")
def main_run(corpus):
    """12 steps, checkpoint and evaluation every 6, dropout 0.1, learned positions with max_seq_len == seq_len."""
    cfg = make_cfg()
    metrics = run(corpus, cfg, "main")
    return {"cfg": cfg, "dir": corpus["root"] / "main", "metrics": metrics}


def hand_valid_ids(corpus) -> tuple[torch.Tensor, int]:
    """The valid split tokenized by hand: nanoGPT's 90/10 character split; the char vocabulary is <unk> then the
    training characters sorted by code point."""
    text = corpus["input"].read_text()
    cut = int(len(text) * 0.9)
    vocab = ["<unk>"] + sorted(set(text[:cut]))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index.get(c, 0) for c in text[cut:]]), len(vocab)


# --- the data module ------------------------------------------------------------------------------
def test_datamodule_tokenizes_and_indexes_batches_by_step(corpus):
    cfg = make_cfg()
    dm = LMDataModule(cfg, data_dir=corpus["data"], cache_dir=corpus["cache"] / "dm")
    dm.prepare()
    ids, vocab_size = hand_valid_ids(corpus)
    assert dm.tokenizer.vocab_size == vocab_size == dm.model_overrides()["vocab_size"]
    assert torch.equal(dm.ids["valid"], ids)
    assert "test" not in dm.ids  # Tiny Shakespeare has no test split
    n_text = len(corpus["input"].read_text())
    assert len(dm.ids["train"]) + len(dm.ids["valid"]) == n_text  # one id per character

    # batch i depends only on (seed, i); x and y are shifted windows of the training stream
    x, y = dm._train_batch(5)
    assert x.shape == y.shape == (cfg.train.batch_size, SEQ_LEN)
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = dm._train_batch(5)
    assert torch.equal(x, x2)
    # the data position restored from a checkpoint restarts the stream there
    dm.load_state_dict({"train_batches": 5})
    first = next(iter(dm.train_dataloader()))
    assert torch.equal(first[0], x) and torch.equal(first[1], y)

    # evaluation windows: non-overlapping, covering every target once, the last one partial
    n = len(dm.ids["valid"])
    assert (n - 1) % SEQ_LEN != 0, "the synthetic corpus should leave a partial final window"
    windows = dm.windows("valid", SEQ_LEN)
    ys = torch.cat([w[1].flatten() for w in windows])
    assert torch.equal(ys, dm.ids["valid"][1:])
    assert windows[-1][0].shape == (1, (n - 1) % SEQ_LEN)
    xs = torch.cat([w[0].flatten() for w in windows])
    assert torch.equal(xs, dm.ids["valid"][:-1])


# --- the run directory ----------------------------------------------------------------------------
def test_run_directory_contents(main_run, corpus):
    d, m = main_run["dir"], main_run["metrics"]
    for name in ("config.yaml", "env.json", "data.json", "metrics.json", "model.pt", "checkpoints/last.ckpt",
                 "logs/metrics.csv"):
        assert (d / name).is_file(), name
    assert not [p for p in d.rglob("*.tmp")], "atomic writes left temporary files"

    cfg = ExperimentConfig.from_yaml((d / "config.yaml").read_text())
    _, vocab_size = hand_valid_ids(corpus)
    assert cfg == main_run["cfg"].replace(model=main_run["cfg"].model.replace(vocab_size=vocab_size, pad_token_id=0))

    env = json.loads((d / "env.json").read_text())
    assert set(env["git"]) == {"commit", "dirty"}
    assert env["git"]["commit"] is None or len(env["git"]["commit"]) == 40
    assert env["packages"]["torch"] == torch.__version__.split("+")[0] or env["packages"]["torch"] == torch.__version__
    assert "lightning" in env["packages"]
    assert env["precision"] == "32-true"

    data = json.loads((d / "data.json").read_text())
    assert data["source"] == "local" and data["dataset"] == "tinyshakespeare"
    assert data["files"] == {"input.txt": hashlib.sha256(corpus["input"].read_bytes()).hexdigest()}
    assert data["tokens"]["valid"] == len(hand_valid_ids(corpus)[0])

    stored = json.loads((d / "metrics.json").read_text())
    assert stored == json.loads(json.dumps(m))
    assert m["status"] == "completed" and m["diverged_at_step"] is None
    assert m["steps"] == 12
    assert m["train_tokens"] == 12 * 8 * SEQ_LEN
    assert m["cost"]["parameters"] > 0 and m["cost"]["train_tokens_per_s"] > 0
    for key in ("valid_loss", "valid_ppl", "valid_ppl_by_length"):
        assert key in m["metrics"]
    # Tiny Shakespeare has no test split: no metric calls the validation split "test"
    assert not any(k.startswith("test") for k in m["metrics"])
    # every number the task writes is one its family declares, with its direction and scale in the record
    from study.record import flatten_record

    declared = LanguageModelling()
    numeric = [k[len("metric."):] for k, v in flatten_record(m).items() if k.startswith("metric.")]
    assert numeric and all(declared.metric(k) is not None for k in numeric), numeric
    assert m["declared"]["valid_loss"]["direction"] == "minimize" and m["schema"] == 2
    assert m["metrics"]["valid_ppl"] == pytest.approx(math.exp(m["metrics"]["valid_loss"]))


def test_logged_curves(main_run):
    """logs/metrics.csv: train/loss, train/lr and per-layer gradient norms, each under the step it belongs to."""
    cfg = main_run["cfg"]
    rows = read_csv(main_run["dir"] / "logs" / "metrics.csv")
    columns = set(rows[0])
    assert {"step", "train/loss", "train/lr", "val/loss"} <= columns
    assert {"grad_norm/decoder.00", "grad_norm/decoder.01", "grad_norm/other"} <= columns

    loss = column_by_step(rows, "train/loss")
    assert sorted(loss) == [2, 5, 8, 11]  # Lightning writes every log_every (3) steps
    assert all(math.isfinite(float(v)) for v in loss.values())
    # the lr written under step s is the lr step s ran at (not that of an earlier step)
    lr = column_by_step(rows, "train/lr")
    assert sorted(lr) == sorted(loss)
    for step, value in lr.items():
        assert float(value) == pytest.approx(cfg.train.lr * lr_multiplier(step, cfg.train), rel=1e-6), step
    # gradient norms every grad_norm_every (4) steps, and only there (no stale copies under later steps)
    gn = column_by_step(rows, "grad_norm/decoder.00")
    assert sorted(gn) == [0, 4, 8]
    assert all(float(v) > 0 for v in gn.values())
    assert len(column_by_step(rows, "val/loss")) == 2  # after steps 6 and 12


def test_checkpoint_and_model_load_with_weights_only(main_run):
    d = main_run["dir"]
    ckpt = torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 12
    assert {"state_dict", "optimizer_states", "lr_schedulers", "study"} <= set(ckpt)
    assert ckpt["study"]["train_tokens"] == 12 * 8 * SEQ_LEN
    assert isinstance(ckpt["study"]["torch_rng"], torch.Tensor)
    assert ckpt["LMDataModule"] == {"train_batches": 12}
    weights = torch.load(d / "model.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in weights.values())
    # model.pt is the final state of the model that the checkpoint holds too
    for k, v in weights.items():
        assert torch.equal(ckpt["state_dict"][f"model.{k}"], v), k


def test_load_model_reproduces_valid_loss_and_perplexity_by_hand(main_run, corpus):
    model, cfg = load_model(main_run["dir"])
    assert not model.training
    assert cfg.model.vocab_size == hand_valid_ids(corpus)[1]
    ids, _ = hand_valid_ids(corpus)
    loss, count = hand_loss(model, ids, SEQ_LEN)
    assert count == len(ids) - 1  # every target, including the final partial window
    m = main_run["metrics"]["metrics"]
    assert loss == pytest.approx(m["valid_loss"], rel=1e-5)
    assert math.exp(loss) == pytest.approx(m["valid_ppl"], rel=1e-5)
    # training did something: better than the untrained model
    fresh = build_model(cfg.model).eval()
    assert loss < hand_loss(fresh, ids, SEQ_LEN)[0]


def test_learned_positions_are_not_applicable_beyond_max_seq_len(main_run):
    curve = main_run["metrics"]["metrics"]["valid_ppl_by_length"]
    assert list(curve) == ["16", "32", "64"]  # one entry per task.eval_lengths multiple
    assert curve["16"] == pytest.approx(main_run["metrics"]["metrics"]["valid_ppl"])
    assert curve["32"] == NOT_APPLICABLE and curve["64"] == NOT_APPLICABLE
    assert main_run["metrics"]["metrics"]["valid_ppl_at_2x"] == NOT_APPLICABLE


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_extrapolating_positions_give_numbers_at_every_length(corpus, position):
    cfg = make_cfg(model={"position": position, "n_layers": 1, "dropout": 0.0}, train={"max_steps": 2})
    m = run(corpus, cfg, f"extrapolate-{position}")
    assert m["status"] == "completed"
    curve = m["metrics"]["valid_ppl_by_length"]
    assert list(curve) == ["16", "32", "64"]
    assert m["metrics"]["valid_ppl_at_2x"] == curve["32"]
    assert all(isinstance(v, float) and math.isfinite(v) for v in curve.values())
    model, _ = load_model(corpus["root"] / f"extrapolate-{position}")
    ids, _ = hand_valid_ids(corpus)
    for length in (16, 32, 64):  # windows longer than training (and than max_seq_len)
        loss, count = hand_loss(model, ids, length)
        assert count == len(ids) - 1
        assert math.exp(loss) == pytest.approx(curve[str(length)], rel=1e-5), length


def test_a_length_the_split_cannot_fill_is_not_applicable_rather_than_a_shorter_window(corpus):
    """A length with no full window in the split would be measured on one shorter window under its label: 'n/a'."""
    ids, _ = hand_valid_ids(corpus)
    too_long = (len(ids) - 1) // 16 + 1  # the smallest multiple of seq_len (16) longer than the split's predictions
    cfg = make_cfg(model={"position": "rope", "n_layers": 1, "dropout": 0.0}, task={"eval_lengths": [1, 2, too_long]},
                   train={"max_steps": 2})
    curve = run(corpus, cfg, "longer-than-split")["metrics"]["valid_ppl_by_length"]
    assert curve[str(16 * too_long)] == NOT_APPLICABLE
    assert isinstance(curve["32"], float) and math.isfinite(curve["32"])


def test_lm_declines_objectives_it_never_writes():
    """The length curve is written for the last split only, the 2x point only where eval_lengths has 2, and a
    length past a learned position table (max_seq_len rows) as n/a."""
    task = LanguageModelling()
    rope = {"position": "rope"}
    wikitext = make_cfg(model=rope, task={"dataset": "wikitext-2", "eval_lengths": [1, 2]})
    assert "last split only (test)" in task.unwritten_metric(wikitext, "valid_ppl_at_2x")
    assert task.unwritten_metric(wikitext, "test_ppl_at_2x") is None
    shakespeare = make_cfg(model=rope, task={"eval_lengths": [1, 4]})
    assert "has no 2" in task.unwritten_metric(shakespeare, "valid_ppl_at_2x")
    assert task.unwritten_metric(make_cfg(model=rope, task={"eval_lengths": [1, 2]}), "valid_ppl_at_2x") is None
    learned = make_cfg(model={"position": "learned", "max_seq_len": 16}, task={"seq_len": 16, "eval_lengths": [1, 2]})
    assert "cannot address length 32" in task.unwritten_metric(learned, "valid_ppl_at_2x")
    assert "cannot address length 32" in task.unwritten_metric(learned, "valid_ppl_by_length.32")
    assert task.unwritten_metric(learned, "valid_ppl_by_length.16") is None


def test_eval_tokens_must_hold_a_window_of_the_longest_evaluation_length():
    with pytest.raises(ConfigError) as err:
        make_cfg(task={"eval_lengths": [1, 8], "eval_tokens": 100})  # 8 x 16 = 128 tokens
    assert "eval_tokens" in str(err.value) and "128" in str(err.value)
    assert make_cfg(task={"eval_lengths": [1, 8], "eval_tokens": 128}).task.eval_tokens == 128


# --- divergence -----------------------------------------------------------------------------------
def test_the_throughput_leaves_out_the_time_spent_writing_checkpoints(corpus, monkeypatch):
    """A checkpoint is written in a step's end hooks, inside the step's timed window: a write made slow (0.4 s) must
    not show in train_tokens_per_s, which measures training (tokens per step / seconds per step)."""
    import study.run.single as single

    write = single.atomic_write

    def slow(path, save):
        if str(path).endswith(".ckpt"):
            time.sleep(0.4)
        return write(path, save)

    monkeypatch.setattr(single, "atomic_write", slow)
    cfg = make_cfg(model={"n_layers": 1, "dropout": 0.0},
                   train={"max_steps": 9, "checkpoint_every": 1, "eval_every": 50, "warmup_steps": 0})
    m = run(corpus, cfg, "slow-checkpoints")
    seconds_per_step = cfg.train.batch_size * cfg.task.seq_len / m["cost"]["train_tokens_per_s"]
    assert seconds_per_step < 0.2, seconds_per_step  # a tiny model's step: milliseconds, not the write's 0.4 s


def test_absurd_lr_diverges_cleanly(corpus):
    cfg = make_cfg(model={"n_layers": 1, "dropout": 0.0},
                   train={"lr": 1e6, "grad_clip": None, "warmup_steps": 0, "max_steps": 30, "eval_every": 50})
    d = corpus["root"] / "diverged-lr"
    m = run(corpus, cfg, "diverged-lr")  # does not raise
    assert m["status"] == "diverged"
    assert isinstance(m["diverged_at_step"], int) and 0 < m["diverged_at_step"] < 30
    assert m["metrics"] == {}
    stored = json.loads((d / "metrics.json").read_text())
    assert stored["status"] == "diverged" and stored["diverged_at_step"] == m["diverged_at_step"]
    assert (d / "model.pt").is_file()
    # a diverged run is finished: running it again does nothing
    assert run(corpus, cfg, "diverged-lr") == stored


def test_nan_loss_diverges_at_that_step(corpus, monkeypatch):
    class NaNAtStep3(LMModule):
        def training_loss(self, batch):
            loss, n = super().training_loss(batch)
            return (loss * float("nan"), n) if self.global_step == 3 else (loss, n)

    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, NaNAtStep3))
    cfg = make_cfg(model={"n_layers": 1}, train={"max_steps": 10, "log_every": 1})
    d = corpus["root"] / "diverged-nan"
    m = run(corpus, cfg, "diverged-nan")
    assert m["status"] == "diverged" and m["diverged_at_step"] == 3
    assert m["train_tokens"] == 3 * 8 * SEQ_LEN  # the three finite steps
    assert json.loads((d / "metrics.json").read_text())["diverged_at_step"] == 3
    loss = column_by_step(read_csv(d / "logs" / "metrics.csv"), "train/loss")
    assert [s for s, v in loss.items() if math.isfinite(float(v))] == [0, 1, 2]
    assert math.isnan(float(loss[3])) and max(loss) == 3  # logged as nan, not as a stale finite value


def test_a_run_stopped_between_written_steps_writes_its_last_step_fresh(corpus, monkeypatch):
    # Training values are given to Lightning only on the steps it writes; a run that ends in between (a time
    # budget: Lightning's Timer sets should_stop in on_train_batch_end, before the module's hook) still gets its
    # last step written with that step's own values, not the previous written step's.
    class StopAfterStep7(LMModule):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.global_step == 7:
                self.trainer.should_stop = True
            super().on_train_batch_end(outputs, batch, batch_idx)

    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, StopAfterStep7))
    cfg = make_cfg(model={"n_layers": 1}, train={"max_steps": 12, "log_every": 3, "eval_every": 100})
    run(corpus, cfg, "stopped-early")
    rows = read_csv(corpus["root"] / "stopped-early" / "logs" / "metrics.csv")
    lr = column_by_step(rows, "train/lr")
    assert sorted(lr) == [2, 5, 6] and sorted(column_by_step(rows, "train/loss")) == [2, 5, 6]
    for step, value in lr.items():
        assert float(value) == pytest.approx(cfg.train.lr * lr_multiplier(step, cfg.train), rel=1e-6), step


def test_a_run_whose_last_step_is_not_a_logging_step_writes_it(corpus):
    """max_steps=10 with log_every=3: Lightning writes steps 2, 5 and 8 (0-based) and, reaching max_steps, nothing
    more; the last step's own training values are written too, under step 9."""
    cfg = make_cfg(model={"n_layers": 1}, train={"max_steps": 10, "log_every": 3, "eval_every": 100})
    run(corpus, cfg, "last-step-between")
    rows = read_csv(corpus["root"] / "last-step-between" / "logs" / "metrics.csv")
    lr = column_by_step(rows, "train/lr")
    assert sorted(lr) == [2, 5, 8, 9] and sorted(column_by_step(rows, "train/loss")) == [2, 5, 8, 9]
    assert float(lr[9]) == pytest.approx(cfg.train.lr * lr_multiplier(9, cfg.train), rel=1e-6)


# --- exact resume ---------------------------------------------------------------------------------
class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing on the way up handles it."""


class KilledDuringStep9(LMModule):
    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        if self.global_step == 9:
            raise Killed()


def kill_during_step_9(corpus, cfg: ExperimentConfig, name: str, monkeypatch) -> None:
    """Run `cfg` into `name` until it is killed during step 9 (after its step-6 checkpoint)."""
    with monkeypatch.context() as mp:
        mp.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, KilledDuringStep9))
        with pytest.raises(Killed):
            run(corpus, cfg, name)


def test_exact_resume_after_a_kill(main_run, corpus, monkeypatch):
    """A run killed during step 9 (after the step-6 checkpoint, with steps 6-8 logged) and run again ends bit-identical to the
    uninterrupted 12-step run: weights, train losses, validation losses and final metrics."""
    cfg = main_run["cfg"]
    d = corpus["root"] / "resumed"

    kill_during_step_9(corpus, cfg, "resumed", monkeypatch)
    assert not (d / "metrics.json").exists() and not (d / "model.pt").exists()
    assert torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    killed_rows = read_csv(d / "logs" / "metrics.csv")
    assert max(int(r["step"]) for r in killed_rows) == 8  # the attempt logged steps past the checkpoint
    killed_env = json.loads((d / "env.json").read_text())
    # the run's cost counts its earlier attempt up to the checkpoint (made large here, so that it shows)
    ckpt = torch.load(d / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["study"]["fit_seconds"] > 0
    ckpt["study"]["fit_seconds"] = 1000.0
    torch.save(ckpt, d / "checkpoints" / "last.ckpt")

    m = run(corpus, cfg, "resumed")  # same config, same directory: resumes from step 6
    assert m["status"] == "completed" and m["steps"] == 12
    env = json.loads((d / "env.json").read_text())  # the resumed attempt's, the killed one's kept beside it
    assert env["earlier_attempts"] == [killed_env] and "earlier_attempts" not in killed_env
    assert run(corpus, cfg, "resumed") == m and json.loads((d / "env.json").read_text()) == env  # finished: as is
    assert 1000.0 < m["cost"]["fit_seconds"] < 1000.0 + 10 * main_run["metrics"]["cost"]["fit_seconds"]
    assert m["cost"]["wall_seconds"] > m["cost"]["fit_seconds"]
    ref = main_run["metrics"]
    assert m["metrics"] == ref["metrics"]
    assert m["train_tokens"] == ref["train_tokens"]

    a = torch.load(main_run["dir"] / "model.pt", weights_only=True)
    b = torch.load(d / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    rows_a = read_csv(main_run["dir"] / "logs" / "metrics.csv")
    rows_b = read_csv(d / "logs" / "metrics.csv")
    for column in ("train/loss", "train/lr", "val/loss", "grad_norm/decoder.00", "grad_norm/other"):
        assert column_by_step(rows_b, column) == column_by_step(rows_a, column), column
    assert sorted(column_by_step(rows_b, "train/loss")) == [2, 5, 8, 11]  # history before the kill kept


def test_tensorboard_is_told_to_hide_earlier_attempts_events_from_the_step_a_run_trains_first(main_run, monkeypatch,
                                                                                               tmp_path):
    """TensorBoard adds an event file per attempt and would draw the steps a resumed run trains again twice: its
    SummaryWriter gets `purge_step`, the checkpoint's step (0 for a run from scratch). CI has no tensorboard: a
    stand-in records what the logger is given; the next test checks the events where tensorboard is installed."""
    from study.record import RunDir
    from study.run.single import _loggers

    made = []
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setattr("lightning.pytorch.loggers.TensorBoardLogger", lambda *a, **kw: made.append(kw))
    ckpt = main_run["dir"] / "checkpoints" / "last.ckpt"
    _loggers(RunDir(tmp_path / "resumed"), main_run["cfg"], ckpt)
    _loggers(RunDir(tmp_path / "fresh"), main_run["cfg"], None)
    step = torch.load(ckpt, weights_only=True)["global_step"]
    assert step > 0 and [kw.get("purge_step") for kw in made] == [step, 0]


def test_a_resumed_runs_tensorboard_events_hold_each_step_once(main_run, corpus, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    kill_during_step_9(corpus, main_run["cfg"], "resumed-tensorboard", monkeypatch)
    run(corpus, main_run["cfg"], "resumed-tensorboard")  # steps 6-8 trained again
    events = EventAccumulator(str(corpus["root"] / "resumed-tensorboard" / "logs" / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 5, 8, 11]


class KilledValidatingAfterStep6(LMModule):
    def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0):
        if self.global_step == 6:
            raise Killed()


def test_a_run_killed_while_it_validates_validates_again_when_resumed(main_run, corpus, monkeypatch):
    """Killed during the validation after step 6, the run resumes from a checkpoint from before that validation
    and runs it again: its validation curve has every point the uninterrupted run's has. (Lightning resumed from a
    checkpoint saved before a validation by skipping it.)"""
    cfg, d = main_run["cfg"], corpus["root"] / "killed-validating"
    with monkeypatch.context() as mp:
        mp.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, KilledValidatingAfterStep6))
        with pytest.raises(Killed):
            run(corpus, cfg, "killed-validating")
    m = run(corpus, cfg, "killed-validating")
    assert m["status"] == "completed" and m["metrics"] == main_run["metrics"]["metrics"]
    rows_a, rows_b = read_csv(main_run["dir"] / "logs" / "metrics.csv"), read_csv(d / "logs" / "metrics.csv")
    assert column_by_step(rows_b, "val/loss") == column_by_step(rows_a, "val/loss")
    assert len(column_by_step(rows_a, "val/loss")) == 2


def test_weight_ema_is_what_is_evaluated_saved_and_resumed(main_run, corpus, monkeypatch):
    """With train.ema_decay the model evaluated and saved is the moving average of the weights after every
    optimizer step, its decay warming up as min(decay, (1 + n) / (10 + n)); the weights trained are untouched (the
    same trajectory as without EMA); and a run killed after its step-6 checkpoint resumes to the same average."""
    decay = 0.8
    cfg = main_run["cfg"].replace(train=main_run["cfg"].train.replace(ema_decay=decay))
    trajectory: list[dict[str, torch.Tensor]] = []

    class Recording(LMModule):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            super().on_train_batch_end(outputs, batch, batch_idx)
            trajectory.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})

    with monkeypatch.context() as mp:
        mp.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, Recording))
        m = run(corpus, cfg, "ema")
    assert m["status"] == "completed" and len(trajectory) == 12
    last_raw = torch.load(main_run["dir"] / "model.pt", weights_only=True)
    for k, v in trajectory[-1].items():  # averaging never feeds back into training
        assert torch.equal(v, last_raw[k]), k
    hand = {k: v.clone() for k, v in trajectory[0].items()}
    for n, weights in enumerate(trajectory[1:], start=1):
        d = min(decay, (1 + n) / (10 + n))
        for k in hand:
            if hand[k].is_floating_point():
                hand[k] = torch.lerp(hand[k], weights[k], 1 - d)
    saved = torch.load(corpus["root"] / "ema" / "model.pt", weights_only=True)
    for k in hand:
        assert torch.allclose(saved[k], hand[k], atol=1e-6), k
    assert not all(torch.equal(saved[k], last_raw[k]) for k in saved)
    assert m["metrics"]["valid_ppl"] != main_run["metrics"]["metrics"]["valid_ppl"]

    kill_during_step_9(corpus, cfg, "ema-resumed", monkeypatch)
    resumed = run(corpus, cfg, "ema-resumed")
    assert resumed["metrics"] == m["metrics"]
    again = torch.load(corpus["root"] / "ema-resumed" / "model.pt", weights_only=True)
    for k in saved:
        assert torch.equal(again[k], saved[k]), k

    # killed after its last checkpoint, while computing the final metrics: the rerun skips training (Lightning runs
    # no on_train_end), and still evaluates and saves the average, not the raw weights of the checkpoint
    class KilledInFinalMetrics(LMModule):
        def final_metrics(self, dm):
            raise Killed()

    with monkeypatch.context() as mp:
        mp.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, KilledInFinalMetrics))
        with pytest.raises(Killed):
            run(corpus, cfg, "ema-final")
    finished = run(corpus, cfg, "ema-final")
    assert finished["metrics"] == m["metrics"]
    for k, v in torch.load(corpus["root"] / "ema-final" / "model.pt", weights_only=True).items():
        assert torch.equal(v, saved[k]), k


def test_a_killed_run_is_not_resumed_on_other_data(main_run, corpus, monkeypatch, tmp_path):
    """Resuming continues a checkpoint: on another copy of the data (other file digests) the run would train on
    two corpora while data.json named the second. Refused, naming the file, with nothing in the directory changed;
    the same data resumes."""
    cfg = main_run["cfg"]
    d = corpus["root"] / "resume-other-data"
    kill_during_step_9(corpus, cfg, "resume-other-data", monkeypatch)
    before = {p: p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}
    write_corpus(tmp_path / "other", seed=1)
    with pytest.raises(RunDirConflict, match=r"trained on other data \(files\.input\.txt: "):
        run_experiment(cfg, d, data_dir=tmp_path / "other", cache_dir=corpus["cache"])
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()} == before
    assert run(corpus, cfg, "resume-other-data")["metrics"] == main_run["metrics"]["metrics"]


def test_data_compared_on_resume_is_what_was_read_not_where_it_came_from():
    from study.run.conflict import data_differences

    local = {"source": "local", "dataset": "multi30k", "files": {"raw/train.de.gz": "aa"}, "tokenizer": ["t1"],
             "examples": {"train": 29000}}
    hub = {"source": "hub", "dataset": "bentrevett/multi30k", "config": None, "revision": "r1", "tokenizer": ["t2"],
           "examples": {"train": 29000}}
    assert data_differences(local, hub) == []  # one benchmark, two copies: nothing to compare but what was read
    assert data_differences(local, {**hub, "examples": {"train": 28999}}) == ["examples.train: 29000 there, 28999 here"]
    assert data_differences(hub, {**hub, "revision": "r2"}) == ["revision: 'r1' there, 'r2' here"]
    assert data_differences({**local, "init_from": "runs/p"}, {**local, "init_from": "/abs/runs/p"}) == []


def test_rerunning_a_finished_run_does_nothing(main_run, corpus, monkeypatch):
    d = main_run["dir"]
    before = {p: p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}

    def no_data(self):
        raise AssertionError("a finished run must not load data or train again")

    monkeypatch.setattr(LMDataModule, "prepare", no_data)
    m = run(corpus, main_run["cfg"], "main")
    assert m == json.loads((d / "metrics.json").read_text())
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()} == before


def test_a_different_config_in_the_same_directory_conflicts(main_run, corpus):
    d = main_run["dir"]
    before = {p: p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}
    other = make_cfg(train={"lr": 1e-3})
    # a finished run of another config: its metrics are not returned as this config's; the error names the field
    with pytest.raises(RunDirConflict, match=r"different config \(train\.lr: 0\.003 there, 0\.001 here\)"):
        run(corpus, other, "main")
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()} == before

    # an unfinished run of another config (only its config.yaml written so far): not resumed
    unfinished = corpus["root"] / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((d / "config.yaml").read_text())
    with pytest.raises(RunDirConflict, match=r"different config \(train\.lr: 0\.003 there, 0\.001 here\)"):
        run(corpus, other, "unfinished")
    assert sorted(p.name for p in unfinished.iterdir()) == ["config.yaml"]


def test_force_reruns_from_scratch(corpus):
    """--force into a directory holding another config's finished run trains the new config from step 0
    (it must not resume the old config's checkpoint)."""
    small = {"model": {"n_layers": 1, "dropout": 0.0}, "train": {"max_steps": 4, "checkpoint_every": 2}}
    old = make_cfg(**small)
    new = make_cfg(**merge(small, {"train": {"lr": 1e-2, "batch_size": 4}}))
    run(corpus, old, "forced")
    with pytest.raises(RunDirConflict):
        run(corpus, new, "forced")
    forced = run(corpus, new, "forced", force=True)
    fresh = run(corpus, new, "fresh")
    assert forced["steps"] == 4 and forced["train_tokens"] == 4 * 4 * SEQ_LEN
    assert forced["metrics"] == fresh["metrics"]
    a = torch.load(corpus["root"] / "forced" / "model.pt", weights_only=True)
    b = torch.load(corpus["root"] / "fresh" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- real data ------------------------------------------------------------------------------------
@pytest.mark.realdata
def test_real_wikitext2_and_tinyshakespeare(tmp_path, monkeypatch):
    if not REAL_DATA.is_dir():
        pytest.skip(f"{REAL_DATA} not found")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("STUDY_DATA_DIR", raising=False)

    prepared: list[LMDataModule] = []
    original = LMDataModule.prepare

    def prepare_then_shorten_evaluation(self):
        original(self)
        prepared.append(self)
        # Evaluating WikiText-2's 463k valid+test tokens through a 33k-word softmax takes minutes on a CPU;
        # this test is about preparing the data and training, so evaluate on the first 2k tokens only.
        for split in set(self.ids) - {"train"}:
            self.ids[split] = self.ids[split][:2048]

    monkeypatch.setattr(LMDataModule, "prepare", prepare_then_shorten_evaluation)
    tiny = {"model": {"preset": "gpt2", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
            "train": {"max_steps": 3, "batch_size": 8, "eval_every": 3, "eval_batches": 1, "progress_bar": False,
                      "accelerator": "cpu", "warmup_steps": 1}}

    wt = ExperimentConfig.from_dict(merge(tiny, {"name": "wt2", "task": {"dataset": "wikitext-2", "seq_len": 16,
                                                                          "eval_lengths": [1]}}))
    assert wt.task.tokenizer == "word"
    m = run_experiment(wt, tmp_path / "wt2", data_dir=REAL_DATA, cache_dir=tmp_path / "cache")
    dm = prepared[-1]
    assert dm.tokenizer.vocab_size == 33278  # WikiText-2's vocabulary, <unk> and <eos> included
    assert {"<unk>", "<eos>"} <= set(dm.tokenizer.tokenizer.get_vocab())
    assert len(dm.ids["train"]) == 2_088_628
    data = json.loads((tmp_path / "wt2" / "data.json").read_text())
    assert data["tokens"] == {"train": 2_088_628, "valid": 217_646, "test": 245_569}
    assert set(data["files"]) == {"train.txt.gz", "valid.txt", "test.txt"}
    assert m["status"] == "completed" and m["steps"] == 3
    assert math.isfinite(m["metrics"]["valid_ppl"]) and m["metrics"]["valid_ppl"] < 2 * 33278
    assert math.isfinite(m["metrics"]["test_ppl"]) and "test_ppl_by_length" in m["metrics"]  # WikiText-2 has one
    assert ExperimentConfig.from_yaml((tmp_path / "wt2" / "config.yaml").read_text()).model.vocab_size == 33278

    ts = ExperimentConfig.from_dict(merge(tiny, {"name": "ts", "task": {"dataset": "tinyshakespeare", "seq_len": 32,
                                                                        "eval_lengths": [1]}}))
    m = run_experiment(ts, tmp_path / "ts", data_dir=REAL_DATA, cache_dir=tmp_path / "cache")
    assert m["status"] == "completed" and m["steps"] == 3
    assert prepared[-1].tokenizer.vocab_size == 66  # 65 characters + <unk>
    assert math.isfinite(m["metrics"]["valid_ppl"])


def test_an_lm_run_imports_neither_glue_metrics_nor_sacrebleu():
    # the task registry imports a family on first use: start-up time is part of every run's wall time
    code = ("import sys; from study.tasks import family; family('lm').implementation(); "
            "print(sorted(m for m in ('sklearn', 'sacrebleu') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    with pytest.raises(ValueError, match="implemented: \\['glue', 'lm', 'pretrain', 'translation'\\]"):
        family("vision")


def test_with_accumulation_a_step_logs_its_mean_loss_and_a_time_budget_stops_between_steps(corpus, monkeypatch):
    """train.accumulate: 2: the logged train/loss is the mean of the optimizer step's micro-batch losses (the last
    one alone is a sample of batch_size); a run stopped by its time budget stops at an optimizer step, never between
    its micro-batches (whose gradients would be dropped and their tokens still counted)."""
    from study.tasks import ledger

    seen: list[tuple[int, float]] = []
    add = ledger.StepLedger.add

    def recording(self, step, loss, tokens):
        seen.append((step, float(loss)))
        add(self, step, loss, tokens)

    monkeypatch.setattr(ledger.StepLedger, "add", recording)
    run(corpus, make_cfg(train={"accumulate": 2, "batch_size": 4}), "accumulated")
    logged = column_by_step(read_csv(corpus["root"] / "accumulated" / "logs" / "metrics.csv"), "train/loss")
    assert logged
    for step, value in logged.items():
        micro = [loss for s, loss in seen if s == step]
        assert len(micro) == 2 and float(value) == pytest.approx(sum(micro) / 2, rel=1e-5)
    for i, budget in enumerate((0.3, 0.5)):
        m = run(corpus, make_cfg(train={"accumulate": 4, "batch_size": 4, "max_steps": 100000, "max_time_s": budget,
                                        "eval_every": 100000, "checkpoint_every": 100000}), f"budget-{i}")
        assert m["stopped_by"] == "time" and m["train_tokens"] == m["steps"] * 4 * 4 * SEQ_LEN


def test_an_evaluation_split_shorter_than_one_window_is_refused_naming_it(tmp_path):
    """A truncated or empty valid file would score valid_loss 0.0 (no window: nothing summed) or fail at the first
    validation, after training steps: refused when the data is read, naming the split."""
    folder = tmp_path / "data" / "tinyshakespeare"
    folder.mkdir(parents=True)
    (folder / "input.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 4)
    with pytest.raises(ValueError, match=r"the tinyshakespeare valid split holds \d+ tokens, fewer than one window"):
        run_experiment(make_cfg(task={"seq_len": 32, "eval_lengths": [1]}, model={"max_seq_len": 32}),
                       tmp_path / "run", data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "run" / "checkpoints").exists()
