"""GLUE tasks from the original TSV release (or the `nyu-mll/glue` hub copy).

Split names follow the GLUE files: "train", "dev", "test"; MNLI has "dev_matched", "dev_mismatched", "test_matched",
"test_mismatched" and "diagnostic" (the diagnostic set AX: test-only, predicted by the MNLI model; locally
`glue/diagnostic/diagnostic.tsv`, on the hub config "ax"). Labels use the hub's integer conventions (MNLI:
entailment 0, neutral 1, contradiction 2; QNLI/RTE: entailment 0, not_entailment 1; others 0/1 as in the files);
STS-B labels are floats in [0, 5]; test labels are None.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from study.tasks.data.errors import DataError, DatasetUnavailable, MalformedDataError
from study.tasks.data.sources import (
    DatasetSource,
    HubUnavailable,
    LocalFile,
    LocalFiles,
    decode_utf8,
    hub_fingerprint,
    hub_load_dataset,
    load_from_sources,
    local_fingerprint,
    read_bytes,
)

log = logging.getLogger(__name__)

GLUE_HUB_ID = "nyu-mll/glue"


@dataclass(frozen=True, slots=True)
class GlueExample:
    """One example. `text_b` is None for single-sentence tasks (CoLA, SST-2); `label` is an int class id (a float
    for STS-B) and None on test splits; `idx` is the file's index column (needed for test submissions) or, for files
    without one, the 0-based row number."""

    text_a: str
    text_b: str | None
    label: int | float | None
    idx: int


@dataclass(frozen=True)
class GlueTaskInfo:
    """Static metadata of a GLUE task.

    name: canonical name ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE", "WNLI").
    num_labels: number of classes (1 for the STS-B regression).
    is_regression: True for STS-B.
    metrics: metric names, computed on each of `eval_splits`: "mcc", "accuracy", "f1", "pearson", "spearman".
    label_names: class names by id (None for STS-B).
    train_split / eval_splits / test_splits: split names.
    """

    name: str
    hub_config: str
    num_labels: int
    is_regression: bool
    metrics: tuple[str, ...]
    label_names: tuple[str, ...] | None
    eval_splits: tuple[str, ...] = ("dev",)
    test_splits: tuple[str, ...] = ("test",)
    train_split: str = "train"
    # local TSV layout
    text_a_col: str = "sentence1"
    text_b_col: str | None = "sentence2"
    label_col: str = "label"
    label_map: dict[str, int] | None = None  # string label -> id; None: int() (or float() for regression)
    headerless_columns: tuple[str, ...] | None = None  # CoLA train/dev have no header row
    index_col: str | None = "index"
    # hub layout
    hub_text_a: str = "sentence1"
    hub_text_b: str | None = "sentence2"

    @property
    def all_splits(self) -> tuple[str, ...]:
        return (self.train_split, *self.eval_splits, *self.test_splits)

    @property
    def primary_metric(self) -> str:
        return self.metrics[0]

    @property
    def flat_metrics(self) -> tuple[str, ...]:
        """The metric names a run of this task writes: `metrics`, each suffixed by its dev split where the task has
        two (MNLI: accuracy_m, accuracy_mm)."""
        if len(self.eval_splits) == 1:
            return self.metrics
        return tuple(f"{m}_{DEV_SUFFIX.get(s, s)}" for s in self.eval_splits for m in self.metrics)


# the record's suffix for each of MNLI's dev splits (GlueTaskInfo.flat_metrics)
DEV_SUFFIX = {"dev_matched": "m", "dev_mismatched": "mm"}


_NLI2 = {"entailment": 0, "not_entailment": 1}
_MNLI = {"entailment": 0, "neutral": 1, "contradiction": 2}

GLUE_TASKS: dict[str, GlueTaskInfo] = {
    t.name: t
    for t in (
        GlueTaskInfo(
            "CoLA", "cola", 2, False, ("mcc",), ("unacceptable", "acceptable"),
            text_a_col="sentence", text_b_col=None, headerless_columns=("source", "label", "mark", "sentence"),
            hub_text_a="sentence", hub_text_b=None,
        ),
        GlueTaskInfo(
            "SST-2", "sst2", 2, False, ("accuracy",), ("negative", "positive"),
            text_a_col="sentence", text_b_col=None, hub_text_a="sentence", hub_text_b=None,
        ),
        GlueTaskInfo(
            "MRPC", "mrpc", 2, False, ("f1", "accuracy"), ("not_equivalent", "equivalent"),
            text_a_col="#1 String", text_b_col="#2 String", label_col="Quality",
        ),
        GlueTaskInfo(
            "STS-B", "stsb", 1, True, ("pearson", "spearman"), None, label_col="score",
        ),
        GlueTaskInfo(
            "QQP", "qqp", 2, False, ("f1", "accuracy"), ("not_duplicate", "duplicate"),
            text_a_col="question1", text_b_col="question2", label_col="is_duplicate", index_col="id",
            hub_text_a="question1", hub_text_b="question2",
        ),
        GlueTaskInfo(
            "MNLI", "mnli", 3, False, ("accuracy",), ("entailment", "neutral", "contradiction"),
            eval_splits=("dev_matched", "dev_mismatched"),
            test_splits=("test_matched", "test_mismatched", "diagnostic"),
            label_col="gold_label", label_map=_MNLI, hub_text_a="premise", hub_text_b="hypothesis",
        ),
        GlueTaskInfo(
            "QNLI", "qnli", 2, False, ("accuracy",), ("entailment", "not_entailment"),
            text_a_col="question", text_b_col="sentence", label_map=_NLI2,
            hub_text_a="question", hub_text_b="sentence",
        ),
        GlueTaskInfo(
            "RTE", "rte", 2, False, ("accuracy",), ("entailment", "not_entailment"), label_map=_NLI2,
        ),
        GlueTaskInfo(
            "WNLI", "wnli", 2, False, ("accuracy",), ("not_entailment", "entailment"),
        ),
    )
}
GLUE_TASK_NAMES: tuple[str, ...] = tuple(GLUE_TASKS)
_ALIASES = {re.sub(r"[^a-z0-9]", "", n.lower()): n for n in GLUE_TASKS}

# Test splits that live outside their task's folder and hub config. The diagnostic set (AX) has no training data of
# its own: the GLUE server scores the MNLI model's predictions on it, so it is loaded as a test split of MNLI.
_OWN_FILE = {"diagnostic": "diagnostic/diagnostic.tsv"}  # split -> file under glue/
_OWN_HUB = {"diagnostic": ("ax", "test")}  # split -> (hub config, hub split)


def glue_task_info(task: str) -> GlueTaskInfo:
    """Metadata for a task; accepts "SST-2", "sst2", "sst-2", "STS-B", "stsb", ..."""
    key = re.sub(r"[^a-z0-9]", "", task.lower())
    if key not in _ALIASES:
        raise DataError(f"unknown GLUE task {task!r}; choose one of {list(GLUE_TASK_NAMES)}")
    return GLUE_TASKS[_ALIASES[key]]


@dataclass(frozen=True)
class GlueTask:
    """A loaded GLUE task.

    Fields: info (GlueTaskInfo), splits (split name -> list[GlueExample]), fingerprint, unavailable_splits (test
    splits that were not found and so were skipped). Shortcuts: name, num_labels, is_regression, metrics,
    label_names, train_split, eval_splits, test_splits.
    """

    info: GlueTaskInfo
    splits: dict[str, list[GlueExample]]
    fingerprint: dict[str, Any]
    unavailable_splits: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def num_labels(self) -> int:
        return self.info.num_labels

    @property
    def is_regression(self) -> bool:
        return self.info.is_regression

    @property
    def metrics(self) -> tuple[str, ...]:
        return self.info.metrics

    @property
    def label_names(self) -> tuple[str, ...] | None:
        return self.info.label_names

    @property
    def train_split(self) -> str:
        return self.info.train_split

    @property
    def eval_splits(self) -> tuple[str, ...]:
        return self.info.eval_splits

    @property
    def test_splits(self) -> tuple[str, ...]:
        return self.info.test_splits

    def __getitem__(self, split: str) -> list[GlueExample]:
        return self.splits[split]


# --------------------------------------------------------------------------------------------------------------------
# Local TSV files


def _parse_label(info: GlueTaskInfo, raw: str, path: Path, line: int) -> int | float:
    raw = raw.strip()
    try:
        if info.is_regression:
            return float(raw)
        if info.label_map is not None:
            return info.label_map[raw]
        value = int(raw)
    except (KeyError, ValueError):
        allowed = list(info.label_map) if info.label_map else ("a number" if info.is_regression else "an integer")
        raise MalformedDataError(path, f"bad label {raw!r} (expected {allowed})", line=line) from None
    if not 0 <= value < info.num_labels:
        raise MalformedDataError(path, f"label {value} out of range 0..{info.num_labels - 1}", line=line)
    return value


def read_glue_tsv(info: GlueTaskInfo, path: Path, split: str) -> tuple[list[GlueExample], str]:
    """Parse one GLUE TSV file (csv.QUOTE_NONE, BOM tolerated, headerless CoLA train/dev). Returns examples, sha256."""
    data, digest = read_bytes(path)
    text = decode_utf8(path, data, bom=True)  # utf-8-sig: MRPC train/dev start with a BOM
    is_test = split in info.test_splits
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE, strict=False)
    headerless = info.headerless_columns is not None and not is_test
    if headerless:
        header = list(info.headerless_columns or ())
    else:
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise MalformedDataError(path, "empty file (expected a header row)", line=1) from None
    needed = [info.text_a_col] + ([info.text_b_col] if info.text_b_col else [])
    if not is_test:
        needed.append(info.label_col)
    missing = [c for c in needed if c not in header]
    if missing:
        raise MalformedDataError(path, f"missing column(s) {missing}; header is {header}", line=1)
    pos = {c: header.index(c) for c in needed}
    idx_pos = header.index(info.index_col) if info.index_col and info.index_col in header else None
    examples: list[GlueExample] = []
    for row in reader:
        line = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if len(row) != len(header):
            raise MalformedDataError(
                path, f"expected {len(header)} tab-separated fields ({header}), got {len(row)}", line=line
            )
        label = None if is_test else _parse_label(info, row[pos[info.label_col]], path, line)
        if idx_pos is not None:
            try:
                idx = int(row[idx_pos])
            except ValueError:
                raise MalformedDataError(path, f"bad index {row[idx_pos]!r}", line=line) from None
        else:
            idx = len(examples)
        examples.append(
            GlueExample(
                text_a=row[pos[info.text_a_col]],
                text_b=row[pos[info.text_b_col]] if info.text_b_col else None,
                label=label,
                idx=idx,
            )
        )
    return examples, digest


def _split_file(info: GlueTaskInfo, split: str) -> str:
    return _OWN_FILE.get(split, f"{info.name}/{split}.tsv")


def _local_files(info: GlueTaskInfo, splits: Sequence[str], required: set[str]) -> dict[str, LocalFile]:
    return {
        s: LocalFile(display=_split_file(info, s), candidates=(_split_file(info, s),), required=s in required)
        for s in splits
    }


def _glue_local(info: GlueTaskInfo, splits: Sequence[str], local: LocalFiles) -> GlueTask:
    out, digests, skipped = {}, {}, []
    for s in splits:
        path = local.found.get(s)
        if path is None:
            skipped.append(s)
            continue
        out[s], digests[path] = read_glue_tsv(info, path, s)
    fp = local_fingerprint("glue/" + info.name, local, digests, task=info.name)
    return GlueTask(info, out, fp, tuple(skipped))


def _glue_hub(info: GlueTaskInfo, splits: Sequence[str], required: set[str], revision: str) -> GlueTask:
    configs: dict[str, Any] = {}  # hub config -> its loaded DatasetDict (MNLI's diagnostic split is config "ax")

    def hub_split(split: str) -> tuple[str, Any]:
        config, name = _OWN_HUB.get(split, (info.hub_config, split.replace("dev", "validation")))
        if config not in configs:
            configs[config] = hub_load_dataset(GLUE_HUB_ID, config, revision)
        if name not in configs[config]:
            raise HubUnavailable(f"{GLUE_HUB_ID}/{config}: no split {name!r}")
        return config, configs[config][name]

    out, skipped = {}, []
    for s in splits:
        try:
            config, d = hub_split(s)
        except HubUnavailable as e:
            if s in required:
                raise
            # an optional test split (e.g. the diagnostic set, a second download) must not cost the task
            log.warning("GLUE %s: split %r not loaded from the hub; skipped (%s)", info.name, s, e)
            skipped.append(s)
            continue
        cols = d.column_names
        needed = [info.hub_text_a, "label", "idx"] + ([info.hub_text_b] if info.hub_text_b else [])
        if any(c not in cols for c in needed):
            raise HubUnavailable(f"{GLUE_HUB_ID}/{config}: expected columns {needed}, got {cols}")
        a = d[info.hub_text_a]
        b = d[info.hub_text_b] if info.hub_text_b else [None] * len(a)
        labels = d["label"]
        idxs = d["idx"]
        is_test = s in info.test_splits

        def conv(lab: Any, is_test: bool = is_test) -> int | float | None:
            if is_test or lab is None or lab == -1:
                return None
            return float(lab) if info.is_regression else int(lab)

        out[s] = [GlueExample(ta, tb, conv(lab), int(i)) for ta, tb, lab, i in zip(a, b, labels, idxs)]
    fp = hub_fingerprint(DatasetSource("glue", ("glue",), GLUE_HUB_ID, info.hub_config), revision, task=info.name)
    return GlueTask(info, out, fp, tuple(skipped))


def load_glue(
    task: str, data_dir: str | os.PathLike[str] | None = None, splits: Iterable[str] | None = None
) -> GlueTask:
    """Load one GLUE task.

    task: "CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE" or "WNLI" (case and dashes ignored).
    Local files: `glue/<Task>/{train,dev,test}.tsv` (MNLI: `dev_matched.tsv`, `dev_mismatched.tsv`,
    `test_matched.tsv`, `test_mismatched.tsv`; its "diagnostic" split is `glue/diagnostic/diagnostic.tsv`), as
    written by GLUE's `download_glue_data.py` (a `glue_data/` folder, or `data_dir` pointing at it, also works).
    Hub fallback: `nyu-mll/glue`.
    splits: which splits to load. Default: train and the dev split(s) are required, test splits are loaded when
    present (else listed in `unavailable_splits`). Splits named explicitly are all required.
    Raises DatasetUnavailable (naming the missing files and the hub id) if a required file is missing and the hub
    cannot be used; MalformedDataError (file and line) for a bad row.
    """
    info = glue_task_info(task)
    if splits is None:
        wanted = list(info.all_splits)
        required = {info.train_split, *info.eval_splits}
    else:
        wanted = list(splits)
        bad = [s for s in wanted if s not in info.all_splits]
        if bad:
            raise DataError(f"GLUE {info.name} has no split(s) {bad}; splits are {list(info.all_splits)}")
        required = set(wanted)
    source = DatasetSource(
        name=f"GLUE {info.name}",
        subdirs=("glue", "glue_data"),
        hub_id=GLUE_HUB_ID,
        hub_config=info.hub_config,
    )
    return load_from_sources(
        source,
        _local_files(info, wanted, required),
        data_dir,
        lambda local: _glue_local(info, wanted, local),
        lambda rev: _glue_hub(info, wanted, required, rev),
    )


def load_glue_suite(
    tasks: Iterable[str] = GLUE_TASK_NAMES, data_dir: str | os.PathLike[str] | None = None
) -> tuple[dict[str, GlueTask], dict[str, DatasetUnavailable]]:
    """Load several tasks; tasks whose data is unavailable are skipped and returned with their error, e.g.
    `loaded, skipped = load_glue_suite()`; report `str(skipped[name])` for each skipped task."""
    loaded: dict[str, GlueTask] = {}
    skipped: dict[str, DatasetUnavailable] = {}
    for t in tasks:
        name = glue_task_info(t).name
        try:
            loaded[name] = load_glue(name, data_dir)
        except DatasetUnavailable as e:
            skipped[name] = e
    return loaded, skipped
