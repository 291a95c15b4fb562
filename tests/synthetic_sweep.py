"""A synthetic sweep results directory in the layout `study sweep` writes (plan.json with declared metrics, results
table, run directories with training curves), for the report's tests. Three kinds:

    make_synthetic_sweep(root, ...)            language modelling: Tiny Shakespeare (a validation split only) or
                                               WikiText-2 (validation and test)
    make_pretrain_sweep(root, ...)             BERT-style pretraining with NSP on and off (`model.nsp`)
    make_nsp_glue_sweep(root, ...)             a study in stages: pretrain (NSP on/off) -> GLUE fine-tuning

Values are made up (a fixed effect per axis value plus seeded noise); nothing here is a measurement. The
declarations below mirror the task families' (tests/test_report.py checks them against study.tasks when it imports).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd

_UNIFORM = "ln(vocabulary size) nats for a uniform prediction"


def _decl(direction: str, scale: str, objective: bool = True, defined_by: tuple[str, ...] = ()) -> dict:
    out = {"direction": direction, "scale": scale, "constant": "-", "objective": objective, "description": ""}
    return out | ({"defined_by": list(defined_by)} if defined_by else {})


TOKENS = ("task.dataset", "task.tokenizer", "task.vocab_size", "task.lowercase")
EVALUATED = (*TOKENS, "task.eval_tokens")
AT_LENGTH = (*EVALUATED, "task.seq_len")
MASKED_TOKENS = (*TOKENS, "task.mlm_probability", "task.seq_len")
PAIRS = (*TOKENS, "task.seq_len")
CORRELATION = "0-100 (a correlation: -100 to 100)"
DECLARED = {
    "lm": {"valid_loss": _decl("minimize", "nats/token", defined_by=AT_LENGTH),
           "valid_ppl": _decl("minimize", "perplexity", defined_by=AT_LENGTH),
           "test_loss": _decl("minimize", "nats/token", defined_by=AT_LENGTH),
           "test_ppl": _decl("minimize", "perplexity", defined_by=AT_LENGTH),
           "*_ppl_by_length.*": _decl("minimize", "perplexity", False, defined_by=EVALUATED),
           "*_ppl_at_2x": _decl("minimize", "perplexity", defined_by=AT_LENGTH)},
    "pretrain": {"valid_mlm_loss": _decl("minimize", "nats/masked token", defined_by=(*MASKED_TOKENS, "model.nsp")),
                 "valid_mlm_ppl": _decl("minimize", "perplexity", defined_by=(*MASKED_TOKENS, "model.nsp")),
                 "valid_mlm_loss_full_sentences": _decl("minimize", "nats/masked token", defined_by=MASKED_TOKENS),
                 "valid_nsp_accuracy": _decl("maximize", "fraction (0-1)", defined_by=PAIRS),
                 "valid_nsp_loss": _decl("minimize", "nats/pair", defined_by=PAIRS),
                 "valid_masked_tokens": _decl("maximize", "count", False),
                 "valid_nsp_pairs": _decl("maximize", "count", False)},
    "glue": {"glue_score": _decl("maximize", "0-100", defined_by=("task.glue_tasks", "metric.glue_score_tasks")),
             "*_std": _decl("minimize", "0-100 (sample sd over fine-tuning seeds)", False),
             "seeds": _decl("maximize", "seed ids", False),
             "*/score": _decl("maximize", "0-100"),
             **{f"*/{m}": _decl("maximize", CORRELATION if m in ("mcc", "pearson", "spearman") else "0-100")
                for m in ("accuracy", "f1", "mcc", "pearson", "spearman", "accuracy_m", "accuracy_mm")}},
}
DEFAULT_OBJECTIVE = {"lm": "valid_loss", "pretrain": "valid_mlm_loss", "glue": "glue_score"}
CURVES = {"lm": {"train": "train/loss", "valid": "val/loss"}, "glue": {"train": "train/loss", "valid": "val/loss"},
          "pretrain": {"train": "train/mlm_loss", "valid": "val/mlm_loss"}}

DEFAULT_AXES = {
    "norm_position": ["pre", "post"],
    "norm": ["rmsnorm", "layernorm"],
    "position": ["rope", "learned", "sinusoidal", "alibi", "t5_bias", "none"],
    "attention": ["mha", "gqa", "mqa"],
    "span": ["global", "local"],
}
# made-up effect of each value on valid_loss (nats), relative to the baseline value
EFFECT = {"post": 0.08, "layernorm": 0.01, "learned": 0.03, "sinusoidal": 0.05, "alibi": -0.01, "t5_bias": 0.0,
          "none": 0.15, "gqa": 0.005, "mqa": 0.02, "local": 0.04, "layernorm+post": 0.0}
# made-up perplexity growth per doubling of the evaluation length
GROWTH = {"rope": 1.10, "alibi": 0.99, "t5_bias": 1.0, "sinusoidal": 1.6, "none": 1.2}
KV = {"mha": 2048, "gqa": 1024, "mqa": 512}
SEQ_LEN = 64
GLUE_TASKS = {"SST-2": ("accuracy",), "CoLA": ("mcc",), "MRPC": ("f1", "accuracy"), "RTE": ("accuracy",)}


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _points(axes: dict[str, list[str]], design: str, config) -> list[dict]:
    """The plan's points: OFAT (baseline, then one axis at a time) or the full grid; `config(axes)` builds each
    point's config."""
    base = {a: v[0] for a, v in axes.items()}
    points = []
    if design == "ofat":
        points.append({"label": "baseline", "varied": "baseline", "is_baseline": True, "axes": dict(base)})
        for axis, values in axes.items():
            for v in values[1:]:
                points.append({"label": f"{axis}={v}", "varied": axis, "is_baseline": False,
                               "axes": {**base, axis: v}})
    else:
        for combo in itertools.product(*axes.values()):
            a = dict(zip(axes, combo))
            points.append({"label": ",".join(f"{k}={v}" for k, v in a.items()), "varied": "grid",
                           "is_baseline": a == base, "axes": a})
    for p in points:
        p["config"] = config(p["axes"])
        p["point"] = _hash(p["config"])
    return points


