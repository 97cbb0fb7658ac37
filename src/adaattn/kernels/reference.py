"""Plain PyTorch references of the fused kernels: what a model runs without them (G4-T2 "PyTorch").

Statistics and rotations are computed in fp32 and the result cast back to the input dtype, as
the Llama / Qwen code in Hugging Face Transformers does. Layout of q and k: (B, S, H, D); cos and
sin: (S, D/2) fp32, the rotate-half convention (first half of the head dim paired with the second).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _up(t: Tensor) -> Tensor:
    """fp32 for 16-bit inputs; float64 stays float64 (the accuracy reference)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    xf = _up(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * _up(weight)
    return y.to(x.dtype)


def swiglu_ref(a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b, in fp32, cast back."""
    return (F.silu(_up(a)) * _up(b)).to(a.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, S, H, D); cos, sin: (S, D/2)."""
    xf = _up(x)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = _up(cos[:, None, :]), _up(sin[:, None, :])  # (S, 1, D/2): broadcast over heads
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary embedding of q (B, S, Hq, D) and k (B, S, Hkv, D) from one cos/sin table."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope_ref(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                     eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """RMSNorm over the head dim of every q and k head (QK-norm), then the rotary embedding."""
    return _rotate(rms_norm_ref(q, q_weight, eps), cos, sin), _rotate(rms_norm_ref(k, k_weight, eps), cos, sin)


def rope_cache(seq_len: int, head_dim: int, base: float = 10000.0, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin: (seq_len, head_dim/2) fp32, inv_freq_i = base^(-2i/head_dim)."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim; got {head_dim}")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq_len, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def int8_linear_ref(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """INT8 weight-only linear: the (out, in) int8 weight cast to x's dtype, the per-channel scale on the output."""
    y = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)
