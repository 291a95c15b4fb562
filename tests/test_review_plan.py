"""Review of planning: what the plan says it runs is what runs. Four ways it did not: an `exclude` rule naming a
true/false/null value matched nothing (its points ran anyway); a conditional axis whose condition names an axis
declared after it, or a chain of conditions, never applied in a grid and, one factor at a time, ran its values
where its condition did not hold; an objective some points never write was accepted when the first point wrote it;
and a sweep whose trials train on a GPU was given hours of CPU time as its estimate."""

from __future__ import annotations

import pytest
from test_sweep_refusals import LM, plan_of, refused

from study.sweep.estimate import estimate
from study.sweep.plan import check, describe

SPAN = {"global": {"model.window": None}, "local": {"model.window": 16}}
PATTERN = {"field": "model.window_pattern", "values": ["L", "LG"], "when": {"span": "local"}}
LR = {"field": "train.lr", "values": [0.002, 0.001], "when": {"pattern": "LG"}}  # refines pattern=LG


@pytest.mark.parametrize("axes, rule, dropped", [
    ({"model.tie_embeddings": [True, False]}, {"tie_embeddings": False}, "tie_embeddings=false,norm=layernorm"),
    ({"model.window": [None, 16]}, {"window": None}, "window=none,norm=layernorm"),
])
def test_an_exclude_rule_naming_a_boolean_or_null_value_drops_its_point(tmp_path, axes, rule, dropped):
    plan = plan_of(tmp_path, **LM, design="grid", axes={**axes, "model.norm": ["rmsnorm", "layernorm"]},
                   exclude=[{**rule, "norm": "layernorm"}])
    assert dropped not in [p.label for p in plan.points] and plan.excluded == [dropped]
    assert len(plan.points) == 3


@pytest.mark.parametrize("order", [["span", "pattern", "lr"], ["lr", "span", "pattern"]])
def test_a_grid_of_chained_conditions_applies_each_where_its_condition_holds_in_any_declared_order(tmp_path, order):
    axes = {"span": SPAN, "pattern": PATTERN, "lr": LR}
    plan = plan_of(tmp_path, **LM, design="grid", axes={name: axes[name] for name in order})
    check(plan)
    ran = {(p.axes["span"], p.axes["pattern"], p.axes["lr"], p.config.train.lr) for p in plan.points}
    assert ran == {("global", "n/a", "n/a", 0.002), ("local", "L", "n/a", 0.002),
                   ("local", "LG", "0.002", 0.002), ("local", "LG", "0.001", 0.001)}


@pytest.mark.parametrize("order", [["span", "pattern", "lr"], ["lr", "span", "pattern"]])
def test_one_factor_at_a_time_varies_a_chained_conditional_axis_only_where_its_condition_holds(tmp_path, order):
    axes = {"span": SPAN, "pattern": PATTERN, "lr": LR}
    plan = plan_of(tmp_path, **LM, axes={name: axes[name] for name in order})
    check(plan)
    varied = next(p for p in plan.points if p.label == "lr=0.001")
    assert varied.axes == {"span": "local", "pattern": "LG", "lr": "0.001"}
    assert (varied.config.model.window, varied.config.model.window_pattern) == (16, "LG")


def test_axes_whose_conditions_form_a_cycle_are_refused_naming_the_cycle(tmp_path):
    text = refused(tmp_path, **LM, design="grid", axes={
        "model.norm": ["rmsnorm", "layernorm"],
        "a": {"field": "train.lr", "values": [0.002, 0.001], "when": {"b": 0.1}},
        "b": {"field": "train.weight_decay", "values": [0.1, 0.0], "when": {"a": 0.002}}})
    assert "axes.a.when" in text and "cycle" in text and "a -> b -> a" in text


def test_a_conditional_value_whose_condition_holds_at_no_point_is_refused(tmp_path):
    """pattern applies only where span=local, and its `when` value of span is one no grid point combines with
    pattern's own condition: its values would run nowhere."""
    text = refused(tmp_path, **LM, design="grid", axes={
        "span": SPAN, "pattern": PATTERN,
        "lr": {"field": "train.lr", "values": [0.002, 0.001], "when": {"pattern": "LG", "span": "global"}}})
    assert "axes.lr" in text and "no point" in text


def test_an_objective_that_some_points_never_write_is_refused_naming_them(tmp_path):
    for lengths in ([[1, 2, 4], [1, 4]], [[1, 4], [1, 2, 4]]):  # the first point writes it, then the second
        text = refused(tmp_path, **LM, axes={"task.eval_lengths": lengths}, objective={"metric": "valid_ppl_at_2x"})
        assert "task.eval_lengths=[1, 4] has no 2: valid_ppl_at_2x is never written" in text
        assert "eval_lengths=[1, 4]" in text  # the point it is missing at


