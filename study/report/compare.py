"""Our results beside the published ones, with the comparability of every pair stated.

Two comparisons:

* numbers: each of our measurements (a sweep's baseline and best variant, recorded runs; see measure.py) filed
  under a `match` key (`tinyshakespeare:loss`, `multi30k:de-en:bleu`, `glue:qnli:accuracy`, ...) beside the
  published rows with that key. A pair is *comparable* only when the metric variant (`variant_key`: scorer,
  tokenization, casing, unit), the split and the model variant (`model_variant`: trained from scratch, pretrained
  with MLM + NSP or MLM only, randomly initialised) and the model size (within 2x in parameters) are the same, and,
  where the published row states them (published.csv's `context` and `selection`), the evaluation context (tokens
  per window: our Measurement.context, the run's task.seq_len) and which model is reported (ours: the model at the
  end of training; `best`: the best validation value over training, picked on the split it reports), and ours covers
  the whole split (a language model's task.eval_tokens can cut its evaluation to the split's first tokens:
  Measurement.eval_subset); otherwise the row says what differs. Size and training compute (where the publication
  gives it) are stated as ratios.
* effects: for each published ablation effect whose axis the sweep varies, on a metric of ours that measures the
  quantity the publication states the direction for (effects.csv's `metric`: a perplexity direction is never judged
  on BLEU) and on cells that hold the other axes where the publication held them (effects.csv's `held`, checked
  against the cells' configs where the sweep does not vary the axis), our paired difference (same seeds) beside the
  published direction: agree / disagree / inconclusive (our interval contains zero); 'consistent' where
  the publication reports no clear difference and our interval contains zero; 'by construction' where our metric is
  a cost computed from the config (a KV-cache difference is the definition of MQA, not evidence about it). Each
  tested effect also has its paired t-test p-value, a Holm-adjusted verdict over all effects tested in the report,
  and the smallest difference its seeds could have detected.
"""

from __future__ import annotations

import datetime
import math
from fnmatch import fnmatchcase
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from study.report.collect import (
    AT_2X,
    SPLIT_WORDS,
    Declaration,
    SweepResults,
    at_2x_column,
    config_field,
    metric_column,
    metric_name,
    normalise_value,
    ran_off_plan,
)
from study.report.markdown import Doc, fmt, fmt_uncertain
from study.report.measure import (  # noqa: F401  (re-exported: the comparison's public names)
    GLUE_METRICS,
    GLUE_TASKS,
    Measurement,
    dataset_key,
    glue_columns,
    load_run,
    model_variant_words,
    run_measurements,
    sacrebleu_variant,
    sweep_measurements,
)
from study.report.published import EFFECT_METRICS, load_effects, load_published
from study.report.stats import (
    ALPHA,
    NO_SPREAD_TEST,
    NO_SPREAD_WHY,
    POWER,
    holm_adjust,
    holm_withdrawn,
    lower_is_better,
    no_spread_text,
    paired_difference,
)

BY_CONSTRUCTION = "by construction"
COUNTED = ("agree", "disagree")  # the verdicts that claim something, and that Holm's correction may withdraw


# -- numbers -------------------------------------------------------------------------------------------------------
def _ratio(ours: float, theirs: float) -> str:
    if not (math.isfinite(ours) and math.isfinite(theirs)) or ours <= 0 or theirs <= 0:
        return "unknown"
    r = ours / theirs
    return f"{r:.3g}×" if r >= 1 else f"1/{1 / r:.3g}"


SIZE_FACTOR = 2.0  # models further apart than this in parameters are not compared directly: scale changes the number


def _same_model_variant(m: Measurement, pub: pd.Series) -> bool:
    theirs = str(pub.get("model_variant", "") or "")
    return not theirs or m.model_variant == theirs


def _published_params(row: pd.Series) -> float:
    """A published row's parameter count (its `params_m` in millions), NaN when it gives none."""
    return float(row["params_m"]) * 1e6 if pd.notna(row.get("params_m")) else math.nan


def _size(m: Measurement, pub: pd.Series) -> float:
    """Our parameters / the published model's, NaN when either is not known."""
    theirs = _published_params(pub)
    return m.params / theirs if m.params and math.isfinite(m.params) and theirs > 0 else math.nan


def _same_size(m: Measurement, pub: pd.Series) -> bool | None:
    """Within SIZE_FACTOR in parameters; None where a side's size is not known (the size rule then does not apply,
    and the sentence says so: compare.csv's same_size is left empty, never True)."""
    size = _size(m, pub)
    return None if not math.isfinite(size) else 1 / SIZE_FACTOR <= size <= SIZE_FACTOR


def _same_metric_variant(m: Measurement, pub: pd.Series) -> bool:
    """The same scorer, tokenization, casing and unit: equal variant keys, neither of them unknown (a sacreBLEU score
    whose signature neither side records is not known to be the same variant: `sacrebleu:unspecified`)."""
    keys = (str(m.variant_key), str(pub["variant_key"]))
    return keys[0] == keys[1] and not any("unspecified" in k.split(":") for k in keys)


UNNAMED_BLEU = "bleu"  # published.csv's scorer for BLEU whose scorer a paper does not name


def _variant_difference(ours: str, theirs: str) -> str:
    """'unknown' where the two metric variants may be the same but one side does not say (`sacrebleu:unspecified`
    beside `sacrebleu:13a:cased`, or both unspecified; published.csv's `bleu:unspecified`, BLEU by a scorer the paper
    does not name, beside any BLEU scorer's); 'different' where what is known differs (another scorer). A variant
    key is `scorer:details`."""
    keys = [ours.split(":"), theirs.split(":")]
    if not any("unspecified" in k for k in keys):
        return "different"
    scorers = {k[0] for k in keys}
    unnamed_bleu = any(k == [UNNAMED_BLEU, "unspecified"] for k in keys) and all(s.endswith("bleu") for s in scorers)
    return "unknown" if len(scorers) == 1 or unnamed_bleu else "different"


