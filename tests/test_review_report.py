"""The report and the results table read a config field as it ran: a field left unset (null, or absent from a
config.yaml written before the field existed) is the value the config resolves it to. `model.n_kv_heads: null` is
n_heads (MHA), so a run that leaves it unset and one that spells it out are the same model, and a cell a
conditional axis does not apply to holds that axis at the baseline's value when it ran the baseline's fields."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pandas as pd
import yaml
from test_sweep_axes_overlap import finish
from test_sweep_refusals import LM, plan_of

from study.report.collect import SweepResults, load_results
from study.report.compare import CellPair, Measurement, cell_pairs, comparability
from study.report.figures import holding_baseline
from study.sweep.plan import check
from study.sweep.results import build_table

REPO = Path(__file__).resolve().parent.parent
N_HEADS = 4  # experiments/ablation_base.yaml


def _kv_plan(tmp_path: Path, values):
    plan = plan_of(tmp_path, **LM, axes={"model.n_kv_heads": values})
    check(plan)
    return plan


def _ran_with(point, **model) -> str:
    """config.yaml of `point`'s seed-0 run with `model` fields set (a key given as None is left out altogether)."""
    cfg = point.config.with_seed(0).to_dict()
    cfg["model"].update({k: v for k, v in model.items() if v is not None})
    for k in [k for k, v in model.items() if v is None]:
        cfg["model"].pop(k)
    return yaml.safe_dump(cfg)


# -- the results table -------------------------------------------------------------------------------------------
def test_a_run_that_spells_out_the_unset_default_ran_as_planned_under_the_unset_label(tmp_path):
    plan = _kv_plan(tmp_path, [None, 2])
    mha = plan.points[0]
    row = finish(tmp_path, plan, mha, _ran_with(mha, n_kv_heads=N_HEADS))
    assert (row["axis.n_kv_heads"], row["ran_as_planned"], row["label"]) == ("none", True, mha.label)
    assert row["config.model.n_kv_heads"] == str(N_HEADS)  # what ran, resolved


def test_a_field_absent_from_an_older_config_yaml_is_read_as_its_default(tmp_path):
    plan = _kv_plan(tmp_path, [None, 2])
    mha = plan.points[0]
    row = finish(tmp_path, plan, mha, _ran_with(mha, n_kv_heads=None))  # no n_kv_heads key at all
    assert (row["axis.n_kv_heads"], row["ran_as_planned"]) == ("none", True)
    assert row["config.model.n_kv_heads"] == str(N_HEADS)


def test_the_unset_value_and_the_spelled_out_default_resolve_to_one_recorded_value(tmp_path):
    plan = _kv_plan(tmp_path, [N_HEADS, 2])
    spelled = plan.points[0]
    row = finish(tmp_path, plan, spelled, _ran_with(spelled, n_kv_heads=None))
    assert (row["axis.n_kv_heads"], row["ran_as_planned"]) == (str(N_HEADS), True)


def test_a_null_that_ran_is_read_as_a_value_never_as_not_run(tmp_path):
    """window: null (global attention) is a value: a trial planned at window 16 that ran global says so."""
    plan = plan_of(tmp_path, **LM, axes={"model.window": [16, None]})
    check(plan)
    local = plan.points[0]
    cfg = local.config.with_seed(0).to_dict()
    cfg["model"]["window"] = None
    row = finish(tmp_path, plan, local, yaml.safe_dump(cfg))
    assert (row["axis.window"], row["ran_as_planned"]) == ("none", False)
    assert row["label"] == f"{local.label} (ran: window=none)"


# -- the report --------------------------------------------------------------------------------------------------
def _conditional_grid(recorded: dict[str, str] | None):
    """pre,mha (n_kv_heads 4), pre,mqa (1) and post, which the attention axis does not apply to and whose planned
    config leaves n_kv_heads unset; `recorded`: the table's config.model.n_kv_heads per cell, as the sweep wrote it."""
    cells = (("pre,mha", "pre", "mha"), ("pre,mqa", "pre", "mqa"), ("post", "post", "n/a"))
    table = pd.DataFrame([{"label": label, "axis.norm_position": norm, "axis.attention": att, "is_baseline": False,
                           "status": "completed", "task": "lm", "seed": 0,
                           **({"config.model.n_kv_heads": recorded[label]} if recorded else {})}
                          for label, norm, att in cells])
    kv = {"pre,mha": 4, "pre,mqa": 1, "post": None}
    points = [{"label": label, "config": {"model": {"n_kv_heads": kv[label]}}} for label in kv]
    plan = {"axes": {"norm_position": ["pre", "post"], "attention": ["mha", "mqa"]}, "points": points,
            "axis_fields": {"norm_position": ["model.norm_position"], "attention": ["model.n_kv_heads"]}}
    return SweepResults(Path("r"), table, plan)