def test_an_extrapolation_objective_a_learned_position_table_cannot_reach_is_refused(tmp_path):
    """A learned table of max_seq_len rows writes n/a past it: the point would train to the end, then fail for its
    objective. Refused before anything runs, naming the point; a table that reaches twice seq_len is fine."""
    text = refused(tmp_path, **LM, axes={"model.position": ["rope", "learned"]},
                   set={"model.max_seq_len": 128, "task.seq_len": 128}, objective={"metric": "valid_ppl_at_2x"})
    assert "learned positions cannot address length 256 (model.max_seq_len=128)" in text and "position=learned" in text
    plan_of(tmp_path, **LM, axes={"model.position": ["rope", "learned"]},
            set={"model.max_seq_len": 256, "task.seq_len": 128}, objective={"metric": "valid_ppl_at_2x"})


def test_a_sweep_that_trains_on_a_gpu_gets_no_time_from_this_machines_cpu(tmp_path):
    plan = plan_of(tmp_path, **LM, set={"train.accelerator": "gpu"}, axes={"model.norm": ["rmsnorm", "layernorm"]})
    cost = estimate(plan, rate_flops=None)
    assert cost["estimated_wall_s"] is None and cost["train_flops"] > 0
    text = describe(plan, cost)
    assert "time not estimated" in text and "--peak-flops" in text and " h" not in text.split("cost:")[1]
    given = estimate(plan, rate_flops=1e15)  # the rate of the machine that will run it, given
    assert given["estimated_wall_s"] > 0 and "about" in describe(plan, given)


def test_an_exclude_rule_that_removes_the_one_factor_at_a_time_baseline_is_refused(tmp_path):
    axes = {"model.norm": ["rmsnorm", "layernorm"], "model.tie_embeddings": [True, False]}
    text = refused(tmp_path, **LM, axes=axes, exclude=[{"norm": "rmsnorm"}])
    assert "exclude: a rule removes the baseline" in text
    check(plan_of(tmp_path, **LM, axes=axes, exclude=[{"norm": "layernorm"}]))  # a one-factor point may go


def test_a_pretraining_sweep_over_nsp_refuses_an_nsp_objective(tmp_path):
    """Pretraining writes valid_nsp_* only with model.nsp: a sweep over nsp on/off ranked by NSP accuracy would have
    no value at half its points."""
    from test_sweep_refusals import PRETRAIN

    text = refused(tmp_path, **PRETRAIN, axes={"model.nsp": [True, False]}, objective={"metric": "valid_nsp_accuracy"})
    assert "model.nsp is false" in text and "valid_nsp_accuracy is never written" in text
    text = refused(tmp_path, **PRETRAIN, axes={"model.nsp": [True, False]}, objective={"metric": "valid_mlm_loss"})
    assert "valid_mlm_loss measures something else where" in text and "model.nsp=True" in text  # its own input format
    check(plan_of(tmp_path, **PRETRAIN, axes={"model.nsp": [True, False]},
                  objective={"metric": "valid_mlm_loss_full_sentences"}))


def test_a_set_field_that_never_reaches_the_model_is_refused_as_an_axis_value_would_be(tmp_path):
    """A spec's `set` states the settings every point runs with: a field the task never reads (pretraining has no
    label smoothing), or a fine-tuning stage's model field that init_from replaces with the pretrained architecture,
    would be a setting the study names and never ran."""
    from test_sweep_refusals import EXPERIMENTS, PRETRAIN

    text = refused(tmp_path, base=PRETRAIN["base"], set={**PRETRAIN["set"], "train.label_smoothing": 0.1},
                   axes={"model.nsp": [True, False]})
    assert "set: train.label_smoothing does not reach the trained model" in text
    fp32 = {"train.precision": "32-true"}
    stages = {"pretrain": {"base": str(EXPERIMENTS / "wikitext2_bert_pretrain_nsp.yaml"), "set": fp32},
              "glue": {"base": str(EXPERIMENTS / "glue_finetune.yaml"), "init_from": "pretrain",
                       "set": {**fp32, "model.norm": "rmsnorm"}}}
    text = refused(tmp_path, stages=stages, axes={"model.nsp": [True, False]})
    assert "stages.glue.set: glue.model.norm is replaced when the config is resolved (asked 'rmsnorm'" in text