def _lm_config(dataset: str):
    def config(a: dict) -> dict:
        return {"name": "p", "model": {"preset": "llama2", **a},
                "task": {"name": "lm", "dataset": dataset, "seq_len": SEQ_LEN, "tokenizer": "char"},
                "train": {"max_steps": 200}}
    return config


def _curves(rng, loss: float, diverged_at: int | None, n_layers: int, post: bool, extra: float = 0.0) -> pd.DataFrame:
    """Lightning's sparse metrics.csv: train/loss (with `extra` added, like MLM + NSP against MLM alone) and
    train/mlm_loss every 10 steps, val/* every 50, per-layer gradient norms every 50."""
    rows = []
    for step in range(0, 201, 10):
        if diverged_at is not None and step > diverged_at:
            break
        if step % 50 == 0:
            grads = {f"grad_norm/decoder.{i:02d}": float((0.5 + 0.4 * i if post else 1.5 - 0.1 * i)
                                                         * np.exp(-step / 300) * (1 + 0.05 * rng.standard_normal()))
                     for i in range(n_layers)}
            rows.append({"step": step, **grads, "grad_norm/other": 0.7})
        cur = loss + 2.5 * np.exp(-step / 40) + 0.02 * rng.standard_normal()
        rows.append({"epoch": 0, "step": step, "train/loss": cur + extra, "train/mlm_loss": cur, "train/lr": 1e-3})
        if step % 50 == 0 and step > 0:
            rows.append({"epoch": 0, "step": step, "val/loss": cur + 0.03 + extra, "val/mlm_loss": cur + 0.03})
    return pd.DataFrame(rows)


def _plan(sweep: str, design: str, seeds, axes: dict, points: list[dict], objective: dict, tasks: list[str],
          stages: list[str], axis_fields: dict) -> dict:
    return {"sweep": sweep, "design": design, "objective": objective, "seeds": list(seeds), "stages": stages,
            "axes": axes, "axis_fields": axis_fields, "points": points,
            "tasks": {t: {"metrics": DECLARED[t], "default_objective": DEFAULT_OBJECTIVE[t], "curves": CURVES[t]}
                      for t in tasks},
            "environment": {"torch": "2.13.0+cpu", "device": "cpu", "git": {"commit": "0" * 40, "dirty": False}}}


