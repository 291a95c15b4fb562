"""ScaleNorm (Nguyen & Salazar 2019), added as the guide says a value is added: one class in study/axes/norm.py and
this file. Nothing else in the tree lists norms."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from study.axes import NORMS
from study.axes.norm import ScaleNorm
from study.config import ModelConfig
from study.model import build_model
from study.model.accounting import parameter_count


def test_scalenorm_is_g_times_x_over_its_l2_norm_with_one_parameter():
    norm = ScaleNorm(8)
    assert [p.numel() for p in norm.parameters()] == [1] and ScaleNorm.num_parameters(8, True) == 1
    assert norm.scale.item() == pytest.approx(math.sqrt(8))  # unit RMS at initialisation, as LayerNorm's output
    x = torch.randn(3, 5, 8)
    expected = math.sqrt(8) * x / x.norm(dim=-1, keepdim=True)
    assert torch.allclose(norm(x), expected, atol=1e-6)
    assert torch.allclose(norm(x).pow(2).mean(-1), torch.ones(3, 5), atol=1e-5)
    with torch.no_grad():
        norm.scale.fill_(2.0)
    assert torch.allclose(norm(x).norm(dim=-1), torch.full((3, 5), 2.0), atol=1e-5)
    assert torch.isfinite(norm(torch.zeros(2, 8))).all()  # eps keeps a zero vector finite
    assert norm(x.bfloat16()).dtype == torch.bfloat16  # the norm is taken in float32, the output keeps the input's dtype


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_the_accounting_counts_scalenorm_models_exactly(arch):
    cfg = ModelConfig(arch=arch, norm="scalenorm", d_model=32, n_layers=2, n_heads=4, vocab_size=50, max_seq_len=16,
                      type_vocab_size=2 if arch == "encoder" else 0, embedding_norm=arch == "encoder")
    model = build_model(cfg)
    assert parameter_count(cfg) == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_a_decoder_with_scalenorm_trains():
    torch.manual_seed(0)
    cfg = ModelConfig(arch="decoder", norm="scalenorm", d_model=32, n_layers=2, n_heads=4, vocab_size=20, max_seq_len=16)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 20, (8, 16))
    losses = []
    for _ in range(30):
        loss = model.loss(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5


def test_study_axes_lists_it(capsys):
    from study.cli import main

    assert "scalenorm" in NORMS
    assert main(["axes"]) == 0
    assert "    scalenorm    ScaleNorm" in capsys.readouterr().out


def test_a_dry_run_plans_a_study_over_it(tmp_path, capsys):
    """`study sweep SPEC --dry-run` accepts model.norm: [rmsnorm, scalenorm] (--peak-flops: no benchmark runs)."""
    from study.cli import main

    spec = {"name": "norms", "base": {"model": {"preset": "gpt2", "d_model": 32, "n_layers": 1, "n_heads": 2,
                                                "max_seq_len": 16},
                                      "task": {"name": "lm", "dataset": "tinyshakespeare", "seq_len": 16},
                                      "train": {"max_steps": 2}},
            "axes": {"model.norm": ["rmsnorm", "scalenorm"]}, "seeds": [0]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(path), "--dry-run", "--peak-flops", "1e11", "--results", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "rmsnorm, scalenorm" in out and "norm=scalenorm" in out and "dry run: nothing was run" in out