# Which model a number is of (published.csv's `selection`; empty: not stated). Every record of ours is the model at
# the end of training: study.run.single computes the final metrics after fit (the EMA weights where train.ema_decay
# is set), never at a checkpoint picked by a validation score. A best-over-training value picked on the split it
# reports is biased low (the minimum of noisy evaluations), so it is another number than a final one.
OUR_SELECTION = "final"
SELECTION_WORDS = {"final": "the model at the end of training",
                   "best": "the best validation value over training, picked on the split it reports"}


def _published_context(pub: pd.Series) -> int | None:
    """published.csv's `context`: the tokens per evaluation window the number is measured at (None: not stated)."""
    value = pd.to_numeric(str(pub.get("context", "") or ""), errors="coerce")
    return int(value) if pd.notna(value) else None


def _same_context(context: int | None, pub: pd.Series) -> bool | None:
    """The same evaluation context (True also where the publication states none: the row does not depend on one);
    None where the publication states one and ours is not known, which is never called the same."""
    theirs = _published_context(pub)
    if theirs is None:
        return True
    return None if context is None else context == theirs


def _same_selection(pub: pd.Series) -> bool:
    return str(pub.get("selection", "") or "") in ("", OUR_SELECTION)


def _setting_differences(m: Measurement, pub: pd.Series) -> tuple[list[str], list[str]]:
    """(differences, notes) in what the number is read at: the evaluation context (ours: task.seq_len tokens per
    window; a longer context lowers a language model's loss), which model is reported (see OUR_SELECTION), what
    part of the split it covers (ours: Measurement.eval_subset; a published number is taken to cover its split) and,
    for a fine-tuned pretrained model, its pretraining (corpus and length decide much of a GLUE score)."""
    parts, notes = [], []
    theirs = _published_context(pub)
    if theirs is not None and m.context is None:
        parts.append(f"evaluation context not known on our side (published: {theirs} tokens per window)")
    elif not _same_context(m.context, pub):
        parts.append(f"different evaluation context (ours: {m.context} tokens per window; published: {theirs})")
    if not _same_selection(pub):
        selection = str(pub["selection"])
        parts.append(f"different model reported (ours: {SELECTION_WORDS[OUR_SELECTION]}; published: "
                     f"{SELECTION_WORDS.get(selection, selection)})")
    if m.eval_subset:
        parts.append(f"only part of the split evaluated (ours: {m.eval_subset}, as task.eval_tokens sets; "
                     "published: the whole split)")
    if m.model_variant.startswith("pretrained:") and str(pub.get("model_variant", "")).startswith("pretrained:"):
        # task.init_from is always one of our pretrain runs: never the published corpus and budget
        # (published.csv's `setting` is the fine-tuning recipe the number was read with, not the pretraining)
        parts.append(f"different pretraining (ours: a `pretrain` run of this project; published: that of "
                     f"{pub.get('model') or 'the published model'})")
    return parts, notes


def comparability(m: Measurement, pub: pd.Series) -> tuple[bool, str]:
    """(comparable, sentence): comparable only when the metric variant (known on both sides), the split, the model
    variant (where the published row states one), the size (within a factor SIZE_FACTOR in parameters, where both
    are known), the part of the split evaluated (ours: the whole split) and, where the published row states them,
    the evaluation context (ours: m.context, task.seq_len) and the model reported (final or best) are the same;
    otherwise every difference is named, and a size or context not known is never called the same."""
    same_variant = _same_metric_variant(m, pub)
    same_split = m.split.lower() == str(pub["split"]).lower()
    same_model = _same_model_variant(m, pub)
    parts = []
    if not same_model:
        parts.append(f"different model variant (ours: {model_variant_words(m.model_variant)}; published: "
                     f"{model_variant_words(str(pub['model_variant']))})")
    if not same_variant:
        what = _variant_difference(str(m.variant_key), str(pub["variant_key"]))
        parts.append(f"{what} metric variant (ours: {m.variant_words}; published: {pub['metric_variant']})")
    if not same_split:
        parts.append(f"different split (ours: {m.split}; published: {pub['split']})")
    setting, notes = _setting_differences(m, pub)
    parts += setting
    same_size, pub_params = _same_size(m, pub), _published_params(pub)
    if same_size is False:
        parts.append(f"different size (parameters ours/published {_ratio(m.params, pub_params)})")
    comparable = same_variant and same_split and same_model and same_size is not False and not setting
    size_known = math.isfinite(_size(m, pub))
    notes += [] if size_known else ["size not known on both sides"]
    if "community" in str(pub["verification"]).lower():
        notes.append("community result, not a peer-reviewed number")
    elif "secondary" in str(pub["verification"]).lower():
        notes.append("published number from a secondary transcription")
    same = "same metric variant, split, model variant and size" if size_known else \
        "same metric variant, split and model variant"
    head = same if comparable else "NOT directly comparable: " + "; ".join(parts)
    return comparable, head + ("; " + "; ".join(notes) if notes else "")


def compare_numbers(measurements: list[Measurement], published: pd.DataFrame) -> pd.DataFrame:
    """Each published row beside each of our measurements filed under its `match` key (those on its split where
    any are), with the comparability stated."""
    rows = []
    by_key: dict[str, list[Measurement]] = {}
    for m in measurements:
        by_key.setdefault(m.key, []).append(m)
    for _, pub in published.iterrows():
        ours = by_key.get(pub["match"], [])
        same = [m for m in ours if m.split.lower() == str(pub["split"]).lower()]
        for m in same or ours:
            ci = m.interval
            comparable, text = comparability(m, pub)
            pub_flops = pub["train_flops"] if pd.notna(pub["train_flops"]) else math.nan
            rows.append({
                "ours": m.source, "key": m.key, "split": m.split, "metric": m.metric,
                "our_mean": ci.mean, "our_ci_lo": ci.lo, "our_ci_hi": ci.hi, "our_n": ci.n, "our_sd": ci.sd,
                "our_metric_variant": m.variant_words, "our_variant_key": m.variant_key,
                "our_model_variant": m.model_variant, "our_note": m.note,
                "published": pub["value"], "published_printed": pub["value_printed"], "published_id": pub["id"],
                "citation": f"{pub['citation']}, {pub['table']}", "published_model": pub["model"],
                "published_model_variant": pub.get("model_variant", ""),
                "published_split": pub["split"], "published_metric_variant": pub["metric_variant"],
                "published_variant_key": pub["variant_key"], "verification": pub["verification"],
                "same_metric_variant": _same_metric_variant(m, pub),
                "same_split": m.split.lower() == str(pub["split"]).lower(),
                "same_model_variant": _same_model_variant(m, pub), "same_size": _same_size(m, pub),
                "our_context": m.context, "published_context": _published_context(pub),
                "same_context": _same_context(m.context, pub), "our_selection": OUR_SELECTION,
                "published_selection": str(pub.get("selection", "") or ""), "same_selection": _same_selection(pub),
                "our_eval_subset": m.eval_subset, "same_eval_subset": not m.eval_subset,
                "comparable": comparable,
                "comparability": text, "size_ratio": _ratio(m.params, _published_params(pub)),
                "compute_ratio": _ratio(m.train_flops, pub_flops) if math.isfinite(pub_flops) else "not published",
            })
    return pd.DataFrame(rows)


