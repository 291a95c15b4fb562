"""Training-step throughput and peak memory of our decoders against Hugging Face, on a CPU or a CUDA GPU.

One run measures, for each architecture (our `llama2` / `gpt2` presets against
`LlamaForCausalLM` / `GPT2LMHeadModel` with attn_implementation="sdpa"), size (5M, 20M) and
dtype (float32, bfloat16 autocast), the tokens per second of a full training step
(forward + next-token cross-entropy + backward + AdamW step) at B=32, T=128, vocab 8000, the
shapes of /work/shared/anchors/hf_throughput.py. Contestants:

  ours        our model, loss through `study.model.loss.linear_cross_entropy` (the output
              projection fused with the cross-entropy in row chunks; no (B*T, vocab) logits)
  ours-plain  our model, `F.cross_entropy` over the full float32 logits: the loss computation
              Hugging Face runs (`ForCausalLMLoss`), so ours-plain vs hf compares the bodies
  hf          the Hugging Face model called with `labels=`, its standard training path

Both models start from the same weights (Hugging Face's initialisation copied into ours with
`study.interop.hf.load_hf_weights`), and the run checks that parameter counts match and that
the logits and losses agree. All contestants use the same optimizer (AdamW, fused kernel when
torch has it; `--optimizer default` for the for-loop one). Steps alternate between
contestants, a round at a time with the starting contestant rotated, so machine noise hits all
of them; the reported tok/s is from the median step time (and the best step), the ratio is the
median of per-round ratios. On a CPU each contestant runs in a process of its own, as a user's
training does (`ContestantProcess` says what sharing one did), warms up `--warmup` steps, and at
each turn runs `--rewarm` untimed steps before its timed ones; each records the minor page faults
and system time of its timed steps (a step that allocates fresh memory pays the kernel for it).
Every contestant's process, and every memory probe, keeps the memory a step frees for the next
step to reuse, as study's CPU training processes do (`study.run.environment.reuse_freed_memory`);
`--malloc default` leaves glibc's thresholds, under which Hugging Face's larger temporaries are
mapped afresh every step (bench/README.md, "Freed memory kept for reuse").

Peak memory is measured per (contestant, arch, size, dtype) in a fresh subprocess: build the
model, optimizer and batch, read the resident set size (RSS), reset the kernel's high-water
mark (write 5 to /proc/self/clear_refs), run two training steps (the second one has the AdamW
state allocated), then read VmHWM. Reported: peak RSS minus the RSS before the steps, i.e.
activations + gradients + optimizer state + temporaries, as the OS saw them (allocator slack
included). Where clear_refs is not writable the probe falls back to ru_maxrss (noted).

FLOPs: `study.model.accounting.flops_per_token(cfg, T, training=True)`, i.e. per token
3 x (2 x N_matmul + 4 x L x d_attn x (T+1)/2): N_matmul = weights multiplied per token (the
output projection included, embedding lookups, biases and norms excluded); the attention term
counts QK^T and AV over the keys a causal query sees. The same figure serves both
implementations. It is shown beside this machine's square-GEMM rate measured in the same run.

On a GPU (`--device cuda`): float32 runs with TF32 matmuls on both sides (what `precision: 32-true` trains with,
`study.model.precision.enable_tf32`), a third size (110M, 12 layers of 768) joins the two, each round times 20 steps
per contestant, each step is timed between two `torch.cuda.synchronize()` calls, and peak memory is
`torch.cuda.max_memory_allocated()` over the steps minus what was allocated before them, in the same process (the
caching allocator's own count, so no subprocess is needed). The GEMM rate is a square matmul at 4096 and 8192.

    python bench/throughput.py                  # full run (~10 min on 2 cores), JSON to bench/results/
    python bench/throughput.py --device cuda    # the same contestants on the GPU (~3 min on an H200)
    python bench/throughput.py --quick          # smoke test
    python bench/throughput.py --sizes 5M --dtypes fp32 --archs llama
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from study.io import unused_path  # noqa: E402
from study.run.environment import bench_provenance, cpu_flags, cpu_model  # noqa: E402

VOCAB, SEQ, BATCH = 8000, 128, 32
SIZES = {
    "5M": dict(d=256, layers=4, heads=4, kv_heads=2),
    "20M": dict(d=512, layers=6, heads=8, kv_heads=4),
    "110M": dict(d=768, layers=12, heads=12, kv_heads=4),  # GPT-2 small's body; timed by default on a GPU only
}
ARCHS = ("llama", "gpt2")
DTYPES = ("fp32", "bf16")
IMPLS = ("ours", "ours-plain", "hf")
IGNORE = -100
LOSS_PATHS = {
    "ours": "study.model.loss.linear_cross_entropy(model.decoder(x), lm_head weight, shifted targets)",
    "ours-plain": "F.cross_entropy(model(x).float() over all B*T rows, shifted targets, ignore_index=-100)",
    "hf": "model(input_ids=x, labels=x).loss (ForCausalLMLoss: float upcast, shift, mean)",
    "compiled": "torch.compile(model), then F.cross_entropy on its logits (inductor fuses the loss)",
}
DEFAULT_STEPS = {"5M": 2, "20M": 1, "110M": 1}  # timed steps per contestant per round: the CPU run near 10 min
GPU_STEPS = 20  # a GPU step takes milliseconds: more steps per round, so each median is over enough of them


# --- models ---------------------------------------------------------------------------------------


def our_config(arch: str, size: str):
    from study.config import preset

    s = SIZES[size]
    common = dict(
        vocab_size=VOCAB, d_model=s["d"], n_layers=s["layers"], n_heads=s["heads"], max_seq_len=512, dropout=0.0
    )
    if arch == "llama":
        d_ff = int(8 * s["d"] / 3) // 64 * 64
        return preset("llama2", n_kv_heads=s["kv_heads"], d_ff=d_ff, tie_embeddings=True, **common)
    return preset("gpt2", d_ff=4 * s["d"], **common)


def hf_model(arch: str, size: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    s = SIZES[size]
    if arch == "llama":
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=s["d"], intermediate_size=int(8 * s["d"] / 3) // 64 * 64,
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
            max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5, attention_dropout=0.0,
            attn_implementation="sdpa",
        )
        return LlamaForCausalLM(cfg)
    # the anchor script leaves GPT-2's dropout at its 0.1 default; here every dropout is 0 on both sides
    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=s["d"], n_layer=s["layers"], n_head=s["heads"], n_positions=512,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(cfg)


def count_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def shifted_targets(x: torch.Tensor) -> torch.Tensor:
    """Next-token targets with the last position ignored, as Hugging Face shifts `labels`."""
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], IGNORE)], dim=1)


def make_loss_fn(impl: str, model, compile_: bool = False):
    """loss(x) for one contestant: the whole forward including its loss."""
    from study.model.loss import linear_cross_entropy

    if impl == "hf":
        fwd = torch.compile(model) if compile_ else model
        return lambda x, t: fwd(input_ids=x, labels=x).loss
    if impl == "ours-plain" or compile_:  # under torch.compile inductor fuses the plain loss itself
        fwd = torch.compile(model) if compile_ else model
        return lambda x, t: F.cross_entropy(fwd(x).float().view(-1, VOCAB), t.view(-1), ignore_index=IGNORE)
    head = model.lm_head.proj
    return lambda x, t: linear_cross_entropy(model.decoder(x), head.weight, t, bias=head.bias, ignore_index=IGNORE)


def make_optimizer(model, kind: str):
    params = list(model.parameters())
    if kind == "fused":
        try:
            return torch.optim.AdamW(params, lr=1e-4, fused=True), "AdamW(fused=True)"
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(params, lr=1e-4), "AdamW(default)"


class Contestant:
    def __init__(self, impl: str, model, optimizer: str, bf16: bool, compile_: bool = False):
        self.impl = impl
        self.model = model
        self.loss_fn = make_loss_fn(impl, model, compile_)
        self.opt, self.opt_name = make_optimizer(model, optimizer)
        self.bf16 = bf16
        self.times: list[float] = []

    def step(self, x: torch.Tensor, t: torch.Tensor) -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss_fn(x, t)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed_step(self, x: torch.Tensor, t: torch.Tensor) -> float:
        """Seconds for one step, the device's queue drained before and after (a CPU runs synchronously)."""
        synchronize(x.device)
        t0 = time.perf_counter()
        self.step(x, t)
        synchronize(x.device)
        return time.perf_counter() - t0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_models(arch: str, size: str, impls: list[str], device: torch.device) -> tuple[dict, dict]:
    """The Hugging Face model and our model(s), ours loaded with HF's initial weights."""
    from study.model import build_model

    torch.manual_seed(0)
    hf = hf_model(arch, size)
    cfg = our_config(arch, size)
    models = {}
    info = {"params_hf": count_params(hf), "weights_copied_from_hf": False}
    for impl in impls:
        if impl == "hf":
            models[impl] = hf
            continue
        ours = build_model(cfg)
        try:
            from study.interop.hf import load_hf_weights

            missing = load_hf_weights(ours, hf)
            info["weights_copied_from_hf"] = not missing
        except Exception as e:  # the interop layer is optional for the benchmark
            info["weights_copy_error"] = f"{type(e).__name__}: {e}"
        models[impl] = ours
    ours_any = next((m for k, m in models.items() if k != "hf"), None) or build_model(cfg)
    info["params_ours"] = count_params(ours_any)
    info["params_match"] = info["params_ours"] == info["params_hf"]
    return {k: m.to(device) for k, m in models.items()}, info


