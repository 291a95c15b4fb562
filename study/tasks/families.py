"""The declarations of the task families whose implementation is one module: language modelling (study.tasks.lm),
translation (study.tasks.translation) and BERT-style pretraining (study.tasks.pretrain); GLUE's is study.tasks.glue.

A declaration (its metrics, the fields it reads, its hooks) imports neither Lightning nor the family's data code:
`study sweep` reads every point's declarations while it plans, and `study.tasks.family` would otherwise import
Lightning for them (about 6-9 s on a two-core machine, before any trial starts). `implementation()` imports the
family's Lightning module when a run needs it.
"""

from __future__ import annotations

from study.config import ExperimentConfig
from study.tasks.contract import SPLIT_FROM_NAME, MetricSpec, TaskFamily

_UNIFORM = "ln(vocabulary size) nats for a uniform prediction; the unigram entropy for the best constant one"
# what one token of a per-token metric is: the tokenizer, its vocabulary and the text it reads decide it (and the corpus
# both are of: a loss on another corpus is another quantity)
TOKENS = ("task.dataset", "task.tokenizer", "task.vocab_size", "task.lowercase")
# a language model's evaluation: the tokens above, over the split's first task.eval_tokens tokens where that is set
EVALUATED_TOKENS = (*TOKENS, "task.eval_tokens")
# ... in windows of task.seq_len tokens: a longer window predicts each token from more context on average, so a loss
# at another training length is another quantity (the length curve, keyed by tokens, compares lengths)
AT_TRAINING_LENGTH = (*EVALUATED_TOKENS, "task.seq_len")
# a translation metric: which language is translated into which (BLEU on German references is another metric)
LANGUAGES = ("task.src_lang", "task.tgt_lang")
# lowercased BLEU and chrF score an easier task than cased ones (sacreBLEU's signature: case:lc)
CASING = ("task.lowercase",)
# a masked-token loss also depends on how many tokens are masked (a larger share leaves less context to predict from)
# and on task.seq_len, which decides the validation inputs (the segment pairs and full-sentence packs, and so the masks)
MASKED_TOKENS = (*TOKENS, "task.mlm_probability", "task.seq_len")
# the validation sentence pairs: segments of up to task.seq_len tokens of the tokenizer's, cut at sentence ends
SENTENCE_PAIRS = (*TOKENS, "task.seq_len")


class LanguageModelling(TaskFamily):
    """Next-token prediction with a decoder (`lm`)."""

    name = "lm"
    metrics = (
        MetricSpec("valid_loss", "minimize", "nats/token", _UNIFORM, description="validation cross-entropy (over "
                   "the split's first task.eval_tokens tokens where that is set)", split="valid",
                   defined_by=AT_TRAINING_LENGTH),
        MetricSpec("valid_ppl", "minimize", "perplexity", "the vocabulary size for a uniform prediction",
                   split="valid", defined_by=AT_TRAINING_LENGTH),
        MetricSpec("test_loss", "minimize", "nats/token", _UNIFORM, description="written when the corpus has a test "
                   "split (WikiText-2; not Tiny Shakespeare)", split="test", defined_by=AT_TRAINING_LENGTH),
        MetricSpec("test_ppl", "minimize", "perplexity", "the vocabulary size for a uniform prediction", split="test",
                   defined_by=AT_TRAINING_LENGTH),
        # measured on the corpus's last split, which the key names: test on WikiText-2, valid on Tiny Shakespeare
        MetricSpec("*_ppl_by_length.*", "minimize", "perplexity",
                   "the vocabulary size for a uniform prediction", objective=False,
                   description="perplexity at each evaluation length (key: tokens) on the last split; 'n/a' where "
                               "a position table cannot reach or the split holds no window of that length",
                   split=SPLIT_FROM_NAME, defined_by=EVALUATED_TOKENS),
        MetricSpec("*_ppl_at_2x", "minimize", "perplexity", "the vocabulary size for a uniform prediction",
                   description="perplexity at twice the training length (Press et al. 2022's extrapolation test)",
                   split=SPLIT_FROM_NAME, defined_by=AT_TRAINING_LENGTH),
    )
    default_objective = "valid_loss"
    reads_task_fields = frozenset({"seq_len", "tokenizer", "vocab_size", "lowercase", "eval_lengths", "eval_tokens"})

    def check_data(self, cfg: ExperimentConfig, data_dir) -> None:
        from study.tasks.data import load_lm_corpus

        load_lm_corpus(cfg.task.dataset, data_dir)

    def implementation(self):
        from study.tasks.lm import LMDataModule, LMModule

        return LMDataModule, LMModule

    def unwritten_metric(self, cfg: ExperimentConfig, metric: str) -> str | None:
        from study.tasks.data.lm import EVAL_SPLITS

        split = metric.split("_", 1)[0]
        splits = EVAL_SPLITS.get(cfg.task.dataset, ("valid", "test"))
        if split in ("valid", "test") and split not in splits:
            return f"{cfg.task.dataset} has no {split} split (only {list(splits)}): {metric} is never written"
        extrapolation = "_ppl_by_length" in metric or metric.endswith("_ppl_at_2x")
        if extrapolation and split != splits[-1]:
            return (f"the length curve is measured on the last split only ({splits[-1]}): {metric} is never written; "
                    f"use {splits[-1]}{metric[len(split):]}")
        if metric.endswith("_ppl_at_2x") and 2 not in cfg.task.eval_lengths:
            return f"task.eval_lengths={list(cfg.task.eval_lengths)} has no 2: {metric} is never written"
        return _beyond_positions(cfg, metric) if extrapolation else None


