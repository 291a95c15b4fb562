"""Published results shipped with the package, each row with its citation and metric variant.

    study/report/published.csv   one row per published number: citation, table, dataset, split, metric,
                                 metric_variant (how it was measured, in words), variant_key (the same,
                                 machine-comparable), model, `model_variant` (which variant of the model the number
                                 is of, machine-comparable: MODEL_VARIANTS), size, value, verification level,
                                 source, `match`: the key our own measurements are filed under (see compare.py),
                                 `context`: the tokens per evaluation window the number was measured at (a
                                 positive integer; empty where the publication does not state it or it does not
                                 apply), compared with our task.seq_len, and `selection`: which model the number
                                 is of (SELECTIONS: `final`, the model at the end of training; `best`, the best
                                 validation value over training; empty where the publication does not say)
    study/report/effects.csv     the published direction of each ablation effect: axis, baseline and variant
                                 value, the published numbers, 'better' / 'worse' / 'same' for the variant,
                                 the magnitude, which of our metrics it is compared with, and
                                 `units_match_ours` ('yes' where the published effect is in the units and on the
                                 scale of that metric of ours: GLUE dev metrics in points on 0-100), and
                                 `held`: where the publication held the other axes ('warmup=none'; several
                                 separated by ';'), in the sweeps' axis vocabulary; compare.py pairs the effect
                                 only with cells that hold them so, in a grid by their axis values and elsewhere by
                                 their configs (Xiong et al. 2020 compare post- with pre-norm without warm-up, and
                                 Post-LN with and without it), and `metric`: the quantity the published direction is
                                 about (EFFECT_METRICS); compare.py compares it only with a metric of ours that
                                 measures that quantity

Curated from ../shared/references/published.md (every number there was read from the paper, an official
repository or, flagged as such, a secondary transcription or a community reproduction).
"""

from __future__ import annotations

import re
from importlib import resources

import pandas as pd

PUBLISHED_COLUMNS = ("id", "citation", "year", "table", "task", "dataset", "split", "metric", "metric_variant",
                     "variant_key", "model", "model_variant", "model_size", "params_m", "train_flops", "setting",
                     "value", "value_printed", "verification", "source", "match", "context", "selection")
REQUIRED = ("id", "citation", "table", "dataset", "split", "metric", "metric_variant", "variant_key", "model", "value",
            "verification", "source", "match")
EFFECT_COLUMNS = ("effect_id", "axis", "baseline", "variant", "our_metric", "published_metric", "published_baseline",
                  "published_variant", "published_direction", "magnitude", "citation", "table", "task", "dataset",
                  "params_m", "evidence", "units_match_ours", "published_ids", "note", "held", "metric")
EFFECT_REQUIRED = ("effect_id", "axis", "baseline", "variant", "our_metric", "published_metric", "published_direction",
                   "magnitude", "citation", "table", "dataset", "metric")
# effects.csv's `metric`: the quantity a published direction is about, with the columns of ours that measure it
# (fnmatch patterns). A direction holds only for the metric it was published on: removing label smoothing improves
# perplexity and lowers BLEU (Vaswani et al. 2017, Table 3 (D)), so an effect is never judged on another quantity.
EFFECT_METRICS = {
    "cross-entropy": ("metric.*loss", "metric.*ppl", "metric.*_ppl_at_2x"),  # perplexity = exp(loss): same direction
    "bleu": ("metric.bleu", "metric.*.bleu"),
    "accuracy": ("metric.*accuracy", "metric.*accuracy_m", "metric.*accuracy_mm"),
    "training-speed": ("cost.train_tokens_per_s",),
    # decoding time, and the KV-cache memory read per token that bounds it (Shazeer 2019; compared by construction)
    "decode-cost": ("cost.kv_cache_bytes_per_token",),
    "average-score": (),  # an average over tasks scored by different metrics (ROUGE, BLEU, F1): none of ours is one
}
DIRECTIONS = ("better", "worse", "same")
# `model_variant`: how the model was obtained, so a number of BERT pretrained with NSP is never paired with one of a
# model pretrained without it, or with a randomly initialised encoder. Empty where it does not apply.
MODEL_VARIANTS = re.compile(r"^(|from-scratch|random-init|(pretrained|zero-shot):[a-z0-9+.\-]+)$")
UNITS_MATCH = ("", "yes", "no")
SELECTIONS = ("", "final", "best")  # published.csv's `selection` (compare.py: ours is always `final`)
CONTEXT = re.compile(r"^([1-9][0-9]*)?$")  # published.csv's `context`: empty or a positive integer (tokens)


def _read(name: str) -> pd.DataFrame:
    with resources.files("study.report").joinpath(name).open("r", encoding="utf-8") as f:
        return pd.read_csv(f, dtype=str, keep_default_na=False)


