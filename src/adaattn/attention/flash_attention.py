"""The phase-3 guide's attention names (G2-C1), on this package's parts.

| the guide's name                        | here                                                              |
|-----------------------------------------|-------------------------------------------------------------------|
| ``AdaptiveFlashAttention``              | ``AdaptiveFlashAttention``: AdaAttention made from a config       |
| ``FlashAttentionConfig``                | ``FlashAttentionConfig``: that config, checked when it is made    |
| ``get_flash_statistics()``              | ``AdaptiveFlashAttention.get_flash_statistics``                   |
| ``fused_scaled_dot_product_attention()``| ``fused_scaled_dot_product_attention``: the kernel manager's op   |
| ``memory_efficient_attention()``        | ``chunked.chunked_attention`` (query blocks, constant extra memory)|
| ``AttentionKernelManager``              | ``kernel_manager.AttentionKernelManager``                         |
| ``CUDAManager``                         | ``hardware.HardwareCapabilities``                                 |

The guide's "FlashAttention-first strategy with fallback" is the kernel manager's: it runs the
backend it measured fastest on this machine for the inputs (flash kernels where they win, not
first by rule), and falls back down its ranking when one fails, the reason logged once. So
``enable_flash`` enables the manager, and "flash" in the statistics is a backend that always runs a
fused kernel without the (L, S) score matrix (``backends.FLASH_LIKE``: flash-attn, SDPA's flash,
cuDNN and efficient kernels forced, FlexAttention, xFormers); SDPA's own dispatch is not counted, as
the manager does not see which kernel it picks. The guide's layer is "full attention", so the
config's ``rank_mode`` is "full" (AdaAttention's own default is "auto").
"""

from __future__ import annotations

import dataclasses
import functools
import math

from torch import Tensor

from adaattn.attention.ada import AdaAttention, shared_kernel_manager
from adaattn.attention.args import check_dropout, check_policy
from adaattn.attention.backends import BACKENDS, FLASH_LIKE, sdpa_path
from adaattn.attention.chunked import check_mask, check_qkv
from adaattn.attention.chunked import chunked_attention as memory_efficient_attention
from adaattn.attention.hardware import CUDAManager
from adaattn.attention.kernel_manager import AttentionKernelManager

__all__ = ["AdaptiveFlashAttention", "CUDAManager", "FlashAttentionConfig", "fused_scaled_dot_product_attention",
           "memory_efficient_attention"]


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """How an ``AdaptiveFlashAttention`` computes attention. Checked when made: a bad value is a
    ValueError that names the field and what it allows."""

    enable_flash: bool = True  # through the kernel manager (False: PyTorch's SDPA, no measurement)
    precision_mode: str = "auto"  # fp32, bf16, fp16, fp8 (where its guard allows), or auto (by hardware, escalated)
    rank_mode: str | int = "full"  # full (exact), auto (low-rank where measured faster and accurate), or a rank
    dropout: float = 0.0  # the kernel manager's backends take none: a training call with dropout runs SDPA
    backends: tuple[str, ...] | None = None  # the manager's candidates; None: the hardware's, the shared manager

    def __post_init__(self) -> None:
        if not isinstance(self.enable_flash, bool):
            raise ValueError(f"enable_flash must be True or False; got {self.enable_flash!r}")
        check_policy(self.precision_mode, self.rank_mode, "auto", self.dropout)
        if self.backends is not None:
            if isinstance(self.backends, str) or not self.backends:
                raise ValueError(f"backends must be a non-empty sequence of backend names (allowed: "
                                 f"{', '.join(BACKENDS)}); got {self.backends!r}")
            unknown = [b for b in self.backends if b not in BACKENDS]
            if unknown:
                raise ValueError(f"backends: unknown {', '.join(map(repr, unknown))}; allowed: {', '.join(BACKENDS)}")
            object.__setattr__(self, "backends", tuple(self.backends))

    def manager(self) -> AttentionKernelManager:
        """The kernel manager this config runs: the shared one (what AdaAttention uses by default), or one
        per ``backends`` in the process."""
        if self.backends is None:
            return shared_kernel_manager()
        return _manager(self.backends)


