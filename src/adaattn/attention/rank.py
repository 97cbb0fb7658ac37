"""Adaptive rank: estimate the effective rank of each head's attention matrix; a Nyström low-rank path.

Estimate (per head, on a sample of query rows): the softmax rows P_s (m x S) of m sampled queries.
- spectrum rank: the number of singular values of P_s holding ``energy`` of its squared
  Frobenius norm (a randomized estimate: the rows are a random sample);
- entropy rank: exp(mean row entropy), the number of keys a query effectively attends to.
Rows of a rank-r attention matrix span at most r dimensions, so the spectrum rank of a sample
bounds the matrix's from below; the policy takes the spectrum rank, and reports both.

Low-rank path: Nyström with segment-mean landmarks (Xiong et al. 2021, Nyströmformer):
softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V with r landmarks Q~, K~ (means of r
contiguous segments of Q and K). Chosen over the alternatives because a drop-in module must work
with pretrained weights and no training: Linformer-style learned projections need training, and
a PCA projection of keys and values costs an SVD per call (O(S D^2)) and is exact only for the
values, not for the softmax. Nyström costs O(S r D) plus an r x r pseudo-inverse, and needs
neither. It has no causal or padding form here: with a mask, the exact path runs. Without
autograd, on a device the Triton kernels run on, the forward is four fused launches up to 128
landmarks, the r x r solve as batched matmuls beyond (``nystrom_triton``; ``nystrom_path`` says
which implementation runs and why).

Policy (``choose_rank``, what ``rank_mode="auto"`` runs on the first call of a signature): the
sampled spectrum rank r_est of every head; if the largest is clearly low (at most half the
sample and at most S/16), 2 r_est landmarks are tried on the sampled query rows, and taken only
when their relative L2 error against exact attention of those rows is within ``max_rel_error``.
Segment-mean landmarks summarise contiguous tokens: a matrix of low rank whose structure is not
contiguous in the sequence (clustered tokens spread over it) can fail the check and stay exact.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from adaattn.kernels.runtime import get_kernel_status, needs_grad, use_triton


def sample_rows(n: int, rows: int, device) -> Tensor:
    """Indices of up to ``rows`` evenly spaced query rows out of ``n``."""
    return torch.linspace(0, n - 1, min(rows, n), device=device).long()


def _sample_probs(q: Tensor, k: Tensor, rows: int, scale: float) -> Tensor:
    """(B, Hq, m, S) softmax rows of m evenly spaced queries, fp32."""
    idx = sample_rows(q.shape[2], rows, q.device)
    g = q.shape[1] // k.shape[1]
    kk = k.detach().float().repeat_interleave(g, dim=1)
    return torch.softmax(q.detach().float()[:, :, idx] @ kk.transpose(-2, -1) * scale, dim=-1)


def estimate_rank(q: Tensor, k: Tensor, sample_rows: int = 64, energy: float = 0.99,
                  scale: float | None = None) -> dict[str, Tensor]:
    """Per head (averaged over the batch): {"spectrum": (Hq,), "entropy": (Hq,)} effective ranks, float."""
    if not 0 < energy <= 1:
        raise ValueError(f"energy must be in (0, 1]; got {energy}")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    with torch.no_grad():
        p = _sample_probs(q, k, sample_rows, scale)  # (B, H, m, S)
        s2 = torch.linalg.svdvals(p) ** 2  # (B, H, min(m, S))
        frac = s2.cumsum(-1) / s2.sum(-1, keepdim=True).clamp_min(1e-30)
        spectrum = (frac < energy).sum(-1) + 1
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).mean(-1)
    return {"spectrum": spectrum.float().mean(0), "entropy": entropy.exp().mean(0)}


PINV_ITERS = 6  # Newton-Schulz iterations of the pseudo-inverse (Nyströmformer's default)
PINV_MATMULS_PER_ITER = 4  # r x r x r products per iteration (``_pinv``): what bounds the solve's time


def _segment_means(x: Tensor, r: int) -> Tensor:
    """(B, H, S, D) -> (B, H, r, D) fp32: means of r contiguous segments, segment i the rows
    floor(i S / r) .. floor((i + 1) S / r) - 1 (sizes differ by at most one). When r divides S,
    one mean over a (B, H, r, S/r, D) view; otherwise prefix sums."""
    B, H, S, D = x.shape
    if S % r == 0:
        return x.view(B, H, r, S // r, D).mean(3, dtype=torch.float32)
    bounds = torch.arange(r + 1, device=x.device) * S // r
    csum = torch.nn.functional.pad(x.float().cumsum(2), (0, 0, 1, 0))
    sums = csum[:, :, bounds[1:]] - csum[:, :, bounds[:-1]]
    return sums / (bounds[1:] - bounds[:-1]).clamp_min(1)[:, None].float()


def nystrom_attention(q: Tensor, k: Tensor, v: Tensor, rank: int, scale: float | None = None,
                      pinv_iters: int = PINV_ITERS, rows: Tensor | None = None) -> Tensor:
    """Nyström approximation of softmax(q k^T * scale) v with ``rank`` landmarks; no mask.
    q (B, Hq, L, D), k and v (B, Hkv, S, D); GQA without copying k or v (the query heads of a kv
    head are stacked). q K~^T runs in the input dtype (fp32 accumulation; q is never copied to
    fp32); landmarks, Q~ k^T, its product with v, the softmaxes and the r x r pseudo-inverse are
    fp32: the pseudo-inverse of an ill-conditioned landmark kernel amplifies any rounding there.
    Output in q's dtype. ``rows``: only these query rows of the output (the landmarks still come
    from every row)."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int; got {rank!r}")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    rank = min(rank, L, S)
    if nystrom_path(q, k, v, rank) == "triton":
        from adaattn.attention.nystrom_triton import nystrom_forward

        return nystrom_forward(q, k, v, rank, scale, pinv_iters, rows=rows)
    ql = _segment_means(q, rank)  # (B, Hq, r, D) fp32
    # key landmarks rounded to the input dtype for q K~^T; the r x r kernel is built from the same
    # rounded values, or its pseudo-inverse amplifies the mismatch
    kl = _segment_means(k, rank).to(k.dtype)  # (B, Hkv, r, D)
    kl = kl.repeat_interleave(g, dim=1) if g > 1 else kl  # r rows per query head: a small copy
    qr = q if rows is None else q[:, :, rows]
    f = torch.softmax((qr @ kl.transpose(-2, -1)).float() * scale, dim=-1)  # (B, Hq, L', r)
    a = torch.softmax(ql @ kl.float().transpose(-2, -1) * scale, dim=-1)  # (B, Hq, r, r)
    # Q~ k^T and its product with v in fp32 (the pseudo-inverse amplifies their rounding); per kv
    # head, its g query heads' landmarks stacked: (B, Hkv, g r, S)
    kf, vf = k.float(), v.float()
    b = torch.softmax(ql.reshape(B, Hkv, g * rank, D) @ kf.transpose(-2, -1) * scale, dim=-1)
    bv = (b @ vf).reshape(B, Hq, rank, D)
    return (f @ (_pinv(a, pinv_iters) @ bv)).to(q.dtype)


