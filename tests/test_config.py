"""ModelConfig: validated on construction, every problem listed, YAML round trip, presets."""

from pathlib import Path

import pytest

from study.axes import ACTIVATIONS, AXES, NORMS
from study.config import (PRESETS, ConfigError, ExperimentConfig, ModelConfig, TrainConfig, axis_choices,
                          parse_overrides, preset)


def problems_of(**fields):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**fields)
    return err.value.problems, str(err.value)


def test_defaults_are_valid_and_resolve_derived_fields():
    cfg = ModelConfig()
    assert cfg.objective == "clm"
    assert cfg.resolved_n_kv_heads == cfg.n_heads
    assert cfg.resolved_head_dim == cfg.d_model // cfg.n_heads
    assert cfg.attention_kind == "mha"


def test_config_is_frozen():
    with pytest.raises(Exception):
        ModelConfig().d_model = 3


def test_yaml_and_dict_round_trip_every_preset():
    for name in PRESETS:
        cfg = preset(name)
        assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_field_is_named_with_valid_fields():
    with pytest.raises(ConfigError, match="normm: unknown field"):
        ModelConfig.from_dict({"normm": "rmsnorm"})


def test_heads_must_divide_by_kv_heads():
    problems, text = problems_of(n_heads=8, n_kv_heads=3, d_model=64)
    assert any(p.startswith("n_kv_heads:") for p in problems)
    assert "[1, 2, 4, 8]" in text  # the valid values


def test_rope_needs_even_head_dim():
    problems, _ = problems_of(position="rope", d_model=36, n_heads=4)  # head_dim 9
    # the fields that make the head dimension are named: a sweep of d_model or n_heads is reported under position
    assert any(p.startswith("position:") and "even head dimension, got 9 (d_model / n_heads = 36 / 4)" in p
               for p in problems)
    problems, _ = problems_of(position="rope", d_model=36, n_heads=4, head_dim=7)
    assert any("got 7 (head_dim=7)" in p for p in problems)


@pytest.mark.parametrize("window", [0, -3])
def test_window_must_be_positive(window):
    problems, _ = problems_of(window=window)
    assert any(p.startswith("window:") for p in problems)


def test_window_pattern_rules():
    assert any(p.startswith("window_pattern:") for p in problems_of(window_pattern="LG")[0])  # no window
    assert any(p.startswith("window_pattern:") for p in problems_of(window=4, window_pattern="LXG")[0])
    assert any(p.startswith("window_pattern:") for p in problems_of(window=4, window_pattern="GG")[0])
    cfg = ModelConfig(window=4, window_pattern="LLLG", n_layers=8)
    assert cfg.layer_spans() == ["local"] * 3 + ["global"] + ["local"] * 3 + ["global"]
    assert ModelConfig(n_layers=3).layer_spans() == ["global"] * 3


def test_nsp_only_on_an_mlm_encoder():
    problems, text = problems_of(arch="decoder", nsp=True, type_vocab_size=2)
    assert any(p.startswith("nsp:") for p in problems)
    assert "encoder" in text
    problems, _ = problems_of(arch="encoder", nsp=True, type_vocab_size=0)
    assert any(p.startswith("type_vocab_size:") for p in problems)


def test_objective_must_match_arch():
    problems, _ = problems_of(arch="decoder", objective="mlm")
    assert any(p.startswith("objective:") for p in problems)
    assert ModelConfig(arch="encoder-decoder").objective == "seq2seq"


@pytest.mark.parametrize("field,registry", list(AXES.items()))
def test_unknown_axis_value_lists_the_registry(field, registry):
    problems, _ = problems_of(**{field: "nonsense"})
    [problem] = [p for p in problems if p.startswith(field + ":")]
    for name in registry.names():
        assert repr(name) in problem


def test_all_problems_reported_at_once():
    problems, _ = problems_of(norm="batchnorm", window=0, n_heads=4, n_kv_heads=3, dropout=1.5)
    fields = {p.split(":")[0] for p in problems}
    assert {"norm", "window", "n_kv_heads", "dropout"} <= fields


