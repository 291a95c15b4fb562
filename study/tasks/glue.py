"""GLUE fine-tuning: the nine tasks, their official metrics, test predictions in the server's format.

A GLUE experiment (`task.name: glue`) is a suite: `task.dataset` names one task (`sst2`, `SST-2`, ...) or `glue`
for the tasks in `task.glue_tasks` (empty: all nine), and each task is fine-tuned once per seed in
`task.finetune_seeds` (empty: `train.seed`). `study run` writes

    <run_dir>/config.yaml, env.json, data.json   the resolved suite (model from task.init_from), data fingerprints
    <run_dir>/metrics.json                       per task: each seed's dev metrics, their mean and std (sample);
                                                 the GLUE score over the tasks run; unavailable tasks with where
                                                 to get them
    <run_dir>/<TASK>/seed<k>/                    one ordinary run directory per (task, seed): config, logs,
                                                 metrics.json, model.pt (encoder), classifier.pt (the head),
                                                 predictions/<TASK>.tsv (its test predictions)
    <run_dir>/submission/<TASK>.tsv              for each task the test predictions of the seed with the best
                                                 dev score, named and formatted as the GLUE server expects
                                                 (`index<TAB>prediction`; MNLI-m.tsv / MNLI-mm.tsv; label names
                                                 for MNLI, QNLI, RTE; 0/1 otherwise; STS-B a score in [0, 5]);
                                                 AX.tsv: the MNLI model's predictions on the diagnostic set
                                                 (glue/diagnostic/diagnostic.tsv; not written when it is absent)

A task whose data cannot be found (here QNLI's train split, MNLI, QQP) is listed under `unavailable` with the
files expected and the hub id, and the other tasks run; a single named task that is unavailable fails the run.

Inputs are `[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]` with segment ids 0/1, truncated longest-first to
`task.seq_len`; the classifier reads the tanh pooler over [CLS] (`task.pooling: cls`, BERT's) or over the mean of the
final hidden states of the real tokens (`mean`) (cross-entropy; mean squared error for the STS-B regression).
With `task.init_from: RUN_DIR` (a finished pretrain run) the encoder's architecture, weights and tokenizer come
from there; only `model.dropout`/`attention_dropout` are taken from this config; the NSP head is dropped.
`task.pretrained_weights: false` keeps the tokenizer and architecture and starts from random weights.
Without `init_from`, a WordPiece vocabulary is trained on the task's training text and the model section is used.
`task.per_task` gives single tasks their own settings (`{cola: {train.lr: 1.0e-4, task.epochs: 6}}`: any train
field but the seed, task.epochs, pooling, seq_len, and model.dropout, attention_dropout), applied over the suite's
for that task's runs only.
Fine-tuning steps are `min(train.max_steps, task.epochs passes)`, capped by `train.max_time_s` per (task, seed);
warm-up is at most a tenth of the steps; with a time budget the decay follows whichever of steps and time runs out
first.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from study.config import ExperimentConfig
from study.config.task import glue_task_key
from study.io import atomic_write, atomic_write_json, atomic_write_text, read_json
from study.model.transformer import SequenceClassificationHead
from study.tasks.base import StepIndexedBatches, StudyDataModule, StudyModule, length_grouped_batches, seeded_generator
from study.tasks.data import (
    GLUE_TASK_NAMES,
    DatasetUnavailable,
    GlueTaskInfo,
    TrainedTokenizer,
    build_tokenizer,
    glue_task_info,
    load_glue,
)
from study.tasks.glue_metrics import GLUE_TASK_COUNT, compute_metrics, glue_score, task_score
from study.tasks.pretrain import CLS, PAD, SEP, SPECIALS, TOKENIZER_FILE

log = logging.getLogger(__name__)

# test split -> file name the GLUE server expects; the diagnostic set (AX) is predicted by the MNLI model
SUBMISSION_FILES = {
    ("MNLI", "test_matched"): "MNLI-m",
    ("MNLI", "test_mismatched"): "MNLI-mm",
    ("MNLI", "diagnostic"): "AX",
}
PRETRAIN_FILES = ("config.yaml", "model.pt", TOKENIZER_FILE, "metrics.json")


def submission_name(task: str, split: str) -> str:
    return SUBMISSION_FILES.get((task, split), task)


# --------------------------------------------------------------------------------------------------------------------
# the pretrained run


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pretrained_config(init_from: str | Path) -> ExperimentConfig:
    """The config of a finished pretrain run directory; a clear ValueError (naming task.init_from) otherwise."""
    run_dir = Path(init_from)
    hint = "give the directory of a finished pretrain run, e.g. runs/wikitext2-bert-nsp"
    if not run_dir.is_dir():
        raise ValueError(f"task.init_from: {run_dir} does not exist; {hint}")
    missing = [f for f in PRETRAIN_FILES if not (run_dir / f).is_file()]
    if missing:
        raise ValueError(f"task.init_from: {run_dir} is not a finished pretrain run (missing {missing}); {hint}")
    status = read_json(run_dir / "metrics.json").get("status")
    if status != "completed":
        raise ValueError(f"task.init_from: the run in {run_dir} did not complete (status {status!r})")
    cfg = ExperimentConfig.from_yaml(run_dir.joinpath("config.yaml").read_text())
    if cfg.model.arch != "encoder" or cfg.model.objective != "mlm":
        raise ValueError(f"task.init_from: {run_dir} holds a {cfg.model.arch}/{cfg.model.objective} model "
                         f"(task {cfg.task.name!r}); GLUE fine-tunes an MLM encoder from a pretrain run")
    return cfg


def resolve_model(cfg: ExperimentConfig) -> ExperimentConfig:
    """With task.init_from, the model section becomes the pretrained architecture (NSP head dropped), keeping
    this config's dropout; the combination is validated again (e.g. seq_len against learned positions)."""
    if not cfg.task.init_from:
        return cfg
    pre = pretrained_config(cfg.task.init_from).model
    model = pre.replace(nsp=False, dropout=cfg.model.dropout, attention_dropout=cfg.model.attention_dropout)
    return cfg.replace(model=model)


