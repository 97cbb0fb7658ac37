"""Guide 003's long-term-memory (LTM) transformer: a dense decoder that reads a long sequence in segments and
keeps, per layer, a memory bank of compressed past segments (``docs/models.md`` says which paper each part
follows).

- Read: a layer's attention attends from the current segment over [its bank's slots ; the segment so far]
  (the slots are past, so every one is visible; the segment is causal). The slots are the layer's own past
  inputs, normalised and projected by the layer's own k and v weights (the Compressive Transformer's design).
- Write: after a segment, each layer's inputs for it are mean-pooled by ``memory_compression`` and projected
  (a learned ``Linear``, initialised to the identity) into segment / c new slots, appended to the bank.
- Slot management: a full bank merges its oldest slots in pairs (``memory_merge``: older memory grows coarser,
  the compression ratio adapting to the context's length) or evicts them (FIFO). ``memory_stats`` reports
  the slots filled, and ``Transformer.reduce_memory_slots`` shrinks the banks of later calls.

Shapes: B batch, S segment tokens, E dim, N slots filled, C the bank's capacity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Compressor(nn.Module):
    """A segment's states (B, S, E) -> S / c slots (B, S / c, E): the mean of each c tokens, projected."""

    def __init__(self, dim: int, rate: int):
        super().__init__()
        self.rate = rate
        self.proj = nn.Linear(dim, dim, bias=False)

    def reset_parameters(self) -> None:
        nn.init.eye_(self.proj.weight)  # a fresh bank holds the pooled states themselves

    def forward(self, x: Tensor) -> Tensor:
        B, S, E = x.shape
        n = S // self.rate  # a last partial segment's remainder tokens write no slot
        pooled = x[:, : n * self.rate].reshape(B, n, self.rate, E).mean(2)
        return self.proj(pooled)


def write(bank: Tensor, new: Tensor, capacity: int, merge: bool) -> Tensor:
    """The bank (B, N, E) with ``new`` (B, n, E) appended, kept to ``capacity`` slots: the oldest 2k slots merged
    into k by pairs (``merge``) or the oldest k dropped, k being the overflow."""
    out = torch.cat([bank, new], dim=1)
    over = out.shape[1] - capacity
    if over <= 0:
        return out
    if not merge or 2 * over > out.shape[1]:  # cannot happen while capacity >= n (the config checks it)
        return out[:, over:]
    oldest = out[:, : 2 * over]
    merged = oldest.unflatten(1, (over, 2)).mean(2)
    return torch.cat([merged, out[:, 2 * over:]], dim=1)


def empty_banks(n_layers: int, batch: int, dim: int, like: Tensor) -> list[Tensor]:
    return [like.new_zeros(batch, 0, dim) for _ in range(n_layers)]


def memory_stats(banks: list[Tensor] | None, capacity: int) -> dict:
    """Slots filled per layer and in all, the capacity, and utilization (filled / capacity, over the layers)."""
    filled = [int(b.shape[1]) for b in banks] if banks else []
    total = sum(filled)
    return {"capacity": capacity, "filled": filled,
            "utilization": total / (capacity * len(filled)) if filled else 0.0,
            "bytes": sum(b.numel() * b.element_size() for b in banks) if banks else 0}


def memory_kv(x: Tensor, weight: Tensor, bias: Tensor | None, H: int, G: int, D: int) -> tuple[Tensor, Tensor]:
    """The slots (B, N, E), normalised by the caller, through a fused qkv projection's k and v rows:
    (B, G, N, D) each."""
    B, N, _ = x.shape
    kv = F.linear(x, weight[H * D:], None if bias is None else bias[H * D:])
    k, v = kv.split([G * D, G * D], dim=-1)
    return k.view(B, N, G, D).transpose(1, 2), v.view(B, N, G, D).transpose(1, 2)


def segment_mask(n_slots: int, S: int, device) -> Tensor:
    """(S, N + S) bool: every slot, then the segment causally."""
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril_()
    return torch.cat([torch.ones(S, n_slots, dtype=torch.bool, device=device), causal], dim=1)


class SegmentCache(nn.Module):
    """An LTM layer's decoding state, of constant size whatever the context and allocated at the bank's capacity C
    from the start, so that a one-token step has the same shapes at every position (one graph; a CUDA graph under
    ``reduce-overhead``):

    - ``keys`` / ``values`` (B, G, C + S, D): the bank's slots' first (the first ``filled`` in use), then the
      current segment's;
    - ``inputs`` (B, S, E): the layer's inputs for the segment, which the compressor writes to the bank once the
      segment is complete; ``bank`` (B, C, E): the slots' states;
    - ``filled``: the slots in use, on the host (the bank is written from the host, once a segment) and on the
      device (``n_slots``, which the step's mask reads); ``seen``: the tokens read so far (decoding goes in order).
    """

    def __init__(self, batch: int, kv_heads: int, segment_len: int, head_dim: int, dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.capacity = capacity
        kv = torch.zeros(batch, kv_heads, capacity + segment_len, head_dim, dtype=dtype, device=device)
        self.register_buffer("keys", kv, persistent=False)
        self.register_buffer("values", torch.zeros_like(kv), persistent=False)
        self.register_buffer("inputs", torch.zeros(batch, segment_len, dim, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("bank", torch.zeros(batch, capacity, dim, dtype=dtype, device=device), persistent=False)
        self.register_buffer("n_slots", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.register_buffer("columns", torch.arange(capacity + segment_len, device=device), persistent=False)
        self.filled = 0
        self.seen = 0

    @property
    def k(self) -> Tensor:
        """The segment's keys (B, G, S, D)."""
        return self.keys[:, :, self.capacity:]

    def update(self, offsets: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write k, v (B, G, n, D) at the segment's ``offsets`` (n,); the keys and values to attend (the bank's
        slots, then the segment's) and the (n, C + S) mask: the slots in use, the segment causally."""
        C = self.capacity
        self.keys.index_copy_(2, offsets + C, k.to(self.keys.dtype))
        self.values.index_copy_(2, offsets + C, v.to(self.values.dtype))
        seg = self.columns - C  # a column's offset in the segment (negative: a slot)
        mask = (self.columns < self.n_slots)[None, :] | ((seg >= 0)[None, :] & (seg[None, :] <= offsets[:, None]))
        return self.keys, self.values, mask

    def memory(self) -> Tensor:
        """The slots in use (B, N, E)."""
        return self.bank[:, : self.filled]

    def set_bank(self, bank: Tensor, k: Tensor, v: Tensor) -> None:
        """The bank's new slots (B, N, E), N <= C, with their keys and values (B, G, N, D)."""
        n = bank.shape[1]
        self.bank[:, :n] = bank.to(self.bank.dtype)
        self.keys[:, :, :n] = k.to(self.keys.dtype)
        self.values[:, :, :n] = v.to(self.values.dtype)
        self.filled = n
        self.n_slots.fill_(n)

    def reset(self) -> None:
        """Forget what was read, in place (a compiled step keeps its buffers): no token seen, no slot in use."""
        self.seen = self.filled = 0
        self.n_slots.zero_()

    def state_bytes(self) -> int:
        """The bytes this layer keeps between tokens: its buffers (the bank's at its capacity)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())
