"""Choose a translation recipe's beam-search length penalty on the validation split, never on a test set.

    python bench/length_penalty.py --run bench/runs/multi30k-de-en-zen4-seed0 [--alphas 0,0.6,1.0,1.4] [--test]

Decodes the run's validation split ("valid": 1,014 Multi30k pairs) with the run's beam size and length limits at each
GNMT length penalty alpha (score / ((5 + |Y|) / 6)^alpha; Wu et al. 2016), under bf16 autocast when the run trained in
bf16 as `TranslationModule.translate` decodes, and prints sacreBLEU per alpha. `--test` also scores the recipe's first
test set at each alpha, recorded beside the validation column so a reader sees whether the choice carried over; it
must not be used to choose. JSON to bench/results/length-penalty-<run name>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import batches, load, machine  # noqa: E402

from study.model.generate import beam_search  # noqa: E402


def bleu_at(model, cfg, dm, split: str, alpha: float) -> dict:
    """sacreBLEU of the split decoded with length penalty `alpha`, and the mean hypothesis length in tokens."""
    import sacrebleu

    from study.tasks.translation import BOS, EOS, PAD

    task = cfg.task
    sources, refs = dm.corpus.sources(split), dm.corpus.targets(split)
    hyps: list[list[int]] = [[] for _ in sources]
    started = time.perf_counter()
    for chunk, src, mask in batches(cfg, dm, sources):
        found = beam_search(model, src, mask, bos=BOS, eos=EOS, beam_size=task.beam_size, length_penalty=alpha,
                            max_len_a=task.max_len_a, max_len_b=task.max_len_b, never=(PAD, BOS))
        for i, h in zip(chunk, found):
            hyps[i] = h
    metric = sacrebleu.metrics.BLEU()
    score = metric.corpus_score(dm.tgt_tok.decode_batch(hyps), [refs])
    return {"bleu": score.score, "signature": str(metric.get_signature()),
            "mean_hypothesis_tokens": sum(map(len, hyps)) / len(hyps), "seconds": time.perf_counter() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a translation run directory")
    parser.add_argument("--data-dir", default=os.environ.get("STUDY_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--cache-dir", default=None, help="tokenizer cache the run used (default: study's)")
    parser.add_argument("--alphas", default="0,0.6,1.0,1.4")
    parser.add_argument("--test", action="store_true", help="also score the first test set (for the record only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    run = Path(args.run)
    model, cfg, dm = load(run, args.data_dir, args.cache_dir)
    bf16 = cfg.train.precision == "bf16-mixed"
    splits = ["valid"] + ([cfg.task.test_sets[0]] if args.test else [])
    rows = []
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for alpha in (float(a) for a in args.alphas.split(",")):
            row = {"alpha": alpha, **{split: bleu_at(model, cfg, dm, split, alpha) for split in splits}}
            rows.append(row)
            print(f"alpha {alpha:4.2f}  " + "  ".join(f"{s} BLEU {row[s]['bleu']:6.2f}" for s in splits), flush=True)
    best = max(rows, key=lambda r: r["valid"]["bleu"])
    print(f"best on valid: alpha {best['alpha']} (the run decoded its test sets with {cfg.task.length_penalty})")
    record = {"date": datetime.date.today().isoformat(), "run_dir": str(run), "precision": cfg.train.precision,
              "beam": cfg.task.beam_size, "recipe_length_penalty": cfg.task.length_penalty,
              "chosen_on_valid": best["alpha"], "rows": rows, "machine": machine(torch.get_num_threads())}
    from study.io import atomic_write_text, unused_path

    out = Path(args.out) if args.out else unused_path(ROOT / "bench" / "results" / f"length-penalty-{run.name}.json")
    atomic_write_text(out, json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
