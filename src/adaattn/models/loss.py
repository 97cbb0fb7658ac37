"""The LM head and the cross-entropy in one pass, without the B x S x vocab logits in memory (issue 67).

A plain training step writes the head's logits (N x V in bf16), reads them for an fp32 log-softmax, keeps what
the backward needs, and in the backward writes the logits' gradient (N x V again) before the head's two GEMMs:
at llama_1b's B=4, S=2048, V=32000 that is ~0.5 GB a tensor. ``linear_cross_entropy`` does the head a chunk of
rows at a time inside the forward: the chunk's logits, its loss, and the gradient of the loss with respect to
the chunk's logits, at once turned into the hidden states' gradient and added into the head's; the backward only
scales those two by the incoming gradient. Liger-Kernel's fused linear cross-entropy has the same design (the
mfu study measures it beside this one); here the chunk's softmax is PyTorch's, compiled on a GPU so that its
log-sum-exp, exp and the target's subtraction are one kernel over the chunk.

Chunks: Liger's sizing, rows = next power of two of N / ceil(V / E) (the chunk's logits about the size of the
hidden states), times ``CHUNK_SCALE``: bigger chunks are bigger GEMMs, and the memory saved is still V / E-fold.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

CHUNK_SCALE = 4  # chunks 4x Liger's: the chunk's logits ~4x the hidden states (N x E), still far below N x V


def chunk_rows(n: int, dim: int, vocab: int) -> int:
    """Rows a chunk: Liger's size (the logits of a chunk about the hidden states' size) times ``CHUNK_SCALE``."""
    return min(n, CHUNK_SCALE * 2 ** math.ceil(math.log2(max(1, math.ceil(n / math.ceil(vocab / dim))))))


def _chunk(logits: Tensor, targets: Tensor, ignore_index: int, scale: Tensor) -> tuple[Tensor, Tensor]:
    """(the chunk's summed loss, d(loss * scale)/d(logits) in the logits' dtype): fp32 softmax, ignored rows 0."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    keep = targets != ignore_index
    safe = torch.where(keep, targets, 0)
    target_logit = x.gather(1, safe[:, None])[:, 0]
    loss = torch.where(keep, lse - target_logit, 0.0).sum()
    grad = torch.exp(x - lse[:, None]).scatter_add(1, safe[:, None], x.new_full((x.shape[0], 1), -1.0))
    grad = grad * (keep.to(grad.dtype) * scale)[:, None]
    return loss, grad.to(logits.dtype)


_compiled_chunk = None


def _chunk_fn(device: torch.device):
    """The chunk's softmax: compiled on a GPU (one kernel over the chunk's logits), eager elsewhere."""
    global _compiled_chunk
    if device.type != "cuda":
        return _chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk, dynamic=False)
    return _compiled_chunk


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, dtype: torch.dtype,
                rows: int) -> Tensor:
        n = hidden.shape[0]
        w = weight.to(dtype)
        # the mean over the kept targets, as F.cross_entropy's; a tensor on the device: no host sync a step
        acc = torch.promote_types(dtype, torch.float32)  # fp32 sums (float64 where the GEMMs are: the tests')
        scale = 1.0 / (targets != ignore_index).sum().clamp_min(1).to(acc)
        grad_h = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        step = _chunk_fn(hidden.device)
        for lo in range(0, n, rows):
            h = hidden[lo:lo + rows].to(dtype)
            loss, g = step(h @ w.t(), targets[lo:lo + rows], ignore_index, scale)
            total += loss
            grad_h[lo:lo + rows] = g @ w
            grad_w += (g.t() @ h).to(acc)  # each chunk's product in the compute dtype, the sum in fp32
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h * grad_out).to(h_dtype), (grad_w * grad_out).to(w_dtype), None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100,
                         dtype: torch.dtype = torch.bfloat16, rows: int | None = None) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)`` (the mean over targets not ``ignore_index``) without
    the logits: ``hidden`` (..., E), ``weight`` (V, E), ``targets`` (...) matching ``hidden``'s leading dims.
    The head's GEMMs run in ``dtype`` (as a bf16 autocast runs the head), the softmax in fp32; ``rows`` a
    chunk (default ``chunk_rows``). Its gradients are computed in the forward: call it only where a backward
    follows (a training step), else it does the backward's work for nothing."""
    if hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: hidden (..., E) {tuple(hidden.shape)}, weight (V, E) "
                         f"{tuple(weight.shape)} and targets {tuple(targets.shape)} do not match")
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    rows = rows or chunk_rows(h.shape[0], weight.shape[1], weight.shape[0])
    return _LinearCrossEntropy.apply(h, weight, t, ignore_index, dtype, rows)
