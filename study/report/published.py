"""Published results shipped with the package, each row with its citation and metric variant.

    study/report/published.csv   one row per published number: citation, table, dataset, split, metric,
                                 metric_variant (how it was measured, in words), variant_key (the same,
                                 machine-comparable), model and size, value, verification level, source, and
                                 `match`: the key our own measurements are filed under (see compare.py)
    study/report/effects.csv     the published direction of each ablation effect: axis, baseline and variant
                                 value, the published numbers, 'better' / 'worse' / 'same' for the variant,
                                 the magnitude, and which of our metrics it is compared with

Curated from ../shared/references/published.md (every number there was read from the paper, an official
repository or, flagged as such, a secondary transcription or a community reproduction).
"""

from __future__ import annotations

from importlib import resources

import pandas as pd

PUBLISHED_COLUMNS = ("id", "citation", "year", "table", "task", "dataset", "split", "metric", "metric_variant",
                     "variant_key", "model", "model_size", "params_m", "train_flops", "setting", "value",
                     "value_printed", "verification", "source", "match")
REQUIRED = ("id", "citation", "table", "dataset", "split", "metric", "metric_variant", "variant_key", "model", "value",
            "verification", "source", "match")
EFFECT_COLUMNS = ("effect_id", "axis", "baseline", "variant", "our_metric", "published_metric", "published_baseline",
                  "published_variant", "published_direction", "magnitude", "citation", "table", "task", "dataset",
                  "params_m", "evidence", "published_ids", "note")
EFFECT_REQUIRED = ("effect_id", "axis", "baseline", "variant", "our_metric", "published_metric", "published_direction",
                   "magnitude", "citation", "table", "dataset")
DIRECTIONS = ("better", "worse", "same")


def _read(name: str) -> pd.DataFrame:
    with resources.files("study.report").joinpath(name).open("r", encoding="utf-8") as f:
        return pd.read_csv(f, dtype=str, keep_default_na=False)


def load_published() -> pd.DataFrame:
    """The published table, `value` as float (NaN where none), every other column as text."""
    table = _read("published.csv")
    table["value"] = pd.to_numeric(table["value"], errors="coerce")
    table["params_m"] = pd.to_numeric(table["params_m"], errors="coerce")
    table["train_flops"] = pd.to_numeric(table["train_flops"], errors="coerce")
    return table


def load_effects() -> pd.DataFrame:
    table = _read("effects.csv")
    for col in ("published_baseline", "published_variant", "params_m"):
        table[col] = pd.to_numeric(table[col], errors="coerce")
    return table


def validate_published(table: pd.DataFrame) -> list[str]:
    """Every problem with the published table: missing columns, empty required cells (every row needs
    a citation, a table, a metric variant and a value), duplicate ids."""
    problems = [f"missing column {c}" for c in PUBLISHED_COLUMNS if c not in table]
    for c in REQUIRED:
        if c not in table:
            continue
        empty = table[c].isna() | (table[c].astype(str).str.strip() == "")
        problems += [f"row {table.loc[i, 'id'] if 'id' in table else i}: empty {c}" for i in table.index[empty]]
    if "id" in table:
        problems += [f"duplicate id {i}" for i in table["id"][table["id"].duplicated()]]
    return problems


def validate_effects(effects: pd.DataFrame, published: pd.DataFrame | None = None) -> list[str]:
    """Every problem with the effects table: missing cells, unknown directions, a published number that
    contradicts the stated direction's sign, ids that are not in the published table."""
    problems = [f"missing column {c}" for c in EFFECT_COLUMNS if c not in effects]
    for c in EFFECT_REQUIRED:
        if c in effects:
            empty = effects[c].isna() | (effects[c].astype(str).str.strip() == "")
            problems += [f"effect {effects.loc[i, 'effect_id']}: empty {c}" for i in effects.index[empty]]
    for _, e in effects.iterrows():
        if e["published_direction"] not in DIRECTIONS:
            problems.append(f"effect {e['effect_id']}: direction {e['published_direction']!r} not in {DIRECTIONS}")
        if published is not None:
            ids = [i for i in str(e.get("published_ids", "")).split(";") if i]
            missing = [i for i in ids if i not in set(published["id"])]
            problems += [f"effect {e['effect_id']}: unknown published id {i}" for i in missing]
    return problems