def test_type_errors_are_reported_per_field():
    problems, _ = problems_of(d_model="wide", dropout="lots")
    assert {p.split(":")[0] for p in problems} == {"d_model", "dropout"}


def test_axis_choices_come_from_registries():
    choices = axis_choices()
    assert choices["norm"] == NORMS.names() and choices["activation"] == ACTIVATIONS.names()
    assert {k: v for k, v in choices.items() if k in AXES} == {k: r.names() for k, r in AXES.items()}
    # the values the presets and the README's examples rely on are among them
    assert {"layernorm", "rmsnorm"} <= set(choices["norm"]) and {"rope", "alibi", "learned"} <= set(choices["position"])


def test_presets_are_the_published_recipes():
    llama = preset("llama2")
    assert (llama.norm, llama.norm_position, llama.position, llama.activation) == ("rmsnorm", "pre", "rope", "swiglu")
    assert llama.attention_kind == "mha" and not llama.bias  # the 7B (GQA is the 34B's and 70B's)
    assert preset("mistral").window == 4096 and preset("mistral").attention_kind == "gqa"
    bert = preset("bert")
    assert (bert.arch, bert.norm_position, bert.position, bert.nsp) == ("encoder", "post", "learned", True)
    vaswani = preset("vaswani")
    assert (vaswani.arch, vaswani.norm_position, vaswani.position, vaswani.activation) == (
        "encoder-decoder", "post", "sinusoidal", "relu")
    # residual dropout only (§5.4); BERT and GPT-2 drop attention weights at their dropout rate
    assert (vaswani.resolved_attention_dropout, bert.resolved_attention_dropout) == (0.0, 0.1)
    assert preset("t5").position == "t5_bias"
    assert preset("gpt2").activation == "gelu_tanh"


def test_an_encoder_decoder_preset_deepens_both_stacks_and_lets_arch_be_overridden():
    assert preset("vaswani").resolved_encoder_layers == 6 and preset("t5").resolved_encoder_layers == 12  # published
    assert preset("t5", n_layers=4).resolved_encoder_layers == 4
    assert preset("vaswani", n_layers=2, n_encoder_layers=3).resolved_encoder_layers == 3
    assert preset("t5", arch="decoder").arch == "decoder"


def test_replacing_the_arch_derives_its_default_objective_again():
    assert ModelConfig(arch="decoder").replace(arch="encoder").objective == "mlm"
    assert ModelConfig(arch="encoder").replace(arch="encoder-decoder").objective == "seq2seq"
    assert ModelConfig(arch="decoder").replace(arch="encoder", objective="mlm").objective == "mlm"
    with pytest.raises(ConfigError, match="objective"):  # an objective named in the change is kept, and checked
        ModelConfig(arch="decoder").replace(arch="encoder", objective="clm")


def test_preset_overrides_are_validated():
    assert preset("llama2", norm="layernorm").norm == "layernorm"
    with pytest.raises(ConfigError, match="n_kv_heads"):
        preset("mistral", n_heads=4, d_model=256)  # 8 kv heads no longer divide 4 heads
    with pytest.raises(KeyError, match="valid presets"):
        preset("gpt5")


def test_parse_overrides_reads_yaml_scalars():
    assert parse_overrides(["window=16", "norm=rmsnorm", "bias=false", "n_kv_heads=null"]) == {
        "window": 16, "norm": "rmsnorm", "bias": False, "n_kv_heads": None}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["window"])


def test_overrides_and_config_files_read_numbers_as_written_yaml_1_2():
    """PyYAML's YAML 1.1 reads `010` as 8, `1:30` as 90 and `no` as false: a seed or a name would silently hold
    another value than the one written. Configs, specs and `--set` follow YAML 1.2's core schema instead."""
    assert parse_overrides(["train.seed=010", "a=1:30", "b=no", "c=2e-3", "d=2026-11-26", "e=0x10", "f=on"]) == {
        "train.seed": 10, "a": "1:30", "b": "no", "c": 0.002, "d": "2026-11-26", "e": 16, "f": "on"}
    assert TrainConfig.from_yaml("seed: 010\nlr: 3e-4\n").seed == 10
    assert TrainConfig.from_yaml("seed: 010\nlr: 3e-4\n").lr == 3e-4


