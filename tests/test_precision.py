"""Mixed precision. `train.precision: auto` is bf16-mixed only where the hardware multiplies bf16 natively, and a run
records what it resolved to. A bf16-mixed run of every task family trains with gradient clipping (the fused AdamW
under autocast) and evaluates or decodes batch after batch under autocast. Tiny models: where bf16 is not native it
is emulated, slowly but correctly."""

from __future__ import annotations

import copy
import json
import math
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from study.axes import ACTIVATIONS
from study.config import ConfigError, ExperimentConfig
from study.model.accounting import kv_cache_bytes_per_token
from study.model.precision import resolve_precision
from study.run import run_experiment
from study.run.environment import CPU_MALLOC
from test_glue_task import glue_cfg, write_glue
from test_lm_task import make_cfg as lm_cfg
from test_lm_task import write_corpus
from test_pretrain_task import BASE as PRETRAIN_BASE
from test_pretrain_task import write_wikitext
from test_translation_task import config as translation_cfg
from test_translation_task import write_multi30k

pytestmark = pytest.mark.usefixtures("offline_hub", "one_torch_thread")


def _hardware(monkeypatch, *, cuda: bool = False, cuda_bf16: bool = False, avx512_bf16: bool = False,
              amx: bool = False) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    # torch's default, including_emulation=True, also says yes on a pre-Ampere GPU (it can store bf16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: cuda_bf16 or including_emulation)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)


def test_auto_is_bf16_mixed_only_where_bf16_is_native(monkeypatch):
    _hardware(monkeypatch)  # an AVX2 CPU: bf16 matmuls are emulated, ~100x slower than float32
    assert resolve_precision("auto") == "32-true"
    _hardware(monkeypatch, avx512_bf16=True)
    assert resolve_precision("auto") == "bf16-mixed"
    assert resolve_precision("auto", "cpu") == "bf16-mixed"
    _hardware(monkeypatch, amx=True)
    assert resolve_precision("auto") == "bf16-mixed"
    assert resolve_precision("auto", "mps") == "32-true"
    _hardware(monkeypatch, cuda=True, cuda_bf16=False, avx512_bf16=True)  # a pre-Ampere GPU on a bf16 CPU
    assert resolve_precision("auto") == "32-true"
    assert resolve_precision("auto", "cpu") == "bf16-mixed"  # the run is told to train on the CPU
    _hardware(monkeypatch, cuda=True, cuda_bf16=True)
    assert resolve_precision("auto", "gpu") == "bf16-mixed"
    for explicit in ("32-true", "bf16-mixed", "16-mixed", "bf16-true"):
        assert resolve_precision(explicit) == explicit


def test_16_mixed_on_a_cpu_is_recorded_as_the_bf16_lightning_runs(monkeypatch):
    _hardware(monkeypatch)
    assert resolve_precision("16-mixed") == "bf16-mixed"
    assert resolve_precision("16-mixed", "cpu") == "bf16-mixed"
    _hardware(monkeypatch, cuda=True, cuda_bf16=True)
    assert resolve_precision("16-mixed") == "16-mixed"


def test_an_unknown_precision_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"train\.precision.*auto"):
        lm_cfg(train={"precision": "fp8"})


