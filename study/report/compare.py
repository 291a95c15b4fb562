"""Our results beside the published ones, with the comparability of every pair stated.

Two comparisons:

* numbers: each of our measurements (a sweep's baseline and best variant, recorded single runs) filed under
  a `match` key (`tinyshakespeare:loss`, `multi30k:de-en:bleu`, `glue:qnli:accuracy`, ...) beside the
  published rows with that key. A pair is *comparable* only when the metric variant (`variant_key`: scorer,
  tokenization, casing, unit) and the split are the same; otherwise the row says what differs. Model size
  (and training compute, where the publication gives it) is stated as a ratio.
* effects: for each published ablation effect whose axis the sweep varies, our paired difference (same
  seeds) beside the published direction: agree / disagree / inconclusive (our interval contains zero).
  Published 'no difference' effects read 'consistent' when our interval contains zero.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from study.report.collect import SweepResults, flatten_metrics, metric_column, metric_direction
from study.report.markdown import Doc, fmt
from study.report.published import load_effects, load_published
from study.report.stats import mean_ci, paired_difference

# -- mapping our metric columns to the published `match` keys ----------------------------------------------------
DATASET_KEYS = {"tinyshakespeare": "tinyshakespeare", "shakespeare": "tinyshakespeare", "wikitext2": "wikitext2",
                "wikitext103": "wikitext103", "multi30k": "multi30k", "wmt14": "wmt14", "newstest2014": "wmt14",
                "iwslt14": "iwslt14", "glue": "glue"}
TOKEN_UNITS = {"char": "char", "character": "char", "word": "word", "bpe": "subword", "wordpiece": "subword",
               "unigram": "subword"}
GLUE_TASKS = {"mnli": "mnli_m", "mnli_m": "mnli_m", "mnli-m": "mnli_m", "mnli_matched": "mnli_m", "mnlim": "mnli_m",
              "mnli_mm": "mnli_mm", "mnli-mm": "mnli_mm", "mnli_mismatched": "mnli_mm", "sst2": "sst2", "sst-2": "sst2",
              "sst": "sst2", "stsb": "stsb", "sts-b": "stsb", "cola": "cola", "mrpc": "mrpc", "qqp": "qqp",
              "qnli": "qnli", "rte": "rte", "wnli": "wnli", "average": "average", "score": "average"}
GLUE_METRICS = {"accuracy": "accuracy", "acc": "accuracy", "f1": "f1", "mcc": "mcc", "matthews": "mcc",
                "matthews_correlation": "mcc", "matthews_corr": "mcc", "spearman": "spearman", "spearmanr": "spearman",
                "pearson": "pearson", "score": "score"}
GLUE_COLUMN = re.compile(r"^metric\.(?:glue\.)?(?:test_sets\.|tasks\.)?(?P<task>[a-z0-9_\-]+?)[./]"
                         r"(?:mean\.)?(?P<metric>[a-z_]+)$")
# study.tasks.glue flattens MNLI's two dev sets as `mnli/accuracy_m` and `mnli/accuracy_mm`
SPLIT_SUFFIX = {"_m": "mnli_m", "_mm": "mnli_mm"}


def dataset_key(name: Any) -> str:
    text = re.sub(r"[^a-z0-9]", "", str(name or "").lower())
    for k, v in DATASET_KEYS.items():
        if text.startswith(k.replace("-", "")):
            return v
    return text or "unknown"


def glue_columns(columns) -> dict[str, str]:
    """Our GLUE metric columns by match key: 'metric.qnli.accuracy' / 'metric.glue.qnli.acc' /
    'metric.test_sets.sst-2.accuracy' -> 'glue:qnli:accuracy' ... (the mapping this module owns)."""
    out = {}
    for col in columns:
        m = GLUE_COLUMN.match(str(col).lower())
        if not m or m["task"] not in GLUE_TASKS or m["metric"].endswith("_std"):
            continue
        task, metric = GLUE_TASKS[m["task"]], m["metric"]
        for suffix, split_task in SPLIT_SUFFIX.items():
            if task.startswith("mnli") and metric.endswith(suffix) and metric[: -len(suffix)] in GLUE_METRICS:
                task, metric = split_task, metric[: -len(suffix)]
        if metric in GLUE_METRICS:
            out.setdefault(f"glue:{task}:{GLUE_METRICS[metric]}", col)
    return out


def sacrebleu_variant(signature: str | None) -> tuple[str, str]:
    """(variant_key, words) from a sacreBLEU signature such as 'nrefs:1|case:mixed|eff:no|tok:13a|...'."""
    if not signature or not isinstance(signature, str):
        return "sacrebleu:unspecified", "sacreBLEU (signature not recorded)"
    parts = dict(p.split(":", 1) for p in signature.split("|") if ":" in p)
    tok, case = parts.get("tok", "?"), parts.get("case", "?")
    cased = "cased" if case == "mixed" else "lowercased" if case == "lc" else case
    return f"sacrebleu:{tok}:{cased}", f"sacreBLEU on detokenized output, {signature}"


@dataclass
class Measurement:
    source: str        # 'sweep <name>: <label>' or 'run <label>'
    key: str           # published `match` key
    split: str
    metric: str        # our column
    variant_key: str
    variant_words: str
    values: list[float]
    params: float = math.nan
    train_flops: float = math.nan

    @property
    def interval(self):
        return mean_ci(self.values)


def measurements_from_rows(source: str, rows: pd.DataFrame, task_cfg: dict, task: str,
                           dataset: str) -> list[Measurement]:
    """What one variant (rows: its completed trials) or one run (one row) measured, filed by match key."""
    out: list[Measurement] = []
    dk = dataset_key(dataset)
    params = float(pd.to_numeric(rows.get("cost.parameters", pd.Series(dtype=float)), errors="coerce").mean())
    flops = pd.to_numeric(rows.get("train_tokens", pd.Series(dtype=float)), errors="coerce") * \
        pd.to_numeric(rows.get("cost.train_flops_per_token", pd.Series(dtype=float)), errors="coerce")
    flops = float(flops.mean()) if len(flops) else math.nan

    def add(key, split, col, vkey, words, percent=False):
        if col in rows:
            vals = [float(v) for v in pd.to_numeric(rows[col], errors="coerce") if pd.notna(v) and math.isfinite(v)]
            if percent and vals and all(-1 <= v <= 1 for v in vals):  # fractions -> the papers' 0-100 scale
                vals, words = [100 * v for v in vals], words + " (fraction × 100)"
            if vals:
                out.append(Measurement(source, key, split, col, vkey, words, vals, params, flops))

    if task in ("lm", "pretrain"):
        unit = TOKEN_UNITS.get(str(task_cfg.get("tokenizer", "")).lower(), str(task_cfg.get("tokenizer") or "token"))
        for split, prefix in (("validation", "valid"), ("test", "test")):
            add(f"{dk}:loss", split, f"metric.{prefix}_loss", f"xent-nats:{unit}",
                f"cross-entropy in nats per {unit} token")
            add(f"{dk}:ppl", split, f"metric.{prefix}_ppl", f"ppl:{unit}:nonoverlapping",
                f"{unit}-level perplexity over non-overlapping windows")
    if task == "translation":
        pair = f"{task_cfg.get('src_lang', '?')}-{task_cfg.get('tgt_lang', '?')}"
        sets = sorted({c.split(".")[2] for c in rows.columns
                       if c.startswith("metric.test_sets.") and c.endswith(".bleu")})
        for s in sets:
            sig = rows.get(f"metric.test_sets.{s}.bleu_signature")
            sig = next((x for x in sig if isinstance(x, str) and x), None) if sig is not None else None
            vkey, words = sacrebleu_variant(sig)
            add(f"{dk}:{pair}:bleu", s, f"metric.test_sets.{s}.bleu", vkey, words)
        if not sets:
            add(f"{dk}:{pair}:bleu", "test", "metric.bleu", "sacrebleu:unspecified", "BLEU (scorer not recorded)")
    for key, col in glue_columns(rows.columns).items():
        metric = key.rsplit(":", 1)[1]
        add(key, "dev", col, f"glue:{metric}:dev", f"{metric} on the dev set", percent=True)
    return out


def sweep_measurements(results: SweepResults) -> list[Measurement]:
    """For each task: the baseline and the best variant by the primary metric (mean over seeds)."""
    out = []
    for task in results.tasks:
        done = results.completed(task)
        if done.empty:
            continue
        metric, direction = results.objective(task)
        col = metric_column(metric)
        means = done.groupby("label")[col].mean().dropna() if col in done else pd.Series(dtype=float)
        picks = [results.baseline_label]
        if len(means):
            best = means.idxmin() if direction == "minimize" else means.idxmax()
            if best not in picks:
                picks.append(best)
        for label in picks:
            rows = done[done["label"] == label]
            if rows.empty:
                continue
            cfg = results.point_config(label).get("task") or {}
            dataset = rows["dataset"].dropna().iloc[0] if rows["dataset"].notna().any() else cfg.get("dataset")
            kind = ("" if label == "baseline" else " (baseline)" if label == results.baseline_label
                    else " (best variant)")
            out += measurements_from_rows(f"sweep {results.sweep}: {label}{kind}", rows, cfg, task, dataset)
    return out


def load_run(path: str | Path) -> tuple[str, pd.DataFrame, dict] | None:
    """A recorded run (bench/results/run-*.json) or a run directory (metrics.json + config.yaml), as
    (label, one-row table, config); None when it holds neither."""
    path = Path(path)
    if path.is_dir():
        if not (path / "metrics.json").is_file():
            return None
        metrics = json.loads((path / "metrics.json").read_text())
        config = {}
        if (path / "config.yaml").is_file():
            import yaml

            config = yaml.safe_load((path / "config.yaml").read_text()) or {}
        label = config.get("name") or path.name
    elif path.suffix == ".json" and path.is_file():
        data = json.loads(path.read_text())
        if "metrics" in data and isinstance(data["metrics"], dict) and "status" in data["metrics"]:
            metrics, config, label = data["metrics"], data.get("config") or {}, data.get("label") or path.stem
        elif "status" in data:
            metrics, config, label = data, {}, path.stem
        else:
            return None
    else:
        return None
    row = flatten_metrics(metrics)
    row["seed"] = (config.get("train") or {}).get("seed", 0)
    table = pd.DataFrame([row])
    for col in table.columns:
        if col.startswith(("metric.", "cost.")) and not col.endswith("signature"):
            table[col] = pd.to_numeric(table[col], errors="coerce") if table[col].map(
                lambda v: not isinstance(v, str) or v.replace(".", "", 1).isdigit()).all() else table[col]
    return label, table, config


def run_measurements(paths: list[str | Path]) -> list[Measurement]:
    out = []
    for p in paths:
        loaded = load_run(p)
        if loaded is None:
            continue
        label, table, config = loaded
        if str(table.get("status", pd.Series(["completed"])).iloc[0]) != "completed":
            continue
        task_cfg = config.get("task") or {}
        out += measurements_from_rows(f"run {label} (one seed)", table, task_cfg, task_cfg.get("name", "lm"),
                                      task_cfg.get("dataset", label))
    return out


# -- comparisons ---------------------------------------------------------------------------------------------------
def _ratio(ours: float, theirs: float) -> str:
    if not (math.isfinite(ours) and math.isfinite(theirs)) or ours <= 0 or theirs <= 0:
        return "unknown"
    r = ours / theirs
    return f"{r:.3g}×" if r >= 1 else f"1/{1 / r:.3g}"


def comparability(m: Measurement, pub: pd.Series) -> tuple[bool, str]:
    """(comparable, sentence): comparable only when the metric variant and the split are the same."""
    same_variant = m.variant_key == pub["variant_key"]
    same_split = m.split.lower() == str(pub["split"]).lower()
    parts = []
    if not same_variant:
        parts.append(f"different metric variant (ours: {m.variant_words}; published: {pub['metric_variant']})")
    if not same_split:
        parts.append(f"different split (ours: {m.split}; published: {pub['split']})")
    if "community" in str(pub["verification"]).lower():
        parts.append("community result, not a peer-reviewed number")
    elif "secondary" in str(pub["verification"]).lower():
        parts.append("published number from a secondary transcription")
    comparable = same_variant and same_split
    head = "same metric variant and split" if comparable else "NOT directly comparable: " + "; ".join(parts[:2])
    extra = parts[2:] if not comparable else parts
    return comparable, head + ("; " + "; ".join(extra) if extra else "")


def compare_numbers(measurements: list[Measurement], published: pd.DataFrame) -> pd.DataFrame:
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
            pub_params = pub["params_m"] * 1e6 if pd.notna(pub["params_m"]) else math.nan
            pub_flops = pub["train_flops"] if pd.notna(pub["train_flops"]) else math.nan
            rows.append({
                "ours": m.source, "key": m.key, "split": m.split, "metric": m.metric,
                "our_mean": ci.mean, "our_ci_lo": ci.lo, "our_ci_hi": ci.hi, "our_n": ci.n,
                "our_metric_variant": m.variant_words, "our_variant_key": m.variant_key,
                "published": pub["value"], "published_printed": pub["value_printed"], "published_id": pub["id"],
                "citation": f"{pub['citation']}, {pub['table']}", "published_model": pub["model"],
                "published_split": pub["split"], "published_metric_variant": pub["metric_variant"],
                "published_variant_key": pub["variant_key"], "verification": pub["verification"],
                "same_metric_variant": m.variant_key == pub["variant_key"],
                "same_split": m.split.lower() == str(pub["split"]).lower(), "comparable": comparable,
                "comparability": text, "size_ratio": _ratio(m.params, pub_params),
                "compute_ratio": _ratio(m.train_flops, pub_flops) if math.isfinite(pub_flops) else "not published",
            })
    return pd.DataFrame(rows)


def _effect_verdict(published: str, ours: str) -> str:
    if ours in ("no pairs", "not run"):
        return "not run"
    if ours == "not measured":
        return "not measured"
    if ours.startswith("no CI"):
        return "no CI (n=1)"
    if published == "same":
        return "consistent" if ours == "inconclusive" else "disagree"
    if ours == "inconclusive":
        return "inconclusive"
    return "agree" if ours == published else "disagree"


def resolve_metric(results: SweepResults, name: str, task: str) -> tuple[str | None, str]:
    """Our column and direction for an effect's `our_metric` ('objective', 'test_ppl_at_2x',
    'cost.train_tokens_per_s', 'glue.qnli.accuracy', ...)."""
    if name == "objective":
        metric, direction = results.objective(task)
        return metric_column(metric), direction
    col = metric_column(name)
    if col in results.table:
        return col, metric_direction(col)
    if name.startswith("glue."):
        parts = name.split(".")
        key = f"glue:{GLUE_TASKS.get(parts[1], parts[1])}:{GLUE_METRICS.get(parts[2], parts[2])}"
        found = glue_columns(results.table.columns).get(key)
        if found:
            return found, "maximize"
    return None, metric_direction(col)


def compare_effects(results: SweepResults, effects: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(tested, untested): each published effect whose axis and both values are in the sweep beside our
    paired difference; the others listed with the reason."""
    tested, untested = [], []
    for _, e in effects.iterrows():
        base_label = results.label_for(e["axis"], e["baseline"]) if e["axis"] in results.axes else None
        var_label = results.label_for(e["axis"], e["variant"]) if e["axis"] in results.axes else None
        if base_label is None or var_label is None:
            why = ("axis not in this sweep" if e["axis"] not in results.axes else
                   f"value {e['baseline'] if base_label is None else e['variant']!s} not in this sweep")
            untested.append({"effect_id": e["effect_id"], "axis": e["axis"], "baseline": e["baseline"],
                             "variant": e["variant"], "citation": f"{e['citation']}, {e['table']}", "reason": why})
            continue
        task = results.table.loc[results.table["label"] == var_label, "task"].dropna()
        task = str(task.iloc[0]) if len(task) else results.tasks[0]
        col, direction = resolve_metric(results, e["our_metric"], task)
        done = results.completed(task)
        if col is None or col not in done:
            d = None
            ours = "not measured"
        else:
            d = paired_difference(done, col, var_label, base_label, direction)
            ours = d.verdict
        base_rows = done[done["label"] == base_label]
        costs = base_rows.get("cost.parameters", pd.Series(dtype=float))
        params = float(pd.to_numeric(costs, errors="coerce").mean()) if len(base_rows) else math.nan
        pub_params = e["params_m"] * 1e6 if pd.notna(e["params_m"]) else math.nan
        same_task = str(e["task"]) == task
        notes = []
        if not same_task:
            notes.append(f"published on {e['dataset']} ({e['task']}), ours on "
                         f"{', '.join(map(str, done['dataset'].dropna().unique())) or task} ({task})")
        notes.append(f"model size ratio ours/published {_ratio(params, pub_params)}")
        if str(e.get("note", "")).strip():
            notes.append(str(e["note"]))
        tested.append({
            "effect_id": e["effect_id"], "axis": e["axis"], "baseline": e["baseline"], "variant": e["variant"],
            "citation": f"{e['citation']}, {e['table']}", "published_metric": e["published_metric"],
            "published_baseline": e["published_baseline"], "published_variant": e["published_variant"],
            "published_direction": e["published_direction"], "published_magnitude": e["magnitude"],
            "published_evidence": e.get("evidence", ""),
            "our_metric": (col or e["our_metric"]).removeprefix("metric."), "our_direction_rule": direction,
            "our_baseline_label": base_label, "our_variant_label": var_label,
            "our_n_pairs": d.diff.n if d else 0, "our_diff": d.diff.mean if d else math.nan,
            "our_ci_lo": d.diff.lo if d else math.nan, "our_ci_hi": d.diff.hi if d else math.nan,
            "our_direction": ours, "verdict": _effect_verdict(e["published_direction"], ours),
            "comparability": "; ".join(notes),
        })
    return pd.DataFrame(tested), pd.DataFrame(untested)