def load_published() -> pd.DataFrame:
    """The published table, validated (ValueError naming every problem: a misspelt `selection` must never pass),
    `value` as float (NaN where none), every other column as text."""
    table = _read("published.csv")
    problems = validate_published(table)
    if problems:
        raise ValueError("study/report/published.csv: " + "; ".join(problems))
    table["value"] = pd.to_numeric(table["value"], errors="coerce")
    table["params_m"] = pd.to_numeric(table["params_m"], errors="coerce")
    table["train_flops"] = pd.to_numeric(table["train_flops"], errors="coerce")
    return table


def load_effects() -> pd.DataFrame:
    """The effects table, validated (ValueError naming every problem: a misspelt `metric` must never pass)."""
    table = _read("effects.csv")
    problems = validate_effects(table)
    if problems:
        raise ValueError("study/report/effects.csv: " + "; ".join(problems))
    for col in ("published_baseline", "published_variant", "params_m"):
        table[col] = pd.to_numeric(table[col], errors="coerce")
    return table


def _row_name(table: pd.DataFrame, i) -> str:
    return f"row {table.loc[i, 'id'] if 'id' in table else i}"


def validate_published(table: pd.DataFrame) -> list[str]:
    """Every problem with the published table: missing columns, empty required cells (every row needs
    a citation, a table, a metric variant and a value), duplicate ids, a `model_variant`, `context` or `selection`
    outside its vocabulary."""
    problems = [f"missing column {c}" for c in PUBLISHED_COLUMNS if c not in table]
    for c in REQUIRED:
        if c not in table:
            continue
        empty = table[c].isna() | (table[c].astype(str).str.strip() == "")
        problems += [f"{_row_name(table, i)}: empty {c}" for i in table.index[empty]]
    if "id" in table:
        problems += [f"duplicate id {i}" for i in table["id"][table["id"].duplicated()]]
    if "model_variant" in table:
        bad = ~table["model_variant"].fillna("").astype(str).str.match(MODEL_VARIANTS)
        problems += [f"{_row_name(table, i)}: model_variant "
                     f"{table.loc[i, 'model_variant']!r} is not one of from-scratch, random-init, "
                     "pretrained:<objective>, zero-shot:<corpus> or empty" for i in table.index[bad]]
    if "context" in table:
        bad = ~table["context"].fillna("").astype(str).str.match(CONTEXT)
        problems += [f"{_row_name(table, i)}: context {table.loc[i, 'context']!r} is not a positive whole number "
                     "of tokens or empty" for i in table.index[bad]]
    if "selection" in table:
        bad = ~table["selection"].fillna("").astype(str).isin(SELECTIONS)
        problems += [f"{_row_name(table, i)}: selection {table.loc[i, 'selection']!r} is not one of "
                     f"{', '.join(s for s in SELECTIONS if s)} or empty" for i in table.index[bad]]
    return problems


def _held_problems(e: pd.Series) -> list[str]:
    """`held` is empty or 'axis=value' conditions separated by ';', none on the effect's own axis."""
    parts = [p.strip() for p in str(e.get("held", "") or "").split(";") if p.strip()]
    bad = [p for p in parts if "=" not in p or not p.split("=", 1)[1].strip()]
    own = [p for p in parts if p.split("=", 1)[0].strip() == e["axis"]]
    return ([f"effect {e['effect_id']}: held {p!r} is not axis=value" for p in bad] +
            [f"effect {e['effect_id']}: held {p!r} conditions the effect's own axis" for p in own])


def validate_effects(effects: pd.DataFrame, published: pd.DataFrame | None = None) -> list[str]:
    """Every problem with the effects table: missing cells, unknown directions and metrics, a published number that
    contradicts the stated direction's sign, ids that are not in the published table."""
    problems = [f"missing column {c}" for c in EFFECT_COLUMNS if c not in effects]
    for c in EFFECT_REQUIRED:
        if c in effects:
            empty = effects[c].isna() | (effects[c].astype(str).str.strip() == "")
            problems += [f"effect {effects.loc[i, 'effect_id']}: empty {c}" for i in effects.index[empty]]
    for _, e in effects.iterrows():
        if e["published_direction"] not in DIRECTIONS:
            problems.append(f"effect {e['effect_id']}: direction {e['published_direction']!r} not in {DIRECTIONS}")
        if str(e.get("units_match_ours", "")) not in UNITS_MATCH:
            problems.append(f"effect {e['effect_id']}: units_match_ours {e['units_match_ours']!r} not in {UNITS_MATCH}")
        if str(e.get("metric", "")) not in EFFECT_METRICS:
            problems.append(f"effect {e['effect_id']}: metric {e.get('metric')!r} not in {tuple(EFFECT_METRICS)}")
        problems += _held_problems(e)
        if published is not None:
            ids = [i for i in str(e.get("published_ids", "")).split(";") if i]
            missing = [i for i in ids if i not in set(published["id"])]
            problems += [f"effect {e['effect_id']}: unknown published id {i}" for i in missing]
    return problems