def pretrained_tokenizer(init_from: str | Path) -> TrainedTokenizer:
    path = Path(init_from) / TOKENIZER_FILE
    tok = Tokenizer.from_file(str(path))
    ids = [tok.token_to_id(s) for s in SPECIALS]
    if ids != list(range(len(SPECIALS))):
        raise ValueError(f"task.init_from: {path} has special ids {ids}, expected {list(range(len(SPECIALS)))}")
    return TrainedTokenizer(tok, "pretrained", _sha256(path), path, True, SPECIALS, "[UNK]")


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


# --------------------------------------------------------------------------------------------------------------------
# inputs


def encode_example(tok: TrainedTokenizer, a: str, b: str | None, seq_len: int) -> tuple[list[int], list[int]]:
    """[CLS] a [SEP] (b [SEP]) with segment ids, the longer text trimmed from its end until it fits."""
    ids_a = tok.encode(a)
    if b is None:
        ids_a = ids_a[: seq_len - 2]
        return [CLS, *ids_a, SEP], [0] * (len(ids_a) + 2)
    ids_b = tok.encode(b)
    while len(ids_a) + len(ids_b) > seq_len - 3:
        (ids_a if len(ids_a) > len(ids_b) else ids_b).pop()
    return [CLS, *ids_a, SEP, *ids_b, SEP], [0] * (len(ids_a) + 2) + [1] * (len(ids_b) + 1)


def collate(examples: Sequence[tuple[list[int], list[int]]], labels: Sequence | None, regression: bool) -> dict[str, torch.Tensor]:
    width = max(len(x) for x, _ in examples)
    ids = torch.full((len(examples), width), PAD, dtype=torch.long)
    types = torch.zeros((len(examples), width), dtype=torch.long)
    for k, (x, t) in enumerate(examples):
        ids[k, : len(x)] = torch.tensor(x)
        types[k, : len(t)] = torch.tensor(t)
    batch = {"input_ids": ids, "token_type_ids": types}
    if bool((ids == PAD).any()):
        batch["padding_mask"] = ids != PAD
    if labels is not None:
        batch["labels"] = torch.tensor(list(labels), dtype=torch.float32 if regression else torch.long)
    return batch