# -- output ----------------------------------------------------------------------------------------------------------
@dataclass
class Comparison:
    numbers: pd.DataFrame
    effects: pd.DataFrame
    untested: pd.DataFrame
    markdown: Path | None = None


def _ci_text(r) -> str:
    return f"[{fmt(r['our_ci_lo'], 'signed')}, {fmt(r['our_ci_hi'], 'signed')}]"


def _ours_text(r) -> str:
    if r["our_n"] == 0 or pd.isna(r["our_mean"]):
        return "–"
    if r["our_n"] == 1:
        return f"{fmt(r['our_mean'])} (n=1)"
    return f"{fmt(r['our_mean'])} ± {fmt((r['our_ci_hi'] - r['our_ci_lo']) / 2)} (n={r['our_n']})"


def build_compare_doc(results: SweepResults | None, numbers: pd.DataFrame, effects: pd.DataFrame,
                      untested: pd.DataFrame, runs: list[str], generated: str | None = None) -> Doc:
    doc = Doc()
    generated = generated or datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    title = f"Published results beside ours: {results.sweep}" if results else "Published results beside ours"
    doc.h(1, title)
    sources = ([f"sweep `{results.root}` ({results.source})"] if results else []) + [f"run `{r}`" for r in runs]
    doc.p(f"Generated by `study compare` on {generated} from " + (", ".join(sources) or "no results") +
          " and the published table shipped in `study/report/published.csv` (citations per row). "
          "Nothing here is written by hand.")
    if results is not None and results.is_partial:
        from study.report.markdown import status_sentence

        doc.note(f"**Partial results: the sweep is still running or incomplete.** {status_sentence(results)}.")

    doc.h(2, "Published effects: reproduced or not")
    if effects.empty:
        doc.p("No published effect in the shipped table concerns an axis this sweep varies.")
    else:
        counts = effects["verdict"].value_counts()
        doc.p("At a glance: " + ", ".join(f"**{n} {v}**" for v, n in counts.items()) + f" of {len(effects)} effects "
              "tested. *agree*/*disagree*: our 95% interval of the paired difference (same seeds) excludes zero and "
              "has the published sign / the opposite sign; *inconclusive*: our interval contains zero; *consistent*: "
              "the publication reports no clear difference and our interval contains zero (which does not prove "
              "equality). Published numbers are single runs without intervals unless stated.")
        glance = []
        for _, r in effects.iterrows():
            ours = "–" if pd.isna(r["our_diff"]) else fmt(r["our_diff"], "signed") + (
                f" {_ci_text(r)}" if r["our_n_pairs"] >= 2 else " (n=1)")
            glance.append([f"{r['axis']}: {r['baseline']} → {r['variant']}", r["citation"], r["published_direction"],
                           f"{r['our_direction']}: Δ {r['our_metric']} {ours}", f"**{r['verdict']}**"])
        doc.table(["effect", "citation", "published: variant is", "ours: variant is (Δ, 95% CI)", "verdict"], glance,
                  align="lllll")
        doc.h(3, "Details and comparability")
        rows = []
        for _, r in effects.iterrows():
            ci = "–" if r["our_n_pairs"] < 2 else _ci_text(r)
            rows.append([f"{r['axis']}: {r['baseline']} → {r['variant']}", r["citation"],
                         f"{r['published_metric']}: {fmt(r['published_baseline'])} → {fmt(r['published_variant'])} "
                         f"({r['published_magnitude']})", r["published_direction"],
                         f"Δ {r['our_metric']} {fmt(r['our_diff'], 'signed')} {ci} (n={r['our_n_pairs']})",
                         r["our_direction"], f"**{r['verdict']}**", r["comparability"]])
        doc.table(["effect", "citation", "published", "published: variant is", "ours (95% CI, pairs)",
                   "ours: variant is", "verdict", "comparability"], rows, align="llllllll")
    if not untested.empty:
        doc.h(3, "Published effects this sweep does not test")
        lines = [f"{r['axis']}: {r['baseline']} → {r['variant']} ({r['citation']}): {r['reason']}"
                 for _, r in untested.iterrows()]
        doc.ul(list(dict.fromkeys(lines)))

    doc.h(2, "Our numbers beside published numbers")
    if numbers.empty:
        doc.p("None of our measurements shares a dataset and metric with a row of the published table.")
    else:
        n_comp = int(numbers["comparable"].sum())
        doc.p(f"{len(numbers)} pairs; {n_comp} directly comparable (same metric variant and split). Every other row "
              "says what differs; a number from a different metric variant is shown for orientation only.")
        rows = []
        for _, r in numbers.iterrows():
            rows.append([r["ours"], f"{r['key']} ({r['split']})", _ours_text(r),
                         f"{r['published_printed']}", f"{r['published_model']}: {r['citation']}",
                         "yes" if r["comparable"] else "**no**", r["comparability"], r["size_ratio"],
                         r["compute_ratio"]])
        doc.table(["ours", "measure (split)", "ours (95% CI)", "published", "published model and source",
                   "comparable", "comparability", "size ours/published", "compute ours/published"],
                  rows, align="llrrllll" + "l")
    return doc


def run_compare(results: SweepResults | None, out: str | Path, runs: list[str | Path] = (),
                published: pd.DataFrame | None = None, effects: pd.DataFrame | None = None,
                generated: str | None = None) -> Comparison:
    """Write <out>/compare.md, compare.csv (numbers) and compare_effects.csv (effects)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    published = load_published() if published is None else published
    effects_table = load_effects() if effects is None else effects
    measurements = (sweep_measurements(results) if results is not None else []) + run_measurements(list(runs))
    numbers = compare_numbers(measurements, published)
    tested, untested = (compare_effects(results, effects_table) if results is not None
                        else (pd.DataFrame(), pd.DataFrame()))
    doc = build_compare_doc(results, numbers, tested, untested, [str(r) for r in runs], generated)
    md = out / "compare.md"
    md.write_text(doc.to_markdown())
    (out / "compare.html").write_text(doc.to_html("Published results beside ours"))
    numbers.to_csv(out / "compare.csv", index=False)
    tested.to_csv(out / "compare_effects.csv", index=False)
    return Comparison(numbers, tested, untested, md)