# -- pairs of cells -------------------------------------------------------------------------------------------------
NOT_APPLIED = "n/a"  # a conditional axis's value in the cells its `when` leaves out: the recipe's setting holds there


@dataclass(frozen=True)
class CellPair:
    """Two cells of a sweep that differ in one axis: `held` names every other axis's value in both (grids)."""

    baseline: str
    variant: str
    held: tuple[tuple[str, str], ...]


def _cells(results: SweepResults) -> dict[str, dict[str, str]]:
    """label -> {axis: value} of every cell with trials that ran as planned, in variant order; NOT_APPLIED where an
    axis does not apply. A trial relabelled by what ran (`<label> (ran: ...)`) is no cell of the design: where its
    axes equal another cell's it would pair a second time under that cell's values, and join Holm's family."""
    rows = results.table[~ran_off_plan(results.table)].drop_duplicates("label").set_index("label")
    axes = [a for a in results.axes if f"axis.{a}" in rows]

    def value(label: str, axis: str) -> str:
        v = rows.loc[label, f"axis.{axis}"]
        return NOT_APPLIED if pd.isna(v) else str(v)

    return {lbl: {a: value(lbl, a) for a in axes} for lbl in results.variant_order if lbl in rows.index}


def _held_alike(results: SweepResults, axis: str, labels: tuple[str, str], values: tuple[str, str]) -> bool:
    """Do two cells hold `axis` alike? Both at the same value; or, where it does not apply to one of them, only when
    they ran every field the axis sets alike (`SweepResults.set_alike`: an unset field resolved where the table
    records it, so a cell leaving n_kv_heads unset holds MHA as a cell that spells it out does)."""
    if NOT_APPLIED not in values:
        return normalise_value(values[0]) == normalise_value(values[1])
    fields = (results.plan.get("axis_fields") or {}).get(axis) or []
    if not fields:
        return values[0] == values[1]
    return results.set_alike(labels, fields)


def cell_pairs(results: SweepResults, axis: str, baseline: str, variant: str) -> list[CellPair]:
    """Every (baseline cell, variant cell) that differ in `axis` alone: OFAT's baseline and one-axis points, and in a
    grid one pair for each setting of the other axes (post-norm without vs with warm-up, pre-norm ...)."""
    cells, pairs = _cells(results), []

    def at(value: str) -> list[tuple[str, dict[str, str]]]:
        return [(lbl, a) for lbl, a in cells.items() if normalise_value(a.get(axis, NOT_APPLIED)) ==
                normalise_value(value)]

    for b_label, b_axes in at(baseline):
        for v_label, v_axes in at(variant):
            others = [a for a in b_axes if a != axis]
            if all(_held_alike(results, a, (b_label, v_label), (b_axes[a], v_axes[a])) for a in others):
                held = tuple((a, b_axes[a] if b_axes[a] != NOT_APPLIED else v_axes[a]) for a in others)
                pairs.append(CellPair(b_label, v_label, held))
    return pairs


def held_conditions(e: pd.Series) -> dict[str, str]:
    """effects.csv's `held`: 'warmup=none; ...', the other axes' settings under which the effect was published."""
    parts = [p.split("=", 1) for p in str(e.get("held", "") or "").split(";") if "=" in p]
    return {k.strip(): v.strip() for k, v in parts}


def _meets(pair: CellPair, conditions: dict[str, str]) -> bool:
    """A pair the publication's condition covers on the axes the sweep varies: every condition on an axis the pair
    holds is met (a condition on an axis the sweep does not vary is checked in the cells' configs: _unvaried_held)."""
    held = dict(pair.held)
    return all(normalise_value(held[a]) == normalise_value(v) for a, v in conditions.items() if a in held)


def _held_text(held) -> str:
    return ", ".join(f"{a}={v}" for a, v in held if v != NOT_APPLIED)


# What a `held` condition means in config fields where the sweep does not vary its axis (a sweep that varies it
# defines its values itself), in the shipped sweeps' vocabulary (experiments/sweeps/multi30k_warmup_gqa.yaml).
HELD_FIELDS = {"warmup": {"none": {"train.warmup_steps": 0}}}


def _condition_fields(config: dict, axis: str, value: str) -> dict | None:
    """The config fields `axis=value` stands for: HELD_FIELDS, else the model, train or task field the axis is named
    after (norm_position=post: model.norm_position is post); None when neither knows it."""
    if axis in HELD_FIELDS:
        return HELD_FIELDS[axis].get(normalise_value(value))
    section = next((s for s in ("model", "train", "task") if axis in (config.get(s) or {})), None)
    return {f"{section}.{axis}": value} if section else None