class GlueDataModule(StudyDataModule):
    def __init__(self, cfg: ExperimentConfig, data_dir: str | Path | None = None, cache_dir: str | Path | None = None):
        super().__init__(cfg)
        self.data_dir, self.cache_dir = data_dir, cache_dir
        self.info: GlueTaskInfo = glue_task_info(cfg.task.dataset)
        self._epoch: tuple[int, list[list[int]]] | None = None  # (epoch, its batches), built on first use

    def prepare(self) -> None:
        task = self.cfg.task
        if task.dataset == "glue":
            raise ValueError("task.dataset: 'glue' is a suite; run it with study.run.run_experiment")
        self.data = load_glue(self.info.name, self.data_dir)
        if task.init_from:
            pretrained_config(task.init_from)
            self.tokenizer = pretrained_tokenizer(task.init_from)
            origin = {"init_from": str(task.init_from), "model_sha256": _sha256(Path(task.init_from) / "model.pt"),
                      "pretrained_weights": task.pretrained_weights}
        else:
            texts = [t for e in self.data[self.info.train_split] for t in (e.text_a, e.text_b) if t]
            fp = {"glue": self.data.fingerprint, "split": self.info.train_split}
            self.tokenizer = build_tokenizer(task.tokenizer, texts, task.vocab_size, SPECIALS, self.cache_dir, fp,
                                             lowercase=task.lowercase)
            origin = {"init_from": None}
        self.encoded = {
            split: [encode_example(self.tokenizer, e.text_a, e.text_b, task.seq_len) for e in examples]
            for split, examples in self.data.splits.items()
        }
        self.labels = {split: [e.label for e in examples] for split, examples in self.data.splits.items()}
        self.n_train = len(self.encoded[self.info.train_split])
        if self.n_train == 0:
            raise ValueError(f"GLUE {self.info.name}: the training split is empty")
        self.fingerprint = {**self.data.fingerprint, "tokenizer": self.tokenizer.key, **origin,
                            "examples": {k: len(v) for k, v in self.encoded.items()},
                            "unavailable_splits": list(self.data.unavailable_splits)}
        self.train_stream = StepIndexedBatches(self._train_batch)

    def model_overrides(self) -> dict[str, Any]:
        return {"vocab_size": self.tokenizer.vocab_size, "pad_token_id": PAD}

    def save_artifacts(self, run_dir: Path) -> None:
        atomic_write(Path(run_dir) / TOKENIZER_FILE, lambda p: self.tokenizer.tokenizer.save(str(p)))

    def _train_batch(self, i: int) -> dict[str, torch.Tensor]:
        """Batch i of the training stream: length-grouped (GLUE sentences range from 3 to 128 tokens, so random
        batches padded to their longest are two-thirds padding on SST-2), reshuffled every epoch."""
        bs, split = self.cfg.train.batch_size, self.info.train_split
        epoch, pos = divmod(i, math.ceil(self.n_train / bs))
        if self._epoch is None or self._epoch[0] != epoch:
            lengths = [len(ids) for ids, _ in self.encoded[split]]
            self._epoch = (epoch, length_grouped_batches(lengths, bs, seeded_generator(self.cfg.train.seed, -1 - epoch)))
        idx = self._epoch[1][pos]
        return collate([self.encoded[split][j] for j in idx], [self.labels[split][j] for j in idx], self.info.is_regression)

    def batches(self, split: str, batch_size: int = 128, with_labels: bool = True) -> tuple[list[dict], list[int]]:
        """Length-sorted batches of a split and the order they hold the examples in."""
        enc = self.encoded[split]
        order = sorted(range(len(enc)), key=lambda j: len(enc[j][0]))
        labels = self.labels[split]
        out = []
        for k in range(0, len(order), batch_size):
            chunk = order[k : k + batch_size]
            out.append(collate([enc[j] for j in chunk], [labels[j] for j in chunk] if with_labels else None,
                               self.info.is_regression))
        return out, order

    def val_dataloader(self):
        return self._loader(self.batches(self.info.eval_splits[0], self.cfg.train.batch_size)[0], batch_size=None)


