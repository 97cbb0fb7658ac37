"""The projections of a decode step, each one kernel with what surrounds it fused in (issue 66).

A decode step of a small model reads every weight once; at batch 1 it is a chain of GEMVs, each a few
microseconds, so the kernels between them (norms, RoPE, cache writes, residual adds, SwiGLU) and the gaps
between launches cost as much as the weights' bytes. One kernel per projection, as the fastest public
CUDA-graph decoders are built (four a layer; with the attention's two, ``kernels.decode_attention``, a layer of
``models.decode_step`` is six launches):

- ``norm_qkv_rope``: RMSNorm of the residual stream, the packed q/k/v projection, RoPE on q and k, k and v
  written into the layer's cache at the step's position, q returned (B, H, D). A program computes rows
  j and j + D/2 of one head (the pairs RoPE rotates), so the rotation needs nothing from another program;
- ``norm_swiglu``: RMSNorm, the packed gate/up projection, silu(gate) * up;
- ``add_linear``: a projection added into the fp32 residual stream in place, split over K across programs
  (each adds its partial with an fp32 atomic): enough programs to fill the GPU for any shape, no
  reduction kernel, the residual add for free;
- ``norm_linear``: RMSNorm and a projection (the LM head).

The norm is recomputed by every program from the row it reads anyway (a row of 2K values from L2), the
price of not launching it. Weights are 16-bit (``nn.Linear``), INT8 with a scale per output channel, or INT4
in groups of K with a scale and an offset per group (two values a byte, low nibble first), dequantized in
registers: the kernels read the packed bytes. One row (GEMV) is fp32 multiply-adds, the INT8 and INT4 codes
made fp32 by their bits, not by the conversion unit (slow on Hopper); more rows run on tensor
cores (rows padded to 16), fp32 accumulation; with Programmatic Dependent Launch (``pdl=True``, Hopper and
newer) each kernel launches while the one before it drains, issues the loads of its first weights (which no
kernel writes) and waits (``griddepcontrol.wait``) only before reading its inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.quant_weight import (QuantWeight, _quant, add_linear_ref, norm_linear_ref,
                                          norm_qkv_rope_ref, norm_swiglu_ref)
from adaattn.kernels.runtime import interpreter, sm_count

STORE, ADD, SWIGLU, ROPE = 0, 1, 2, 3  # the epilogues
_STORE, _ADD, _SWIGLU, _ROPE = (tl.constexpr(e) for e in (STORE, ADD, SWIGLU, ROPE))  # the same, inside kernels
ROPE_ROWS = 16  # rows of a head's half a RoPE program computes with tensor cores (a divisor of D / 2)


@triton.jit
def _x_tile(x_ptr, nw_ptr, m, k, mmask, kmask, sx, rstd, NORM: tl.constexpr):
    """Rows m, columns k of the activations, RMS-normalised as the model's RMSNorm does (fp32 statistics, the
    product cast to the model's dtype), in fp32."""
    xv = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
    if NORM:
        nw = tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        xv = (xv.to(tl.float32) * rstd[:, None] * nw[None, :]).to(nw_ptr.dtype.element_ty)
    return xv.to(tl.float32)


