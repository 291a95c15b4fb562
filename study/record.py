"""The run record: what a run directory holds, the `metrics.json` schema, and the statuses a run can end in.

One module owns these, and the run layer (which writes them), the sweep (which queues and tabulates them) and the
report (which reads them) all use it. It imports nothing from the rest of `study` but `study.io`, and nothing heavy,
so the report package can read records without the model stack.

    <run_dir>/config.yaml    the resolved experiment: what ran, not what was asked (labels are read from here)
    <run_dir>/env.json       code version, packages, device, precision, attention kernels of the attempt that ran
                             last; each earlier attempt's (a resumed run may have begun on another machine) under
                             `earlier_attempts`, oldest first
    <run_dir>/data.json      fingerprint of the data actually read
    <run_dir>/metrics.json   the record below, written last and atomically: its presence means the run ended
    <run_dir>/model.pt       final weights (a plain state dict: torch.load(weights_only=True))
    <run_dir>/checkpoints/   last.ckpt for resuming (model, optimizer, scheduler, RNG, data position)
    <run_dir>/logs/          metrics.csv: the training curves (Lightning's CSV logger)
    <run_dir>/trial.json     (sweeps) every attempt at this run: worker, start, end, outcome
    <run_dir>/trial.log      (sweeps) the trial process's output

A run made of several runs (a GLUE suite, a pretrain -> fine-tune pipeline) has the same files at its top and one
ordinary run directory per part below it.

`metrics.json` (schema 2):

    schema             2 (records without it are schema 1: bench/results/run-*.json, older sweeps)
    status             completed | diverged (a result: training blew up, recorded with its step)
    diverged_at_step   the step, when diverged
    divergence         {step, reason}: which part of the divergence rule stopped it (study.tasks.ledger); optional
    steps, train_tokens, stopped_by ('time' when the time budget ended training before max_steps)
    metrics            the task's final metrics, by the names its task family declares
    declared           {metric name: {direction, scale, constant, objective, description}}: the declarations of the
                       task family that wrote them, so a reader never guesses a metric's direction or scale
    cost               parameters, FLOPs, KV-cache bytes (computed from the config), throughput and memory (measured)
"""

from __future__ import annotations

import functools
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from study.io import atomic_write_json, file_sha256, read_json_or_none

