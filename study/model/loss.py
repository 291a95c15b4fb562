"""Next-token cross-entropy fused with the output projection, computed in row chunks.

`linear_cross_entropy(h, weight, targets)` equals
`F.cross_entropy(F.linear(h, weight, bias).float(), targets, ignore_index=..., label_smoothing=...)` (mean
over non-ignored targets) but never materialises the (N, vocab) logits: each chunk of rows is
projected into one buffer, and its loss and gradient (softmax - one_hot) are computed while the chunk is in cache.
On a CPU (float32 or bfloat16 logits) one C++ pass per row does it (study/axes/kernels/cross_entropy_grad.cpp: the
loss as logsumexp - target logit, the gradient written over the logits); elsewhere eager ops do: a softmax, which on
CPU is several times faster than log_softmax, the log of its pick (log_softmax takes over for the rare rows where p
underflows) and a scatter of the one-hot. The gradients for `h`, `weight` and `bias` are accumulated during the
forward pass; the backward only scales them by the incoming gradient. The matmuls are the same three the
unfused path runs (logits, dlogits @ W, dlogits^T @ h), so it costs no extra FLOPs, and
peak memory drops by about three (N, vocab) float32 tensors (logits, log-probabilities,
their gradient).

Label smoothing eps makes a row's loss (1 - eps) * (-log p_t) + eps * (logsumexp - mean logit), which is
-log p_t + eps * (target logit - mean logit), and its logit gradient p - (1 - eps) one_hot - eps/V. Neither
needs another pass over a chunk: the mean logit is h . mean(W) + mean(b), and the constant -eps/V reaches the
gradients of `h`, `weight` and `bias` as rank-one terms added once at the end (`_Smoothing`). With eps = 0 none
of it runs.

Under autocast the projections run in the autocast dtype and the softmax in float32, as
the unfused path does. In float32 the result equals the unfused loss and gradients up to
rounding and summation order (relative differences around 1e-6), not bit for bit. The
model's own outputs are untouched: this is a separate loss path, not a change to
`DecoderLM.forward`. Use it as

    h = model.decoder(input_ids)                       # (B, T, d), final norm applied
    loss = linear_cross_entropy(h, model.lm_head.proj.weight, targets, bias=model.lm_head.proj.bias)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from study.axes.cpu_kernels import eager_cpu_ops
from study.model.precision import autocast_dtype, host_reads_are_free


# below log(1e-30) a float32 softmax loses digits (and underflows to 0 near 1e-38)
_LOG_TINY = -69.0


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, targets, ignore_index, chunk_size, compute_dtype, label_smoothing):
        n, n_vocab = h.shape[0], weight.shape[0]
        with torch.autocast(h.device.type, enabled=False):
            hc, w = h.to(compute_dtype), weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            rows = _Targets(targets, ignore_index, 1.0 - label_smoothing)
            loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h, grad_w, grad_b = _gradient_buffers(h, weight, bias, ctx.needs_input_grad, compute_dtype)
            smoothing = _Smoothing(label_smoothing, hc, w, b, rows.valid) if label_smoothing else None
            # one chunk of logits, overwritten by their gradient (softmax - target_weight * one_hot), and W's share of
            # it, allocated once: fresh (rows, V) blocks each chunk cost page faults (bench/README.md, "Page faults")
            z_all = torch.empty((min(chunk_size, n), n_vocab), dtype=compute_dtype, device=h.device)
            partial_w = _partial_weight_grad(grad_w, compute_dtype)
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                x, z = hc[start:end], z_all[:end - start]
                torch.mm(x, w.t(), out=z) if b is None else torch.addmm(b, x, w.t(), out=z)
                if smoothing is not None:
                    smoothing.add_rows(x, z, *rows.chunk(start, end)[1:])
                loss_sum += rows.loss_and_logit_grad_(z, start, end)
                if grad_h is not None:
                    torch.mm(z, w, out=grad_h[start:end])
                if grad_w is not None and partial_w is None:
                    grad_w.addmm_(z.t(), x)
                elif grad_w is not None:  # torch's CPU addmm_ takes one dtype: W's share rounds to it, then adds
                    _add_to_float32_(grad_w, torch.mm(z.t(), x, out=partial_w))
                if grad_b is not None:
                    grad_b.add_(z.sum(0, dtype=torch.float32))
            scale = 1.0 / rows.count.to(torch.float32)
            grads = [None if g_ is None else g_.to(like.dtype)
                     for g_, like in ((grad_h, h), (grad_w, weight), (grad_b, bias))]
            if smoothing is not None:
                loss_sum = loss_sum + smoothing.loss_sum
                smoothing.add_uniform_gradients(grads, rows.valid, rows.count)
            loss = loss_sum * scale
            grads = [None if g_ is None else g_.mul_(scale) for g_ in grads]
        ctx.grads = grads
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads = ctx.grads
        if not host_reads_are_free(grad_loss.device) or not bool(grad_loss == 1):
            grads = [None if g is None else g * grad_loss for g in grads]
        return grads[0], grads[1], grads[2], None, None, None, None, None


def _gradient_buffers(h, weight, bias, needs, compute_dtype) -> tuple:
    """Where the forward accumulates the gradients it will return (None for an input that needs none): h's rows in
    the compute dtype, each written once; W's and b's sums over chunks in float32."""
    grad_h = torch.empty(h.shape, dtype=compute_dtype, device=h.device) if needs[0] else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if needs[1] else None
    grad_b = None
    if bias is not None and needs[2]:
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device)
    return grad_h, grad_w, grad_b


def _partial_weight_grad(grad_w: torch.Tensor | None, compute_dtype: torch.dtype) -> torch.Tensor | None:
    """Where a chunk's share of W's gradient lands before its float32 sum, where the compute dtype is not float32."""
    if grad_w is None or compute_dtype == grad_w.dtype:
        return None
    return torch.empty(grad_w.shape, dtype=compute_dtype, device=grad_w.device)


def _add_to_float32_(acc: torch.Tensor, part: torch.Tensor) -> None:
    """acc (float32) += part. torch's mixed-dtype add_ first copies a bfloat16 part to a fresh float32 block (3.4 ms of
    4.4 for W's (8000, 512) share on a Xeon with AMX, 2 threads); on a CPU the C++ kernel adds it in one pass."""
    ops = eager_cpu_ops("cross_entropy_grad", part) if part.dtype == torch.bfloat16 else None
    if ops is None:
        acc.add_(part)
    else:
        ops.accumulate_(acc, part)