def _beyond_positions(cfg: ExperimentConfig, metric: str) -> str | None:
    """Why an extrapolation metric is written as n/a (study.tasks.lm): its length is beyond the rows of a position
    scheme that cannot extrapolate (a learned table of max_seq_len rows)."""
    from study.axes import POSITIONS

    tail = metric.rsplit(".", 1)[-1]
    length = 2 * cfg.task.seq_len if metric.endswith("_ppl_at_2x") else int(tail) if tail.isdigit() else None
    if length is None or POSITIONS[cfg.model.position].extrapolates or length <= cfg.model.max_seq_len:
        return None
    return (f"{cfg.model.position} positions cannot address length {length} (model.max_seq_len="
            f"{cfg.model.max_seq_len}): {metric} is written as n/a")



class Translation(TaskFamily):
    """Sequence-to-sequence translation with an encoder-decoder, scored with sacreBLEU (`translation`)."""

    name = "translation"
    metrics = (
        MetricSpec("valid_loss", "minimize", "nats/token", _UNIFORM, split="valid",
                   description="mean token cross-entropy of the final model on the validation split, its pairs cut to "
                               "task.seq_len as in training (truncated_pairs counts them; no label smoothing): the "
                               "objective a tuning may choose by, as BLEU is measured on test sets",
                   defined_by=(*TOKENS, "task.joint_vocab", *LANGUAGES, "task.seq_len")),
        MetricSpec("bleu", "maximize", "BLEU (0-100)", "about 0 (a constant sentence shares few n-grams)",
                   description="sacreBLEU on the first of task.test_sets, detokenized (13a); cased unless "
                               "task.lowercase (the record's signature says which)", split="test",
                   defined_by=(*CASING, *LANGUAGES, "task.test_sets")),
        MetricSpec("chrf", "maximize", "chrF (0-100)", "a few points (character n-grams of a constant sentence)",
                   description="sacreBLEU's chrF on the first of task.test_sets; cased unless task.lowercase",
                   split="test", defined_by=(*CASING, *LANGUAGES, "task.test_sets")),
        MetricSpec("test_sets.*.bleu", "maximize", "BLEU (0-100)", "about 0", split="test",
                   defined_by=(*CASING, *LANGUAGES)),
        MetricSpec("test_sets.*.chrf", "maximize", "chrF (0-100)", "a few points", split="test",
                   defined_by=(*CASING, *LANGUAGES)),
        MetricSpec("test_sets.*.decode_seconds", "minimize", "seconds", "-", objective=False, cost=True,
                   description="wall time of decoding the test set (beam search of task.beam_size; greedy at 1), "
                               "its tokenization and detokenization included (a measured cost)", split="test"),
        MetricSpec("test_sets.*.kv_cache_peak_bytes", "minimize", "bytes", "-", objective=False, cost=True,
                   description="the most bytes the KV cache held while a batch of 100 sentences was decoded "
                               "(each hypothesis's self-attention K/V and each sentence's cross-attention K/V, shared "
                               "by its hypotheses; measured from the cache's tensors)", split="test"),
        MetricSpec("test_sets.*.sentences", "maximize", "count", "-", objective=False, split="test"),
        MetricSpec("test_sets.*.truncated_sources", "minimize", "count", "-", objective=False, split="test",
                   description="test sentences whose source was cut to the length the position scheme can address "
                               "(model.max_seq_len of a learned table; never for the other schemes): their "
                               "translations saw part of the source, which lowers BLEU"),
        MetricSpec("test_sets.*.hypotheses_at_length_limit", "minimize", "count", "-", objective=False, split="test",
                   description="translations that ended because decoding forced EOS at their length limit "
                               "(task.max_len_a * |source| + task.max_len_b, or the position cap), not because the "
                               "model chose to end: cut translations, which lower BLEU"),
        MetricSpec("test_sets.*.length_capped_by_positions", "minimize", "count", "-", objective=False, split="test",
                   description="of hypotheses_at_length_limit, those whose limit was lowered below "
                               "task.max_len_a * |source| + task.max_len_b because a learned position table "
                               "(model.max_seq_len - 1 target tokens) cannot address more"),
        MetricSpec("truncated_pairs.*", "minimize", "count", "-", objective=False,
                   description="train/valid sentence pairs with a side over task.seq_len tokens, cut to it (a cut "
                               "target gets no EOS, so the model is not taught to end sentences early)"),
    )
    default_objective = "bleu"
    reads_task_fields = frozenset({"seq_len", "tokenizer", "vocab_size", "lowercase", "src_lang", "tgt_lang",
                                   "joint_vocab", "beam_size", "length_penalty", "max_len_a", "max_len_b",
                                   "test_sets"})

    def check_data(self, cfg: ExperimentConfig, data_dir) -> None:
        from study.tasks.data import load_translation

        task = cfg.task
        load_translation(task.dataset, task.src_lang, task.tgt_lang, data_dir,
                         needed=("train", "valid", *task.test_sets))

    def implementation(self):
        from study.tasks.translation import TranslationDataModule, TranslationModule

        return TranslationDataModule, TranslationModule

    def unread_fields(self, cfg: ExperimentConfig) -> dict[str, str]:
        out = super().unread_fields(cfg)
        if cfg.task.beam_size == 1:  # study.tasks.translation decodes greedily, which ranks no hypotheses
            out["task.length_penalty"] = "task.beam_size is 1: greedy decoding ranks no hypotheses by length"
        return out