SCHEMA = 2
COMPLETED, DIVERGED, FAILED, RUNNING, PENDING = "completed", "diverged", "failed", "running", "pending"
FINISHED = (COMPLETED, DIVERGED)  # a run directory in one of these holds a result and is never run again
STATUSES = (COMPLETED, DIVERGED, FAILED, RUNNING, PENDING)  # a trial's status in a results table
# the directions a metric may be declared with (a task's MetricSpec, a sweep's objective, the report's verdicts):
# any other word is refused, never read as one of them
DIRECTIONS = ("minimize", "maximize")
NOT_APPLICABLE = "n/a"  # a metric that does not apply (e.g. learned positions past their table): missing, not zero
# The run layer's own columns of `cost` (study.model.accounting and the run's measurements): direction, unit, and
# whether the number follows from the config by arithmetic ("by construction": a difference in it is not evidence,
# it is the definition of the variant) or was measured.
COSTS = {
    "parameters": ("minimize", "count", True),
    "d_ff": ("minimize", "count", True),
    "train_flops_per_token": ("minimize", "FLOP/token", True),
    "train_flops_per_token_dense": ("minimize", "FLOP/token", True),
    "inference_flops_per_token": ("minimize", "FLOP/token", True),
    "kv_cache_bytes_per_token": ("minimize", "bytes/token", True),
    "kv_cache_bytes_at_seq_len": ("minimize", "bytes", True),
    "train_tokens_per_s": ("maximize", "tokens/s", False),
    "peak_memory_bytes": ("minimize", "bytes", False),
    "fit_seconds": ("minimize", "seconds", False),
    "final_eval_seconds": ("minimize", "seconds", False),  # the final evaluation (and decoding), after training
    "wall_seconds": ("minimize", "seconds", False),
}
RECORD_KEYS = ("schema", "status", "diverged_at_step", "steps", "stopped_by", "train_tokens", "metrics", "declared",
               "cost")  # the schema's keys; a task family may add its own beside them (GLUE: `init`)


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def sub(self, *parts: str) -> "RunDir":
        """A part of a run made of several runs (e.g. `SST-2/seed0`)."""
        return RunDir(self.path.joinpath(*parts))

    config = property(lambda self: self.path / "config.yaml")
    env = property(lambda self: self.path / "env.json")
    data = property(lambda self: self.path / "data.json")
    metrics = property(lambda self: self.path / "metrics.json")
    weights = property(lambda self: self.path / "model.pt")
    checkpoints = property(lambda self: self.path / "checkpoints")
    last_checkpoint = property(lambda self: self.path / "checkpoints" / "last.ckpt")
    logs = property(lambda self: self.path / "logs")
    curves = property(lambda self: self.path / "logs" / "metrics.csv")
    trial = property(lambda self: self.path / "trial.json")
    trial_log = property(lambda self: self.path / "trial.log")

    def read(self) -> dict[str, Any] | None:
        """The metrics.json record, or None when there is none (the run has not ended) or it is no record (not a
        JSON object: a damaged file)."""
        record = read_json_or_none(self.metrics)
        return record if isinstance(record, dict) else None

    def finished(self) -> dict[str, Any] | None:
        """The record of a run that ended with a result (completed or diverged), else None."""
        record = self.read()
        return record if record and record.get("status") in FINISHED else None

    def write(self, record: dict[str, Any]) -> None:
        atomic_write_json(self.metrics, record)

    def remove_stale_temp_files(self, older_than_s: float = 60.0) -> list[Path]:
        """Delete the temporary files of writes a kill cut short (`study.io.atomic_write`'s `.NAME.XXXX.tmp`, as
        large as a checkpoint), which nothing else would remove: each attempt's have other names. For the process
        that holds the run directory, before it writes. trial.json's are left alone (sweep workers update it
        under its own lock while the run trains), as is any file written to in the last `older_than_s` seconds."""
        now = time.time()
        found = self.path.rglob(".*.tmp") if self.path.is_dir() else ()
        stale = [p for p in found if not p.name.startswith(f".{self.trial.name}.") and p.is_file()
                 and now - p.stat().st_mtime > older_than_s]
        for p in stale:
            p.unlink(missing_ok=True)
        return stale

    def write_env(self, env: dict[str, Any], continues: bool) -> None:
        """env.json for the attempt starting now; where it `continues` earlier attempts (a resumed run), their
        environments are kept under `earlier_attempts` (a run started afresh has none: what was there is gone)."""
        old = read_json_or_none(self.env) if continues else None
        if isinstance(old, dict):
            env = env | {"earlier_attempts": [*old.pop("earlier_attempts", []), old]}
        atomic_write_json(self.env, env)

    def read_curves(self):
        """logs/metrics.csv as a DataFrame (sparse Lightning rows with a `step` column), or None when it is
        absent, unreadable, empty or has no steps. (pandas is imported here, so this module stays light.)"""
        import pandas as pd

        try:
            frame = pd.read_csv(self.curves) if self.curves.is_file() else None
        except (OSError, ValueError, pd.errors.ParserError):
            return None
        return frame if frame is not None and "step" in frame and not frame.empty else None


def stopped_by_any(records: list[dict[str, Any]]) -> str | None:
    """A record made of several runs (a suite's parts, a pipeline's stages) ran short where any of them did: 'time'
    when a time budget ended any of them before its max_steps."""
    return "time" if any(r.get("stopped_by") == "time" for r in records) else None


def started_from(init_from: str | Path) -> dict[str, str]:
    """What a run that starts from another's weights records in its data.json: the run it started from and the
    digest of the model.pt it read there. The run layer compares the digests with the model.pt there now
    (`started_from_digests`, study.run.single.replaced_start): a result is handed back only while it is a result of
    the model on disk."""
    return {"init_from": str(init_from), "model_sha256": file_sha256(RunDir(init_from).weights)}