def test_a_written_config_reads_back_equal_even_where_a_string_looks_like_a_number():
    import yaml  # a YAML 1.1 reader (another tool) reads what we write the same way too

    from study.config import ExperimentConfig
    from study.io import dump_yaml, load_yaml

    for name in ["010", "1e5", "no", "2026-11-26", "true", "0o7", "1_000"]:
        cfg = ExperimentConfig.from_dict({"name": name})
        assert ExperimentConfig.from_yaml(cfg.to_yaml()) == cfg
        assert load_yaml(dump_yaml({"name": name})) == {"name": name}
        assert yaml.safe_load(dump_yaml({"name": name})) == {"name": name}


def test_segment_embeddings_only_on_encoders():
    problems, _ = problems_of(arch="decoder", type_vocab_size=2)
    assert any(p.startswith("type_vocab_size:") for p in problems)


def test_segment_embeddings_have_the_two_rows_sentence_pairs_index():
    """GLUE pairs and NSP give segment ids 0 and 1: one row fails at the first pair (a suite's third task), a third
    row is a parameter nothing reads."""
    for size in (1, 3):
        problems, text = problems_of(arch="encoder", objective="mlm", type_vocab_size=size)
        assert [p for p in problems if p.startswith("type_vocab_size:")], size
        assert "0 (no segment embeddings) or 2" in text
    assert ModelConfig(arch="encoder", objective="mlm", type_vocab_size=2).type_vocab_size == 2


def test_experiment_errors_list_every_section_with_its_prefix():
    from study.config import ExperimentConfig

    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({"model": {"window": 0}, "task": {"seq_len": 1}, "train": {"lr": -1}})
    fields = {p.split(":")[0] for p in err.value.problems}
    assert {"model.window", "task.seq_len", "train.lr"} <= fields


def test_multi30k_test_sets_are_checked_against_the_language_pair_before_any_data_is_read():
    from study.config.task import TaskConfig

    mt = dict(name="translation", dataset="multi30k", tokenizer="bpe", vocab_size=1000)
    with pytest.raises(ConfigError) as err:  # the default test sets include 2017's, which Czech lacks
        TaskConfig(**mt, src_lang="en", tgt_lang="cs")
    assert err.value.problems == [
        "test_sets: ['test_2017_flickr', 'test_2017_mscoco'] not in multi30k en-cs, whose test sets are "
        "['test_2016_flickr', 'test_2018_flickr'] (Czech joined in 2018: it has no 2017 test sets)"]
    TaskConfig(**mt, src_lang="en", tgt_lang="cs", test_sets=("test_2016_flickr", "test_2018_flickr"))
    with pytest.raises(ConfigError, match=r"\['test_2016'\] not in multi30k de-en"):
        TaskConfig(**mt, test_sets=("test_2016",))
    with pytest.raises(ConfigError, match="test_sets: needs at least one"):
        TaskConfig(**mt, test_sets=())


def test_translation_needs_a_lossless_tokenizer():
    from study.config import TaskConfig

    with pytest.raises(ConfigError, match="lossless"):
        TaskConfig(name="translation", dataset="multi30k", tokenizer="wordpiece", vocab_size=1000)
    assert TaskConfig(name="translation", dataset="multi30k", tokenizer="bpe", vocab_size=1000).tokenizer == "bpe"


def test_a_vocab_size_for_a_character_vocabulary_is_refused_when_the_config_is_read():
    """A character vocabulary is the corpus's characters: `vocab_size: 512` would label a model it does not build
    (and a sweep over it would train one model under every label)."""
    from study.config import TaskConfig

    with pytest.raises(ConfigError, match="vocab_size.*char"):
        TaskConfig(name="lm", dataset="tinyshakespeare", tokenizer="char", vocab_size=512)
    assert TaskConfig(name="lm", dataset="tinyshakespeare", tokenizer="char").vocab_size is None