class GlueModule(StudyModule):
    def __init__(self, cfg: ExperimentConfig):
        super().__init__(cfg)
        self.info = glue_task_info(cfg.task.dataset)
        self.head = SequenceClassificationHead(cfg.model, self.info.num_labels)
        if cfg.task.init_from and cfg.task.pretrained_weights:
            load_encoder_weights(self.model, Path(cfg.task.init_from) / "model.pt")
        self.test_predictions: dict[str, list[tuple[int, Any]]] = {}

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.net(batch["input_ids"], token_type_ids=batch["token_type_ids"], padding_mask=batch.get("padding_mask"))
        pooled = self.model.pooled(h, batch.get("padding_mask"), self.cfg.task.pooling)
        return self.head(pooled).float()

    def training_loss(self, batch) -> tuple[torch.Tensor, int]:
        out = self.logits(batch)
        if self.info.is_regression:
            loss = F.mse_loss(out.squeeze(-1), batch["labels"])
        else:
            loss = F.cross_entropy(out, batch["labels"])
        tokens = int(batch["padding_mask"].sum()) if "padding_mask" in batch else batch["input_ids"].numel()
        return loss, tokens

    @torch.no_grad()
    def predict(self, dm: GlueDataModule, split: str) -> list:
        """Predicted class ids (scores for STS-B) for every example of a split, in file order."""
        self.model.eval()
        self.head.eval()
        batches, order = dm.batches(split, with_labels=False)
        flat: list = []
        for batch in batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self.precision_context():
                out = self.logits(batch)
            flat += (out.squeeze(-1) if self.info.is_regression else out.argmax(-1)).tolist()
        preds: list = [None] * len(order)
        for j, p in zip(order, flat):
            preds[j] = p
        return preds

    def final_metrics(self, dm: GlueDataModule) -> dict[str, Any]:
        info = self.info
        dev = {split: compute_metrics(info.metrics, dm.labels[split], self.predict(dm, split))
               for split in info.eval_splits}
        for split in info.test_splits:
            if split in dm.encoded:
                idxs = [e.idx for e in dm.data[split]]
                self.test_predictions[split] = list(zip(idxs, self.predict(dm, split)))
        return {"task": info.name, "score": task_score(dev), **flat_metrics(info, dev), "dev": dev,
                "n_train": dm.n_train, "n_dev": {s: len(dm.encoded[s]) for s in info.eval_splits}}

    def save_outputs(self, run_dir: Path) -> None:
        """The classifier head (model.pt holds the encoder) and the test predictions in the GLUE server format."""
        atomic_write(Path(run_dir) / "classifier.pt", lambda p: torch.save(self.head.state_dict(), p))
        for split, rows in self.test_predictions.items():
            write_submission(Path(run_dir) / "predictions" / f"{submission_name(self.info.name, split)}.tsv", self.info, rows)


def flat_metrics(info: GlueTaskInfo, dev: dict[str, dict[str, float]]) -> dict[str, float]:
    """{metric: value} for a single dev split; MNLI's become accuracy_m and accuracy_mm."""
    if len(info.eval_splits) == 1:
        return dict(dev[info.eval_splits[0]])
    suffix = {"dev_matched": "m", "dev_mismatched": "mm"}
    return {f"{k}_{suffix.get(split, split)}": v for split in info.eval_splits for k, v in dev[split].items()}


def format_prediction(info: GlueTaskInfo, pred) -> str:
    if info.is_regression:
        return f"{min(5.0, max(0.0, float(pred))):.3f}"
    if info.label_map is not None and info.label_names is not None:  # MNLI, QNLI, RTE: label names
        return info.label_names[int(pred)]
    return str(int(pred))