def test_a_set_default_that_per_task_settings_override_for_some_tasks_still_plans():
    """nsp_glue sets the fine-tuning stage's max_steps for the small tasks while per_task gives SST-2 and CoLA their
    own: a default with exceptions reaches part of the suite, which a `set` may (an axis value may not)."""
    from test_sweep_refusals import EXPERIMENTS

    from study.sweep import expand, load_spec

    plan = expand(*load_spec(EXPERIMENTS / "sweeps" / "nsp_glue.yaml"))
    assert not plan.refused and plan.points


def test_a_context_length_axis_under_a_scheme_without_a_position_table_is_refused(tmp_path):
    """max_seq_len sizes a learned position table and nothing else: swept under RoPE, every value would train the same
    model while the table listed them as different points."""
    text = refused(tmp_path, **LM, axes={"model.max_seq_len": [128, 256]})
    assert "axes.max_seq_len: model.max_seq_len does not reach the trained model: only position 'learned' reads it, " \
           "not 'rope'" in text
    where_read = {"field": "model.max_seq_len", "values": [128, 256], "when": {"position": "learned"}}
    plan = plan_of(tmp_path, **LM, design="grid", axes={"model.position": ["rope", "learned"], "table": where_read})
    check(plan)
    assert {(p.config.model.position, p.config.model.max_seq_len) for p in plan.points} == {
        ("rope", 128), ("learned", 128), ("learned", 256)}
    # a `set` states the table's size for the points that have one, as a single config keeps it under any scheme
    check(plan_of(tmp_path, **LM, set={"model.max_seq_len": 256}, axes={"model.position": ["rope", "learned"]}))


def test_a_point_that_spells_out_what_another_leaves_unset_is_the_same_run_and_trains_once(tmp_path):
    """n_kv_heads: null is n_heads (MHA): a variant naming n_heads trains the same model, so the plan skips it
    rather than present two seeds' noise between identical models as the difference between two variants. The run
    directory keeps its content hash (unset fields left out), so committed results are not orphaned."""
    from study.config import content_hash

    attention = {"mha": {"model.n_kv_heads": None}, "gqa": {"model.n_kv_heads": 2},
                 "mha-named": {"model.n_kv_heads": 4}}
    plan = plan_of(tmp_path, **LM, set={"model.n_heads": 4}, axes={"attention": attention})
    check(plan)
    assert [p.label for p in plan.points] == ["baseline", "attention=gqa"]
    assert plan.duplicates == [("attention=mha-named", "baseline")]
    assert "skipped attention=mha-named: the same config as baseline" in describe(plan)
    baseline = plan.points[0]
    assert baseline.point == content_hash(baseline.config.replace(name="x"))
    assert baseline.config.model.n_kv_heads is None


def test_window_patterns_that_build_the_same_layers_are_one_run():
    """The pattern restarts in each stack, cut to its depth and repeated: over two layers 'LGGG' and 'LGLL' build
    'LG', and an all-local pattern builds what no pattern does. The plan skips such points as duplicates rather than
    read two seeds' noise between identical models as an effect."""
    from study.config import ExperimentConfig, content_hash
    from study.config.hashing import same_run_hash

    def cfg(pattern, n_layers=2):
        return ExperimentConfig.from_dict({"model": {"preset": "llama2", "d_model": 32, "n_layers": n_layers,
                                                     "n_heads": 2, "window": 8, "window_pattern": pattern}})

    assert len({same_run_hash(cfg(p)) for p in ("LG", "LGGG", "LGLL")}) == 1
    assert len({same_run_hash(cfg(p)) for p in (None, "L", "LL")}) == 1
    assert same_run_hash(cfg("LG")) != same_run_hash(cfg("GL")) != same_run_hash(cfg(None))
    assert same_run_hash(cfg("LG", 4)) != same_run_hash(cfg("LGGG", 4))  # over four layers they differ
    assert content_hash(cfg("LG")) != content_hash(cfg("LGGG"))  # run directories keep their names


def test_a_sweep_over_window_patterns_skips_those_that_build_the_same_layers(tmp_path):
    plan = plan_of(tmp_path, **LM, set={"model.window": 16, "model.n_layers": 2},
                   axes={"model.window_pattern": ["LG", "LGGG", "GL"]})
    check(plan)
    assert [p.label for p in plan.points] == ["baseline", "window_pattern=GL"]
    assert plan.duplicates == [("window_pattern=LGGG", "baseline")]