class Pretraining(TaskFamily):
    """BERT-style masked language modelling, with or without next-sentence prediction (`pretrain`)."""

    name = "pretrain"
    metrics = (
        MetricSpec("valid_mlm_loss", "minimize", "nats/masked token", _UNIFORM,
                   description="MLM cross-entropy on the validation split in the model's own input format "
                               "(segment pairs with NSP, full sentences without)", split="valid",
                   defined_by=(*MASKED_TOKENS, "model.nsp")),
        MetricSpec("valid_mlm_ppl", "minimize", "perplexity", "the vocabulary size for a uniform prediction",
                   split="valid", defined_by=(*MASKED_TOKENS, "model.nsp")),
        MetricSpec("valid_mlm_loss_full_sentences", "minimize", "nats/masked token", _UNIFORM,
                   description="MLM cross-entropy on the validation text in the FULL-SENTENCES format: the same "
                               "input for a model trained with NSP or without, so the one to compare across them",
                   split="valid", defined_by=MASKED_TOKENS),
        MetricSpec("valid_nsp_accuracy", "maximize", "fraction (0-1)",
                   "the majority label's share of the validation pairs (0.55 on WikiText-2: a one-sentence "
                   "chunk is always paired with a random next, as in BERT)",
                   description="next-sentence prediction accuracy (written with model.nsp only)", split="valid",
                   defined_by=SENTENCE_PAIRS),
        MetricSpec("valid_nsp_loss", "minimize", "nats/pair", "ln 2 = 0.693 for a constant 50/50 prediction",
                   split="valid", defined_by=SENTENCE_PAIRS),
        MetricSpec("valid_masked_tokens", "maximize", "count", "-", objective=False,
                   description="masked tokens evaluated (bookkeeping)", split="valid"),
        MetricSpec("valid_nsp_pairs", "maximize", "count", "-", objective=False,
                   description="sentence pairs evaluated (bookkeeping)", split="valid"),
    )
    default_objective = "valid_mlm_loss"
    # the MLM loss, not the total (MLM + NSP), which adds a loss only NSP models have; still each model's own input
    # format (valid_mlm_loss's defined_by names model.nsp), so the report marks these curves † across NSP on/off
    curves = {"train": "train/mlm_loss", "valid": "val/mlm_loss"}
    reads_task_fields = frozenset({"seq_len", "tokenizer", "vocab_size", "lowercase", "mlm_probability",
                                   "nsp_weight"})
    unread_train_fields = frozenset({"label_smoothing"})

    def check_data(self, cfg: ExperimentConfig, data_dir) -> None:
        from study.tasks.data import load_lm_corpus

        load_lm_corpus(cfg.task.dataset, data_dir)

    def implementation(self):
        from study.tasks.pretrain import PretrainDataModule, PretrainModule

        return PretrainDataModule, PretrainModule

    def unwritten_metric(self, cfg: ExperimentConfig, metric: str) -> str | None:
        if metric.startswith("valid_nsp_") and not cfg.model.nsp:
            return f"model.nsp is false (MLM only, no sentence pairs): {metric} is never written"
        return None

    def predicted_fraction(self, cfg: ExperimentConfig) -> float:
        return cfg.task.mlm_probability  # the output head runs on the masked positions only