def test_a_cell_leaving_n_kv_heads_unset_pairs_with_mha_as_it_ran():
    ran = _conditional_grid({"pre,mha": "4", "pre,mqa": "1", "post": "4"})
    assert cell_pairs(ran, "norm_position", "pre", "post") == [CellPair("pre,mha", "post", (("attention", "mha"),))]
    # a table that does not record what ran: the unset field is not taken for a default the report cannot know
    assert cell_pairs(_conditional_grid(None), "norm_position", "pre", "post") == []


def test_a_heatmap_holds_a_cell_an_axis_does_not_apply_to_at_the_baseline_when_it_ran_the_baseline():
    ran = _conditional_grid({"pre,mha": "4", "pre,mqa": "1", "post": "4"})
    held = holding_baseline(ran, ran.table, ["attention"])
    assert held.set_index("label")["axis.attention"].to_dict() == {"pre,mha": "mha", "pre,mqa": "mqa", "post": "mha"}
    other = _conditional_grid({"pre,mha": "4", "pre,mqa": "1", "post": "2"})
    assert holding_baseline(other, other.table, ["attention"]).set_index("label").loc["post", "axis.attention"] == "n/a"


def test_the_shipped_gqa_grid_rebuilt_holds_its_unset_cells_at_mha(tmp_path):
    """results/multi30k-warmup-gqa: the attention axis applies to pre-norm with warm-up only; the other three cells
    leave n_kv_heads unset (4 heads: MHA), so the norm position x warm-up heatmap at attention=mha has all four."""
    root = tmp_path / "multi30k-warmup-gqa"
    shutil.copytree(REPO / "results" / "multi30k-warmup-gqa", root)
    table = build_table(root)  # no run directory here: the committed rows are kept, what ran filled from the plan
    assert set(table["config.model.n_kv_heads"]) == {"4", "2", "1"}
    table.to_csv(root / "results.csv", index=False)
    (root / "results.parquet").unlink()
    results = load_results(root)
    rows = holding_baseline(results, results.completed(), ["attention"])
    assert rows.drop_duplicates("label")["axis.attention"].tolist().count("mha") == 4


# -- our numbers beside published ones -----------------------------------------------------------------------------
def _ours(variant_key: str, params: float) -> Measurement:
    return Measurement("run r (3 seeds)", "wmt14:en-de:bleu", "newstest2014", "metric.bleu", variant_key,
                       "sacreBLEU (signature not recorded)", [27.0, 27.5, 28.0], params=params,
                       model_variant="from-scratch")


def _published(variant_key: str, params_m: float) -> pd.Series:
    return pd.Series({"variant_key": variant_key, "split": "newstest2014", "model_variant": "from-scratch",
                      "params_m": params_m, "metric_variant": "sacreBLEU (signature not given)",
                      "verification": "primary-text"})


def test_two_unknown_bleu_variants_are_not_the_same_variant():
    """Zhang & Sennrich's rows give no sacreBLEU signature; a run of ours that recorded none is not thereby the same
    scorer, tokenization and casing."""
    comparable, text = comparability(_ours("sacrebleu:unspecified", 60e6), _published("sacrebleu:unspecified", 60))
    assert not comparable
    assert text.startswith("NOT directly comparable: unknown metric variant (ours: sacreBLEU (signature not "
                           "recorded); published: sacreBLEU (signature not given))")


def test_a_bleu_variant_one_side_does_not_record_is_unknown_not_different():
    """A run that recorded no signature may have scored as the publication did: not known to be the same, nor
    different; a known scorer that differs is different."""
    _, text = comparability(_ours("sacrebleu:unspecified", 60e6), _published("sacrebleu:13a:cased", 60))
    assert text.startswith("NOT directly comparable: unknown metric variant")
    _, text = comparability(_ours("sacrebleu:unspecified", 60e6), _published("tokenized-bleu:moses", 60))
    assert text.startswith("NOT directly comparable: different metric variant")
    _, text = comparability(_ours("sacrebleu:13a:lowercased", 60e6), _published("sacrebleu:13a:cased", 60))
    assert text.startswith("NOT directly comparable: different metric variant")


