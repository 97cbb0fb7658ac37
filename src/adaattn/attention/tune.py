"""Ahead-of-time tuning (``adaattn tune``): rank the attention backends for a list of shapes into the kernel
manager's persisted cache, so that a compiled model's first trace finds every decision made.

What persists is the backend ranking per signature (it depends on the machine, not on the data). The
precision and rank policies look at the inputs (guards, sampled rows): they decide on the model's own
eager call or ``AdaAttention.tune`` in the process that compiles.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from adaattn.attention.ada import ENV_CACHE, AdaAttention
from adaattn.attention.kernel_manager import AttentionKernelManager

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MASKS = ("none", "causal", "padding")  # padding: a key padding mask (the "mask" signatures)
MODES = {"fwd": (False,), "fwd_bwd": (True,), "both": (False, True)}  # the grad modes tuned


@dataclass(frozen=True)
class Shape:
    batch: int
    q_len: int
    k_len: int

    @staticmethod
    def parse(text: str) -> Shape:
        """"BxS" (self-attention) or "BxLxS" (L queries over S keys)."""
        parts = text.lower().split("x")
        if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"shape {text!r} must be BxS or BxLxS with positive integers, e.g. 8x4096 or 1x1x4096")
        b, *lens = (int(p) for p in parts)
        return Shape(b, lens[0], lens[-1])


def cache_path(path: str | os.PathLike | None) -> Path:
    """The cache to fill: ``path``, else ``$ADAATTN_KERNEL_CACHE`` (what AdaAttention's shared manager reads)."""
    chosen = path or os.environ.get(ENV_CACHE)
    if not chosen:
        raise ValueError(f"no cache file: pass --cache PATH or set {ENV_CACHE} (the file AdaAttention's shared "
                         "kernel manager reads)")
    return Path(chosen)


def tune_shapes(embed_dim: int, heads: int, shapes: list[Shape], cache: str | os.PathLike, *, kv_heads: int | None = None,
                dtype: str = "bf16", mask: str = "none", mode: str = "both", device: str | None = None) -> list[dict]:
    """Rank the backends of every (shape, grad mode) signature into ``cache``: one row per signature with its
    ranking, the median GPU time per backend (ms) and the seconds it took. Every argument is checked first."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of: {', '.join(DTYPES)}")
    if mask not in MASKS:
        raise ValueError(f"mask {mask!r} is not one of: {', '.join(MASKS)}")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of: {', '.join(MODES)}")
    if not shapes:
        raise ValueError("shapes: give at least one BxS or BxLxS")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"device {device!r} is not one of: cpu{', cuda' if torch.cuda.is_available() else ''}")
    manager = AttentionKernelManager(cache_path=cache)
    # precision fixed to dtype: the signatures are those of a model computing in it (auto's choice on the GPU)
    module = AdaAttention(embed_dim, heads, batch_first=True, num_kv_heads=kv_heads, precision_mode=dtype,
                          rank_mode="full",
                          kernel_manager=manager, device=device, dtype=DTYPES[dtype])
    rows = []
    for shape in shapes:
        x = torch.randn(shape.batch, shape.q_len, embed_dim, device=device, dtype=DTYPES[dtype])
        kv = x if shape.k_len == shape.q_len else torch.randn(shape.batch, shape.k_len, embed_dim, device=device,
                                                              dtype=DTYPES[dtype])
        pad = None
        if mask == "padding":
            pad = torch.zeros(shape.batch, shape.k_len, dtype=torch.bool, device=device)
            pad[:, -max(1, shape.k_len // 8):] = True
        for grad in MODES[mode]:
            before = set(manager.rankings)
            t0 = time.perf_counter()
            module.tune(x, kv, kv, key_padding_mask=pad, is_causal=mask == "causal", grad=grad)
            new = [k for k in manager.rankings if k not in before]
            for key in new or [None]:
                rows.append({"shape": shape, "grad": grad, "signature": key or "(already in the cache)",
                             "ranking": manager.rankings.get(key, []), "ms": manager.times_ms.get(key, {}),
                             "seconds": time.perf_counter() - t0})
    return rows