def _write(root: Path, rows: list[dict], plan: dict, spec: list[str]) -> Path:
    table = pd.DataFrame(rows)
    table.to_parquet(root / "results.parquet", index=False)
    table.to_csv(root / "results.csv", index=False)
    (root / "plan.json").write_text(json.dumps(plan, indent=2))
    (root / "spec.yaml").write_text("\n".join(spec) + "\n")
    return root


def _identity(sweep: str, p: dict, seed: int, task: str, dataset: str, run_dir: Path) -> dict:
    return {"sweep": sweep, "point": p["point"], "seed": seed, "trial_key": f"{p['point']}-s{seed}",
            "label": p["label"], "varied": p["varied"], "is_baseline": p["is_baseline"],
            **{f"axis.{k}": v for k, v in p["axes"].items()}, "ran_as_planned": True, "task": task,
            "dataset": dataset, "schema": 2, "run_dir": str(run_dir), "env.torch": "2.13.0+cpu",
            "env.git": "0" * 40, "env.device": "cpu", "data.fingerprint": "f" * 16}


def _lm_metrics(rng, loss: float, a: dict, split: str) -> dict:
    """valid_* always; test_* only for a corpus with a test split; extrapolation on the last split."""
    pos = a.get("position", "rope")
    row = {"metric.valid_loss": loss, "metric.valid_ppl": float(np.exp(loss))}
    if split == "test":
        row |= {"metric.test_loss": loss + 0.01, "metric.test_ppl": float(np.exp(loss + 0.01))}
    last = loss + (0.01 if split == "test" else 0.0)
    for k, n in enumerate(SEQ_LEN * m for m in (1, 2, 4, 8)):
        ppl = float(np.exp(last)) * GROWTH.get(pos, 1.0) ** k
        row[f"metric.{split}_ppl_by_length.{n}"] = np.nan if (pos == "learned" and k > 0) else ppl
    row[f"metric.{split}_ppl_at_2x"] = row[f"metric.{split}_ppl_by_length.{2 * SEQ_LEN}"]
    row |= {"cost.parameters": 746880 + (16384 if pos == "learned" else 0)
            - {"mha": 0, "gqa": 16384, "mqa": 24576}.get(a.get("attention", "mha"), 0),
            "cost.train_flops_per_token": 4.67e6, "cost.inference_flops_per_token": 1.56e6,
            "cost.kv_cache_bytes_per_token": KV.get(a.get("attention", "mha"), 2048),
            "cost.train_tokens_per_s": 12000 * (0.8 if pos == "t5_bias" else 1.0) + 200 * rng.standard_normal(),
            "cost.peak_memory_bytes": 8.5e8, "cost.fit_seconds": 130.0, "cost.wall_seconds": 140.0}
    return row


def _status(problems: bool, partial: bool, points: list[dict], i: int, seed: int, seeds) -> tuple[str, str, float]:
    """(status, error, diverged step) of trial (point i, seed): the fixed pattern of failures the tests expect."""
    if problems and len(points) > 1 and i == 1 and seed == seeds[-1]:
        return "failed", "RuntimeError: out of memory\nTraceback...", np.nan
    if problems and len(points) > 2 and i == 2 and seed == seeds[0]:
        return "diverged", "", 120
    if partial and i == len(points) - 2 and seed == seeds[-1]:
        return "running", "", np.nan
    return "completed", "", np.nan