def _unvaried_held(results: SweepResults, e: pd.Series, pair: CellPair) -> tuple[str, str]:
    """(why the pair is not compared, '' when it is; what its cells hold): every `held` condition on an axis the sweep
    does not vary, checked in both cells' configs. A field a config leaves unset is not taken for its default: an
    unresolved condition is a reason, never a silent pass."""
    held = []
    for axis, value in held_conditions(e).items():
        if axis in results.axes:
            continue  # _meets compares the cells' axis values
        head = f"published at {axis}={value}"
        configs = [results.experiment_config(label) for label in (pair.baseline, pair.variant)]
        fields = _condition_fields(configs[0], axis, value)
        if not fields:
            return f"{head}; not checked: no config field is known for {axis}={value}", ""
        unset = sorted({f for c in configs for f in fields if config_field(c, f) is None})
        if unset:
            return f"{head}; not checked: the cells' configs do not set {', '.join(unset)}", ""
        have = [", ".join(f"{f}={config_field(c, f)}" for f in fields) for c in configs]
        text = have[0] if have[0] == have[1] else f"{have[0]} ({pair.baseline}), {have[1]} ({pair.variant})"
        if any(normalise_value(config_field(c, f)) != normalise_value(v) for c in configs for f, v in fields.items()):
            return f"{head}; this sweep's cells have {text}", ""
        held.append(f"this sweep does not vary {axis}: its cells hold it ({text})")
    return "", "; ".join(held)


# -- effects -------------------------------------------------------------------------------------------------------
def _effect_verdict(published: str, ours: str, withheld: bool = False) -> str:
    """Our verdict beside the published direction. `withheld`: our pairs gave a verdict that a divergence withdrew
    (stats.PairedDifference.verdict), so 'inconclusive' does not mean our interval contains zero: never 'consistent'."""
    if withheld:
        return "inconclusive"
    if ours == "no pairs":  # both cells may have run, on no seed in common: nothing is paired
        return "no common seeds"
    if ours == "not run":
        return "not run"
    if ours == "not measured":
        return "not measured"
    if ours == "direction not declared":
        return "not compared (direction not declared)"
    if ours.startswith("no CI"):
        return "no CI (n=1)"
    if published == "same":
        return "consistent" if ours == "inconclusive" else "disagree"
    if ours == "inconclusive":
        return "inconclusive"
    return "agree" if ours == published else "disagree"


def holm_verdict(verdict: str, holm_p: float) -> str:
    """The verdict after Holm's correction: an agree/disagree whose adjusted p-value is not below 0.05 is withdrawn
    (inconclusive); other verdicts stand. Never 'consistent', even where the publication reports no difference:
    that word says our interval contains zero, and a withdrawn disagree's interval excludes it."""
    return holm_withdrawn(verdict, holm_p, COUNTED)


def resolve_metric(results: SweepResults, name: str, task: str) -> tuple[str | None, Declaration | None]:
    """Our column for an effect's `our_metric` and its declaration: 'objective' (the declared objective),
    'ppl_at_2x' (whichever `<split>_ppl_at_2x` the sweep has: Tiny Shakespeare's validation, WikiText-2's test), a
    metric name ('SST-2/accuracy') or a cost ('cost.kv_cache_bytes_per_token'). (None, ...) when the sweep lacks
    it; (column, None) when nothing declares it."""
    if name == "objective":
        metric, _ = results.objective(task)
        return metric_column(metric), results.declaration(metric, task)
    if name == "ppl_at_2x":
        col = at_2x_column(results.completed(task)) or at_2x_column(results.table)
        return col, results.declaration(col, task) if col else None
    if name.startswith("glue."):  # glue.<task>.<metric>: the match-key spelling
        parts = name.split(".")
        key = f"glue:{GLUE_TASKS.get(parts[1], parts[1])}:{GLUE_METRICS.get(parts[2], parts[2])}"
        col = glue_columns(results.table.columns).get(key)
        return col, results.declaration(col, task) if col else None
    col = metric_column(name)
    return (col if col in results.table else None), results.declaration(col, task)


def _split_of(col: str | None) -> str:
    """The split a column measures, as named: `valid_*` validation, `test_*` test, else ''."""
    name = (col or "").removeprefix("metric.")
    m = AT_2X.match(col or "")
    prefix = m["split"] if m else name.split("_", 1)[0]
    return SPLIT_WORDS.get(prefix, "") if prefix in ("valid", "test") else ""


def _mean(done: pd.DataFrame, label: str, col: str) -> float:
    vals = pd.to_numeric(done.loc[done["label"] == label, col], errors="coerce") if col in done else pd.Series([])
    return float(vals.mean()) if vals.notna().any() else math.nan


def _steps(results: SweepResults, done: pd.DataFrame, label: str) -> str:
    """'ours 600 training steps of 64 examples': the training length of a (single-stage) sweep's cell, as recorded;
    a study in stages: its first stage's data and training length (the pretraining a published ablation differs in
    most: BERT's 1M steps on BooksCorpus and Wikipedia against a short run on a small corpus)."""
    if results.stages:
        return _first_stage_budget(results, done, label)
    steps = pd.to_numeric(done.loc[done["label"] == label, "steps"], errors="coerce") if "steps" in done else None
    if steps is None or not steps.notna().any():
        return ""
    batch = ((results.experiment_config(label).get("train") or {}).get("batch_size"))
    return f"ours {int(steps.median())} training steps" + (f" of {batch} examples" if batch else "")


def _first_stage_budget(results: SweepResults, done: pd.DataFrame, label: str) -> str:
    """The first stage's dataset and training length from the cell's config (whose resolved form each trial's
    `ran_as_planned` checks); its steps are the budget `train.max_steps`, which a time budget may have cut."""
    first = results.stages[0]
    cfg = results.experiment_config(label, first)
    task, train = cfg.get("task") or {}, cfg.get("train") or {}
    if not task.get("dataset") or not train.get("max_steps"):
        return ""
    cut = done.loc[done["label"] == label, "stopped_by"].eq("time").any() if "stopped_by" in done else False
    batch, seq_len = train.get("batch_size"), task.get("seq_len")
    return (f"our {first} stage: {task['dataset']}, {train['max_steps']} steps"
            + (f" of {batch} x {seq_len} tokens" if batch and seq_len else "")
            + (" (some cut short by train.max_time_s)" if cut else ""))


