"""Print the README's GLUE / BERT-pretraining comparison table from the recorded runs.

    python bench/glue_table.py

For every column pair of COLUMNS whose GLUE records exist (bench/results/run-<name>.json: the NSP and MLM-only
pretraining runs and the GLUE suites fine-tuned from them, mean ± sample std over seeds), two columns, then
run-glue-random-init.json when present, the Hugging Face anchor (../shared/anchors/README.md, hf_glue) and
BERT-base's published dev numbers (../shared/references/published.md: Hugging Face run_glue README,
bert-base-cased, and Devlin et al. 2018 Table 5). Every GLUE number is on the 0-100 scale (MCC and correlations
x 100).
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# column label -> records (bench/results/run-<name>.json): (pretrain NSP, pretrain MLM only, GLUE from NSP, GLUE from
# MLM only). A GLUE entry may be a tuple (base, over, ...): base's record with the tasks each `over` ran replaced by
# its results, in order; an `over` may be (name, [tasks]) to take only those tasks from it.
COLUMNS = {
    "128 tok x 16": ("wikitext2-bert-nsp", "wikitext2-bert-nonsp", "glue-from-nsp", "glue-from-nonsp"),
    "64 tok x 64": ("wikitext2-bert-nsp-seq64-b64", "wikitext2-bert-nonsp-seq64-b64",
                    "glue-from-nsp-seq64", "glue-from-nonsp-seq64"),
    "64 tok x 64, Zen 4 bf16": ("wikitext2-bert-nsp-bf16", "wikitext2-bert-nonsp-bf16",
                                "glue-from-nsp-bf16", "glue-from-nonsp-bf16"),
    # experiments/glue_finetune.yaml as shipped: lr 1e-3 for SST-2, STS-B and WNLI (the column before); task.per_task
    # lr 1e-4 and up to 6 epochs for CoLA, MRPC and RTE; CoLA also without dropout. The MLM-only CoLA runs come
    # from the suite run with dropout 0 for every task, whose CoLA settings are the shipped ones.
    "64 tok x 64, Zen 4 bf16, shipped fine-tuning": (
        "wikitext2-bert-nsp-bf16", "wikitext2-bert-nonsp-bf16",
        ("glue-from-nsp-bf16", "glue-small-from-nsp-bf16-lr1e-4", "glue-cola-from-nsp-bf16-dropout0"),
        ("glue-from-nonsp-bf16", "glue-small-from-nonsp-bf16-lr1e-4", ("glue-from-nonsp-bf16-dropout0", ["CoLA"]))),
}
# (task, metric, label)
ROWS = [("SST-2", "accuracy", "SST-2 acc"), ("CoLA", "mcc", "CoLA MCC"), ("MRPC", "f1", "MRPC F1"),
        ("MRPC", "accuracy", "MRPC acc"), ("STS-B", "pearson", "STS-B Pearson"), ("STS-B", "spearman", "STS-B Spearman"),
        ("RTE", "accuracy", "RTE acc"), ("WNLI", "accuracy", "WNLI acc")]
# ../shared/anchors/README.md (hf_glue): NSP / MLM-only, one seed, dev
ANCHOR = {"SST-2 acc": (77.2, 77.4), "MRPC F1": (80.1, 78.3), "RTE acc": (48.4, 52.3), "CoLA MCC": (8.0, 12.0),
          "STS-B Pearson": (15.0, 15.0)}
ANCHOR_PRETRAIN = {"valid_mlm_loss": "6.47 / 6.36", "valid_nsp_accuracy": "0.52 / –"}
# ../shared/references/published.md: HF transformers run_glue README (bert-base-cased, dev, fp32)
BERT_BASE_DEV = {"SST-2 acc": 92.32, "CoLA MCC": 56.53, "MRPC F1": 88.85, "MRPC acc": 84.07, "STS-B Pearson": 88.64,
                 "STS-B Spearman": 88.48, "RTE acc": 65.70, "WNLI acc": 56.34}
# Devlin et al. 2018 Table 5 (BERT-base, dev): MLM+NSP / no NSP
BERT_TABLE5 = {"SST-2 acc": (92.7, 92.6), "MRPC acc": (86.7, 86.5)}


def load(name: str) -> dict | None:
    path = RESULTS / f"run-{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_glue(spec: str | tuple) -> dict | None:
    if isinstance(spec, str):
        return load(spec)
    merged = load(spec[0])
    for over in spec[1:]:
        name, tasks = (over, None) if isinstance(over, str) else over
        merged = overlay(merged, load(name), tasks)
    return merged


def glue_cell(run: dict | None, task: str, metric: str) -> str:
    r = run["metrics"]["metrics"] if run else {}
    if f"{task}/{metric}" not in r:
        return "–"
    return f"{100 * r[f'{task}/{metric}']:.1f} ± {100 * r[f'{task}/{metric}_std']:.1f}"


def overlay(base: dict | None, over: dict | None, tasks: list[str] | None = None) -> dict | None:
    """`base`'s GLUE record with the tasks `over` ran (or those of them in `tasks`) replaced by `over`'s, and the
    GLUE score recomputed."""
    if base is None or over is None:
        return None
    merged = json.loads(json.dumps(base))
    m, o = merged["metrics"]["metrics"], over["metrics"]["metrics"]
    taken = list(tasks or o["tasks"])
    for task in taken:
        for key in [k for k in m if k.startswith(f"{task}/")]:
            del m[key]
        m.update({k: v for k, v in o.items() if k.startswith(f"{task}/")})
        m["tasks"][task] = o["tasks"][task]
    scored = sorted(name for name, t in m["tasks"].items() if t.get("score_mean") is not None)
    m["glue_score"] = sum(m["tasks"][name]["score_mean"] for name in scored) / len(scored)
    m["glue_score_tasks"] = scored
    merged["overlays"] = merged.get("overlays", []) + [(sorted(taken), over)]
    return merged


def pretrain_cell(run: dict | None, key: str) -> str:
    r = run["metrics"]["metrics"] if run else {}
    return f"{r[key]:.2f}" if key in r else "–"


def main() -> None:
    columns = []  # (header, pretrain record, glue record)
    for label, (pre_nsp, pre_mlm, ft_nsp, ft_mlm) in COLUMNS.items():
        pre_nsp, pre_mlm, ft_nsp, ft_mlm = load(pre_nsp), load(pre_mlm), load_glue(ft_nsp), load_glue(ft_mlm)
        if ft_nsp or ft_mlm:
            columns.append((f"ours, MLM + NSP ({label})", pre_nsp, ft_nsp))
            columns.append((f"ours, MLM only ({label})", pre_mlm, ft_mlm))
    rand = load("glue-random-init")
    if rand is not None:
        columns.append(("ours, random init", None, rand))
    print("| | " + " | ".join(h for h, _, _ in columns)
          + " | HF anchor NSP / MLM only | BERT-base dev (run_glue) | BERT-base Table 5 NSP / no NSP |")
    print("|---|" + "---|" * (len(columns) + 3))
    for key, label in (("valid_mlm_loss", "valid MLM loss (own format)"),
                       ("valid_mlm_loss_full_sentences", "valid MLM loss, full-sentence input"),
                       ("valid_nsp_accuracy", "valid NSP accuracy")):
        print(f"| {label} | " + " | ".join(pretrain_cell(pre, key) for _, pre, _ in columns)
              + f" | {ANCHOR_PRETRAIN.get(key, '–')} | – | – |")
    for task, metric, label in ROWS:
        a, t5 = ANCHOR.get(label), BERT_TABLE5.get(label)
        print(f"| {label} | " + " | ".join(glue_cell(ft, task, metric) for _, _, ft in columns)
              + f" | {f'{a[0]} / {a[1]}' if a else '–'} | {BERT_BASE_DEV.get(label, '–')} | "
              f"{f'{t5[0]} / {t5[1]}' if t5 else '–'} |")
    scores = []
    for _, _, ft in columns:
        r = ft["metrics"]["metrics"] if ft else {}
        tasks = r.get("glue_score_tasks") or []
        scores.append(f"{r['glue_score']:.1f}" if r.get("glue_score") is not None and len(tasks) == 6 else "–")
    bert = (92.32 + 56.53 + (88.85 + 84.07) / 2 + (88.64 + 88.48) / 2 + 65.70 + 56.34) / 6
    print("| GLUE score over these 6 tasks | " + " | ".join(scores) + f" | – | {bert:.1f} | – |")
    print()
    for header, pre, ft in columns:
        print(f"{header}:")
        if pre:
            m = pre["metrics"]
            print(f"  pretraining: {m['cost']['parameters']:,} parameters, {m['steps']} steps, {m['train_tokens']:,} "
                  f"tokens, {m['cost']['train_tokens_per_s']:.0f} tok/s, fit {m['cost']['fit_seconds']:.0f} s")
        if ft:
            m = ft["metrics"]
            print(f"  GLUE: tasks {m['metrics']['glue_score_tasks']}, seeds {m['metrics']['seeds']}, fit "
                  f"{m['cost']['fit_seconds']:.0f} s in all, wall {ft['end_to_end_wall_seconds']:.0f} s, "
                  f"unavailable {m['metrics']['unavailable_tasks']}")
            for tasks, over in ft.get("overlays", []):
                print(f"  of which {tasks} from run-{over['label']}.json (fit {over['metrics']['cost']['fit_seconds']:.0f} s "
                      f"in all, wall {over['end_to_end_wall_seconds']:.0f} s)")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