@torch.no_grad()
def equivalence(models: dict, x: torch.Tensor, t: torch.Tensor) -> dict:
    """Max |logit difference| ours vs HF and the three losses, float32, on a small batch."""
    out = {}
    hf = models.get("hf")
    ours = next((m for k, m in models.items() if k != "hf"), None)
    if hf is None or ours is None:
        return out
    lo, lh = ours(x), hf(input_ids=x).logits
    out["max_abs_logit_diff"] = float((lo - lh).abs().max())
    out["loss_hf"] = float(hf(input_ids=x, labels=x).loss)
    out["loss_ours_plain"] = float(F.cross_entropy(lo.float().view(-1, VOCAB), t.view(-1), ignore_index=IGNORE))
    with torch.enable_grad():
        from study.model.loss import linear_cross_entropy

        head = ours.lm_head.proj
        out["loss_ours_fused"] = float(linear_cross_entropy(ours.decoder(x), head.weight, t, bias=head.bias).detach())
    return out


# --- machine --------------------------------------------------------------------------------------


def gemm_rate(dtype: torch.dtype, n: int, reps: int = 3, device: torch.device = torch.device("cpu")) -> float:
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def machine_gemm(dtypes: list[str], device: torch.device) -> dict:
    """Best square-GEMM GFLOP/s per dtype (fp32 at 1024 and 2048; bf16 the same unless the first,
    small probe shows it emulated, in which case only 512 and 1024 are timed). On a GPU: 4096 and 8192, fp32 with
    TF32 when it is on, as the float32 training steps run."""
    out: dict = {}
    if device.type == "cuda":
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            out[name] = {n: round(gemm_rate(dtype, n, reps=5, device=device), 1) for n in (4096, 8192)}
        return out
    out["fp32"] = {n: round(gemm_rate(torch.float32, n), 1) for n in (1024, 2048)}
    # always timed (it decides whether bf16 runs); an emulated bf16 GEMM takes seconds at 1024
    probe = gemm_rate(torch.bfloat16, 512, reps=1)
    sizes = (1024, 2048) if probe > 20 else (1024,)
    out["bf16"] = {512: round(probe, 1)} | {n: round(gemm_rate(torch.bfloat16, n, reps=2), 1) for n in sizes}
    return out


