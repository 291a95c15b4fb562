"""Score a translation model trained elsewhere (a Hugging Face seq2seq checkpoint, from the hub or
a local folder) on WMT14 newstest2014, the way `study` scores its own: detokenized output,
sacreBLEU BLEU and chrF with their signatures.

    study score-mt Helsinki-NLP/opus-mt-de-en --src de --tgt en --data-dir ../shared/data

This is how published WMT14 numbers (Vaswani et al. 2017 report tokenized BLEU on newstest2014)
can be set beside a model's sacreBLEU on the same test set, with the metric variant stated.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import sacrebleu
import torch

from study.tasks.data import DataError, load_newstest2014
from study.tasks.data.translation import newstest2014_release


class ModelUnavailable(DataError):
    pass


def load_hf_translator(model: str, device: str = "cpu"):
    """(model, tokenizer) of a seq2seq checkpoint: a local folder, else the hub id (offline: a clear error)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = str(Path(model).expanduser()) if model.startswith("~") else model
    if not Path(model).exists() and (model.startswith(("/", ".")) or model.count("/") > 1):
        # a path (a hub id is NAME or ORG/NAME): a mistyped folder was reported as a bad hub id
        raise ModelUnavailable(f"no local folder {model}: give the folder a seq2seq checkpoint and its tokenizer were "
                               "saved in (save_pretrained), or a hub id (NAME or ORG/NAME)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
        net = AutoModelForSeq2SeqLM.from_pretrained(model).to(device).eval()
    except (OSError, ValueError) as err:
        where = "local folder" if Path(model).exists() else "Hugging Face hub id"
        raise ModelUnavailable(
            f"cannot load translation model {model!r} ({where}): {str(err).splitlines()[0]}. Give a local folder "
            "holding a seq2seq checkpoint and its tokenizer (save_pretrained), or a hub id with network access."
        ) from None
    return net, tokenizer


# checkpoints that translate in the direction a language code or a task prefix names (mBART, M2M-100, NLLB: codes;
# T5: "translate German to English: "): score-mt sets neither, so they would translate in a default direction or
# not at all, and score as a poor model rather than as a refusal
NEEDS_DIRECTION = {"mbart": "language codes", "m2m_100": "language codes", "nllb-moe": "language codes",
                   "t5": "a task prefix", "mt5": "a task prefix", "umt5": "a task prefix"}


def direction_problem(net, tokenizer, model: str) -> str | None:
    """Why `model` cannot be scored as a plain src -> tgt translator, or None."""
    kind = getattr(getattr(net, "config", None), "model_type", None)
    needs = NEEDS_DIRECTION.get(kind) or ("language codes" if getattr(tokenizer, "src_lang", None) else None)
    if needs is None:
        return None
    return (f"{model} ({kind}) is told its translation direction by {needs}, which study score-mt does not set: it "
            "would translate in a default direction and score as a weak model. Give a bilingual checkpoint that "
            "translates the source as it is (Marian/opus-mt, FSMT; e.g. Helsinki-NLP/opus-mt-de-en)")


@torch.no_grad()
def translate(net, tokenizer, sources: list[str], beam_size: int = 4, batch_size: int = 16,
              max_new_tokens: int = 256, device: str = "cpu") -> tuple[list[str], dict[str, int]]:
    """The translations, and how many were cut: sources longer than the tokenizer's model_max_length (the model
    saw their start only) and outputs that ran to max_new_tokens. A cut lowers BLEU; without the counts nothing
    would say why."""
    out, cuts = [], {"truncated_sources": 0, "outputs_at_max_new_tokens": 0}
    eos = net.generation_config.eos_token_id
    eos = torch.tensor(eos if isinstance(eos, list) else [eos], device=device)
    for i in range(0, len(sources), batch_size):
        chunk = sources[i:i + batch_size]
        lengths = [len(ids) for ids in tokenizer(chunk)["input_ids"]]
        cuts["truncated_sources"] += sum(n > tokenizer.model_max_length for n in lengths)
        batch = tokenizer(chunk, return_tensors="pt", padding=True, truncation=True).to(device)
        generated = net.generate(**batch, num_beams=beam_size, max_new_tokens=max_new_tokens)
        new = generated[:, 1:]  # after the decoder's start token
        if new.shape[1] >= max_new_tokens:  # a row that did not end before its last token reached the limit (an EOS
            # there may be forced: BART's and Marian's configs set forced_eos_token_id)
            cuts["outputs_at_max_new_tokens"] += int((~torch.isin(new[:, :max_new_tokens - 1], eos).any(1)).sum())
        out += tokenizer.batch_decode(generated, skip_special_tokens=True)
    return out, cuts


def score_newstest2014(model: str, src: str = "de", tgt: str = "en", data_dir: str | None = None,
                       beam_size: int = 4, batch_size: int = 16, limit: int | None = None,
                       max_new_tokens: int = 256, device: str = "cpu") -> dict[str, Any]:
    """sacreBLEU BLEU and chrF (with signatures) of `model` on newstest2014 src->tgt."""
    corpus = load_newstest2014(src, tgt, data_dir)  # data errors first: before any model is loaded
    pairs = corpus.splits["test"][:limit] if limit else corpus.splits["test"]
    sources = [p[0] for p in pairs]
    references = [p[1] for p in pairs]
    net, tokenizer = load_hf_translator(model, device)
    if (problem := direction_problem(net, tokenizer, model)) is not None:
        raise ModelUnavailable(problem)
    started = time.time()
    hypotheses, cuts = translate(net, tokenizer, sources, beam_size, batch_size, max_new_tokens, device)
    seconds = time.time() - started
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    return {
        "model": model, "dataset": "newstest2014", "release": newstest2014_release(len(corpus.splits["test"])),
        "src": src, "tgt": tgt, "sentences": len(pairs),
        "complete": limit is None or limit >= len(corpus.splits["test"]),
        "bleu": bleu.corpus_score(hypotheses, [references]).score, "bleu_signature": str(bleu.get_signature()),
        "chrf": chrf.corpus_score(hypotheses, [references]).score, "chrf_signature": str(chrf.get_signature()),
        "beam_size": beam_size, "max_new_tokens": max_new_tokens, **cuts, "decode_seconds": seconds,
        # what the checkpoint's own generation config sets beyond the defaults (a length penalty, a minimum length,
        # forced tokens): generate() applies it, so the score is of these settings too
        "generation_config": json.loads(net.generation_config.to_json_string(use_diff=True)),
        "data": corpus.fingerprint,
        "examples": [{"source": s, "reference": r, "hypothesis": h}
                     for s, r, h in list(zip(sources, references, hypotheses))[:5]],
        "hypotheses": hypotheses,
    }
