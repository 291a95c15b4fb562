"""Where a sweep's files live, and which trials a plan asks for.

    results/<sweep>/storage.json     the storage this sweep's queue lives in (`storage.identity`, and the URL
                                     redacted), written once: a command naming another storage is refused
    results/<sweep>/spec.yaml        the spec as written, and the `--set` overrides it ran with (as comments)
    results/<sweep>/plan.json        every point with its complete config and content hash, the objective and the
                                     task families' metric declarations
    results/<sweep>/points/*.yaml    the config each trial process reads
    results/<sweep>/tuned.json       (tuning mode) each point's tuning trials and the setting chosen, for the tuning
                                     settings that ran them (`tuning_id`; an earlier tuning's under `superseded`)
    results/runs/<point>/seed-<k>/   each trial's run directory (`study.record`), shared by every sweep with that point
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from study.io import atomic_write_json, read_json
from study.record import RunDir, metric_value
from study.sweep.queue import TrialSpec
from study.sweep.storage import StorageError, identity, redact


@dataclass
class SweepLayout:
    """Where a sweep's files live: results/<sweep>/ for the sweep, results/runs/ for the runs."""

    sweep_dir: Path

    @property
    def results_root(self) -> Path:
        return self.sweep_dir.parent

    @property
    def runs_root(self) -> Path:
        """Where every sweep's run directories live (and a pipeline's shared stages: the same place a plain
        sweep of that stage's config would put them)."""
        return self.results_root / "runs"

    def run_dir(self, point: str, seed: int) -> Path:
        return self.runs_root / point / f"seed-{seed}"

    def run(self, point: str, seed: int) -> RunDir:
        return RunDir(self.run_dir(point, seed))

    def point_config(self, point: str) -> Path:
        return self.sweep_dir / "points" / f"{point}.yaml"

    @property
    def plan_path(self) -> Path:
        return self.sweep_dir / "plan.json"

    @property
    def tuned_path(self) -> Path:
        return self.sweep_dir / "tuned.json"

    @property
    def storage_path(self) -> Path:
        return self.sweep_dir / "storage.json"


def recorded_storage(layout: SweepLayout) -> dict[str, Any] | None:
    """The storage the sweep folder belongs to ({"identity", "url" redacted}); None before its first run (and for a
    sweep started by a release that did not record it: its next run records the storage it names)."""
    return read_json(layout.storage_path) if layout.storage_path.is_file() else None


def check_storage(layout: SweepLayout, url: str) -> None:
    """Refuse a storage other than the one the sweep folder belongs to: two queues over one results folder would
    train every trial twice, at the same time, into the same run directories. Reads only."""
    recorded = recorded_storage(layout)
    if recorded is None or recorded["identity"] == identity(url):
        return
    raise StorageError(
        f"{layout.sweep_dir} belongs to storage {recorded['url']!r} ({recorded['identity']}), not "
        f"{redact(url)!r} ({identity(url)}): give --storage (or $STUDY_STORAGE) the recorded storage (a file path "
        "after sqlite:/// or journal:/// is relative to the working directory; after sqlite://// or journal:////, "
        "absolute), or give this sweep another --results folder")


def record_storage(layout: SweepLayout, url: str) -> None:
    """Record the storage (once; of two commands starting together on a new folder, the second is refused)."""
    import os

    tmp = layout.sweep_dir / f".storage-{os.getpid()}.json"
    atomic_write_json(tmp, {"identity": identity(url), "url": redact(url)})  # whole, with the umask's mode
    try:
        os.link(tmp, layout.storage_path)  # never replaces: the first record stands
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    check_storage(layout, url)


def trial_specs(plan: dict[str, Any], tuned: dict[str, Any] | None = None) -> list[TrialSpec]:
    """Every trial the plan asks for. In tuning mode: each point's tuning trials, and its seed
    trials once its tuning has picked a setting (`tuned`, from tuned.json, for these tuning settings)."""
    tune = plan.get("tune") or {}
    specs: list[TrialSpec] = []
    choices = _axis_choices(plan)
    current = current_tuned(plan, tuned or {})
    for p in plan["points"]:
        point, label = p["point"], p["label"]
        axes = tuple((name, str(value), choices[name]) for name, value in (p.get("axes") or {}).items())
        if not tune:
            specs += [TrialSpec(key=f"{point}-s{s}", point=point, seed=s, label=label, axes=axes)
                      for s in plan["seeds"]]
            continue
        specs += [TrialSpec(key=tuning_key(plan, point, i), point=point, seed=tune["seed"], label=label, kind="tune",
                            axes=axes) for i in range(tune["trials"])]
        chosen = current.get(point, {}).get("point")
        if chosen:
            specs += [TrialSpec(key=seed_key(plan, point, s), point=point, seed=s, label=label, runs_point=chosen,
                                axes=axes) for s in plan["seeds"]]
    return specs


