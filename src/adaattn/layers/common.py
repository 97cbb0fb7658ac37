"""RMSNorm, SwiGLU MLP and a rotary embedding whose cos/sin cache one instance shares with every layer."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from adaattn.kernels import apply_rope, qk_norm_rope, rms_norm, rope_cache, swiglu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one fused projection (one GEMM, strided halves)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.gate_up = nn.Linear(dim, 2 * hidden_dim, bias=bias, device=device, dtype=dtype)
        self.down = nn.Linear(hidden_dim, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).split(self.hidden_dim, dim=-1)  # views: row stride 2 * hidden_dim
        return self.down(swiglu(gate, up))


class RotaryEmbedding(nn.Module):
    """One cos/sin cache (max_seq_len, head_dim/2) fp32 for every layer that holds this instance.

    Pass the same instance to all attention layers (G4-T1 "shared RoPE cache"); the cache grows on
    demand (to the next power of two) when a longer sequence arrives.
    """

    def __init__(self, head_dim: int, max_seq_len: int = 2048, base: float = 10000.0, device=None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding needs an even head_dim; got {head_dim}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1; got {max_seq_len}")
        self.head_dim, self.base = head_dim, base
        cos, sin = rope_cache(max_seq_len, head_dim, base, device=device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.cos.shape[0]

    def cache_bytes(self) -> int:
        return self.cos.nbytes + self.sin.nbytes

    def ensure(self, seq_len: int) -> None:
        """Grow the cache to hold ``seq_len`` positions (call before compiling for longer inputs)."""
        if seq_len > self.max_seq_len:
            if torch.compiler.is_compiling():
                raise RuntimeError(f"RotaryEmbedding cache holds {self.max_seq_len} positions, input has {seq_len}: "
                                   f"call .ensure({seq_len}) before compiling")
            n = 1 << (seq_len - 1).bit_length()
            self.cos, self.sin = rope_cache(n, self.head_dim, self.base, device=self.cos.device)

    def forward(self, q: Tensor, k: Tensor, inplace: bool = False) -> tuple[Tensor, Tensor]:
        """q (B, S, Hq, D), k (B, S, Hkv, D) -> rotated copies, or q and k rotated in place."""
        self.ensure(q.shape[1])
        return apply_rope(q, k, self.cos, self.sin, inplace)

    def with_qk_norm(self, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                     eps: float = 1e-6) -> tuple[Tensor, Tensor]:
        """Per-head RMSNorm of q and k, then the rotation, in one kernel."""
        self.ensure(q.shape[1])
        return qk_norm_rope(q, k, q_weight, k_weight, self.cos, self.sin, eps)
