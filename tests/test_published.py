"""The published tables shipped in study/report are well-formed, and `study compare` never pairs numbers
whose metric variants differ without saying so."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

from study.report.collect import load_results
from study.report.compare import (
    Measurement,
    _effect_verdict,
    compare_effects,
    compare_numbers,
    glue_columns,
    run_compare,
    sacrebleu_variant,
)
from study.report.published import load_effects, load_published, validate_effects, validate_published
from synthetic_sweep import make_synthetic_sweep

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_CITATIONS = ("Vaswani et al. 2017", "Xiong et al. 2020", "Press", "Shazeer 2019", "Ainslie et al. 2023",
                      "Devlin et al. 2018", "Liu et al. 2019", "Narang et al. 2021", "bentrevett")


@pytest.fixture(scope="module")
def published():
    return load_published()


@pytest.fixture(scope="module")
def effects():
    return load_effects()


def test_published_table_is_well_formed(published):
    assert validate_published(published) == []
    assert len(published) > 50
    for _, row in published.iterrows():
        assert row["citation"].strip() and row["table"].strip(), row["id"]
        assert row["metric_variant"].strip() and row["variant_key"].strip(), row["id"]
        assert math.isfinite(row["value"]), row["id"]
        printed = re.search(r"[-+]?\d[\d,]*\.?\d*(?:e[-+]?\d+)?", row["value_printed"])  # the number as printed
        assert printed and float(printed.group().replace(",", "")) == pytest.approx(row["value"]), row["id"]


def test_published_table_covers_the_issue_citations(published):
    for citation in REQUIRED_CITATIONS:
        assert published["citation"].str.contains(citation, regex=False).any(), citation
    multi30k = published[published["match"] == "multi30k:de-en:bleu"]
    assert len(multi30k) == 1 and "community" in multi30k["verification"].iloc[0]


def test_validation_catches_missing_citation_and_variant(published):
    broken = published.copy()
    broken.loc[0, "citation"] = ""
    broken.loc[1, "metric_variant"] = " "
    problems = validate_published(broken)
    assert any("empty citation" in p for p in problems) and any("empty metric_variant" in p for p in problems)


def test_every_published_row_states_its_model_variant(published):
    """Devlin's BERT-base GLUE rows are MLM + NSP, Table 5's ablation and RoBERTa's no-NSP formats MLM only, the
    language-modelling and translation rows trained from scratch on the task."""
    variant = published.set_index("id")["model_variant"]
    assert variant["devlin18-t1-sst2"] == variant["devlin18-t5-nsp-sst2"] == "pretrained:mlm+nsp"
    assert variant["devlin18-t5-nonsp-sst2"] == variant["liu19-fullsent-sst2"] == "pretrained:mlm"
    assert variant["hf-runglue-sst2-accuracy"] == "pretrained:mlm+nsp"
    for i in ("nanogpt-shakespeare-char-val", "vaswani17-t3-base-ppl", "press22-alibi-L512-eval1012",
              "bentrevett-multi30k-transformer-bleu"):
        assert variant[i] == "from-scratch", i


def test_validation_catches_an_unknown_model_variant_and_units_flag(published, effects):
    broken = published.copy()
    broken.loc[0, "model_variant"] = "pretrained"  # which objective?
    assert any("model_variant 'pretrained'" in p for p in validate_published(broken))
    no_column = published.drop(columns="model_variant")
    assert "missing column model_variant" in validate_published(no_column)
    bad = effects.copy()
    bad.loc[0, "units_match_ours"] = "maybe"
    assert any("units_match_ours 'maybe'" in p for p in validate_effects(bad, published))


def test_nsp_effects_name_our_glue_columns_and_share_our_units(effects):
    nsp = effects[effects["axis"] == "nsp"]
    assert set(nsp["baseline"]) == {"true"} and set(nsp["variant"]) == {"false"}
    assert set(nsp["our_metric"]) == {"QNLI/accuracy", "MNLI/accuracy_m", "MRPC/accuracy", "SST-2/accuracy"}
    assert set(nsp["units_match_ours"]) == {"yes"}
    assert "test_ppl_at_2x" not in set(effects["our_metric"])  # the split is whichever the sweep has


def test_effects_are_well_formed_and_cite_published_rows(effects, published):
    assert validate_effects(effects, published) == []
    for citation in ("Vaswani", "Xiong", "Press", "Shazeer", "Ainslie", "Devlin", "Liu", "Narang"):
        assert effects["citation"].str.contains(citation).any(), citation


def test_effect_numbers_match_the_published_rows_and_their_direction(effects, published):
    values = published.set_index("id")["value"]
    for _, e in effects.iterrows():
        base_id, var_id = e["published_ids"].split(";")[:2]
        assert values[base_id] == pytest.approx(e["published_baseline"]), e["effect_id"]
        assert values[var_id] == pytest.approx(e["published_variant"]), e["effect_id"]
        metric = e["published_metric"].lower()
        lower_better = any(k in metric for k in ("loss", "perplexity", "ln(ppl)", "us/token"))
        delta = e["published_variant"] - e["published_baseline"]
        improvement = -delta if lower_better else delta
        scale = abs(e["published_baseline"])
        if e["published_direction"] == "better":
            assert improvement > 0, e["effect_id"]
        elif e["published_direction"] == "worse":
            assert improvement < 0, e["effect_id"]
        else:  # 'same': within 1% of the baseline value
            assert abs(delta) <= 0.01 * scale, e["effect_id"]


def test_effect_verdicts():
    assert _effect_verdict("worse", "worse") == "agree"
    assert _effect_verdict("worse", "better") == "disagree"
    assert _effect_verdict("better", "inconclusive") == "inconclusive"
    assert _effect_verdict("same", "inconclusive") == "consistent"
    assert _effect_verdict("same", "worse") == "disagree"
    assert _effect_verdict("better", "no CI (n=1)") == "no CI (n=1)"
    assert _effect_verdict("better", "no pairs") == "no common seeds"  # both may have run, on other seeds
    assert _effect_verdict("better", "direction not declared") == "not compared (direction not declared)"


# -- the comparison ----------------------------------------------------------------------------------------------------
def _pub(**kw):
    row = {"id": "x", "citation": "A et al.", "table": "Table 1", "match": "multi30k:de-en:bleu",
           "split": "test_2016_flickr", "variant_key": "sacrebleu:13a:cased", "metric_variant": "sacreBLEU 13a cased",
           "value": 30.0, "value_printed": "30.0", "model": "m", "params_m": 10.0, "train_flops": float("nan"),
           "verification": "primary-text"}
    row.update(kw)
    return pd.DataFrame([row])


def _ours(vkey="sacrebleu:13a:cased", split="test_2016_flickr"):
    return Measurement("run r", "multi30k:de-en:bleu", split, "metric.test_sets.test_2016_flickr.bleu", vkey,
                       "our words", [37.0], params=5e6)


def test_same_variant_and_split_is_comparable():
    rows = compare_numbers([_ours()], _pub())
    assert rows["comparable"].tolist() == [True] and rows["comparability"][0].startswith("same metric variant")
    assert rows["size_ratio"][0] == "1/2"


def test_different_metric_variant_is_never_paired_silently():
    rows = compare_numbers([_ours(vkey="sacrebleu:intl:cased")], _pub())
    assert rows["comparable"].tolist() == [False] and not rows["same_metric_variant"][0]
    assert "NOT directly comparable: different metric variant" in rows["comparability"][0]
    rows = compare_numbers([_ours(split="test_2017_flickr")], _pub())
    assert "different split" in rows["comparability"][0] and not rows["comparable"][0]


def test_compare_marks_every_mismatch_in_the_markdown(tmp_path):
    """The recorded Multi30k run (sacreBLEU, cased, detokenized) beside the community result (torchtext BLEU on
    lowercased tokens): shown, and marked not comparable with the reason."""
    run = ROOT / "bench" / "results" / "run-multi30k-de-en.json"
    if not run.is_file():
        pytest.skip("bench/results/run-multi30k-de-en.json not present")
    comparison = run_compare(None, tmp_path, runs=[run])
    numbers = comparison.numbers
    m30k = numbers[numbers["key"] == "multi30k:de-en:bleu"]
    assert len(m30k) == 1 and m30k["split"].iloc[0] == "test_2016_flickr"
    assert m30k["our_variant_key"].iloc[0] == "sacrebleu:13a:cased"
    for _, r in numbers.iterrows():
        if not r["same_metric_variant"]:
            assert not r["comparable"] and "different metric variant" in r["comparability"]
    md = comparison.markdown.read_text()
    assert "torchtext" in md and "| **no** |" in md
    assert (tmp_path / "compare.csv").is_file()


def test_compare_effects_on_a_synthetic_sweep(tmp_path, effects):
    root = make_synthetic_sweep(tmp_path / "s", axes={"position": ["rope", "alibi", "sinusoidal", "learned"]},
                                partial=False, problems=False, with_runs=False, noise=0.002)
    results = load_results(root)
    tested, untested = compare_effects(results, effects)
    by_id = tested.set_index("effect_id")
    # the synthetic sweep extrapolates like Press et al.: ALiBi flat, sinusoidal blowing up
    assert by_id.loc["alibi-vs-rope-extrapolation", "verdict"] == "agree"
    assert by_id.loc["sinusoidal-vs-rope-extrapolation", "verdict"] == "agree"
    assert by_id.loc["alibi-vs-rope-extrapolation", "our_n_pairs"] == 3
    # effects between two non-baseline variants are paired too (learned vs sinusoidal, both in the sweep)
    assert by_id.loc["sinusoidal-vs-learned", "our_baseline_label"] == "position=learned"
    assert "axis not in this sweep" in set(untested["reason"])
    assert "value t5_bias not in this sweep" in set(untested["reason"])
    md = run_compare(results, tmp_path / "out", runs=[]).markdown.read_text()
    assert "Published effects: reproduced or not" in md and "**agree**" in md


def test_glue_mapping_and_sacrebleu_signatures():
    cols = ["metric.qnli/accuracy", "metric.qnli/accuracy_std", "metric.mnli/accuracy_m", "metric.cola/mcc",
            "metric.valid_loss"]
    assert glue_columns(cols) == {"glue:qnli:accuracy": "metric.qnli/accuracy",
                                  "glue:mnli_m:accuracy": "metric.mnli/accuracy_m", "glue:cola:mcc": "metric.cola/mcc"}
    assert sacrebleu_variant("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0")[0] == "sacrebleu:13a:cased"
    assert sacrebleu_variant("nrefs:1|case:lc|tok:intl")[0] == "sacrebleu:intl:lowercased"
    assert sacrebleu_variant(None)[0] == "sacrebleu:unspecified"
