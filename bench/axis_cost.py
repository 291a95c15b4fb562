"""What each value of each design axis costs in time, measured so that a speed verdict reflects the idea, not our code.

For every registered value of every axis (`study.axes.AXES`: norm, norm_position, position, activation) plus attention
sharing (n_kv_heads: MHA, GQA, MQA) and sliding windows (a few `model.window` sizes), with only that field changed
from the default sweep's baseline (`experiments/ablation_base.yaml`: a 4-layer, 128-wide llama2-style decoder,
batch 16 x 128 tokens, character vocabulary), two times:

  isolated   forward + backward of the smallest piece that holds the axis: the norm module (norm), the FFN
             (activation), a one-layer stack with embeddings, position scheme, masks and final norm (the others);
  step       one full training step of the whole model: forward, fused cross-entropy, backward, fused AdamW step,
             zero_grad.

Each is reported as a ratio to the axis's baseline value (the first value listed below) measured in the same run:
contestants alternate a round at a time with the first one rotated, and the ratio is the median over rounds of
that round's ratio (time of the value / time of the baseline), so machine noise lands on all of them.

A third section times RMSNorm's kernels against LayerNorm (forward + backward, fp32 and bf16 autocast): today's
`RMSNorm` (its C++ CPU kernel, study/axes/kernels/rms_norm.cpp), its eager path (analytic backward), the plain
formula it replaced, `F.rms_norm`, and `F.layer_norm`; and each activation that declares a C++ kernel through it and
through its eager form, at bench/throughput.py's FFN shapes (ratio kernel / eager: above 1 means the kernel loses).

A fourth (`--attention`, skipped on a CPU without native bf16) times bf16 attention forward + backward at shapes of
the shipped experiments: SDPA as it is (its fused CPU kernel, bf16 backward), what `study.model.attention` runs (the
same forward; below 256 keys its own backward: batched GEMMs around two C++ passes), the same with the kernel's
float32 backward instead (what runs without a compiler, and what ran before the C++ backward), and SDPA in float32;
ratios to SDPA in bf16.

A fifth (`--loss`) times the output projection + cross-entropy, forward + backward, at bench/throughput.py's shapes:
the plain loss, and study.model.loss's fused one on eager ops and with its C++ pass; ratios to the plain loss.

    python bench/axis_cost.py                     # ~4-5 min on one AVX2 core; JSON to bench/results/
    python bench/axis_cost.py --rounds 3 --steps 1   # faster, noisier
    python bench/axis_cost.py --skip-axes --loss --threads 2   # the norm kernels and the loss
    python bench/axis_cost.py --quick             # smoke test: 1 round, 1 step, nothing written
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from study.axes import AXES, NORMS, default_d_ff  # noqa: E402
from study.axes.norm import RMSNorm, rms_norm_reference  # noqa: E402
from study.config.presets import preset  # noqa: E402
from study.model.ffn import FeedForward  # noqa: E402
from study.model.transformer import DecoderLM, Stack  # noqa: E402
from study.run.environment import bench_provenance, cpu_flags, cpu_model  # noqa: E402

BATCH, SEQ, VOCAB = 16, 128, 65  # the default sweep: 16 x 128 characters of Tiny Shakespeare (65 symbols)
BASE_YAML = ROOT / "experiments" / "ablation_base.yaml"
WINDOWS = (None, 64, 32, 16)  # global first (the baseline), then local spans
KERNEL_SHAPES = ((16, 128, 128), (8, 256, 512))
# (B, nh, n_kv, T, causal): Multi30k's batches (64 pairs of ~20 tokens, padded), the throughput benchmark's 5M and
# 20M Llama (32 x 128, GQA), the default sweep (16 x 128), longer contexts around the 256-key switch.
ATTENTION_SHAPES = ((64, 4, 4, 20, False), (32, 4, 2, 128, True), (32, 8, 4, 128, True), (16, 4, 4, 128, True),
                    (16, 8, 8, 255, True), (16, 8, 8, 256, True), (8, 8, 8, 512, True))


def base_config():
    model = dict(yaml.safe_load(BASE_YAML.read_text())["model"])
    return preset(model.pop("preset"), **model, vocab_size=VOCAB)


def axis_variants(base) -> dict[str, list[tuple[str, object]]]:
    """axis -> [(value label, config)], the baseline's value first; invalid combinations are skipped (printed)."""
    variants: dict[str, list[tuple[str, object]]] = {}
    for field, registry in AXES.items():
        values = sorted(registry.names(), key=lambda v: v != getattr(base, field))  # baseline first, then as registered
        changes = [(v, {field: v}) for v in values]
        if field == "activation":  # d_ff at each activation's own default, so the FFN keeps its parameter count
            changes = [(v, {field: v, "d_ff": default_d_ff(base.d_model, registry[v].gated)}) for v in values]
        variants[field] = _valid(base, field, changes)
    heads = base.n_heads
    sharing = [("mha", heads), ("gqa", heads // 2), ("mqa", 1)]
    variants["attention"] = _valid(base, "n_kv_heads", [(n, {"n_kv_heads": kv}) for n, kv in sharing])
    variants["window"] = _valid(base, "window", [("global" if w is None else f"local-{w}", {"window": w})
                                                 for w in WINDOWS])
    return variants


def _valid(base, field: str, changes: list[tuple[str, dict]]) -> list[tuple[str, object]]:
    out = []
    for label, change in changes:
        try:
            out.append((label, base.replace(**change)))
        except Exception as error:  # a value this baseline cannot take (the config lists why)
            print(f"  skip {field}={label}: {str(error).splitlines()[0]}")
    return out


def isolated_fn(axis: str, cfg) -> Callable[[], None]:
    """Forward + backward of the smallest module holding `axis`, on a batch of the default sweep's shape."""
    torch.manual_seed(0)
    if axis in ("norm", "activation"):
        module = NORMS[cfg.norm](cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias) if axis == "norm" else FeedForward(cfg)
        x = torch.randn(BATCH, SEQ, cfg.d_model, requires_grad=True)
        return lambda: module(x).sum().backward()
    embedding = torch.nn.Embedding(cfg.vocab_size, cfg.d_model)
    stack = Stack(cfg.replace(n_layers=1), 1, causal=True, cross=False, token_embedding=embedding)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    return lambda: stack(ids).sum().backward()


def step_fn(cfg) -> Callable[[], None]:
    """One training step of the whole model: forward, fused loss, backward, AdamW, zero_grad."""
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1))

    def step() -> None:
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_alternating(fns: dict[str, Callable[[], None]], rounds: int, steps: int, warmup: int = 1) -> dict:
    """Seconds per call of each fn, a round at a time with the first contestant rotated; ratios to the first key
    are the median of the per-round ratios."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            for _ in range(steps):
                fns[name]()
            seconds[name].append((time.perf_counter() - start) / steps)
    base = seconds[names[0]]
    return {n: {"ms": 1e3 * statistics.median(s), "ratio": statistics.median(a / b for a, b in zip(s, base)),
                "round_ratios": [round(a / b, 4) for a, b in zip(s, base)]} for n, s in seconds.items()}


@contextlib.contextmanager
def eager_rmsnorm():
    """RMSNormFunction on its eager path, forward and backward (what a GPU, torch.compile or a machine without a
    compiler runs)."""
    import study.axes.norm as norm_module

    kernel, norm_module._cpu_kernel = norm_module._cpu_kernel, lambda x: None
    try:
        yield
    finally:
        norm_module._cpu_kernel = kernel


def kernel_fns(shape: tuple[int, ...], autocast: bool) -> dict[str, Callable[[], None]]:
    """RMSNorm's candidate kernels and LayerNorm over the last dim of `shape`, forward + backward."""
    torch.manual_seed(0)
    d = shape[-1]
    x, dy = torch.randn(*shape, requires_grad=True), torch.randn(*shape)
    ours, layer_norm = RMSNorm(d), NORMS["layernorm"](d)  # both as the model calls them: modules
    weight = ours.weight
    candidates = {
        "layernorm (F.layer_norm, fused)": lambda: layer_norm(x),
        "rmsnorm (ours: C++ kernel)": lambda: ours(x),
        "rmsnorm (ours, eager: analytic backward)": lambda: ours(x),
        "rmsnorm (plain formula, before)": lambda: rms_norm_reference(x, weight, 1e-6),
        "rmsnorm (F.rms_norm)": lambda: F.rms_norm(x, (d,), weight, 1e-6),
    }

    def run(fn, eager: bool):
        def call():
            with eager_rmsnorm() if eager else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    y = fn()
                y.backward(dy)
        return call

    return {name: run(fn, "eager" in name) for name, fn in candidates.items()}


