"""The task contract: what a task family declares, so that sweeps, the run layer and reports never guess.

A task family (language modelling, translation, pretraining, GLUE) is one `TaskFamily` subclass. It declares

- the metrics it writes (`MetricSpec`: name, direction, scale, what a constant predictor scores, whether it may rank
  a sweep, the data split it is measured on), and its default objective; the sweep refuses an objective the family
  does not declare (and a tuning that would choose by a test-set metric), and reports read directions and scales
  from the declarations written into every record, never from a metric's name;
- the training curves it logs that are comparable across its variants (`curves`);
- which config fields it reads, and which asked values it overrides (`unread_fields`, `overridden_fields`), so a
  sweep axis that would not reach the trained model is refused before training;
- its implementation (a LightningDataModule and a LightningModule, imported on use);
- optional hooks for the run layer: `resolve` (the config that will run, e.g. GLUE's model from a pretrained run),
  and, for an experiment made of several runs, `sub_runs` and `combine` (the GLUE suite: tasks x seeds).

A task family never imports the run layer: the run layer calls these hooks. A class that leaves out a required
declaration fails when it is defined, not after a trial has trained.
"""

from __future__ import annotations

import abc
import dataclasses
import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from study.record import DIRECTIONS

if TYPE_CHECKING:
    from study.config import ExperimentConfig

SPLITS = ("valid", "test")
# `MetricSpec.split` of a pattern whose keys say their split in their first word (`valid_ppl_at_2x`, `test_ppl_at_2x`)
SPLIT_FROM_NAME = "from name"


