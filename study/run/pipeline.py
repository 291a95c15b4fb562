"""A pipeline: stages run in order, each later stage starting from an earlier stage's run directory.

    <run_dir>/config.yaml     the pipeline (each stage's config; `task.init_from: stage:<name>` where a stage starts
                              from another)
    <run_dir>/data.json       each stage's data.json under its name (what every stage read)
    <run_dir>/metrics.json    the last stage's metrics, with each earlier stage's under its name
                              (`pretrain.valid_mlm_loss`), and `stages`: where each stage ran; its cost: every
                              stage's time summed (`fit_seconds`, as `steps`), the last stage's model (`parameters`),
                              and each stage's own cost under its name (`cost.pretrain.fit_seconds`)
    <run_dir>/<last stage>/   the last stage's run directory (a GLUE suite: one run per task and seed)
    <stage_root>/<hash>/seed-<k>/   every earlier stage's run directory, content-hashed like a sweep point

An earlier stage is trained once: pipelines that differ only in later stages (fine-tuning settings) find it
finished and reuse it, and in a sweep it is the very directory a plain sweep of that stage's config would use. A
kill loses nothing: a finished stage is not run again, and an unfinished one resumes from its checkpoint. Two
workers that reach the same shared stage at once take turns (a file lock), the second finding it finished. A shared
stage forced anew (`--force` on another pipeline that shares it) holds another model: a later stage fine-tuned from
the old one, and a finished pipeline's record of it, are run again from the new one, not handed back.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from study.config import ConfigError, ExperimentConfig, PipelineConfig, content_hash
from study.config.pipeline import stage_ref
from study.io import atomic_write_json, atomic_write_text, exclusive_lock, read_json_or_none
from study.model.precision import resolve_precision
from study.record import COMPLETED, RunDir, extras, make_record, stage_run_dirs, stopped_by_any
from study.run.conflict import finished_run, handed_back

log = logging.getLogger(__name__)


def resolved_precision(cfg: PipelineConfig) -> PipelineConfig:
    stages = {k: s.replace(train=s.train.replace(precision=resolve_precision(s.train.precision, s.train.accelerator)))
              for k, s in cfg.stages.items()}
    return PipelineConfig(name=cfg.name, stages=stages)


def stage_dir(cfg: PipelineConfig, name: str, run_dir: Path, stage_root: Path) -> Path:
    """Where stage `name` runs: the last stage inside the pipeline's run directory, earlier (shared) stages under
    `stage_root` by content hash and seed."""
    stage = cfg.stages[name]
    if name == list(cfg.stages)[-1]:
        return run_dir / name
    digest = content_hash(stage)
    ref = stage_ref(stage.task.init_from)
    if ref is not None:  # a middle stage is also what it starts from: its config names that only as `stage:NAME`
        upstream = stage_dir(cfg, ref, run_dir, stage_root)
        digest = hashlib.sha256(f"{digest} from {upstream.parent.name}/{upstream.name}".encode()).hexdigest()[:12]
    return stage_root / digest / f"seed-{stage.train.seed}"


@contextlib.contextmanager
def run_dir_lock(directory: str | Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive lock on a run directory while one process runs it: two sweeps that share a point, or two
    pipelines that share a stage, take turns, and the second finds the run finished. The lock file sits beside the
    directory, so a shared stage and a sweep trial of that stage's config take the same lock. flock: the kernel
    releases it when its holder dies, so a killed worker never leaves it held. Only rank zero locks: the other
    ranks of a DDP run are started by rank zero while it holds the lock, and waiting for it would deadlock them.
    `on_wait`: called when another process holds it (default: a warning, then wait; raise in it to refuse)."""
    from study.run.single import launch_rank

    if launch_rank() != 0:
        yield
        return
    directory = Path(directory).resolve()  # one lock file however the directory is spelled (a symlink, say)

    def waiting() -> None:  # say why this trial does nothing for a while (its log is read to find out)
        log.warning("%s is being run by another process; waiting for it to finish", directory)

    with exclusive_lock(directory.parent / f".{directory.name}.lock", on_wait=on_wait or waiting):
        yield


def _precisions(cfg: PipelineConfig) -> str:
    """The precision the stages train in, for the pipeline's env.json: one value where they share it, else each
    stage's (`pretrain: bf16-mixed, glue: 32-true`; the first stage's alone said the whole pipeline trained in it).
    Each stage's env.json has its own."""
    by_stage = {name: str(stage.train.precision) for name, stage in cfg.stages.items()}
    values = set(by_stage.values())
    return values.pop() if len(values) == 1 else ", ".join(f"{name}: {p}" for name, p in by_stage.items())


