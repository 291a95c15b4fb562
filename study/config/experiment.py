"""`ExperimentConfig`: model + task + training, the unit `study run` executes.

YAML form (the model may start from a preset and override fields):

    name: shakespeare-gpt2
    model: {preset: gpt2, d_model: 128, n_layers: 4, n_heads: 4}
    task: {name: lm, dataset: tinyshakespeare, seq_len: 64}
    train: {max_steps: 2000, batch_size: 12, lr: 1.0e-3}

`--set model.window=16` style overrides address any field by section.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from study.config.base import Config, ConfigError, Problems, parse_overrides
from study.config.model import ModelConfig
from study.config.presets import PRESETS
from study.config.task import TaskConfig, glue_task_key
from study.config.train import TrainConfig

SECTIONS = ("model", "task", "train")


def _model_from(data: dict[str, Any] | ModelConfig) -> ModelConfig:
    if isinstance(data, ModelConfig):
        return data
    data = dict(data or {})
    name = data.pop("preset", None)
    if name is not None:
        if not isinstance(name, str) or name not in PRESETS:
            raise ConfigError("ModelConfig", [f"preset: unknown preset {name!r}; valid presets: {sorted(PRESETS)}"])
        data = {**PRESETS[name], **data}
    return ModelConfig.from_dict(data)


@dataclass(frozen=True)
class ExperimentConfig(Config):
    name: str = "experiment"
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def _validate(self, p: Problems) -> None:
        p.check(bool(re.fullmatch(r"(?!\.+$)[A-Za-z0-9_.=+-]+", self.name)), "name",
                f"{self.name!r}: use letters, digits and _ . = + - only, not dots alone (it names a directory)")
        m, t = self.model, self.task
        p.check(m.arch == t.arch, "model.arch", f"task {t.name!r} trains arch={t.arch!r}, got arch={m.arch!r}")
        if t.name == "pretrain" or t.name == "glue":
            p.check(m.objective == "mlm", "model.objective", f"task {t.name!r} needs objective='mlm'")
        if t.name == "pretrain":  # [CLS] A [SEP] (B [SEP]) around at least two tokens of text (study.tasks.pretrain)
            shortest = 5 if m.nsp else 4
            p.check(t.seq_len >= shortest, "task.seq_len", f"pretraining{' with nsp' if m.nsp else ''} needs >= "
                    f"{shortest} ([CLS]/[SEP] around at least two tokens of text), got {t.seq_len}")
        if t.nsp_weight != 1.0:
            p.check(m.nsp, "task.nsp_weight", f"weights the NSP loss, which model.nsp=false leaves out (got {t.nsp_weight})")
        if t.name == "translation" and not t.joint_vocab:
            p.check(not m.tie_embeddings, "model.tie_embeddings",
                    "separate source/target vocabularies (task.joint_vocab=false) cannot share one embedding matrix; "
                    "set model.tie_embeddings=false or task.joint_vocab=true")
        for task in t.per_task:
            try:
                self.for_glue_task(task)
            except ConfigError as err:
                p.add(f"task.per_task.{task}", "; ".join(err.problems))
        if not t.init_from:  # else the model section is the pretrained run's, validated with it when resolved
            self._validate_positions(p)

    def check_resolved_model(self) -> None:
        """Raise ConfigError where the task's sequences do not fit the model that will run: a config with
        task.init_from is checked here once its model section is the pretrained run's (the one it was written with
        is a placeholder, not checked when it is built)."""
        problems = Problems()
        self._validate_positions(problems)
        if problems.items:
            raise ConfigError(type(self).__name__, problems.items)

    def _validate_positions(self, p: Problems) -> None:
        """The task's sequences fit what the position scheme can address (a learned table: model.max_seq_len)."""
        from study.axes import POSITIONS

        m, t = self.model, self.task
        limit = POSITIONS[m.position].max_positions(m)
        if limit is not None:
            longest = t.seq_len + (1 if t.name == "translation" else 0)  # the decoder's input: BOS + the sentence
            plus = " (+ BOS)" if t.name == "translation" else ""
            p.check(longest <= limit, "task.seq_len",
                    f"{t.seq_len}{plus} exceeds model.max_seq_len={m.max_seq_len}, the length "
                    f"{m.position} positions can address; raise model.max_seq_len or shorten task.seq_len")
        self._validate_window(p)

    def _validate_window(self, p: Problems) -> None:
        """A sliding window must be shorter than the longest sequence the task trains or evaluates on: a window that
        spans every sequence masks nothing, so its run would be global attention reported as local (a preset's
        4,096-token window at seq_len 128, or a swept window that never bites)."""
        m, t = self.model, self.task
        if m.window is None:
            return
        longest = t.seq_len + (1 if t.name == "translation" else 0)  # the decoder's input: BOS + the sentence
        if t.name == "lm":  # language modelling also evaluates at multiples of seq_len (task.eval_lengths)
            longest = t.seq_len * max(t.eval_lengths, default=1)
        p.check(m.window < longest, "model.window",
                f"{m.window} spans every sequence this task runs (at most {longest} tokens), so it masks nothing and "
                f"every layer attends globally; choose a window below {longest}, or model.window: null")

    def with_seed(self, seed: int) -> "ExperimentConfig":
        return self.replace(train=self.train.replace(seed=seed))

    def for_glue_task(self, task: str) -> "ExperimentConfig":
        """This GLUE suite's settings for one of its tasks: the task's `task.per_task` entry applied over the rest
        (an empty `per_task` in the result; the suite's config keeps the whole mapping)."""
        settings = self.task.per_task.get(glue_task_key(task), {})
        data = set_fields(self.to_dict(), settings)
        data["task"]["per_task"] = {}
        return ExperimentConfig.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ExperimentConfig":
        if data is not None and not isinstance(data, dict):
            raise ConfigError(cls.__name__, [f"an experiment is a mapping with sections model, task and train, not a "
                                             f"{type(data).__name__}"])
        data = dict(data or {})
        unknown = sorted(set(data) - {"name", *SECTIONS})
        if unknown:
            spec = {"base", "set", "init_from", "axes"} & set(unknown)  # a sweep spec's stage keys, in an experiment
            hint = (f" ({', '.join(sorted(spec))}: keys of a sweep spec's stages; a pipeline YAML for `study run` "
                    "writes each stage out in full, as experiments/pretrain_then_glue.yaml)") if spec else ""
            raise ConfigError(cls.__name__, [f"{k}: unknown section; valid: ['name', 'model', 'task', 'train']{hint}"
                                             for k in unknown])
        # build every section before failing, so one error lists the problems of all three
        sections: dict[str, Any] = {}
        problems: list[str] = []
        builders = {"model": _model_from, "task": TaskConfig.from_dict, "train": TrainConfig.from_dict}
        for section, build in builders.items():
            value = data.get(section)
            if isinstance(value, (ModelConfig, TaskConfig, TrainConfig)):
                sections[section] = value
                continue
            if value is not None and not isinstance(value, dict):
                problems.append(f"{section}: must be a mapping of fields, got {type(value).__name__} {value!r}")
                continue
            try:
                sections[section] = build(value or {})
            except ConfigError as err:
                problems += [f"{section}.{p}" for p in err.problems]
        if problems:
            raise ConfigError(cls.__name__, problems)
        return cls(name=data.get("name", "experiment"), **sections)

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> "ExperimentConfig":
        """An experiment YAML with `--set` overrides applied (a pipeline YAML is refused: `load_experiment`
        reads either)."""
        from study.config.pipeline import load_experiment

        cfg = load_experiment(path, overrides)
        if not isinstance(cfg, cls):
            raise ConfigError(cls.__name__, [f"{path}: a pipeline of stages, not one experiment"])
        return cfg


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply `section.field=value` overrides (`name=...` for the top level)."""
    return set_fields(data, parse_overrides(overrides))


def set_fields(data: dict[str, Any], assignments: dict[str, Any]) -> dict[str, Any]:
    """A copy of the experiment mapping `data` with `{"section.field": value}` assignments applied."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in assignments.items():
        if key == "name":
            data["name"] = value
            continue
        section, _, fname = key.partition(".")
        if section not in SECTIONS or not fname:
            raise ConfigError("ExperimentConfig", [f"{key}: overrides look like model.FIELD, task.FIELD or train.FIELD"])
        if key == "model.preset":
            _refuse_shadowed_preset(value, data.get("model") or {}, assignments)
        data.setdefault(section, {})[fname] = value
    return data


