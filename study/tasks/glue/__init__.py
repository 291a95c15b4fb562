"""GLUE fine-tuning (`task.name: glue`): the tasks, their official metrics on the 0-100 scale, test predictions in
the server's format.

A GLUE experiment is a suite of runs, which the run layer runs through this family's hooks (`sub_runs`,
`combine`): `task.dataset` names one task (`sst2`, `SST-2`, ...) or `glue` for the tasks in `task.glue_tasks`
(empty: all nine), and each task is fine-tuned once per seed in `task.finetune_seeds` (empty: `train.seed`):

    <run_dir>/config.yaml, env.json, data.json   the resolved suite (model from task.init_from), data fingerprints
    <run_dir>/metrics.json                       per task: the mean over seeds of each dev metric and its sample
                                                 standard deviation (null for one seed: one seed has no spread;
                                                 none for a task with a diverged seed); the GLUE score over the
                                                 tasks run (null when one is unscored); every seed's numbers under
                                                 `parts`; unavailable tasks with where to get them; `init`: where
                                                 the encoder came from (pretrained with or without NSP, or random)
    <run_dir>/<TASK>/seed<k>/                    one ordinary run directory per (task, seed): config, logs,
                                                 metrics.json, model.pt (encoder), classifier.pt (the head),
                                                 predictions/<TASK>.tsv (its test predictions)
    <run_dir>/submission/<TASK>.tsv              for each task the test predictions of the seed with the best
                                                 dev score, named and formatted as the GLUE server expects

A task whose data cannot be found (here QNLI's train split, MNLI, QQP) is listed under `unavailable` with the
files expected and the hub id, and the other tasks run; a single named task that is unavailable fails the run.

Inputs are `[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]` with segment ids 0/1 (`study.tasks.glue.data`); the
classifier reads the tanh pooler over [CLS] (`task.pooling: cls`, BERT's) or over the mean of the final hidden
states of the real tokens (`mean`). With `task.init_from: RUN_DIR` (a finished pretrain run) the encoder's
architecture, weights and tokenizer come from there; only `model.dropout`/`attention_dropout` are taken from this
config; the NSP head is dropped. `task.pretrained_weights: false` keeps the tokenizer and architecture and starts
from random weights. Without `init_from`, a WordPiece vocabulary is trained on the task's training text and the
model section is used. `task.per_task` gives single tasks their own settings (`{cola: {train.lr: 1.0e-4,
task.epochs: 6}}`). Fine-tuning steps are `min(train.max_steps, task.epochs passes)`, capped by `train.max_time_s`
per (task, seed); warm-up is at most a tenth of the steps.
"""

from __future__ import annotations

import math
import shutil
import statistics
from pathlib import Path
from typing import Any

from study.config import ConfigError, ExperimentConfig
from study.config.pipeline import stage_ref
from study.config.task import PER_TASK_MODEL_FIELDS, glue_task_key
from study.tasks.contract import MetricSpec, SubRun, TaskFamily
from study.tasks.data import GLUE_TASK_NAMES, DatasetUnavailable, glue_task_info, load_glue

_METRIC_CONSTANTS = ("the training majority class: SST-2 accuracy 50.9, RTE 52.7, WNLI 56.3, MRPC F1 81.2 / "
                     "accuracy 68.4; MCC 0 (CoLA); correlation 0 (STS-B)")



def _scale(metric: str) -> str:
    """A metric's scale: points on 0-100, a correlation's down to -100 (a prediction that runs against the labels)."""
    return "0-100 (a correlation: -100 to 100)" if metric in ("mcc", "pearson", "spearman") else "0-100"


