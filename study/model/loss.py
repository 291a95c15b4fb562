"""Next-token cross-entropy fused with the output projection, computed in row chunks.

`linear_cross_entropy(h, weight, targets)` equals
`F.cross_entropy(F.linear(h, weight, bias).float(), targets, ignore_index=...)` (mean over
non-ignored targets) but never materialises the (N, vocab) logits: each chunk of rows is
projected, and its softmax, loss and gradient (softmax - one_hot) are computed while the
chunk is in cache. The loss reads log p[target] from the softmax, which on CPU is several
times faster than log_softmax (log_softmax takes over for the rare rows where p underflows).
The gradients for `h`, `weight` and `bias` are accumulated during the forward pass; the
backward only scales them by the incoming gradient. The matmuls are the same three the
unfused path runs (logits, dlogits @ W, dlogits^T @ h), so it costs no extra FLOPs, and
peak memory drops by about three (N, vocab) float32 tensors (logits, log-probabilities,
their gradient).

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

from study.model.precision import autocast_dtype, host_reads_are_free


# below log(1e-30) a float32 softmax loses digits (and underflows to 0 near 1e-38)
_LOG_TINY = -69.0


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, targets, ignore_index, chunk_size, compute_dtype):
        n = h.shape[0]
        needs = ctx.needs_input_grad
        with torch.autocast(h.device.type, enabled=False):
            hc = h.to(compute_dtype)
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            valid = targets != ignore_index
            count = valid.sum()
            # On the CPU reading a value costs nothing and saves whole passes over the chunk; on a GPU it would wait
            # for the device, so there every row is masked and every pick corrected without asking.
            reads_free = host_reads_are_free(h.device)
            any_ignored = bool(count < n) if reads_free else True
            safe_targets = targets.clamp(min=0) if any_ignored else targets
            loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty(n, h.shape[1], dtype=compute_dtype, device=h.device) if needs[0] else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if needs[1] else None
            grad_b = None
            if b is not None and needs[2]:
                grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device)
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                x = hc[start:end]
                t = safe_targets[start:end, None]
                logits = F.linear(x, w, b).float()
                # softmax is several times faster than log_softmax on CPU; the picked
                # log-probability is log(p) unless p underflows, where log_softmax decides.
                p = torch.softmax(logits, dim=-1)
                picked = _picked_log_probs(p, logits, t, reads_free)
                del logits
                if any_ignored:
                    keep = valid[start:end]
                    picked = picked.masked_fill(~keep, 0.0)
                loss_sum -= picked.sum()
                if grad_h is None and grad_w is None and grad_b is None:
                    continue
                g = p
                g.scatter_add_(1, t, torch.full_like(t, -1.0, dtype=g.dtype))
                if any_ignored:
                    g.mul_(keep[:, None])
                g = g.to(compute_dtype)
                if grad_h is not None:
                    torch.mm(g, w, out=grad_h[start:end])
                if grad_w is not None:
                    if compute_dtype == torch.float32:
                        grad_w.addmm_(g.t(), x)
                    else:
                        grad_w.add_(torch.mm(g.t(), x))
                if grad_b is not None:
                    grad_b.add_(g.sum(0, dtype=torch.float32))
            scale = 1.0 / count.to(torch.float32)
            loss = loss_sum * scale
            grads = []
            for g_, like in ((grad_h, h), (grad_w, weight), (grad_b, bias)):
                grads.append(None if g_ is None else (g_.to(like.dtype) if g_.dtype != like.dtype else g_).mul_(scale))
        ctx.grads = grads
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads = ctx.grads
        if not host_reads_are_free(grad_loss.device) or not bool(grad_loss == 1):
            grads = [None if g is None else g * grad_loss for g in grads]
        return grads[0], grads[1], grads[2], None, None, None, None


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


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `F.linear(h, weight, bias)` against `targets`, ignoring
    `ignore_index`; `h` is (..., d) and `targets` the matching (...) shape. `chunk_size`
    rows are projected at a time (default: about 4M logits, 16 MB in float32, per chunk)."""
    if chunk_size is None:
        chunk_size = max(64, (1 << 22) // weight.shape[0] // 64 * 64)
    h2 = h.reshape(-1, h.shape[-1])
    t = targets.reshape(-1)
    compute_dtype = autocast_dtype(h.device.type) or torch.promote_types(h.dtype, weight.dtype)
    if not (h2.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        with torch.no_grad():
            b = None if bias is None else bias.to(compute_dtype)
            logits = F.linear(h2.to(compute_dtype), weight.to(compute_dtype), b)
            return F.cross_entropy(logits.float(), t, ignore_index=ignore_index)
    return _LinearCrossEntropy.apply(h2, weight, bias, t, ignore_index, chunk_size, compute_dtype)
