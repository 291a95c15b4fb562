"""What the GPU path promises, checked on a CUDA device (skipped where torch sees none; CI has none).

- Every axis value computes the same function on the GPU as on the CPU, and none of them makes SDPA fall back to its
  math kernel, which materialises the (B, H, T, T) scores: forward and backward run with the math kernel disabled,
  and the profiler names the kernel each one ran (docs/model.md, "Attention kernels on a GPU").
- A training step makes no synchronizing CUDA call except at logging steps: CUDA's own sync debug mode watches
  forward, backward and what follows in every step of a real run; inside backward only what torch's own embedding
  backward does on the build is allowed, measured beside it (none on torch 2.11). tests/test_step_ledger.py counts
  the same reads on a CPU, where nothing waits.
  Under 16-mixed the GradScaler's overflow read is the one allowed per step (torch's, documented).
- A float32 run trains its matmuls in TF32 and says so in env.json.
- A run told `accelerator: cpu` on a GPU machine opens no CUDA context (it would take GPU memory for nothing).
- A killed run resumes its CUDA dropout stream from its checkpoint: it logs the uninterrupted run's losses.

Set STUDY_GPU_RECORD to a folder to have the kernel table and the syncs seen written there as JSON; the H200 runs are
in bench/results/gpu-2026-11-26/, gpu-2026-11-27/ and gpu-2026-11-28/ (bench/gpu_lease.sh runs this file with the
other GPU checks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from study.config import preset
from study.model import build_model
from study.tasks.lm import LanguageModelling, LMDataModule, LMModule
from tests.test_lm_task import column_by_step, kill_during_step_9, make_cfg, read_csv, run, write_corpus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB, B, T = 256, 4, 61  # an odd length: real batches are not multiples of 8, which the kernels pad for
SMALL = dict(vocab_size=VOCAB, d_model=128, n_heads=4, d_ff=256, max_seq_len=2 * T, dropout=0.0)
NON_MATH = [getattr(SDPBackend, k) for k in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
            if hasattr(SDPBackend, k)]

# name: (preset, overrides, what the batch has)
CASES = {
    "decoder, rope, causal": ("llama2", dict(n_layers=2, n_kv_heads=4), "causal"),
    "decoder, rope, GQA 4:2, causal": ("llama2", dict(n_layers=2, n_kv_heads=2), "causal"),
    "decoder, MQA, causal": ("llama2", dict(n_layers=2, n_kv_heads=1), "causal"),
    "decoder, learned, padded": ("gpt2", dict(n_layers=2), "padded"),
    "decoder, sliding window 16": ("mistral", dict(n_layers=2, n_kv_heads=4, window=16), "causal"),
    "decoder, window 16, GQA 4:2": ("mistral", dict(n_layers=2, n_kv_heads=2, window=16), "causal"),
    "decoder, alibi": ("llama2", dict(n_layers=2, n_kv_heads=4, position="alibi"), "causal"),
    "decoder, t5 bias": ("llama2", dict(n_layers=2, n_kv_heads=4, position="t5_bias"), "causal"),
    "decoder, attention dropout 0.1": ("gpt2", dict(n_layers=2, attention_dropout=0.1), "causal"),
    "encoder (BERT), padded": ("bert", dict(n_layers=2), "padded"),
    "encoder-decoder (Vaswani), padded": ("vaswani", dict(n_layers=2, n_encoder_layers=2), "seq2seq"),
    "encoder-decoder (T5), padded": ("t5", dict(n_layers=2, n_encoder_layers=2), "seq2seq"),
}


def _batch(device) -> dict:
    """Token ids (B, T) and a padding mask (B, T), True for real tokens (rows of 61, 52, 31 and 5 tokens)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (B, T), generator=g)
    lengths = torch.tensor([T, T - 9, T - 30, 5])
    pad = torch.arange(T)[None] < lengths[:, None]
    return {"ids": ids.to(device), "pad": pad.to(device)}