@pytest.mark.parametrize("base, axes, metric", [
    ("mt", {"task.test_sets": [["test_2016_flickr"], ["test_2017_mscoco"]]}, "bleu"),  # another test set
    ("mt", {"direction": {"de-en": {"task.src_lang": "de", "task.tgt_lang": "en"},
                          "en-de": {"task.src_lang": "en", "task.tgt_lang": "de"}}}, "bleu"),  # other references
    ("mt", {"direction": {"de-en": {"task.src_lang": "de", "task.tgt_lang": "en"},
                          "en-de": {"task.src_lang": "en", "task.tgt_lang": "de"}}}, "valid_loss"),
    ("mt", {"task.seq_len": [128, 32]}, "valid_loss"),  # validation pairs cut shorter: other tokens scored
    ("lm", {"task.eval_tokens": [4096, None]}, "valid_loss"),  # part of the split against all of it
    ("lm", {"task.dataset": ["tinyshakespeare", "wikitext-2"]}, "valid_loss"),  # another corpus
    ("lm", {"task.seq_len": [32, 64]}, "valid_loss"),  # longer windows: more context per token on average
    ("pretrain", {"task.seq_len": [64, 128]}, "valid_mlm_loss_full_sentences"),  # other packs, other masks
    ("pretrain", {"task.seq_len": [64, 128]}, "valid_nsp_accuracy"),  # other sentence pairs
    ("glue", {"task.glue_tasks": [["sst2", "cola"], ["sst2", "rte"]]}, "glue_score"),  # a mean over other tasks
])
def test_an_objective_measured_on_other_text_cannot_rank_the_points(tmp_path, base, axes, metric):
    """BLEU on another test set or into another language, a loss over part of a split or over another corpus: one
    name, another quantity at each point."""
    from test_sweep_refusals import EXPERIMENTS

    bases = {"mt": "multi30k_de_en.yaml", "glue": "glue_finetune.yaml", "pretrain": "wikitext2_bert_pretrain_nsp.yaml"}
    spec = LM if base == "lm" else {"base": str(EXPERIMENTS / bases[base]), "set": {"train.precision": "32-true"}}
    if "task.dataset" in axes:
        spec = {**spec, "set": {"task.tokenizer": "bpe", "task.vocab_size": 2000}}
    assert f"objective: {metric} measures something else where" in refused(
        tmp_path, **spec, axes=axes, objective={"metric": metric})


def test_an_objective_whose_meaning_an_axis_changes_cannot_rank_the_points(tmp_path):
    """A loss per token is per token of the tokenizer: lowercased text, or another vocabulary, is another metric under
    the same name. BLEU does not depend on the vocabulary; it does on the casing."""
    from test_sweep_refusals import EXPERIMENTS, PRETRAIN

    text = refused(tmp_path, **LM, axes={"task.lowercase": [False, True]})
    assert "objective: valid_loss measures something else where" in text
    assert "task.lowercase=False" in text and "task.lowercase=True (at lowercase=true)" in text
    mt = {"base": str(EXPERIMENTS / "multi30k_de_en.yaml"), "set": {"train.precision": "32-true"}}
    vocab = {"task.vocab_size": [8000, 4000]}
    check(plan_of(tmp_path, **mt, axes=vocab, objective={"metric": "bleu"}))
    assert "valid_loss measures something else" in refused(tmp_path, **mt, axes=vocab,
                                                            objective={"metric": "valid_loss"})
    assert "bleu measures something else" in refused(tmp_path, **mt, axes={"task.lowercase": [False, True]},
                                                      objective={"metric": "bleu"})
    # a tuned share of masked tokens: each trial predicts other tokens from less context
    tune = {"field": "task.mlm_probability", "low": 0.1, "high": 0.4, "log": False}
    assert "tune.field: task.mlm_probability decides what the objective valid_mlm_loss measures" in refused(
        tmp_path, **PRETRAIN, tune=tune, axes={"model.norm": ["layernorm"]})


def test_a_schedule_axis_that_warm_up_leaves_no_step_is_refused(tmp_path):
    """Every schedule warms up alike: with warm-up as long as training, cosine and linear train the same steps."""
    text = refused(tmp_path, **LM, set={"train.max_steps": 50, "train.warmup_steps": 50},
                   axes={"train.schedule": ["cosine", "linear"]})
    assert "train.schedule does not reach the trained model: warm-up (warmup_steps=50) lasts max_steps=50" in text
    check(plan_of(tmp_path, **LM, set={"train.max_steps": 50, "train.warmup_steps": 10},
                  axes={"train.schedule": ["cosine", "linear"]}))