def nystrom_path(q: Tensor, k: Tensor, v: Tensor, rank: int) -> str:
    """Which implementation ``nystrom_attention`` runs for these inputs: "triton" (four fused
    launches, forward only: ``nystrom_triton``) or "torch: <why not triton>" (differentiable)."""
    if not use_triton(q, k, v):
        return f"torch: {get_kernel_status()['reason'] or 'Triton kernels cannot run on ' + q.device.type}"
    if needs_grad(q, k, v):
        return "torch: autograd needs the graph (the Triton path is forward only)"
    if torch.compiler.is_compiling():
        return "torch: under torch.compile"
    from adaattn.attention.nystrom_triton import supported

    why = supported(q, min(rank, q.shape[2], k.shape[2]))
    return "triton" if why is None else f"torch: {why}"


def _pinv(a: Tensor, iters: int) -> Tensor:
    """Iterative Moore-Penrose inverse (Razavi et al. 2014, as Nyströmformer), differentiable and batched:
    z <- z (13 I - a z (15 I - a z (7 I - a z))) / 4, each "c I - x y" one fused batched matmul."""
    shape, n = a.shape, a.shape[-1]
    a = a.reshape(-1, n, n)
    eye = torch.eye(n, device=a.device, dtype=a.dtype)
    eye7, eye15, eye13_4 = 7 * eye, 15 * eye, 3.25 * eye  # few launches per iteration: host time on a GPU
    z = a.transpose(1, 2) / (a.abs().sum(2).amax(1) * a.abs().sum(1).amax(1))[:, None, None]
    for _ in range(iters):
        az = torch.bmm(a, z)
        t = torch.baddbmm(eye15, az, eye7 - az, alpha=-1)
        z = torch.bmm(z, torch.baddbmm(eye13_4, az, t, alpha=-0.25))
    return z.view(shape)


def choose_rank(q: Tensor, k: Tensor, v: Tensor, sample: int = 64, min_len: int = 1024,
                max_rel_error: float = 0.05, scale: float | None = None) -> tuple[int | None, dict]:
    """The policy: (landmarks, or None for the exact path; what it saw). See the module docstring."""
    seen: dict = {"estimate": None, "tried": None, "sample_rel_error": None}
    if k.shape[2] < min_len:
        return None, seen
    est = int(estimate_rank(q, k, sample_rows=sample, scale=scale)["spectrum"].max().item())
    seen["estimate"] = est
    # a sample of m rows cannot show a rank above m: only clearly low estimates count
    if est > min(sample // 2, k.shape[2] // 16):
        return None, seen
    r = 2 * est
    seen["tried"] = r
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    with torch.no_grad():
        idx = sample_rows(q.shape[2], sample, q.device)
        g = q.shape[1] // k.shape[1]
        kk, vv = (t.detach().float().repeat_interleave(g, dim=1) for t in (k, v))
        exact = torch.softmax(q.detach().float()[:, :, idx] @ kk.transpose(-2, -1) * scale, dim=-1) @ vv
        approx = nystrom_attention(q.detach(), k.detach(), v.detach(), r, scale=scale, rows=idx).float()
        err = (torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact).clamp_min(1e-30)).item()
    seen["sample_rel_error"] = err
    return (r if err <= max_rel_error else None), seen
