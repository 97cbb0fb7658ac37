"""A decode step's attention and its output projection in two launches (issue 66): the split-K attention's
partials (``kernels.decode_attention``), then one kernel that combines each head's chunks and adds that head's
share of the output projection into the fp32 residual stream.

The output projection is a sum over heads: out[n] = sum_h W[n, h D : (h + 1) D] . o_h. A program owns one (sequence,
heads, block of output rows): it combines the head's partials (a few chunks of D floats, in L2), then multiplies them
by its weight tile and adds the result into the residual with fp32 atomics, as ``add_linear_``'s K splits do. A
program takes ``HEADS_PER_PROGRAM`` heads of one kv group (an output row then gets H / HP atomic adds), and each
block of rows repeats their combine (a few KB of L2 reads) in exchange for the launch the separate combine kernel
costs. The weight tile is read before waiting on the attention (it depends on no earlier kernel), so under
Programmatic Dependent Launch its loads overlap the partials' kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.decode_attention import check_decode_attention, decode_attention_ref, launch_partials
from adaattn.kernels.decode_proj import _check, _i8_f32
from adaattn.kernels.quant_weight import QuantWeight, _quant, add_linear_ref
from adaattn.kernels.runtime import interpreter, sm_count, use_triton


@triton.jit
def _heads_out(pacc_ptr, row, smask, wt, lsum, cols, D: tl.constexpr, HP: tl.constexpr, W: tl.constexpr,
               ODT: tl.constexpr):
    """Columns ``cols`` (W of each head's D) of HP heads' attention outputs from their chunks' partials (``row``
    (BLOCK_S, HP), ``wt`` a chunk's weight), rounded to the model's dtype as the separate combine stores them, in
    fp32, heads after one another: (HP W,)."""
    acc = tl.load(pacc_ptr + row[:, :, None] * D + cols[None, None, :], mask=smask[:, None, None], other=0.0)
    o = tl.sum(acc * wt[:, :, None], axis=0) / lsum[:, None]  # (HP, W)
    return tl.reshape(o.to(ODT).to(tl.float32), (HP * W,))


@triton.jit
def _combine_out_kernel(pacc_ptr, pm_ptr, pl_ptr, w_ptr, s_ptr, z_ptr, res_ptr, H, SPLITS, N, K, sr,
                        R: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, BITS: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, ODT: tl.constexpr,
                        PDL: tl.constexpr):
    pid, nt = tl.program_id(0), tl.program_id(1)
    b, h0 = pid // (H // HP), (pid % (H // HP)) * HP  # HP consecutive heads of one kv group: W[:, h0 D : (h0 + HP) D]
    n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    KW: tl.constexpr = HP * D  # the program's columns of the weight
    NG: tl.constexpr = KW // GROUP if GROUP < KW else 1  # INT4 groups in them
    if BITS == 4:  # byte j of a row holds columns 2j (low nibble) and 2j + 1 (high)
        j = tl.arange(0, KW // 2)
        w = tl.load(w_ptr + n[:, None] * (K // 2) + h0 * (D // 2) + j[None, :], mask=nmask[:, None], other=0)
        gi = (h0 * D) // GROUP + tl.arange(0, NG)
        sc = tl.load(s_ptr + n[:, None] * (K // GROUP) + gi[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
        zo = tl.load(z_ptr + n[:, None] * (K // GROUP) + gi[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
    else:
        kk = tl.arange(0, KW)
        w = tl.load(w_ptr + n[:, None] * K + h0 * D + kk[None, :], mask=nmask[:, None], other=0)
    if PDL:  # the weights above are no earlier kernel's output; the partials are
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    g, r0 = h0 // R, h0 % R
    s = tl.arange(0, BLOCK_S)
    smask = s < SPLITS
    row = ((b * (H // R) + g) * SPLITS + s)[:, None] * R + r0 + tl.arange(0, HP)[None, :]  # (BLOCK_S, HP)
    m = tl.load(pm_ptr + row, mask=smask[:, None], other=float("-inf"))
    lsum = tl.load(pl_ptr + row, mask=smask[:, None], other=0.0)
    wt = tl.where(m > float("-inf"), tl.exp(m - tl.max(m, axis=0)[None, :]), 0.0)  # an empty chunk weighs nothing
    lsum = tl.sum(lsum * wt, axis=0)  # (HP,)
    if BITS == 4:  # sum(q o) a group times its scale, plus its offset times sum(o): the codes never scaled
        half = tl.arange(0, D // 2)
        oe = _heads_out(pacc_ptr, row, smask, wt, lsum, 2 * half, D, HP, D // 2, ODT)
        oo = _heads_out(pacc_ptr, row, smask, wt, lsum, 2 * half + 1, D, HP, D // 2, ODT)
        t = (w & 15).to(tl.float32) * oe[None, :] + (w >> 4).to(tl.float32) * oo[None, :]
        tg = tl.sum(tl.reshape(t, (BLOCK_N, NG, KW // 2 // NG)), axis=2)
        og = tl.sum(tl.reshape(oe + oo, (1, NG, KW // 2 // NG)), axis=2)
        y = tl.sum(tg * sc + og * zo, axis=1)
    else:
        o = _heads_out(pacc_ptr, row, smask, wt, lsum, tl.arange(0, D), D, HP, D, ODT)
        y = tl.sum((_i8_f32(w) if BITS == 8 else w.to(tl.float32)) * o[None, :], axis=1)
        if BITS == 8:  # one scale a row of the weight: on the sum
            y *= tl.load(s_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.atomic_add(res_ptr + b * sr + n, y, mask=nmask, sem="relaxed")


# One head a program. In the H200 A/B of llama_1b's step (notebook, 2026-11-29) one head beat two, four and eight:
# the atomic adds it multiplies cost less than the programs (the parallelism) that bigger programs give up. The
# kernel takes any HP dividing the group's heads (tests run 2).
HEADS_PER_PROGRAM = 1


# At most 128 output rows a program: in the H200 A/B of llama_1b's bf16 step (notebook, 2026-11-29) 128 beat 256
# and 64; the 256-row tile holds twice the weights in registers for the same atomic adds.
MAX_ROWS = 128


def _block_n(programs: int, N: int, device: torch.device) -> int:
    """Output rows a program: about two programs an SM, 32 to ``MAX_ROWS`` rows."""
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    return max(32, min(MAX_ROWS, triton.next_power_of_2(triton.cdiv(programs * N, 2 * sms))))


def attention_out_fwd(residual: Tensor, q: Tensor, k: Tensor, v: Tensor, length: Tensor, data: Tensor,
                      scale: Tensor | None, offset: Tensor | None, group: int, attn_scale: float | None, pdl: bool,
                      length_offset: int) -> None:
    B, H, D = q.shape
    R = H // k.shape[1]
    hp = HEADS_PER_PROGRAM
    if R % hp:
        raise ValueError(f"attention_out_: HEADS_PER_PROGRAM={hp} must divide the {R} heads of a kv group")
    w = _quant(data, scale, offset, group)
    pdl = pdl and not interpreter()
    pacc, pm, pl, splits = launch_partials(q, k, v, length, None, attn_scale, pdl, length_offset)
    N, K = w.out_features, w.in_features
    block_n = _block_n(B * H // hp, N, q.device)
    data, s_arg, z_arg = w.data, w.scale if w.scale is not None else w.data, w.offset if w.offset is not None \
        else w.data
    extra = {"launch_pdl": True} if pdl else {}
    _combine_out_kernel[(B * H // hp, triton.cdiv(N, block_n))](
        pacc, pm, pl, data, s_arg, z_arg, residual, H, splits, N, K, residual.stride(0),
        R=R, D=D, HP=hp, BITS=w.bits, GROUP=w.group or D, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        BLOCK_N=block_n, ODT=tl.float32 if q.dtype == torch.float32 else tl.bfloat16 if q.dtype == torch.bfloat16
        else tl.float16, PDL=pdl, num_warps=8 if block_n * hp * D >= 16384 else 4, **extra)


@torch.library.custom_op("adaattn::attention_out", mutates_args=("residual",))
def _attention_out_op(residual: Tensor, q: Tensor, k: Tensor, v: Tensor, length: Tensor, data: Tensor,
                      scale: Tensor | None, offset: Tensor | None, group: int, attn_scale: float | None, pdl: bool,
                      length_offset: int) -> None:
    attention_out_fwd(residual, q, k, v, length, data, scale, offset, group, attn_scale, pdl, length_offset)


@_attention_out_op.register_fake
def _(residual, q, k, v, length, data, scale, offset, group, attn_scale, pdl, length_offset):
    return None


def attention_out_ref(residual: Tensor, q: Tensor, k: Tensor, v: Tensor, length: Tensor, w: QuantWeight,
                      attn_scale: float | None = None, length_offset: int = 0) -> None:
    """The model's ops in order: the attention's output in q's dtype, its projection added to the residual."""
    o = decode_attention_ref(q, k, v, length, None, attn_scale, length_offset)
    add_linear_ref(residual, o.reshape(q.shape[0], -1), w)


def attention_out_(residual: Tensor, q: Tensor, k: Tensor, v: Tensor, length: Tensor, w: QuantWeight,
                   attn_scale: float | None = None, pdl: bool = False, length_offset: int = 0) -> None:
    """residual (B, N) fp32 += attention(q (B, H, D) over k, v (B, G, M, D)'s first ``length + length_offset``
    positions) (B, H D) @ weight^T, in place: ``decode_attention`` and ``add_linear_`` in two launches."""
    check_decode_attention(q, k, v, length, None)
    B, H, D = q.shape
    _check("attention_out_", q.reshape(B, H * D), w)
    if residual.dtype != torch.float32 or tuple(residual.shape) != (B, w.out_features):
        raise ValueError(f"attention_out_: the residual must be fp32 ({B}, {w.out_features}); got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    if w.bits == 4 and w.group % D and D % w.group:
        raise ValueError(f"attention_out_: INT4 groups of {w.group} must divide or be divided by the head dim {D}")
    if not use_triton(q, k, v, length):
        return attention_out_ref(residual, q, k, v, length, w, attn_scale, length_offset)
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    q = q if q.stride(-1) == 1 else q.contiguous()
    op = _attention_out_op if torch.compiler.is_compiling() else attention_out_fwd
    op(residual, q, k, v, length, w.data, w.scale, w.offset, w.group, attn_scale, pdl, length_offset)


__all__ = ["attention_out_", "attention_out_ref"]
