"""Fused kernels (G4-T1, G4-T2, G4-C1): RMSNorm, SwiGLU, rotary embedding, QK-RMSNorm + rotary; and the INT8
weight-only linear of decoding (G3-T3).

Each public function runs the Triton kernels (forward and backward) when they are on and can run
on the inputs' device, and the plain PyTorch reference otherwise; ``get_kernel_status()`` says
which and why. Under ``torch.compile`` the kernels are ``torch.library`` custom ops, so a model
using them compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from adaattn.kernels.checks import check_int8_linear, check_qk_norm, check_rms_norm, check_rope, check_swiglu
from adaattn.kernels.reference import int8_linear_ref, qk_norm_rope_ref, rms_norm_ref, rope_cache, rope_ref, swiglu_ref
from adaattn.kernels.runtime import (ENV_DISABLE, get_kernel_status, needs_grad, refuse_grad_leaves, set_use_triton_kernels,
                                     use_triton)

try:  # the kernels need Triton; without it every function below runs its reference
    from adaattn.kernels.rms_norm import rms_norm_triton
    from adaattn.kernels.rope import qk_norm_rope_triton, rope_triton
    from adaattn.kernels.swiglu import swiglu_triton
    from adaattn.kernels.int8_linear import int8_linear_triton
except ImportError:  # get_kernel_status() reports the import error
    rms_norm_triton = swiglu_triton = rope_triton = qk_norm_rope_triton = int8_linear_triton = None

__all__ = [
    "ENV_DISABLE", "get_kernel_status", "set_use_triton_kernels", "rms_norm", "swiglu", "apply_rope",
    "qk_norm_rope", "int8_linear", "rope_cache", "rms_norm_ref", "swiglu_ref", "rope_ref", "qk_norm_rope_ref",
    "int8_linear_ref",
]


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim; weight (hidden,)."""
    check_rms_norm(x, weight, eps)
    if use_triton(x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b (a: gate, b: up)."""
    check_swiglu(a, b)
    if use_triton(a, b):
        return swiglu_triton(a, b)
    return swiglu_ref(a, b)


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """Rotary embedding of q (B, S, Hq, D) and k (B, S, Hkv, D) from one (S, D/2) cos/sin table.

    ``inplace=True`` rotates q and k themselves and returns them (no new q- and k-sized tensors);
    autograd refuses it on leaves that require grad, as for any in-place op."""
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be True or False; got {inplace!r}")
    check_rope(q, k, cos, sin)
    if use_triton(q, k, cos, sin):
        return rope_triton(q, k, cos, sin, inplace)
    qo, ko = rope_ref(q, k, cos[: q.shape[1]], sin[: q.shape[1]])
    if not inplace:
        return qo, ko
    if not torch.compiler.is_compiling():  # compiled, autograd refuses a leaf while tracing, before any write
        refuse_grad_leaves("rope", q=q, k=k)
    return q.copy_(qo), k.copy_(ko)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                 eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Per-head RMSNorm of q and k (weights (D,)), then the rotary embedding, in one kernel."""
    check_rope(q, k, cos, sin)
    check_qk_norm(q, q_weight, k_weight, eps)
    if use_triton(q, k, q_weight, k_weight, cos, sin):
        return qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps)
    return qk_norm_rope_ref(q, k, q_weight, k_weight, cos[: q.shape[1]], sin[: q.shape[1]], eps)


def int8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = (x @ weight^T) * scale (+ bias): weight (out, in) int8, one scale per output channel. The kernel
    reads the int8 bytes (decoding's rows); a call that autograd records takes the reference (the kernel
    builds no gradient)."""
    check_int8_linear(x, weight, scale, bias)
    tensors = (x, weight, scale) if bias is None else (x, weight, scale, bias)
    if use_triton(*tensors) and not needs_grad(x):
        return int8_linear_triton(x, weight, scale, bias)
    return int8_linear_ref(x, weight, scale, bias)

