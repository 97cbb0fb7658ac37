"""Rotary embedding of q and k in one launch, and fused QK-RMSNorm + rotary embedding (G4-T2, G4-C1).

q: (B, S, Hq, D), k: (B, S, Hkv, D) (GQA: Hq a multiple of Hkv, or any counts), any strides over
B, S and H with the head dim contiguous, so a (B, H, S, D) tensor passes as ``t.transpose(1, 2)``
and a slice of a fused qkv projection passes without a copy. cos, sin: (S, D/2) from one shared
cache (``reference.rope_cache``), rotate-half convention. One program rotates every q and k head
of TOKENS consecutive tokens, a (TOKENS, heads, D/2) tile per half, reading each cos/sin row
once; TOKENS is tuned on the head counts and head dim (many tokens per program when a token
has few heads: one token of 4 heads x 128 is 1 KB, too little work for a program). Head counts
and head dim are compile-time constants (one compile per attention shape of a model), so the
head and head-dim masks fold away.

QK-norm (Qwen3, OLMo2): RMSNorm over the head dim of each head with weights (D,), then the
rotation. Its backward is a persistent grid (PPS programs per SM, tuned) whose programs accumulate the two weight gradients
in fp32 registers; the partials are summed in fp32 and cast once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.partials import sum_partials
from adaattn.kernels.checks import check_rope_args
from adaattn.kernels.runtime import (TunedLaunch, last_dim_contiguous, needs_grad, programs_for, refuse_grad_leaves,
                                     tuned)

def _prune(configs, key, kwargs):
    """Keep tiles of TOKENS x heads x D/2 of at most 4096 elements per q or k half."""
    heads = max(kwargs["BLOCK_QH"], kwargs["BLOCK_KH"]) * kwargs["BLOCK_D2"]
    keep = [c for c in configs if c.kwargs["TOKENS"] * heads <= 4096 or c.kwargs["TOKENS"] == 1]
    return keep or configs[:1]


_CONFIGS = tuned([triton.Config({"TOKENS": t}, num_warps=w) for t, w in
                  [(4, 4), (1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (4, 8), (8, 4), (8, 8),
                   (16, 4), (16, 8), (32, 4), (32, 8)]])
# QK-norm backward: also its persistent grid, PPS programs per SM
_BWD_CONFIGS = tuned([triton.Config({"TOKENS": t, "PPS": p}, num_warps=w) for t, w in
                      [(4, 4), (1, 4), (2, 4), (4, 8), (8, 4), (8, 8), (16, 8)] for p in (1, 2, 4, 8)])
MAX_PPS = max(c.kwargs["PPS"] for c in _BWD_CONFIGS)


@triton.jit
def _tokens(t0, n_tokens, seq_len, TOKENS: tl.constexpr):
    """Tokens t0 .. t0 + TOKENS - 1 of the flattened (B, S): (batch index, position, in range).
    Divided in int32 (B * S < 2**31; an int64 division is dozens of instructions), widened after."""
    tok = t0 + tl.arange(0, TOKENS)
    return (tok // seq_len).to(tl.int64), (tok % seq_len).to(tl.int64), tok < n_tokens


@triton.jit
def _angles(cos_ptr, sin_ptr, s, tmask, cs_rs, half, BLOCK_D2: tl.constexpr):
    """The tokens' cos and sin rows, fp32, as (TOKENS, 1, BLOCK_D2) to broadcast over heads."""
    d = tl.arange(0, BLOCK_D2)
    mask = tmask[:, None] & (d < half)[None, :]
    off = s[:, None] * cs_rs + d[None, :]
    cos = tl.load(cos_ptr + off, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + off, mask=mask, other=0.0).to(tl.float32)
    return cos[:, None, :], sin[:, None, :]


