"""Data layer: benchmark corpora as plain Python structures, plus cached tokenizers.

Sources: a local folder (`data_dir=` / `--data-dir` / `$STUDY_DATA_DIR`) takes precedence; otherwise the Hugging
Face hub (skipped in offline mode, short timeouts). See `study.tasks.data.sources`.

    load_lm_corpus(name, data_dir=None) -> LMCorpus                    # "wikitext-2", "tinyshakespeare"
    load_translation("multi30k", src, tgt, data_dir=None) -> TranslationCorpus
    load_newstest2014(src, tgt, data_dir=None) -> TranslationCorpus    # split "test", for scoring
    load_glue(task, data_dir=None, splits=None) -> GlueTask
    load_glue_suite(tasks, data_dir=None) -> (loaded, skipped)
    build_tokenizer(kind, texts, vocab_size, special_tokens, cache_dir, fingerprint, ...) -> TrainedTokenizer
"""

from study.tasks.data.errors import DataError, DatasetUnavailable, MalformedDataError
from study.tasks.data.glue import (
    GLUE_TASK_NAMES,
    GLUE_TASKS,
    GlueExample,
    GlueTask,
    GlueTaskInfo,
    glue_task_info,
    load_glue,
    load_glue_suite,
)
from study.tasks.data.lm import LM_CORPORA, LMCorpus, load_lm_corpus, split_wikitext_documents
from study.tasks.data.sources import DATA_DIR_ENV, resolve_data_dir
from study.tasks.data.tokenizers import (
    TOKENIZER_KINDS,
    TrainedTokenizer,
    build_lm_tokenizer,
    build_tokenizer,
    build_translation_tokenizers,
    tokenizer_cache_key,
    translation_texts,
)
from study.tasks.data.translation import TranslationCorpus, load_newstest2014, load_translation

__all__ = [
    "DATA_DIR_ENV",
    "DataError",
    "DatasetUnavailable",
    "GLUE_TASKS",
    "GLUE_TASK_NAMES",
    "GlueExample",
    "GlueTask",
    "GlueTaskInfo",
    "LMCorpus",
    "LM_CORPORA",
    "MalformedDataError",
    "TOKENIZER_KINDS",
    "TrainedTokenizer",
    "TranslationCorpus",
    "build_lm_tokenizer",
    "build_tokenizer",
    "build_translation_tokenizers",
    "glue_task_info",
    "load_glue",
    "load_glue_suite",
    "load_lm_corpus",
    "load_newstest2014",
    "load_translation",
    "resolve_data_dir",
    "split_wikitext_documents",
    "tokenizer_cache_key",
    "translation_texts",
]
