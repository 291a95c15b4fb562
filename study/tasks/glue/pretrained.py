"""The pretrained run a GLUE experiment fine-tunes (`task.init_from`): its config, tokenizer and encoder weights."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from study.config import ExperimentConfig
from study.io import file_sha256 as sha256
from study.record import COMPLETED, RunDir
from study.tasks.data import TrainedTokenizer
from study.tasks.pretrain import SPECIALS, TOKENIZER_FILE

PRETRAIN_FILES = ("config.yaml", "model.pt", TOKENIZER_FILE, "metrics.json")
HINT = "give the directory of a finished pretrain run, e.g. runs/wikitext2-bert-nsp"


def pretrained_config(init_from: str | Path) -> ExperimentConfig:
    """The config of a finished pretrain run directory; a clear ValueError (naming task.init_from) otherwise."""
    run = RunDir(init_from)
    if not run.path.is_dir():
        raise ValueError(f"task.init_from: {run.path} does not exist; {HINT}")
    missing = [f for f in PRETRAIN_FILES if not (run / f).is_file()]
    if missing:
        raise ValueError(f"task.init_from: {run.path} is not a finished pretrain run (missing {missing}); "
                         f"{_pipeline_hint(run) or HINT}")
    status = (run.read() or {}).get("status")
    if status != COMPLETED:
        raise ValueError(f"task.init_from: the run in {run.path} did not complete (status {status!r})")
    cfg = ExperimentConfig.from_yaml(run.config.read_text())
    check_pretrained(cfg, str(run.path))
    return cfg


def _pipeline_hint(run: RunDir) -> str | None:
    """Where a pipeline's stages ran, when `run` is a pipeline's folder (its stages are run directories elsewhere:
    a pretraining stage is shared by every pipeline that runs it, under stages/<hash>/seed-<n>)."""
    stages = (run.read() or {}).get("stages")
    if not isinstance(stages, dict) or not stages:
        return None
    where = ", ".join(f"{name}: {s.get('run_dir')}" for name, s in stages.items() if isinstance(s, dict))
    return f"{run.path} is a pipeline's folder, whose stages ran in {where}; give the pretraining stage's directory"


def check_pretrained(cfg: ExperimentConfig, where: str) -> None:
    if cfg.model.arch != "encoder" or cfg.model.objective != "mlm":
        raise ValueError(f"task.init_from: {where} holds a {cfg.model.arch}/{cfg.model.objective} model "
                         f"(task {cfg.task.name!r}); GLUE fine-tunes an MLM encoder from a pretrain run")
    # A GLUE run's model is an MLM encoder too, but its directory is a suite (one model per task and seed, no
    # tokenizer at the top), so starting from one could only fail once it has trained: refused here, before.
    if cfg.task.name != "pretrain":
        raise ValueError(f"task.init_from: {where} is a {cfg.task.name!r} run, which leaves no single encoder to "
                         "start from; GLUE fine-tunes an MLM encoder from a pretrain run")


def pretrained_tokenizer(init_from: str | Path) -> TrainedTokenizer:
    path = Path(init_from) / TOKENIZER_FILE
    tok = Tokenizer.from_file(str(path))
    ids = [tok.token_to_id(s) for s in SPECIALS]
    if ids != list(range(len(SPECIALS))):
        raise ValueError(f"task.init_from: {path} has special ids {ids}, expected {list(range(len(SPECIALS)))}")
    return TrainedTokenizer(tok, "pretrained", sha256(path), path, True, SPECIALS, "[UNK]")


def load_encoder_weights(model: torch.nn.Module, path: Path) -> None:
    """Copy a pretrained EncoderModel state dict into `model` (its NSP head, if any, is not used)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k: v for k, v in state.items() if not k.startswith("nsp_head.")}
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [k for k in set(own) & set(state) if own[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(f"task.init_from: {path} does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, shape mismatch {sorted(shapes)[:5]}")
    model.load_state_dict(state, strict=False)