# the model's size and regularisation: a section that states them next to a preset scales the preset (a 2-layer
# Llama-2), as it is meant to; its other fields are the design the preset names
SCALING_FIELDS = frozenset({"vocab_size", "d_model", "n_layers", "n_encoder_layers", "n_heads", "n_kv_heads",
                            "head_dim", "d_ff", "max_seq_len", "dropout", "attention_dropout"})


def _refuse_shadowed_preset(name: Any, model: dict[str, Any], assignments: dict[str, Any]) -> None:
    """A preset set as an override gives way to every field the model section states (a run's config.yaml states
    them all): where its design fields (norm, position, activation, ...) differ from the preset's, it would not be
    the preset that ran, so it is refused. Sizes the section states scale the preset (SCALING_FIELDS)."""
    if not isinstance(name, str):  # (an unknown preset is named when the section is built)
        return
    shadowed = sorted(f for f, v in PRESETS.get(name, {}).items() if f in model and model[f] != v
                      and f not in SCALING_FIELDS and f"model.{f}" not in assignments)
    if shadowed:
        raise ConfigError("ExperimentConfig", [
            f"model.preset: {name!r} set as an override gives way to the model section's own "
            f"{', '.join(shadowed)}, which differ from the preset's; set those fields too, or write the preset into "
            "the config in place of them"])

