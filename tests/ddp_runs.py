"""Runs under Lightning DDP on two CPU processes (gloo), for tests/test_ddp_cpu.py: `python tests/ddp_runs.py ROOT CASE`.

Lightning starts rank 1 by running this script again (LOCAL_RANK=1). Each rank writes ROOT/rank<r>.json: the run
records it wrote, the record it returned, the learning rate of each step, the model's parameters at the end of
training and how many broadcasts it made.

CASE: `pipeline` (MLM-only pretraining -> GLUE, the heads each stage leaves unused), `time-budget` (a language
model stopped by train.max_time_s, whose learning rate follows the clock) or `rng` (a language model with dropout,
checkpointed every 2 steps; `rng crash` fails on both ranks after the checkpoint of step 2, as a killed job would
stop). Each rank also records a digest of its random stream at every training step.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")

import torch  # noqa: E402

torch.set_num_threads(1)
ROOT, CASE = Path(sys.argv[1]), sys.argv[2]
CRASH = sys.argv[3:] == ["crash"]
RANK = int(os.environ.get("LOCAL_RANK", 0))
DDP = {"accelerator": "cpu", "devices": 2, "strategy": "ddp"}
SEEN: dict = {"writes": [], "lrs": [], "rng": {}, "broadcasts": 0, "params": None, "returned": None, "loaded": []}


def _config():
    if CASE == "pipeline":
        from test_glue_task import TRAIN, write_glue
        from test_pretrain_task import BASE, write_wikitext

        from study.config import PipelineConfig

        if RANK == 0:
            write_glue(ROOT / "data")
            write_wikitext(ROOT / "data")
        pre = copy.deepcopy(BASE)
        pre["model"]["nsp"] = False
        pre["train"].update(max_steps=3, **DDP)
        glue = {"model": {"arch": "encoder", "objective": "mlm", "dropout": 0.1},
                "task": {"name": "glue", "dataset": "glue", "glue_tasks": ["sst2"], "seq_len": 32,
                         "init_from": "stage:pretrain", "finetune_seeds": [0], "epochs": 1},
                "train": {**TRAIN, "max_steps": 4, **DDP}}
        return PipelineConfig.from_dict({"name": "ddp-pipeline", "stages": {"pretrain": pre, "glue": glue}})
    from test_lm_task import make_cfg, write_corpus

    if RANK == 0:
        write_corpus(ROOT / "data")
    if CASE == "rng":
        return make_cfg(model={"dropout": 0.2}, train={"max_steps": 4, "checkpoint_every": 2, "eval_every": 2,
                                                       "log_every": 2, **DDP})
    return make_cfg(train={"max_steps": 100000, "max_time_s": 4, "schedule": "cosine", "warmup_steps": 1,
                           "eval_every": 100000, "checkpoint_every": 100000, "log_every": 5, "grad_norm_every": 0,
                           **DDP})


def _watch() -> None:
    """Record what this rank does, through the classes every task and run share."""
    from lightning.pytorch.strategies import DDPStrategy

    import study.tasks.glue.module as glue_module
    from study.record import RunDir
    from study.tasks.base import StudyModule

    write, broadcast, step, end = RunDir.write, DDPStrategy.broadcast, StudyModule.training_step, StudyModule.on_train_end
    load = glue_module.load_encoder_weights

    def watched_write(self, record):
        SEEN["writes"].append(str(self.metrics))
        write(self, record)

    def watched_broadcast(self, obj, src=0):
        SEEN["broadcasts"] += 1
        return broadcast(self, obj, src)

    def watched_step(self, batch, index):
        if CRASH and self.global_step == 2:
            raise SystemExit(f"rank {RANK} stops after the checkpoint of step 2")
        SEEN["lrs"].append(self.trainer.optimizers[0].param_groups[0]["lr"])
        SEEN["rng"][self.global_step] = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()
        return step(self, batch, index)

    def watched_end(self):
        end(self)
        SEEN["params"] = [p.detach().double().sum().item() for p in self.model.parameters()]

    def watched_load(model, path):
        SEEN["loaded"].append(Path(path).is_file())
        return load(model, path)

    RunDir.write, DDPStrategy.broadcast = watched_write, watched_broadcast
    StudyModule.training_step, StudyModule.on_train_end = watched_step, watched_end
    glue_module.load_encoder_weights = watched_load


def main() -> None:
    from study.run import run_experiment

    cfg = _config()
    _watch()
    atexit.register(lambda: (ROOT / f"rank{RANK}.json").write_text(json.dumps(SEEN)))
    record = run_experiment(cfg, ROOT / "run", data_dir=ROOT / "data", cache_dir=ROOT / "cache",
                            **({"stage_root": ROOT / "stages"} if CASE == "pipeline" else {}))
    SEEN["returned"] = {"status": record["status"], "metrics": record["metrics"], "steps": record["steps"]}


if __name__ == "__main__":
    main()
