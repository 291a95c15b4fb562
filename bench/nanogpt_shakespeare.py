"""nanoGPT on Tiny Shakespeare (character level), in one file, to time it beside `study run`.

A faithful single-file replica of Andrej Karpathy's nanoGPT, https://github.com/karpathy/nanoGPT
(MIT licence, Copyright (c) 2022 Andrej Karpathy), which is not installable from pip here:
  model.py  LayerNorm (optional bias), CausalSelfAttention (F.scaled_dot_product_attention,
            is_causal=True), MLP (GELU), pre-LN Block, GPTConfig, GPT (weight tying, N(0, 0.02) init,
            c_proj weights N(0, 0.02/sqrt(2*n_layer))), get_num_params, configure_optimizers
  train.py  torch.manual_seed(1337 + 0), get_batch (random offsets), estimate_loss, get_lr (linear
            warm-up then cosine to min_lr), the loop (eval at iter 0 and every eval_interval,
            forward, backward, clip, step, zero_grad(set_to_none=True), stop once iter > max_iters)
  data/shakespeare_char/prepare.py  chars = sorted(set(text)), first 90% train / last 10% val,
            uint16 ids (held in memory; train.py memmaps the same arrays from train.bin/val.bin)
The defaults are config/train_shakespeare_char.py over train.py's, overridden by the anchor's run:
    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
Left out: DDP, checkpoints, wandb, torch.compile, from_pretrained, generate, estimate_mfu. On CPU
train.py's autocast context is a nullcontext and its float16 GradScaler disables itself without
CUDA, so everything runs in float32 with no loss scaling, as here. configure_optimizers fuses
AdamW only on CUDA (upstream rule), so the CPU run uses the default (foreach) AdamW, as upstream.

    OMP_NUM_THREADS=1 python bench/nanogpt_shakespeare.py --out bench/results/nanogpt.json
    python bench/nanogpt_shakespeare.py --max_iters 20 --eval_iters 2      # smoke test

Timing: wall_s runs from a clock read before `import torch`; ms_per_iter averages the per-iteration
time (train.py's dt, with that iteration's estimate_loss time taken out) over iterations after the
first 10; eval_s is the total estimate_loss time. The final losses are estimate_loss's at iteration
max_iters (nanoGPT's last evaluation when eval_interval divides max_iters; added here if it does not).
"""
import time

_T_START = time.perf_counter()  # before importing torch, so the import counts in wall_s

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


