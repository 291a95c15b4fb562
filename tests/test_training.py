"""Training machinery (study.tasks.base) without a Trainer: lr schedules, AdamW parameter groups,
per-layer gradient norms, the step-indexed training stream, and atomic writes (study.io)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from study.config import ExperimentConfig, ModelConfig, TaskConfig, TrainConfig
from study.io import atomic_write, atomic_write_json, atomic_write_text
from study.model import build_model
from study.tasks.base import (
    StepIndexedBatches,
    layer_grad_norms,
    length_grouped_batches,
    lr_multiplier,
    parameter_groups,
    seeded_generator,
)


def _train(**kw) -> TrainConfig:
    return TrainConfig(**kw)


def tiny_model_cfg(**kw) -> ModelConfig:
    base = dict(arch="decoder", vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
    return ModelConfig(**{**base, **kw})


# --- learning-rate schedules --------------------------------------------------------------------
# warmup 10, max_steps 110, floor 0.1: warm-up is (step + 1) / 10; decay progress is (step - 10) / 100.
DECAY = dict(warmup_steps=10, max_steps=110, min_lr_ratio=0.1)


@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 0.1),
        (4, 0.5),
        (9, 1.0),
        (10, 1.0),  # progress 0
        (35, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # progress 0.25 -> 0.868198...
        (60, 0.55),  # progress 0.5: 0.1 + 0.9 * 0.5 * (1 + 0)
        (85, 0.1 + 0.9 * 0.5 * (1 - math.cos(math.pi / 4))),  # progress 0.75 -> 0.231802...
        (110, 0.1),  # progress 1: the floor
        (500, 0.1),  # past max_steps: stays at the floor
    ],
)
def test_cosine_schedule(step, expected):
    assert lr_multiplier(step, _train(schedule="cosine", **DECAY)) == pytest.approx(expected, abs=1e-12)


def test_cosine_hand_values_are_what_the_formula_gives():
    # the two non-trivial constants above, written out
    assert 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)) == pytest.approx(0.8681980515)
    assert 0.1 + 0.9 * 0.5 * (1 - math.cos(math.pi / 4)) == pytest.approx(0.2318019485)


@pytest.mark.parametrize(
    "step, expected",
    [(0, 0.1), (9, 1.0), (10, 1.0), (35, 0.775), (60, 0.55), (85, 0.325), (110, 0.1), (1000, 0.1)],
)
def test_linear_schedule(step, expected):
    assert lr_multiplier(step, _train(schedule="linear", **DECAY)) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("step, expected", [(0, 0.1), (4, 0.5), (9, 1.0), (10, 1.0), (60, 1.0), (10_000, 1.0)])
def test_constant_schedule_with_warmup(step, expected):
    assert lr_multiplier(step, _train(schedule="constant", **DECAY)) == pytest.approx(expected, abs=1e-12)


def test_constant_schedule_without_warmup_is_one():
    cfg = _train(schedule="constant", warmup_steps=0)
    assert [lr_multiplier(s, cfg) for s in (0, 1, 999)] == [1.0, 1.0, 1.0]


def test_cosine_without_warmup_starts_at_one_and_ends_at_floor():
    cfg = _train(schedule="cosine", warmup_steps=0, max_steps=100, min_lr_ratio=0.0)
    assert lr_multiplier(0, cfg) == 1.0
    assert lr_multiplier(50, cfg) == pytest.approx(0.5)
    assert lr_multiplier(100, cfg) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "step, expected",
    # Vaswani et al. eq. 3 normalised to peak 1 at step warmup: min(s / w, sqrt(w / s)) with s = step + 1, w = 4
    [(0, 0.25), (1, 0.5), (3, 1.0), (4, math.sqrt(4 / 5)), (15, 0.5), (99, 0.2), (399, 0.1)],
)
def test_inverse_sqrt_schedule(step, expected):
    cfg = _train(schedule="inverse_sqrt", warmup_steps=4, max_steps=1000)
    assert lr_multiplier(step, cfg) == pytest.approx(expected, abs=1e-12)


def test_inverse_sqrt_needs_warmup():
    from study.config import ConfigError

    with pytest.raises(ConfigError, match="warmup_steps"):
        TrainConfig(schedule="inverse_sqrt", warmup_steps=0)


def test_optimizer_follows_the_schedule_step_by_step():
    """configure_optimizers: optimizer step k runs at lr * lr_multiplier(k) (LambdaLR stepped per step)."""
    from study.tasks.lm import LMModule

    train = dict(lr=2e-3, schedule="cosine", warmup_steps=3, max_steps=10, min_lr_ratio=0.1, weight_decay=0.05)
    cfg = ExperimentConfig.from_dict({"model": tiny_model_cfg().to_dict(), "task": {"seq_len": 8}, "train": train})
    module = LMModule(cfg)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert conf["lr_scheduler"]["interval"] == "step"
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert opt.defaults["betas"] == (cfg.train.beta1, cfg.train.beta2)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[1]["lr"] == seen[-1]
        opt.step()
        sched.step()
    assert seen == pytest.approx([2e-3 * lr_multiplier(k, cfg.train) for k in range(12)], rel=1e-12)
    assert seen[2] == pytest.approx(2e-3)  # peak at the end of warm-up
    assert seen[10] == pytest.approx(2e-4)  # the floor at max_steps


# --- AdamW parameter groups ---------------------------------------------------------------------
def _names_by_id(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def test_parameter_groups_decay_matrices_not_biases_or_norm_gains():
    model = build_model(tiny_model_cfg(tie_embeddings=True, bias=True, position="learned"))
    groups = parameter_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    names = _names_by_id(model)
    decay = {n for p in groups[0]["params"] for n in names[id(p)]}
    no_decay = {n for p in groups[1]["params"] for n in names[id(p)]}

    # the tied output matrix is the token embedding: one tensor, decayed once
    assert model.lm_head.proj.weight is model.token_embedding.weight
    assert {"token_embedding.weight", "lm_head.proj.weight"} <= decay
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert sum(p.numel() for g in groups for p in g["params"]) == model.num_parameters()

    assert "decoder.position.table.weight" in decay  # the learned position table is a matrix
    for name in decay:
        assert name.endswith("weight") and "norm" not in name, name
    assert any(n.endswith(".bias") for n in no_decay)
    assert any("norm" in n for n in no_decay)
    for name, p in model.named_parameters():
        is_bias_or_gain = name.endswith(".bias") or "norm" in name
        assert (name in no_decay) == is_bias_or_gain, name
        assert (name in decay) == (p.dim() >= 2), name


def test_parameter_groups_untied_rmsnorm_no_bias():
    model = build_model(tiny_model_cfg(tie_embeddings=False, bias=False, norm="rmsnorm", position="rope"))
    groups = parameter_groups(model, 0.3)
    names = _names_by_id(model)
    decay = {n for p in groups[0]["params"] for n in names[id(p)]}
    no_decay = {n for p in groups[1]["params"] for n in names[id(p)]}
    assert "lm_head.proj.weight" in decay and "token_embedding.weight" in decay
    assert model.lm_head.proj.weight is not model.token_embedding.weight
    assert no_decay and all("norm" in n for n in no_decay)  # only RMSNorm gains are left
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


def test_parameter_groups_skip_frozen_and_count_shared_once():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 10)
            self.b.weight = nn.Parameter(torch.randn(10, 4))
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight  # tied
            self.norm = nn.LayerNorm(4)
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)

    toy = Toy()
    decay, no_decay = (g["params"] for g in parameter_groups(toy, 0.01))
    assert [id(p) for p in decay] == [id(toy.emb.weight), id(toy.a.weight), id(toy.b.weight)]
    assert [id(p) for p in no_decay] == [id(toy.a.bias), id(toy.b.bias), id(toy.norm.weight), id(toy.norm.bias)]
    # AdamW accepts the groups as they are (it rejects a tensor that appears twice)
    torch.optim.AdamW(parameter_groups(toy, 0.01), lr=1e-3)


# --- per-layer gradient norms -------------------------------------------------------------------
def test_layer_grad_norms_match_a_manual_computation():
    torch.manual_seed(0)
    model = build_model(tiny_model_cfg(n_layers=3))
    x = torch.randint(0, 40, (2, 8))
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten()).backward()

    norms = layer_grad_norms(model)
    assert set(norms) == {"decoder.00", "decoder.01", "decoder.02", "other"}
    manual: dict[str, float] = {}
    for name, p in model.named_parameters():
        if name.startswith("decoder.blocks."):
            key = f"decoder.{int(name.split('.')[2]):02d}"
        else:
            key = "other"  # embeddings (tied head included once), positions, final norm
        manual[key] = manual.get(key, 0.0) + float((p.grad.double() ** 2).sum())
    for key, value in manual.items():
        assert norms[key] == pytest.approx(math.sqrt(value), rel=1e-6), key
    assert all(v > 0 for v in norms.values())
    # together they are the global gradient norm (what clipping uses)
    total = math.sqrt(sum(v * v for v in norms.values()))
    global_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) if hasattr(
        torch.nn.utils, "get_total_norm") else torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert total == pytest.approx(float(global_norm), rel=1e-5)


def test_layer_grad_norms_keys_for_encoder_decoder_and_many_layers():
    class Stack(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(2, 2, bias=False) for _ in range(n))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Stack(2)
            self.decoder = Stack(12)
            self.head = nn.Linear(2, 2, bias=False)
            self.unused = nn.Linear(2, 2, bias=False)  # no gradient: not reported

    m = Model()
    for i, blk in enumerate(m.encoder.blocks):
        blk.weight.grad = torch.full((2, 2), float(i + 1))  # norm 2 (i + 1)
    for i, blk in enumerate(m.decoder.blocks):
        blk.weight.grad = torch.full((2, 2), 0.5 * i)  # norm i
    m.head.weight.grad = torch.tensor([[3.0, 4.0], [0.0, 0.0]])  # norm 5
    norms = layer_grad_norms(m)
    expected = {"encoder.00": 2.0, "encoder.01": 4.0, "other": 5.0}
    expected.update({f"decoder.{i:02d}": float(i) for i in range(12)})
    assert norms.keys() == expected.keys()
    assert "decoder.10" in norms and "decoder.11" in norms  # zero-padded: sorts by depth
    for k, v in expected.items():
        assert norms[k] == pytest.approx(v), k


# --- the step-indexed training stream ----------------------------------------------------------
def test_step_indexed_batches_depend_only_on_seed_and_index():
    def make(i):
        return torch.randint(0, 1000, (4,), generator=seeded_generator(7, i))

    stream = StepIndexedBatches(make)
    first = [b for _, b in zip(range(6), stream)]
    torch.manual_seed(123)  # the global RNG plays no part
    stream.start = 3
    resumed = [b for _, b in zip(range(3), stream)]
    for a, b in zip(first[3:], resumed):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(make(0), torch.randint(0, 1000, (4,), generator=seeded_generator(8, 0)))


def test_length_grouped_batches_cover_the_epoch_once_with_little_padding():
    lengths = torch.randint(1, 129, (1000,), generator=torch.Generator().manual_seed(0)).tolist()

    def fill(batches):  # real tokens / tokens after padding every batch to its longest
        return sum(sum(lengths[j] for j in b) for b in batches) / sum(len(b) * max(lengths[j] for j in b) for b in batches)

    batches = length_grouped_batches(lengths, 32, seeded_generator(0, 0), megabatch=10)
    assert sorted(j for b in batches for j in b) == list(range(1000))
    assert len(batches) == math.ceil(1000 / 32) and sum(len(b) < 32 for b in batches) == 1
    perm = torch.randperm(1000, generator=seeded_generator(0, 0)).tolist()
    random_batches = [perm[k : k + 32] for k in range(0, 1000, 32)]
    assert fill(random_batches) < 0.6 and fill(batches) > 0.85  # measured: 0.52 and 0.90
    again = length_grouped_batches(lengths, 32, seeded_generator(0, 0), megabatch=10)
    other = length_grouped_batches(lengths, 32, seeded_generator(0, 1), megabatch=10)
    assert again == batches
    assert {frozenset(b) for b in other} != {frozenset(b) for b in batches}  # the grouping changes, not only the order
    longest = [max(lengths[j] for j in b) for b in batches]  # batches come in random order, not short to long
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


# --- atomic writes ------------------------------------------------------------------------------
def test_atomic_write_replaces_the_file(tmp_path):
    path = tmp_path / "sub" / "metrics.json"
    atomic_write_json(path, {"status": "completed", "x": 1.5})
    assert json.loads(path.read_text()) == {"status": "completed", "x": 1.5}
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.json"]


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_intact_and_no_temp_files(tmp_path, exc):
    path = tmp_path / "metrics.json"
    atomic_write_json(path, {"status": "completed", "steps": 12})
    before = path.read_bytes()

    def half_written(tmp):
        tmp.write_text('{"status": "comp')  # truncated JSON, then the "kill"
        raise exc

    with pytest.raises(type(exc)):
        atomic_write(path, half_written)
    assert path.read_bytes() == before
    assert json.loads(path.read_text())["steps"] == 12
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]  # no .metrics.json.*.tmp left


def test_a_failed_first_write_creates_nothing(tmp_path):
    def boom(tmp):
        tmp.write_bytes(b"partial")
        raise OSError("killed")

    with pytest.raises(OSError):
        atomic_write(tmp_path / "model.pt", boom)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_of_a_torch_state_dict_loads_with_weights_only(tmp_path):
    sd = build_model(tiny_model_cfg()).state_dict()
    atomic_write(tmp_path / "model.pt", lambda p: torch.save(sd, p))
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_ranks_and_workers_draw_disjoint_batches(monkeypatch):
    import study.tasks.base as base

    stream = StepIndexedBatches(lambda i: i)
    seen = {}
    for rank in range(3):
        monkeypatch.setattr(base, "_rank_and_world", lambda rank=rank: (rank, 3))
        seen[rank] = [b for _, b in zip(range(4), stream)]
    assert seen == {0: [0, 3, 6, 9], 1: [1, 4, 7, 10], 2: [2, 5, 8, 11]}
    stream.start = 2  # resumed at local batch 2
    monkeypatch.setattr(base, "_rank_and_world", lambda: (1, 3))
    assert [b for _, b in zip(range(2), stream)] == [7, 10]


def test_compiled_forward_leaves_the_state_dict_keys_unchanged(monkeypatch):
    from study.tasks.lm import LMModule

    class Wrapper(nn.Module):  # stands in for torch.compile's OptimizedModule (also an nn.Module)
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

        def forward(self, *a, **k):
            return self._orig_mod(*a, **k)

    monkeypatch.setattr(torch, "compile", lambda m: Wrapper(m))
    cfg = ExperimentConfig(model=tiny_model_cfg(), task=TaskConfig(seq_len=8), train=TrainConfig(compile=True))
    compiled, eager = LMModule(cfg), LMModule(cfg.replace(train=TrainConfig(compile=False)))
    assert isinstance(compiled.forward_model, Wrapper)
    assert list(compiled.state_dict()) == list(eager.state_dict())


def test_lm_training_loss_applies_label_smoothing_and_validation_does_not():
    from study.tasks.lm import LMModule

    cfg = ExperimentConfig(model=tiny_model_cfg(), task=TaskConfig(seq_len=8), train=TrainConfig(label_smoothing=0.2))
    module = LMModule(cfg)
    x = torch.randint(0, 40, (2, 8))
    y = torch.randint(0, 40, (2, 8))
    logits = module.model(x).flatten(0, 1)
    smoothed, _ = module.training_loss((x, y))
    plain, _ = module.validation_loss((x, y))
    assert plain.item() == pytest.approx(nn.functional.cross_entropy(logits, y.flatten()).item(), rel=1e-5)
    assert smoothed.item() == pytest.approx(
        nn.functional.cross_entropy(logits, y.flatten(), label_smoothing=0.2).item(), rel=1e-5)
    assert abs(smoothed.item() - plain.item()) > 1e-4  # so the two checks above tell them apart


def test_lm_evaluation_can_be_limited_to_the_first_tokens():
    from study.tasks.lm import LMDataModule

    cfg = ExperimentConfig(model=tiny_model_cfg(), task=TaskConfig(seq_len=8, eval_lengths=(1, 2), eval_tokens=20),
                           train=TrainConfig(batch_size=2))
    dm = LMDataModule(cfg)
    dm.ids = {"test": torch.arange(100)}
    windows = dm.windows("test", 8)
    inputs = torch.cat([x.flatten() for x, _ in windows])
    targets = torch.cat([y.flatten() for _, y in windows])
    assert inputs.tolist() == list(range(20)) and targets.tolist() == list(range(1, 21))
    assert [x.shape for x, _ in windows] == [(2, 8), (1, 4)]
