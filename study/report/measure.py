"""Our measurements, filed under the published table's `match` keys, each saying what it measured: the split as it
is named (a corpus without a test split has no test numbers), how many seeds of what (a GLUE record's fine-tuning
seeds are its own sample), the metric's variant and scale, and which variant of the model it is (trained from
scratch, pretrained with MLM + NSP or MLM only, or randomly initialised), the evaluation context it was read at
(the run's task.seq_len: tokens per evaluation window) and, where a language model's number covers only the first
task.eval_tokens tokens of its split, that part of the split (with the split's length where data.json records it).

Sources: a sweep's baseline and best variant (`sweep_measurements`) and recorded runs (`run_measurements`:
bench/results/run-*.json or run directories). Records of schema 1 are read by that schema's documented rules
(`SCHEMA1_*` below), never by guessing from the values.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from study.io import load_yaml, read_json_or_none
from study.record import COMPLETED, DIVERGED, flatten_record, record_schema
from study.report.collect import SweepResults, metric_column, ran_off_plan
from study.report.stats import mean_ci

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
# metric names may hold digits (MRPC and QQP report `f1`)
GLUE_COLUMN = re.compile(r"^metric\.(?:glue\.)?(?P<task>[a-z0-9_\-]+?)/(?P<metric>[a-z0-9_]+)$")
# study.tasks.glue flattens MNLI's two dev sets as `MNLI/accuracy_m` and `MNLI/accuracy_mm`
SPLIT_SUFFIX = {"_m": "mnli_m", "_mm": "mnli_mm"}
SPLITS = (("validation", "valid"), ("test", "test"))

# Schema 1 (records without `schema`; bench/results/run-*.json) had two conventions schema 2 dropped:
# - a corpus without a test split had its validation split written a second time as `test_*` (Tiny Shakespeare):
#   those columns are the validation split under another name and are never shown as test numbers;
# - a GLUE record stored each task's metrics (and their sds) as fractions (0-1) and the scores (`score`,
#   `glue_score`) on 0-100; schema 2 stores every GLUE number on 0-100, so schema-1 metrics are multiplied by 100.
SCHEMA1_VALIDATION_AS_TEST = ("tinyshakespeare",)
SCHEMA1_GLUE_ON_0_100 = ("score", "glue_score")
GLUE_SEED_BOOKKEEPING = ("status", "steps", "task", "n_train")

# `model_variant` of published.csv and of ours: which variant of the model a number is of
MODEL_VARIANT_WORDS = {
    "pretrained:mlm+nsp": "MLM + NSP pretraining", "pretrained:mlm": "MLM-only pretraining",
    "pretrained:?": "pretrained, pretraining objective not recorded",
    "random-init": "randomly initialised encoder (no pretraining)", "from-scratch": "trained from scratch on the task",
    "pretrained:span-corruption": "span-corruption pretraining (T5)", "zero-shot:webtext": "zero-shot after WebText",
}


def model_variant_words(key: str) -> str:
    return MODEL_VARIANT_WORDS.get(key, key or "not stated")


def dataset_key(name: Any) -> str:
    text = re.sub(r"[^a-z0-9]", "", str(name or "").lower())
    for k, v in DATASET_KEYS.items():
        if text.startswith(k.replace("-", "")):
            return v
    return text or "unknown"


def glue_columns(columns) -> dict[str, str]:
    """Our GLUE metric columns by match key: 'metric.QNLI/accuracy' -> 'glue:qnli:accuracy',
    'metric.MNLI/accuracy_m' -> 'glue:mnli_m:accuracy' (the mapping this module owns); sds are left out."""
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


# The task families that evaluate only the first task.eval_tokens tokens of a split when it is set (study.tasks.lm:
# LanguageModelling reads the field, its windows stop there); every other family evaluates its whole split.
EVAL_TOKENS_TASKS = ("lm",)


@dataclass
class Measurement:
    source: str        # 'sweep <name>: <label> (<n> <unit>)' or 'run <label> (<n> <unit>)'
    key: str           # published `match` key
    split: str
    metric: str        # our column
    variant_key: str
    variant_words: str
    values: list[float]
    params: float = math.nan
    train_flops: float = math.nan
    model_variant: str = ""  # MODEL_VARIANT_WORDS' keys
    note: str = ""           # how the values were read (e.g. a schema-1 rule applied)
    context: int | None = None       # tokens per evaluation window: the run's task.seq_len (None: not known)
    eval_tokens: int | None = None   # computed on the split's first eval_tokens tokens only (None: the whole split)
    split_tokens: int | None = None  # the tokens of the split a whole-split evaluation predicts (data.json's count)

    @property
    def interval(self):
        return mean_ci(self.values)

    @property
    def eval_subset(self) -> str:
        """The part of the split the number covers, in words ('the first 32,768 of the validation split's 111,539
        tokens'; 'at most the first 32,768 tokens of the validation split' where the split's length is not
        recorded: a shorter split is evaluated whole), or '' for the whole split."""
        if self.eval_tokens is None:
            return ""
        if self.split_tokens is not None:
            return f"the first {self.eval_tokens:,} of the {self.split} split's {self.split_tokens:,} tokens"
        return f"at most the first {self.eval_tokens:,} tokens of the {self.split} split"


@dataclass
class Source:
    """What one set of rows is: a sweep variant's completed trials, or one recorded run (one row). `per_seed`
    overrides a column with the values it aggregates (a GLUE record's per-fine-tuning-seed values)."""

    label: str
    rows: pd.DataFrame
    task_cfg: dict
    task: str
    dataset: str
    model_variant: str = ""
    per_seed: dict[str, list[float]] = field(default_factory=dict)
    schema: int = 2
    data: dict = field(default_factory=dict)  # the data.json of one of its runs ({}: none found)


def _values(src: Source, col: str) -> list[float]:
    if col in src.per_seed:
        return list(src.per_seed[col])
    if col not in src.rows:
        return []
    return [float(v) for v in pd.to_numeric(src.rows[col], errors="coerce") if pd.notna(v) and math.isfinite(v)]


def measurements_from_source(src: Source) -> list[Measurement]:
    """What one variant or one run measured, filed by match key."""
    out: list[Measurement] = []
    rows = src.rows
    params = float(pd.to_numeric(rows.get("cost.parameters", pd.Series(dtype=float)), errors="coerce").mean())
    flops = pd.to_numeric(rows.get("train_tokens", pd.Series(dtype=float)), errors="coerce") * \
        pd.to_numeric(rows.get("cost.train_flops_per_token", pd.Series(dtype=float)), errors="coerce")
    flops = float(flops.mean()) if len(flops) else math.nan

    context = _positive_int(src.task_cfg.get("seq_len"))

    def add(key, split, col, vkey, words, note="", **subset):
        vals = _values(src, col)
        if vals:
            out.append(Measurement(src.label, key, split, col, vkey, words, vals, params, flops, src.model_variant,
                                   note, context, **subset))

    if src.task in ("lm", "pretrain"):
        _lm_measurements(src, add)
    if src.task == "translation":
        _translation_measurements(src, add)
    for key, col in glue_columns([*rows.columns, *src.per_seed]).items():
        metric = key.rsplit(":", 1)[1]
        rule = (" Schema-1 record: its fractions were multiplied by 100 (that schema's rule for task metrics)"
                if src.schema < 2 and metric != "score" else "")
        add(key, "dev", col, f"glue:{metric}:dev", f"{metric} on the dev set, 0-100", rule.strip())
    return out


def _lm_measurements(src: Source, add) -> None:
    """Loss and perplexity per split the record has; a schema-1 record of a corpus without a test split wrote its
    validation split as `test_*` too, which is not a test measurement."""
    dk = dataset_key(src.dataset)
    tokenizer = str(src.task_cfg.get("tokenizer") or "token")
    unit = TOKEN_UNITS.get(tokenizer.lower(), tokenizer)
    text, read_as = _text_variant(src.task_cfg, unit)
    for split, prefix in SPLITS:
        if prefix == "test" and src.schema < 2 and dk in SCHEMA1_VALIDATION_AS_TEST:
            continue
        subset = _split_subset(src, prefix)
        add(f"{dk}:loss", split, f"metric.{prefix}_loss", f"xent-nats:{unit}{text}",
            f"cross-entropy in nats per {unit} token{read_as}", **subset)
        add(f"{dk}:ppl", split, f"metric.{prefix}_ppl", f"ppl:{unit}:nonoverlapping{text}",
            f"{unit}-level perplexity over non-overlapping windows{read_as}", **subset)


def _positive_int(value: Any) -> int | None:
    """A config's or record's count as an int, None where it is unset or not a positive whole number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if value > 0 and float(value).is_integer() else None


def _split_subset(src: Source, prefix: str) -> dict[str, int | None]:
    """{eval_tokens, split_tokens} of a Measurement on split `prefix` ('valid', 'test'): the tokens of the split a
    whole-split evaluation predicts, as data.json records them (`tokens`, the split's length; its first token is
    never predicted), and the task.eval_tokens the evaluation stopped at where that cut the split (or may have: a
    split whose length is not recorded)."""
    tokens = src.data.get("tokens") if isinstance(src.data, dict) else None
    length = _positive_int(tokens.get(prefix)) if isinstance(tokens, dict) else None
    split_tokens = length - 1 if length is not None and length > 1 else None
    cap = _positive_int(src.task_cfg.get("eval_tokens")) if src.task in EVAL_TOKENS_TASKS else None
    if cap is None or (split_tokens is not None and cap >= split_tokens):
        return {"eval_tokens": None, "split_tokens": split_tokens}
    return {"eval_tokens": cap, "split_tokens": split_tokens}


def _text_variant(task_cfg: dict, unit: str) -> tuple[str, str]:
    """(variant key suffix, words) for a text read other than as published: lowercased, or (words) with the
    vocabulary cut to task.vocab_size, rarer words read as <unk>. Both make the prediction easier, so such a loss
    or perplexity is another metric variant than the published full-text one, never the same."""
    key, words = "", []
    if task_cfg.get("lowercase") and unit in ("char", "word"):
        key, words = key + ":lowercased", [*words, "lowercased text"]
    if unit == "word" and task_cfg.get("vocab_size") is not None:
        size = task_cfg["vocab_size"]
        key, words = key + f":vocab{size}", [*words, f"vocabulary cut to {size} words (rarer ones read as <unk>)"]
    return key, (f" ({'; '.join(words)})" if words else "")


def _translation_measurements(src: Source, add) -> None:
    rows, dk = src.rows, dataset_key(src.dataset)
    pair = f"{src.task_cfg.get('src_lang', '?')}-{src.task_cfg.get('tgt_lang', '?')}"
    sets = sorted({c.split(".")[2] for c in rows.columns if c.startswith("metric.test_sets.") and c.endswith(".bleu")})
    for s in sets:
        sig = rows.get(f"metric.test_sets.{s}.bleu_signature")
        sig = next((x for x in sig if isinstance(x, str) and x), None) if sig is not None else None
        vkey, words = sacrebleu_variant(sig)
        add(f"{dk}:{pair}:bleu", s, f"metric.test_sets.{s}.bleu", vkey, words)
    if not sets:
        add(f"{dk}:{pair}:bleu", "test", "metric.bleu", "sacrebleu:unspecified", "BLEU (scorer not recorded)")


# -- model variants ------------------------------------------------------------------------------------------------
def _pretrained(nsp: Any) -> str:
    return "pretrained:?" if nsp is None else ("pretrained:mlm+nsp" if nsp else "pretrained:mlm")


def legacy_pretrain_nsp(init_from: str, near: Path | None = None) -> bool | None:
    """model.nsp of the pretraining run a legacy GLUE record names in task.init_from: from that run directory's
    config.yaml, or from the recorded run beside the record named after it (bench/results/run-<name>.json)."""
    ref = Path(init_from)
    candidates = [ref / "config.yaml"]
    if near is not None:  # bench/results/run-x.json: the repository is two levels up, the named run beside it
        candidates += [near.parent.parent / ref / "config.yaml", near / f"run-{ref.name}.json"]
    for path in candidates:
        if not path.is_file():
            continue
        data = read_json_or_none(path) if path.suffix == ".json" else load_yaml(path.read_text())
        cfg = (data or {}).get("config", data) or {}
        nsp = (cfg.get("model") or {}).get("nsp")
        if nsp is not None:
            return bool(nsp)
    return None


def record_model_variant(task: str, record: dict, config: dict, near: Path | None = None) -> str:
    """Which variant of the model a record is of: GLUE from its `init` (schema 2) or, for a legacy record, from
    task.init_from / task.pretrained_weights and the named pretraining run's model.nsp; other tasks train from
    scratch."""
    if task != "glue":
        return "from-scratch"
    init = record.get("init")
    if isinstance(init, dict) and init.get("weights"):
        if init["weights"] != "pretrained":
            return "random-init"
        objective = init.get("pretrain_objective")
        return f"pretrained:{objective}" if objective else "pretrained:?"
    t = config.get("task") or {}
    if not t.get("init_from") or t.get("pretrained_weights") is False:
        return "random-init"
    return _pretrained(legacy_pretrain_nsp(str(t["init_from"]), near))


def sweep_model_variant(results: SweepResults, label: str, rows: pd.DataFrame, task: str) -> str:
    """A sweep variant's model variant: from a finished trial's record (`init`), else from its planned config (a
    pipeline's GLUE stage starting from its pretraining stage: that stage's model.nsp)."""
    if task != "glue":
        return "from-scratch"
    for _, row in rows.iterrows():
        run_dir = results.run_dir(row)
        record = read_json_or_none(run_dir / "metrics.json") if run_dir else None
        if record and isinstance(record.get("init"), dict):
            return record_model_variant(task, record, {})
    glue = results.experiment_config(label)
    t = glue.get("task") or {}
    ref = str(t.get("init_from") or "")
    stages = results.point_config(label).get("stages") or {}
    if ref.startswith("stage:") and ref[len("stage:"):] in stages and t.get("pretrained_weights") is not False:
        return _pretrained((stages[ref[len("stage:"):]].get("model") or {}).get("nsp"))
    return record_model_variant(task, {}, glue)


# -- sources -------------------------------------------------------------------------------------------------------
def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _finetune_seeds(rows: pd.DataFrame) -> int | None:
    """Fine-tuning seeds per GLUE record, from its `seeds` metric (a list, flattened as '0,1')."""
    if "metric.seeds" not in rows or not rows["metric.seeds"].notna().any():
        return None
    return len(str(rows["metric.seeds"].dropna().iloc[0]).split(","))


def sweep_unit(results: SweepResults, rows: pd.DataFrame, task: str) -> str:
    """What the n of a sweep variant counts: seeds; a GLUE sweep's fine-tuning seeds; a pipeline's pretraining
    runs, each the mean of its fine-tuning seeds."""
    n, k = len(rows), _finetune_seeds(rows) if task == "glue" else None
    if task == "glue" and results.stages:
        return _plural(n, "pretraining run") + (f", each the mean of {_plural(k, 'fine-tuning seed')}" if k else "")
    return _plural(n, "fine-tuning seed" if task == "glue" else "seed")


def sweep_measurements(results: SweepResults) -> list[Measurement]:
    """For each task: the baseline and the best variant by the declared objective (mean over seeds). A variant
    with a diverged seed is no candidate (its mean over the seeds that survived flatters it, and the report never
    calls it better), nor is a trial relabelled by what ran (no variant of the design, and no planned config)."""
    out = []
    for task in results.tasks:
        done = results.completed(task)
        if done.empty:
            continue
        metric, direction = results.objective(task)
        col = metric_column(metric)
        means = done.groupby("label")[col].mean().dropna() if col in done else pd.Series(dtype=float)
        finished = results.finished(task)
        # (the baseline stays, as the yardstick: without it a variant worse than the baseline was the "best")
        dropped = set(finished.loc[(finished["status"] == DIVERGED) | ran_off_plan(finished), "label"])
        means = means.drop(dropped - {results.baseline_label}, errors="ignore")
        picks = [results.baseline_label]
        if len(means):
            best = means.idxmin() if direction == "minimize" else means.idxmax()
            if best not in picks:
                picks.append(best)
        for label in picks:
            rows = done[done["label"] == label]
            if rows.empty:
                continue
            cfg = results.experiment_config(label).get("task") or {}
            dataset = rows["dataset"].dropna().iloc[0] if rows["dataset"].notna().any() else cfg.get("dataset")
            kind = ("" if label == "baseline" else ", baseline" if label == results.baseline_label
                    else ", best variant")
            source = f"sweep {results.sweep}: {label}{kind} ({sweep_unit(results, rows, task)})"
            out += measurements_from_source(Source(source, rows, cfg, task, str(dataset or ""),
                                                   sweep_model_variant(results, label, rows, task),
                                                   data=_sweep_data(results, rows)))
    return out


def _sweep_data(results: SweepResults, rows: pd.DataFrame) -> dict:
    """The data.json of the first of `rows`' trials whose run directory holds one ({} where none is found: a
    results folder shipped without its runs)."""
    for _, row in rows.iterrows():
        run_dir = results.run_dir(row)
        data = read_json_or_none(run_dir / "data.json") if run_dir else None
        if isinstance(data, dict):
            return data
    return {}


def glue_seed_values(record: dict) -> dict[str, list[float]]:
    """A GLUE record's per-fine-tuning-seed values by column (`metric.SST-2/accuracy` -> [one per completed
    seed]): schema 2's `parts`, schema 1's `metrics.tasks`, the latter's fractions put on 0-100 by its rule."""
    schema = record_schema(record)
    parts = record.get("parts") if schema >= 2 else (record.get("metrics") or {}).get("tasks")
    out: dict[str, list[float]] = {}
    for task, part in (parts or {}).items():
        seeds = (part or {}).get("seeds") or {}
        for _, r in sorted(seeds.items(), key=lambda kv: str(kv[0])):
            if not isinstance(r, dict) or r.get("status", COMPLETED) != COMPLETED:
                continue
            for name, v in r.items():
                if name in GLUE_SEED_BOOKKEEPING or isinstance(v, bool) or not isinstance(v, (int, float)) \
                        or not math.isfinite(v):
                    continue
                scale = 1.0 if schema >= 2 or name in SCHEMA1_GLUE_ON_0_100 else 100.0
                out.setdefault(f"metric.{task}/{name}", []).append(scale * float(v))
    return out