@triton.jit
def _heads(b, s, tmask, sb, ss, sh, n_heads, half, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Offsets of the first halves of the tokens' heads (TOKENS, BLOCK_H, BLOCK_D2) for strides
    (sb, ss, sh), and their mask."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D2)
    off = (b * sb + s * ss)[:, None, None] + (h * sh)[None, :, None] + d[None, None, :]
    mask = tmask[:, None, None] & (h < n_heads)[None, :, None] & (d < half)[None, None, :]
    return off, mask


@triton.jit
def _load_halves(x_ptr, off, mask, half):
    x1 = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + off + half, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_rotated(o_ptr, off, mask, half, x1, x2, cos, sin):
    tl.store(o_ptr + off, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + off + half, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(x_ptr, o_ptr, b, s, tmask, x_sb, x_ss, x_sh, o_sb, o_ss, o_sh, cos, sin, n_heads, half,
                  BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr):
    off, mask = _heads(b, s, tmask, x_sb, x_ss, x_sh, n_heads, half, BLOCK_H, BLOCK_D2)
    x1, x2 = _load_halves(x_ptr, off, mask, half)
    o_off, _ = _heads(b, s, tmask, o_sb, o_ss, o_sh, n_heads, half, BLOCK_H, BLOCK_D2)
    _store_rotated(o_ptr, o_off, mask, half, x1, x2, cos, sin)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
                 q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh, cs_rs,
                 n_tokens, seq_len, n_qh: tl.constexpr, n_kh: tl.constexpr, half: tl.constexpr,
                 BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D2: tl.constexpr, BACKWARD: tl.constexpr,
                 TOKENS: tl.constexpr):
    b, s, tmask = _tokens(tl.program_id(0) * TOKENS, n_tokens, seq_len, TOKENS)
    cos, sin = _angles(cos_ptr, sin_ptr, s, tmask, cs_rs, half, BLOCK_D2)
    if BACKWARD:  # the rotation is orthogonal: its transpose is the rotation by -angle
        sin = -sin
    _rotate_heads(q_ptr, qo_ptr, b, s, tmask, q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh, cos, sin, n_qh, half,
                  BLOCK_QH, BLOCK_D2)
    _rotate_heads(k_ptr, ko_ptr, b, s, tmask, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh, cos, sin, n_kh, half,
                  BLOCK_KH, BLOCK_D2)


@triton.jit
def _norm_rotate_heads(x_ptr, o_ptr, w_ptr, rstd_ptr, b, s, tok, tmask, x_sb, x_ss, x_sh, o_sb, o_ss, o_sh,
                       cos, sin, n_heads, half, eps, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr):
    off, mask = _heads(b, s, tmask, x_sb, x_ss, x_sh, n_heads, half, BLOCK_H, BLOCK_D2)
    x1, x2 = _load_halves(x_ptr, off, mask, half)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D2)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * half) + eps)  # (T, H)
    tl.store(rstd_ptr + tok[:, None] * n_heads + h[None, :], rstd, mask=tmask[:, None] & (h < n_heads)[None, :])
    w1 = tl.load(w_ptr + d, mask=d < half, other=0.0).to(tl.float32)[None, None, :]
    w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)[None, None, :]
    o_off, _ = _heads(b, s, tmask, o_sb, o_ss, o_sh, n_heads, half, BLOCK_H, BLOCK_D2)
    _store_rotated(o_ptr, o_off, mask, half, x1 * rstd[:, :, None] * w1, x2 * rstd[:, :, None] * w2, cos, sin)


@triton.jit
def _qk_norm_rope_fwd_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, wq_ptr, wk_ptr, rq_ptr, rk_ptr, cos_ptr, sin_ptr,
                             q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh, cs_rs,
                             n_tokens, seq_len, n_qh: tl.constexpr, n_kh: tl.constexpr, half: tl.constexpr, eps,
                             BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D2: tl.constexpr,
                             TOKENS: tl.constexpr):
    t0 = tl.program_id(0) * TOKENS
    tok = t0.to(tl.int64) + tl.arange(0, TOKENS)
    b, s, tmask = _tokens(t0, n_tokens, seq_len, TOKENS)
    cos, sin = _angles(cos_ptr, sin_ptr, s, tmask, cs_rs, half, BLOCK_D2)
    _norm_rotate_heads(q_ptr, qo_ptr, wq_ptr, rq_ptr, b, s, tok, tmask, q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh,
                       cos, sin, n_qh, half, eps, BLOCK_QH, BLOCK_D2)
    _norm_rotate_heads(k_ptr, ko_ptr, wk_ptr, rk_ptr, b, s, tok, tmask, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh,
                       cos, sin, n_kh, half, eps, BLOCK_KH, BLOCK_D2)