def _loss(model, kind: str, batch: dict) -> torch.Tensor:
    ids, pad = batch["ids"], batch["pad"]
    if kind == "causal":
        return model(ids).float().square().mean()
    if kind == "padded" and hasattr(model, "mlm_logits"):
        return model.mlm_logits(model(ids, padding_mask=pad)).float().square().mean()
    if kind == "padded":
        return model(ids, padding_mask=pad).float().square().mean()
    return model(ids, ids.flip(1), src_padding_mask=pad).float().square().mean()  # seq2seq


def _sdpa_ops(model, kind: str, batch: dict, bf16: bool) -> set[str]:
    """The SDPA operators a forward + backward dispatched to, with the math kernel disabled."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof, sdpa_kernel(NON_MATH):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = _loss(model, kind, batch)
        loss.backward()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key and "backward" not in e.key}


def _record(name: str, payload) -> None:
    folder = os.environ.get("STUDY_GPU_RECORD")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_text(json.dumps(payload, indent=1, default=str) + "\n")


KERNELS: dict[str, dict[str, list[str]]] = {}


class _no_tf32:
    """Float32 matmuls in float32 (a float32 run turns TF32 on for the whole process)."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_every_axis_value_runs_without_the_math_kernel_and_matches_the_cpu(case, precision):
    name, overrides, kind = CASES[case]
    torch.manual_seed(0)
    model = build_model(preset(name, **SMALL, **overrides)).eval()  # eval: no dropout in the comparison
    with torch.no_grad():
        reference = _loss(model.double(), kind, _batch("cpu")).item()
    model = model.float().cuda()
    with torch.no_grad(), _no_tf32(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        got = _loss(model, kind, _batch("cuda")).item()
    tolerance = 2e-2 if precision == "bf16" else 1e-4
    assert abs(got - reference) <= tolerance * abs(reference), (got, reference)

    ops = _sdpa_ops(model.train(), kind, _batch("cuda"), precision == "bf16")
    KERNELS.setdefault(case, {})[precision] = sorted(ops)
    _record("sdpa_kernels.json", KERNELS)
    assert ops and not any("math" in op for op in ops), ops


# --- no synchronizing CUDA call between logging steps ---------------------------------------------------------


SYNC = "synchroniz"  # CUDA's sync debug mode warns "called a synchronizing CUDA operation"


class WatchesSyncs(LMModule):
    """Turns on CUDA's sync debug mode from the start of a training step to the end of its on_train_batch_end and
    keeps, per step, where each synchronizing call came from, in three phases: forward (to on_before_backward),
    backward (the autograd engine replays its threads' warnings when backward returns) and after (clipping, the
    optimizer, weight averaging, the callbacks and this module's hooks)."""

    syncs_by_step: dict[int, dict[str, list[str]]] = {}

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self._step, self._marks = int(self.global_step), []
        self._catcher = warnings.catch_warnings(record=True)
        self._seen = self._catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_before_backward(self, loss):
        super().on_before_backward(loss)
        self._marks.append(len(self._seen))

    def on_after_backward(self):
        super().on_after_backward()
        self._marks.append(len(self._seen))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        torch.cuda.set_sync_debug_mode("default")
        self._catcher.__exit__(None, None, None)
        where = [f"{Path(w.filename).name}:{w.lineno}" if SYNC in str(w.message) else None for w in self._seen]
        a, b = self._marks
        phases = {"forward": where[:a], "backward": where[a:b], "after": where[b:]}
        WatchesSyncs.syncs_by_step[self._step] = {k: [w for w in v if w] for k, v in phases.items()}


def _syncs(fn) -> int:
    """Synchronizing CUDA calls made by fn()."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC in str(w.message) for w in seen)


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        grad.sum().item()
        return grad * 2


def test_the_sync_detector_sees_a_synchronizing_call_in_forward_and_in_backward():
    x = torch.ones(3, device="cuda", requires_grad=True)
    assert _syncs(lambda: x.sum().item()) >= 1
    assert _syncs(lambda: _ReadsInBackward.apply(x).sum().backward()) >= 1


def _embedding_backward_syncs() -> int:
    """Synchronizing calls in one backward of torch's own nn.Embedding on this build (not code of ours)."""
    table = torch.nn.Embedding(VOCAB, 32).cuda()
    out = table(torch.randint(0, VOCAB, (8, 16), device="cuda")).sum()
    torch.cuda.synchronize()
    return _syncs(out.backward)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_a_gpu_training_step_synchronizes_only_at_logging_steps(tmp_path, monkeypatch, precision):
    """Under 16-mixed one read per step is torch's, not ours: the GradScaler asks whether the step overflowed
    (`found_inf`) to decide whether to skip it, with the AdamW unfused so that gradients are unscaled before they are
    clipped (docs/experiments.md). bf16-mixed and 32-true need no scaler."""
    write_corpus(tmp_path / "data")
    corpus = {"root": tmp_path, "data": tmp_path / "data", "cache": tmp_path / "cache"}
    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, WatchesSyncs))
    WatchesSyncs.syncs_by_step = {}
    cfg = make_cfg(train={"max_steps": 12, "log_every": 4, "grad_norm_every": 4, "eval_every": 50,
                          "checkpoint_every": 50, "grad_clip": 1.0, "precision": precision, "progress_bar": True,
                          "ema_decay": 0.99, "accelerator": "gpu"})
    metrics = run(corpus, cfg, f"syncs-{precision}")
    per_embedding = _embedding_backward_syncs()
    embeddings = sum(isinstance(m, torch.nn.Embedding) for m in build_model(cfg.model).modules())
    _record(f"syncs_{precision}.json", {"torch_embedding_backward_syncs": per_embedding, "embeddings": embeddings,
                                        "by_step": WatchesSyncs.syncs_by_step})
    assert metrics["status"] == "completed"
    assert sorted(WatchesSyncs.syncs_by_step) == list(range(12))
    logging_steps = {s for s in range(12) if (s + 1) % 4 == 0 or s % 4 == 0}
    quiet = {s: v for s, v in WatchesSyncs.syncs_by_step.items() if s not in logging_steps}
    # ours and Lightning's: none; inside backward: only what torch's own embedding backward does on this build
    scaler_reads = 1 if precision == "16-mixed" else 0
    assert quiet and all(v["forward"] == [] for v in quiet.values()), quiet
    assert all(len(v["after"]) == scaler_reads and all("grad_scaler" in w for w in v["after"])
               for v in quiet.values()), quiet
    assert all(len(v["backward"]) == per_embedding * embeddings for v in quiet.values()), quiet
    env = json.loads((tmp_path / f"syncs-{precision}" / "env.json").read_text())
    assert env["device"] == torch.cuda.get_device_name(0)
    if precision == "32-true" and torch.cuda.get_device_capability() >= (8, 0):
        assert env["tf32_matmul"] is True