def started_from_digests(data: Any) -> set[str]:
    """Every model.pt digest a data.json records (`started_from`), at any depth: a suite's holds each part's."""
    if not isinstance(data, dict):
        return set()
    found = {data["model_sha256"]} if isinstance(data.get("model_sha256"), str) else set()
    return found.union(*(started_from_digests(v) for v in data.values()))


def stage_run_dirs(record: dict[str, Any] | None, run_dir: str | Path | None = None) -> dict[str, str]:
    """{stage: run directory} of a study in stages' record (its `stages` entry); {} for a single run. Given the
    pipeline's own `run_dir`, a recorded stage directory that is gone (the results folder moved or mounted elsewhere)
    is looked for where study.run.pipeline.stage_dir puts it relative to the pipeline: the last stage inside it
    (`<run_dir>/<stage>`), an earlier one as the same `<hash>/seed-<k>` under its default stage root
    (`<run_dir>/stages`) or beside it, where a sweep keeps its stages (its runs folder)."""
    stages = (record or {}).get("stages") or {}
    found = {name: s["run_dir"] for name, s in stages.items() if isinstance(s, dict) and s.get("run_dir")}
    if run_dir is None:
        return found
    here = Path(run_dir)
    for name, recorded in found.items():
        old = Path(recorded)
        moved = ([here / name] if old.name == name else  # (the last stage's directory is named after it)
                 [here / "stages" / old.parent.name / old.name, here.parent.parent / old.parent.name / old.name])
        if not old.is_dir():
            found[name] = str(next((m for m in moved if m.is_dir()), old))
    return found


def make_record(status: str, metrics: dict[str, Any], cost: dict[str, Any], *, steps: int,
                train_tokens: int | None = None, diverged_at_step: int | None = None,
                stopped_by: str | None = None, declared: dict[str, dict] | None = None,
                **extra: Any) -> dict[str, Any]:
    """A metrics.json record of the current schema."""
    if status not in FINISHED:
        raise ValueError(f"a run record's status is one of {FINISHED}, got {status!r}")
    return {"schema": SCHEMA, "status": status, "diverged_at_step": diverged_at_step, "steps": steps,
            "stopped_by": stopped_by, "train_tokens": train_tokens, "metrics": metrics, "declared": declared or {},
            "cost": cost, **extra}


def extras(record: dict[str, Any]) -> dict[str, Any]:
    """The entries of a record beside the schema's own."""
    return {k: v for k, v in record.items() if k not in RECORD_KEYS}


def _flatten(prefix: str, value: Any, out: dict[str, Any], numeric: bool) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out, numeric)
    elif isinstance(value, bool):
        out[prefix] = value
    elif isinstance(value, (int, float)):
        out[prefix] = float(value) if numeric else value
    elif isinstance(value, (list, tuple)):
        if all(isinstance(v, (str, int, float, bool)) for v in value):
            out[prefix] = ",".join(str(v) for v in value)
    elif value is None or value == NOT_APPLICABLE:
        if numeric:
            out[prefix] = math.nan  # does not apply: a missing number, never a zero
    else:
        out[prefix] = value  # text: a sacreBLEU signature, a format name


