"""Float64 attention reference: the single source of truth for accuracy checks (G1-T1, G1-T2)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, chunk: int = 1024) -> Tensor:
    """softmax(q k^T / sqrt(d)) v in float64, over (B, H, S, D) inputs; returns float64.

    Query rows are processed ``chunk`` at a time so the S x S score matrix never exists whole:
    at S=16384, H=16 it would be 34 GB in float64.
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"expected (B, H, S, D) q/k/v with matching B, H, D; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    q64, k64, v64 = q.double(), k.double(), v.double()
    s_q, s_k = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    cols = torch.arange(s_k, device=q.device)
    for start in range(0, s_q, chunk):
        stop = min(start + chunk, s_q)
        scores = torch.matmul(q64[..., start:stop, :], k64.transpose(-2, -1)) * scale  # (B, H, c, S_k)
        if causal:
            # top-left aligned causal mask, as SDPA's is_causal
            rows = torch.arange(start, stop, device=q.device)[:, None]
            scores.masked_fill_(cols[None, :] > rows, float("-inf"))
        out[..., start:stop, :] = torch.matmul(torch.softmax(scores, dim=-1), v64)
    return out
