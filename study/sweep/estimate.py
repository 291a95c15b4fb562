"""The plan's cost before anything runs: training FLOPs from the accounting module, and a rough wall-clock time at
this machine's measured matmul rate (or one given with --peak-flops) times an assumed utilisation.

Every sequence is counted at `task.seq_len`. That is exact where a task packs its data into seq_len-token windows
(language modelling) and close for BERT pairs, which fill seq_len except 10% made shorter on purpose (Devlin et al.
2018, A.2). Translation and GLUE pad each batch only to its longest example, typically far below seq_len (Multi30k's
sentences are about a dozen words against seq_len 100), and the dry run reads no data to know by how much: for them the
estimate is an upper bound, and `estimate` says so (`length_basis`, `basis_sentence`) rather than print a number
that looks exact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from study.config import ExperimentConfig, PipelineConfig

if TYPE_CHECKING:
    from study.sweep.plan import Plan

# Throughput a training step reaches, as a fraction of the peak matmul rate, for the small
# models these sweeps train on a CPU (measured here: ~50% for the default sweep's trials); used only for
# the plan's time estimate, which says so.
ASSUMED_UTILISATION = 0.45
TRIAL_OVERHEAD_S = 15.0  # process start (import lightning ~5 s), data, final evaluation


def matmul_rate_flops(threads: int = 1, seconds: float = 0.3) -> float:
    """This machine's float32 matmul rate (FLOP/s) with `threads` threads, measured in a fraction of a second."""
    import time

    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            a @ b
            count += 1
        return 2 * n**3 * count / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)


def _planning_vocab(cfg: ExperimentConfig) -> int:
    """The vocabulary the run will have: the task's tokenizer size when it sets one; char-level
    vocabularies are small (at most a few hundred symbols); otherwise the model config's."""
    if cfg.task.vocab_size:
        return cfg.task.vocab_size
    return 256 if cfg.task.tokenizer == "char" else cfg.model.vocab_size


def _parts(cfg: ExperimentConfig) -> list[ExperimentConfig]:
    """The runs one experiment makes: a GLUE suite's tasks (each with its task.per_task settings) x fine-tuning
    seeds, at most (a task's epochs may stop it sooner; which tasks have data is known only when it runs)."""
    if cfg.task.name != "glue":
        return [cfg]
    from study.tasks.data import GLUE_TASK_NAMES

    tasks = (cfg.task.glue_tasks or GLUE_TASK_NAMES) if cfg.task.dataset == "glue" else (cfg.task.dataset,)
    seeds = max(1, len(cfg.task.finetune_seeds))
    return [cfg.for_glue_task(t) for t in tasks for _ in range(seeds)]


def training_flops(cfg: ExperimentConfig | PipelineConfig) -> float:
    """Training FLOPs of one trial at its step budget (a pipeline: every stage; a suite: every run, at most)."""
    from study.model.accounting import flops_per_token
    from study.tasks import family

    if isinstance(cfg, PipelineConfig):
        return sum(training_flops(stage) for stage in cfg.stages.values())
    total = 0.0
    for part in _parts(cfg):
        tokens_per_step = part.train.batch_size * part.train.accumulate * part.train.devices * part.task.seq_len
        model = part.model.replace(vocab_size=_planning_vocab(part))
        fraction = family(part.task.name).predicted_fraction(part)
        total += flops_per_token(model, part.task.seq_len, predicted_fraction=fraction) * tokens_per_step * \
            part.train.max_steps
    return total


# How the task families shape a batch, for the estimate's honesty: packed to seq_len (exact) or padded to the batch's
# longest example (seq_len is then an upper bound). A family not named here is taken as an upper bound.
SEQ_LEN_IS_EXACT = {"lm": "packed into task.seq_len-token windows",
                    "pretrain": "pairs filling task.seq_len (10% shorter on purpose)"}


def length_basis(cfg: ExperimentConfig | PipelineConfig) -> str:
    """'exact' when every run of the trial fills task.seq_len, else 'upper bound' (a pipeline: its loosest stage)."""
    if isinstance(cfg, PipelineConfig):
        bases = {length_basis(stage) for stage in cfg.stages.values()}
        return "upper bound" if "upper bound" in bases else "exact"
    return "exact" if cfg.task.name in SEQ_LEN_IS_EXACT else "upper bound"


def _task_names(cfg: ExperimentConfig | PipelineConfig) -> list[str]:
    if isinstance(cfg, PipelineConfig):
        return [n for stage in cfg.stages.values() for n in _task_names(stage)]
    return [cfg.task.name]


def basis_sentence(cost: dict[str, Any]) -> str:
    """What the printed FLOPs and time rest on, for the plan's description."""
    bounded = cost.get("upper_bound_tasks") or []
    if not bounded:
        return "every sequence counted at task.seq_len, as the tasks fill it (packed): the FLOPs are exact"
    tasks = f"the {' and '.join(bounded)} task" + (" pads" if len(bounded) == 1 else "s pad")
    return (f"an UPPER BOUND: sequences counted at task.seq_len, but {tasks} each batch only to its longest example, "
            "and the dry run reads no data to measure it (short sentences: the real cost can be several times lower)")


