"""Attention: one module for self- and cross-attention, always through SDPA.

`torch.nn.functional.scaled_dot_product_attention` picks the flash or
memory-efficient kernel on GPU (and the fused CPU kernel here). Everything
that varies between architectures reaches it through two narrow inputs:

- K/V with `n_kv_heads` heads, shared across query-head groups (MHA when
  n_kv_heads == n_heads, GQA in between, MQA when 1; Shazeer 2019, Ainslie et al. 2023);
- an additive bias built once per forward for each attention span (causal,
  padding, sliding window, ALiBi/T5 position bias), or `is_causal=True` when the
  plain causal mask is all there is, so the fastest kernel can run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from study.axes.cpu_kernels import eager_cpu_ops
from study.axes.position import apply_rotary

# Added to the scores of key positions a query must not see. Finite (not -inf) so a
# query with no visible key (an all-padding row) yields a uniform, not NaN, average,
# and representable in bfloat16.
MASKED = -1e9

try:  # torch >= 2.5 shares K/V heads inside SDPA without materialising copies
    _SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")
except Exception:  # pragma: no cover
    _SDPA_HAS_GQA = False


def span_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor | None:
    """Boolean (Tq, Tk) mask of visible keys, or None when every key is visible.

    A window of W lets a query see the W most recent positions including itself
    (key j visible from query i iff i - j < W), as Mistral's sliding window does;
    in a bidirectional stack it is symmetric (|i - j| < W).
    """
    if not causal and window is None:
        return None
    offset = q_positions[:, None] - k_positions[None, :]
    visible = torch.ones_like(offset, dtype=torch.bool)
    if causal:
        visible &= offset >= 0
    if window is not None:
        visible &= offset.abs() < window
    return visible


def attention_bias(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    causal: bool,
    window: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, bool]:
    """Combine span, padding and position bias into one additive (B|1, H|1, Tq, Tk) float bias.

    Returns (bias, is_causal). When the only constraint is a plain causal mask over a
    square score matrix, returns (None, True) so SDPA can use its causal kernel.
    `key_padding_mask` is (B, Tk) with True for real tokens.
    """
    square = q_positions.numel() == k_positions.numel()
    if causal and window is None and key_padding_mask is None and position_bias is None and square:
        return None, True
    visible = span_mask(q_positions, k_positions, causal, window)
    if visible is not None:
        visible = visible[None, None]
    if key_padding_mask is not None:
        pad = key_padding_mask.bool()[:, None, None, :]
        visible = pad if visible is None else visible & pad
    if visible is None and position_bias is None:
        return None, False
    bias = position_bias[None].float() if position_bias is not None else torch.zeros((1, 1) + visible.shape[-2:], device=q_positions.device)
    if visible is not None:
        bias = bias.masked_fill(~visible, MASKED)
    return bias, False


class _LayerKV:
    """One layer's self-attention K and V in one time-major buffer `kv` (capacity, B, 2, nkv, hs) whose positions
    [start, end) are held. Time-major so that appending a step writes in place (a concatenation copied the whole past
    at every step) and beam search's reorder copies each held position once, as one row gather over (positions * B)
    rows of K and V together into the leading positions of a fresh buffer."""

    def __init__(self, kv: torch.Tensor, start: int = 0, end: int = 0):
        self.kv, self.start, self.end = kv, start, end

    @classmethod
    def empty(cls, rows: int, heads: int, head_dim: int, capacity: int, like: torch.Tensor) -> "_LayerKV":
        return cls(like.new_empty((capacity, rows, 2, heads, head_dim)))

    @property
    def held(self) -> int:
        return self.end - self.start

    def held_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values, (B, nkv, L, hs) views of the buffer."""
        kv = self.kv[self.start : self.end]  # (L, B, 2, nkv, hs)
        return kv[:, :, 0].permute(1, 2, 0, 3), kv[:, :, 1].permute(1, 2, 0, 3)

    def append(self, k: torch.Tensor, v: torch.Tensor, keep: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new (B, nkv, T, hs) keys/values after the held ones; returns all of them (B, nkv, L, hs) as
        views, then holds only the `keep` most recent (a sliding-window layer) when `keep` is set."""
        t = k.shape[2]
        if self.end + t > self.kv.shape[0]:  # full: move the held positions into a buffer twice their need
            self._move(None, capacity=2 * (self.held + t))
        self.kv[self.end : self.end + t, :, 0] = k.permute(2, 0, 1, 3)  # (T, B, nkv, hs)
        self.kv[self.end : self.end + t, :, 1] = v.permute(2, 0, 1, 3)
        self.end += t
        seen = self.held_kv()  # (B, nkv, L, hs) each
        if keep is not None:
            self.start = max(self.start, self.end - keep)
        return seen

    def select(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (beam search's surviving hypotheses): one copy of each held position."""
        self._move(index, capacity=self.kv.shape[0])

    def _move(self, index: torch.Tensor | None, capacity: int) -> None:
        """Move the held positions (of rows `index`, or all) to the start of a fresh buffer of `capacity`."""
        held, (_, rows, _, heads, head_dim) = self.held, self.kv.shape
        new_rows = rows if index is None else index.numel()
        moved = self.kv.new_empty((max(capacity, held + 1), new_rows, 2, heads, head_dim))
        if index is None:
            moved[:held] = self.kv[self.start : self.end]
        elif held:  # row p * rows + index[i] of the (positions * rows) source is row p * new_rows + i of the destination
            rows_of = (torch.arange(held, device=index.device)[:, None] * rows + index[None, :]).view(-1)
            source = self.kv[self.start : self.end].view(held * rows, -1)
            torch.index_select(source, 0, rows_of, out=moved[:held].view(held * new_rows, -1))
        self.kv, self.start, self.end = moved, 0, held

    def nbytes(self) -> int:
        """Bytes of the held positions (a buffer's spare capacity, at most as much again, is not counted)."""
        return self.held * self.kv[0].numel() * self.kv.element_size()


@dataclass
class KVCache:
    """Keys and values of past positions for incremental decoding.

    Stores `n_kv_heads` heads per layer, so MQA/GQA shrink it by n_heads / n_kv_heads.
    Self-attention entries grow by one step per call, except in sliding-window layers, which
    keep only the `window - 1` most recent positions (all a later query can see; Mistral's
    rolling cache, Jiang et al. 2023), so their memory stops growing. Cross-attention entries
    (the encoder memory projected once) are computed on the first decoding step.
    """

    self_kv: dict[int, _LayerKV] = field(default_factory=dict)
    cross_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    seen: int = 0  # positions processed so far: the position of the next token

    @property
    def length(self) -> int:
        return self.seen

    def kept(self, window: int | None) -> int:
        """How many past positions a layer with this window (None: global) holds now."""
        return self.seen if window is None else min(self.seen, window - 1)

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's keys/values (B, nkv, T, hs); returns past + new (B, nkv, past + T, hs) for this step's
        attention, and holds only the `keep` most recent positions when `keep` is set (a sliding-window layer)."""
        if layer not in self.self_kv:
            b, heads, t, head_dim = k.shape
            self.self_kv[layer] = _LayerKV.empty(b, heads, head_dim, capacity=max(2 * t, 16), like=k)
        return self.self_kv[layer].append(k, v, keep)

    def held(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The self-attention keys and values `layer` holds, (B, nkv, L, hs) each."""
        return self.self_kv[layer].held_kv()

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows of both stores (beam search keeps the surviving hypotheses)."""
        self.select_self(index)
        self.select_cross(index)

    def select_self(self, index: torch.Tensor) -> None:
        """Select batch rows of the self-attention K/V (what depends on each hypothesis)."""
        for entry in self.self_kv.values():
            entry.select(index)

    def select_cross(self, index: torch.Tensor) -> None:
        """Select batch rows of the cross-attention K/V (what depends only on the source sentence)."""
        self.cross_kv = {layer: (k.index_select(0, index), v.index_select(0, index))
                         for layer, (k, v) in self.cross_kv.items()}

    def nbytes(self) -> int:
        """Bytes of the K/V held: every layer's held self-attention positions and its memory K/V."""
        cross = sum(t.numel() * t.element_size() for kv in self.cross_kv.values() for t in kv)
        return cross + sum(entry.nbytes() for entry in self.self_kv.values())


def share_kv_in_kernel(bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether SDPA should share K/V heads itself (`enable_gqa`) rather than be given expanded copies. On CUDA only
    the flash, cuDNN and math kernels take `enable_gqa`; flash and cuDNN take 16-bit inputs only, and flash no bias:
    with a bias (padding, window, ALiBi, T5) or in float32 GQA/MQA would fall to the math kernel, which materialises
    the (B, H, T, T) scores (seen on an H200, tests/test_gpu.py). There the copies are the cheaper side, as they let
    the memory-efficient kernel run. The CPU's fused kernel takes both."""
    if device.type == "cpu":
        return _SDPA_HAS_GQA
    return _SDPA_HAS_GQA and bias is None and dtype in (torch.float16, torch.bfloat16)


# SDPA's fused CPU kernel (torch <= 2.13 at least) is fast forward in bf16/fp16 but slow backward at short lengths:
# measured on a Xeon with AMX-BF16, 2 threads, forward + backward of (B, nh, T, hs) = (64, 4, 20, 64) took 14.3 ms in
# bf16 against 2.9 ms with the same forward and the float32 backward, (32, 8, 128, 64) 67 against 32 ms
# (bench/results/axis-cost-2026-11-26-xeon-amx-2threads-attention-backward.json); the two meet
# at 256 keys (45 ms each) and bf16 wins beyond (384 keys: 37 against 42 ms). On a Zen 4 EPYC (AVX-512 BF16, no
# AMX, 1 thread) the same holds: 17.9 against 5.7 ms at Multi30k's shape, 0.96x at 255 keys, parity from 256. Below
# this many keys a half-precision CPU training step keeps the kernel's forward and runs its own backward
# (`_CpuShortAttention`; bench/axis_cost.py --attention). Its bf16 form (batched GEMMs) crosses SDPA's bf16 path at the
# same length (Xeon, 2 threads, (16, 8, T, 64) causal: 41.7 against 44.2 ms at 255 keys, 47.8 against 43.2 at 256).
_CPU_SHORT_BACKWARD_BELOW = 256
_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_cpu_flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _CpuShortAttention(torch.autograd.Function):
    """SDPA's CPU flash kernel in q's dtype forward, saving its output and log-sum-exp; the backward from those.

    bf16 with the C++ kernel (study/axes/kernels/attention_grad.cpp): the flash backward's formulas as five batched
    GEMMs around two fused passes over the (B, H, T, Tk) scores, small below 256 keys (`_bf16_short_backward`).
    Otherwise (fp16, or no compiler) the kernel's float32 backward from float32 copies. Outputs equal SDPA's;
    gradients are SDPA's up to rounding, no further from float64 than SDPA's own half-precision backward
    (tests/test_attention_kernels.py)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, is_causal):
        out, lse = _cpu_flash(q, k, v, 0.0, is_causal, attn_mask=bias)  # (B, nh, T, hs), (B, nh, T) float32
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bias, ctx.is_causal = bias, is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ops = eager_cpu_ops("attention_grad", q) if q.dtype == torch.bfloat16 else None
        with torch.autocast("cpu", enabled=False):  # a backward called inside autocast keeps the dtypes chosen here
            if ops is not None:
                dq, dk, dv = _bf16_short_backward(ops, grad_out.to(q.dtype), q, k, v, out, lse, ctx.bias,
                                                  ctx.is_causal)
            else:
                bias = None if ctx.bias is None else ctx.bias.float()
                dq, dk, dv = _cpu_flash_backward(grad_out.float().contiguous(), q.float(), k.float(), v.float(),
                                                 out.float(), lse, 0.0, ctx.is_causal, attn_mask=bias)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _bf16_short_backward(ops, grad_out, q, k, v, out, lse, bias, is_causal):
    """dq, dk, dv of softmax(q k^T / sqrt(hs) + bias) v (Dao 2023, Algorithm 2, P recomputed from the log-sum-exp),
    batched per K/V head: the query heads sharing one (GQA) are stacked as rows, so dk and dv sum over them inside
    the GEMM. S, dP and D in float32 (a bf16 dP raised dq's error by 40%); P and dS rounded to bf16 for their GEMMs."""
    b, nh, t, hs = q.shape
    nkv, tk = k.shape[1], k.shape[2]
    g, rows = b * nkv, (nh // nkv) * t
    scale = hs**-0.5
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()  # the C++ pass reads rows of hs
    qg, kg, vg = q.reshape(g, rows, hs), k.reshape(g, tk, hs), v.reshape(g, tk, hs)
    dog = grad_out.reshape(g, rows, hs)
    scores = torch.bmm(qg.float(), kg.float().transpose(1, 2))  # (g, rows, tk) = (B, nh, T, Tk)
    p16 = ops.probs_(scores.view(b, nh, t, tk), lse, bias, is_causal, scale)  # scores become P; p16 = P in bf16
    dv = torch.bmm(p16.view(g, rows, tk).transpose(1, 2), dog)  # (g, tk, hs)
    dp = torch.bmm(dog.float(), vg.float().transpose(1, 2))  # (g, rows, tk)
    ops.score_grad_(p16, dp.view(b, nh, t, tk), scores.view(b, nh, t, tk), grad_out, out, scale)  # p16 becomes dS
    ds = p16.view(g, rows, tk)
    dq, dk = torch.bmm(ds, kg), torch.bmm(ds.transpose(1, 2), qg)
    return dq.view(b, nh, t, hs), dk.view(b, nkv, tk, hs), dv.view(b, nkv, tk, hs)


def _short_backward_pays(q, k, v, bias, dropout_p) -> bool:
    """Whether this SDPA call is a half-precision CPU training call short enough for `_CpuShortAttention`:
    no dropout and no learned bias (the kernel computes no bias gradient, so SDPA itself picks the math kernel for
    T5's bias), and K/V heads the kernel shares itself or as many as q's."""
    return (
        _cpu_flash_backward is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and dropout_p == 0.0
        and (bias is None or not bias.requires_grad)
        and k.shape[-2] < _CPU_SHORT_BACKWARD_BELOW
        and (k.shape[1] == q.shape[1] or _SDPA_HAS_GQA)
    )


def _sdpa(q, k, v, bias, is_causal, dropout_p, n_rep):
    if _short_backward_pays(q, k, v, bias, dropout_p):
        return _CpuShortAttention.apply(q, k, v, bias, is_causal)
    if n_rep > 1:
        if share_kv_in_kernel(bias, q.device, q.dtype):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=True
            )
        b, h, t, d = k.shape
        k = k[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)
        v = v[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal)


def _group_by_memory_row(q: torch.Tensor, memory_rows: int, bias: torch.Tensor | None):
    """Cross-attention queries (B, nh, T, hs) of B = g * Bm target rows against Bm memory rows, each memory row shared
    by g consecutive target rows (beam search's g hypotheses of one sentence): one memory row's queries become
    (Bm, nh, g*T, hs), so its K/V are projected and stored once, not g times, and one SDPA call block serves g
    hypotheses. The bias (Bm, 1, T, S) depends on the key alone (source padding), so its first query row serves
    all. With g = 1 (training, greedy decoding) nothing changes."""
    b, nh, t, hs = q.shape
    if b == memory_rows:
        return q, bias
    if b % memory_rows:
        raise ValueError(f"{b} target rows cannot share {memory_rows} memory rows: each memory row serves the same "
                         "number of consecutive target rows")
    g = b // memory_rows
    q = q.view(memory_rows, g, nh, t, hs).transpose(1, 2).reshape(memory_rows, nh, g * t, hs)
    return q, None if bias is None else bias[:, :, :1]


class Attention(nn.Module):
    """Multi-head attention with n_kv_heads K/V heads; `cross=True` attends to a memory."""

    def __init__(self, cfg, layer_idx: int, cross: bool = False, window: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.cross = cross
        self.cache_keep = window - 1 if window is not None else None  # a sliding-window layer's rolling cache
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.resolved_n_kv_heads
        self.head_dim = cfg.resolved_head_dim
        self.dropout_p = cfg.resolved_attention_dropout
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if cross:
            self.q_proj = nn.Linear(cfg.d_model, q_dim, bias=cfg.bias)
            self.kv_proj = nn.Linear(cfg.d_model, 2 * kv_dim, bias=cfg.bias)
        else:  # one fused projection: rows are [q; k; v]
            self.qkv_proj = nn.Linear(cfg.d_model, q_dim + 2 * kv_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(q_dim, cfg.d_model, bias=cfg.bias)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # (B, T, n*hs) -> (B, n, T, hs)

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        is_causal: bool,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        memory: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d). nh query heads, nkv K/V heads (nh = nkv * groups), hs = head_dim; `bias`
        (B|1, nh|1, T, Tk) is added to the scores; Tk = T, plus the cached past, or the memory length S."""
        b, t, _ = x.shape
        if self.cross:
            q = self._heads(self.q_proj(x), self.n_heads)  # (B, nh, T, hs)
            k, v = self._memory_kv(memory, cache)  # (Bm, nkv, S, hs) each
            q, bias = _group_by_memory_row(q, k.shape[0], bias)  # (Bm, nh, g*T, hs); g = B / Bm
        else:
            q, k, v = self._self_qkv(x, rotary, cache)  # (B, nh, T, hs), (B, nkv, Tk, hs), (B, nkv, Tk, hs)
        if bias is not None and bias.dtype != q.dtype:
            bias = bias.to(q.dtype)
        dropout_p = self.dropout_p if self.training else 0.0
        out = _sdpa(q, k, v, bias, is_causal, dropout_p, self.n_heads // self.n_kv_heads)  # (B|Bm, nh, g*T, hs)
        out = out.view(out.shape[0], self.n_heads, -1, t, self.head_dim).permute(0, 2, 3, 1, 4)  # (Bm, g, T, nh, hs)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))  # (B, T, d)

    def _self_qkv(self, x: torch.Tensor, rotary, cache: KVCache | None):
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_dim, kv_dim, kv_dim], dim=-1)  # (B, T, nh*hs), (B, T, nkv*hs) x 2
        q, k, v = self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)
        if rotary is not None:  # RoPE rotates q and k before they are cached (Su et al. 2021)
            cos, sin = rotary  # (T, hs) each
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.append(self.layer_idx, k, v, keep=self.cache_keep)  # (B, nkv, past + T, hs)
        return q, k, v

    def _memory_kv(self, memory: torch.Tensor, cache: KVCache | None):
        """K and V of the encoder memory (B, S, d), projected once per decoding and kept in the cache."""
        if cache is not None and self.layer_idx in cache.cross_kv:
            return cache.cross_kv[self.layer_idx]
        kv_dim = self.n_kv_heads * self.head_dim
        k, v = self.kv_proj(memory).split([kv_dim, kv_dim], dim=-1)  # (B, S, nkv*hs) each
        k, v = self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)
        if cache is not None:
            cache.cross_kv[self.layer_idx] = (k, v)
        return k, v