def write_submission(path: Path, info: GlueTaskInfo, rows: Sequence[tuple[int, Any]]) -> None:
    lines = ["index\tprediction"] + [f"{idx}\t{format_prediction(info, p)}" for idx, p in rows]
    atomic_write_text(path, "\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------------------------------------
# the suite


def suite_tasks(cfg: ExperimentConfig) -> list[str]:
    names = (cfg.task.glue_tasks or GLUE_TASK_NAMES) if cfg.task.dataset == "glue" else (cfg.task.dataset,)
    return list(dict.fromkeys(glue_task_info(t).name for t in names))


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def run_glue(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Fine-tune every task of the suite once per seed (see the module docstring); returns the metrics dict."""
    from study.environment import snapshot
    from study.model.accounting import parameter_count
    from study.run import FINISHED, RunDirConflict, run_single

    started = time.time()
    run_dir = Path(run_dir)
    cfg = resolve_model(cfg)  # init_from problems surface here, before any data or training
    tasks = suite_tasks(cfg)
    seeds = list(cfg.task.finetune_seeds or (cfg.train.seed,))
    metrics_path, config_path = run_dir / "metrics.json", run_dir / "config.yaml"

    if not force and config_path.exists():
        stored = ExperimentConfig.from_yaml(config_path.read_text())
        asked = cfg.replace(model=cfg.model.replace(vocab_size=stored.model.vocab_size))  # decided by the data
        if stored != asked:
            raise RunDirConflict.between(run_dir, stored, asked)
    if not force and metrics_path.exists() and read_json(metrics_path).get("status") in FINISHED:
        log.info("%s already finished; nothing to do", run_dir)
        return read_json(metrics_path)

    atomic_write_text(config_path, cfg.to_yaml())  # the suite as given, its model resolved from init_from
    atomic_write_json(run_dir / "env.json", snapshot(cfg.train.precision))
    results: dict[str, dict[str, Any]] = {}
    unavailable: dict[str, str] = {}
    fingerprints: dict[str, Any] = {}
    parameters: int | None = None
    totals = {"steps": 0, "train_tokens": 0, "fit_seconds": 0.0}
    for name in tasks:
        try:
            data = load_glue(name, data_dir)
        except DatasetUnavailable as err:
            if len(tasks) == 1:
                raise
            log.warning("GLUE %s unavailable; skipped:\n%s", name, err)
            unavailable[name] = str(err)
            continue
        fingerprints[name] = data.fingerprint
        n_train = len(data[data.train_split])
        task_cfg = cfg.for_glue_task(name)  # the suite's settings with this task's task.per_task entry applied
        t = task_cfg.train
        steps = t.max_steps
        if task_cfg.task.epochs is not None:
            steps = max(1, min(steps, math.ceil(task_cfg.task.epochs * n_train / (t.batch_size * t.accumulate))))
        seed_runs: dict[str, Any] = {}
        for seed in seeds:
            sub = task_cfg.replace(
                name=f"{cfg.name}.{name}.seed{seed}",
                task=task_cfg.task.replace(dataset=glue_task_key(name), glue_tasks=(), finetune_seeds=(seed,)),
                train=t.replace(seed=seed, max_steps=steps, warmup_steps=min(t.warmup_steps, steps // 10)),
            )
            m = run_single(sub, run_dir / name / f"seed{seed}", data_dir=data_dir, cache_dir=cache_dir, force=force)
            parameters = parameters or m["cost"].get("parameters")
            seed_runs[str(seed)] = {"status": m["status"], "steps": m["steps"], **m["metrics"]}
            for k in ("steps", "train_tokens"):
                totals[k] += int(m.get(k) or 0)
            totals["fit_seconds"] += float(m["cost"]["fit_seconds"])
        results[name] = _aggregate(name, seed_runs)
        best = results[name].get("best_seed")
        if best is not None:
            src = run_dir / name / f"seed{best}" / "predictions"
            for f in sorted(src.glob("*.tsv")) if src.is_dir() else []:
                (run_dir / "submission").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, run_dir / "submission" / f.name)

    atomic_write_json(run_dir / "data.json", {"init_from": cfg.task.init_from, "tasks": fingerprints})

    scores = {k: v["score_mean"] for k, v in results.items() if v.get("score_mean") is not None}
    summary: dict[str, Any] = {
        "glue_score": glue_score(scores) if scores else None,
        "glue_score_tasks": sorted(scores),
        "glue_score_complete": len(scores) == GLUE_TASK_COUNT,
        "seeds": seeds,
    }
    for name, r in results.items():
        for k, v in r.get("mean", {}).items():
            summary[f"{name}/{k}"] = v
            summary[f"{name}/{k}_std"] = r["std"][k]
    summary["unavailable_tasks"] = sorted(unavailable)
    statuses = {s["status"] for r in results.values() for s in r["seeds"].values()}
    metrics = {
        "status": "diverged" if "diverged" in statuses else "completed",
        "diverged_at_step": None,
        "steps": totals["steps"],
        "stopped_by": None,
        "train_tokens": totals["train_tokens"],
        "metrics": {**summary, "tasks": results, "unavailable": unavailable},
        "cost": {"parameters": parameters or parameter_count(cfg.model), "fit_seconds": totals["fit_seconds"],
                 "wall_seconds": time.time() - started},
    }
    atomic_write_json(metrics_path, metrics)
    return metrics


def _aggregate(name: str, seed_runs: dict[str, Any]) -> dict[str, Any]:
    """Mean and sample standard deviation over the seeds of every metric and of the task score."""
    info = glue_task_info(name)
    done = {s: r for s, r in seed_runs.items() if r["status"] == "completed" and "score" in r}
    out: dict[str, Any] = {"seeds": seed_runs, "metrics": list(info.metrics)}
    if not done:
        return {**out, "score_mean": None}
    keys = [k for k, v in next(iter(done.values())).items() if isinstance(v, float) and k != "score"]
    out["mean"], out["std"] = {}, {}
    for k in keys:
        out["mean"][k], out["std"][k] = _mean_std([r[k] for r in done.values()])
    out["score_mean"], out["score_std"] = _mean_std([r["score"] for r in done.values()])
    out["best_seed"] = max(done, key=lambda s: done[s]["score"])
    return out
