"""`bench/axis_cost.py --loss` times what it names: its "eager ops" contestant runs the fused loss without the C++
pass, its "C++ pass" contestant with it, and the plain loss neither; all three compute the same gradients."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import axis_cost  # noqa: E402

import study.model.loss as loss_module  # noqa: E402


@pytest.mark.parametrize("autocast", [False, True])
def test_each_loss_contestant_runs_the_path_it_names(autocast):
    h, w, t = axis_cost.loss_inputs(256, 16, 50)
    fns = axis_cost.loss_fns((h, w, t), autocast)
    grads = {}
    for name, fn in fns.items():
        with torch.profiler.profile() as prof:
            fn()
        ran_kernel = "study_cross_entropy_grad::forward_" in {e.key for e in prof.key_averages()}
        assert ran_kernel == ("C++" in name), name
        assert loss_module.eager_cpu_ops is not None and loss_module.eager_cpu_ops.__name__ == "eager_cpu_ops"
        grads[name], h.grad = h.grad.clone(), None
    plain, *fused = grads.values()
    for g in fused:
        torch.testing.assert_close(g, plain, atol=(2e-2 if autocast else 1e-6) * float(plain.abs().max()), rtol=0)


@pytest.mark.parametrize("autocast", [False, True])
def test_each_activation_kernel_is_timed_against_its_eager_form(autocast):
    """Every activation that declares a kernel gets a pair, and the pair computes the same gradient by both paths."""
    from study.axes import ACTIVATIONS

    fns = axis_cost.activation_fns((64, 8), autocast)
    assert set(fns) == {name for name in ACTIVATIONS.names() if ACTIVATIONS[name].cpu_kernel}
    for name, (h, pair) in fns.items():
        with torch.profiler.profile() as prof:
            pair["C++ kernel"]()
        kernel = ACTIVATIONS[name].cpu_kernel
        assert f"study_{kernel}::{kernel}" in {e.key for e in prof.key_averages()}, name
        grads = []
        for path in ("C++ kernel", "eager"):
            h.grad = None
            pair[path]()
            grads.append(h.grad.float())
        tolerance = 2e-2 if autocast else 1e-5
        torch.testing.assert_close(grads[0], grads[1], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("causal", [True, False])
def test_each_attention_contestant_runs_the_path_it_names(causal):
    """"ours" runs the C++ backward, "ours, float32 backward" the fused kernel's float32 one, SDPA neither; the switch
    is put back after each call."""
    from study.axes.cpu_kernels import cpu_ops
    from study.model import attention

    if cpu_ops("attention_grad") is None or attention._cpu_flash_backward is None:
        pytest.skip("no C++ kernel or no CPU flash kernel here")
    fns = axis_cost.attention_fns(2, 4, 2, 16, causal)
    assert set(fns) == {"sdpa bf16 (as it is)", "ours", "ours, float32 backward", "sdpa float32"}
    for name, fn in fns.items():
        with torch.profiler.profile() as prof:
            fn()
        ran = {e.key for e in prof.key_averages()}
        assert ("study_attention_grad::score_grad_" in ran) == (name == "ours"), name
        assert ("_CpuShortAttentionBackward" in ran) == name.startswith("ours"), name
        assert attention.eager_cpu_ops.__name__ == "eager_cpu_ops"


@pytest.mark.parametrize("native", [False, True])
def test_a_bf16_table_on_a_cpu_that_emulates_bf16_says_so(monkeypatch, native):
    import study.model.precision as precision

    monkeypatch.setattr(precision, "native_bf16", lambda accelerator="auto": native)
    assert axis_cost.precision_label(False) == "fp32"
    assert axis_cost.precision_label(True) == ("bf16 autocast" if native else "bf16 autocast (emulated)")


def test_the_bf16_loss_tables_are_skipped_where_bf16_is_emulated_and_say_so(monkeypatch):
    """Emulated, each bf16 loss cell runs at about 1 GFLOP/s: `--loss` took hours on an AVX2 CPU (as --attention
    would, which skips them too)."""
    import study.model.precision as precision

    monkeypatch.setattr(precision, "native_bf16", lambda accelerator="auto": False)
    monkeypatch.setattr(axis_cost, "LOSS_SHAPES", [(8, 16, 32)])
    tables = axis_cost.measure_loss(rounds=1, steps=1)
    assert tables["8 rows, d 16, vocab 32, bf16 autocast (emulated)"] == "skipped: this CPU emulates bf16"
    assert isinstance(tables["8 rows, d 16, vocab 32, fp32"], dict)
