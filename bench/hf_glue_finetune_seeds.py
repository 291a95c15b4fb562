# GLUE fine-tuning from a pretrained checkpoint (or random init) under a wall-clock cap per task.
# usage: hf_glue_finetune_seeds.py {nsp|mlm|scratch} [TASK ...] [--cap-scale X] [--seed K]
#
# The Hugging Face anchor's ../shared/anchors/hf_glue/finetune.py, unchanged but for a --seed option (default 0, which
# is the anchor's own run): K seeds the classifier's initialisation (torch/random) and shifts each epoch's shuffle
# (generator seed ep + 1000 K); results go to ft_results_seeds.jsonl with the seed. Run prep.py and pretrain.py from
# ../shared/anchors/hf_glue first, with the same ANCHOR_WORK and STUDY_DATA_DIR=../shared/data. Record: bench/results/anchor-hf-glue-cola-mlm-seeds.json.
import os
WORK = os.environ.get("ANCHOR_WORK", os.getcwd())  # tokenizer, tensors, checkpoints, results
DATA = os.environ.get("STUDY_DATA_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data"))
import sys, csv, time, json, random, contextlib
import torch, numpy as np
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
from scipy.stats import pearsonr, spearmanr

G = os.path.join(DATA, "glue")
init = sys.argv[1]
args = [a for a in sys.argv[2:] if not a.startswith("--")]
SEED = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0
if "--seed" in sys.argv: args = [a for a in args if a != str(SEED)]
scale = float(sys.argv[sys.argv.index("--cap-scale") + 1]) if "--cap-scale" in sys.argv else 1.0
if scale != 1.0: args = [a for a in args if a != sys.argv[sys.argv.index("--cap-scale") + 1]]
TASKS = args or ["SST-2", "MRPC", "RTE", "CoLA", "STS-B"]
CAP = {"SST-2": 180, "MRPC": 120, "RTE": 120, "CoLA": 120, "STS-B": 120}
BS, LR, WARM, WD, EPOCHS, MAXLEN = 32, 2e-4, 0.10, 0.01, 3, 128
tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(WORK, "tokenizer"))
amp = lambda: torch.autocast("cpu", dtype=torch.bfloat16)

def read(task, split):
    enc = "utf-8-sig" if task == "MRPC" else "utf-8"
    with open(f"{G}/{task}/{split}.tsv", encoding=enc, newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if task != "CoLA": rows = rows[1:]                       # CoLA train/dev have no header
    if task == "SST-2": return [r[0] for r in rows], None, [int(r[1]) for r in rows]
    if task == "CoLA":  return [r[3] for r in rows], None, [int(r[1]) for r in rows]
    if task == "MRPC":  return [r[3] for r in rows], [r[4] for r in rows], [int(r[0]) for r in rows]
    if task == "RTE":   return [r[1] for r in rows], [r[2] for r in rows], [0 if r[3] == "entailment" else 1 for r in rows]
    if task == "STS-B": return [r[7] for r in rows], [r[8] for r in rows], [float(r[9]) for r in rows]

def encode(a, b):
    kw = dict(truncation=True, max_length=MAXLEN, return_token_type_ids=True)
    e = tok(a, b, **kw) if b else tok(a, **kw)
    return [{k: e[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")} for i in range(len(a))]

def metrics(task, pred, gold):
    if task == "STS-B":
        return {"pearson": pearsonr(pred, gold)[0], "spearman": spearmanr(pred, gold)[0]}
    m = {"acc": accuracy_score(gold, pred)}
    if task == "MRPC": m["f1"] = f1_score(gold, pred)
    if task == "CoLA": m["mcc"] = matthews_corrcoef(gold, pred)
    return m

for task in TASKS:
    reg = task == "STS-B"; nl = 1 if reg else 2
    tra, trb, trl = read(task, "train"); dva, dvb, dvl = read(task, "dev")
    trX, dvX = encode(tra, trb), encode(dva, dvb)
    torch.manual_seed(SEED); random.seed(SEED)
    if init == "scratch":
        cfg = BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=1024, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0,
                         num_labels=nl)
        model = BertForSequenceClassification(cfg)
    else:
        model = BertForSequenceClassification.from_pretrained(os.path.join(WORK, f"ckpt_{init}"), num_labels=nl)
    if reg: model.config.problem_type = "regression"
    nd = ["bias", "LayerNorm.weight"]
    opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if not any(x in n for x in nd)], "weight_decay": WD},
                             {"params": [p for n, p in model.named_parameters() if any(x in n for x in nd)], "weight_decay": 0.0}],
                            lr=LR, eps=1e-6)
    cap = CAP[task] * scale
    n = len(trX); spe = (n + BS - 1) // BS; total = EPOCHS * spe
    model.train(); step, seen, ntok, losses = 0, 0, 0, []
    t0 = time.perf_counter(); stop = False
    for ep in range(EPOCHS):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(ep + 1000 * SEED)).tolist()
        for k in range(0, n, BS):
            el = time.perf_counter() - t0
            if step and el + el / step > cap: stop = True; break
            f = max(el / cap, step / total)                   # whichever cap (time or 3 epochs) comes first
            lr = LR * (f / WARM if f < WARM else max(0.0, (1 - f) / (1 - WARM)))
            for g in opt.param_groups: g["lr"] = max(lr, LR * 1e-3)
            idx = perm[k:k + BS]
            b = tok.pad([trX[i] for i in idx], return_tensors="pt", pad_to_multiple_of=16)
            lab = torch.tensor([trl[i] for i in idx], dtype=torch.float if reg else torch.long)
            with amp():
                out = model(**b, labels=lab)
            opt.zero_grad(set_to_none=True); out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
            step += 1; seen += len(idx); ntok += int(b["attention_mask"].sum()); losses.append(out.loss.item())
        if stop: break
    tt = time.perf_counter() - t0
    model.eval(); preds = []
    with torch.no_grad(), amp():
        for k in range(0, len(dvX), 128):
            lg = model(**tok.pad(dvX[k:k + 128], return_tensors="pt", pad_to_multiple_of=16)).logits.float()
            preds += (lg.squeeze(-1) if reg else lg.argmax(-1)).tolist()
    m = {k: round(float(v), 4) for k, v in metrics(task, preds, dvl).items()}
    res = {"seed": SEED, "init": init, "task": task, "steps": step, "epochs": round(seen / n, 2), "train_time_s": round(tt, 1),
           "tok_per_s": round(ntok / tt), "final_train_loss": round(float(np.mean(losses[-20:])), 4),
           "n_train": n, "n_dev": len(dvX), "cap_s": cap, **m}
    print(json.dumps(res), flush=True)
    if scale == 1.0:
        with open(os.path.join(WORK, "ft_results_seeds.jsonl"), "a") as fh: fh.write(json.dumps(res) + "\n")
