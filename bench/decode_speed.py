"""Beam-search decode throughput: the vectorised `study.model.generate.beam_search` against the per-sentence loop it
replaced (`tests/beam_search_reference.py`, kept verbatim with the KV cache it ran on), on a trained Multi30k model
and a real test set. Both run the same model code; what differs is the search and the cache.

    python bench/decode_speed.py --run runs/decode-speed-model             # 3 rounds, JSON to bench/results/
    python bench/decode_speed.py --run DIR --rounds 5 --threads 1 --quick  # --quick: the first 200 sentences

The test set is decoded as `TranslationModule.translate` decodes it (length-sorted batches of 100, the task's
beam size, length penalty and length limits; float32, or with `--precision bf16` under bf16 autocast as a bf16-mixed
run decodes), but without its ban on PAD and BOS (since 2026-11-27; the reference predates it and the two must return
the same translations; the ban costs a top-(2k + 2) instead of 2k and a sort of those per step), once per
contestant per round; the order of the two alternates each round so that machine noise lands on both. Every
round checks that both return identical hypotheses (in bf16 a matmul's rounding may depend on how many rows it
multiplies, and the new search drops finished sentences, so there the count of differing hypotheses and each
side's BLEU are recorded instead). Reported: sentences/s and generated tokens/s (hypothesis tokens plus the EOS) per
contestant from its median round, and the median over rounds of the per-round time ratio reference / new.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the frozen reference lives beside the tests that compare against it

from beam_search_reference import reference_beam_search  # noqa: E402

from study.model.generate import beam_search  # noqa: E402
from study.run.environment import bench_provenance, cpu_flags, cpu_model  # noqa: E402

CONTESTANTS = {"reference": reference_beam_search, "new": beam_search}


def load(run_dir: Path, data_dir: str, cache_dir: str | None):
    """The run's model, config and a DataModule with the run's tokenizers (as `study run` built them)."""
    from study.run import load_model
    from study.run.single import default_cache_dir
    from study.tasks.translation import TranslationDataModule

    model, cfg = load_model(run_dir)
    dm = TranslationDataModule(cfg, data_dir=data_dir, cache_dir=default_cache_dir(cache_dir) / "tokenizers")
    dm.prepare()
    return model, cfg, dm


def batches(cfg, dm, sentences: list[str], batch_size: int = 100):
    """(positions, src, mask) per batch, as TranslationModule.translate forms them: sorted by source length, each
    source cut only where the position scheme cannot address it (study.tasks.translation.decoder_sources)."""
    from study.tasks.translation import EOS, PAD, decoder_sources, pad_batch

    ids, _ = decoder_sources(cfg, dm, sentences)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = []
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        src = pad_batch([ids[i] or [EOS] for i in chunk])
        out.append((chunk, src, src != PAD))
    return out


def decode_all(search, model, cfg, work, beam: int) -> tuple[float, list[list[int]]]:
    """Seconds to decode every batch, and the hypotheses in the test set's order."""
    from study.tasks.translation import BOS, EOS

    task = cfg.task
    kw = dict(bos=BOS, eos=EOS, beam_size=beam, length_penalty=task.length_penalty, max_len_a=task.max_len_a,
              max_len_b=task.max_len_b)
    hyps: list[list[int]] = [[] for _ in range(1 + max(max(c) for c, _, _ in work))]
    started = time.perf_counter()
    for chunk, src, mask in work:
        for i, h in zip(chunk, search(model, src, mask, **kw)):
            hyps[i] = h
    return time.perf_counter() - started, hyps


def run_rounds(model, cfg, work, beam: int, rounds: int, exact: bool = True, warmup_batches: int = 2) -> dict:
    """Alternating rounds (the first contestant swaps each round); outputs compared every round (`exact`: any
    difference stops the run; else the number of differing hypotheses is kept). Before them each contestant decodes
    `warmup_batches` batches untimed: the first calls pay one-off costs (oneDNN primitive creation, allocator
    growth, lazy imports) that would otherwise land on whichever contestant runs first in round 1."""
    for name in CONTESTANTS if warmup_batches > 0 else ():
        decode_all(CONTESTANTS[name], model, cfg, work[:warmup_batches], beam)
    seconds: dict[str, list[float]] = {name: [] for name in CONTESTANTS}
    outputs, differ = {}, []
    for r in range(rounds):
        names = list(CONTESTANTS) if r % 2 == 0 else list(reversed(CONTESTANTS))
        for name in names:
            elapsed, outputs[name] = decode_all(CONTESTANTS[name], model, cfg, work, beam)
            seconds[name].append(elapsed)
            print(f"round {r + 1}/{rounds} {name:9s} {elapsed:7.2f} s", flush=True)
        this_round = sum(a != b for a, b in zip(outputs["new"], outputs["reference"]))
        if this_round and exact:
            raise SystemExit(f"round {r + 1}: {this_round} hypotheses differ between the reference and the new search")
        differ.append(this_round)  # (bf16: a near tie may break either way in each round)
    # the last round's outputs are scored: its count of differing hypotheses is the one beside the BLEU
    return {"seconds": seconds, "hypotheses": outputs["new"], "reference_hypotheses": outputs["reference"],
            "differing_hypotheses": differ[-1], "differing_by_round": differ}