def run_pipeline(cfg: PipelineConfig, run_dir: str | Path, data_dir: str | Path | None = None,
                 cache_dir: str | Path | None = None, force: bool = False,
                 stage_root: str | Path | None = None) -> dict[str, Any]:
    """Run every stage of `cfg` in order (see the module docstring); returns the pipeline's record.

    `stage_root`: where shared stages live (a sweep passes its results/runs); default `<run_dir>/stages`."""
    from study.run import run_experiment
    from study.run.environment import prepare_training_process, snapshot
    from study.run.single import discard_result, launch_rank

    run = RunDir(run_dir)
    cfg = resolved_precision(cfg)
    if (done := finished_run(run, cfg, force)) is not None:
        if (replaced := replaced_stage(cfg, run, done)) is None:
            return handed_back(run, done)
        log.warning("%s; the pipeline runs again from its stages as they are now", replaced)
    refuse_unrunnable_stages(cfg)
    refuse_missing_data(cfg, data_dir)
    started = time.time()
    # resolved: a later stage's task.init_from (its config.yaml) names the run it starts from unambiguously, however
    # the results folder was spelled (relative, another cwd, a symlink); a resumed stage finds the same value there
    stage_root = (Path(stage_root) if stage_root is not None else run.path / "stages").resolve()
    prepare_training_process(cfg.first.train.accelerator)  # as its stages will: env.json records what they train with
    writes = launch_rank() == 0  # under DDP every rank runs the stages (each stage's ranks wait for its record)
    if force or done is not None:  # after the stage and data checks: a bad input never costs the old record (see
        discard_result(run)         # discard_result); a finished record here is one replaced_stage found stale
    if writes:
        atomic_write_text(run.config, cfg.to_yaml())
        run.write_env(snapshot(_precisions(cfg), cfg.first.train.accelerator),
                      continues=not (force or done is not None))
    ran: dict[str, tuple[Path, dict[str, Any]]] = {}
    for name, stage in cfg.stages.items():
        ref = stage_ref(stage.task.init_from)
        if ref is not None:  # start from the earlier stage's run directory
            stage = stage.replace(task=stage.task.replace(init_from=str(ran[ref][0])))
        directory = stage_dir(cfg, name, run.path, stage_root)
        log.info("%s: stage %s in %s", cfg.name, name, directory)
        with run_dir_lock(directory):
            record = run_experiment(stage, directory, data_dir=data_dir, cache_dir=cache_dir, force=force)
        ran[name] = (directory, record)
        if record["status"] != COMPLETED:  # a diverged stage is the pipeline's result: nothing to start from
            break
    record = _pipeline_record(cfg, ran, time.time() - started)
    if writes:  # what each stage read (a results table's data.fingerprint), then the record
        atomic_write_json(run.data, {"stages": {n: read_json_or_none(RunDir(d).data) for n, (d, _) in ran.items()}})
        run.write(record)
    return record


def replaced_stage(cfg: PipelineConfig, run: RunDir, record: dict[str, Any]) -> str | None:
    """Why a finished pipeline's `record` is not one of its stages as they are now, or None: a later stage whose
    result was fine-tuned from a model its upstream stage no longer holds (a shared stage forced anew by another
    pipeline: study.run.single.replaced_start)."""
    from study.run.single import replaced_start

    ran = stage_run_dirs(record, run.path)
    for name, stage in cfg.stages.items():
        ref = stage_ref(stage.task.init_from)
        if ref is not None and name in ran and ref in ran:
            if (why := replaced_start(RunDir(ran[name]), ran[ref])) is not None:
                return why
    return None


def refuse_unrunnable_stages(cfg: PipelineConfig) -> None:
    """Resolve every stage as it will run, each later stage against the config of the stage it starts from, and
    raise the first problem naming its stage. A later stage is otherwise resolved only once the stages before it have
    trained, so a combination that cannot run (a fine-tuning seq_len beyond the pretrained positions, a start from a
    stage that leaves no single model to start from) would fail after hours of pretraining rather than before it."""
    from study.tasks import family, resolved_stage

    if problems := stage_name_problems(cfg):
        raise ConfigError("PipelineConfig", problems)
    for name in cfg.stages:  # in order: a stage's problem is raised before those of the stages that start from it
        stage = cfg.stages[name]
        if problems := family(stage.task.name).unread_settings(stage):
            raise ConfigError("PipelineConfig", [f"stages.{name}.{p}" for p in problems])
        try:
            resolved_stage(cfg, name)
        except ConfigError as err:
            raise ConfigError("PipelineConfig", [f"stages.{name}.{p}" for p in err.problems]) from None
        except ValueError as err:
            raise ValueError(f"stages.{name}: {err}") from None