def test_gated_ffn_default_width_keeps_the_parameter_count():
    from study.axes import default_d_ff

    assert default_d_ff(4096, gated=True) == 11008  # Llama 2 7B
    for d in (64, 128, 256, 512):
        gated_params, plain_params = 3 * d * default_d_ff(d, True), 2 * d * default_d_ff(d, False)
        assert abs(gated_params / plain_params - 1) < 0.03


EXPERIMENTS = sorted((Path(__file__).resolve().parents[1] / "experiments").glob("*.yaml"))
SWEEP_SPECS = {"ablation_default.yaml"}  # checked with the sweep's own loader in test_sweep.py


@pytest.mark.parametrize("path", [p for p in EXPERIMENTS if p.name not in SWEEP_SPECS], ids=lambda p: p.name)
def test_every_shipped_experiment_config_is_valid(path):
    from study.config import load_experiment

    cfg = load_experiment(path)  # one experiment, or a pipeline of stages (pretrain_then_glue.yaml)
    assert cfg.name and type(cfg).from_yaml(cfg.to_yaml()) == cfg


@pytest.mark.parametrize("eps", [0.0, -1e-8])
def test_adam_eps_must_be_positive_before_the_optimizer_is_built(eps):
    with pytest.raises(ConfigError, match=r"adam_eps: must be > 0"):
        TrainConfig(adam_eps=eps)


@pytest.mark.parametrize("decay", [0.0, 1.0, 1.5, -0.1])
def test_ema_decay_outside_the_open_unit_interval_is_rejected(decay):
    with pytest.raises(ConfigError, match=r"ema_decay: must be in \(0, 1\) or null"):
        TrainConfig(ema_decay=decay)
    assert TrainConfig(ema_decay=0.999).ema_decay == 0.999 and TrainConfig().ema_decay is None


def test_differences_name_each_differing_field_with_its_section():
    from study.config import ExperimentConfig

    base = ExperimentConfig.from_dict({"model": {"d_model": 64}, "train": {"lr": 3e-3}})
    other = base.replace(train=base.train.replace(lr=1e-3, precision="bf16-mixed"),
                         model=base.model.replace(d_model=32))
    assert base.differences(base) == {}
    assert base.differences(other) == {"model.d_model": (64, 32), "train.lr": (3e-3, 1e-3),
                                       "train.precision": ("32-true", "bf16-mixed")}
    assert other.differences(base)["train.lr"] == (1e-3, 3e-3)


def test_weight_averaging_is_refused_where_the_weights_are_bf16():
    """bf16-true keeps the weights, and so the moving average, in bf16: lerp(1.0, 1.1, 0.001) is 1.0 there, and the
    warm-up weight reaches 0 after about 4,000 updates; the average would silently stop moving."""
    with pytest.raises(ConfigError, match="ema_decay: cannot average weights kept in bf16"):
        TrainConfig(ema_decay=0.999, precision="bf16-true")
    assert TrainConfig(ema_decay=0.999, precision="bf16-mixed").ema_decay == 0.999


@pytest.mark.parametrize(("task", "window", "longest"), [
    ({"name": "pretrain", "dataset": "wikitext-2", "seq_len": 128, "vocab_size": 8000}, 128, 128),
    ({"name": "lm", "dataset": "tinyshakespeare", "seq_len": 64, "eval_lengths": [1, 2]}, 200, 128),
    ({"name": "translation", "dataset": "multi30k", "seq_len": 63, "vocab_size": 8000}, 64, 64),
])
def test_a_window_that_spans_every_sequence_the_task_runs_is_refused_naming_model_window(task, window, longest):
    """It would mask nothing: the run would be global attention labelled local (a preset's 4,096-token window at
    seq_len 128). Language modelling counts its longest evaluation; translation the decoder's BOS."""
    from study.config import ExperimentConfig

    arch = {"pretrain": "encoder", "lm": "decoder", "translation": "encoder-decoder"}[task["name"]]
    model = {"arch": arch, "position": "rope", "window": window, "objective": "mlm" if arch == "encoder" else None}
    model = {k: v for k, v in model.items() if v is not None}
    with pytest.raises(ConfigError, match=rf"model\.window: {window} spans every sequence .*at most {longest} tokens"):
        ExperimentConfig.from_dict({"model": model, "task": task})
    ExperimentConfig.from_dict({"model": {**model, "window": longest - 1}, "task": task})  # one shorter bites