@dataclass(frozen=True)
class MetricSpec:
    """One metric a task family writes into metrics.json's `metrics`.

    `name` may hold a `*` for a family of keys (`valid_ppl_by_length.*`). `objective=False` marks counts and
    bookkeeping (tokens evaluated, examples) that must never rank a sweep. `cost=True` marks a cost the task
    measures (decode time, the KV cache held): reports set it beside the quality metrics. `split` is the data the
    metric is measured on: 'valid' (which a sweep may tune on), 'test' (which must never choose what it then
    scores), None for neither or not one split (costs, training-data counts), or SPLIT_FROM_NAME where the key's
    first word says it (`split_of`). `defined_by` are the config fields (`section.field`) that decide what the
    metric measures: a loss per token is per token of the tokenizer task.tokenizer and task.vocab_size make, BLEU
    with task.lowercase scores an easier task. Values measured under different settings of them are different
    metrics under one name, and cannot rank one sweep. An entry `metric.NAME` is a metric the task writes beside it
    that records what the run decided it measures (the GLUE score's tasks: those whose data the run could read):
    only the results can say whether two cells measured the same thing."""

    name: str
    direction: str
    scale: str  # unit and range, e.g. 'nats/token', 'perplexity', '0-100', 'BLEU (0-100)', 'count'
    constant: str  # what a constant predictor scores, e.g. '0 (MCC of a constant prediction)'
    objective: bool = True
    description: str = ""
    cost: bool = False
    split: str | None = None
    defined_by: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"metric {self.name!r}: direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.split not in (*SPLITS, SPLIT_FROM_NAME, None):
            raise ValueError(f"metric {self.name!r}: split must be one of {SPLITS}, {SPLIT_FROM_NAME!r} or None, "
                             f"got {self.split!r}")

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.name)

    def split_of(self, name: str) -> str | None:
        """The split metric `name` (one this spec matches) is measured on: 'valid', 'test' or None."""
        if self.split != SPLIT_FROM_NAME:
            return self.split
        head = name.split("_", 1)[0]
        return head if head in SPLITS else None

    def on_split(self, split: str) -> str | None:
        """This spec's name as measured on `split` (a SPLIT_FROM_NAME pattern's `*` prefix replaced by it), or None
        when it is measured on another split."""
        if self.split == SPLIT_FROM_NAME and self.name.startswith("*_"):
            return split + self.name[1:]
        return self.name if self.split_of(self.name) == split else None

    def to_dict(self) -> dict[str, Any]:
        """The declaration as records hold it (no `defined_by` where it is empty, as in records from before it)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "name"}
        if not self.defined_by:
            del out["defined_by"]
        else:
            out["defined_by"] = list(self.defined_by)
        return out


@dataclass(frozen=True)
class SubRun:
    """One run of an experiment made of several (a GLUE suite: one task, one seed), in `<run_dir>/<path>`; a part
    that cannot run (its data is not available) has no config and says why."""

    path: str
    config: "ExperimentConfig | None"
    skip_reason: str | None = None


class TaskFamily(abc.ABC):
    """A task family's declarations and hooks (see the module docstring). Instances are stateless."""

    name: ClassVar[str]
    metrics: ClassVar[tuple[MetricSpec, ...]]
    default_objective: ClassVar[str]
    # training curves comparable across variants: {'train': column, 'valid': column} of logs/metrics.csv
    curves: ClassVar[dict[str, str]] = {"train": "train/loss", "valid": "val/loss"}
    # the TaskConfig fields this family reads; any other task.* field is never read, and refused as an axis
    reads_task_fields: ClassVar[frozenset[str]]
    # TrainConfig fields the family does not read (most read them all: the training loop is shared)
    unread_train_fields: ClassVar[frozenset[str]] = frozenset()
    # ModelConfig fields the data decides (vocabulary size, padding id): an asked value never reaches the model
    data_decided_model_fields: ClassVar[tuple[str, ...]] = ("vocab_size", "pad_token_id")
    # an experiment of this family is several runs (`sub_runs` / `combine`), not one; `part_metrics`: what each
    # part's own record holds
    suite: ClassVar[bool] = False
    part_metrics: ClassVar[tuple[MetricSpec, ...]] = ()
    # a suite that sets training fields per part from its data (`sub_runs`): which, and how (a sentence)
    part_settings: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:  # an intermediate base class, not a family
            return
        missing = [a for a in ("metrics", "default_objective", "reads_task_fields") if not hasattr(cls, a)]
        if cls.implementation is TaskFamily.implementation:
            missing.append("implementation()")
        if missing:
            raise TypeError(f"task family {cls.__name__} does not declare {missing}")
        spec = cls.metric(cls.default_objective)
        if spec is None or not spec.objective:
            raise TypeError(f"task family {cls.name!r}: default_objective {cls.default_objective!r} is not one of its "
                            "declared objective metrics")

    # -- declarations --------------------------------------------------------------------------------------
    @classmethod
    def metric(cls, name: str) -> MetricSpec | None:
        """The declaration of metric `name` (exact names first, then patterns), or None."""
        exact = [m for m in cls.metrics if m.name == name]
        return exact[0] if exact else next((m for m in cls.metrics if m.matches(name)), None)

    @classmethod
    def objectives_on(cls, split: str) -> list[str]:
        """The objective metrics this family declares on `split` (a pattern keyed by split: its key for it)."""
        names = (m.on_split(split) for m in cls.metrics if m.objective)
        return [n for n in names if n is not None]

    @classmethod
    def declared(cls, part: bool = False) -> dict[str, dict[str, Any]]:
        """The declarations as written into metrics.json and plan.json (`part`: a suite part's record)."""
        return {m.name: m.to_dict() for m in (cls.part_metrics if part else cls.metrics)}

    @classmethod
    def objective_problem(cls, metric: str, direction: str | None = None) -> str | None:
        """None when `metric` may rank a sweep of this family (and `direction`, if given, is its declared one);
        else what is wrong and what would be valid."""
        spec = cls.metric(metric)
        valid = [m.name for m in cls.metrics if m.objective]
        if spec is None:
            return f"{metric!r} is not a metric task {cls.name!r} writes; its objectives: {valid}"
        if not spec.objective:
            return f"{metric!r} ({spec.scale}) is bookkeeping, not a quality measure; objectives: {valid}"
        if direction is not None and direction != spec.direction:
            return f"{metric!r} is declared {spec.direction} ({spec.scale}), not {direction}"
        return None

    def unwritten_metric(self, cfg: "ExperimentConfig", metric: str) -> str | None:
        """Why this family, running `cfg`, will not write declared metric `metric` (e.g. a test metric of a corpus
        without a test split), or None."""
        return None

    # -- what reaches the model --------------------------------------------------------------------------------
    def unread_fields(self, cfg: "ExperimentConfig") -> dict[str, str]:
        """`section.field` -> why, for every field whose value this family never reads in `cfg`."""
        from study.config.task import TaskConfig
        from study.config.train import TrainConfig

        out = {f"task.{f.name}": f"task {self.name!r} does not read it"
               for f in dataclasses.fields(TaskConfig) if f.name not in self.reads_task_fields | {"name", "dataset"}}
        out.update({f"train.{n}": f"task {self.name!r} does not read it" for n in self.unread_train_fields
                    if n in {f.name for f in dataclasses.fields(TrainConfig)}})
        out.update({f"model.{n}": "the data decides it (set task.vocab_size for the tokenizer's size)"
                    for n in self.data_decided_model_fields})
        return out

    def unread_settings(self, cfg: "ExperimentConfig") -> list[str]:
        """One problem per task or training field `cfg` sets away from its default that this family never reads
        there (`unread_fields`): the run's config.yaml would record a setting that never ran (label smoothing on a
        pretraining run, a beam size on language modelling)."""
        from study.config.task import TaskConfig
        from study.config.train import TrainConfig

        defaults = {f"{section}.{f.name}": f.default_factory() if f.default is dataclasses.MISSING else f.default
                    for section, kind in (("task", TaskConfig), ("train", TrainConfig))
                    for f in dataclasses.fields(kind)}
        problems = []
        for path, why in self.unread_fields(cfg).items():
            section, _, name = path.partition(".")
            if path in defaults and getattr(getattr(cfg, section), name) != defaults[path]:
                problems.append(f"{path}: {why}, so {getattr(getattr(cfg, section), name)!r} would never run; leave "
                                f"it out (its default: {defaults[path]!r})")
        return problems

    def overridden_fields(self, cfg: "ExperimentConfig") -> dict[str, str]:
        """`section.field` -> why, for fields `cfg` sets but that do not reach the trained model (beyond
        `unread_fields`), e.g. the model fields a pretrained run decides."""
        return {}

    # -- hooks ------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def implementation(self) -> tuple[type, type]:
        """(LightningDataModule class, LightningModule class); imported here, so declarations stay cheap."""

    def predicted_fraction(self, cfg: "ExperimentConfig") -> float:
        """Share of positions whose output head (vocabulary projection) runs in training (FLOPs accounting)."""
        return 1.0

    def resolve(self, cfg: "ExperimentConfig", pretrained: "ExperimentConfig | None" = None) -> "ExperimentConfig":
        """The config that will run, known before any data is read (`pretrained`: the config of the run
        task.init_from names, when the caller has it; else the family reads it from disk if it needs it)."""
        return cfg

    def check_data(self, cfg: "ExperimentConfig", data_dir: str | Path | None) -> None:
        """Read the data `cfg`'s run reads, as it reads it: a DataError (DatasetUnavailable: the files expected and
        where) where the run would stop for it. `study sweep` calls it once per dataset before any trial starts,
        so that a --data-dir without the dataset is one error, not every trial failing three times. Every family
        that reads data overrides it (tests/test_review_left.py checks the registered ones)."""

    def metric_without_data(self, cfg: "ExperimentConfig", metric: str, data_dir: str | Path | None) -> str | None:
        """Why a run of `cfg` on the data under `data_dir` would write no `metric` though it runs (a suite that skips
        a task it cannot read, whose metric that is), or None. `study sweep` asks it of its objective before any
        trial starts: every trial would train and then fail for the missing objective."""
        return None

    def sub_runs(self, cfg: "ExperimentConfig", data_dir: str | Path | None) -> list[SubRun] | None:
        """None for a single run; else the runs that make up the experiment, each in its own run directory."""
        return None

    def combine(self, cfg: "ExperimentConfig", results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The experiment's `metrics` from its sub-runs' records ({sub-run path: metrics.json record})."""
        raise NotImplementedError(f"task {self.name!r} runs as one run; it has no sub-runs to combine")

    def suite_details(self, cfg: "ExperimentConfig", results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Top-level entries of the experiment's metrics.json beside `metrics` (GLUE: every seed's numbers)."""
        return {}

    def save_suite_outputs(self, cfg: "ExperimentConfig", run_dir: Path, results: dict[str, dict[str, Any]]) -> None:
        """Files an experiment of several runs writes at its top (GLUE: the submission folder)."""

    def record_extras(self, cfg: "ExperimentConfig") -> dict[str, Any]:
        """Top-level entries of the experiment's metrics.json beside the schema's (GLUE: where its encoder came
        from, which `study compare` needs to say what it compares)."""
        return {}

    def reads_train_seed(self, cfg: "ExperimentConfig") -> bool:
        """Whether train.seed reaches the runs (GLUE with task.finetune_seeds uses those seeds instead): a sweep's
        seeds set it, so a family that ignores it would run every seed the same."""
        return True