def _held_notes(results: SweepResults, e: pd.Series, pair: CellPair) -> list[str]:
    """The publication's condition on the other axes, and how the cells hold those this sweep does not vary."""
    if not held_conditions(e):
        return []
    return [f"published at {e['held']}", _unvaried_held(results, e, pair)[1]]


def _effect_notes(results: SweepResults, e: pd.Series, task: str, done: pd.DataFrame, pair: CellPair,
                  split: str, metric: str, spec: Declaration | None) -> str:
    """What differs between the published effect and our pair: task and dataset, metric, split, the publication's
    condition on the other axes, model size, training length, and the effect's own note."""
    notes = []
    ours = ", ".join(map(str, done["dataset"].dropna().unique())) or task
    if str(e["task"]) != task or str(e["dataset"]).lower() != ours.lower():
        notes.append(f"published on {e['dataset']} ({e['task']}), ours on {ours} ({task})")
    if str(e.get("units_match_ours", "")) != "yes":
        described = f"{metric}, {spec.description}" if spec is not None and spec.description else metric
        notes.append(f"different metric (published: {e['published_metric']}; ours: {described})")
    if split:
        notes.append(f"ours on the {split} split")
    if results.stages:
        notes.append(f"pairs are {results.stages[0]} seeds (trials of the study in stages "
                     f"{' → '.join(results.stages)})")
    notes += _held_notes(results, e, pair)
    notes.append(f"model size ratio ours/published "
                 f"{_ratio(_mean(done, pair.baseline, 'cost.parameters'), _published_params(e))}")
    notes.append(_steps(results, done, pair.baseline))
    if str(e.get("note", "")).strip():
        notes.append(str(e["note"]))
    return "; ".join(n for n in notes if n)


def _power_columns(e: pd.Series, spec: Declaration | None, d) -> dict:
    """The minimum detectable difference and whether the published effect exceeds it (only where the published
    effect is in our units: effects.csv's units_match_ours, and our metric declared on 0-100)."""
    mde = d.mde if d is not None else math.nan
    published_effect = float(e["published_variant"]) - float(e["published_baseline"]) \
        if pd.notna(e["published_variant"]) and pd.notna(e["published_baseline"]) else math.nan
    same_units = str(e.get("units_match_ours", "")) == "yes" and spec is not None and spec.scale.startswith("0-100")
    detectable = ("yes" if abs(published_effect) >= mde else "no") if same_units and math.isfinite(mde) \
        and math.isfinite(published_effect) else ""
    return {"published_effect": published_effect, "our_mde": mde, "same_units": same_units,
            "published_effect_detectable": detectable}


def _pair_task(results: SweepResults, pair: CellPair) -> str:
    task = results.table.loc[results.table["label"] == pair.variant, "task"].dropna()
    return str(task.iloc[0]) if len(task) else results.tasks[0]


def _metric_reason(results: SweepResults, e: pd.Series, pair: CellPair) -> str:
    """Why the pair's metric is not one the published direction is about ('' when it is, or when the sweep lacks
    it: 'not measured'). A direction holds for its metric only: removing label smoothing improves perplexity and
    lowers BLEU (Vaswani et al. 2017)."""
    patterns = EFFECT_METRICS.get(str(e.get("metric", "") or ""))
    if patterns is None:
        return f"effects.csv names no known metric for its direction ({e.get('metric')!r})"
    col, _ = resolve_metric(results, e["our_metric"], _pair_task(results, pair))
    if col is None or any(fnmatchcase(col, p) for p in patterns):
        return ""
    return f"published on {e['published_metric']}; this sweep's metric is {metric_name(col)}"


def _definition_reason(results: SweepResults, e: pd.Series, pair: CellPair) -> str:
    """Why the pair's metric cannot carry the effect: the two cells ran a field that defines it differently
    (SweepResults.defined_differently), so their difference measures that too; '' when they measure it alike."""
    task = _pair_task(results, pair)
    col, _ = resolve_metric(results, e["our_metric"], task)
    differ = results.defined_differently(col, task, [pair.baseline, pair.variant]) if col else {}
    return "; ".join(f"{metric_name(col)} is defined by `{f}`, which the two cells ran differently ({', '.join(v)})"
                     for f, v in differ.items())


def _our_difference(results: SweepResults, e: pd.Series, pair: CellPair) -> tuple:
    """(task, column, declaration, paired difference or None, our direction) of one pair on the effect's metric."""
    task = _pair_task(results, pair)
    col, spec = resolve_metric(results, e["our_metric"], task)
    done = results.completed(task)
    if col is None or col not in done:
        return task, col, spec, None, "not measured"
    if spec is None:
        return task, col, spec, None, "direction not declared"
    d = paired_difference(results.finished(task), col, pair.variant, pair.baseline, spec.direction)
    return task, col, spec, d, d.verdict


def _constructed_direction(d) -> str:
    """A cost computed from the config: its direction is the sign of the mean difference, not a test's verdict (it
    differs alike on every seed, so a test has no spread to work with; the row is never counted as evidence)."""
    if d.diff.mean == 0:
        return "same"
    return "better" if (d.diff.mean < 0) == lower_is_better(d.direction) else "worse"


