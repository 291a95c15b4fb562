"""A training step never reads a device tensor (the ledger is read at logging steps only), and the divergence rule:
a non-finite loss, or a finite blow-up above `train.divergence_factor` times the initial loss, ends the run as
`diverged` with its step and the reason; a healthy run is never called diverged."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from study.config import TrainConfig
from study.config.base import ConfigError
from study.tasks.lm import LanguageModelling, LMDataModule, LMModule
from study.tasks.ledger import Read, StepLedger
from tests.test_lm_task import SEQ_LEN, make_cfg, run, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("ledger")
    write_corpus(root / "data")
    return {"root": root, "data": root / "data", "cache": root / "cache"}


def _read(losses, start=0):
    return Read(list(range(start, start + len(losses))), list(losses), [10] * len(losses))


# --- the rule on its own ----------------------------------------------------------------------------
def test_a_non_finite_loss_diverges_at_its_step_even_before_the_initial_loss_is_known():
    ledger = StepLedger(factor=4.0)
    found = ledger.divergence(_read([8.0, 7.5, float("inf"), float("nan")]))
    assert found.step == 2 and "inf" in found.reason


def test_a_finite_blow_up_above_the_factor_diverges_at_the_end_of_its_read():
    ledger = StepLedger(factor=4.0)
    assert ledger.divergence(_read([8.0])) is None  # sets the initial loss: 8
    assert ledger.initial == 8.0
    assert ledger.divergence(_read([30.0, 31.0], start=10)) is None  # below 4 x 8 on average
    found = ledger.divergence(_read([20.0, 400.0], start=12))
    assert found.step == 13 and "above 4 x the initial 8" in found.reason


def test_a_blow_up_in_the_first_read_is_caught_by_that_read():
    ledger = StepLedger(factor=4.0)
    found = ledger.divergence(_read([4.0] + [400.0] * 9))
    assert found is not None and found.step == 9 and "the initial 4" in found.reason


def test_without_a_factor_only_non_finite_losses_diverge():
    ledger = StepLedger(factor=None)
    ledger.divergence(_read([1.0]))
    assert ledger.divergence(_read([1e6], start=10)) is None
    assert ledger.divergence(_read([math.nan], start=11)).step == 11


def test_the_ledger_reads_every_pending_step_once_and_sums_tokens():
    ledger = StepLedger(factor=4.0)
    for step in range(3):
        ledger.add(step, torch.tensor(2.0 + step), torch.tensor(5) if step else 7)  # ints and tensors alike
    read = ledger.read()
    assert read.steps == [0, 1, 2] and read.losses == [2.0, 3.0, 4.0] and read.tokens == [7, 5, 5]
    assert ledger.read() is None


def test_the_factor_must_exceed_one():
    with pytest.raises(ConfigError, match="divergence_factor"):
        TrainConfig(divergence_factor=0.5)


# --- in a run ------------------------------------------------------------------------------------------
class BlowsUpAtStep12(LMModule):
    """A finite blow-up: the loss is multiplied by 100 from step 12 on (as lr 10 without clipping does)."""

    def training_loss(self, batch):
        loss, n = super().training_loss(batch)
        return (loss * 100.0, n) if self.global_step >= 12 else (loss, n)


def test_a_finite_blow_up_is_recorded_as_diverged_with_its_step_and_reason(corpus, monkeypatch):
    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, BlowsUpAtStep12))
    cfg = make_cfg(model={"n_layers": 1}, train={"max_steps": 30, "log_every": 3, "eval_every": 50})
    m = run(corpus, cfg, "finite-blow-up")
    assert m["status"] == "diverged" and m["diverged_at_step"] == 14  # the read of steps 12-14
    assert m["divergence"]["step"] == 14 and "above 4 x the initial" in m["divergence"]["reason"]
    assert m["metrics"] == {} and m["train_tokens"] == 14 * 8 * SEQ_LEN  # steps 0-13 counted
    stored = json.loads((corpus["root"] / "finite-blow-up" / "metrics.json").read_text())
    assert stored["divergence"] == m["divergence"]


def test_the_same_blow_up_completes_when_the_rule_is_off(corpus, monkeypatch):
    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, BlowsUpAtStep12))
    cfg = make_cfg(model={"n_layers": 1}, train={"max_steps": 18, "log_every": 3, "eval_every": 50,
                                                 "divergence_factor": None})
    m = run(corpus, cfg, "blow-up-rule-off")
    assert m["status"] == "completed" and "divergence" not in m


def test_a_healthy_run_is_not_diverged_and_counts_every_token(corpus):
    cfg = make_cfg(train={"max_steps": 20, "log_every": 1, "eval_every": 50})
    m = run(corpus, cfg, "healthy")
    assert m["status"] == "completed" and m["train_tokens"] == 20 * 8 * SEQ_LEN


# --- no host syncs between logging steps -------------------------------------------------------------
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class CountsReads(LMModule):
    """Counts every read of a tensor's value to the host from the start of a training step to the end of its
    on_train_batch_end (forward, backward, clipping, the optimizer, the callbacks and this module's hooks), by
    step. On a CPU nothing waits, but each such call would wait for the device on a GPU."""

    reads_by_step: dict[int, list[str]] = {}
    counting: int | None = None

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        CountsReads.counting = int(self.global_step)
        CountsReads.reads_by_step[CountsReads.counting] = []
        self._mode = ScalarReads()
        self._mode.__enter__()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        self._mode.__exit__(None, None, None)
        CountsReads.counting = None


class ScalarReads(TorchDispatchMode):
    """Reads made below Python: a tensor turned into a Python number inside an operator's argument parsing (a 0-d
    tensor passed where a Scalar is expected) reaches `aten._local_scalar_dense` without calling `.item()`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and CountsReads.counting is not None:
            CountsReads.reads_by_step[CountsReads.counting].append("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


def _counting(name):
    original = getattr(torch.Tensor, name)

    def wrapper(self, *args, **kwargs):
        if CountsReads.counting is not None:
            CountsReads.reads_by_step[CountsReads.counting].append(name)
        return original(self, *args, **kwargs)

    return wrapper


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_training_step_reads_no_tensor_except_at_logging_steps(corpus, monkeypatch, precision):
    # The paths a GPU takes: code that branches on a value where reads are free (the CPU) must not branch here.
    monkeypatch.setattr("study.model.loss.host_reads_are_free", lambda device: False)
    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, CountsReads))
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, _counting(name))
    CountsReads.reads_by_step = {}
    cfg = make_cfg(train={"max_steps": 12, "log_every": 4, "grad_norm_every": 4, "eval_every": 50,
                          "checkpoint_every": 50, "grad_clip": 1.0, "precision": precision, "progress_bar": True,
                          "ema_decay": 0.99})
    run(corpus, cfg, f"host-reads-{precision}")
    assert sorted(CountsReads.reads_by_step) == list(range(12))
    logging_steps = {s for s in range(12) if (s + 1) % 4 == 0 or s % 4 == 0}  # written, or its grad norms taken
    quiet = {s: reads for s, reads in CountsReads.reads_by_step.items() if s not in logging_steps}
    assert quiet and all(reads == [] for reads in quiet.values()), quiet
    assert any(CountsReads.reads_by_step[s] for s in logging_steps)  # the counter does see reads