@triton.jit
def _norm_rotate_heads_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, b, s, tok, tmask,
                           dy_sb, dy_ss, dy_sh, x_sb, x_ss, x_sh, dx_sb, dx_ss, dx_sh, cos, sin,
                           n_heads, half, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr):
    """dx for the tokens' heads; returns their contribution to dw (two halves, (BLOCK_D2,) each)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D2)
    off, mask = _heads(b, s, tmask, dy_sb, dy_ss, dy_sh, n_heads, half, BLOCK_H, BLOCK_D2)
    dy1, dy2 = _load_halves(dy_ptr, off, mask, half)
    # undo the rotation: gradient with respect to the normalised head
    dn1 = dy1 * cos + dy2 * sin
    dn2 = dy2 * cos - dy1 * sin
    off, _ = _heads(b, s, tmask, x_sb, x_ss, x_sh, n_heads, half, BLOCK_H, BLOCK_D2)
    x1, x2 = _load_halves(x_ptr, off, mask, half)
    hmask = tmask[:, None] & (h < n_heads)[None, :]
    rstd = tl.load(rstd_ptr + tok[:, None] * n_heads + h[None, :], mask=hmask, other=0.0)[:, :, None]
    w1 = tl.load(w_ptr + d, mask=d < half, other=0.0).to(tl.float32)[None, None, :]
    w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)[None, None, :]
    xh1 = x1 * rstd
    xh2 = x2 * rstd
    wdy1 = w1 * dn1
    wdy2 = w2 * dn2
    c = ((tl.sum(wdy1 * xh1, axis=2) + tl.sum(wdy2 * xh2, axis=2)) / (2 * half))[:, :, None]
    off, _ = _heads(b, s, tmask, dx_sb, dx_ss, dx_sh, n_heads, half, BLOCK_H, BLOCK_D2)
    tl.store(dx_ptr + off, ((wdy1 - xh1 * c) * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + off + half, ((wdy2 - xh2 * c) * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
    return tl.sum(tl.sum(dn1 * xh1, axis=1), axis=0), tl.sum(tl.sum(dn2 * xh2, axis=1), axis=0)


@triton.jit
def _qk_norm_rope_bwd_kernel(dq_ptr, dk_ptr, q_ptr, k_ptr, wq_ptr, wk_ptr, rq_ptr, rk_ptr, cos_ptr, sin_ptr,
                             dxq_ptr, dxk_ptr, dwq_ptr, dwk_ptr,
                             dq_sb, dq_ss, dq_sh, dk_sb, dk_ss, dk_sh, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,
                             dxq_sb, dxq_ss, dxq_sh, dxk_sb, dxk_ss, dxk_sh, cs_rs,
                             n_tokens, seq_len, n_qh: tl.constexpr, n_kh: tl.constexpr, half: tl.constexpr,
                             BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D2: tl.constexpr,
                             TOKENS: tl.constexpr):
    pid = tl.program_id(0)
    per_program = tl.cdiv(tl.cdiv(n_tokens, TOKENS), tl.num_programs(0))
    d = tl.arange(0, BLOCK_D2)
    dwq1 = tl.zeros((BLOCK_D2,), dtype=tl.float32)
    dwq2 = tl.zeros((BLOCK_D2,), dtype=tl.float32)
    dwk1 = tl.zeros((BLOCK_D2,), dtype=tl.float32)
    dwk2 = tl.zeros((BLOCK_D2,), dtype=tl.float32)
    for i in range(0, per_program):
        t0 = (pid * per_program + i) * TOKENS
        tok = t0.to(tl.int64) + tl.arange(0, TOKENS)
        b, s, tmask = _tokens(t0, n_tokens, seq_len, TOKENS)
        cos, sin = _angles(cos_ptr, sin_ptr, s, tmask, cs_rs, half, BLOCK_D2)
        a1, a2 = _norm_rotate_heads_bwd(dq_ptr, q_ptr, wq_ptr, rq_ptr, dxq_ptr, b, s, tok, tmask,
                                        dq_sb, dq_ss, dq_sh, q_sb, q_ss, q_sh, dxq_sb, dxq_ss, dxq_sh,
                                        cos, sin, n_qh, half, BLOCK_QH, BLOCK_D2)
        dwq1 += a1
        dwq2 += a2
        a1, a2 = _norm_rotate_heads_bwd(dk_ptr, k_ptr, wk_ptr, rk_ptr, dxk_ptr, b, s, tok, tmask,
                                        dk_sb, dk_ss, dk_sh, k_sb, k_ss, k_sh, dxk_sb, dxk_ss, dxk_sh,
                                        cos, sin, n_kh, half, BLOCK_KH, BLOCK_D2)
        dwk1 += a1
        dwk2 += a2
    row = pid.to(tl.int64) * 2 * half
    tl.store(dwq_ptr + row + d, dwq1, mask=d < half)
    tl.store(dwq_ptr + row + half + d, dwq2, mask=d < half)
    tl.store(dwk_ptr + row + d, dwk1, mask=d < half)
    tl.store(dwk_ptr + row + half + d, dwk2, mask=d < half)


# --------------------------------------------------------------------------- launchers


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _check(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_rope_args(q, k, cos, sin)
    cos, sin = last_dim_contiguous(cos), last_dim_contiguous(sin)
    if cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    return last_dim_contiguous(q), last_dim_contiguous(k), cos, sin


def _example(op: str):
    """Tuning problems of one head shape: q (1, T, Hq, D), k (1, T, Hkv, D), T tokens for q's bytes."""
    def example(key: tuple, nbytes: int, device: torch.device):
        n_qh, n_kh, half, q_dtype, k_dtype, cs_dtype = key[:6]
        tokens = max(1, nbytes // (n_qh * 2 * half * q_dtype.itemsize))
        q = torch.randn(1, tokens, n_qh, 2 * half, device=device, dtype=q_dtype)
        k = torch.randn(1, tokens, n_kh, 2 * half, device=device, dtype=k_dtype)
        angle = 6.283 * torch.rand(tokens, half, device=device)  # a true rotation: in place, values stay put
        cos, sin = angle.cos().to(cs_dtype), angle.sin().to(cs_dtype)
        if op == "rope":
            inplace = key[6]
            return lambda: rope_apply(q, k, cos, sin, inplace=inplace)
        wq, wk = (torch.ones(2 * half, device=device, dtype=dt) for dt in key[6:8])
        if op == "qk_fwd":
            return lambda: qk_norm_rope_fwd(q, k, wq, wk, cos, sin, 1e-6)
        dq, dk = torch.randn_like(q, dtype=key[8]), torch.randn_like(k, dtype=key[9])
        rq = torch.ones(tokens * n_qh, device=device, dtype=torch.float32)
        rk = torch.ones(tokens * n_kh, device=device, dtype=torch.float32)
        return lambda: qk_norm_rope_bwd(dq, dk, q, k, wq, wk, rq, rk, cos, sin)

    return example


_rope = TunedLaunch(_rope_kernel, _CONFIGS, _example("rope"), _prune)
_qk_fwd = TunedLaunch(_qk_norm_rope_fwd_kernel, _CONFIGS, _example("qk_fwd"), _prune)
_qk_bwd = TunedLaunch(_qk_norm_rope_bwd_kernel, _BWD_CONFIGS, _example("qk_bwd"), _prune, grid_only=("PPS",))


def _key(q: Tensor, k: Tensor, cos: Tensor, *more: Tensor) -> tuple:
    """What the tuning is keyed on: head counts, half the head dim, and the dtypes (the rotary
    embedding adds whether it writes in place)."""
    return (q.shape[2], k.shape[2], q.shape[3] // 2, q.dtype, k.dtype, cos.dtype, *(t.dtype for t in more))


def _token_grid(n_tokens: int):
    return lambda meta: (triton.cdiv(n_tokens, meta["TOKENS"]),)


def _blocks(q: Tensor, k: Tensor) -> dict[str, int]:
    return _pow2_blocks(q.shape[2], k.shape[2], q.shape[3] // 2)


@functools.cache
def _pow2_blocks(n_qh: int, n_kh: int, half: int) -> dict[str, int]:
    """Padded tile sizes of a head shape (cached: three next_power_of_2 calls are a few us of host time)."""
    return dict(BLOCK_QH=triton.next_power_of_2(n_qh), BLOCK_KH=triton.next_power_of_2(n_kh),
                BLOCK_D2=triton.next_power_of_2(half))


def rope_apply(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool = False,
               inplace: bool = False) -> tuple[Tensor, Tensor]:
    """Rotated copies of q and k (the inverse rotation when ``backward``), in q's and k's layouts;
    with ``inplace``, q and k themselves, rotated where they lie (each element is read and written by
    one program, loads before stores). Autograd does not see the in-place write: ``rope_triton`` does."""
    if inplace and (q.stride(-1) != 1 or k.stride(-1) != 1):
        raise ValueError(f"in-place rotary embedding needs q and k with a contiguous head dim; got strides "
                         f"{q.stride()} and {k.stride()}")
    q, k, cos, sin = _check(q, k, cos, sin)
    qo, ko = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    B, S, Hq, D = q.shape
    if q.numel() and k.numel():
        # in place is its own tuning key: the config that is fastest out of place was seen to be
        # slower in place at large sizes
        _rope((*_key(q, k, cos), inplace), _token_grid(B * S), q, k, qo, ko, cos, sin, *_strides(q), *_strides(k),
              *_strides(qo), *_strides(ko), cos.stride(0), B * S, S, Hq, k.shape[2], D // 2, **_blocks(q, k),
              BACKWARD=backward)
    return qo, ko


def qk_norm_rope_fwd(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                     eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q_out, k_out, rstd_q (B*S*Hq,) fp32, rstd_k (B*S*Hkv,) fp32)."""
    q, k, cos, sin = _check(q, k, cos, sin)
    B, S, Hq, D = q.shape
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (D,) or w.device != q.device:
            raise ValueError(f"{name} must be ({D},) on {q.device}; got {tuple(w.shape)} on {w.device}")
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    rq = torch.empty(B * S * Hq, dtype=torch.float32, device=q.device)
    rk = torch.empty(B * S * k.shape[2], dtype=torch.float32, device=q.device)
    if q.numel() and k.numel():
        _qk_fwd(_key(q, k, cos, q_weight, k_weight), _token_grid(B * S),
                q, k, qo, ko, q_weight, k_weight, rq, rk, cos, sin, *_strides(q), *_strides(k), *_strides(qo),
                *_strides(ko), cos.stride(0), B * S, S, Hq, k.shape[2], D // 2, eps, **_blocks(q, k))
    return qo, ko, rq, rk


def qk_norm_rope_bwd(dq: Tensor, dk: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                     rq: Tensor, rk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q, k, cos, sin = _check(q, k, cos, sin)
    dq, dk = last_dim_contiguous(dq), last_dim_contiguous(dk)
    B, S, Hq, D = q.shape
    dxq, dxk = torch.empty_like(q), torch.empty_like(k)
    if not (q.numel() and k.numel()):
        return dxq, dxk, torch.zeros_like(q_weight), torch.zeros_like(k_weight)
    # partial rows for the largest grid; the chosen grid's programs each write their row, only those are summed
    rows = programs_for(B * S, q.device, MAX_PPS)
    dwq = torch.empty((rows, D), dtype=torch.float32, device=q.device)
    dwk = torch.empty((rows, D), dtype=torch.float32, device=q.device)
    def programs(meta) -> int:  # never more programs than blocks of tokens: each writes a partial row
        return programs_for(triton.cdiv(B * S, meta["TOKENS"]), q.device, meta["PPS"])

    meta = _qk_bwd(_key(q, k, cos, q_weight, k_weight, dq, dk), lambda meta: (programs(meta),),
                   dq, dk, q, k, q_weight, k_weight, rq, rk, cos, sin, dxq, dxk, dwq, dwk,
                   *_strides(dq), *_strides(dk), *_strides(q), *_strides(k), *_strides(dxq), *_strides(dxk),
                   cos.stride(0), B * S, S, Hq, k.shape[2], D // 2, **_blocks(q, k))
    n = programs(meta)
    return dxq, dxk, sum_partials(dwq[:n], q_weight.dtype), sum_partials(dwk[:n], k_weight.dtype)


# --------------------------------------------------------------------------- autograd: eager and compiled


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(cos, sin)
        return rope_apply(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor):
        cos, sin = ctx.saved_tensors
        return *rope_apply(dq, dk, cos, sin, backward=True), None, None


class RopeInplaceFunction(RopeFunction):
    """Rotates q and k in place (marked dirty: autograd refuses leaves that require grad and catches
    later use of a tensor saved before the rotation); the backward is RopeFunction's, out of place."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(cos, sin)
        rope_apply(q, k, cos, sin, inplace=True)
        ctx.mark_dirty(q, k)
        return q, k


class QKNormRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps):
        qo, ko, rq, rk = qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, eps)
        ctx.save_for_backward(q, k, q_weight, k_weight, rq, rk, cos, sin)
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        q, k, q_weight, k_weight, rq, rk, cos, sin = ctx.saved_tensors
        return *qk_norm_rope_bwd(dq, dk, q, k, q_weight, k_weight, rq, rk, cos, sin), None, None, None


@torch.library.custom_op("adaattn::rope", mutates_args=())
def rope_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    return rope_apply(q, k, cos, sin, backward)


@rope_op.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    # the layouts rope_apply gives (a head dim not contiguous is copied first): inductor plans buffers from these
    return torch.empty_like(last_dim_contiguous(q)), torch.empty_like(last_dim_contiguous(k))


def _rope_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[2], inputs[3])


