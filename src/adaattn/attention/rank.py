"""Adaptive rank: estimate the effective rank of each head's attention matrix; a Nyström low-rank path.

Estimate (per head, on a sample of query rows): the softmax rows P_s (m x S) of m sampled queries.
- spectrum rank: the number of singular values of P_s holding ``energy`` of its squared
  Frobenius norm (a randomized estimate: the rows are a random sample);
- entropy rank: exp(mean row entropy), the number of keys a query effectively attends to.
Rows of a rank-r attention matrix span at most r dimensions, so the spectrum rank of a sample
bounds the matrix's from below; the policy takes the spectrum rank, and reports both.

Low-rank paths, two, both from segment means (r contiguous segments of the sequence) and both
working with pretrained weights and no training (Linformer-style learned projections need
training; a PCA projection of keys and values costs an SVD per call, O(S D^2), and is exact only
for the values, not for the softmax):
- ``nystrom``: Nyström with segment-mean landmarks (Xiong et al. 2021, Nyströmformer):
  softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V with r landmarks Q~, K~ (means of r
  contiguous segments of Q and K). It keeps each key's own weight for the landmark queries, so it
  is the more accurate of the two where keys vary within a segment, but it pays an r x r
  pseudo-inverse (48 r^3 flops per head): that solve bounds the landmarks at which it pays. Without
  autograd, on a device the Triton kernels run on, the forward is four fused launches up to 128
  landmarks, the r x r solve as batched matmuls beyond (``kernels.nystrom``; ``nystrom_path`` says
  which implementation runs and why).
- ``pooled``: the keys and values projected onto their segment means, a fixed Linformer
  projection (E = F = segment averaging): softmax(Q K~^T + log n) V~, n the segments' sizes (each
  mean stands for its n keys). No solve: one attention of the L queries over r keys (SDPA),
  O(L r D), differentiable; a forward without autograd on a device the Triton kernels run on, with
  S a multiple of r, is two fused launches (``kernels.pooled.pooled_forward``; ``pooled_path`` says
  which runs). Exact where the keys within each segment are equal (the values need not be); where
  they vary, every key of a segment gets its mean's weight, so it errs more than Nyström on the
  same landmarks.
Neither has a causal or padding form here: with a mask, the exact path runs.

Policy (``choose_rank``, what ``rank_mode="auto"`` runs on the first call of a signature): the
sampled spectrum rank r_est of every head; if the largest is clearly low (at most half the
sample and at most S/16), 2 r_est landmarks are tried on the sampled query rows by each low-rank
path in turn, the cheaper first (``LOW_RANK_METHODS``: pooled, then Nyström), and the first whose
relative L2 error against exact attention of those rows is within ``max_rel_error`` is taken where it
is faster than the exact path (``speed``: AdaAttention times the path against the exact path's backend,
side by side, as its kernel manager times backends: ``low_rank_speed``); otherwise the
exact path runs. Why: the path pays its error for speed, and at short sequences it is slower (two or
four Triton launches against one fused kernel: the rank study's policy rows).
Segment-mean landmarks summarise contiguous tokens: a matrix of low rank whose structure is not
contiguous in the sequence (clustered tokens spread over it) can fail the check and stay exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from adaattn.attention.backends import BACKENDS, Signature, sdpa_path, workload
from adaattn.kernels.runtime import get_kernel_status, needs_grad, use_triton
from adaattn.kernels.pinv import pinv


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
PINV_MATMULS_PER_ITER = 4  # r x r x r products per iteration (``kernels.pinv``): what bounds the solve's time


def _segment_means(x: Tensor, r: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """(B, H, S, D) -> (B, H, r, D) in ``dtype``: means of r contiguous segments, segment i the rows
    floor(i S / r) .. floor((i + 1) S / r) - 1 (sizes differ by at most one). When r divides S,
    one mean over a (B, H, r, S/r, D) view; otherwise prefix sums."""
    B, H, S, D = x.shape
    if S % r == 0:
        return x.view(B, H, r, S // r, D).mean(3, dtype=dtype)
    bounds = torch.arange(r + 1, device=x.device) * S // r
    csum = torch.nn.functional.pad(x.to(dtype).cumsum(2), (0, 0, 1, 0))
    sums = csum[:, :, bounds[1:]] - csum[:, :, bounds[:-1]]
    return sums / (bounds[1:] - bounds[:-1]).clamp_min(1)[:, None].to(dtype)


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
        from adaattn.kernels.nystrom import nystrom_forward

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
    return (f @ (pinv(a, pinv_iters) @ bv)).to(q.dtype)


def nystrom_path(q: Tensor, k: Tensor, v: Tensor, rank: int) -> str:
    """Which implementation ``nystrom_attention`` runs for these inputs: "triton" (four fused
    launches, forward only: ``kernels.nystrom``) or "torch: <why not triton>" (differentiable)."""
    why = _triton_why_not(q, k, v, min(rank, q.shape[2], k.shape[2]))
    return "triton" if why is None else f"torch: {why}"


def pooled_path(q: Tensor, k: Tensor, v: Tensor, rank: int) -> str:
    """Which implementation ``pooled_attention`` runs for these inputs: "triton" (two fused launches,
    forward only: ``kernels.pooled.pooled_forward``) or "torch: <why not triton>" (differentiable)."""
    rank = min(rank, k.shape[2])
    why = _triton_why_not(q, k, v, rank)
    if why is None and k.shape[2] % rank:
        why = f"S {k.shape[2]} is not a multiple of rank {rank} (the fused path has no segment-size bias)"
    if why is None and not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float16,
                                                                          torch.bfloat16)):
        why = f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (the fused path takes one of fp32, fp16, bf16)"
    return "triton" if why is None else f"torch: {why}"


def _triton_why_not(q: Tensor, k: Tensor, v: Tensor, rank: int) -> str | None:
    """Why the forward-only Triton low-rank kernels cannot run these inputs, or None."""
    if torch.compiler.is_compiling():  # first: the checks below read the environment, which dynamo would trace
        return "under torch.compile"
    if not use_triton(q, k, v):
        return get_kernel_status()['reason'] or f"Triton kernels cannot run on {q.device.type}"
    if needs_grad(q, k, v):
        return "autograd needs the graph (the Triton path is forward only)"
    from adaattn.kernels.nystrom import supported

    return supported(q, rank)


def pooled_attention(q: Tensor, k: Tensor, v: Tensor, rank: int, scale: float | None = None,
                     rows: Tensor | None = None) -> Tensor:
    """softmax(q K~^T * scale + log n) V~: attention over ``rank`` segment means K~, V~ of k and v (means in
    fp32 or wider, rounded to the input dtype), n the segments' sizes (a bias only where they differ); no mask.
    q (B, Hq, L, D), k and v (B, Hkv, S, D); GQA by repeating the r means of a kv head (a small copy).
    One SDPA call, differentiable. Without autograd, on a device the Triton kernels run on, with S a
    multiple of ``rank``: two fused launches instead (``kernels.pooled.pooled_forward``: SDPA's host
    time alone is most of a call at the lengths where this path pays; ``pooled_path`` says which
    runs). ``rows``: only these query rows of the output."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int; got {rank!r}")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    Hq, Hkv, S = q.shape[1], k.shape[1], k.shape[2]
    rank = min(rank, S)
    if pooled_path(q, k, v, rank) == "triton":
        from adaattn.kernels.pooled import pooled_forward

        return pooled_forward(q, k, v, rank, scale, rows=rows)
    bias = None
    if S % rank == 0:  # one launch each: PyTorch reduces bf16 / fp16 in fp32 and rounds the mean once
        kl, vl = (t.view(t.shape[0], t.shape[1], rank, S // rank, t.shape[3]).mean(3) for t in (k, v))
    else:
        acc = torch.promote_types(k.dtype, torch.float32)  # fp32 means of bf16 / fp16, float64 of float64
        kl, vl = _segment_means(k, rank, acc).to(k.dtype), _segment_means(v, rank, acc).to(v.dtype)
        bounds = torch.arange(rank + 1, device=q.device) * S // rank
        bias = (bounds[1:] - bounds[:-1]).to(acc).log().to(q.dtype)[None]  # (1, r): every query row
    if Hq != Hkv:
        kl, vl = kl.repeat_interleave(Hq // Hkv, dim=1), vl.repeat_interleave(Hq // Hkv, dim=1)
    return F.scaled_dot_product_attention(q if rows is None else q[:, :, rows], kl, vl, attn_mask=bias, scale=scale)


LOW_RANK_METHODS = ("pooled", "nystrom")  # the low-rank paths, in the order the policy tries them (cheaper first)


class LowRank(NamedTuple):
    """A low-rank path and its landmarks (segments)."""

    method: str  # one of LOW_RANK_METHODS
    rank: int

    def __str__(self) -> str:
        return f"{self.method} {self.rank}"


def low_rank_attention(q: Tensor, k: Tensor, v: Tensor, choice: LowRank, scale: float | None = None,
                       rows: Tensor | None = None) -> Tensor:
    """The low-rank path ``choice`` names: ``nystrom_attention`` or ``pooled_attention``."""
    if choice.method == "nystrom":
        return nystrom_attention(q, k, v, choice.rank, scale=scale, rows=rows)
    if choice.method == "pooled":
        return pooled_attention(q, k, v, choice.rank, scale=scale, rows=rows)
    raise ValueError(f"low-rank method {choice.method!r} is not one of: {', '.join(LOW_RANK_METHODS)}")


class Speed(NamedTuple):
    """A low-rank path's time per call against the exact path's, timed side by side (``choose_rank``)."""

    low_rank_ms: float  # inf: the low-rank path failed where it was timed
    exact_ms: float
    exact: str  # what the exact path runs (a kernel manager's backend)


def low_rank_speed(manager, through_manager: bool, q: Tensor, k: Tensor, v: Tensor, scale: float,
                   choice: LowRank) -> Speed:
    """AdaAttention's ``speed`` check: the low-rank path against the exact path's backend (``manager``'s first,
    ranked here if it has not been; SDPA where the module does not go through the manager), timed side by side
    as the manager times backends (``time_ops``: GPU-time turns)."""
    if through_manager:
        sig = Signature.of(q, k, "none")
        ranked = manager.ranking(sig) or manager.measure(sig, q, k, v, None, False, scale)
        exact, run = ranked[0], BACKENDS[ranked[0]].run
    else:
        exact, run = "sdpa", sdpa_path
    grad = torch.is_grad_enabled() and q.requires_grad
    times = manager.time_ops({
        "low-rank": workload(lambda *a: low_rank_attention(*a[:3], choice, scale=a[5]), q, k, v, None, False,
                             scale, grad),
        exact: workload(run, q, k, v, None, False, scale, grad)}, q.device)
    return Speed(times.get("low-rank", math.inf), times.get(exact, math.inf), exact)


def skip_reason(choice: LowRank | None, seen: dict, max_rel_error: float | None) -> str | None:
    """Why ``choose_rank`` (its ``seen``) left a path it tried for the exact one: too slow, or its sampled rows'
    error above ``max_rel_error``; None where it took one or tried none."""
    if choice is not None or seen["tried"] is None:
        return None
    if seen["speed"] is not None:
        sp, method = seen["speed"], list(seen["sample_rel_error"])[-1]
        return (f"{seen['tried']} landmarks ({method}): {sp.low_rank_ms:.3g} ms per call, not faster than the exact "
                f"path's {sp.exact} ({sp.exact_ms:.3g} ms)")
    errs = ", ".join(f"{m} {e:.3g}" for m, e in seen["sample_rel_error"].items())
    return f"{seen['tried']} landmarks: sampled rows' relative error ({errs}) > {max_rel_error}"


def choose_rank(q: Tensor, k: Tensor, v: Tensor, sample: int = 64, min_len: int = 1024,
                max_rel_error: float = 0.05, scale: float | None = None,
                methods: tuple[str, ...] = LOW_RANK_METHODS,
                speed: Callable[[LowRank], Speed] | None = None) -> tuple[LowRank | None, dict]:
    """The policy: (the low-rank path and its landmarks, or None for the exact path; what it saw:
    ``estimate``, the landmarks ``tried``, ``sample_rel_error`` per method tried, and ``speed``, the
    ``Speed`` of the path whose error passed, or None). ``methods``: the low-rank paths to try, in order.
    ``speed(path)``: times the path against the exact one; the path is taken only where it is faster
    (None: by its error alone). See the module docstring."""
    bad = [m for m in methods if m not in LOW_RANK_METHODS]
    if not methods or bad:
        raise ValueError(f"methods must be a non-empty tuple of: {', '.join(LOW_RANK_METHODS)}; got {methods!r}")
    seen: dict = {"estimate": None, "tried": None, "sample_rel_error": {}, "speed": None}
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
        norm = torch.linalg.vector_norm(exact).clamp_min(1e-30)
        passed = None
        for method in methods:
            choice = LowRank(method, r)
            approx = low_rank_attention(q.detach(), k.detach(), v.detach(), choice, scale=scale, rows=idx).float()
            err = (torch.linalg.vector_norm(approx - exact) / norm).item()
            seen["sample_rel_error"][method] = err
            if err <= max_rel_error:
                passed = choice
                break
    if passed is None or speed is None:
        return passed, seen
    seen["speed"] = speed(passed)  # outside no_grad: a training call's speed is its forward's and backward's
    return (passed if seen["speed"].low_rank_ms < seen["speed"].exact_ms else None), seen