def cpu_info() -> dict:
    info = {"machine": platform.machine(), "processor": platform.processor(), "model": cpu_model(),
            "isa": [flag for flag, present in cpu_flags().items() if present], "logical_cpus": os.cpu_count()}
    try:
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:
        pass
    return info


def load() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


# --- memory probe (runs in a subprocess) ----------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM")


def probe_model(impl: str, arch: str, size: str):
    """One contestant's model for a memory probe: the weights' values do not matter there, so no Hugging Face model
    is built (or freed) beside ours."""
    torch.manual_seed(0)
    if impl == "hf":
        return hf_model(arch, size)
    from study.model import build_model

    return build_model(our_config(arch, size))


def memory_probe(impl: str, arch: str, size: str, dtype: str, optimizer: str, steps: int) -> dict:
    c = Contestant(impl, probe_model(impl, arch, size), optimizer, bf16=dtype == "bf16")
    torch.manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    t = shifted_targets(x)
    gc.collect()
    base = _rss_bytes()
    method = "VmHWM after clear_refs"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        method = "ru_maxrss (high-water mark could not be reset; includes start-up)"
    for _ in range(steps):
        c.step(x, t)
    if method.startswith("VmHWM"):
        peak = _hwm_bytes()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mb = 2**20
    return {"base_rss_mb": base / mb, "peak_rss_mb": peak / mb, "step_peak_mb": (peak - base) / mb, "method": method}


