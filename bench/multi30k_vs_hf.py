"""Multi30k De->En side by side on this machine: the Hugging Face anchor, then `study run`, at one training budget.

    .venv/bin/python bench/multi30k_vs_hf.py                        # about 55 min on 2 cores
    .venv/bin/python bench/multi30k_vs_hf.py --budget-s 1374 --precision fp32

The anchor (`../shared/anchors/hf_multi30k.py`: `Seq2SeqTrainer` + random-init `MarianMTModel`) was measured on a
CPU with bf16 instructions; its 22.9 minutes are not this machine's 22.9 minutes. So both sides run here, one after
the other, with the same training budget (default: the anchor's 1,374 s):

1. the anchor's tokenizer (`tok`);
2. a short probe of the anchor's training pace (`train --budget_s PROBE`), so that its linear decay can be set to
   end with the budget (`--max_steps = pace x budget`), as a user fitting its recipe to this machine would; the
   anchor's own command (`--max_steps 2500`) would be cut off mid-decay here;
3. the anchor's training and its beam-5 decode of test_2016_flickr (`train`, `decode`);
4. ours: `study run experiments/multi30k_de_en.yaml --set train.max_time_s=BUDGET` through `bench/record_run.py`.

`--precision auto` (the default) gives the anchor `--bf16` only where bf16 matrix multiplies are faster than float32
here (a 1024^3 GEMM is timed); on an AVX2-only CPU bf16 runs at about 1 GFLOP/s and float32 at 120. Writes
bench/results/multi30k-vs-hf.json and its generated table bench/results/multi30k-vs-hf.md
(bench/multi30k_vs_hf_table.py); the anchor's files go to bench/runs/hf-multi30k (not committed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT / "bench"))

from study.run.environment import bench_provenance, cpu_flags, cpu_model  # noqa: E402


def anchor(args, work: Path, *cli: str) -> dict:
    """Run one stage of the anchor script in `work` and return the JSON after its `RESULT` line, if any."""
    env = {**os.environ, "STUDY_DATA_DIR": str(args.data_dir), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, str(args.anchor), *cli]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    (work / f"{cli[0]}-{'-'.join(cli[1:3]).replace('--', '')}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"anchor stage {cli} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    text = proc.stdout
    if "RESULT" not in text:
        return {}
    return json.JSONDecoder().raw_decode(text[text.rindex("RESULT") + len("RESULT"):].lstrip())[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=1374.0, help="training seconds for each side")
    parser.add_argument("--probe-s", type=float, default=90.0, help="seconds of the anchor's pace probe")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--anchor", type=Path, default=SHARED / "anchors" / "hf_multi30k.py")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("STUDY_DATA_DIR", SHARED / "data")))
    parser.add_argument("--config", default="experiments/multi30k_de_en.yaml")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "multi30k-vs-hf.json")
    args = parser.parse_args()
    args.data_dir, args.anchor = args.data_dir.resolve(), args.anchor.resolve()
    if not (args.data_dir / "multi30k").is_dir():
        sys.exit(f"Multi30k not found under {args.data_dir} (--data-dir or STUDY_DATA_DIR)")
    # our run's record, dated: record_run.py refuses to replace one, and would do so only after the anchor's
    # half hour; checked here, before anything runs
    name = f"multi30k-de-en-vs-hf-{datetime.date.today().isoformat()}"
    if not args.skip_ours and (ROOT / "bench" / "results" / f"run-{name}.json").exists():
        sys.exit(f"bench/results/run-{name}.json holds an earlier record of today: move it aside, or --skip-ours")

    import torch

    from throughput import gemm_rate  # bench/throughput.py: best-of-n square GEMM GFLOP/s

    rates = {"fp32": gemm_rate(torch.float32, 1024), "bf16": gemm_rate(torch.bfloat16, 1024, reps=2)}
    precision = args.precision if args.precision != "auto" else ("bf16" if rates["bf16"] > rates["fp32"] else "fp32")
    print(f"matmul GFLOP/s {rates}; the anchor runs in {precision}", flush=True)
    bf16 = ["--bf16"] if precision == "bf16" else []

    work = ROOT / "bench" / "runs" / "hf-multi30k"
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "tok8k").is_dir():
        anchor(args, work, "tok")
    probe = anchor(args, work, "train", "--out", "probe", "--max_steps", "100000", "--budget_s", str(args.probe_s),
                   "--no_eval", "--log_steps", "10", *bf16)
    pace = probe["steps_done"] / probe["train_wall_s"]
    max_steps = int(pace * args.budget_s)
    print(f"anchor pace {pace:.3f} steps/s -> --max_steps {max_steps}", flush=True)
    hf_train = anchor(args, work, "train", "--out", "run", "--max_steps", str(max_steps),
                      "--budget_s", str(args.budget_s), *bf16)
    hf_decode = anchor(args, work, "decode", "--out", "run", "--beams", "5")
    record = {
        "what": "Multi30k De->En test_2016_flickr, the Hugging Face anchor and study run, one after the other on this"
                " machine with the same training budget",
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), **cpu_flags(), **bench_provenance(),
                    "matmul_gflops_1024": {k: round(v, 1) for k, v in rates.items()}},
        "budget_s": args.budget_s,
        "hf": {"precision": precision, "probe": probe, "max_steps": max_steps, "train": hf_train,
               "decode": hf_decode,
               "command": f"hf_multi30k.py train --out run --max_steps {max_steps} --budget_s {args.budget_s}"
                          f"{' --bf16' if bf16 else ''}; decode --out run --beams 5"},
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")  # the anchor's half, kept should our run fail
    if not args.skip_ours:
        cmd = [sys.executable, str(ROOT / "bench" / "record_run.py"), args.config, "--data-dir", str(args.data_dir),
               "--set", f"train.max_time_s={args.budget_s}", "--set", f"name={name}",
               "--set", "train.progress_bar=false",
               # the anchor's precision on both sides (the config's `auto` would decide by CPU flags on its own)
               "--set", f"train.precision={'bf16-mixed' if bf16 else '32-true'}"]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
        ours = json.loads((ROOT / "bench" / "results" / f"run-{name}.json").read_text())
        flickr = ours["metrics"]["metrics"]["test_sets"]["test_2016_flickr"]
        record["ours"] = {"record": f"bench/results/run-{name}.json", "steps": ours["metrics"]["steps"],
                          "bleu": flickr["bleu"], "chrf": flickr["chrf"], "decode_seconds": flickr["decode_seconds"],
                          "train_tokens_per_s": ours["metrics"].get("cost", {}).get("train_tokens_per_s")}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    hf = record["hf"]
    print(f"HF   : {hf['train'].get('steps_done')} steps, BLEU {hf['decode'].get('BLEU')}, "
          f"chrF {hf['decode'].get('chrF')}, decode {hf['decode'].get('decode_s')} s")
    if "ours" in record:
        o = record["ours"]
        print(f"ours : {o['steps']} steps, BLEU {o['bleu']:.2f}, chrF {o['chrf']:.2f}, decode {o['decode_seconds']:.1f} s")
    print(f"wrote {args.out}")
    if "ours" in record and args.out.resolve() == (ROOT / "bench" / "results" / "multi30k-vs-hf.json").resolve():
        import multi30k_vs_hf_table  # bench/: the generated table of this record

        multi30k_vs_hf_table.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
