"""The static KV cache a decoding attention layer owns (gpt-fast's pattern): preallocated (B, G, max, D)
buffers written in place at the tokens' positions, so a decode step has the same shapes at every position."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    """Keys and values of every position a layer has seen, (B, G, M, D) each, and the causal mask's rows."""

    def __init__(self, batch: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str | None = None, window: int | None = None):
        super().__init__()
        shape = (batch, kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # the mask's rows are made per call from the positions: an (M, M) table would be a GiB a layer at 32K
        self.window = window
        self.register_buffer("slots", torch.arange(max_seq_len, device=device), persistent=False)

    def update(self, pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, G, S, D) at positions ``pos`` (S,); return the whole cache (B, G, M, D) x 2."""
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))
        return self.k, self.v

    def state_bytes(self) -> int:
        """The bytes this layer keeps between tokens: its keys, values and the positions its masks are made from."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def mask(self, pos: Tensor) -> Tensor:
        """(S, M) bool: the query at position p sees the cache's positions 0..p (later ones are zeros or stale),
        with a sliding window only the last ``window`` of them."""
        seen = self.slots[None, :] <= pos[:, None]
        if self.window is not None:
            seen &= self.slots[None, :] > pos[:, None] - self.window
        return seen