class _Targets:
    """A flat batch's targets, and each chunk's loss and logit gradient: the C++ kernel's one pass
    (study/axes/kernels/cross_entropy_grad.cpp) on CPU float32 and bfloat16 logits, eager PyTorch elsewhere."""

    def __init__(self, targets: torch.Tensor, ignore_index: int, target_weight: float):
        self.targets, self.ignore_index, self.target_weight = targets, ignore_index, target_weight
        self.valid = targets != ignore_index
        self.count = self.valid.sum()
        # On the CPU reading a value costs nothing and saves whole passes over the chunk; on a GPU it would wait
        # for the device, so there every row is masked and every pick corrected without asking.
        self.reads_free = host_reads_are_free(targets.device)
        self.any_ignored = bool(self.count < targets.numel()) if self.reads_free else True
        self.safe = targets.clamp(min=0) if self.any_ignored else targets

    def chunk(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The chunk's targets, its targets with ignored ones at 0 (column indices), (chunk, 1), and the rows that
        count (None when all do)."""
        keep = self.valid[start:end] if self.any_ignored else None
        return self.targets[start:end], self.safe[start:end, None], keep

    def loss_and_logit_grad_(self, z: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The chunk's summed -log p[target] (float32, 0-d); z, its (chunk, V) logits, becomes their gradient
        softmax - target_weight * one_hot, zero in ignored rows."""
        targets, t, keep = self.chunk(start, end)
        ops = eager_cpu_ops("cross_entropy_grad", z) if z.dtype in (torch.float32, torch.bfloat16) else None
        if ops is not None:
            return ops.forward_(z, targets, self.target_weight, self.ignore_index).sum()
        logits = z.float()
        p = torch.softmax(logits, dim=-1)  # several times faster than log_softmax on CPU
        picked = _picked_log_probs(p, logits, t, self.reads_free)
        p.scatter_add_(1, t, torch.full_like(t, -self.target_weight, dtype=p.dtype))
        if keep is not None:
            picked = picked.masked_fill(~keep, 0.0)
            p.mul_(keep[:, None])
        z.copy_(p)
        return -picked.sum()


def _picked_log_probs(p: torch.Tensor, logits: torch.Tensor, t: torch.Tensor, reads_free: bool) -> torch.Tensor:
    """log p[target] of each row (chunk,): log of the softmax, which loses digits below _LOG_TINY, where log_softmax
    takes over. Without host reads every row takes log p_t = (x_t - x_max) + log p_max (exact: p_max = 1 / sum exp(x -
    x_max) never underflows) wherever the softmax's pick is tiny."""
    picked = p.gather(1, t).squeeze(1).log_()
    tiny = picked < _LOG_TINY
    if reads_free:
        if bool(tiny.any()):
            rows = tiny.nonzero().squeeze(1)
            picked[rows] = torch.log_softmax(logits[rows], dim=-1).gather(1, t[rows]).squeeze(1)
        return picked
    p_max, argmax = p.max(dim=-1, keepdim=True)
    exact = (logits.gather(1, t) - logits.gather(1, argmax) + p_max.log()).squeeze(1)
    return torch.where(tiny, exact, picked)


class _Smoothing:
    """Label smoothing's share of the loss and gradients, from O(rows * d) work. A row's smoothed loss
    (1 - eps) * (-log p_t) + eps * (lse - mean_j z_j) is, with lse = z_t - log p_t, the plain -log p_t plus
    eps * (z_t - mean_j z_j): no logsumexp to take, and mean_j z_j = x . mean_j w_j + mean_j b_j needs no pass over
    the chunk's logits. The -eps/V in every logit's gradient is added to the summed gradients once: -eps * mean_j w_j
    to each kept row of h, -eps/V * (sum of kept rows of h) to each row of W, and -eps/V * (kept rows) to b."""

    def __init__(self, eps: float, hc: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, valid: torch.Tensor):
        self.eps, self.n_vocab = eps, w.shape[0]
        self.w_mean = w.mean(0, dtype=torch.float32)  # (d,)
        self.b_mean = b.mean(dtype=torch.float32) if b is not None else 0.0
        self.h_sum = valid.to(torch.float32) @ hc.float()  # (d,) sum of the kept rows
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=hc.device)

    def add_rows(self, x: torch.Tensor, logits: torch.Tensor, t: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Adds eps * (target logit - mean logit) of the chunk's kept rows."""
        excess = logits.gather(1, t).squeeze(1).float() - (x.float() @ self.w_mean + self.b_mean)
        if keep is not None:
            excess = excess.masked_fill(~keep, 0.0)
        self.loss_sum += self.eps * excess.sum()

    def add_uniform_gradients(self, grads: list, valid: torch.Tensor, count: torch.Tensor) -> None:
        """Adds the -eps/V of every kept row's logit gradient to the summed (unscaled) gradients of h, W and b."""
        grad_h, grad_w, grad_b = grads
        per_logit = self.eps / self.n_vocab
        if grad_h is not None:
            grad_h.addr_(valid.to(grad_h.dtype), self.w_mean.to(grad_h.dtype), alpha=-self.eps)
        if grad_w is not None:
            grad_w.sub_((per_logit * self.h_sum).to(grad_w.dtype))
        if grad_b is not None:
            grad_b.sub_(per_logit * count)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Mean cross-entropy of `F.linear(h, weight, bias)` against `targets`, ignoring
    `ignore_index`, with PyTorch's `label_smoothing`; `h` is (..., d) and `targets` the matching (...)
    shape. `chunk_size` rows are projected at a time (default: about 4M logits, 16 MB in float32, per chunk on a CPU,
    where a chunk that stays in cache pays; 64M logits, 256 MB, on a GPU, where each chunk's dozen kernel launches
    cost more than its memory: eight chunks ran 0.84-0.94x Hugging Face's tokens/s on an H200 at B=32, T=128, vocab
    8000, where one full-logits cross-entropy ran 1.08-1.41x, bench/results/gpu-2026-11-26/)."""
    if chunk_size is None:
        logits_per_chunk = 1 << 22 if h.device.type == "cpu" else 1 << 26
        chunk_size = max(64, logits_per_chunk // weight.shape[0] // 64 * 64)
    h2 = h.reshape(-1, h.shape[-1])
    t = targets.reshape(-1)
    compute_dtype = autocast_dtype(h.device.type) or torch.promote_types(h.dtype, weight.dtype)
    wants_grad = h2.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if not (torch.is_grad_enabled() and wants_grad):  # evaluation: nothing to accumulate
        with torch.no_grad():
            b = None if bias is None else bias.to(compute_dtype)
            logits = F.linear(h2.to(compute_dtype), weight.to(compute_dtype), b)
            return F.cross_entropy(logits.float(), t, ignore_index=ignore_index, label_smoothing=label_smoothing)
    return _LinearCrossEntropy.apply(h2, weight, bias, t, ignore_index, chunk_size, compute_dtype, label_smoothing)