def test_bf16_training_on_the_gpu_matches_a_float32_reference_loss():
    """One bf16 autocast step of the fused loss on the GPU stays near the float64 loss of the same weights."""
    torch.manual_seed(0)
    model = build_model(preset("llama2", **SMALL, n_layers=2, n_kv_heads=2))
    ids = torch.randint(0, VOCAB, (B, T))
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    with torch.no_grad():
        reference = F.cross_entropy(model.double()(ids).view(-1, VOCAB), targets.view(-1), ignore_index=-100).item()
    model = model.float().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model.loss(ids.cuda(), targets.cuda())
    loss.backward()
    assert abs(loss.item() - reference) < 2e-2 * reference
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_beam_search_on_the_gpu_returns_the_cpu_hypotheses(n_kv_heads):
    """The decode path's GPU pieces (the time-major KV cache's in-place appends and row gathers, cross-attention with
    one memory row per sentence, the eager candidate selection) return the hypotheses the CPU path returns, in
    float32 with TF32 off; wide weights keep logits far from ties."""
    from study.model.generate import beam_search

    torch.manual_seed(0)
    cfg = preset("vaswani", **SMALL, n_layers=2, n_encoder_layers=2, n_kv_heads=n_kv_heads, init_std=0.15)
    model = build_model(cfg).eval()
    src = torch.randint(3, VOCAB, (6, 9))
    src[2, 5:] = 0
    kw = dict(bos=1, eos=2, beam_size=4, max_len_a=1.0, max_len_b=4)
    cpu = beam_search(model, src, src != 0, **kw)
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        gpu = beam_search(model.cuda(), src.cuda(), (src != 0).cuda(), **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    assert gpu == cpu


def _resume_gaps(tmp_path, monkeypatch, accelerator: str, rng_module) -> tuple[float, float]:
    """The largest train-loss difference over steps 6-11 between an uninterrupted 12-step run with dropout and (a) the
    same run killed during step 9 and resumed from its step-6 checkpoint, (b) that resume with `rng_module.set_rng_state`
    (torch's or torch.cuda's) made to do nothing, so the stream is not restored."""
    write_corpus(tmp_path / "data")
    corpus = {"root": tmp_path, "data": tmp_path / "data", "cache": tmp_path / "cache"}
    cfg = make_cfg(model={"dropout": 0.1, "attention_dropout": 0.1},
                   train={"accelerator": accelerator, "precision": "32-true", "log_every": 1})
    run(corpus, cfg, "whole")
    kill_during_step_9(corpus, cfg, "resumed", monkeypatch)
    run(corpus, cfg, "resumed")
    kill_during_step_9(corpus, cfg, "stream-not-restored", monkeypatch)
    with monkeypatch.context() as mp:
        mp.setattr(rng_module, "set_rng_state", lambda *a, **k: None)
        run(corpus, cfg, "stream-not-restored")

    def losses(name):
        rows = column_by_step(read_csv(tmp_path / name / "logs" / "metrics.csv"), "train/loss")
        return {s: float(v) for s, v in rows.items() if s >= 6}

    whole = losses("whole")
    assert sorted(whole) == list(range(6, 12))
    return tuple(max(abs(losses(name)[s] - whole[s]) for s in whole) for name in ("resumed", "stream-not-restored"))


def test_a_killed_gpu_run_resumes_the_cuda_dropout_stream_it_saved(tmp_path, monkeypatch):
    """Dropout on a GPU draws from the CUDA generator, which a checkpoint saves beside the CPU one: a run killed after
    its step-6 checkpoint and run again logs the uninterrupted run's losses at steps 6-11 (up to GPU float rounding),
    where the same resume with the CUDA stream left unrestored departs from them by far more."""
    resumed, unrestored = _resume_gaps(tmp_path, monkeypatch, "gpu", torch.cuda)
    _record("resume_gaps.json", {"resumed": resumed, "cuda_stream_not_restored": unrestored})
    assert resumed <= 1e-4 and unrestored > 100 * max(resumed, 1e-6), (resumed, unrestored)


CPU_RUN = """
import json, subprocess, sys, torch
from pathlib import Path
from study.run import run_experiment
from tests.test_lm_task import make_cfg, write_corpus

def used_mib():  # the whole GPU's, as nvidia-smi counts it: a context this process opens shows here
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])

root = Path(sys.argv[1])
write_corpus(root / "data")
seen = {"before": used_mib()}
cfg = make_cfg(train={"accelerator": "cpu", "max_steps": 12, "checkpoint_every": 6, "eval_every": 6})
seen["status"] = run_experiment(cfg, root / "run", data_dir=root / "data", cache_dir=root / "cache")["status"]
seen["after_run"], seen["cuda_initialized_after_run"] = used_mib(), torch.cuda.is_initialized()
torch.cuda.get_rng_state_all()  # what Lightning's isolate_rng asks for where torch sees a GPU
seen["after_get_rng_state_all"] = used_mib()
torch.zeros(1, device="cuda")  # a context for certain: the measure sees one
seen["after_a_cuda_tensor"] = used_mib()
print(json.dumps(seen))
"""


def test_a_cpu_run_on_a_gpu_machine_takes_no_gpu_memory(tmp_path):
    """A run told `accelerator: cpu` (a CPU sweep beside GPU trials, say) opens no CUDA context: in a fresh process it
    trains, checkpoints, evaluates and writes its record, and the GPU's used memory (nvidia-smi's) has not grown,
    where the same process's first CUDA tensor grows it by a context's worth."""
    out = subprocess.run([sys.executable, "-c", CPU_RUN, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    _record("cpu_run_gpu_memory_mib.json", seen)
    assert seen["status"] == "completed"
    assert seen["after_a_cuda_tensor"] - seen["after_run"] > 100, seen  # the measure sees a context
    assert seen["after_run"] - seen["before"] < 50, seen