def _rope_backward(ctx, dq: Tensor, dk: Tensor):
    cos, sin = ctx.saved_tensors
    return *rope_op(dq, dk, cos, sin, True), None, None, None


rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


@torch.library.custom_op("adaattn::qk_norm_rope_fwd", mutates_args=())
def qk_norm_rope_fwd_op(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                        eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, eps)


@qk_norm_rope_fwd_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps):
    B, S, Hq, _ = q.shape
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)
    return (torch.empty_like(q), torch.empty_like(k), q.new_empty(B * S * Hq, dtype=torch.float32),
            q.new_empty(B * S * k.shape[2], dtype=torch.float32))


@torch.library.custom_op("adaattn::qk_norm_rope_bwd", mutates_args=())
def qk_norm_rope_bwd_op(dq: Tensor, dk: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                        rq: Tensor, rk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return qk_norm_rope_bwd(dq, dk, q, k, q_weight, k_weight, rq, rk, cos, sin)


@qk_norm_rope_bwd_op.register_fake
def _(dq, dk, q, k, q_weight, k_weight, rq, rk, cos, sin):
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(q_weight), torch.empty_like(k_weight)


def _qk_setup(ctx, inputs, output) -> None:
    q, k, q_weight, k_weight, cos, sin, _ = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, output[2], output[3], cos, sin)