def stage_name_problems(cfg: PipelineConfig) -> list[str]:
    """The stage names the pipeline's record would lose a number under: its `cost` holds each stage's own cost under
    the stage's name beside the run layer's cost columns, and its `metrics` each earlier stage's metrics beside the
    last stage's, so a stage named `parameters`, or an earlier stage named like a last-stage metric (`glue_score`,
    `test_sets`), would overwrite one of them."""
    from study.record import COSTS
    from study.tasks import family

    last = list(cfg.stages)[-1]
    heads = [m.name.split(".")[0] for m in family(cfg.stages[last].task.name).metrics]
    problems = [f"stages.{name}: a stage name may not be a cost column of the record ({name}); rename the stage"
                for name in cfg.stages if name in COSTS]
    for name in list(cfg.stages)[:-1]:
        clash = next((h for h in heads if fnmatch.fnmatchcase(name, h)), None)
        if clash is not None:
            problems.append(f"stages.{name}: an earlier stage's metrics are recorded under its name beside the last "
                            f"stage's ({cfg.stages[last].task.name}: {clash}); rename the stage")
    return problems


def refuse_missing_data(cfg: PipelineConfig, data_dir: str | Path | None) -> None:
    """List every later stage's parts (a GLUE suite: its tasks), which reads which of its data is there: a stage
    whose data is missing raises its DatasetUnavailable now, not after the stages before it have trained. (The first
    stage's data problems surface before it trains anyway.)"""
    from study.tasks import family

    for stage in list(cfg.stages.values())[1:]:
        family(stage.task.name).sub_runs(stage, data_dir)


def _seeds(stage: ExperimentConfig) -> dict[str, Any]:
    """The seed a stage ran with, or the fine-tuning seeds of one whose task reads those instead (GLUE's
    task.finetune_seeds: its train.seed reaches nothing)."""
    from study.tasks import family

    if family(stage.task.name).reads_train_seed(stage):
        return {"seed": stage.train.seed}
    return {"finetune_seeds": list(stage.task.finetune_seeds)}


def _pipeline_record(cfg: PipelineConfig, ran: dict[str, tuple[Path, dict[str, Any]]], wall: float) -> dict:
    """The last stage's metrics, each earlier stage's under its name, and where every stage ran. Its cost: the time
    of every stage that ran (summed, as its steps and train tokens are), the last stage's model (parameters, FLOPs,
    memory, throughput: what the pipeline's result is a model of), and every stage's own cost under its name."""
    from study.run.suite import TIME_COSTS, combined_wall, summed_times

    names = list(ran)
    _, last = ran[names[-1]]
    complete = len(ran) == len(cfg.stages) and last["status"] == COMPLETED
    metrics = dict(last["metrics"]) if complete else {}
    declared = dict(last.get("declared") or {}) if complete else {}
    for name in names[:-1] if complete else names:
        metrics[name] = ran[name][1]["metrics"]
        declared.update({f"{name}.{k}": v for k, v in (ran[name][1].get("declared") or {}).items()})
    costs = {name: ran[name][1].get("cost") or {} for name in names}
    cost = {**{k: v for k, v in costs[names[-1]].items() if k not in TIME_COSTS and k != "wall_seconds"},
            **summed_times(list(costs.values())), "wall_seconds": combined_wall(wall, list(costs.values())), **costs}
    stages = {n: {"run_dir": str(d), "status": r["status"], "steps": r.get("steps"), "stopped_by": r.get("stopped_by"),
                  "diverged_at_step": r.get("diverged_at_step"), **_seeds(cfg.stages[n])}
              for n, (d, r) in ran.items()}
    diverged = next((n for n, (_, r) in ran.items() if r["status"] != COMPLETED), None)
    return make_record(last["status"] if diverged is None else ran[diverged][1]["status"], metrics, cost,
                       steps=sum(int(r.get("steps") or 0) for _, r in ran.values()),
                       train_tokens=sum(int(r.get("train_tokens") or 0) for _, r in ran.values()),
                       diverged_at_step=ran[diverged][1].get("diverged_at_step") if diverged else None,
                       stopped_by=stopped_by_any([r for _, r in ran.values()]), declared=declared,
                       **{**(extras(last) if complete else {}), "stages": stages, "diverged_in_stage": diverged})
