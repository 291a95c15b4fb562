"""A synthetic sweep results directory in the layout `study sweep` writes, for tests and demos.

Values are made up (a fixed effect per axis value plus seeded noise); nothing here is a measurement.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd

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


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _points(axes: dict[str, list[str]], design: str) -> list[dict]:
    base = {a: v[0] for a, v in axes.items()}
    points = []
    if design == "ofat":
        points.append({"label": "baseline", "varied": "baseline", "is_baseline": True, "axes": dict(base)})
        for axis, values in axes.items():
            for v in values[1:]:
                points.append({"label": f"{axis}={v}", "varied": axis, "is_baseline": False,
                               "axes": {**base, axis: v}})
    else:
        import itertools

        for combo in itertools.product(*axes.values()):
            a = dict(zip(axes, combo))
            points.append({"label": ",".join(f"{k}={v}" for k, v in a.items()), "varied": "grid",
                           "is_baseline": a == base, "axes": a})
    for p in points:
        p["config"] = {"model": {"preset": "llama2", **p["axes"]}, "task": {"name": "lm", "dataset": "tinyshakespeare",
                                                                           "seq_len": SEQ_LEN, "tokenizer": "char"},
                       "train": {"max_steps": 200}}
        p["point"] = _hash(p["config"])
    return points


def _curves(rng, loss: float, diverged_at: int | None, n_layers: int, post: bool) -> pd.DataFrame:
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
        rows.append({"epoch": 0, "step": step, "train/loss": cur, "train/lr": 1e-3})
        if step % 50 == 0 and step > 0:
            rows.append({"epoch": 0, "step": step, "val/loss": cur + 0.03})
    return pd.DataFrame(rows)


def make_synthetic_sweep(root: str | Path, design: str = "ofat", axes: dict | None = None, seeds=(0, 1, 2),
                         partial: bool = True, with_runs: bool = True, noise: float = 0.01, sweep: str = "synthetic",
                         problems: bool = True, n_layers: int = 4) -> Path:
    """Write `root` as a sweep results directory; returns it.

    partial: the last variant's seeds are left out of the table (never ran) and one trial is running.
    problems: one failed and one diverged trial."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    axes = axes or (DEFAULT_AXES if design == "ofat" else {"norm_position": ["pre", "post"],
                                                           "position": ["rope", "alibi", "learned"]})
    points = _points(axes, design)
    rng = np.random.default_rng(0)
    lengths = [SEQ_LEN * k for k in (1, 2, 4, 8)]
    rows = []
    for i, p in enumerate(points):
        a = p["axes"]
        effect = sum(EFFECT.get(v, 0.0) for v in a.values())
        for seed in seeds:
            if partial and i == len(points) - 1:
                continue  # never ran: only the plan knows this point
            status, error, div = "completed", "", np.nan
            if problems and len(points) > 1 and p["label"] == points[1]["label"] and seed == seeds[-1]:
                status, error = "failed", "RuntimeError: out of memory\nTraceback..."
            if problems and len(points) > 2 and p["label"] == points[2]["label"] and seed == seeds[0]:
                status, div = "diverged", 120
            if partial and i == len(points) - 2 and seed == seeds[-1]:
                status = "running"
            loss = 1.70 + effect + noise * rng.standard_normal() + 0.002 * seed
            key = f"{p['point']}-s{seed}"
            run_dir = root / "runs" / key
            row = {"sweep": sweep, "point": p["point"], "seed": seed, "trial_key": key, "label": p["label"],
                   "varied": p["varied"], "is_baseline": p["is_baseline"],
                   **{f"axis.{k}": v for k, v in a.items()}, "task": "lm", "dataset": "tinyshakespeare",
                   "status": status, "attempts": 2 if status == "failed" else 1, "error": error,
                   "steps": 200 if status == "completed" else (div if status == "diverged" else 0),
                   "diverged_at_step": div, "train_tokens": 153600, "stopped_by": "",
                   "run_dir": str(run_dir), "env.torch": "2.13.0+cpu", "env.git": "0" * 40, "env.device": "cpu",
                   "data.fingerprint": "f" * 16}
            if status == "completed":
                pos = a.get("position", "rope")
                row |= {"metric.valid_loss": loss, "metric.valid_ppl": float(np.exp(loss)),
                        "metric.test_loss": loss + 0.01, "metric.test_ppl": float(np.exp(loss + 0.01))}
                for k, n in enumerate(lengths):
                    ppl = float(np.exp(loss + 0.01)) * GROWTH.get(pos, 1.0) ** k
                    row[f"metric.test_ppl_by_length.{n}"] = np.nan if (pos == "learned" and k > 0) else ppl
                row |= {"cost.parameters": 746880 + (16384 if a.get("position") == "learned" else 0)
                        - {"mha": 0, "gqa": 16384, "mqa": 24576}.get(a.get("attention", "mha"), 0),
                        "cost.train_flops_per_token": 4.67e6, "cost.inference_flops_per_token": 1.56e6,
                        "cost.kv_cache_bytes_per_token": KV.get(a.get("attention", "mha"), 2048),
                        "cost.train_tokens_per_s": 12000 * (0.8 if pos == "t5_bias" else 1.0)
                        + 200 * rng.standard_normal(),
                        "cost.peak_memory_bytes": 8.5e8, "cost.fit_seconds": 130.0, "cost.wall_seconds": 140.0}
            rows.append(row)
            if with_runs and status != "pending":
                (run_dir / "logs").mkdir(parents=True, exist_ok=True)
                curves = _curves(np.random.default_rng(seed), loss, div if status == "diverged" else None,
                                 n_layers, a.get("norm_position") == "post")
                curves.to_csv(run_dir / "logs" / "metrics.csv", index=False)
    table = pd.DataFrame(rows)
    table.to_parquet(root / "results.parquet", index=False)
    table.to_csv(root / "results.csv", index=False)
    plan = {"sweep": sweep, "design": design, "objective": {"metric": "valid_loss", "direction": "minimize"},
            "seeds": list(seeds), "axes": axes, "points": points,
            "environment": {"torch": "2.13.0+cpu", "device": "cpu", "git": {"commit": "0" * 40, "dirty": False}}}
    (root / "plan.json").write_text(json.dumps(plan, indent=2))
    spec = [f"name: {sweep}", f"design: {design}", "base: experiments/shakespeare_char_llama2.yaml",
            f"seeds: {list(seeds)}", "axes:"] + [f"  {k}: [{', '.join(v)}]" for k, v in axes.items()]
    (root / "spec.yaml").write_text("\n".join(spec) + "\n")
    return root