# ----------------------------------------------------------------------------- model.py
class LayerNorm(nn.Module):
    """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # scaled init of the residual projections (GPT-2)
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        print("number of parameters: %.2fM" % (self.get_num_params() / 1e6,))

    def get_num_params(self, non_embedding=True):
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:  # position embeddings subtracted; token embeddings are tied to lm_head
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]  # matmul weights, embeddings
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]  # biases, norms
        optim_groups = [{'params': decay_params, 'weight_decay': weight_decay},
                        {'params': nodecay_params, 'weight_decay': 0.0}]
        num_decay_params = sum(p.numel() for p in decay_params)
        num_nodecay_params = sum(p.numel() for p in nodecay_params)
        print(f"num decayed parameter tensors: {len(decay_params)}, with {num_decay_params:,} parameters")
        print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with {num_nodecay_params:,} parameters")
        fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == 'cuda'
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
        print(f"using fused AdamW: {use_fused}")
        return optimizer


# ----------------------------------------------------------------------------- config
# train.py defaults, then config/train_shakespeare_char.py, then the anchor's command-line flags.
CONFIG = dict(
    eval_interval=250, log_interval=1, eval_iters=20,            # shakespeare_char; flags
    gradient_accumulation_steps=1, batch_size=12, block_size=64,  # shakespeare_char; flags
    n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False,     # flags; bias: train.py
    learning_rate=1e-3, max_iters=2000, weight_decay=1e-1,        # shakespeare_char; flag; train.py
    beta1=0.9, beta2=0.99, grad_clip=1.0,                         # train.py; shakespeare_char; train.py
    decay_lr=True, warmup_iters=100, lr_decay_iters=2000, min_lr=1e-4,
)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])

    def as_bool(s):  # train.py's configurator takes --bias=False / --decay_lr=True
        return str(s).lower() in ('1', 'true', 'yes')

    for k, v in CONFIG.items():
        p.add_argument(f'--{k}', type=as_bool if isinstance(v, bool) else type(v), default=v)
    p.add_argument('--seed', type=int, default=1337, help="torch.manual_seed(seed + 0), as train.py")
    p.add_argument('--threads', type=int, default=0, help="torch.set_num_threads; 0 leaves torch's default")
    p.add_argument('--data', type=Path, default=None,
                   help="input.txt; default $STUDY_DATA_DIR/tinyshakespeare/input.txt, else ../shared/data/...")
    p.add_argument('--out', type=Path, default=None, help="write the JSON record here")
    return p.parse_args()


def data_path(arg):
    if arg is not None:
        return arg
    if os.environ.get('STUDY_DATA_DIR'):
        return Path(os.environ['STUDY_DATA_DIR']) / 'tinyshakespeare' / 'input.txt'
    return Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'tinyshakespeare' / 'input.txt'


# ----------------------------------------------------------------------------- train.py
def main():
    a = parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    path = data_path(a.data)
    if not path.is_file():
        raise SystemExit(f"Tiny Shakespeare not found at {path} (pass --data or set $STUDY_DATA_DIR)")
    with open(path, 'r', encoding='utf-8') as f:  # prepare.py
        text = f.read()
    chars = sorted(list(set(text)))
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = len(text)
    train_data = np.array([stoi[c] for c in text[:int(n * 0.9)]], dtype=np.uint16)
    val_data = np.array([stoi[c] for c in text[int(n * 0.9):]], dtype=np.uint16)
    print(f"vocab size {len(chars)}, train has {len(train_data):,} tokens, val has {len(val_data):,} tokens")
    print(f"tokens per iteration will be: {a.gradient_accumulation_steps * a.batch_size * a.block_size:,}")

    torch.manual_seed(a.seed + 0)  # seed_offset = 0 without DDP
    device = device_type = 'cpu'

    def get_batch(split):
        data = train_data if split == 'train' else val_data
        ix = torch.randint(len(data) - a.block_size, (a.batch_size,))
        x = torch.stack([torch.from_numpy((data[i:i + a.block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + a.block_size]).astype(np.int64)) for i in ix])
        return x.to(device), y.to(device)

    model = GPT(GPTConfig(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size,
                          bias=a.bias, vocab_size=len(chars), dropout=a.dropout))
    model.to(device)
    optimizer = model.configure_optimizers(a.weight_decay, a.learning_rate, (a.beta1, a.beta2), device_type)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ['train', 'val']:
            losses = torch.zeros(a.eval_iters)
            for k in range(a.eval_iters):
                X, Y = get_batch(split)
                logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        if it < a.warmup_iters:  # 1) linear warm-up
            return a.learning_rate * (it + 1) / (a.warmup_iters + 1)
        if it > a.lr_decay_iters:  # 2) past the decay: min_lr
            return a.min_lr
        decay_ratio = (it - a.warmup_iters) / (a.lr_decay_iters - a.warmup_iters)  # 3) cosine
        assert 0 <= decay_ratio <= 1
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return a.min_lr + coeff * (a.learning_rate - a.min_lr)

    iter_num, evals, step_s, eval_s = 0, [], [], 0.0
    t_loop = time.perf_counter()
    X, Y = get_batch('train')  # fetch the very first batch
    t0 = time.perf_counter()
    while True:
        lr = get_lr(iter_num) if a.decay_lr else a.learning_rate
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        dt_eval = 0.0
        # nanoGPT evaluates at iter 0 and every eval_interval, which includes max_iters in the anchor's
        # run (2000 % 250 == 0); also evaluating at max_iters gives short runs a final loss too
        if iter_num % a.eval_interval == 0 or iter_num == a.max_iters:
            te = time.perf_counter()
            losses = estimate_loss()
            dt_eval = time.perf_counter() - te
            eval_s += dt_eval
            evals.append(dict(iter=iter_num, train=float(losses['train']), val=float(losses['val'])))
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        for micro_step in range(a.gradient_accumulation_steps):
            logits, loss = model(X, Y)
            loss = loss / a.gradient_accumulation_steps
            X, Y = get_batch('train')  # prefetch the next batch
            loss.backward()
        if a.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        dt, t0 = t1 - t0, t1
        step_s.append(dt - dt_eval)
        if iter_num % a.log_interval == 0:
            lossf = loss.item() * a.gradient_accumulation_steps
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
        iter_num += 1
        if iter_num > a.max_iters:
            break
    train_loop_s = time.perf_counter() - t_loop

    timed = step_s[10:] or step_s
    record = dict(
        impl='nanoGPT (bench/nanogpt_shakespeare.py replica of https://github.com/karpathy/nanoGPT)',
        config={k: getattr(a, k) for k in CONFIG} | dict(seed=a.seed, device='cpu', dtype='float32', compile=False),
        data=str(path), vocab_size=len(chars), params=model.get_num_params(),
        final_iter=evals[-1]['iter'], final_train_loss=evals[-1]['train'], final_val_loss=evals[-1]['val'],
        evals=evals, steps=len(step_s),
        wall_s=time.perf_counter() - _T_START, train_loop_s=train_loop_s, eval_s=eval_s,
        ms_per_iter=1000 * sum(timed) / len(timed),
        torch=torch.__version__, threads=torch.get_num_threads(),
    )
    # the CPU kind the times are of, read after they were taken (importing study is no part of nanoGPT's run)
    from study.run.environment import cpu_flags, cpu_model
    record['machine'] = dict(cpu=cpu_model(), cores=os.cpu_count(), **cpu_flags())
    print(json.dumps(record, indent=2))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(record, indent=2) + '\n')


if __name__ == '__main__':
    main()