def _effect_row(results: SweepResults, e: pd.Series, pair: CellPair) -> dict:
    """One tested effect on one pair of cells: our paired difference on the declared metric beside the published
    direction."""
    task, col, spec, d, ours = _our_difference(results, e, pair)
    done = results.completed(task)
    constructed = spec is not None and spec.by_construction and d is not None and d.diff.n > 0
    ours = _constructed_direction(d) if constructed else ours
    split, metric = _split_of(col), (col or e["our_metric"]).removeprefix("metric.")
    return {
        "effect_id": e["effect_id"], "axis": e["axis"], "baseline": e["baseline"], "variant": e["variant"],
        "citation": f"{e['citation']}, {e['table']}", "published_metric": e["published_metric"],
        "published_baseline": e["published_baseline"], "published_variant": e["published_variant"],
        "published_direction": e["published_direction"], "published_magnitude": e["magnitude"],
        "published_evidence": e.get("evidence", ""), "published_held": e.get("held", ""),
        "our_metric": metric, "our_split": split,
        "our_scale": spec.scale if spec else "", "our_direction_rule": spec.direction if spec else "not declared",
        "our_baseline_label": pair.baseline, "our_variant_label": pair.variant,
        "our_held": _held_text(pair.held) if results.design != "ofat" else "",
        "our_n_pairs": d.diff.n if d else 0, "our_diff": d.diff.mean if d else math.nan,
        "our_ci_lo": d.diff.lo if d else math.nan, "our_ci_hi": d.diff.hi if d else math.nan,
        "our_sd": d.diff.sd if d else math.nan, "our_diverged": d.divergence if d else "",
        "our_ratio": _ratio(_mean(done, pair.variant, col), _mean(done, pair.baseline, col)) if constructed else "",
        "p_value": d.p_value if d is not None and not constructed else math.nan,
        "our_test": d.test if d is not None and not constructed else "",
        **_power_columns(e, spec, d),
        "our_direction": ours,
        "verdict": BY_CONSTRUCTION if constructed else _effect_verdict(e["published_direction"], ours,
                                                                      d is not None and d.verdict != d.pairs_verdict),
        "comparability": _effect_notes(results, e, task, done, pair, split, metric, spec),
    }


def _test_key(r: pd.Series) -> tuple:
    """What makes two effect rows one test: the same two cells (either way round) on the same column."""
    return frozenset((r["our_baseline_label"], r["our_variant_label"])), r["our_metric"]


def add_holm(tested: pd.DataFrame) -> pd.DataFrame:
    """Holm-adjusted p-values and verdicts over every effect of the report with a p-value (two or more pairs, a
    declared direction, not by construction): the family of tests this report makes. Effects that are one paired
    test (two publications' mqa effects on the same two cells and column) are one member of the family: counting
    it twice would make the correction stricter than the tests made, and its adjusted p is shared."""
    if tested.empty:
        return tested
    tested = tested.copy()
    keys = [_test_key(r) for _, r in tested.iterrows()]
    first = {}
    for key, p in zip(keys, tested["p_value"]):
        if math.isfinite(p):
            first.setdefault(key, p)
    adjusted = dict(zip(first, holm_adjust(list(first.values()))))
    tested["holm_p"] = [adjusted.get(k, math.nan) if math.isfinite(p) else math.nan
                        for k, p in zip(keys, tested["p_value"])]
    tested["holm_family"] = len(first)
    tested["holm_verdict"] = [holm_verdict(v, p) for v, p in zip(tested["verdict"], tested["holm_p"])]
    return tested


def _untested(e: pd.Series, reason: str) -> dict:
    return {"effect_id": e["effect_id"], "axis": e["axis"], "baseline": e["baseline"], "variant": e["variant"],
            "citation": f"{e['citation']}, {e['table']}", "reason": reason}


def _no_pair_reason(results: SweepResults, e: pd.Series) -> str:
    """Why no two cells of the sweep test the effect: the axis or a value is missing, or no two cells differ in the
    effect's axis alone."""
    if e["axis"] not in results.axes:
        return "axis not in this sweep"
    values = {normalise_value(v) for v in _cells(results).values() for v in [v.get(e["axis"], NOT_APPLIED)]}
    for value in (e["baseline"], e["variant"]):
        if normalise_value(value) not in values:
            return f"value {value!s} not in this sweep"
    return f"no two cells of this sweep differ in {e['axis']} alone"


def compare_effects(results: SweepResults, effects: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(tested, untested): each published effect beside our paired difference on every pair of cells that differ
    in the effect's axis alone, hold the other axes where the publication held them (effects.csv's `held`) and are
    measured on the quantity the published direction is about (its `metric`); the effects with no such pair, and
    the pairs the publication's condition or metric leaves out, listed with the reason (outside the Holm family)."""
    tested, untested = [], []
    for _, e in effects.iterrows():
        pairs = cell_pairs(results, e["axis"], e["baseline"], e["variant"]) if e["axis"] in results.axes else []
        kept = [p for p in pairs if _meets(p, held_conditions(e))]
        untested += [_untested(e, f"the cells at {_held_text(p.held)} are not compared: the published effect holds "
                                  f"{e['held']}") for p in pairs if p not in kept]
        if not pairs:
            untested.append(_untested(e, _no_pair_reason(results, e)))
        for p in kept:
            reason = _unvaried_held(results, e, p)[0] or _metric_reason(results, e, p) or _definition_reason(
                results, e, p)
            if reason:
                untested.append(_untested(e, reason))
            else:
                tested.append(_effect_row(results, e, p))
    return add_holm(pd.DataFrame(tested)), pd.DataFrame(untested)


# -- output ----------------------------------------------------------------------------------------------------------
@dataclass
class Comparison:
    numbers: pd.DataFrame
    effects: pd.DataFrame
    untested: pd.DataFrame
    markdown: Path | None = None


def _no_spread(r) -> bool:
    """Pairs whose differences are all equal (stats.PairedDifference.no_spread): no interval, an exact sign-flip p;
    a cost computed from the config (by construction) differs alike on every seed."""
    return r["our_n_pairs"] >= 2 and r["our_sd"] == 0


def _ci_text(r) -> str:
    if _no_spread(r) and r["verdict"] == BY_CONSTRUCTION:
        return "(equal on every seed: computed from the config)"
    if _no_spread(r):
        return f"(no spread: {r['our_n_pairs']} equal differences, no interval)"
    return f"[{fmt(r['our_ci_lo'], 'signed')}, {fmt(r['our_ci_hi'], 'signed')}]"


def _ours_text(r) -> str:
    """Mean ± 95% half-width (n); one value, or n equal values, has no interval: 'n=1, no CI', 'no spread (n equal
    values)', never ± 0."""
    if r["our_n"] == 0 or pd.isna(r["our_mean"]):
        return "–"
    if r["our_n"] == 1:
        return f"{fmt(r['our_mean'])} (n=1, no CI)"
    if pd.isna(r["our_ci_lo"]):  # n equal values (stats.mean_ci): no interval, never ± 0
        return f"{fmt(r['our_mean'])}, {no_spread_text(int(r['our_n']))}"
    mean, half = fmt_uncertain((r["our_ci_hi"] - r["our_ci_lo"]) / 2, r["our_mean"])
    return f"{mean} ± {half} (n={r['our_n']})"