def make_synthetic_sweep(root: str | Path, design: str = "ofat", axes: dict | None = None, seeds=(0, 1, 2),
                         partial: bool = True, with_runs: bool = True, noise: float = 0.01, sweep: str = "synthetic",
                         problems: bool = True, n_layers: int = 4, dataset: str = "tinyshakespeare") -> Path:
    """Write `root` as a language-modelling sweep's results directory; returns it.

    partial: the last variant's seeds are left out of the table (never ran) and one trial is running.
    problems: one failed and one diverged trial. dataset: 'tinyshakespeare' (validation only) or 'wikitext-2'."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    axes = axes or (DEFAULT_AXES if design == "ofat" else {"norm_position": ["pre", "post"],
                                                           "position": ["rope", "alibi", "learned"]})
    split = "test" if dataset == "wikitext-2" else "valid"
    points = _points(axes, design, _lm_config(dataset))
    rng = np.random.default_rng(0)
    rows = []
    for i, p in enumerate(points):
        a = p["axes"]
        effect = sum(EFFECT.get(v, 0.0) for v in a.values())
        for seed in seeds:
            if partial and i == len(points) - 1:
                continue  # never ran: only the plan knows this point
            status, error, div = _status(problems, partial, points, i, seed, seeds)
            loss = 1.70 + effect + noise * rng.standard_normal() + 0.002 * seed
            run_dir = root / "runs" / p["point"] / f"seed-{seed}"
            row = _identity(sweep, p, seed, "lm", dataset, run_dir) | {
                "status": status, "attempts": 2 if status == "failed" else 1, "error": error,
                "steps": 200 if status == "completed" else (div if status == "diverged" else 0),
                "diverged_at_step": div, "train_tokens": 153600, "stopped_by": ""}
            if status == "completed":
                row |= _lm_metrics(rng, loss, a, split)
            rows.append(row)
            if with_runs and status != "pending":
                (run_dir / "logs").mkdir(parents=True, exist_ok=True)
                _curves(np.random.default_rng(seed), loss, div if status == "diverged" else None, n_layers,
                        a.get("norm_position") == "post").to_csv(run_dir / "logs" / "metrics.csv", index=False)
    objective = {"metric": "valid_loss", "direction": "minimize", "scale": "nats/token", "task": "lm"}
    plan = _plan(sweep, design, seeds, axes, points, objective, ["lm"], [],
                 {a: [f"model.{a}"] for a in axes})
    spec = [f"name: {sweep}", f"design: {design}", "base: experiments/shakespeare_char_llama2.yaml",
            f"seeds: {list(seeds)}", "axes:"] + [f"  model.{k}: [{', '.join(v)}]" for k, v in axes.items()]
    return _write(root, rows, plan, spec)


def _pretrain_config(a: dict) -> dict:
    return {"name": "p", "model": {"arch": "encoder", "objective": "mlm", "nsp": a["nsp"] == "true"},
            "task": {"name": "pretrain", "dataset": "wikitext-2", "seq_len": 64, "tokenizer": "wordpiece"},
            "train": {"max_steps": 200}}


def _pretrain_metrics(rng, nsp: bool, seed: int) -> dict:
    """MLM loss about the same either way; NSP adds its own loss (0.67 nats) to the total, and packing full
    sentences (no NSP) evaluates more masked tokens: a count that must never rank anything."""
    mlm = 5.6 + 0.02 * rng.standard_normal() + 0.002 * seed
    row = {"metric.valid_mlm_loss": mlm, "metric.valid_mlm_ppl": float(np.exp(mlm)),
           "metric.valid_mlm_loss_full_sentences": mlm - 0.02,
           "metric.valid_masked_tokens": 41884.0 if nsp else 42578.0}
    if nsp:
        row |= {"metric.valid_nsp_accuracy": 0.52, "metric.valid_nsp_loss": 0.69, "metric.valid_nsp_pairs": 2448.0}
    return row | {"cost.parameters": 5349186 if nsp else 5348672, "cost.train_flops_per_token": 3.3e7,
                  "cost.kv_cache_bytes_per_token": 0, "cost.train_tokens_per_s": 4100 + 50 * rng.standard_normal()}


def make_pretrain_sweep(root: str | Path, seeds=(0, 1, 2), sweep: str = "nsp-pretrain",
                        with_runs: bool = True) -> Path:
    """A pretraining sweep over `model.nsp: [true, false]` (the baseline: NSP on), every trial completed."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    axes = {"nsp": ["true", "false"]}
    points = _points(axes, "ofat", _pretrain_config)
    rng = np.random.default_rng(1)
    rows = []
    for p in points:
        nsp = p["axes"]["nsp"] == "true"
        for seed in seeds:
            run_dir = root / "runs" / p["point"] / f"seed-{seed}"
            metrics = _pretrain_metrics(rng, nsp, seed)
            rows.append(_identity(sweep, p, seed, "pretrain", "wikitext-2", run_dir) | {
                "config.model.nsp": p["axes"]["nsp"],  # what ran, as study.sweep.results.resolved_fields records it
                "status": "completed", "attempts": 1, "error": "", "steps": 200, "diverged_at_step": np.nan,
                "train_tokens": 204800, "stopped_by": ""} | metrics)
            if with_runs:
                (run_dir / "logs").mkdir(parents=True, exist_ok=True)
                _curves(np.random.default_rng(seed), metrics["metric.valid_mlm_loss"], None, 2, False,
                        extra=0.67 if nsp else 0.0).to_csv(run_dir / "logs" / "metrics.csv", index=False)
    objective = {"metric": "valid_mlm_loss", "direction": "minimize", "scale": "nats/masked token",
                 "task": "pretrain"}
    plan = _plan(sweep, "ofat", seeds, axes, points, objective, ["pretrain"], [], {"nsp": ["model.nsp"]})
    spec = [f"name: {sweep}", "base: experiments/wikitext2_bert_pretrain_nsp.yaml", f"seeds: {list(seeds)}",
            "axes:", "  model.nsp: [true, false]"]
    return _write(root, rows, plan, spec)


