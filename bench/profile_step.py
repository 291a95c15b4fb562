"""Where a training step spends its time: torch.profiler over `bench/throughput.py`'s contestants.

    python bench/profile_step.py --arch llama --size 5M --dtype bf16       # ours, ours-plain and hf
    python bench/profile_step.py --arch gpt2 --size 20M --dtype fp32 --impls ours,hf --top 25

Builds the same models, batch and optimizer as the throughput benchmark (B=32, T=128, vocab 8000, Hugging Face's
initial weights copied into ours), warms each contestant up, then profiles `--steps` full training steps of each
(forward, loss, backward, AdamW) and prints, per contestant, the operators with the most self CPU time and the
step's time split into groups (matmuls, attention, norms, element-wise, loss, optimizer). Times are per step. The
profiler's own overhead inflates small kernels, so compare contestants within one run, and read wall times from
`bench/throughput.py`, not from here. `--out FILE` records the tables as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # noqa: E402

# operator name -> group, first match wins (aten names; autograd's backward nodes carry the forward's name)
GROUPS = (
    ("attention", ("scaled_dot_product", "flash_attention", "_CpuFlash", "attention")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "_softmax", "softmax", "_LinearCrossEntropy",
              "gather", "scatter")),
    ("norm", ("layer_norm", "RMSNorm", "vector_norm", "rsqrt", "linalg_vector_norm")),
    ("optimizer", ("_fused_adamw", "adamw", "Optimizer", "_foreach")),
    ("matmul", ("mm", "addmm", "bmm", "linear", "matmul")),
    ("copy / cast", ("copy_", "to_copy", "_to_copy", "clone", "contiguous", "cat", "empty", "zero_", "fill_")),
)


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "element-wise / other"


def profile_contestant(contestant, x, t, steps: int) -> tuple[list[dict], dict[str, float]]:
    """Top operators by self CPU time (ms per step) and the per-group split of one contestant's step."""
    for _ in range(2):
        contestant.step(x, t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            contestant.step(x, t)
    rows = []
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        self_ms = event.self_cpu_time_total / 1e3 / steps
        if self_ms <= 0:
            continue
        rows.append({"op": event.key, "self_ms": round(self_ms, 3), "calls": event.count // steps})
        groups[group_of(event.key)] += self_ms
    rows.sort(key=lambda r: -r["self_ms"])
    return rows, dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=tp.ARCHS, default="llama")
    ap.add_argument("--size", choices=tuple(tp.SIZES), default="5M")
    ap.add_argument("--dtype", choices=tp.DTYPES, default="bf16")
    ap.add_argument("--impls", default=",".join(tp.IMPLS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from study.run.environment import reuse_freed_memory

    malloc = reuse_freed_memory("cpu")  # as study's CPU training processes and bench/throughput.py's contestants run
    impls = args.impls.split(",")
    models, _ = tp.build_models(args.arch, args.size, impls, torch.device("cpu"))  # the CPU step (GPU: no profile)
    x = torch.randint(0, tp.VOCAB, (tp.BATCH, tp.SEQ))
    t = tp.shifted_targets(x)
    record = {"arch": args.arch, "size": args.size, "dtype": args.dtype, "threads": args.threads,
              "steps": args.steps, "cpu": tp.cpu_model(), "malloc": malloc, "contestants": {}}
    for impl in impls:
        contestant = tp.Contestant(impl, models[impl], "fused", bf16=args.dtype == "bf16")
        rows, groups = profile_contestant(contestant, x, t, args.steps)
        record["contestants"][impl] = {"total_self_ms": round(sum(groups.values()), 1),
                                       "groups_ms": {k: round(v, 1) for k, v in groups.items()}, "top": rows}
        print(f"\n{impl}: {sum(groups.values()):.1f} ms of self CPU time per step")
        print("  " + ", ".join(f"{k} {v:.1f}" for k, v in groups.items()))
        for row in rows[: args.top]:
            print(f"  {row['self_ms']:9.2f} ms  x{row['calls']:<4} {row['op']}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"recorded {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
