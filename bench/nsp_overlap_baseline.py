"""How separable are WikiText-2's NSP pairs without any learning? A one-feature rule as a yardstick for NSP accuracy.

    .venv/bin/python bench/nsp_overlap_baseline.py [--config experiments/wikitext2_bert_pretrain_nsp.yaml]

Builds the pretraining pairs exactly as `study run` does (same tokenizer, `nsp_pairs`, the fixed validation pairs),
and scores the rule "B is from another article when few of B's word pieces occur in A": the feature is the share of
B's distinct word pieces, the `--common` most frequent ones of the training split left out, that also occur in A; the
threshold is the one with the best accuracy on one epoch of training pairs. Prints and writes
`bench/results/nsp-overlap-baseline.json`. A model at the majority class on pairs this rule separates has not
learned what its input shows, rather than been given an impossible task.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from study.config import ExperimentConfig  # noqa: E402
from study.tasks.pretrain import N_SPECIAL, VALID_SEED, PretrainDataModule  # noqa: E402


def overlap_features(dm: PretrainDataModule, split: str, seed: int, common: set[int]) -> list[tuple[float, int]]:
    examples, labels = dm.examples(split, True, random.Random(seed))
    out = []
    for (ids, types), label in zip(examples, labels):
        a = {t for t, s in zip(ids, types) if s == 0 and t >= N_SPECIAL and t not in common}
        b = {t for t, s in zip(ids, types) if s == 1 and t >= N_SPECIAL and t not in common}
        out.append((len(a & b) / max(1, len(b)), label))
    return out


def accuracy(data: list[tuple[float, int]], threshold: float) -> float:
    return sum((f < threshold) == (label == 1) for f, label in data) / len(data)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "experiments" / "wikitext2_bert_pretrain_nsp.yaml"))
    parser.add_argument("--data-dir", default=os.environ.get("STUDY_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--cache-dir", default=os.environ.get("STUDY_CACHE_DIR", str(ROOT / ".cache" / "study")))
    parser.add_argument("--common", type=int, default=200, help="leave out the N most frequent word pieces")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nsp-overlap-baseline.json")
    args = parser.parse_args()

    cfg = ExperimentConfig.load(args.config, [])
    dm = PretrainDataModule(cfg, data_dir=args.data_dir, cache_dir=args.cache_dir)
    dm.prepare()
    counts = collections.Counter(t for doc in dm.docs["train"] for sent in doc for t in sent)
    common = {t for t, _ in counts.most_common(args.common)}
    train = overlap_features(dm, "train", cfg.train.seed, common)
    valid = overlap_features(dm, "valid", VALID_SEED, common)
    threshold = max(sorted({f for f, _ in train}), key=lambda th: accuracy(train, th))
    n_random = sum(label for _, label in valid)
    record = {
        "what": "NSP accuracy of the rule 'B is random when the share of its word pieces (the most frequent left out)"
                " also in A is below a threshold fitted on training pairs'",
        "config": os.path.relpath(args.config, ROOT),
        "common_left_out": args.common,
        "threshold": threshold,
        "train_pairs": len(train),
        "train_accuracy": accuracy(train, threshold),
        "valid_pairs": len(valid),
        "valid_accuracy": accuracy(valid, threshold),
        "valid_majority_class": max(n_random, len(valid) - n_random) / len(valid),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