def _pipeline_config(a: dict) -> dict:
    pre = _pretrain_config(a)
    glue = {"name": "g", "model": {"arch": "encoder", "objective": "mlm", "nsp": False},
            "task": {"name": "glue", "dataset": "glue", "init_from": "stage:pretrain", "pretrained_weights": True,
                     "finetune_seeds": [0, 1]}, "train": {"max_steps": 100}}
    return {"name": "nsp-glue", "stages": {"pretrain": pre, "glue": glue}}


def _glue_metrics(rng, nsp: bool, seed: int, effect: float) -> dict:
    """A GLUE record's flat metrics on the 0-100 scale, with the pretraining stage's under `pretrain.`."""
    row: dict = {"metric.seeds": "0,1", "metric.glue_score_complete": False, "metric.glue_score_tasks": "CoLA,MRPC"}
    scores = []
    for t, metrics in GLUE_TASKS.items():
        vals = [60 + 10 * k + (effect if nsp else 0.0) + 0.4 * rng.standard_normal() for k in range(len(metrics))]
        for m, v in zip(metrics, vals):
            row[f"metric.{t}/{m}"], row[f"metric.{t}/{m}_std"] = v, 0.5
        row[f"metric.{t}/score"], row[f"metric.{t}/score_std"] = float(np.mean(vals)), 0.5
        scores.append(row[f"metric.{t}/score"])
    row["metric.glue_score"] = float(np.mean(scores))
    row |= {f"metric.pretrain.{k[len('metric.'):]}": v for k, v in _pretrain_metrics(rng, nsp, seed).items()
            if k.startswith("metric.")}
    return row | {"cost.parameters": 5348672.0, "cost.pretrain.parameters": 5349186.0 if nsp else 5348672.0}


def make_nsp_glue_sweep(root: str | Path, seeds=(0, 1, 2), sweep: str = "nsp-glue", nsp_effect: float = 3.0) -> Path:
    """A study in stages (pretrain -> glue) over `model.nsp: [true, false]`; NSP adds `nsp_effect` points to every
    GLUE metric. The trial's seed is the pretraining seed; each GLUE record averages two fine-tuning seeds."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    axes = {"nsp": ["true", "false"]}
    points = _points(axes, "ofat", _pipeline_config)
    rng = np.random.default_rng(2)
    rows = []
    for p in points:
        nsp = p["axes"]["nsp"] == "true"
        for seed in seeds:
            rows.append(_identity(sweep, p, seed, "glue", "glue", root / "runs" / p["point"] / f"seed-{seed}") | {
                "config.model.nsp": p["axes"]["nsp"],
                "status": "completed", "attempts": 1, "error": "", "steps": 1500, "diverged_at_step": np.nan,
                "train_tokens": 6e6, "stopped_by": ""} | _glue_metrics(rng, nsp, seed, nsp_effect))
    objective = {"metric": "glue_score", "direction": "maximize", "scale": "0-100", "task": "glue"}
    plan = _plan(sweep, "ofat", seeds, axes, points, objective, ["pretrain", "glue"], ["pretrain", "glue"],
                 {"nsp": ["model.nsp"]})
    spec = [f"name: {sweep}", "stages: {pretrain: ..., glue: ...}", f"seeds: {list(seeds)}", "axes:",
            "  model.nsp: [true, false]"]
    return _write(root, rows, plan, spec)