def cuda_memory_probe(impl: str, arch: str, size: str, dtype: str, optimizer: str, steps: int) -> dict:
    """Peak bytes the caching allocator handed out over `steps` training steps, above what the model, optimizer and
    batch held before them (the allocator's exact count: no subprocess needed on a GPU)."""
    device = torch.device("cuda")
    model = probe_model(impl, arch, size).to(device)
    c = Contestant(impl, model, optimizer, bf16=dtype == "bf16")
    x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    t = shifted_targets(x)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(steps):
        c.step(x, t)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del c, model
    gc.collect()
    torch.cuda.empty_cache()
    mb = 2**20
    return {"base_rss_mb": base / mb, "peak_rss_mb": peak / mb, "step_peak_mb": (peak - base) / mb,
            "method": "torch.cuda.max_memory_allocated over the steps minus memory_allocated before them"}


def this_script(role: str, spec: str, args) -> list[str]:
    """The command that runs this file as a helper process (`--_probe` or `--_contestant`) with the run's options."""
    return [sys.executable, str(Path(__file__).resolve()), role, spec, "--threads", str(args.threads),
            "--optimizer", args.optimizer, "--malloc", args.malloc]


def run_probe(impl: str, arch: str, size: str, dtype: str, args) -> dict:
    if args.compile:  # the probes build eager models: their memory is not the compiled ones'
        return {"error": "not measured under --compile (the memory probe builds the eager model)"}
    if args.device == "cuda":
        return cuda_memory_probe(impl, arch, size, dtype, args.optimizer, args.probe_steps)
    cmd = this_script("--_probe", f"{impl},{arch},{size},{dtype}", args) + ["--probe-steps", str(args.probe_steps)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT))
    if res.returncode != 0:
        return {"error": (res.stderr or res.stdout)[-2000:]}
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["probe_wall_s"] = round(time.perf_counter() - t0, 1)
    return out


# --- throughput -----------------------------------------------------------------------------------