def test_the_device_path_of_the_fused_loss_equals_the_cpu_path(monkeypatch):
    from study.model.loss import linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    w = (torch.randn(50, 16) * 4).requires_grad_()  # large logits: some picks underflow the softmax
    targets = torch.randint(0, 50, (40,))
    targets[::7] = -100  # ignored rows
    results = []
    for free in (True, False):
        monkeypatch.setattr("study.model.loss.host_reads_are_free", lambda device, free=free: free)
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, targets, chunk_size=16)
        (loss * 0.5).backward()
        results.append((loss.detach(), h.grad.clone(), w.grad.clone()))
    reference = torch.nn.functional.cross_entropy(h.detach() @ w.detach().T, targets)
    assert torch.isfinite(reference) and torch.allclose(results[0][0], reference, rtol=1e-5)
    for cpu, device in zip(results[0], results[1]):
        assert torch.allclose(cpu, device, rtol=1e-5, atol=1e-7)


def test_a_diverged_trial_row_says_why_in_its_error_column():
    from study.sweep.results import _status

    record = {"status": "diverged", "diverged_at_step": 14,
              "divergence": {"step": 14, "reason": "mean training loss 400 over steps 12-14 above 4 x the initial 8"}}
    assert _status(record, [{"id": "s#1", "ended": 1.0, "outcome": "diverged"}]) == (
        "diverged", "mean training loss 400 over steps 12-14 above 4 x the initial 8")
    assert _status({"status": "completed"}, []) == ("completed", "")


class CountsReadsByMicroBatch(CountsReads):
    """CountsReads keyed by micro-batch (batch_idx) rather than by optimizer step."""

    def on_train_batch_start(self, batch, batch_idx):
        LMModule.on_train_batch_start(self, batch, batch_idx)
        CountsReads.counting = int(batch_idx)
        CountsReads.reads_by_step[CountsReads.counting] = []
        self._mode = ScalarReads()
        self._mode.__enter__()


@pytest.mark.parametrize("progress_bar", [True, False])
def test_a_micro_batch_between_optimizer_steps_reads_no_tensor(corpus, monkeypatch, progress_bar):
    """With train.accumulate, global_step still names the step before on the next step's first micro-batch: the
    progress bar (or the plain progress lines) must not take that for a logging step and read the logged values."""
    monkeypatch.setattr("study.model.loss.host_reads_are_free", lambda device: False)
    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, CountsReadsByMicroBatch))
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, _counting(name))
    CountsReads.reads_by_step = {}
    cfg = make_cfg(train={"max_steps": 8, "accumulate": 2, "log_every": 2, "grad_norm_every": 0, "eval_every": 50,
                          "checkpoint_every": 50, "progress_bar": progress_bar})
    run(corpus, cfg, f"host-reads-accumulate-{progress_bar}")
    first_micro_batches = {i: reads for i, reads in CountsReads.reads_by_step.items() if i % 2 == 0}
    assert len(first_micro_batches) == 8 and all(r == [] for r in first_micro_batches.values()), first_micro_batches
    assert any(reads for i, reads in CountsReads.reads_by_step.items() if i % 2 == 1)  # the counter sees the reads
