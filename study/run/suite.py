"""An experiment made of several runs (a GLUE suite: every task x every fine-tuning seed), through the hooks its
task family declares (`sub_runs`, `combine`, `save_suite_outputs`): each part is an ordinary run directory below
the experiment's, and the experiment's own record combines theirs.

    <run_dir>/config.yaml, env.json, data.json, metrics.json    the experiment (data.json: each part's fingerprint)
    <run_dir>/<part>/                                           one run directory per part (e.g. SST-2/seed0)

A part that finished is not run again, so a killed suite resumes at the part it was running; but a suite or part
fine-tuned from a model that is no longer the one in `task.init_from` (that run was forced anew) runs again, from
scratch (`study.run.single.replaced_start`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from study.config import ExperimentConfig
from study.io import atomic_write_json, atomic_write_text, read_json_or_none
from study.model.accounting import parameter_count
from study.record import COMPLETED, COSTS, DIVERGED, RunDir, make_record, stopped_by_any
from study.run.conflict import finished_run, handed_back
from study.run.single import data_module, discard_result, launch_rank, replaced_start, run_single
from study.tasks import family
from study.tasks.data.errors import DataError

log = logging.getLogger(__name__)

# The time costs a record of several runs (a suite, a pipeline) adds up over them, as it does their steps and train
# tokens: the `seconds` of study.record.COSTS but wall_seconds, which such a record measures itself (combined_wall)
TIME_COSTS = tuple(k for k, (_, unit, _) in COSTS.items() if unit == "seconds" and k != "wall_seconds")


def combined_wall(own: float, costs: list[dict[str, Any]]) -> float:
    """A record of several runs: its own clock, which also holds the time between its runs; or, where that is less,
    the sum of its runs' own wall times. A run it found finished (a pretraining stage another trial shares, parts
    done before a kill) took its time when it ran: a trial that reuses it must not look cheaper than one that ran it."""
    return max(own, sum(float(c.get("wall_seconds") or 0) for c in costs))


class StartReplaced(RuntimeError):
    """The model a suite's parts start from (task.init_from) was replaced while the suite ran."""


def summed_times(costs: list[dict[str, Any]]) -> dict[str, float]:
    """{time cost: its sum over `costs`} for each of TIME_COSTS that one of them holds."""
    return {k: sum(float(c.get(k) or 0) for c in costs) for k in TIME_COSTS if any(k in c for c in costs)}


def run_suite(cfg: ExperimentConfig, run_dir: str | Path, data_dir: str | Path | None = None,
              cache_dir: str | Path | None = None, force: bool = False) -> dict[str, Any]:
    """Run every part of `cfg` (its task family's `sub_runs`) and write the combined record; returns it."""
    from study.run.environment import prepare_training_process, snapshot

    run, task = RunDir(run_dir), family(cfg.task.name)
    done = finished_run(run, cfg, force, data_decided=task.data_decided_model_fields)
    # a suite fine-tuned from a model no longer in task.init_from runs again (each part finds out for itself)
    if (replaced := None if force else replaced_start(run, cfg.task.init_from)) is not None:
        log.warning("%s; its parts fine-tuned from that model run again", replaced)
    elif done is not None:
        return handed_back(run, done)
    started = time.time()
    parts = task.sub_runs(cfg, data_dir)  # data problems (a missing task) surface here, before any training
    for part in parts:  # and each part's own (its DataModule's check: a vocabulary its text cannot fill)
        if part.skip_reason is None:
            with _named(cfg, part):
                data_module(part.config, data_dir, cache_dir).check()
    prepare_training_process(cfg.train.accelerator)  # as its parts will: env.json records what they train with
    writes = launch_rank() == 0  # under DDP every rank runs the parts (each part's ranks wait for its record)
    if force or replaced:  # after the data checks: a bad input never costs the old record (discard_result says why)
        discard_result(run)
    if writes:
        atomic_write_text(run.config, cfg.to_yaml())
        run.write_env(snapshot(cfg.train.precision, cfg.train.accelerator), continues=not (force or replaced))
    results: dict[str, dict[str, Any]] = {}
    for part in parts:
        if part.skip_reason is not None:
            log.warning("%s: %s skipped:\n%s", cfg.name, part.path, part.skip_reason)
            results[part.path] = {"skipped": part.skip_reason}
            continue
        log.info("%s: %s", cfg.name, part.path)
        with _named(cfg, part):
            results[part.path] = run_single(part.config, run.sub(part.path).path, data_dir=data_dir,
                                            cache_dir=cache_dir, force=force, declared=task.declared(part=True))
    if writes:
        atomic_write_json(run.data, {"parts": {p: read_json_or_none(run.sub(p).data) for p, r in results.items()
                                               if "skipped" not in r},
                                     "skipped": {p: r["skipped"] for p, r in results.items() if "skipped" in r}})
        if (changed := replaced_start(run, cfg.task.init_from)) is not None:
            raise StartReplaced(f"{changed}: task.init_from was replaced while this suite ran (another run forced "
                                "it anew), so its parts were fine-tuned from different models and combine into no "
                                "result; run it again: each part fine-tuned from another model than the one there "
                                "now runs again")
        task.save_suite_outputs(cfg, run.path, results)
    record = _combined_record(cfg, task, results, time.time() - started)
    if writes:
        run.write(record)
    return record


@contextlib.contextmanager
def _named(cfg: ExperimentConfig, part):
    """A part's own data problem (a vocabulary its training text cannot fill), named by the part."""
    try:
        yield
    except DataError as err:
        if type(err) is not DataError:
            raise
        raise DataError(f"{cfg.name}: part {part.path}: {err}") from None


def _combined_record(cfg: ExperimentConfig, task, results: dict[str, dict[str, Any]], wall: float) -> dict:
    ran = [r for r in results.values() if "skipped" not in r]
    diverged = any(r["status"] == DIVERGED for r in ran)
    parameters = next((r["cost"].get("parameters") for r in ran if r.get("cost")), None)
    cost = {"parameters": parameters or parameter_count(cfg.model),
            **summed_times([r.get("cost") or {} for r in ran]),
            "wall_seconds": combined_wall(wall, [r.get("cost") or {} for r in ran])}
    return make_record(DIVERGED if diverged else COMPLETED, task.combine(cfg, results), cost,
                       steps=sum(int(r.get("steps") or 0) for r in ran),
                       train_tokens=sum(int(r.get("train_tokens") or 0) for r in ran), stopped_by=stopped_by_any(ran),
                       declared=task.declared(), **task.suite_details(cfg, results), **task.record_extras(cfg))