def test_an_unknown_arch_is_one_error_not_also_one_about_the_objective_it_would_decide():
    with pytest.raises(ConfigError) as err:
        ModelConfig(arch="decoder-only")
    assert err.value.problems == ["arch: 'decoder-only' is not one of ['decoder', 'encoder', 'encoder-decoder']"]
    with pytest.raises(ConfigError, match="objective: 'xx' is not one of"):
        ModelConfig(arch="decoder", objective="xx")


def test_pretraining_seq_len_leaves_room_for_text_around_its_special_tokens():
    """[CLS] A [SEP] B [SEP] (NSP) or [CLS] text [SEP] around at least two tokens: refused when the config is built,
    not after WikiText-2 is read and a WordPiece vocabulary trained."""
    def pretrain(seq_len: int, nsp: bool) -> dict:
        return {"model": {"arch": "encoder", "objective": "mlm", "nsp": nsp, "type_vocab_size": 2 if nsp else 0},
                "task": {"name": "pretrain", "dataset": "wikitext-2", "seq_len": seq_len, "vocab_size": 100}}

    for seq_len, nsp in [(4, True), (3, False)]:
        with pytest.raises(ConfigError, match=r"task.seq_len: pretraining.* needs >= "):
            ExperimentConfig.from_dict(pretrain(seq_len, nsp))
    assert ExperimentConfig.from_dict(pretrain(5, True)).task.seq_len == 5
    assert ExperimentConfig.from_dict(pretrain(4, False)).task.seq_len == 4


def test_a_translation_decoder_reads_bos_and_the_sentence_so_positions_and_windows_count_seq_len_plus_one():
    """Sources are cut to seq_len tokens and the decoder's input is BOS + at most seq_len target tokens: seq_len + 1
    learned positions suffice, and a window of seq_len + 1 would mask nothing in training."""
    def translation(**model) -> dict:
        return {"model": {"arch": "encoder-decoder", **model},
                "task": {"name": "translation", "dataset": "multi30k", "seq_len": 20, "vocab_size": 1000}}

    assert ExperimentConfig.from_dict(translation(position="learned", max_seq_len=21)).model.max_seq_len == 21
    with pytest.raises(ConfigError, match=r"task.seq_len: 20 \(\+ BOS\) exceeds model.max_seq_len=20"):
        ExperimentConfig.from_dict(translation(position="learned", max_seq_len=20))
    with pytest.raises(ConfigError, match=r"model.window: 21 spans every sequence"):
        ExperimentConfig.from_dict(translation(window=21))
    assert ExperimentConfig.from_dict(translation(window=20)).model.window == 20


def test_a_preset_given_as_an_override_is_refused_where_the_model_section_would_override_its_design():
    """`--set model.preset=llama2` on a run's config.yaml (every field stated) changed nothing and said nothing: the
    stated norm, position and activation won. Refused naming them; stated sizes scale the preset, as meant."""
    from study.config.experiment import apply_overrides

    tiny = {"model": {"preset": "gpt2", "d_model": 64, "n_heads": 2, "n_layers": 2, "max_seq_len": 64},
            "task": {"name": "lm", "seq_len": 32}}
    stated = ExperimentConfig.from_dict(tiny).to_dict()
    with pytest.raises(ConfigError, match=r"model.preset: 'llama2' .* own activation, bias, norm, position"):
        apply_overrides(stated, ["model.preset=llama2"])
    scaled = ExperimentConfig.from_dict(apply_overrides(tiny, ["model.preset=llama2"])).model
    assert (scaled.norm, scaled.position, scaled.activation, scaled.d_model) == ("rmsnorm", "rope", "swiglu", 64)
    both = apply_overrides(stated, ["model.preset=llama2", "model.norm=rmsnorm", "model.position=rope",
                                    "model.activation=swiglu", "model.bias=false", "model.tie_embeddings=false"])
    assert ExperimentConfig.from_dict(both).model.norm == "rmsnorm"
