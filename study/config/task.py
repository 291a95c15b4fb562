"""`TaskConfig`: which task family, on which data, measured how."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from study.config.base import Config, Problems

# task family -> (architecture it trains, datasets it reads)
TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lm": ("decoder", ("tinyshakespeare", "wikitext-2")),
    "translation": ("encoder-decoder", ("multi30k",)),
    "pretrain": ("encoder", ("wikitext-2",)),
    # glue: one task, or "glue" for the suite listed in task.glue_tasks
    "glue": ("encoder", ("glue", "cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")),
}
GLUE_DATASETS = TASKS["glue"][1][1:]
TOKENIZERS = ("char", "word", "bpe", "wordpiece")
# the tokenizer each dataset is conventionally measured with
DEFAULT_TOKENIZER = {"tinyshakespeare": "char", "wikitext-2": "word", "multi30k": "bpe"}
LANGS = ("de", "en", "fr", "cs")
# Multi30k's test sets (Task 1), and those its release lacks in a language: Czech joined in 2018 (Barrault et al.
# 2018), after the 2017 test sets were translated
MULTI30K_TEST_SETS = ("test_2016_flickr", "test_2017_flickr", "test_2017_mscoco", "test_2018_flickr")
MULTI30K_NOT_IN = {"cs": ("test_2017_flickr", "test_2017_mscoco")}
POOLINGS = ("cls", "mean")
# the task fields one GLUE task of a suite may set for itself (task.per_task); the rest are the suite's
PER_TASK_FIELDS = ("epochs", "pooling", "seq_len")
# the training fields that are the suite's alone: where and at what precision it runs (resolved once for the machine,
# as `precision: auto` is, before any part starts)
SUITE_TRAIN_FIELDS = ("precision", "accelerator", "devices", "strategy")
# and the model fields: fine-tuning's regularisation, the ones a pretrained encoder (task.init_from) does not decide
PER_TASK_MODEL_FIELDS = ("dropout", "attention_dropout")


def glue_task_key(name: str) -> str:
    """GLUE task name as the dataset key: "SST-2" -> "sst2", "STS-B" -> "stsb"."""
    return "".join(c for c in str(name).lower() if c.isalnum())


@dataclass(frozen=True)
class TaskConfig(Config):
    name: str = "lm"
    dataset: str = "tinyshakespeare"
    seq_len: int = 128  # lm/pretrain: training context; translation: max tokens per sentence
    tokenizer: str | None = None  # None -> the dataset's conventional one
    vocab_size: int | None = None  # bpe/wordpiece target size; word: the most frequent words (None: all); char: None
    lowercase: bool = False
    # lm: perplexity at these multiples of seq_len (length extrapolation, Press et al. 2022)
    eval_lengths: tuple[int, ...] = (1, 2, 4, 8)
    eval_tokens: int | None = None  # lm: evaluate on the first N tokens of valid/test; None -> the whole split
    # translation
    src_lang: str = "de"
    tgt_lang: str = "en"
    joint_vocab: bool = True
    beam_size: int = 5
    length_penalty: float = 1.0  # GNMT-style ((5 + |y|) / 6)^alpha (Wu et al. 2016); 0 -> raw log-prob
    max_len_a: float = 1.2  # decode at most a * |source| + b tokens (fairseq's convention)
    max_len_b: int = 10
    test_sets: tuple[str, ...] = ("test_2016_flickr", "test_2017_flickr", "test_2017_mscoco")
    # pretrain (BERT-style MLM; NSP on or off is model.nsp)
    mlm_probability: float = 0.15  # fraction of tokens selected; of those 80% [MASK], 10% random, 10% unchanged
    # loss = MLM + nsp_weight * NSP. BERT sums them unweighted (1.0); a larger weight gives the one-label-per-pair
    # NSP signal more of the shared encoder's gradient against the ~10 labels per pair of MLM
    nsp_weight: float = 1.0
    # glue
    glue_tasks: tuple[str, ...] = ()  # dataset "glue": these tasks (e.g. [sst2, cola]); empty -> all nine
    init_from: str | None = None  # a pretrain run directory: its architecture, weights and tokenizer
    pretrained_weights: bool = True  # with init_from: false keeps its tokenizer and shape, weights start random
    finetune_seeds: tuple[int, ...] = ()  # one fine-tuning run per seed and task; empty -> (train.seed,)
    epochs: float | None = None  # glue: at most this many passes over a task's training set (max_steps caps too)
    # glue: what the classifier's tanh pooler reads: BERT's first-token vector ("cls") or the mean of the final hidden
    # states over the real tokens ("mean", Sentence-BERT's default: Reimers & Gurevych 2019, Table 6)
    pooling: str = "cls"
    # glue: settings for single tasks of the suite, as `--set` keys, e.g. {cola: {train.lr: 1.0e-4, task.epochs: 6}};
    # Devlin et al. (2019, A.3) choose the fine-tuning learning rate per task on dev. Only train.* (not the seed, which
    # task.finetune_seeds gives), the task fields in PER_TASK_FIELDS and the model fields in PER_TASK_MODEL_FIELDS;
    # keys are task names (case and dashes ignored)
    per_task: dict[str, dict[str, Any]] = field(default_factory=dict)

    def _resolve_defaults(self) -> None:
        if self.name == "glue" and glue_task_key(self.dataset) in TASKS["glue"][1]:
            object.__setattr__(self, "dataset", glue_task_key(self.dataset))  # "SST-2" -> "sst2"
        if self.tokenizer is None:
            default = "wordpiece" if self.name in ("pretrain", "glue") else DEFAULT_TOKENIZER.get(self.dataset, "wordpiece")
            object.__setattr__(self, "tokenizer", default)
        if self._per_task_is_mapping():
            object.__setattr__(self, "per_task", {glue_task_key(k): dict(v) for k, v in self.per_task.items()})

    def _per_task_is_mapping(self) -> bool:
        return isinstance(self.per_task, dict) and all(isinstance(v, dict) for v in self.per_task.values())

    def _validate_per_task(self, p: Problems) -> None:
        """The shape of task.per_task; the values are checked where they are applied (ExperimentConfig)."""
        if not self._per_task_is_mapping():
            p.add("per_task", f"must map GLUE task names to {{section.field: value}} settings, got {self.per_task!r}")
            return
        bad = [t for t in self.per_task if t not in GLUE_DATASETS]
        p.check(not bad, "per_task", f"unknown GLUE task(s) {bad}; valid: {list(GLUE_DATASETS)} (case and dashes ignored)")
        for task, settings in self.per_task.items():
            for key in settings:
                section, _, name = str(key).partition(".")
                ok = ((section == "train" and name not in ("", "seed", *SUITE_TRAIN_FIELDS))
                      or (section == "task" and name in PER_TASK_FIELDS)
                      or (section == "model" and name in PER_TASK_MODEL_FIELDS))
                p.check(ok, f"per_task.{task}", f"{key!r} cannot be set per task; valid: train.FIELD (not train.seed: "
                        "task.finetune_seeds gives the seeds; nor the hardware, one for the suite: "
                        f"{', '.join(f'train.{n}' for n in SUITE_TRAIN_FIELDS)}), "
                        f"task.{{{','.join(PER_TASK_FIELDS)}}} or model.{{{','.join(PER_TASK_MODEL_FIELDS)}}}")

    def _validate_glue(self, p: Problems) -> None:
        """The fields of GLUE fine-tuning (`glue`), each refused where it cannot apply."""
        bad = [t for t in self.glue_tasks if glue_task_key(t) not in GLUE_DATASETS]
        p.check(not bad, "glue_tasks",
                f"unknown GLUE task(s) {bad}; valid: {list(GLUE_DATASETS)} (case and dashes ignored)")
        p.check(len(set(self.finetune_seeds)) == len(self.finetune_seeds) and all(s >= 0 for s in self.finetune_seeds),
                "finetune_seeds", f"must be distinct seeds >= 0, got {list(self.finetune_seeds)}")
        p.check(self.epochs is None or self.epochs > 0, "epochs", f"must be > 0 or null, got {self.epochs}")
        p.choice("pooling", self.pooling, POOLINGS)
        self._validate_per_task(p)
        if self.name != "glue":
            for name, empty in (("glue_tasks", ()), ("init_from", None), ("finetune_seeds", ()), ("epochs", None),
                                ("pooling", "cls"), ("per_task", {})):
                p.check(getattr(self, name) == empty, name,
                        f"only applies to task.name='glue' (got {getattr(self, name)!r})")
        elif self.dataset != "glue":
            p.check(not self.glue_tasks, "glue_tasks",
                    f"only applies to dataset='glue' (the suite), not {self.dataset!r}")
        if self.init_from is not None:
            p.check(self.init_from.strip() != "", "init_from", "must be a pretrain run directory or null")
        p.check(self.pretrained_weights or self.init_from is not None, "pretrained_weights",
                "false only applies with task.init_from (a pretrained run's architecture and tokenizer, random "
                "weights); without init_from the weights start random either way")

    @property
    def arch(self) -> str:
        return TASKS[self.name][0]

    def _validate_test_sets(self, p: Problems) -> None:
        absent = {t for lang in (self.src_lang, self.tgt_lang) for t in MULTI30K_NOT_IN.get(lang, ())}
        valid = [t for t in MULTI30K_TEST_SETS if t not in absent]
        wrong = [t for t in self.test_sets if t not in valid]
        why = " (Czech joined in 2018: it has no 2017 test sets)" if absent else ""
        p.check(len(self.test_sets) >= 1 and not wrong, "test_sets",
                f"{wrong} not in multi30k {self.src_lang}-{self.tgt_lang}, whose test sets are {valid}{why}" if wrong
                else f"needs at least one of multi30k's test sets {valid}")

    def _validate(self, p: Problems) -> None:
        if p.choice("name", self.name, TASKS):
            p.choice("dataset", self.dataset, TASKS[self.name][1])
        p.choice("tokenizer", self.tokenizer, TOKENIZERS)
        p.check(self.seq_len >= 2, "seq_len", f"must be >= 2, got {self.seq_len}")
        # a GLUE pair is [CLS] a [SEP] b [SEP]: three special tokens and at least one of text
        p.check(self.name != "glue" or self.seq_len >= 4, "seq_len", f"glue needs >= 4, got {self.seq_len}")
        p.check(self.vocab_size is None or self.vocab_size >= 16, "vocab_size", "must be >= 16 or null")
        p.check(len(self.eval_lengths) >= 1 and all(k >= 1 for k in self.eval_lengths), "eval_lengths",
                f"must be multiples >= 1 of seq_len, got {list(self.eval_lengths)}")
        longest = max(self.eval_lengths, default=1) * self.seq_len  # a window of every evaluation length
        p.check(self.eval_tokens is None or self.eval_tokens >= longest, "eval_tokens",
                f"must hold one window of the longest evaluation length, max(eval_lengths) x seq_len = {longest} "
                f"tokens, or be null (the whole split); got {self.eval_tokens}")
        p.choice("src_lang", self.src_lang, LANGS)
        p.choice("tgt_lang", self.tgt_lang, LANGS)
        p.check(self.src_lang != self.tgt_lang, "tgt_lang", "must differ from src_lang")
        if self.name == "translation" and self.dataset == "multi30k":
            self._validate_test_sets(p)
        p.check(self.beam_size >= 1, "beam_size", f"must be >= 1, got {self.beam_size}")
        p.check(self.length_penalty >= 0, "length_penalty", f"must be >= 0, got {self.length_penalty}")
        # decoding stops at max_len_a * |source| + max_len_b tokens
        p.check(self.max_len_a >= 0, "max_len_a", f"must be >= 0, got {self.max_len_a}")
        p.check(self.max_len_b >= 1, "max_len_b", f"must be >= 1, got {self.max_len_b}")
        if self.tokenizer in ("bpe", "wordpiece") and not (self.name == "glue" and self.init_from):
            p.check(self.vocab_size is not None, "vocab_size", f"tokenizer={self.tokenizer!r} needs a vocab_size")
        if self.name in ("pretrain", "glue"):
            p.check(self.tokenizer in ("wordpiece", "bpe"), "tokenizer",
                    f"{self.name} needs a subword vocabulary ('wordpiece' or 'bpe'), got {self.tokenizer!r}")
        p.check(0 < self.mlm_probability < 1, "mlm_probability", f"must be in (0, 1), got {self.mlm_probability}")
        p.check(self.nsp_weight > 0, "nsp_weight", f"must be > 0, got {self.nsp_weight}")
        if self.name != "pretrain":
            p.check(self.nsp_weight == 1.0, "nsp_weight", f"only applies to task.name='pretrain' (got {self.nsp_weight})")
        self._validate_glue(p)
        if self.name == "translation":
            # BLEU is computed on detokenized text: the tokenizer must give the text back exactly
            p.check(self.tokenizer in ("bpe", "char"), "tokenizer",
                    f"translation is scored on detokenized text and needs a lossless tokenizer ('bpe' or 'char'), "
                    f"got {self.tokenizer!r}")
        # a character vocabulary is the corpus's characters: a size would be a label the model does not have
        p.check(self.tokenizer != "char" or self.vocab_size is None, "vocab_size",
                f"tokenizer='char' takes the corpus's characters; leave vocab_size null, got {self.vocab_size}")
        if self.tokenizer == "bpe" and self.vocab_size is not None:
            # byte-level BPE starts from 256 byte symbols; fewer leaves no room for a single merge
            p.check(self.vocab_size > 260, "vocab_size", f"byte-level bpe needs vocab_size > 260, got {self.vocab_size}")
