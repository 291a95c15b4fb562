"""A run's progress bar counts optimizer steps of train.max_steps and names the run (task, dataset, seed), instead of
Lightning's 'Epoch 0/-2' for a step-budgeted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from study.config import ExperimentConfig
from study.run.progress import run_name


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_bar_counts_steps_of_max_steps_across_epochs_and_names_the_run():
    """Seven steps over two epochs of four batches, in a process of its own, as a user's terminal shows it."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import lightning as L, torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from test_run_progress import _Tiny\n"
        "from study.run.progress import StepProgressBar\n"
        "data = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=2)\n"
        "L.Trainer(max_steps=7, accelerator='cpu', logger=False, enable_checkpointing=False,\n"
        "          enable_model_summary=False, callbacks=[StepProgressBar('glue/sst2 seed 1')]).fit(_Tiny(), data)\n")
    shown = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True,
                           text=True, check=True).stdout  # Lightning's bars write to stdout
    assert "glue/sst2 seed 1 step" in shown and "7/7" in shown
    assert "Epoch" not in shown and "/-" not in shown


def test_a_run_is_named_by_its_task_dataset_and_seed():
    cfg = ExperimentConfig.from_dict({"model": {"preset": "gpt2", "d_model": 32, "n_layers": 1, "n_heads": 2},
                                      "task": {"name": "lm", "dataset": "tinyshakespeare"}, "train": {"seed": 3}})
    assert run_name(cfg) == "lm/tinyshakespeare seed 3"


def test_without_a_bar_a_run_prints_plain_step_lines_for_its_log(capsys):
    """A sweep's trial has no bar (its output is trial.log): it prints `NAME step N/MAX train/...=V (R steps/s)` lines
    at logged steps (here every_s=0: each one) and at the last step, and no carriage-return bar."""
    from study.run.progress import StepLines

    data = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=2)
    L.Trainer(max_steps=7, accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
              enable_progress_bar=False, log_every_n_steps=3,
              callbacks=[StepLines("lm/tinyshakespeare seed 2", every_s=0.0)]).fit(_Tiny(), data)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lm/tinyshakespeare seed 2")]
    assert [line.split()[4] for line in lines] == ["3/7", "6/7", "7/7"]
    assert all(line.endswith("steps/s)") for line in lines)
    assert "\r" not in "".join(lines)
