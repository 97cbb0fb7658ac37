"""Chunked (memory-efficient) attention: query blocks against all keys, softmax in fp32.

Extra memory is one (B, H, chunk, S_k) block of scores at a time, whatever the query length, so
8K+ token sequences run on a CPU or a GPU without the (L, S_k) score matrix of every head. Exact:
each block's softmax sees every key of its rows. The guide's ``memory_efficient_attention``.

Shapes and masks follow ``torch.nn.functional.scaled_dot_product_attention``: q (B, Hq, L, D),
k and v (B, Hkv, S, D) with Hq a multiple of Hkv (GQA through a broadcast, no copy of k or v);
``attn_mask`` a bool mask (True = may attend) or an additive float mask broadcastable to
(B, Hq, L, S); ``is_causal`` aligns query i with key i (top left, as SDPA). A row with no key to
attend to returns zeros.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _block_mask(attn_mask: Tensor | None, start: int, stop: int) -> Tensor | None:
    if attn_mask is None:
        return None
    return attn_mask[..., start:stop, :] if attn_mask.shape[-2] != 1 else attn_mask


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """SDPA's shapes: q (B, Hq, L, D), k and v (B, Hkv, S, D), Hq a multiple of Hkv (a ValueError otherwise)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q must be (B, Hq, L, D) and k, v (B, Hkv, S, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")


def check_mask(attn_mask: Tensor | None, is_causal: bool) -> None:
    """A mask or causal, not both (a ValueError otherwise, as ``scaled_dot_product_attention``)."""
    if is_causal and attn_mask is not None:
        raise ValueError("pass either attn_mask or is_causal, not both (as scaled_dot_product_attention)")


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
                      scale: float | None = None, chunk_size: int = 1024) -> Tensor:
    check_qkv(q, k, v)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    check_mask(attn_mask, is_causal)
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1 / math.sqrt(D) if scale is None else scale
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*attn_mask.shape[:-2], attn_mask.shape[-2], S)
        while attn_mask.dim() < 4:
            attn_mask = attn_mask[None]
        # (B|1, Hq|1, L|1, S) -> (B|1, Hkv|1, G|1, L|1, S) to meet the grouped scores
        b, h = attn_mask.shape[:2]
        attn_mask = attn_mask.reshape(b, 1, 1, *attn_mask.shape[2:]) if h == 1 else \
            attn_mask.reshape(b, Hkv, G, *attn_mask.shape[2:])
    qg = q.reshape(B, Hkv, G, L, D)
    kt, vg = k[:, :, None].transpose(-2, -1), v[:, :, None]  # (B, Hkv, 1, D, S), (B, Hkv, 1, S, D)
    out = torch.empty_like(qg)
    keys = torch.arange(S, device=q.device)
    for start in range(0, L, chunk_size):
        stop = min(start + chunk_size, L)
        scores = (qg[..., start:stop, :] @ kt).float() * scale  # (B, Hkv, G, c, S)
        m = _block_mask(attn_mask, start, stop)
        if is_causal:
            rows = torch.arange(start, stop, device=q.device)
            m = keys[None, :] <= rows[:, None]
        if m is not None:
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no allowed key -> zeros
        out[..., start:stop, :] = (probs.to(v.dtype) @ vg)
    return out.reshape(B, Hq, L, D)


memory_efficient_attention = chunked_attention  # the guide's name
