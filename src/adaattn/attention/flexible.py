"""flexible_attention: one call, several attention backends, GQA without copies where the backend allows.

Backends: "flash" (flash-attn package; GQA native), "xformers" (memory_efficient_attention; kv
heads expanded as a broadcast view), "sdpa" (PyTorch SDPA with ``enable_gqa``: no expansion),
"math" (matmul-softmax-matmul; kv heads expanded). "auto" takes the first of flash, xformers,
sdpa that can run the inputs. A forced backend that cannot run raises and says why; it never
falls back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from adaattn.attention.providers import PROVIDERS

BACKENDS = ("auto", "flash", "xformers", "sdpa", "math")
_backend = "auto"


def set_attention_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of: {', '.join(BACKENDS)}")
    global _backend
    _backend = name


def get_attention_backend() -> str:
    return _backend


def _why_not(backend: str, q: Tensor) -> str | None:
    """Why ``backend`` cannot run these inputs here, or None."""
    if backend in ("sdpa", "math"):
        return None
    if q.device.type != "cuda":
        return f"{backend} needs CUDA tensors; got {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{backend} needs fp16 or bf16; got {q.dtype}"
    provider = PROVIDERS["flash_attn" if backend == "flash" else "xformers_cutlass"]
    return provider.unavailable("cuda")


def _expand_kv(k: Tensor, groups: int) -> Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * groups, S, D) as a broadcast view where possible."""
    if groups == 1:
        return k
    b, h, s, d = k.shape
    return k[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def flexible_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, backend: str | None = None,
                       scale: float | None = None) -> Tensor:
    """q (B, Hq, S, D), k and v (B, Hkv, S, D) with Hq a multiple of Hkv -> (B, Hq, S, D)."""
    backend = backend or _backend
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of: {', '.join(BACKENDS)}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q must be (B, Hq, S, D) and k, v (B, Hkv, S, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if backend == "auto":
        backend = next(b for b in ("flash", "xformers", "sdpa") if _why_not(b, q) is None)
    elif reason := _why_not(backend, q):
        raise RuntimeError(f"attention backend {backend!r} was forced but cannot run: {reason}")
    groups = q.shape[1] // k.shape[1]
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=groups > 1)
    if backend == "math":
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
        scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        if is_causal:
            s_q, s_k = q.shape[2], k.shape[2]
            mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu_(s_k - s_q + 1)
            scores = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D): both packages' layout
    if backend == "flash":
        from flash_attn import flash_attn_func

        return flash_attn_func(qt, kt, vt, causal=is_causal, softmax_scale=scale).transpose(1, 2)
    import xformers.ops as xops

    kt, vt = (_expand_kv(t.transpose(1, 2), groups).transpose(1, 2) for t in (kt, vt))
    bias = xops.LowerTriangularMask() if is_causal else None
    return xops.memory_efficient_attention(qt, kt, vt, attn_bias=bias, scale=scale).transpose(1, 2)