@pytest.mark.parametrize("native", [False, True])
def test_a_run_records_what_auto_resolved_to(native, tmp_path, monkeypatch):
    _hardware(monkeypatch, avx512_bf16=native)
    write_corpus(tmp_path / "data")
    cfg = lm_cfg(model={"n_layers": 1}, train={"precision": "auto", "max_steps": 2, "eval_every": 2})
    m = run_experiment(cfg, tmp_path / "run", data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    expected = "bf16-mixed" if native else "32-true"
    assert m["status"] == "completed"
    assert ExperimentConfig.from_yaml((tmp_path / "run" / "config.yaml").read_text()).train.precision == expected
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["precision"] == expected
    if platform.libc_ver()[0] == "glibc":  # the process keeps what a step frees for the next (reuse_freed_memory)
        assert env["malloc"] == CPU_MALLOC
    resolved = ExperimentConfig.from_yaml((tmp_path / "run" / "config.yaml").read_text())
    assert m["cost"]["kv_cache_bytes_per_token"] == kv_cache_bytes_per_token(resolved.model, 2 if native else 4)
    # the same config run again on the same machine finds its finished run
    assert run_experiment(cfg, tmp_path / "run", data_dir=tmp_path / "data", cache_dir=tmp_path / "cache") == m


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's /proc/cpuinfo")
def test_a_run_names_the_cpu_kind_its_numbers_come_from():
    """Speeds differ several-fold between the CPU kinds this project meets (AVX2 only, AVX-512 BF16, AMX), so env.json
    names the CPU model and its instruction sets; the bf16 one agrees with torch's own check."""
    from study.run.environment import CPU_FLAGS, snapshot

    env = snapshot()
    assert env["cpu_model"]
    assert set(env["cpu_flags"]) == set(CPU_FLAGS)
    assert env["cpu_flags"]["avx512_bf16"] == torch.cpu._is_avx512_bf16_supported()


_STEPS_FAULTS = """
import resource, sys, torch
from study.run.environment import reuse_freed_memory
print(reuse_freed_memory(sys.argv[1]))
x = torch.ones(1 << 20)  # 4 MiB


def step():  # activations of a few sizes, all freed by the step's end: 64, 12, 4, 48 and 64 MiB
    return sum(t.sum() for t in [x.repeat(n) for n in (16, 3, 1, 12, 16)])


for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="sets glibc's malloc thresholds")
@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_a_cpu_training_process_reuses_the_memory_a_step_freed(accelerator):
    """glibc maps a large block afresh at each allocation, so each CPU training step faulted its activations' pages
    in again (bench/README.md, "Freed memory kept for reuse"); a CPU training process keeps freed memory instead, and
    later steps fault few (a block that no freed hole fits yet still faults). GPU runs keep glibc's defaults: host
    memory is not their step's."""
    out = subprocess.run([sys.executable, "-c", _STEPS_FAULTS, accelerator], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    touched = 3 * (64 + 12 + 4 + 48 + 64 << 20) // resource.getpagesize()
    if accelerator == "cpu":
        assert out[0] == str(CPU_MALLOC) and int(out[1]) < touched // 4  # glibc's defaults: all of them
    else:
        assert out[0] == "{}" and int(out[1]) > touched // 2


def test_a_run_records_the_gpus_its_worker_gave_it(monkeypatch):
    """A sweep worker hands each trial its own GPUs through CUDA_VISIBLE_DEVICES; env.json keeps which."""
    from study.run.environment import snapshot

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert snapshot()["cuda_visible_devices"] == "2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert snapshot()["cuda_visible_devices"] is None


def test_a_cpu_run_on_a_gpu_machine_records_the_cpu_it_ran_on(monkeypatch):
    """train.accelerator: cpu on a machine with a GPU: env.json names the CPU, its bf16 and kernels, and the peak
    memory is the process's (the GPU's allocator, never used, would record 0 bytes: the best a minimized cost can
    be)."""
    import torch

    from study.run.environment import peak_memory_bytes, reset_peak_memory, snapshot

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **k: True)
    env = snapshot("32-true", "cpu")
    assert "NVIDIA" not in env["device"] and env["tf32_matmul"] is False and "cpu" in env["attention_kernels"]
    assert env["native_bf16"] == (env["cpu_flags"].get("avx512_bf16", False) or env["cpu_flags"].get("amx_bf16", False))
    reset_peak_memory("cpu")
    assert peak_memory_bytes("cpu") > 10 * 2**20  # this process's resident set (torch alone is more)
    assert snapshot("32-true", "gpu")["device"] == "NVIDIA H100 80GB HBM3"


def test_each_part_of_a_run_in_one_process_records_its_own_peak_memory():
    """A suite's parts and a pipeline's stages train one after another in one process: after the reset a smaller
    part's peak is its own, not the largest earlier one's."""
    import mmap

    from study.run.environment import peak_memory_bytes, reset_peak_memory

    big = mmap.mmap(-1, 400 * 2**20)  # its own mapping, whatever malloc settings an earlier run in this process made
    for page in range(0, len(big), mmap.PAGESIZE):
        big[page] = 1  # resident
    earlier = peak_memory_bytes("cpu")
    big.close()
    reset_peak_memory("cpu")
    assert peak_memory_bytes("cpu") < earlier - 300 * 2**20


def test_a_cpu_run_names_the_compiled_kernels_its_axis_values_run(monkeypatch):
    """RMSNorm, RoPE, SwiGLU, GEGLU and GELU-tanh declare C++ CPU kernels, every model's fused loss has one, bf16
    training's attention backward one and an encoder-decoder's beam search another; a CPU run builds them before
    training and env.json says which path each ran."""
    import study.axes.cpu_kernels as cpu_kernels_module
    from study.config import preset
    from study.run.environment import cpu_kernels

    loss = {"cross_entropy_grad": "c++"}
    assert cpu_kernels(preset("llama2"), "cpu") == {"rms_norm": "c++", "rotary": "c++", "swiglu": "c++", **loss}
    assert cpu_kernels(preset("llama2", norm="layernorm", position="alibi", activation="gelu"), "cpu") == loss
    assert cpu_kernels(preset("gpt2"), "cpu") == {"gelu_tanh": "c++", **loss}  # LayerNorm, learned positions
    assert cpu_kernels(preset("t5", activation="geglu"), "cpu") == {
        "rms_norm": "c++", "geglu": "c++", "log_softmax_topk": "c++", **loss}
    assert cpu_kernels(preset("llama2"), "gpu") == {}
    assert cpu_kernels(preset("vaswani"), "cpu") == {"log_softmax_topk": "c++", **loss}
    assert cpu_kernels(preset("vaswani"), "gpu") == {}
    bf16 = {"rms_norm": "c++", "rotary": "c++", "swiglu": "c++", **loss, "attention_grad": "c++"}
    assert cpu_kernels(preset("llama2"), "cpu", "bf16-mixed") == bf16  # bf16 training: attention's backward too
    assert cpu_kernels(preset("llama2"), "cpu", "16-mixed") == bf16  # what Lightning runs on a CPU for 16-mixed
    not_built = {"rms_norm": None, "rotary": None, "swiglu": None, "cross_entropy_grad": None}
    monkeypatch.setattr(cpu_kernels_module, "_loaded", not_built)
    assert cpu_kernels(preset("llama2"), "cpu") == dict.fromkeys(not_built, "eager")


@pytest.mark.parametrize("autocast", [False, True])
def test_a_llama_training_step_runs_every_kernel_it_declares(autocast):
    """RMSNorm's, RoPE's, SwiGLU's and the loss's C++ kernels are built on a CPU (a machine that runs the suite has a
    compiler) and a training step's forward and backward call each of them, in float32 and under bf16 autocast (where
    the loss also adds W's bfloat16 share to its float32 gradient in C++, and attention's backward runs in C++)."""
    from study.config import preset
    from study.model import build_model
    from study.run.environment import cpu_kernels

    cfg = preset("llama2", vocab_size=50, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    declared = cpu_kernels(cfg, "cpu", "bf16-mixed" if autocast else "32-true")
    attention = {"attention_grad": "c++"} if autocast else {}
    assert declared == {"rms_norm": "c++", "rotary": "c++", "swiglu": "c++", "cross_entropy_grad": "c++", **attention}
    x = torch.randint(0, 50, (2, 7))
    with torch.profiler.profile() as prof, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        build_model(cfg).loss(x, x).backward()
    ran = {e.key for e in prof.key_averages()}
    expected = [f"study_{name}::{name}" for name in ("rms_norm", "rotary", "swiglu")]
    expected += ["study_cross_entropy_grad::forward_"]
    if autocast:
        expected += ["study_cross_entropy_grad::accumulate_", "study_attention_grad::probs_",
                     "study_attention_grad::score_grad_"]
    for op in expected:
        assert op in ran, (op, sorted(k for k in ran if k.startswith("study_")))


@pytest.fixture
def clip_calls(monkeypatch):
    """Every call of torch.nn.utils.clip_grad_norm_: the gradient norm it found and the bound."""
    real = torch.nn.utils.clip_grad_norm_
    calls: list[dict[str, float]] = []

    def spy(parameters, max_norm, *args, **kwargs):
        before = real(parameters, max_norm, *args, **kwargs)
        calls.append({"before": float(before), "max_norm": float(max_norm)})
        return before

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    return calls


def _bf16(cfg: ExperimentConfig, **train) -> ExperimentConfig:
    return cfg.replace(train=cfg.train.replace(precision="bf16-mixed", **train))


def _assert_clipped_every_step(calls: list[dict[str, float]], steps: int) -> None:
    assert len(calls) == steps  # once per optimizer step, with the configured bound
    assert any(c["before"] > c["max_norm"] for c in calls), "the clip never bit: the check proves nothing"


def test_bf16_mixed_lm_clips_with_the_fused_optimizer_and_evaluates(tmp_path, clip_calls):
    write_corpus(tmp_path / "data")
    cfg = _bf16(lm_cfg(model={"n_layers": 1}), max_steps=4, eval_every=2, checkpoint_every=2, grad_clip=0.05)
    m = run_experiment(cfg, tmp_path / "run", data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    assert m["status"] == "completed" and m["steps"] == 4
    _assert_clipped_every_step(clip_calls, 4)
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["optimizer_states"][0]["param_groups"][0]["fused"] is True  # the fast kernel was kept
    assert math.isfinite(m["metrics"]["valid_loss"]) and m["metrics"]["valid_ppl"] > 1


def test_bf16_mixed_pretraining_evaluates_every_validation_batch(tmp_path, clip_calls):
    write_wikitext(tmp_path / "data")
    d = copy.deepcopy(PRETRAIN_BASE)
    d["train"].update({"max_steps": 3, "eval_every": 3, "grad_clip": 0.05, "precision": "bf16-mixed"})
    m = run_experiment(ExperimentConfig.from_dict(d), tmp_path / "run", data_dir=tmp_path / "data",
                       cache_dir=tmp_path / "cache")
    assert m["status"] == "completed"
    _assert_clipped_every_step(clip_calls, 3)
    # the final evaluation walks every validation batch under autocast (more than one: the context is re-entered)
    assert m["metrics"]["valid_nsp_pairs"] > d["train"]["batch_size"]
    assert 0 < m["metrics"]["valid_mlm_loss"] < 10


def test_bf16_mixed_glue_scores_every_dev_batch(tmp_path, clip_calls):
    write_glue(tmp_path / "data")
    dev = tmp_path / "data" / "glue" / "SST-2" / "dev.tsv"  # 300 rows: three prediction batches of 128
    dev.write_text("sentence\tlabel\n" + "".join(f"{'a good film' if i % 2 else 'a dull plot'} .\t{i % 2}\n"
                                                   for i in range(300)))
    cfg = _bf16(glue_cfg(dataset="sst2"), max_steps=3, grad_clip=0.05)
    m = run_experiment(cfg, tmp_path / "run", data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    assert m["status"] == "completed"
    _assert_clipped_every_step(clip_calls, 3)
    assert 0 <= m["metrics"]["SST-2/accuracy"] <= 100  # GLUE metrics on the 0-100 scale
    seed_metrics = json.loads((tmp_path / "run" / "SST-2" / "seed0" / "metrics.json").read_text())
    assert seed_metrics["status"] == "completed"


def test_bf16_mixed_translation_trains_and_decodes(tmp_path, clip_calls):
    write_multi30k(tmp_path / "data")
    cfg = _bf16(translation_cfg(), max_steps=3, eval_every=3, grad_clip=0.05)
    m = run_experiment(cfg, tmp_path / "run", data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    assert m["status"] == "completed"
    _assert_clipped_every_step(clip_calls, 3)
    assert set(m["metrics"]["test_sets"]) == {"test_2016_flickr", "test_2017_flickr", "test_2017_mscoco"}
    assert 0 <= m["metrics"]["bleu"] <= 100


@pytest.mark.parametrize("activation", [n for n, act in ACTIVATIONS.items() if act.cpu_kernel])
def test_a_training_step_runs_the_kernel_its_activation_declares(activation):
    """GEGLU's and GELU-tanh's kernels as SwiGLU's: built, and called by a training step, not silently eager."""
    from study.config import preset
    from study.model import build_model
    from study.run.environment import cpu_kernels

    cfg = preset("llama2", vocab_size=50, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, activation=activation)
    assert cpu_kernels(cfg, "cpu")[activation] == "c++"
    with torch.profiler.profile() as prof:
        build_model(cfg)(torch.randint(0, 50, (2, 7))).sum().backward()
    ran = {e.key for e in prof.key_averages()}
    assert f"study_{activation}::{activation}" in ran, sorted(k for k in ran if k.startswith("study_"))