def _seconds(cfg: ExperimentConfig | PipelineConfig, flops: float, rate: float) -> float:
    if isinstance(cfg, PipelineConfig):
        return sum(_seconds(s, training_flops(s), rate) for s in cfg.stages.values())
    s = flops / (rate * ASSUMED_UTILISATION * max(1, cfg.train.devices))  # DDP: devices share a trial
    runs = len(_parts(cfg))
    if cfg.train.max_time_s:
        s = min(s, cfg.train.max_time_s * runs)
    return s + TRIAL_OVERHEAD_S * runs


def estimate(plan: "Plan", rate_flops: float | None = None, workers: int = 1, threads: int = 1) -> dict[str, Any]:
    """Training FLOPs of the whole plan (from the accounting module) and a rough wall-clock time:
    each run's FLOPs at the matmul rate one trial's threads reach, times an assumed utilisation (no time, and
    `not_timed` says why, for trials on an accelerator without `rate_flops`). A pipeline's earlier
    stages are counted once per run directory they train in, as they run (`_runs`)."""
    from study.model.precision import emulated_bf16, trains_on_cpu

    runs = _runs(plan)
    # this machine's CPU rate says nothing about a GPU's (orders of magnitude apart): without the rate of the
    # machine that will run them (--peak-flops), trials that train on an accelerator get FLOPs and no time
    elsewhere = sorted({run.train.accelerator for run in runs if not trains_on_cpu(run.train.accelerator)})
    rate = rate_flops if rate_flops is not None or elsewhere else matmul_rate_flops(threads)
    flops = seconds = 0.0
    for run in runs:
        f = training_flops(run)
        flops, seconds = flops + f, seconds + (_seconds(run, f, rate) if rate is not None else 0.0)
    bounded = [p for p in plan.points if length_basis(p.config) == "upper bound"]
    tasks = [t for p in bounded for t in _task_names(p.config) if t not in SEQ_LEN_IS_EXACT]
    return {"train_flops": flops, "matmul_flops_per_s": rate,
            "assumed_utilisation": ASSUMED_UTILISATION,
            "estimated_wall_s": seconds / max(1, workers) if rate is not None else None, "workers": workers,
            "not_timed": (f"the trials train on train.accelerator={'/'.join(elsewhere)}, and this machine's CPU "
                          "matmul rate says nothing about it" if rate is None else None),
            "length_basis": "upper bound" if bounded else "exact",
            "upper_bound_points": [p.label for p in bounded], "upper_bound_tasks": list(dict.fromkeys(tasks)),
            # the rate is this machine's float32 one: bf16 runs here would be far slower than the time says
            "emulated_bf16": next((why for run in runs if rate_flops is None
                                   and (why := emulated_bf16(run.train.precision, run.train.accelerator))), None)}


def _runs(plan: "Plan") -> list[ExperimentConfig]:
    """Every run the plan trains: each trial's experiment, or each stage of its pipeline. An earlier stage trains in
    a directory shared by every trial with that stage config and seed (`study.run.pipeline.stage_dir`), so it is
    counted once. The stage tuning mode searches, and the stages after it, differ with every sampled (and every
    point's chosen) value, which the plan cannot know: those count once per tuning trial and per tuned seed."""
    spec = plan.spec
    tune = spec.tune_settings if spec.tune else None
    tuned_from = None
    if tune and spec.stages:
        from study.config.sweep import route

        tuned_from = spec.stage_names.index(route(tune["field"], spec.stage_names)[0])
    # (point, seed, which sampled or chosen tuning value it runs: None without tuning)
    trials = [(p, s, None if not tune else (p.point, "seed", s)) for p in plan.points for s in spec.seeds]
    trials += [(p, tune["seed"], (p.point, "tune", i)) for p in plan.points if tune for i in range(tune["trials"])]
    runs, shared = [], set()
    for point, seed, sampled in trials:
        cfg = point.config.with_seed(seed)
        if not isinstance(cfg, PipelineConfig):
            runs.append(cfg)
            continue
        names = list(cfg.stages)
        for i, (name, stage) in enumerate(cfg.stages.items()):
            if name != names[-1]:
                where = _stage_key(cfg, name)
                key = (where, sampled) if sampled is not None and tuned_from is not None and i >= tuned_from else where
                if key in shared:
                    continue
                shared.add(key)
            runs.append(stage)
    return runs


def _stage_key(cfg: PipelineConfig, name: str) -> str:
    """The shared directory a pipeline's earlier stage trains in (runs/<hash>/seed-<k>), as the run layer names it."""
    from study.run.pipeline import stage_dir

    return str(stage_dir(cfg, name, Path("run"), Path("stages")))


def si(x: float) -> str:
    for factor, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= factor:
            return f"{x / factor:.1f} {prefix}"
    return f"{x:.0f} "


def default_threads(workers: int) -> int:
    """CPU threads per trial so that `workers` trials share the cores without oversubscription."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))