# (tokens, d_ff): bench/throughput.py's batch (32 x 128 tokens) at GPT-2 5M's and Llama 20M's FFN widths
ACTIVATION_SHAPES = ((4096, 1024), (4096, 1344))


def activation_fns(shape: tuple[int, int], autocast: bool) -> dict[str, tuple[torch.Tensor, dict[str, Callable]]]:
    """Per activation that declares a C++ CPU kernel: its input h, the FFN's hidden pre-activation (twice as wide
    for a gated unit), and forward + backward through its eager PyTorch form (`eager`) and through the kernel
    (`apply`)."""
    from study.axes import ACTIVATIONS

    torch.manual_seed(0)
    dtype = torch.bfloat16 if autocast else torch.float32  # the input projection's output dtype
    fns = {}
    for name in ACTIVATIONS.names():
        act = ACTIVATIONS[name]
        if act.cpu_kernel is None:
            continue
        h = torch.randn(shape[0], shape[1] * (2 if act.gated else 1), dtype=dtype, requires_grad=True)
        dy = torch.randn(shape[0], shape[1], dtype=dtype)
        fns[name] = (h, {"eager": lambda act=act, h=h, dy=dy: act.eager(h).backward(dy),
                         "C++ kernel": lambda act=act, h=h, dy=dy: act.apply(h).backward(dy)})
    return fns