def _schema1_glue_row(row: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 GLUE record's flat per-task metrics (and sds) on 0-100, by that schema's rule."""
    out = dict(row)
    for col, v in row.items():
        m = re.match(r"^metric\.[^./]+/(?P<name>[a-z0-9_]+)$", col)  # `f1` and `f1_std` too
        if m and isinstance(v, float) and not m["name"].startswith(SCHEMA1_GLUE_ON_0_100):
            out[col] = 100.0 * v
    return out


@dataclass
class Run:
    """One recorded run: its label, the record as a one-row table, the experiment config, the record itself and
    where it was read from."""

    label: str
    table: pd.DataFrame
    config: dict
    record: dict
    path: Path

    @property
    def task(self) -> str:
        return str((self.config.get("task") or {}).get("name") or "lm")


def load_run(path: str | Path) -> Run | None:
    """A recorded run (bench/results/run-*.json) or a run directory (metrics.json + config.yaml; a pipeline's:
    its last stage's config), or None when it holds neither."""
    path = Path(path)
    if path.is_dir():
        record = read_json_or_none(path / "metrics.json")
        if not isinstance(record, dict):
            return None
        config = {}
        if (path / "config.yaml").is_file():
            config = load_yaml((path / "config.yaml").read_text()) or {}
        label = config.get("name") or path.name
        if config.get("stages"):
            config = list(config["stages"].values())[-1] or {}
    elif path.suffix == ".json" and path.is_file():
        data = _read_run_json(path)
        if isinstance(data.get("metrics"), dict) and "status" in data["metrics"]:
            record, config, label = data["metrics"], data.get("config") or {}, data.get("label") or path.stem
        elif "status" in data:
            record, config, label = data, {}, path.stem
        else:
            return None
    else:
        return None
    row = flatten_record(record)
    row["seed"] = (config.get("train") or {}).get("seed", 0)
    if row["schema"] < 2 and (config.get("task") or {}).get("name") == "glue":
        row = _schema1_glue_row(row)
    return Run(str(label), pd.DataFrame([row]), config, record, path)


class UnreadableRun(ValueError):
    """A recorded run's JSON that is not JSON, or not an object: named, never skipped as if it held no run."""


def _read_run_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise UnreadableRun(f"{path} cannot be read as a recorded run: {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}") from None
    if not isinstance(data, dict):
        raise UnreadableRun(f"{path} holds a JSON {type(data).__name__}, not a recorded run (an object with "
                            "`metrics`, as bench/record_run.py writes)")
    return data


def run_source(run: Run) -> Source:
    """A recorded run as a Source: a GLUE record's n is its fine-tuning seeds (per-seed values from the record),
    with where its encoder came from; any other run is one seed."""
    task_cfg = run.config.get("task") or {}
    near = run.path.parent if run.path.is_file() else run.path
    variant = record_model_variant(run.task, run.record, run.config, near)
    schema = record_schema(run.record)
    if run.task != "glue":
        data = read_json_or_none(run.path / "data.json") if run.path.is_dir() else None
        return Source(f"run {run.label} (one seed)", run.table, task_cfg, run.task,
                      str(task_cfg.get("dataset") or run.label), variant, schema=schema,
                      data=data if isinstance(data, dict) else {})
    per_seed = glue_seed_values(run.record)
    origin = "random initialisation" if variant == "random-init" else "1 pretraining run"
    if per_seed:
        seeds = _plural(max(len(v) for v in per_seed.values()), "fine-tuning seed")
    else:  # a record without its parts: one number, the mean over the seeds it lists
        listed = (run.record.get("metrics") or {}).get("seeds")
        seeds = (f"the mean of {_plural(len(listed), 'fine-tuning seed')}, per-seed values not recorded"
                 if isinstance(listed, list) else "fine-tuning seeds not recorded")
    return Source(f"run {run.label} ({seeds}, {origin})", run.table, task_cfg, run.task,
                  str(task_cfg.get("dataset") or "glue"), variant, per_seed, schema)


def run_measurements(paths: list[str | Path]) -> list[Measurement]:
    out = []
    for p in paths:
        run = load_run(p)
        if run is None or str(run.record.get("status", COMPLETED)) != COMPLETED:
            continue
        out += measurements_from_source(run_source(run))
    return out