def _p_text(p: float) -> str:
    return "–" if not math.isfinite(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


def _effect_p_text(r) -> str:
    return _p_text(r["p_value"]) + (" (exact sign-flip)" if r.get("our_test") == NO_SPREAD_TEST else "")


def _power_text(r) -> str:
    """For an inconclusive (or consistent) effect: the smallest difference its seeds could have detected, and
    whether the published effect (in the same units) exceeds it; with no spread, why there is no such number."""
    if r["verdict"] not in ("inconclusive", "consistent"):
        return ""
    if r.get("our_test") == NO_SPREAD_TEST:
        return (f"no smallest detectable difference: the {r['our_n_pairs']} paired differences are equal (no spread), "
                f"and the exact sign-flip p of n equal differences is 2^(1-n) whatever their size (below {ALPHA:g} "
                "only from 6 pairs on)")
    if not math.isfinite(r["our_mde"]):
        return ""
    text = f"smallest detectable difference {fmt(r['our_mde'])}" + (f" ({r['our_scale']})" if r["our_scale"] else "")
    size = fmt(r["published_effect"], "signed")
    if r["published_effect_detectable"] in ("yes", "no"):
        could = "could" if r["published_effect_detectable"] == "yes" else "could not"
        return text + f"; the seeds {could} have detected an effect of the published size ({size})"
    return text + "; the published effect is in other units, so its size is not compared"


def _ours_effect_text(r) -> str:
    if r["our_direction"] == "not measured":
        return f"not measured: no finished trial of this sweep has `{r['our_metric']}`"
    if r["verdict"] == BY_CONSTRUCTION:
        return f"{r['our_direction']}: {r['our_metric']} variant/baseline {r['our_ratio']} (computed from the config)"
    ours = "–" if pd.isna(r["our_diff"]) else fmt(r["our_diff"], "signed") + (
        f" {_ci_text(r)}" if r["our_n_pairs"] >= 2 else " (n=1, no CI)")
    diverged = r.get("our_diverged")
    return f"{r['our_direction']}: Δ {r['our_metric']} {ours}" + (f"; {diverged}" if isinstance(diverged, str)
                                                                   and diverged else "")


def _effect_label(r) -> str:
    """'warmup: with → none at norm_position=post': the axis, its two values and (grids) where the others are held."""
    held = r.get("our_held", "")
    return f"{r['axis']}: {r['baseline']} → {r['variant']}" + (f" at {held}" if isinstance(held, str) and held else "")


def holm_sentence(family: int) -> str:
    """How Holm's correction treats `family` paired tests (none: nothing to correct, not a division by zero)."""
    if not family:
        return "No paired test was made (no pair had two seed pairs), so nothing is corrected."
    return ("Holm's step-down correction (Holm 1979) compares the smallest p-value with "
            f"0.05/{family}, the next with 0.05/{max(family - 1, 1)}, and so on, stopping at the first that fails, so "
            "the chance of any false agree/disagree among them stays at most 5%; the *Holm* column is the verdict "
            "after it.")


def _effects_section(doc: Doc, effects: pd.DataFrame) -> None:
    # the glance counts the verdicts the table's last column states: a verdict Holm's correction withdraws is
    # counted as withdrawn, never as the agreement or disagreement it was at 95% alone
    counts = effects["holm_verdict" if "holm_verdict" in effects else "verdict"].value_counts()
    family = int(effects["holm_family"].iloc[0]) if "holm_family" in effects else 0
    doc.p("At a glance, after Holm's correction: " + ", ".join(f"**{n} {v}**" for v, n in counts.items())
          + f" of {len(effects)} effects. "
          "*agree*/*disagree*: our 95% interval of the paired difference (same seeds) excludes zero and has the "
          "published sign / the opposite sign, and its Holm-adjusted p-value is below 0.05; *inconclusive*: our "
          "interval contains zero, or Holm's correction withdraws the agree/disagree; *consistent*: the "
          "publication reports no clear difference and our interval contains zero (which does not prove equality); "
          f"*{BY_CONSTRUCTION}*: our metric is computed from the config by arithmetic, so its difference is the "
          "definition of the variant, not evidence (shown with its ratio, never counted as agreement). Published "
          "numbers are single runs without intervals unless stated.")
    doc.p(f"**Multiplicity: {family} paired tests were made here** (one per pair of cells and metric with two or "
          "more seed pairs and a declared direction; effects that are the same test on the same cells and metric "
          f"count once), each at 95%. {holm_sentence(family)} For an inconclusive effect the details give the "
          "smallest difference the seeds could have "
          f"detected ({POWER:.0%} power, two-sided α = 0.05, from the sd of the paired differences: "
          "(t₀.₉₇₅,ₙ₋₁ + t₀.₈₀,ₙ₋₁) · sd / √n), and whether an effect of the published size exceeds it where the "
          "published effect is in our units (GLUE dev metrics, points on 0-100).")
    if (effects.get("our_test", pd.Series(dtype=str)) == NO_SPREAD_TEST).any():
        doc.p(f"*No spread*: {NO_SPREAD_WHY}, and the verdict and Holm's step use that p.")
    glance = [[_effect_label(r), r["citation"], r["published_direction"],
               _ours_effect_text(r), _effect_p_text(r), f"**{r['verdict']}**", r["holm_verdict"]]
              for _, r in effects.iterrows()]
    doc.table(["effect", "citation", "published: variant is", "ours: variant is (Δ, 95% CI)", "p (paired t)",
               "verdict (95%)", f"Holm (family of {family})"], glance, align="lllllll")
    doc.h(3, "Details and comparability")
    rows = []
    for _, r in effects.iterrows():
        ci = "–" if r["our_n_pairs"] < 2 else _ci_text(r)
        rows.append([_effect_label(r), r["citation"],
                     f"{r['published_metric']}: {fmt(r['published_baseline'])} → {fmt(r['published_variant'])} "
                     f"({r['published_magnitude']})", r["published_direction"],
                     f"Δ {r['our_metric']} {fmt(r['our_diff'], 'signed')} {ci} (n={r['our_n_pairs']})"
                     + (f" [{r['our_scale']}]" if r["our_scale"] else ""),
                     f"**{r['verdict']}**", _power_text(r) or "–", r["comparability"]])
    doc.table(["effect", "citation", "published", "published: variant is", "ours (95% CI, pairs)", "verdict",
               "power", "comparability"], rows, align="llllllll")


def _numbers_section(doc: Doc, numbers: pd.DataFrame, measurements_note: list[str]) -> None:
    doc.h(2, "Our numbers beside published numbers")
    for line in measurements_note:
        doc.p(line)
    if numbers.empty:
        doc.p("None of our measurements shares a dataset and metric with a row of the published table.")
        return
    n_comp = int(numbers["comparable"].sum())
    doc.p(f"{len(numbers)} pairs; {n_comp} directly comparable (same metric variant, split and model variant: "
          "trained from scratch, pretrained with MLM + NSP or MLM only, or randomly initialised; a size within "
          f"{SIZE_FACTOR:g}x in parameters where both are known; ours computed on the whole split, where a language "
          "model's task.eval_tokens may cut its evaluation to the split's first tokens; and, where the published row "
          "states them, the same evaluation context and the same model reported: ours is always the model at the end "
          "of training, never the best validation value over training). Every other row "
          "says what differs and is shown for orientation only. n counts what varies in our runs, as each source "
          "says (seeds; a GLUE record's fine-tuning seeds); one value has no interval.")
    if numbers["ours"].astype(str).str.contains(", best variant").any():
        doc.p("A sweep's *best variant* is the one whose mean over its seeds is best, chosen on the very seeds it is "
              "shown with: its number is optimistic (the pick favours whichever variant the seeds' noise helped). "
              "Whether a variant beats the baseline is the paired verdict in the sweep's report, not this row.")
    rows = []
    for _, r in numbers.iterrows():
        rows.append([r["ours"], f"{r['key']} ({r['split']})", _ours_text(r), f"{r['published_printed']}",
                     f"{r['published_model']}: {r['citation']}", "yes" if r["comparable"] else "**no**",
                     r["comparability"] + (f" ({r['our_note']})" if r["our_note"] else ""), r["size_ratio"],
                     r["compute_ratio"]])
    doc.table(["ours", "measure (split)", "ours (95% CI)", "published", "published model and source",
               "comparable", "comparability", "size ours/published", "compute ours/published"],
              rows, align="llrrlllll")


def split_notes(measurements: list[Measurement]) -> list[str]:
    """A sentence for each corpus whose records have a validation split but no test split (Tiny Shakespeare):
    its numbers are validation numbers, and no test number is made up from them."""
    splits: dict[str, set[str]] = {}
    for m in measurements:
        if m.key.endswith((":loss", ":ppl")):
            splits.setdefault(m.key.split(":", 1)[0], set()).add(m.split)
    return [f"`{k}`: our records have no test split (the corpus has none), so its numbers are on the validation "
            "split and no test number is shown." for k, s in sorted(splits.items()) if s == {"validation"}]


def build_compare_doc(results: SweepResults | None, numbers: pd.DataFrame, effects: pd.DataFrame,
                      untested: pd.DataFrame, runs: list[str], generated: str | None = None,
                      notes: list[str] = ()) -> Doc:
    doc = Doc()
    generated = generated or datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    doc.h(1, f"Published results beside ours: {results.sweep}" if results else "Published results beside ours")
    sources = ([f"sweep `{results.root}` ({results.source})"] if results else []) + [f"run `{r}`" for r in runs]
    doc.p(f"Generated by `study compare` on {generated} from " + (", ".join(sources) or "no results") +
          " and the published table shipped in `study/report/published.csv` (citations per row). "
          "Nothing here is written by hand. Directions and scales are the task families' declarations.")
    if results is not None and results.is_partial:
        from study.report.markdown import status_sentence

        doc.note(f"**Partial results: the sweep is still running or incomplete.** {status_sentence(results)}.")
    doc.h(2, "Published effects: reproduced or not")
    if effects.empty:
        doc.p("No published effect in the shipped table could be set beside a paired difference of this sweep"
              + (" (those on its axes are listed below with why)." if not untested.empty else
                 ": none concerns an axis it varies."))
    else:
        _effects_section(doc, effects)
    if not untested.empty:
        doc.h(3, "Published effects this sweep does not test")
        lines = [f"{r['axis']}: {r['baseline']} → {r['variant']} ({r['citation']}): {r['reason']}"
                 for _, r in untested.iterrows()]
        doc.ul(list(dict.fromkeys(lines)))
    _numbers_section(doc, numbers, list(notes))
    return doc


def run_compare(results: SweepResults | None, out: str | Path, runs: list[str | Path] = (),
                published: pd.DataFrame | None = None, effects: pd.DataFrame | None = None,
                generated: str | None = None) -> Comparison:
    """Write <out>/compare.md, compare.html, compare.csv (numbers) and compare_effects.csv (effects)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    published = load_published() if published is None else published
    effects_table = load_effects() if effects is None else effects
    measurements = (sweep_measurements(results) if results is not None else []) + run_measurements(list(runs))
    numbers = compare_numbers(measurements, published)
    tested, untested = (compare_effects(results, effects_table) if results is not None
                        else (pd.DataFrame(), pd.DataFrame()))
    doc = build_compare_doc(results, numbers, tested, untested, [str(r) for r in runs], generated,
                            split_notes(measurements))
    md = out / "compare.md"
    md.write_text(doc.to_markdown())
    (out / "compare.html").write_text(doc.to_html("Published results beside ours"))
    numbers.to_csv(out / "compare.csv", index=False)
    tested.to_csv(out / "compare_effects.csv", index=False)
    return Comparison(numbers, tested, untested, md)