class Glue(TaskFamily):
    """Fine-tuning on GLUE tasks, each once per fine-tuning seed (`glue`)."""

    name = "glue"
    suite = True
    # GLUE's test labels are not public: every quality metric is on a dev split, which is its validation split
    metrics = (
        MetricSpec("glue_score", "maximize", "0-100",
                   "39.1 over SST-2, CoLA, MRPC, STS-B, RTE, WNLI for the training majority class",
                   description="unweighted mean of the task scores of the tasks run (glue_score_tasks); the "
                               "benchmark's GLUE score only when all nine ran (glue_score_complete)", split="valid",
                   # a mean over other tasks is another number: those asked for, and those whose data a run read
                   defined_by=("task.glue_tasks", "metric.glue_score_tasks")),
        MetricSpec("*_std", "minimize", "0-100 (sample sd over fine-tuning seeds)", "-", objective=False,
                   description="spread over the fine-tuning seeds; null for one seed"),
        MetricSpec("seeds", "maximize", "seed ids", "-", objective=False,
                   description="the fine-tuning seeds every task ran (bookkeeping, not a measurement)"),
        MetricSpec("*/score", "maximize", "0-100", _METRIC_CONSTANTS,
                   description="the task's score: mean of its metrics (mean over fine-tuning seeds)", split="valid"),
        *(MetricSpec(f"*/{m}", "maximize", _scale(m), _METRIC_CONSTANTS, description=f"dev {m}, mean over seeds",
                     split="valid")
          for m in ("accuracy", "f1", "mcc", "pearson", "spearman", "accuracy_m", "accuracy_mm")),
    )
    default_objective = "glue_score"
    reads_task_fields = frozenset({"seq_len", "tokenizer", "vocab_size", "lowercase", "glue_tasks", "init_from",
                                   "pretrained_weights", "finetune_seeds", "epochs", "pooling", "per_task"})
    unread_train_fields = frozenset({"label_smoothing"})
    part_settings = ("each task's train.max_steps is capped at task.epochs passes over its training set, and its "
                     "train.warmup_steps at a tenth of its steps (sub_runs).")
    # the metrics of one part (task, seed) of the suite
    part_metrics = (
        MetricSpec("score", "maximize", "0-100", _METRIC_CONSTANTS, split="valid"),
        *(MetricSpec(m, "maximize", _scale(m), _METRIC_CONSTANTS, split="valid")
          for m in ("accuracy", "f1", "mcc", "pearson", "spearman", "accuracy_m", "accuracy_mm")),
        MetricSpec("dev.*", "maximize", "0-100", _METRIC_CONSTANTS, description="each dev split's metrics",
                   split="valid"),
        MetricSpec("n_train", "maximize", "count", "-", objective=False),
        MetricSpec("n_dev.*", "maximize", "count", "-", objective=False),
        MetricSpec("truncated.*", "minimize", "count", "-", objective=False,
                   description="examples of the split (key) longer than task.seq_len tokens, cut to it as BERT does "
                               "(the longer text of a pair from its end): scored or trained on part of their text"),
    )

    def check_data(self, cfg: ExperimentConfig, data_dir) -> None:
        self.sub_runs(cfg, data_dir)  # (a suite runs the tasks it can read; DatasetUnavailable where it reads none)

    def metric_without_data(self, cfg: ExperimentConfig, metric: str, data_dir) -> str | None:
        """A task's metric (`QNLI/accuracy`) when the suite runs that task but cannot read its data: it skips the
        task (as unavailable) and scores the others, so the metric is never written."""
        task, slash, _ = metric.partition("/")
        if not slash or task not in suite_tasks(cfg):
            return None
        try:
            load_glue(task, data_dir)
        except DatasetUnavailable as err:
            return f"{metric} is never written: the suite skips {task}, whose data cannot be read:\n{err}"
        return None

    def implementation(self):
        from study.tasks.glue.data import GlueDataModule
        from study.tasks.glue.module import GlueModule

        return GlueDataModule, GlueModule

    def predicted_fraction(self, cfg: ExperimentConfig) -> float:
        return 0.0  # a pooled classifier replaces the vocabulary projection

    def unwritten_metric(self, cfg: ExperimentConfig, metric: str) -> str | None:
        """A per-task metric (`TASK/metric`) is written only for a task the suite runs, spelled as the record
        spells it (`SST-2`), and only for a metric that task has (SST-2 no F1; MNLI accuracy_m and accuracy_mm)."""
        task, slash, name = metric.partition("/")
        if not slash or "*" in metric:
            return None
        tasks = suite_tasks(cfg)
        if task not in tasks:
            return (f"{metric} is never written: the suite runs {tasks}, and records each task's metrics as "
                    f"TASK/metric with these spellings")
        written = [f"{task}/{m}" for m in ("score", *glue_task_info(task).flat_metrics)]
        return None if metric in written else f"{metric} is never written: {task} writes {written}"

    # -- what reaches the model ------------------------------------------------------------------------------
    def overridden_fields(self, cfg: ExperimentConfig) -> dict[str, str]:
        out = {"model.nsp": "GLUE fine-tuning drops the next-sentence head, so it is never trained here; vary "
                            "model.nsp where the encoder is pretrained (a pipeline's pretraining stage)",
               "model.tie_embeddings": "the classifier reads no vocabulary projection, so tying it to the embedding "
                                       "changes only how the embedding is first drawn; vary it where the encoder is "
                                       "pretrained (a pipeline's pretraining stage)"}
        if cfg.task.init_from:
            why = ("task.init_from takes the architecture from the pretrained run; vary it where the encoder is "
                   "pretrained (a pipeline's pretraining stage)")
            from study.config import ModelConfig
            import dataclasses

            out.update({f"model.{f.name}": why for f in dataclasses.fields(ModelConfig)
                        if f.name not in PER_TASK_MODEL_FIELDS})
            out.update({f"task.{n}": "task.init_from: the pretrained run's tokenizer is used"
                        for n in ("tokenizer", "vocab_size", "lowercase")})
        per_task: dict[str, list[str]] = {}
        for task, settings in cfg.task.per_task.items():
            for key in settings:
                per_task.setdefault(str(key), []).append(task)
        for key, tasks in per_task.items():
            out[key] = (f"task.per_task sets it for {', '.join(tasks)}, so the suite's value does not reach "
                        f"{'that task' if len(tasks) == 1 else 'those tasks'}; vary it there or drop the per-task "
                        "setting")
        return out

    def reads_train_seed(self, cfg: ExperimentConfig) -> bool:
        return not cfg.task.finetune_seeds

    # -- hooks -----------------------------------------------------------------------------------------------
    def resolve(self, cfg: ExperimentConfig, pretrained: ExperimentConfig | None = None) -> ExperimentConfig:
        """With task.init_from, the model section becomes the pretrained architecture (NSP head dropped), keeping
        this config's dropout; the combination is validated again (e.g. seq_len against learned positions). From
        scratch, the model section as written, without a next-sentence head (fine-tuning never trains one)."""
        if not cfg.task.init_from:
            return cfg.replace(model=cfg.model.replace(nsp=False)) if cfg.model.nsp else cfg
        if pretrained is None:
            if stage_ref(cfg.task.init_from) is not None:
                raise ValueError(f"task.init_from: {cfg.task.init_from!r} names a pipeline stage; run the pipeline")
            from study.tasks.glue.pretrained import pretrained_config

            pretrained = pretrained_config(cfg.task.init_from)
        else:
            from study.tasks.glue.pretrained import check_pretrained

            check_pretrained(pretrained, str(cfg.task.init_from))
        model = pretrained.model.replace(nsp=False, dropout=cfg.model.dropout,
                                         attention_dropout=cfg.model.attention_dropout)
        resolved = cfg.replace(model=model)
        _check_lengths(resolved, pretrained)
        return resolved

    def sub_runs(self, cfg: ExperimentConfig, data_dir: str | Path | None) -> list[SubRun]:
        """One run per (task, fine-tuning seed): the task's per-task settings applied, its steps capped at
        task.epochs passes over its training set, warm-up at most a tenth of them. An unavailable task is a skipped
        part; when every task asked for is unavailable, DatasetUnavailable (a suite that runs nothing is no result)."""
        tasks = suite_tasks(cfg)
        seeds = list(cfg.task.finetune_seeds or (cfg.train.seed,))
        parts: list[SubRun] = []
        missing: list[DatasetUnavailable] = []
        for name in tasks:
            try:
                data = load_glue(name, data_dir)
            except DatasetUnavailable as err:
                missing.append(err)
                parts.append(SubRun(name, None, skip_reason=str(err)))
                continue
            task_cfg = cfg.for_glue_task(name)
            t = task_cfg.train
            steps = t.max_steps
            if task_cfg.task.epochs is not None:  # an optimizer step takes batch_size examples on each device
                n_train = len(data[data.train_split])
                per_step = t.batch_size * t.accumulate * t.devices
                steps = max(1, min(steps, math.ceil(task_cfg.task.epochs * n_train / per_step)))
            for seed in seeds:
                parts.append(SubRun(f"{name}/seed{seed}", task_cfg.replace(
                    name=f"{cfg.name}.{name}.seed{seed}",
                    task=task_cfg.task.replace(dataset=glue_task_key(name), glue_tasks=(), finetune_seeds=(seed,)),
                    train=t.replace(seed=seed, max_steps=steps, warmup_steps=min(t.warmup_steps, steps // 10)))))
        if len(missing) == len(tasks):
            raise missing[0] if len(missing) == 1 else _none_available(missing)
        return parts

    def combine(self, cfg: ExperimentConfig, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The suite's metrics: per task the mean over seeds of each dev metric with its sample sd (null for one
        seed), the task score, and the GLUE score over the tasks that ran. A task with a diverged seed has no
        aggregate, and then the suite has no GLUE score: over the tasks (or seeds) that happened not to diverge it
        would score an easier benchmark than the one asked for (a tuner would rank it as a result)."""
        tasks, unavailable = _by_task(results)
        summary: dict[str, Any] = {}
        scores = {k: v["score_mean"] for k, v in tasks.items() if v.get("score_mean") is not None}
        unscored = sorted(set(tasks) - set(scores))
        summary["glue_score"] = _glue_score(scores) if not unscored else None
        summary["glue_score_tasks"] = sorted(scores)
        summary["unscored_tasks"] = unscored
        summary["glue_score_complete"] = len(scores) == len(GLUE_TASK_NAMES)
        summary["seeds"] = list(cfg.task.finetune_seeds or (cfg.train.seed,))
        for name, r in tasks.items():
            for k, v in r.get("mean", {}).items():
                summary[f"{name}/{k}"] = v
                summary[f"{name}/{k}_std"] = r["std"][k]
            if r.get("score_mean") is not None:
                summary[f"{name}/score"], summary[f"{name}/score_std"] = r["score_mean"], r["score_std"]
        summary["unavailable_tasks"] = sorted(unavailable)
        return summary

    def suite_details(self, cfg: ExperimentConfig, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        tasks, unavailable = _by_task(results)
        return {"parts": tasks, "unavailable": unavailable}

    def save_suite_outputs(self, cfg: ExperimentConfig, run_dir: Path, results: dict[str, dict[str, Any]]) -> None:
        """submission/: each task's test predictions from its seed with the best dev score, and nothing else (the
        folder is emptied first: a task with no best seed this time, all its seeds diverged, would otherwise leave
        an earlier run's predictions beside this run's record)."""
        tasks, _ = _by_task(results)
        shutil.rmtree(Path(run_dir) / "submission", ignore_errors=True)
        for name, r in tasks.items():
            best = r.get("best_seed")
            src = Path(run_dir) / name / f"seed{best}" / "predictions"
            for f in sorted(src.glob("*.tsv")) if best is not None and src.is_dir() else []:
                (Path(run_dir) / "submission").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, Path(run_dir) / "submission" / f.name)

    def record_extras(self, cfg: ExperimentConfig) -> dict[str, Any]:
        """`init`: where the encoder came from, so a comparison can say what it compares (Devlin et al.'s BERT is
        pretrained with NSP; a randomly initialised encoder is another model)."""
        if not cfg.task.init_from:
            return {"init": {"weights": "random", "from": None}}
        from study.tasks.glue.pretrained import pretrained_config

        pre = pretrained_config(cfg.task.init_from)
        return {"init": {"weights": "pretrained" if cfg.task.pretrained_weights else "random",
                         "from": str(cfg.task.init_from), "pretrain_task": pre.task.name,
                         "pretrain_objective": "mlm+nsp" if pre.model.nsp else "mlm",
                         "pretrain_seed": pre.train.seed}}


def _check_lengths(resolved: ExperimentConfig, pretrained: ExperimentConfig) -> None:
    """Every task's sequences (its per-task seq_len included) fit the pretrained positions; and where the scheme
    learns a row per position, no task is longer than pretraining's sequences: the rows past them were never
    trained (BERT pretrained its last 10% of steps at 512 tokens for this reason; Devlin et al. 2019, A.2)."""
    from study.axes import POSITIONS

    problems: list[str] = []
    trained = pretrained.task.seq_len
    for name in suite_tasks(resolved):
        task_cfg = resolved.for_glue_task(name)
        where = f"task.per_task.{glue_task_key(name)}: " if "task.seq_len" in resolved.task.per_task.get(
            glue_task_key(name), {}) else ""
        try:
            task_cfg.check_resolved_model()
        except ConfigError as err:
            problems += [f"{where}{p}" for p in err.problems]
            continue
        if POSITIONS[task_cfg.model.position].learns_each_position and task_cfg.task.seq_len > trained:
            problems.append(
                f"{where}task.seq_len: {task_cfg.task.seq_len} is longer than the {trained}-token sequences the "
                f"pretrained run trained its {task_cfg.model.position} positions on: rows {trained} to "
                f"{task_cfg.task.seq_len - 1} of the table would be fine-tuned from their random start (fine-tune at "
                f"task.seq_len <= {trained}, or pretrain at task.seq_len >= {task_cfg.task.seq_len})")
    if problems := list(dict.fromkeys(problems)):
        raise ConfigError(type(resolved).__name__, problems)


def _none_available(missing: list[DatasetUnavailable]) -> DatasetUnavailable:
    """One error for a suite none of whose tasks is available, naming each and the files each needs."""
    return DatasetUnavailable(
        ", ".join(e.dataset for e in missing), hub_id=None,  # (each is named `GLUE <task>`)
        expected_files=[f for e in missing for f in e.expected_files],
        reasons=[f"{e.dataset}: {r}" for e in missing for r in e.reasons],
        hint="None of the tasks asked for (task.glue_tasks) is available, so the suite would run nothing.")


def suite_tasks(cfg: ExperimentConfig) -> list[str]:
    names = (cfg.task.glue_tasks or GLUE_TASK_NAMES) if cfg.task.dataset == "glue" else (cfg.task.dataset,)
    return list(dict.fromkeys(glue_task_info(t).name for t in names))


def _glue_score(scores: dict[str, float]) -> float | None:
    from study.tasks.glue.metrics import glue_score

    return glue_score(scores) if scores else None


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample sd; one value has no spread (None), never a standard deviation of 0."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _by_task(results: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The suite's parts grouped by task and aggregated over seeds; the unavailable tasks with why."""
    seeds: dict[str, dict[str, Any]] = {}
    unavailable: dict[str, str] = {}
    for path, r in results.items():
        task, _, seed = path.partition("/")
        if "skipped" in r:
            unavailable[task] = r["skipped"]
            continue
        seeds.setdefault(task, {})[seed.removeprefix("seed")] = {"status": r["status"], "steps": r["steps"],
                                                                  **r["metrics"]}
    return {name: _aggregate(name, runs) for name, runs in seeds.items()}, unavailable


def _aggregate(name: str, seed_runs: dict[str, Any]) -> dict[str, Any]:
    """Mean and sample standard deviation over the seeds of every metric and of the task score; none when a seed
    did not finish or has no score (a mean over the seeds that survived would be biased towards them). `best_seed`,
    whose test predictions go to submission/, is the best of the seeds that finished with a score."""
    info = glue_task_info(name)
    done = {s: r for s, r in seed_runs.items() if r["status"] == "completed" and "score" in r}
    out: dict[str, Any] = {"seeds": seed_runs, "metrics": list(info.metrics)}
    scored = {s: r for s, r in done.items() if math.isfinite(r["score"])}  # (STS-B's Pearson of a constant: NaN)
    if scored:
        out["best_seed"] = max(scored, key=lambda s: scored[s]["score"])
    if not scored or len(scored) < len(seed_runs):
        return {**out, "score_mean": None}
    keys = [k for k, v in next(iter(done.values())).items() if isinstance(v, float) and k != "score"]
    out["mean"], out["std"] = {}, {}
    for k in keys:
        out["mean"][k], out["std"][k] = _mean_std([r[k] for r in done.values()])
    out["score_mean"], out["score_std"] = _mean_std([r["score"] for r in done.values()])
    return out