def machine(threads: int) -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), **cpu_flags(), **bench_provenance(), "threads": threads,
            "torch": torch.__version__, "python": platform.python_version()}


def trained_model(run_dir: Path) -> dict:
    """What the decoded model is: the run's training length and its own test score (from its metrics.json)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    cost = metrics.get("cost", {})
    return {"steps": metrics.get("steps"), "stopped_by": metrics.get("stopped_by"),
            "fit_seconds": cost.get("fit_seconds"), "parameters": cost.get("parameters"),
            "run_bleu": metrics.get("metrics", {}).get("bleu")}


def summarise(result: dict, sentences: int, dm, refs: list[str]) -> dict:
    import sacrebleu

    tokens = sum(len(h) + 1 for h in result["hypotheses"])  # generated tokens, the EOS included
    generated = {"new": tokens, "reference": sum(len(h) + 1 for h in result["reference_hypotheses"])}
    seconds = result["seconds"]
    ratios = [ref / new for ref, new in zip(seconds["reference"], seconds["new"])]
    per = {name: {"median_s": statistics.median(s), "rounds_s": s, "sentences_per_s": sentences / statistics.median(s),
                  "tokens_per_s": generated[name] / statistics.median(s)}  # each its own output's tokens
           for name, s in seconds.items()}
    def bleu(ids):
        return sacrebleu.corpus_bleu(dm.tgt_tok.decode_batch(ids), [refs]).score

    return {"contestants": per, "ratio_rounds": ratios, "speedup_median": statistics.median(ratios),
            "identical_hypotheses": not any(result["differing_by_round"]),
            "differing_hypotheses": result["differing_hypotheses"],  # in the last round, whose BLEU is below
            "differing_by_round": result["differing_by_round"], "sentences": sentences,
            "generated_tokens": tokens, "mean_hypothesis_tokens": tokens / sentences - 1,
            "bleu": bleu(result["hypotheses"]), "reference_bleu": bleu(result["reference_hypotheses"])}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", default=str(ROOT / "runs" / "decode-speed-model"), help="a translation run directory")
    parser.add_argument("--data-dir", default=os.environ.get("STUDY_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--cache-dir", default=None, help="tokenizer cache the run used (default: study's)")
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--beam", type=int, default=None, help="beam size (default: the run's task.beam_size)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-batches", type=int, default=2, help="untimed batches each contestant decodes first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="the first 200 sentences only (smoke test)")
    parser.add_argument("--precision", choices=("float32", "bf16"), default="float32",
                        help="bf16: both searches under bf16 autocast, as a bf16-mixed run decodes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    model, cfg, dm = load(Path(args.run), args.data_dir, args.cache_dir)
    sources, refs = dm.corpus.sources(args.split), dm.corpus.targets(args.split)
    if args.quick:
        sources, refs = sources[:200], refs[:200]
    work = batches(cfg, dm, sources)
    args.beam = args.beam or cfg.task.beam_size
    started = time.perf_counter()
    bf16 = args.precision == "bf16"
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        result = run_rounds(model, cfg, work, args.beam, args.rounds, exact=not bf16,
                            warmup_batches=args.warmup_batches)
    record = {"date": datetime.date.today().isoformat(), "split": args.split, "beam": args.beam,
              "rounds": args.rounds, "warmup_batches": args.warmup_batches, "batch_size": 100,
              "precision": args.precision, "run_dir": args.run,
              # what decides how many tokens each contestant generates: the trained run's decoding settings
              "decoding": {k: getattr(cfg.task, k) for k in ("length_penalty", "max_len_a", "max_len_b", "seq_len")},
              "trained": trained_model(Path(args.run)),
              "model": cfg.model.__dict__ if hasattr(cfg.model, "__dict__") else str(cfg.model),
              "machine": machine(torch.get_num_threads()), "bench_seconds": time.perf_counter() - started,
              **summarise(result, len(sources), dm, refs)}
    for name, c in record["contestants"].items():
        print(f"{name:9s} {c['sentences_per_s']:7.1f} sentences/s {c['tokens_per_s']:8.0f} tokens/s "
              f"(median {c['median_s']:.2f} s)")
    print(f"speed-up new / reference: {record['speedup_median']:.2f}x (rounds: "
          f"{', '.join(f'{r:.2f}' for r in record['ratio_rounds'])}); {record['differing_hypotheses']} hypotheses "
          f"differ; BLEU {record['bleu']:.2f} (reference search {record['reference_bleu']:.2f})")
    from study.io import atomic_write_text, unused_path

    default_out = unused_path(ROOT / "bench" / "results" / f"decode-speed-{record['date']}-{args.precision}.json")
    out = Path(args.out) if args.out else default_out
    atomic_write_text(out, json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