@functools.cache
def _manager(backends: tuple[str, ...]) -> AttentionKernelManager:
    return AttentionKernelManager(backends=list(backends))


FIELDS = tuple(f.name for f in dataclasses.fields(FlashAttentionConfig))


class AdaptiveFlashAttention(AdaAttention):
    """The guide's attention layer: AdaAttention (a drop-in for ``nn.MultiheadAttention``) made from a
    ``FlashAttentionConfig``; the config's fields may also be given as keywords, over the config's::

        attn = AdaptiveFlashAttention(embed_dim=512, num_heads=8, precision_mode="auto", enable_flash=True)
        out, _ = attn(x, x, x, need_weights=False)
        attn.get_flash_statistics()["flash_ratio"]
    """

    def __init__(self, embed_dim: int, num_heads: int, config: FlashAttentionConfig | None = None, *,
                 bias: bool = True, kdim: int | None = None, vdim: int | None = None, batch_first: bool = False,
                 num_kv_heads: int | None = None, device=None, dtype=None, **fields):
        if config is not None and not isinstance(config, FlashAttentionConfig):
            raise ValueError(f"config must be a FlashAttentionConfig; got {type(config).__name__}")
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            raise ValueError(f"unknown argument(s) {', '.join(unknown)}; AdaptiveFlashAttention takes embed_dim, "
                             f"num_heads, config, bias, kdim, vdim, batch_first, num_kv_heads, device, dtype and "
                             f"the config's fields: {', '.join(FIELDS)}")
        config = dataclasses.replace(config or FlashAttentionConfig(), **fields)
        super().__init__(embed_dim, num_heads, dropout=config.dropout, bias=bias, kdim=kdim, vdim=vdim,
                         batch_first=batch_first, num_kv_heads=num_kv_heads, enable_gpu_optimization=config.enable_flash,
                         precision_mode=config.precision_mode, rank_mode=config.rank_mode,
                         kernel_manager=config.manager(), device=device, dtype=dtype)
        self.config = config

    def get_flash_statistics(self) -> dict:
        """The guide's FlashAttention usage: calls through a flash-like kernel (``FLASH_LIKE``) and through
        the manager's other backends, ``flash_ratio``, calls per backend and the fallbacks with their
        reasons. The counts are the kernel manager's, over every module that shares it (a config with
        its own ``backends`` shares one manager per such config); calls that do not go
        through it (``enable_flash=False``, a low-rank path, dropout in training) are not among them
        (``get_statistics()['ranks']`` counts every call)."""
        stats = self.get_statistics()
        flash = sum(n for backend, n in stats["calls"].items() if backend in FLASH_LIKE)
        return {"flash_calls": flash, "other_calls": stats["total_calls"] - flash, "flash_ratio": stats["flash_ratio"],
                "calls": stats["calls"], "fallbacks": stats["fallbacks"]}


def fused_scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                       dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                       manager: AttentionKernelManager | None = None) -> Tensor:
    """``F.scaled_dot_product_attention``'s call (its shapes and mask convention: a bool mask marks the
    keys a query MAY attend; GQA where key and value have fewer heads) through the kernel manager
    (``manager``, else the shared one): the backend it measured fastest for these inputs on this
    machine, falling back down its ranking where one fails. With ``dropout_p`` > 0 SDPA runs it (the
    manager's backends take no dropout)."""
    check_qkv(query, key, value)
    if not (query.is_floating_point() and query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query, key and value must share one floating dtype; got {query.dtype}, {key.dtype}, "
                         f"{value.dtype}")
    if not query.device == key.device == value.device:
        raise ValueError(f"query, key and value must be on one device; got {query.device}, {key.device}, {value.device}")
    check_mask(attn_mask, is_causal)
    check_dropout(dropout_p, "dropout_p")
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    if dropout_p:
        return sdpa_path(query, key, value, attn_mask, is_causal, scale, dropout_p)
    out, _ = (manager or shared_kernel_manager())(query, key, value, attn_mask, is_causal, scale)
    return out

