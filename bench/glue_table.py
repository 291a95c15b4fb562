"""Print the README's GLUE / BERT-pretraining comparison table from the recorded runs.

    python bench/glue_table.py [--pretrain NSP_RECORD NONSP_RECORD] [--glue NSP_RECORD NONSP_RECORD]

Reads bench/results/run-wikitext2-bert-{nsp,nonsp}.json (pretraining) and run-glue-from-{nsp,nonsp}.json
(fine-tuning, mean ± sample std over seeds), or the records named by --pretrain / --glue, plus run-glue-random-init.json when present, and sets them beside the
Hugging Face anchor (../shared/anchors/README.md, hf_glue) and BERT-base's published dev numbers
(../shared/references/published.md: Hugging Face run_glue README, bert-base-cased, and Devlin et al. 2018 Table 5).
Every GLUE number is on the 0-100 scale (MCC and correlations x 100).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# (task, metric, label)
ROWS = [("SST-2", "accuracy", "SST-2 acc"), ("CoLA", "mcc", "CoLA MCC"), ("MRPC", "f1", "MRPC F1"),
        ("MRPC", "accuracy", "MRPC acc"), ("STS-B", "pearson", "STS-B Pearson"), ("STS-B", "spearman", "STS-B Spearman"),
        ("RTE", "accuracy", "RTE acc"), ("WNLI", "accuracy", "WNLI acc")]
# ../shared/anchors/README.md (hf_glue): NSP / MLM-only, one seed, dev
ANCHOR = {"SST-2 acc": (77.2, 77.4), "MRPC F1": (80.1, 78.3), "RTE acc": (48.4, 52.3), "CoLA MCC": (8.0, 12.0),
          "STS-B Pearson": (15.0, 15.0)}
# ../shared/references/published.md: HF transformers run_glue README (bert-base-cased, dev, fp32)
BERT_BASE_DEV = {"SST-2 acc": 92.32, "CoLA MCC": 56.53, "MRPC F1": 88.85, "MRPC acc": 84.07, "STS-B Pearson": 88.64,
                 "STS-B Spearman": 88.48, "RTE acc": 65.70, "WNLI acc": 56.34}
# Devlin et al. 2018 Table 5 (BERT-base, dev): MLM+NSP / no NSP
BERT_TABLE5 = {"SST-2 acc": (92.7, 92.6), "MRPC acc": (86.7, 86.5)}


def load(name: str) -> dict | None:
    path = RESULTS / f"run-{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def cell(run: dict | None, task: str, metric: str) -> str:
    if run is None:
        return "–"
    r = run["metrics"]["metrics"]
    if f"{task}/{metric}" not in r:
        return "–"
    return f"{100 * r[f'{task}/{metric}']:.1f} ± {100 * r[f'{task}/{metric}_std']:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain", nargs=2, default=["wikitext2-bert-nsp", "wikitext2-bert-nonsp"],
                        metavar=("NSP", "NONSP"), help="pretraining records (bench/results/run-NAME.json)")
    parser.add_argument("--glue", nargs=2, default=["glue-from-nsp", "glue-from-nonsp"], metavar=("NSP", "NONSP"),
                        help="fine-tuning records from those checkpoints")
    args = parser.parse_args()
    pre = dict(zip(("nsp", "nonsp"), map(load, args.pretrain)))
    ft = dict(zip(("nsp", "nonsp"), map(load, args.glue)))
    rand = load("glue-random-init")
    rcol = rand is not None  # the random-init column only when that run was recorded
    print("| | ours, MLM + NSP | ours, MLM only | " + ("ours, random init | " if rcol else "")
          + "HF anchor NSP / MLM only | BERT-base dev (run_glue) | BERT-base Table 5 NSP / no NSP |")
    print("|---|---|---|" + ("---|" if rcol else "") + "---|---|---|")
    x = "– | " if rcol else ""

    def pm(k, key, fmt="{:.2f}"):
        run = pre[k]
        return fmt.format(run["metrics"]["metrics"][key]) if run and key in run["metrics"]["metrics"] else "–"

    print(f"| valid MLM loss (own format) | {pm('nsp', 'valid_mlm_loss')} | {pm('nonsp', 'valid_mlm_loss')} | {x}"
          "6.47 / 6.36 | – | – |")
    print(f"| valid MLM loss, full-sentence input | {pm('nsp', 'valid_mlm_loss_full_sentences')} | "
          f"{pm('nonsp', 'valid_mlm_loss_full_sentences')} | {x}– | – | – |")
    print(f"| valid NSP accuracy | {pm('nsp', 'valid_nsp_accuracy')} | – | {x}0.52 / – | – | – |")
    for task, metric, label in ROWS:
        a = ANCHOR.get(label)
        t5 = BERT_TABLE5.get(label)
        print(f"| {label} | {cell(ft['nsp'], task, metric)} | {cell(ft['nonsp'], task, metric)} | "
              f"{cell(rand, task, metric) + ' | ' if rcol else ''}{f'{a[0]} / {a[1]}' if a else '–'} | {BERT_BASE_DEV.get(label, '–')} | "
              f"{f'{t5[0]} / {t5[1]}' if t5 else '–'} |")
    scores = []
    for k in ("nsp", "nonsp"):
        r = ft[k]["metrics"]["metrics"] if ft[k] else None
        scores.append(f"{r['glue_score']:.1f}" if r and r.get("glue_score") is not None else "–")
    print(f"| GLUE score over these 6 tasks | {scores[0]} | {scores[1]} | {x}– | "
          f"{(92.32 + 56.53 + (88.85 + 84.07) / 2 + (88.64 + 88.48) / 2 + 65.70 + 56.34) / 6:.1f} | – |")
    for k in ("nsp", "nonsp"):
        if pre[k]:
            m = pre[k]["metrics"]
            print(f"\n{k}: {m['cost']['parameters']:,} parameters, {m['steps']} steps, {m['train_tokens']:,} tokens, "
                  f"{m['cost']['train_tokens_per_s']:.0f} tok/s, fit {m['cost']['fit_seconds']:.0f} s")
        if ft[k]:
            m = ft[k]["metrics"]
            print(f"glue-from-{k}: seeds {m['metrics']['seeds']}, fit {m['cost']['fit_seconds']:.0f} s in all, "
                  f"wall {ft[k]['end_to_end_wall_seconds']:.0f} s, unavailable {m['metrics']['unavailable_tasks']}")


if __name__ == "__main__":
    main()
