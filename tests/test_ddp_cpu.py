"""Lightning DDP inside a run, proven on two CPU processes (gloo): what a GPU machine's DDP trial does, minus the GPU.

Each case runs tests/ddp_runs.py, which records what each rank did (see its docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "ddp_runs.py"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo on two local processes")


def _run(tmp_path: Path, case: str, *args: str, fails: bool = False) -> tuple[dict, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "RANK")}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), case, *args],
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert (proc.returncode != 0) == fails, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks[0], ranks[1]


def test_a_pretrain_then_glue_pipeline_trains_under_ddp_and_only_rank_zero_writes(tmp_path):
    """MLM-only pretraining leaves the pooler unused and GLUE the MLM head: DDP refuses a parameter that gets no
    gradient, so they are frozen. Every rank runs the stages; rank 1 starts the GLUE stage only once rank 0 has
    written the pretrained model, and returns the record rank 0 wrote (final metrics are computed on rank 0)."""
    zero, one = _run(tmp_path, "pipeline")
    assert sorted(Path(p).relative_to(tmp_path).as_posix() for p in zero["writes"]) == sorted([
        f"stages/{next((tmp_path / 'stages').iterdir()).name}/seed-0/metrics.json",
        "run/glue/SST-2/seed0/metrics.json", "run/glue/metrics.json", "run/metrics.json"])
    assert one["writes"] == []
    assert zero["loaded"] == one["loaded"] == [True]  # the pretrained model.pt was there when each rank read it
    assert zero["returned"]["status"] == "completed" and zero["returned"] == one["returned"]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]["glue_score"] is not None


def test_a_time_budget_gives_every_rank_the_same_learning_rate_and_no_sync_per_step(tmp_path):
    """train.max_time_s decays the learning rate with the clock: each rank reading its own clock would give the
    replicas different learning rates (and different weights); Lightning's Timer broadcast after every step (a
    host sync each). Rank 0's clock is broadcast at logging steps only."""
    zero, one = _run(tmp_path, "time-budget")
    steps = len(zero["lrs"])
    assert steps > 20 and zero["lrs"] == one["lrs"]
    assert zero["params"] == one["params"]
    assert zero["broadcasts"] <= steps // 5 + 5  # log_every 5: one a logging step, a few at start and end
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert record["stopped_by"] == "time" and record["steps"] == steps


def test_each_rank_draws_its_own_dropout_stream_and_a_resumed_run_continues_every_rank_s(tmp_path):
    """Every rank is seeded alike (one model initialisation); alike streams would give each rank's examples rank 0's
    dropout masks. Rank 0 keeps the seed's stream (what one process draws), the others take their own; a checkpoint
    holds every rank's stream, so a run stopped after step 2 and resumed draws what the uninterrupted run drew."""
    whole = _run(tmp_path / "whole", "rng")
    assert all(whole[0]["rng"][s] != whole[1]["rng"][s] for s in whole[0]["rng"])
    assert sorted(whole[0]["rng"]) == ["0", "1", "2", "3"]
    _run(tmp_path / "stopped", "rng", "crash", fails=True)
    resumed = _run(tmp_path / "stopped", "rng")
    for rank in (0, 1):
        assert sorted(resumed[rank]["rng"]) == ["2", "3"]
        assert resumed[rank]["rng"] == {s: whole[rank]["rng"][s] for s in ("2", "3")}
        assert resumed[rank]["params"] == whole[rank]["params"]
