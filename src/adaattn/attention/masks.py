"""``nn.MultiheadAttention``'s masks as one SDPA mask: ``attn_mask`` (L, S) or (B * heads, L, S), bool (True:
may NOT attend) or additive float, ``key_padding_mask`` (B, S), and ``is_causal``."""

from __future__ import annotations

import torch
from torch import Tensor


def merge_masks(attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool, B: int, H: int, L: int,
                S: int, device) -> tuple[Tensor | None, bool]:
    """One SDPA-style mask (bool True = may attend, or additive float) broadcastable to (B, H, L, S),
    and whether is_causal still has to be passed (True only when no other mask exists)."""
    masks = []
    if attn_mask is not None:
        if attn_mask.dim() == 2 and attn_mask.shape == (L, S):
            masks.append(attn_mask[None, None])
        elif attn_mask.dim() == 3 and attn_mask.shape == (B * H, L, S):
            masks.append(attn_mask.view(B, H, L, S))
        else:
            raise ValueError(f"attn_mask must be (L, S) = ({L}, {S}) or (B * num_heads, L, S) = "
                             f"({B * H}, {L}, {S}); got {tuple(attn_mask.shape)}")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (B, S):
            raise ValueError(f"key_padding_mask must be (B, S) = ({B}, {S}); got {tuple(key_padding_mask.shape)}")
        masks.append(key_padding_mask[:, None, None, :])
    if not masks:
        return None, is_causal
    if is_causal:
        masks.append(torch.ones(L, S, dtype=torch.bool, device=device).triu_(1)[None, None])
    allowed: Tensor | None = None
    additive: Tensor | None = None
    for m in masks:
        if m.dtype == torch.bool:
            allowed = ~m if allowed is None else allowed & ~m
        elif m.is_floating_point():
            additive = m.float() if additive is None else additive + m.float()
        else:
            raise TypeError(f"masks must be bool or float; got {m.dtype}")
    if additive is None:
        return allowed, False
    if allowed is not None:
        additive = additive.masked_fill(~allowed, float("-inf"))
    return additive, False