def measure_activations(rounds: int, steps: int) -> dict:
    results = {}
    for shape in ACTIVATION_SHAPES:
        for autocast in (False, True):
            key = f"{'x'.join(map(str, shape))} {precision_label(autocast, 'bf16')}"
            rows = {}
            for name, (_, fns) in activation_fns(shape, autocast).items():
                timed = time_alternating(fns, rounds, 10 * steps)
                rows.update({f"{name} ({path})": t for path, t in timed.items()})
            print_table(f"activation kernels, forward + backward, {key} (ratios to the eager form)",
                        {n: {"fwd+bwd": t} for n, t in rows.items()}, ("fwd+bwd",))
            results[key] = rows
    return results


def attention_fns(b: int, nh: int, nkv: int, t: int, causal: bool) -> dict[str, Callable[[], None]]:
    """bf16 attention forward + backward, (B, nh, T, 64) queries: SDPA as it is, ours (`_sdpa`) with and without its
    C++ backward, SDPA in float32."""
    from study.model.attention import _sdpa

    torch.manual_seed(0)
    q = torch.randn(b, nh, t, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, nkv, t, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dy = torch.randn(b, nh, t, 64, dtype=torch.bfloat16)
    bias = None
    if not causal:  # padding: the last 20% of keys hidden in every other row
        bias = torch.zeros(b, 1, 1, t, dtype=torch.bfloat16)
        bias[::2, ..., int(0.8 * t):] = -1e9
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    dy32 = dy.float()  # cast once, as the inputs are: the float32 contestant's casts are not timed
    bias32 = None if bias is None else bias.float()
    gqa = nh != nkv

    def float32_backward():
        with eager_path("study.model.attention"):  # the backward is where the kernel would be picked
            _sdpa(q, k, v, bias, causal, 0.0, nh // nkv).backward(dy)

    candidates = {
        "sdpa bf16 (as it is)": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal,
                                                                       enable_gqa=gqa).backward(dy),
        "ours": lambda: _sdpa(q, k, v, bias, causal, 0.0, nh // nkv).backward(dy),
        "ours, float32 backward": float32_backward,
        "sdpa float32": lambda: F.scaled_dot_product_attention(q32, k32, v32, attn_mask=bias32, is_causal=causal,
                                                               enable_gqa=gqa).backward(dy32),
    }
    return candidates


def measure_attention(rounds: int, steps: int) -> dict:
    results = {}
    for shape in ATTENTION_SHAPES:
        key = "B{} nh{} nkv{} T{} {}".format(*shape[:4], "causal" if shape[4] else "padding")
        results[key] = timed_table(f"bf16 attention, forward + backward, {key} (ratios to SDPA bf16)",
                                   attention_fns(*shape), rounds, 5 * steps)
    return results


# (rows, d_model, vocab): bench/throughput.py's batch (32 x 128 tokens) at its 5M and 20M widths
LOSS_SHAPES = ((4096, 256, 8000), (4096, 512, 8000))


@contextlib.contextmanager
def eager_path(module_name: str):
    """`module_name` (study.model.loss, study.model.attention) without its C++ CPU kernels: the eager path a GPU,
    torch.compile or a machine without a compiler runs (for attention's bf16 backward, the fused kernel's float32
    one)."""
    module = importlib.import_module(module_name)
    kernel, module.eager_cpu_ops = module.eager_cpu_ops, lambda name, x: None
    try:
        yield
    finally:
        module.eager_cpu_ops = kernel


def loss_inputs(rows: int, d: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final hidden states h (rows, d), a vocabulary projection W (vocab, d), targets with each sequence's last
    position ignored (as the training steps do)."""
    torch.manual_seed(0)
    h = torch.randn(rows, d, requires_grad=True)
    w = (0.02 * torch.randn(vocab, d)).requires_grad_()
    t = torch.randint(0, vocab, (rows,))
    t[127::128] = -100
    return h, w, t


def loss_fns(inputs: tuple[torch.Tensor, ...], autocast: bool) -> dict[str, Callable[[], None]]:
    """Output projection + next-token cross-entropy, forward + backward: the plain formula (Hugging Face's loss),
    the fused chunked loss on eager ops, and the fused loss with its C++ pass (kernels/cross_entropy_grad.cpp)."""
    from study.model.loss import linear_cross_entropy

    h, w, t = inputs

    def run(loss_fn, eager: bool):
        def call():
            with eager_path("study.model.loss") if eager else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = loss_fn()
                loss.backward()
        return call

    return {
        "plain (F.linear, F.cross_entropy)": run(lambda: F.cross_entropy(F.linear(h, w).float(), t), False),
        "fused, eager ops": run(lambda: linear_cross_entropy(h, w, t), True),
        "fused, C++ pass (ours)": run(lambda: linear_cross_entropy(h, w, t), False),
    }


def measure_loss(rounds: int, steps: int) -> dict:
    """The loss tables: float32, and bf16 autocast where this CPU multiplies bf16 natively (emulated, its cells
    would take hours at about 1 GFLOP/s, as --attention's would; recorded as skipped)."""
    from study.model.precision import native_bf16

    results = {}
    for shape in LOSS_SHAPES:
        for autocast in (False, True):
            key = "{} rows, d {}, vocab {}, {}".format(*shape, precision_label(autocast))
            if autocast and not native_bf16("cpu"):
                results[key] = "skipped: this CPU emulates bf16"
                continue
            results[key] = timed_table(f"loss, forward + backward, {key} (ratios to the plain loss)",
                                       loss_fns(loss_inputs(*shape), autocast), rounds, steps)
    return results


def precision_label(autocast: bool, bf16: str = "bf16 autocast") -> str:
    """A table's precision, "(emulated)" where this CPU has no native bf16: those timings are of torch's emulation
    (about 100x slower matmuls on an AVX2 CPU), not of the kernels a bf16 run would use where bf16 is native."""
    from study.model.precision import native_bf16

    return "fp32" if not autocast else bf16 + ("" if native_bf16("cpu") else " (emulated)")


def machine(threads: int) -> dict:
    return {"cpu": cpu_model(), **cpu_flags(), **bench_provenance(), "threads": threads, "torch": torch.__version__,
            "python": platform.python_version()}


def print_table(title: str, rows: dict[str, dict], columns: tuple[str, ...]) -> None:
    print(f"\n{title}")
    print(f"  {'value':36s}" + "".join(f"{c + ' ms':>16s}{c + ' ratio':>16s}" for c in columns))
    for name, row in rows.items():
        print(f"  {name:36s}" + "".join(f"{row[c]['ms']:16.3f}{row[c]['ratio']:15.3f}x" for c in columns))


def timed_table(title: str, fns: dict[str, Callable[[], None]], rounds: int, calls: int) -> dict:
    """`time_alternating` of forward + backward callables, printed as one table."""
    timed = time_alternating(fns, rounds, calls)
    print_table(title, {n: {"fwd+bwd": t} for n, t in timed.items()}, ("fwd+bwd",))
    return timed


def measure_axes(rounds: int, steps: int) -> dict:
    base = base_config()
    results = {}
    for axis, variants in axis_variants(base).items():
        isolated = time_alternating({label: isolated_fn(axis, cfg) for label, cfg in variants}, rounds, 3 * steps)
        step = time_alternating({label: step_fn(cfg) for label, cfg in variants}, rounds, steps)
        rows = {label: {"isolated": isolated[label], "step": step[label]} for label, _ in variants}
        print_table(f"axis {axis} (baseline {variants[0][0]})", rows, ("isolated", "step"))
        results[axis] = rows
    return results


def measure_kernels(rounds: int, steps: int) -> dict:
    results = {}
    for shape in KERNEL_SHAPES:
        for autocast in (False, True):
            key = f"{'x'.join(map(str, shape))} {precision_label(autocast)}"
            results[key] = timed_table(f"norm kernels, forward + backward, {key} (ratios to LayerNorm)",
                                       kernel_fns(shape, autocast), rounds, 10 * steps)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (median of per-round ratios)")
    parser.add_argument("--steps", type=int, default=2, help="timed training steps per contestant per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on a shared machine)")
    parser.add_argument("--skip-axes", action="store_true",
                        help="only the kernels (norms, and attention with --attention)")
    parser.add_argument("--attention", action="store_true", help="also bf16 attention kernels (native bf16 only)")
    parser.add_argument("--loss", action="store_true", help="also the output projection + cross-entropy")
    parser.add_argument("--quick", action="store_true", help="1 round of 1 step; writes nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default bench/results/axis-cost-<date>.json)")
    args = parser.parse_args(argv)
    rounds, steps = (1, 1) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(args.threads)
    from study.run.environment import reuse_freed_memory

    info = machine(args.threads) | {"malloc": reuse_freed_memory("cpu")}  # as study's CPU training processes run
    print(f"machine: {info}")
    start = time.perf_counter()
    record = {"machine": info, "rounds": rounds, "steps": steps, "batch": [BATCH, SEQ], "vocab": VOCAB,
              "norm_kernels": measure_kernels(rounds, steps), "activation_kernels": measure_activations(rounds, steps)}
    if args.attention:
        from study.model.precision import native_bf16

        record["attention_kernels"] = (measure_attention(rounds, steps) if native_bf16("cpu")
                                       else "skipped: this CPU emulates bf16")
    if args.loss:
        record["loss"] = measure_loss(rounds, 3 * steps)
    if not args.skip_axes:
        record["axes"] = measure_axes(rounds, steps)
    record["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"\n{record['wall_s']} s")
    if not args.quick:
        from study.io import atomic_write_text, unused_path

        out = args.out or unused_path(ROOT / "bench" / "results" / f"axis-cost-{_dt.date.today().isoformat()}.json")
        atomic_write_text(out, json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