def _qk_backward(ctx, dq, dk, _drq, _drk):
    q, k, q_weight, k_weight, rq, rk, cos, sin = ctx.saved_tensors
    return *qk_norm_rope_bwd_op(dq, dk, q, k, q_weight, k_weight, rq, rk, cos, sin), None, None, None


qk_norm_rope_fwd_op.register_autograd(_qk_backward, setup_context=_qk_setup)


def rope_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """Rotated q and k; ``inplace`` rotates q and k themselves (no new (B, S, H, D) tensors, as Liger's
    and flash-attn's in-place rotary do) and returns them."""
    if torch.compiler.is_compiling():
        qo, ko = rope_op(q, k, cos, sin, False)
        return (q.copy_(qo), k.copy_(ko)) if inplace else (qo, ko)
    if not needs_grad(q, k):
        if not inplace:
            return rope_apply(q, k, cos, sin)
        rope_apply(q, k, cos, sin, inplace=True)
        # a Triton store bumps no version counter: do it, so a graph that saved q or k sees the change
        torch.autograd.graph.increment_version([t for t in (q, k) if not t.is_inference()])
        return q, k
    if inplace:
        refuse_grad_leaves("rope", q=q, k=k)
    return (RopeInplaceFunction if inplace else RopeFunction).apply(q, k, cos, sin)


def qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    if torch.compiler.is_compiling():
        return qk_norm_rope_fwd_op(q, k, q_weight, k_weight, cos, sin, eps)[:2]
    if not needs_grad(q, k, q_weight, k_weight):
        return qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, eps)[:2]
    return QKNormRopeFunction.apply(q, k, q_weight, k_weight, cos, sin, eps)