def metric_value(record: dict[str, Any], name: str) -> float | None:
    """The finite value of metric `name` (nested names joined with '.', e.g. `pretrain.valid_mlm_loss`) in a
    record, or None when it is missing, not a number or not finite."""
    value = flatten_record(record).get(f"metric.{name}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def record_schema(record: dict[str, Any]) -> int:
    """The schema a record was written with (1 when it names none). A newer schema (a later version of study wrote
    it) or a damaged value is refused: read as this version's schema, its fields could mean other things (schema 2
    changed the scale of task metrics), and a table or report would carry the misreading without a word."""
    raw = record.get("schema", 1)
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= SCHEMA:
        newer = isinstance(raw, int) and not isinstance(raw, bool) and raw > SCHEMA
        raise ValueError(f"a metrics.json of schema {raw!r}: this version of study reads schemas 1 to {SCHEMA}"
                         + ("; it was written by a newer version: upgrade study to read it" if newer else
                            "; the file is damaged: rerun the run (--force) or remove it"))
    return raw


def flatten_record(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics.json record as one table row: status, steps, ..., `metric.<name>` (nested names joined with '.';
    numbers as floats, 'n/a' and null as NaN) and `cost.<name>`."""
    row: dict[str, Any] = {}
    for key in ("status", "steps", "diverged_at_step", "train_tokens", "stopped_by"):
        if key in record:
            row[key] = record[key]
    row["schema"] = record_schema(record)
    _flatten("metric", record.get("metrics") or {}, row, numeric=True)
    _flatten("cost", record.get("cost") or {}, row, numeric=False)
    return row


# --- a sweep's tables: results.parquet / results.csv, curves.parquet -----------------------------------------------
class UnreadableTable(ValueError):
    """A results (or curves) table is there but cannot be read: reported, never taken for a sweep in which nothing
    ran (its rows may be the only record of trials whose run directories are elsewhere)."""


def read_table(files: list[Path], read_csv: Any = None) -> tuple[Any, Path | None]:
    """The first of `files` (parquet or CSV) that is there and reads as a sweep's table (it has a trial_key column),
    and which file it was; (None, None) where none is there; UnreadableTable naming each one that is there but
    cannot be read. `read_csv`: how a CSV is read (the report keeps axis labels as written). The sweep, which
    writes the tables, and the report, which reads them, both read them here. (pandas is imported here.)"""
    import pandas as pd

    unreadable = []
    for f in (f for f in files if f.is_file()):
        try:
            table = pd.read_parquet(f) if f.suffix == ".parquet" else (read_csv or pd.read_csv)(f)
        except Exception as err:  # a parquet being rewritten by a running sweep: the CSV next
            unreadable.append(f"{f} ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})")
            continue
        if "trial_key" in table.columns:
            return table, f
        unreadable.append(f"{f} (no trial_key column: not a results table)")
    if unreadable:
        raise UnreadableTable("; ".join(unreadable))
    return None, None


# --- sweeps' trial.json: who ran an attempt, and whether that process is still there --------------------------
def own_attempts(trial: dict[str, Any] | None, sweep: str) -> list[dict[str, Any]]:
    """This sweep's attempts at a trial (trial.json), in the order they started. trial.json is shared by the sweeps
    that share the run directory (attempt ids are `<sweep>#<n>`), and an attempt updated when it ends is written
    last: another sweep's failed attempt says nothing of this sweep's trial."""
    attempts = [a for a in (trial or {}).get("attempts", []) if str(a.get("id", "")).startswith(f"{sweep}#")]
    return sorted(attempts, key=lambda a: float(a.get("started") or 0.0))


def interrupted(attempt: dict[str, Any]) -> str | None:
    """Why a trial.json attempt that has not ended never will, or None: its worker, a process on this host, is gone
    (a `kill -9`, a crash of the machine's session). Elsewhere (another host, no worker recorded) it may still run.
    Results tables and reports give the trial as pending with this."""
    if "ended" in attempt or not worker_gone(worker := str(attempt.get("worker", ""))):
        return None
    return f"last attempt interrupted: its worker ({worker}) is gone; rerunning `study sweep` resumes it"


@functools.lru_cache(maxsize=None)
def host_id() -> str:
    """This host as a worker id names it: its hostname, boot and PID namespace. Containers on one machine may share
    a hostname (`--network host`) but not their PIDs: a pid is only checked (`worker_gone`) where the
    namespace is this process's own, elsewhere the heartbeat's grace decides."""
    name = socket.gethostname()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        return f"{name}/{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc (macOS): one namespace per host
        return name


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def worker_gone(worker: str) -> bool:
    """Whether `worker` ("host:pid", as a sweep's queue and trial.json record a trial's worker or the enqueue lock's
    holder) is another process on this host that no longer runs."""
    host, _, pid = worker.rpartition(":")
    return host == host_id() and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))