@triton.jit
def _dot(acc, xv, w, FP32: tl.constexpr):
    """acc + xv @ w^T on tensor cores; fp32 exactly (not TF32) for fp32 models and the interpreter, whose
    reduced-precision tl.dot is wrong."""
    if FP32:
        return tl.dot(xv, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(xv.to(w.dtype), tl.trans(w), acc)


@triton.jit
def _i8_f32(w):
    """int8 -> fp32 without the conversion unit (Hopper's I2F issues at an eighth of the FMA rate, about the
    rate the GEMV's own bytes arrive): w + 128 in the low bits of 2^23's float, then 2^23 + 128 taken off.
    Exact for every int8."""
    return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _nib_f32(c):
    """A 4-bit code c as the fp32 1 + c / 16, c placed in the mantissa of 1.0: no conversion unit, exact."""
    return ((c.to(tl.int32) << 19) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_dense(p, s, z, DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Codes p (BLOCK_N, BLOCK_K / 2) of one nibble, their groups' scales and offsets (BLOCK_N, BLOCK_K / GROUP)
    -> weights (BLOCK_N, BLOCK_K / 2) in DT."""
    q = tl.reshape(p.to(tl.float32), (BLOCK_N, BLOCK_K // GROUP, GROUP // 2))
    return tl.reshape(q * s[:, :, None] + z[:, :, None], (BLOCK_N, BLOCK_K // 2)).to(DT)


@triton.jit
def _wload(w_ptr, n, nmask, k0, k_hi, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows n, columns k0 .. k0 + BLOCK_K (INT4: the bytes that hold them). Apart from the arithmetic
    so that a kernel issues its first step's loads before it waits on the previous kernel."""
    if BITS == 4:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w = tl.load(w_ptr + n[:, None] * (K // 2) + kb[None, :], mask=nmask[:, None] & (kb < k_hi // 2)[None, :],
                    other=0)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & (k < k_hi)[None, :], other=0)
    return w


@triton.jit
def _rows(acc, part, w, x_ptr, nw_ptr, s_ptr, z_ptr, n, nmask, m, mmask, k0, k_hi, K, sx, rstd,
          NORM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GEMV: tl.constexpr, FP32: tl.constexpr,
          DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of weight rows n, their tile w (``_wload``): the tensor-core sum into acc (BLOCK_M, BLOCK_N),
    or with GEMV (one row) fp32 multiply-adds into part (BLOCK_N, PART). A GEMV sums as it goes, over each
    thread's 16-byte load (INT4: over each group, which its scale needs): an fp32 tile the width of the K step
    held registers that the loads in flight need."""
    if BITS == 4:  # byte j of a row holds columns 2j (low nibble) and 2j + 1 (high)
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        bmask = kb < k_hi // 2
        kg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        gmask = nmask[:, None] & (kg < k_hi // GROUP)[None, :]
        sc = tl.load(s_ptr + n[:, None] * (K // GROUP) + kg[None, :], mask=gmask, other=0.0).to(tl.float32)
        zo = tl.load(z_ptr + n[:, None] * (K // GROUP) + kg[None, :], mask=gmask, other=0.0).to(tl.float32)
        if GEMV:  # sum(q x) a group, times its scale, plus its offset times sum(x): the codes are never scaled
            k = k0 + tl.arange(0, BLOCK_K)  # one contiguous load of x, split into even and odd columns in a thread
            xe, xo = tl.split(tl.reshape(_x_tile(x_ptr, nw_ptr, m, k, mmask, k < k_hi, sx, rstd, NORM),
                                         (1, BLOCK_K // 2, 2)))
            # each code read in its byte as 1 + c / 16 (_nib_f32), then sum(c x) = 16 (sum((1 + c / 16) x) - sum(x))
            t = _nib_f32(w & 15) * xe + _nib_f32(w >> 4) * xo
            xg = tl.sum(tl.reshape(xe + xo, (1, BLOCK_K // GROUP, GROUP // 2)), axis=2)
            tg = 16.0 * (tl.sum(tl.reshape(t, (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)), axis=2) - xg)
            part += tg * sc + xg * zo
        else:
            xe = _x_tile(x_ptr, nw_ptr, m, 2 * kb, mmask, bmask, sx, rstd, NORM)
            xo = _x_tile(x_ptr, nw_ptr, m, 2 * kb + 1, mmask, bmask, sx, rstd, NORM)
            acc = _dot(acc, xe, _int4_dense(w & 15, sc, zo, DT, BLOCK_N, BLOCK_K, GROUP), FP32)
            acc = _dot(acc, xo, _int4_dense(w >> 4, sc, zo, DT, BLOCK_N, BLOCK_K, GROUP), FP32)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        xv = _x_tile(x_ptr, nw_ptr, m, k, mmask, k < k_hi, sx, rstd, NORM)
        if GEMV:
            t = (_i8_f32(w) if BITS == 8 else w.to(tl.float32)) * xv
            VEC: tl.constexpr = 16 if BITS == 8 else 8  # elements in a 16-byte load
            part += tl.sum(tl.reshape(t, (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2)
        else:
            acc = _dot(acc, xv, w.to(DT), FP32)
    return acc, part


@triton.jit
def _proj_kernel(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr,
                 M, N, K, K_SPLIT, eps, TWO, sx, so, H, G, skc_b, skc_g, skc_m,
                 NORM: tl.constexpr, EPI: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                 D: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid, split = tl.program_id(0), tl.program_id(1)
    if EPI == _ROPE:  # rows j and j + D/2 of one head (TWO = D / 2)
        per_head = D // 2 // BLOCK_N
        head = pid // per_head
        n = head * D + (pid % per_head) * BLOCK_N + tl.arange(0, BLOCK_N)
    else:  # SWIGLU: gate rows n and up rows n + TWO
        head = 0
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask, nmask = m < M, n < N
    DT: tl.constexpr = tl.float32 if FP32 else nw_ptr.dtype.element_ty
    GEMV: tl.constexpr = BLOCK_M == 1  # one row: fp32 multiply-adds, no tensor-core tile padded to 16 rows
    TWO_SETS: tl.constexpr = EPI == _SWIGLU or EPI == _ROPE
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    # the weights do not depend on the previous kernel: the first K step's loads go out before the wait
    wa = _wload(w_ptr, n, nmask, k_lo, k_hi, K, BITS, BLOCK_K)
    wb = wa
    if TWO_SETS:
        wb = _wload(w_ptr, n + TWO, nmask, k_lo, k_hi, K, BITS, BLOCK_K)
    if PDL:  # everything above overlaps the previous kernel's tail; inputs are read only after it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    if NORM:  # the row's RMS over all K, whatever this program's K range
        ss = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=mmask[:, None] & (k < K)[None, :],
                         other=0.0).to(tl.float32)
            ss += tl.sum(xv * xv, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # GEMV partial sums (``_rows``): one a group for INT4, one a thread's 16-byte load for INT8 and 16-bit weights
    PART: tl.constexpr = (BLOCK_K // GROUP if BITS == 4 else BLOCK_K // (16 if BITS == 8 else 8)) if GEMV else 1
    part = tl.zeros((BLOCK_N, PART), tl.float32)
    part2 = tl.zeros((BLOCK_N, PART), tl.float32)
    acc, part = _rows(acc, part, wa, x_ptr, nw_ptr, s_ptr, z_ptr, n, nmask, m, mmask, k_lo, k_hi, K, sx, rstd,
                      NORM, BITS, GROUP, GEMV, FP32, DT, BLOCK_N, BLOCK_K)
    if TWO_SETS:
        acc2, part2 = _rows(acc2, part2, wb, x_ptr, nw_ptr, s_ptr, z_ptr, n + TWO, nmask, m, mmask, k_lo, k_hi, K,
                            sx, rstd, NORM, BITS, GROUP, GEMV, FP32, DT, BLOCK_N, BLOCK_K)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w = _wload(w_ptr, n, nmask, k0, k_hi, K, BITS, BLOCK_K)
        acc, part = _rows(acc, part, w, x_ptr, nw_ptr, s_ptr, z_ptr, n, nmask, m, mmask, k0, k_hi, K, sx, rstd,
                          NORM, BITS, GROUP, GEMV, FP32, DT, BLOCK_N, BLOCK_K)
        if TWO_SETS:
            w2 = _wload(w_ptr, n + TWO, nmask, k0, k_hi, K, BITS, BLOCK_K)
            acc2, part2 = _rows(acc2, part2, w2, x_ptr, nw_ptr, s_ptr, z_ptr, n + TWO, nmask, m, mmask, k0, k_hi,
                                K, sx, rstd, NORM, BITS, GROUP, GEMV, FP32, DT, BLOCK_N, BLOCK_K)
    if GEMV:
        acc = tl.sum(part, axis=1)[None, :]
        acc2 = tl.sum(part2, axis=1)[None, :]
    if BITS == 8:  # one scale a row of the weight: on the sums
        acc *= tl.load(s_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if TWO_SETS:
            acc2 *= tl.load(s_ptr + n + TWO, mask=nmask, other=0.0).to(tl.float32)[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if EPI == _STORE:
        tl.store(out_ptr + m[:, None] * so + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)
    elif EPI == _ADD:  # into the fp32 residual stream; the K splits' partials add up there
        tl.atomic_add(out_ptr + m[:, None] * so + n[None, :], acc, mask=omask, sem="relaxed")
    elif EPI == _SWIGLU:
        y = acc / (1.0 + tl.exp(-acc)) * acc2
        tl.store(out_ptr + m[:, None] * so + n[None, :], y.to(out_ptr.dtype.element_ty), mask=omask)
    else:  # ROPE: q heads rotated into out (B, H, D); k heads rotated and v heads into the caches at pos
        pos = tl.load(pos_ptr)
        j = n - head * D  # 0 .. D/2
        if head < H + G:
            c = tl.load(cos_ptr + pos * TWO + j)[None, :]
            s = tl.load(sin_ptr + pos * TWO + j)[None, :]
            a, b = acc * c - acc2 * s, acc2 * c + acc * s
        else:
            a, b = acc, acc2
        if head < H:
            dst = out_ptr + m[:, None] * so + head * D + j[None, :]
        elif head < H + G:
            dst = kc_ptr + m[:, None] * skc_b + (head - H) * skc_g + pos * skc_m + j[None, :]
        else:
            dst = vc_ptr + m[:, None] * skc_b + (head - H - G) * skc_g + pos * skc_m + j[None, :]
        tl.store(dst, a.to(dst.dtype.element_ty), mask=omask)
        tl.store(dst + TWO, b.to(dst.dtype.element_ty), mask=omask)


def _args(w: QuantWeight) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's three weight pointers (unused ones point at the data: never read)."""
    return w.data, w.scale if w.scale is not None else w.data, w.offset if w.offset is not None else w.data


# Launch configs (BLOCK_N, BLOCK_K, warps, stages, GEMV) by rows (1, up to 16, up to 64), projection and weight
# bits. One row: each projection's config swept inside llama_1b's whole step on an H200, one projection at a time,
# the rest held (notebook, 2026-11-30); more rows: a sweep of each projection alone. One row reads the weight with
# fp32 multiply-adds (GEMV), but INT8's output projection, which read faster on tensor cores (its dequantization
# spread over more threads); the head is 16-bit in the quantized models, so their head entries are not swept. Not
# tuned per GPU at run time: each config is a compile, dozens a model.
_GEMV_BF16 = {"qkv": (8, 2048, 8, 1), "o": (8, 1024, 4, 1), "gate_up": (4, 1024, 2, 1), "down": (8, 2048, 8, 1),
              "head": (8, 1024, 4, 1)}
_CONFIGS = {
    (1, 16): {k: (*v, True) for k, v in _GEMV_BF16.items()},
    (1, 8): {"qkv": (4, 2048, 4, 1, True), "o": (64, 128, 4, 4, False), "gate_up": (4, 1024, 2, 1, True),
             "down": (2, 4096, 4, 1, True), "head": (64, 128, 4, 4, False)},
    (1, 4): {"qkv": (4, 2048, 8, 1, True), "o": (4, 1024, 4, 1, True), "gate_up": (4, 2048, 4, 1, True),
             "down": (8, 2048, 8, 1, True), "head": (8, 1024, 4, 1, True)},
    (16, 16): {"qkv": (16, 256, 4, 3, False), "o": (32, 256, 4, 3, False), "gate_up": (128, 128, 8, 3, False),
               "down": (64, 256, 8, 3, False), "head": (128, 128, 8, 3, False)},
    (16, 8): {"qkv": (16, 256, 4, 3, False), "o": (64, 128, 4, 4, False), "gate_up": (64, 256, 8, 3, False),
              "down": (64, 128, 4, 4, False), "head": (128, 128, 8, 3, False)},
    (16, 4): {"qkv": (16, 128, 4, 4, False), "o": (128, 128, 8, 3, False), "gate_up": (64, 256, 8, 3, False),
              "down": (128, 128, 8, 3, False), "head": (128, 128, 8, 3, False)},
    (64, 16): {"qkv": (16, 128, 4, 4, False), "o": (64, 128, 4, 4, False), "gate_up": (64, 128, 4, 4, False),
               "down": (64, 128, 4, 4, False), "head": (128, 128, 8, 3, False)},
}


def config(epi: int, M: int, N: int, K: int, bits: int) -> dict:
    """The launch of a projection: BLOCK_N rows of the weight a program (RoPE with tensor cores: ROPE_ROWS),
    BLOCK_K columns a step, warps, pipeline stages, and GEMV (one row: fp32 multiply-adds instead of a 16-row
    tensor-core tile)."""
    shape = {ROPE: "qkv", SWIGLU: "gate_up", STORE: "head"}.get(epi) or ("down" if K > N else "o")
    rows = 1 if M == 1 else 16 if M <= 16 else 64
    table = _CONFIGS.get((rows, bits)) or _CONFIGS[(rows, 16)]
    block_n, block_k, warps, stages, gemv = table[shape]
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages, "GEMV": gemv}


def _blocks(M: int, K: int, bits: int, group: int, cfg: dict) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): all rows of a decode step in one tile (at most 64), whole INT4 groups."""
    block_m = 1 if M == 1 and cfg["GEMV"] else min(64, max(16, triton.next_power_of_2(M)))
    block_k = min(cfg["BLOCK_K"], max(16, triton.next_power_of_2(K)))
    if bits == 4:
        block_k = max(block_k, group)
    return block_m, block_k


def _launch(x: Tensor, w: QuantWeight, out: Tensor, epi: int, norm: Tensor | None, eps: float, *, two: int = 0,
            rope: tuple | None = None, heads: tuple[int, int, int] = (0, 0, 0), pdl: bool = False) -> None:
    M, K = x.shape
    N = (w.out_features - two) if epi == SWIGLU else w.out_features
    cfg = config(epi, M, N, K, w.bits)
    block_m, block_k = _blocks(M, K, w.bits, w.group, cfg)
    if epi == ROPE:  # GEMV: the config's rows where they divide half a head, else tensor cores' 16
        block_n = cfg["BLOCK_N"] if block_m == 1 and (heads[2] // 2) % cfg["BLOCK_N"] == 0 else ROPE_ROWS
        n_blocks = N // heads[2] * (heads[2] // 2 // block_n)
    else:
        block_n = cfg["BLOCK_N"]
        n_blocks = triton.cdiv(N, block_n)
    splits = _splits(n_blocks, K, block_k, x.device) if epi == ADD else 1
    k_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, k_split)
    cos, sin, pos, kc, vc = rope if rope is not None else (x, x, x, x, x)
    H, G, D = heads
    data, scale, offset = _args(w)
    fp32 = x.dtype == torch.float32 and (norm is None or norm.dtype == torch.float32) or interpreter()
    extra = {"launch_pdl": True} if pdl and not interpreter() else {}
    _proj_kernel[(n_blocks, splits, triton.cdiv(M, block_m))](
        x, norm if norm is not None else x, data, scale, offset, out, cos, sin, pos, kc, vc,
        M, N, K, k_split, eps, two, x.stride(0), out.stride(0), H, G,
        kc.stride(0) if rope else 0, kc.stride(1) if rope else 0, kc.stride(2) if rope else 0,
        NORM=norm is not None, EPI=epi, BITS=w.bits, GROUP=w.group or 1, D=D or 16, FP32=fp32,
        PDL=pdl and not interpreter(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra)


def _check(op: str, x: Tensor, w: QuantWeight, norm: Tensor | None = None) -> None:
    """One line naming what is wrong, before any work (under torch.compile: at trace time)."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"{op}: x must be (rows, {w.in_features}) for a weight of {w.in_features} inputs; got "
                         f"{tuple(x.shape)}")
    if norm is not None and tuple(norm.shape) != (w.in_features,):
        raise ValueError(f"{op}: the norm's weight must be ({w.in_features},); got {tuple(norm.shape)}")
    if w.bits == 4 and (w.group < 2 or w.group & (w.group - 1) or w.in_features % w.group):
        raise ValueError(f"{op}: INT4 groups must be a power of two dividing {w.in_features}; got {w.group}")
    if w.bits != 16 and w.scale is None or w.bits == 4 and w.offset is None:
        raise ValueError(f"{op}: INT{w.bits} weights need their scale" + (" and offset" if w.bits == 4 else ""))


def _splits(n_blocks: int, K: int, block_k: int, device: torch.device) -> int:
    """K splits for an ADD projection: about two programs an SM in all, each at least one K tile."""
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(K, block_k), triton.cdiv(2 * sms, n_blocks)))


