"""The weight format the decode projections read (``QuantWeight``), and the references they must match: the
model's own ops in order, in the model's dtype (``kernels.decode_proj``, ``kernels.decode_attention_out``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from adaattn.kernels.reference import rms_norm_ref, rope_ref


@dataclass(frozen=True)
class QuantWeight:
    """A linear layer's weight as the kernels read it: ``data`` (N, K) 16-bit or int8, or (N, K / 2) uint8 for
    INT4; ``scale`` (N,) for INT8, (N, K / group) for INT4, with ``offset`` (N, K / group)."""

    data: Tensor
    bits: int = 16
    scale: Tensor | None = None
    offset: Tensor | None = None
    group: int = 0

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1] * (2 if self.bits == 4 else 1)

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The (N, K) weight the kernels multiply by, in ``dtype`` (the references' weight)."""
        if self.bits == 16:
            return self.data.to(dtype)
        if self.bits == 8:
            return (self.data.float() * self.scale.float()[:, None]).to(dtype)
        low, high = (self.data & 15).float(), (self.data >> 4).float()
        q = torch.stack((low, high), dim=-1).reshape(self.data.shape[0], -1)  # (N, K)
        q = q.view(q.shape[0], -1, self.group) * self.scale.float()[..., None] + self.offset.float()[..., None]
        return q.reshape(q.shape[0], -1).to(dtype)


def _quant(data: Tensor, scale: Tensor | None, offset: Tensor | None, group: int) -> QuantWeight:
    """The weight format from the data's dtype: int8 INT8, uint8 INT4 (two a byte), else 16- or 32-bit."""
    bits = 8 if data.dtype == torch.int8 else 4 if data.dtype == torch.uint8 else 16
    return QuantWeight(data, bits, scale, offset, group)




def _linear_ref(x: Tensor, w: QuantWeight) -> Tensor:
    return x @ w.dense(x.dtype).t()


def _norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of the (fp32) residual stream, in the model's dtype as its RMSNorm returns it."""
    return rms_norm_ref(x, weight, eps).to(weight.dtype)


def norm_qkv_rope_ref(x: Tensor, norm: Tensor, eps: float, w: QuantWeight, cos: Tensor, sin: Tensor, pos: Tensor,
                      k_cache: Tensor, v_cache: Tensor, n_heads: int) -> Tensor:
    B, (G, D) = x.shape[0], k_cache.shape[1:4:2]
    qkv = _linear_ref(_norm_ref(x, norm, eps), w).float().view(B, 1, -1, D)  # (B, S=1, heads, D)
    q, k = rope_ref(qkv[:, :, :n_heads], qkv[:, :, n_heads:n_heads + G], cos[pos], sin[pos])
    k_cache[:, :, pos] = k[:, 0, :, None].to(k_cache.dtype)
    v_cache[:, :, pos] = qkv[:, 0, n_heads + G:, None].to(v_cache.dtype)
    return q[:, 0].to(norm.dtype)


def norm_swiglu_ref(x: Tensor, norm: Tensor, eps: float, w: QuantWeight) -> Tensor:
    gate, up = _linear_ref(_norm_ref(x, norm, eps), w).float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(norm.dtype)


def add_linear_ref(residual: Tensor, x: Tensor, w: QuantWeight) -> None:
    residual += _linear_ref(x, w).to(residual.dtype)


def norm_linear_ref(x: Tensor, norm: Tensor | None, eps: float, w: QuantWeight, dtype: torch.dtype) -> Tensor:
    return _linear_ref(_norm_ref(x, norm, eps) if norm is not None else x.to(dtype), w).to(dtype)