class ContestantProcess:
    """One contestant in a process of its own, stepped on request (`serve_contestant` is the other end). On a CPU a
    contestant sharing a process ran at a speed set by what else had used that heap: Hugging Face's GPT-2 5M float32
    step 4,713-4,896 tok/s alone, 5,441 after the Llama 20M cell; its Llama 20M 1,958-2,010 alone, 1,536 beside our
    two models (Xeon with AMX, 2026-11-26; its step faults in 0.5-2 GB of fresh pages, whose cost varies). A user
    trains one model per process, so each contestant gets one. Taking turns still costs a step that faults this much
    more than running alone does (bench/README.md, "Page faults"), so the rates are not those of a lone run."""

    def __init__(self, impl: str, arch: str, size: str, dtype: str, args):
        cmd = this_script("--_contestant", f"{impl},{arch},{size},{dtype}", args)
        cmd += ["--warmup", str(args.warmup), "--rewarm", str(args.rewarm)]
        self.proc = subprocess.Popen(cmd + (["--compile"] if args.compile else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
        self.impl = impl
        self.times: list[float] = []
        self.minor_faults, self.system_s = 0, 0.0  # over the timed steps: fresh pages the kernel mapped in
        self.opt_name = self._reply()["optimizer"]  # built and warmed up

    def _reply(self):
        for line in self.proc.stdout:
            if line.startswith(_REPLY):
                return json.loads(line[len(_REPLY):])
            sys.stdout.write(line)  # anything else the contestant printed
        raise RuntimeError(f"contestant {self.impl} exited with code {self.proc.wait()} (its output is above)")

    def timed_steps(self, n: int) -> list[float]:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        reply = self._reply()
        self.minor_faults += reply["minor_faults"]
        self.system_s += reply["system_s"]
        return reply["times"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


_REPLY = "@contestant "


def serve_contestant(spec: str, args) -> None:
    """The contestant's side of `ContestantProcess`: build it, warm it up, then time the steps asked for."""
    impl, arch, size, dtype = spec.split(",")
    models, _ = build_models(arch, size, [impl], torch.device("cpu"))
    torch.manual_seed(1)  # the batch `measure` draws
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    t = shifted_targets(x)
    c = Contestant(impl, models[impl], args.optimizer, dtype == "bf16", args.compile)
    for _ in range(args.warmup):
        c.step(x, t)
    print(_REPLY + json.dumps({"optimizer": c.opt_name}), flush=True)
    for line in sys.stdin:
        for _ in range(args.rewarm):
            c.step(x, t)
        before = resource.getrusage(resource.RUSAGE_SELF)
        times = [c.timed_step(x, t) for _ in range(int(line))]
        after = resource.getrusage(resource.RUSAGE_SELF)
        print(_REPLY + json.dumps({"times": times, "minor_faults": after.ru_minflt - before.ru_minflt,
                                   "system_s": after.ru_stime - before.ru_stime}), flush=True)


def start_contestants(models: dict, x: torch.Tensor, t: torch.Tensor, arch: str, size: str, dtype: str, args):
    """On a CPU one process per contestant (`ContestantProcess`); on a GPU all in this process (the caching
    allocator keeps no page-fault history, and a process per contestant would spend scarce device time starting)."""
    if args.device == "cpu":
        return [ContestantProcess(k, arch, size, dtype, args) for k in args.impls]
    contestants = [Contestant(k, models[k], args.optimizer, dtype == "bf16", args.compile) for k in args.impls]
    for c in contestants:
        for _ in range(args.warmup):
            c.step(x, t)
        c.timed_steps = lambda n, c=c: [c.timed_step(x, t) for _ in range(n)]
    return contestants


def time_rounds(contestants: list, rounds: int, steps: int) -> list[dict[str, float]]:
    """`rounds` rounds of `steps` timed steps per contestant, the first contestant rotating: median seconds each."""
    n = len(contestants)
    out: list[dict[str, float]] = []
    for r in range(rounds):
        this: dict[str, float] = {}
        for c in contestants[r % n:] + contestants[: r % n]:
            ts = c.timed_steps(steps)
            c.times += ts
            this[c.impl] = statistics.median(ts)
        out.append(this)
        line = "  ".join(f"{k} {BATCH * SEQ / v:,.0f} tok/s" for k, v in this.items())
        print(f"  round {r + 1}: {line}", flush=True)
    return out


def throughput_results(contestants: list, rounds: list[dict], fpt: float, peak_gemm: float) -> tuple[dict, dict]:
    """Per contestant: tok/s from the median and the best step, GFLOP/s; per pair with hf: the median ratio."""
    res = {}
    for c in contestants:
        med, best = statistics.median(c.times), min(c.times)
        tok = BATCH * SEQ / med
        res[c.impl] = {
            "tok_s": tok,
            "tok_s_best": BATCH * SEQ / best,
            "step_times_s": [round(v, 4) for v in c.times],
            "gflops": tok * fpt / 1e9,
            "gflops_frac_of_gemm": tok * fpt / 1e9 / peak_gemm,
        }
        if isinstance(c, ContestantProcess):  # what the step costs the kernel: fresh pages faulted in, system time
            res[c.impl]["minor_faults_per_step"] = round(c.minor_faults / len(c.times))
            res[c.impl]["system_s_per_step"] = round(c.system_s / len(c.times), 3)
    ratios = {}
    if "hf" in res:
        for k in res:
            if k != "hf":
                per_round = [rd["hf"] / rd[k] for rd in rounds]
                ratios[f"{k}/hf"] = {"median_of_rounds": statistics.median(per_round), "per_round": per_round,
                                     "best_step": res[k]["tok_s_best"] / res["hf"]["tok_s_best"]}
    return res, ratios


def measure(arch: str, size: str, dtype: str, args, gemm: dict) -> dict:
    from study.model.accounting import flops_per_token

    device = torch.device(args.device)
    models, info = build_models(arch, size, args.impls, device)
    torch.manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ)).to(device)
    t = shifted_targets(x)
    rec: dict = {"arch": arch, "size": size, "dtype": dtype, **info}
    if dtype == "fp32":
        rec["equivalence_fp32"] = equivalence(models, x[:4], t[:4])
    cfg = our_config(arch, size)
    fpt = flops_per_token(cfg, SEQ, training=True)
    rec["flops_per_token"] = fpt
    rec["n_matmul_params"] = (fpt / 3 - 4 * cfg.n_heads * cfg.resolved_head_dim * cfg.n_layers * (SEQ + 1) / 2) / 2
    rec["loss_paths"] = {k: LOSS_PATHS["compiled" if args.compile and k != "hf" else k] for k in args.impls}
    print(f"\n[{arch} {size} {dtype}] params ours={info['params_ours']:,} hf={info['params_hf']:,} "
          f"{'match' if info['params_match'] else 'MISMATCH'}; "
          f"weights copied from HF: {info['weights_copied_from_hf']}", flush=True)
    if rec.get("equivalence_fp32"):
        e = rec["equivalence_fp32"]
        print(f"  fp32 check: max|logits ours - hf| = {e['max_abs_logit_diff']:.2e}; loss hf {e['loss_hf']:.6f} "
              f"ours-plain {e['loss_ours_plain']:.6f} ours(fused) {e['loss_ours_fused']:.6f}", flush=True)
    if device.type == "cpu":
        del models  # each contestant builds its own, in its own process
        gc.collect()
        models = {}
    contestants = start_contestants(models, x, t, arch, size, dtype, args)
    rec["optimizer"] = contestants[0].opt_name
    steps = args.steps or (GPU_STEPS if device.type == "cuda" else DEFAULT_STEPS[size])
    rec["protocol"] = {"warmup_steps": args.warmup, "rounds": args.rounds, "steps_per_round": steps,
                       "threads": args.threads, "processes": "one per contestant" if device.type == "cpu" else "one"}
    rounds = time_rounds(contestants, args.rounds, steps)
    peak_gemm = max(gemm.get(dtype, {}).values() or [float("nan")])
    rec["contestants"], rec["throughput_ratios"] = throughput_results(contestants, rounds, fpt, peak_gemm)
    rec["rounds"] = rounds
    for c in contestants:
        if isinstance(c, ContestantProcess):
            c.close()
    del contestants, models
    gc.collect()
    if not args.no_memory:
        rec.update(memory_of(arch, size, dtype, args))
    return rec


def memory_of(arch: str, size: str, dtype: str, args) -> dict:
    mem = {impl: run_probe(impl, arch, size, dtype, args) for impl in args.impls}
    for impl, m in mem.items():
        if "error" in m:
            print(f"  memory probe {impl} failed: {m['error'][-300:]}", flush=True)
    out = {"memory": mem}
    if "hf" in mem and "step_peak_mb" in mem["hf"]:
        out["memory_ratios"] = {f"{k}/hf": mem[k]["step_peak_mb"] / mem["hf"]["step_peak_mb"]
                                for k in mem if k != "hf" and "step_peak_mb" in mem[k]}
    print("  peak memory over model+optimizer: " + "  ".join(
        f"{k} {v.get('step_peak_mb', float('nan')):,.0f} MB" for k, v in mem.items()), flush=True)
    return out


# --- report ---------------------------------------------------------------------------------------


def _ratio_text(ratio: dict) -> str:
    """The median of the per-round ratios, and their range where there are several: a cell's rounds spread by up to
    a factor of two on a busy machine, which a bare median hides."""
    rounds = ratio.get("per_round") or []
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{ratio['median_of_rounds']:.2f}x{spread}"


def table(records: list[dict], gemm: dict) -> str:
    impls = [k for k in IMPLS if any(k in r.get("contestants", {}) for r in records)]
    head = ["arch", "size", "dtype", "params"] + [f"{k} tok/s" for k in impls]
    head += [f"{k}/hf tok/s" for k in impls if k != "hf"]
    head += [f"{k} MB" for k in impls] + [f"{k}/hf MB" for k in impls if k != "hf"]
    head += [f"{k} GFLOP/s" for k in impls] + ["GEMM GFLOP/s"]
    rows = [head]
    notes = []
    for r in records:
        if "skipped" in r:
            notes.append(f"{r['arch']} {r['size']} {r['dtype']}: skipped, {r['skipped']}")
            continue
        c, mem = r["contestants"], r.get("memory", {})
        tr, mr = r.get("throughput_ratios", {}), r.get("memory_ratios", {})
        params = f"{r['params_ours'] / 1e6:.2f}M" + ("" if r["params_match"] else "(!)")
        row = [r["arch"], r["size"], r["dtype"], params]
        row += [f"{c[k]['tok_s']:,.0f}" for k in impls]
        row += [_ratio_text(tr[k + "/hf"]) if k + "/hf" in tr else "-" for k in impls if k != "hf"]
        row += [f"{mem.get(k, {}).get('step_peak_mb', float('nan')):,.0f}" for k in impls]
        row += [f"{mr[k + '/hf']:.2f}x" if k + "/hf" in mr else "-" for k in impls if k != "hf"]
        row += [f"{c[k]['gflops']:.1f} ({100 * c[k]['gflops_frac_of_gemm']:.0f}%)" for k in impls]
        row += [f"{max(gemm.get(r['dtype'], {}).values() or [float('nan')]):.1f}"]
        rows.append(row)
    width = max(len(x) for x in rows)
    rows = [x + [""] * (width - len(x)) for x in rows]
    w = [max(len(x[i]) for x in rows) for i in range(width)]
    lines = ["  ".join(v.rjust(w[i]) for i, v in enumerate(x)) for x in rows]
    lines.insert(1, "  ".join("-" * v for v in w))
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="1 round of 1 step per contestant (smoke test)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", default=None, help="default 5M,20M on a CPU, 5M,20M,110M on a GPU")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--archs", default="llama,gpt2")
    ap.add_argument("--impls", default=",".join(IMPLS), help="contestants, from " + ",".join(IMPLS))
    ap.add_argument("--rounds", type=int, default=None, help="default 3 on a CPU, 5 on a GPU")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per contestant per round (default 2 at 5M, 1 at 20M)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps per contestant first (a fresh process speeds up over its first steps)")
    ap.add_argument("--rewarm", type=int, default=1,
                    help="untimed steps a contestant in its own process runs at each turn before the timed ones")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--optimizer", choices=["fused", "default"], default="fused")
    ap.add_argument("--probe-steps", type=int, default=2)
    ap.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    ap.add_argument("--force-bf16", action="store_true",
                    help="run bf16 even where this CPU has no native bf16 matmul (very slow there)")
    ap.add_argument("--compile", action="store_true", help="torch.compile every contestant (ours uses the plain loss)")
    ap.add_argument("--malloc", choices=["reuse", "default"], default="reuse",
                    help="reuse: every contestant's process keeps the memory a step frees for the next, as study's CPU "
                         "training processes do (study.run.environment.reuse_freed_memory); default: glibc's own")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/throughput-<date>.json)")
    ap.add_argument("--_probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_contestant", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    if (args._contestant or args._probe) and args.malloc == "reuse":
        from study.run.environment import reuse_freed_memory

        reuse_freed_memory(args.device)
    if args._contestant:
        serve_contestant(args._contestant, args)
        return 0
    if args._probe:
        impl, arch, size, dtype = args._probe.split(",")
        print(json.dumps(memory_probe(impl, arch, size, dtype, args.optimizer, args.probe_steps)))
        return 0

    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    args.sizes = args.sizes or ("5M,20M,110M" if on_gpu else "5M,20M")
    args.rounds = args.rounds or (5 if on_gpu else 3)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 1, 1
    args.impls = [k.strip() for k in args.impls.split(",") if k.strip()]
    sizes = [s.strip() for s in args.sizes.split(",")]
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    archs = [a.strip() for a in args.archs.split(",")]
    choices = (
        ("sizes", sizes, SIZES), ("dtypes", dtypes, DTYPES), ("archs", archs, ARCHS), ("impls", args.impls, IMPLS)
    )
    for name, vals, valid in choices:
        bad = [v for v in vals if v not in valid]
        if bad:
            ap.error(f"--{name}: unknown {bad}; valid: {list(valid)}")

    import transformers

    t_start = time.perf_counter()
    now = _dt.datetime.now().astimezone()
    env = {
        "date": now.isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "cpu": cpu_info(),
        "loadavg_start": load(),
        "hostname": platform.node(),
        "device": args.device,
        "malloc": args.malloc,  # the same in every contestant's process and memory probe
        **bench_provenance(on_cpu=not on_gpu),
    }
    if on_gpu:
        from study.model.precision import enable_tf32

        env["gpu"] = {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                      "cuda": torch.version.cuda, "tf32_matmul_for_fp32": enable_tf32("cuda")}
        print(f"GPU {env['gpu']}", flush=True)
    print(f"torch {env['torch']}, transformers {env['transformers']}, {args.threads} threads, "
          f"CPU {env['cpu'].get('model', '?')} {env['cpu'].get('isa', '')}, load {env['loadavg_start']}", flush=True)
    device = torch.device(args.device)
    gemm = machine_gemm(dtypes, device)
    print(f"square GEMM GFLOP/s: {gemm}", flush=True)
    bf16_native = max(gemm["bf16"].values()) >= 0.5 * max(gemm["fp32"].values())
    env["bf16_native_matmul"] = bf16_native

    suffix = "-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-") if on_gpu else ""
    # (the default name is never an earlier record's: this run rewrites its own file after every cell)
    out = Path(args.out) if args.out else unused_path(ROOT / "bench" / "results" / f"throughput-{now:%Y-%m-%d}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    gemm_record = {"start": gemm}

    def save(records: list, complete: bool) -> float:
        wall = time.perf_counter() - t_start
        payload = {
            "env": env,
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "shape": {"batch": BATCH, "seq_len": SEQ, "vocab": VOCAB, "sizes": SIZES},
            "gemm_gflops": gemm_record,
            "flops_formula": "study.model.accounting.flops_per_token(cfg, T, training=True) = 3 * (2 * N_matmul + "
                             "4 * L * n_heads * head_dim * (T + 1) / 2) per token; tokens per step = B * T",
            "memory_method": (
                "torch.cuda.max_memory_allocated over the training steps minus memory_allocated before them" if on_gpu
                else "fresh subprocess per contestant: RSS after building model + optimizer + batch, then the kernel "
                     "high-water mark (VmHWM, reset via /proc/self/clear_refs) over the training steps; "
                     "step_peak_mb = peak - base"),
            "complete": complete,  # false: the run stopped before its last cell
            "records": records,
            "wall_s": wall,
        }
        partial = out.with_suffix(".partial")
        partial.write_text(json.dumps(payload, indent=1, default=str))
        partial.replace(out)
        return wall

    records = []
    for dtype in dtypes:
        for arch in archs:
            for size in sizes:
                if dtype == "bf16" and not bf16_native and not args.force_bf16:
                    reason = (f"no native bf16 matmul on this CPU (bf16 GEMM {max(gemm['bf16'].values()):.1f} vs fp32 "
                              f"{max(gemm['fp32'].values()):.1f} GFLOP/s); --force-bf16 runs it anyway")
                    print(f"\n[{arch} {size} bf16] skipped: {reason}", flush=True)
                    records.append({"arch": arch, "size": size, "dtype": dtype, "skipped": reason})
                    continue
                records.append(measure(arch, size, dtype, args, gemm))
                save(records, complete=False)  # a run stopped by a lease's time limit keeps the cells it measured
    n_end = 8192 if on_gpu else 2048
    gemm_record["end"] = {"fp32": {n_end: round(gemm_rate(torch.float32, n_end, device=device), 1)}}
    env["loadavg_end"] = load()
    wall = save(records, complete=True)  # before the table: a table bug never costs the run
    print("\n" + table(records, gemm))
    memory_note = ("peak CUDA allocation" if on_gpu else "peak RSS") + " over the model+optimizer baseline"
    print(f"\ntok/s from the median step; ratios = median over rounds of per-round ratios; MB = {memory_note} "
          f"({args.probe_steps} steps); GFLOP/s from "
          f"study.model.accounting.flops_per_token (6 x matmul weights + causal attention), % of the best square GEMM "
          f"of that dtype. Optimizer: {next((r['optimizer'] for r in records if 'optimizer' in r), '-')}. "
          f"Wall {wall / 60:.1f} min.", flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