# the launchers (eager) and their custom ops (under torch.compile)

def norm_qkv_rope_fwd(x: Tensor, norm: Tensor, eps: float, data: Tensor, scale: Tensor | None,
                      offset: Tensor | None, group: int, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
                      v_cache: Tensor, n_heads: int, pdl: bool) -> Tensor:
    B, (G, D) = x.shape[0], k_cache.shape[1:4:2]
    q = torch.empty(B, n_heads, D, dtype=norm.dtype, device=x.device)
    _launch(x, _quant(data, scale, offset, group), q, ROPE, norm, eps, two=D // 2,
            rope=(cos, sin, pos, k_cache, v_cache), heads=(n_heads, G, D), pdl=pdl)
    return q


def norm_swiglu_fwd(x: Tensor, norm: Tensor, eps: float, data: Tensor, scale: Tensor | None, offset: Tensor | None,
                    group: int, pdl: bool) -> Tensor:
    w = _quant(data, scale, offset, group)
    out = torch.empty(x.shape[0], w.out_features // 2, dtype=norm.dtype, device=x.device)
    _launch(x, w, out, SWIGLU, norm, eps, two=w.out_features // 2, pdl=pdl)
    return out


def add_linear_fwd(residual: Tensor, x: Tensor, data: Tensor, scale: Tensor | None, offset: Tensor | None,
                   group: int, pdl: bool) -> None:
    _launch(x, _quant(data, scale, offset, group), residual, ADD, None, 1.0, pdl=pdl)


def norm_linear_fwd(x: Tensor, norm: Tensor | None, eps: float, data: Tensor, scale: Tensor | None,
                    offset: Tensor | None, group: int, dtype: torch.dtype, pdl: bool) -> Tensor:
    w = _quant(data, scale, offset, group)
    out = torch.empty(x.shape[0], w.out_features, dtype=dtype, device=x.device)
    _launch(x, w, out, STORE, norm, eps, pdl=pdl)
    return out


@torch.library.custom_op("adaattn::norm_qkv_rope", mutates_args=("k_cache", "v_cache"))
def _norm_qkv_rope_op(x: Tensor, norm: Tensor, eps: float, data: Tensor, scale: Tensor | None, offset: Tensor | None,
                      group: int, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                      n_heads: int, pdl: bool) -> Tensor:
    return norm_qkv_rope_fwd(x, norm, eps, data, scale, offset, group, cos, sin, pos, k_cache, v_cache, n_heads, pdl)


@_norm_qkv_rope_op.register_fake
def _(x, norm, eps, data, scale, offset, group, cos, sin, pos, k_cache, v_cache, n_heads, pdl):
    return x.new_empty(x.shape[0], n_heads, k_cache.shape[3], dtype=norm.dtype)


@torch.library.custom_op("adaattn::norm_swiglu", mutates_args=())
def _norm_swiglu_op(x: Tensor, norm: Tensor, eps: float, data: Tensor, scale: Tensor | None, offset: Tensor | None,
                    group: int, pdl: bool) -> Tensor:
    return norm_swiglu_fwd(x, norm, eps, data, scale, offset, group, pdl)


@_norm_swiglu_op.register_fake
def _(x, norm, eps, data, scale, offset, group, pdl):
    return x.new_empty(x.shape[0], data.shape[0] // 2, dtype=norm.dtype)


@torch.library.custom_op("adaattn::add_linear", mutates_args=("residual",))
def _add_linear_op(residual: Tensor, x: Tensor, data: Tensor, scale: Tensor | None, offset: Tensor | None,
                   group: int, pdl: bool) -> None:
    add_linear_fwd(residual, x, data, scale, offset, group, pdl)


@_add_linear_op.register_fake
def _(residual, x, data, scale, offset, group, pdl):
    return None


@torch.library.custom_op("adaattn::norm_linear", mutates_args=())
def _norm_linear_op(x: Tensor, norm: Tensor | None, eps: float, data: Tensor, scale: Tensor | None,
                    offset: Tensor | None, group: int, dtype: torch.dtype, pdl: bool) -> Tensor:
    return norm_linear_fwd(x, norm, eps, data, scale, offset, group, dtype, pdl)


@_norm_linear_op.register_fake
def _(x, norm, eps, data, scale, offset, group, dtype, pdl):
    return x.new_empty(x.shape[0], data.shape[0], dtype=dtype)


def _pick(op, fwd):
    """The custom op while compiling (one opaque node inductor schedules around), the launcher eagerly."""
    return op if torch.compiler.is_compiling() else fwd


def norm_qkv_rope(x: Tensor, norm: Tensor, eps: float, w: QuantWeight, cos: Tensor, sin: Tensor, pos: Tensor,
                  k_cache: Tensor, v_cache: Tensor, n_heads: int, pdl: bool = False) -> Tensor:
    """x (B, E) the residual stream; the packed q/k/v weight ((H + 2G) D, E); cos, sin (positions, D / 2) fp32;
    ``pos`` (1,) the step's position; k_cache, v_cache (B, G, M, D) written at pos -> q (B, H, D) rotated."""
    _check("norm_qkv_rope", x, w, norm)
    B, G, M, D = k_cache.shape
    if v_cache.shape != k_cache.shape or k_cache.shape[0] != x.shape[0] or w.out_features != (n_heads + 2 * G) * D:
        raise ValueError(f"norm_qkv_rope: caches (B={x.shape[0]}, G, M, D) alike and a weight of (H + 2G) D rows "
                         f"expected; got k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}, weight "
                         f"{w.out_features} rows, H={n_heads}")
    if D % (2 * ROPE_ROWS) or tuple(cos.shape[1:]) != (D // 2,):
        raise ValueError(f"norm_qkv_rope: head dim {D} must be a multiple of {2 * ROPE_ROWS}, cos and sin "
                         f"(positions, {D // 2}); got cos {tuple(cos.shape)}")
    return _pick(_norm_qkv_rope_op, norm_qkv_rope_fwd)(x, norm, eps, w.data, w.scale, w.offset, w.group, cos, sin,
                                                        pos, k_cache, v_cache, n_heads, pdl)


def norm_swiglu(x: Tensor, norm: Tensor, eps: float, w: QuantWeight, pdl: bool = False) -> Tensor:
    """x (B, E), the packed gate/up weight (2 hidden, E), gate rows first -> silu(gate) * up (B, hidden)."""
    _check("norm_swiglu", x, w, norm)
    return _pick(_norm_swiglu_op, norm_swiglu_fwd)(x, norm, eps, w.data, w.scale, w.offset, w.group, pdl)


def add_linear_(residual: Tensor, x: Tensor, w: QuantWeight, pdl: bool = False) -> None:
    """residual (B, N) fp32 += x (B, K) @ weight^T, in place."""
    _check("add_linear_", x, w)
    if residual.dtype != torch.float32 or tuple(residual.shape) != (x.shape[0], w.out_features):
        raise ValueError(f"add_linear_: the residual must be fp32 ({x.shape[0]}, {w.out_features}); got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    _pick(_add_linear_op, add_linear_fwd)(residual, x, w.data, w.scale, w.offset, w.group, pdl)


def norm_linear(x: Tensor, norm: Tensor | None, eps: float, w: QuantWeight, dtype: torch.dtype,
                pdl: bool = False) -> Tensor:
    """RMSNorm(x) (or x itself, ``norm`` None) @ weight^T -> (B, N) in ``dtype``."""
    _check("norm_linear", x, w, norm)
    return _pick(_norm_linear_op, norm_linear_fwd)(x, norm, eps, w.data, w.scale, w.offset, w.group, dtype, pdl)


__all__ = ["QuantWeight", "add_linear_", "add_linear_ref", "norm_linear", "norm_linear_ref", "norm_qkv_rope",
           "norm_qkv_rope_ref", "norm_swiglu", "norm_swiglu_ref"]
