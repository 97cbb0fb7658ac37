"""The kernels' arguments, checked at the public functions (Triton launch or PyTorch reference alike): a
TypeError or ValueError naming the argument and the expected shape or dtype, before any work. Pure Python
on shapes and dtypes: under torch.compile they run once, at trace time."""

from __future__ import annotations

import math

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, t: Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16; got {t.dtype}")


def check_eps(eps: float) -> None:
    # comparisons, not math.isfinite: a compiled caller's float attribute may be traced as a symbolic float
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"eps must be a finite number > 0; got {eps!r}")


def check_rms_norm_args(x: Tensor, weight: Tensor) -> None:
    """What the Triton launcher needs (``rms_norm._check``)."""
    check_float("x", x)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be (hidden,) = ({x.shape[-1] if x.dim() else '?'},) for x of shape "
                         f"{tuple(x.shape)}; got {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")


def check_rms_norm(x: Tensor, weight: Tensor, eps: float) -> None:
    check_rms_norm_args(x, weight)
    check_float("weight", weight)
    check_eps(eps)


def check_swiglu(a: Tensor, b: Tensor) -> None:
    check_float("a", a)  # b: the same dtype, below
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"swiglu needs a and b of one shape, dtype and device; got {tuple(a.shape)} {a.dtype} "
                         f"{a.device} and {tuple(b.shape)} {b.dtype} {b.device}")


def check_rope_args(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """What the Triton launcher needs (``rope._check``): q (B, S, Hq, D), k (B, S, Hkv, D), cos and sin
    (>= S, D/2)."""
    check_float("q", q)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, S, H, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    (bq, sq, _, dq), (bk, sk, _, dk) = q.shape, k.shape
    if (bq, sq, dq) != (bk, sk, dk) or q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must share B, S, D, dtype, "
                         "device (layout (B, S, H, D))")
    if dq % 2:
        raise ValueError(f"rotary embedding needs an even head dim; got {dq}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != dq // 2 or cos.shape[0] < sq:
        raise ValueError(f"cos and sin must be (>= S, D/2) = (>= {sq}, {dq // 2}); got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if cos.device != q.device:
        raise ValueError(f"cos on {cos.device}, q on {q.device}")


def check_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """``check_rope_args`` and what the reference path needs too: float tables, k's heads dividing q's. SDPA's
    (B, H, S, D) layout has the same rank: where the table's length is q's dim 2 but not its dim 1, the caller
    most likely passed that layout."""
    check_rope_args(q, k, cos, sin)
    for name, t in (("cos", cos), ("sin", sin)):
        check_float(name, t)
    (_, sq, hq, _), hk = q.shape, k.shape[2]
    if hq % hk:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's ({hk}) (layout (B, S, H, D))")
    if cos.shape[0] == hq and hq != sq and cos.shape[0] != sq and hq == hk:
        raise ValueError(f"cos and sin have {cos.shape[0]} rows, the size of q's dim 2, not of dim 1 (S = {sq}): q and "
                         "k look like SDPA's (B, H, S, D) layout; apply_rope takes (B, S, H, D) (q.transpose(1, 2)); "
                         "for a table longer than S that happens to have H rows, pass cos[:S] and sin[:S]")


def check_qk_norm(q: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> None:
    D = q.shape[-1]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_float(name, w)
        if w.shape != (D,) or w.device != q.device:
            raise ValueError(f"{name} must be ({D},) on {q.device}; got {tuple(w.shape)} on {w.device}")
    check_eps(eps)


def check_int8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
    check_float("x", x)
    if weight.dtype != torch.int8 or weight.dim() != 2 or not weight.is_contiguous():
        raise TypeError(f"weight must be a contiguous (out, in) int8 tensor; got {weight.dtype} "
                        f"{tuple(weight.shape)}{'' if weight.is_contiguous() else ', not contiguous'}")
    n_out, k_in = weight.shape
    if x.dim() < 1 or x.shape[-1] != k_in:
        raise ValueError(f"x's last dim must be the weight's in_features {k_in}; got x of shape {tuple(x.shape)}")
    for name, t in (("scale", scale), ("bias", bias)):
        if t is not None and (t.shape != (n_out,) or t.dtype not in FLOAT_DTYPES):
            raise ValueError(f"{name} must be a float (out,) = ({n_out},) tensor; got {t.dtype} {tuple(t.shape)}")