def tuning_id(plan: dict[str, Any]) -> str:
    """A fingerprint of what decides a tuning's outcome: every tune setting and the objective it ranks by. It is
    part of the tuning keys, the seed keys of tuning mode, the TPE study's name and each tuned.json entry, so a spec
    whose tune block or objective changed tunes again (its earlier tuning trials, chosen setting and seed runs
    answer another question) and the same spec resumes exactly where it stopped."""
    import hashlib
    import json

    tune = dict(plan.get("tune") or {})
    for end in ("low", "high"):  # `low: 0` and `low: 0.0` are one search
        if isinstance(tune.get(end), int) and not isinstance(tune.get(end), bool):
            tune[end] = float(tune[end])
    basis = {"tune": tune, "objective": {k: (plan.get("objective") or {}).get(k) for k in ("metric", "direction")}}
    return hashlib.sha256(json.dumps(basis, sort_keys=True, default=str).encode()).hexdigest()[:8]


def tuning_key(plan: dict[str, Any], point: str, index: int) -> str:
    return f"{point}-{tuning_id(plan)}-tune{index}"


def tuning_index(key: str) -> int:
    return int(key.rsplit("-tune", 1)[1])


def seed_key(plan: dict[str, Any], point: str, seed: int) -> str:
    """A seed trial's key; in tuning mode it names the tuning that chose its config: the same seed of a point tuned
    otherwise (or not at all) is another trial."""
    return f"{point}-{tuning_id(plan)}-s{seed}" if plan.get("tune") else f"{point}-s{seed}"


def current_tuned(plan: dict[str, Any], tuned: dict[str, Any]) -> dict[str, Any]:
    """tuned.json's entries made by this plan's tuning settings (`tuning_id`); an entry of other settings (or of a
    release that did not record them) says nothing about this tuning."""
    fingerprint = tuning_id(plan)
    return {point: entry for point, entry in tuned.items() if entry.get("tuning") == fingerprint}


def finished_results(layout: "SweepLayout", specs: list[TrialSpec], metric: str) -> dict[str, float | None]:
    """The seed trials of `specs` whose run directory holds a result: key -> objective (None: diverged). A completed
    run without the objective is not one (its trial fails with that reason when it runs), so it is left out."""
    finished, configs = {}, {}  # (each point's config read once, for all its seeds)
    for s in specs:
        if s.kind != "seed":  # a tuning trial's config is sampled when it starts: nothing to find on disk
            continue
        point = s.runs_point or s.point
        run = layout.run(point, s.seed)
        record = run.finished()
        value = metric_value(record, metric) if record is not None else None
        if record is not None and (value is not None or record["status"] != "completed"):
            if point not in configs:
                configs[point] = _point_config(layout.point_config(point))
            if _of_a_replaced_model(configs[point], run, record):
                continue  # queued again: the run layer runs it anew from the model there now
            finished[s.key] = value
    return finished


def _point_config(path: Path) -> Any:
    """The config a point's trials run (None where its file is not there)."""
    from study.config import load_experiment

    return load_experiment(path) if path.is_file() else None


def _of_a_replaced_model(cfg: Any, run: RunDir, record: dict[str, Any]) -> bool:
    """A finished result fine-tuned from a model its start no longer holds (a shared pretraining stage, or the run
    task.init_from names, forced anew since): the run layer would not hand it back (study.run.pipeline.replaced_stage,
    study.run.single.replaced_start), so it is no result of this sweep's either."""
    from study.config import PipelineConfig
    from study.run.pipeline import replaced_stage
    from study.run.single import replaced_start

    if cfg is None:
        return False
    if isinstance(cfg, PipelineConfig):
        return replaced_stage(cfg, run, record) is not None
    return bool(cfg.task.init_from) and replaced_start(run, cfg.task.init_from) is not None


def _axis_choices(plan: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Every value of each axis, as the trials' Optuna params take them: Optuna keeps one distribution per param
    name for the whole study, so every point gets the same choices ('n/a' among them where a conditional axis does
    not apply to some point)."""
    choices: dict[str, dict[str, None]] = {name: dict.fromkeys(map(str, values))
                                          for name, values in (plan.get("axes") or {}).items()}
    for q in plan["points"]:
        for name, value in (q.get("axes") or {}).items():
            choices.setdefault(name, {})[str(value)] = None
    return {name: tuple(values) for name, values in choices.items()}


def all_keys(plan: dict[str, Any]) -> list[str]:
    """Every key the sweep will have when done (seed trials of tuned points included)."""
    tune = plan.get("tune") or {}
    keys = []
    for p in plan["points"]:
        keys += [tuning_key(plan, p["point"], i) for i in range(tune.get("trials", 0))]
        keys += [seed_key(plan, p["point"], s) for s in plan["seeds"]]
    return keys


def read_tuned(layout: SweepLayout) -> dict[str, Any]:
    return read_json(layout.tuned_path) if layout.tuned_path.is_file() else {}