def test_bleu_by_a_scorer_the_paper_does_not_name_is_an_unknown_variant_beside_any_bleu_scorer():
    """published.csv's `bleu:unspecified` (Xiong et al., Narang et al.: BLEU, scorer not named) may be sacreBLEU's
    or tokenized BLEU: not known to differ from ours; beside a metric that is no BLEU it differs."""
    for ours in ("sacrebleu:13a:cased", "sacrebleu:unspecified", "tokenized-bleu:moses"):
        _, text = comparability(_ours(ours, 60e6), _published("bleu:unspecified", 60))
        assert text.startswith("NOT directly comparable: unknown metric variant"), ours
    _, text = comparability(_ours("chrf:unspecified", 60e6), _published("bleu:unspecified", 60))
    assert text.startswith("NOT directly comparable: different metric variant")


def test_a_size_not_known_is_never_called_the_same_size():
    comparable, text = comparability(_ours("sacrebleu:13a:cased", math.nan), _published("sacrebleu:13a:cased", math.nan))
    assert comparable  # the size rule applies where both sizes are known, and the sentence says it is not
    assert text == "same metric variant, split and model variant; size not known on both sides"
    _, known = comparability(_ours("sacrebleu:13a:cased", 60e6), _published("sacrebleu:13a:cased", 65))
    assert known == "same metric variant, split, model variant and size"
    from study.report.compare import compare_numbers

    unknown = _published("sacrebleu:13a:cased", math.nan)
    unknown = pd.concat([unknown, pd.Series({"match": "wmt14:en-de:bleu", "train_flops": math.nan, "value": 27.0,
                                             "value_printed": "27.0", "id": "x", "citation": "a paper",
                                             "table": "Table 1", "model": "big"})])
    rows = compare_numbers([_ours("sacrebleu:13a:cased", 60e6)], pd.DataFrame([unknown]))
    assert rows["same_size"].isna().all()  # compare.csv: not True beside size_ratio unknown


def test_a_lowercased_or_cut_word_vocabulary_is_another_perplexity_variant_than_the_published_full_text():
    """A word-level perplexity over a vocabulary cut to task.vocab_size (rarer words read as <unk>) or over
    lowercased text is lower than the full text's: it is never the published 'ppl:word:nonoverlapping' variant."""
    from study.report.measure import Source, measurements_from_source

    rows = pd.DataFrame({"metric.valid_ppl": [100.0], "metric.valid_loss": [4.6]})

    def variants(**task):
        src = Source("x", rows, {"tokenizer": "word", **task}, "lm", "wikitext-2")
        return {m.key: m.variant_key for m in measurements_from_source(src)}

    assert variants()["wikitext2:ppl"] == "ppl:word:nonoverlapping"
    assert variants(vocab_size=10000)["wikitext2:ppl"] == "ppl:word:nonoverlapping:vocab10000"
    assert variants(lowercase=True)["wikitext2:loss"] == "xent-nats:word:lowercased"


def test_a_best_variant_beside_published_numbers_is_said_to_be_chosen_on_its_own_seeds(tmp_path):
    """The best variant is picked by its mean over the seeds it is then shown with: an optimistic number, said so."""
    from synthetic_sweep import make_synthetic_sweep

    from study.report.compare import run_compare

    root = make_synthetic_sweep(tmp_path / "s", axes={"position": ["rope", "alibi"]}, partial=False, problems=False,
                                with_runs=False)
    text = run_compare(load_results(root), tmp_path / "out").markdown.read_text()
    assert ", best variant (" in text and "chosen on the very seeds it is shown with" in text


def test_a_heatmap_draws_the_cell_of_a_plotted_axis_that_does_not_apply_where_the_trial_ran_its_baseline(tmp_path):
    """multi30k-warmup-gqa's norm_position x attention heatmap left (post, mha) empty, "attention not applied",
    though post-norm ran 4 KV heads (MHA): the study's one clear effect (3.6 BLEU) was missing from it."""
    import matplotlib

    matplotlib.use("Agg")
    from study.report.figures import make_figures

    r = load_results(Path(__file__).resolve().parents[1] / "results" / "multi30k-warmup-gqa")
    figs = {f.name: f for f in make_figures(r, tmp_path, formats=("png",), kinds=("heatmap",))}
    assert "post|mha" in figs["translation-bleu-heatmap-norm_position-attention"].series
    assert "none|mha" in figs["translation-bleu-heatmap-warmup-attention"].series


def test_the_html_report_renders_emphasis_and_leaves_code_as_written():
    from study.report.markdown import Doc

    doc = Doc()
    doc.p("variant is *worse*, **disagree**; `*_ppl_at_2x` columns; 2 * 3 * 4")
    body = doc.to_html("t")
    assert "<em>worse</em>" in body and "<strong>disagree</strong>" in body and "*worse*" not in body
    assert "<code>*_ppl_at_2x</code>" in body and "2 * 3 * 4" in body
