"""An FP8 (e4m3) attention forward: Q and K quantized a block of rows at a time (K first smoothed by its mean over
the sequence), Q·Kᵀ on FP8 tensor cores accumulated in fp32, the online softmax in fp32, P·V in FP8 (V
quantized per channel, P scaled to e4m3's range) or in bf16.

- Smoothing K: q·(k - mean) = q·k - q·mean, and q·mean is the same for every key of a query, so the softmax is
  unchanged; what it removes is the channels' common offset, which would otherwise set the blocks' scales and
  leave the keys' differences a few of e4m3's 3 mantissa bits (SageAttention's observation).
- Scales: one per block of ``BLOCK_M`` query rows and one per block of ``BLOCK_N`` key rows (amax / 448), folded
  into the fp32 scores with the softmax scale; V's per-channel scale applied once to the output.
- P·V in FP8: P in [0, 1] (its row's running maximum subtracted) times 448; V transposed in the quantization
  pass, the layout Hopper's FP8 MMA takes its second operand in.
- Quantization is one pass over Q, K and V each (``quantize_qkv``); the attention reads only the FP8 copies.

On the CPU interpreter (whose tl.dot gets FP8 and bf16 operands wrong) the products run on the FP8 values cast to
fp32, so a test there checks the quantization and the algorithm, not the tensor cores.

Not yet a choice of AdaAttention's precision policy (docs/notebook.md, 2026-11-28, seventeenth session): measured
first (issue 68).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.nystrom import LOG2E
from adaattn.kernels.runtime import interpreter, use_triton

E4M3_MAX = 448.0


@dataclass(frozen=True)
class FP8QKV:
    """Q and K in e4m3 with a scale per block of rows, V transposed in e4m3 with a scale per channel."""

    q: Tensor  # (B, H, S, D) e4m3
    q_scale: Tensor  # (B, H, cdiv(S, block_m)) fp32
    k: Tensor  # (B, G, Skv, D) e4m3, K minus its mean over the sequence
    k_scale: Tensor  # (B, G, cdiv(Skv, block_n)) fp32
    v: Tensor  # P·V in FP8: V transposed, (B, G, D, Skv) e4m3; else V itself (B, G, Skv, D)
    v_scale: Tensor | None  # P·V in FP8: (B, G, D) fp32
    block_m: int
    block_n: int


@triton.jit
def _to_e4m3(x, EMULATE: tl.constexpr):
    """fp32 -> e4m3 (x within +-448). On the interpreter the value is first rounded to e4m3's grid in fp32: its own
    conversion drops the carry of a rounding into the exponent (127.9 becomes 64, Triton 3.x `_convert_float`)."""
    if EMULATE:
        e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(x), 1e-30))), -6.0)  # below 2^-6: the subnormals' step
        step = tl.exp2(e - 3.0)  # 3 mantissa bits
        x = tl.minimum(tl.maximum(tl.floor(x / step + 0.5) * step, -448.0), 448.0)
    return x.to(tl.float8e4nv)


@triton.jit
def _block(x_ptr, blk, bh, NH, S, s_b, s_h, s_s, BLOCK: tl.constexpr, D: tl.constexpr):
    """Rows ``blk * BLOCK ...`` of (batch, head) ``bh`` of a (B, NH, S, D) tensor, in fp32 (0 past S)."""
    b, h = bh // NH, bh % NH
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    rmask = rows < S
    x = tl.load(x_ptr + b * s_b + h * s_h + rows[:, None] * s_s + d[None, :], mask=rmask[:, None], other=0.0)
    return b, h, rows, d, rmask, x.to(tl.float32)


@triton.jit
def _quant_rows_kernel(x_ptr, mean_ptr, out_ptr, scale_ptr, S, NH, n_blocks,
                       sx_b, sx_h, sx_s, so_b, so_h, so_s,
                       SUB_MEAN: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, EMULATE: tl.constexpr):
    """One block of rows of one (batch, head): (x - mean) / scale in e4m3, scale = the block's amax / 448."""
    blk, bh = tl.program_id(0), tl.program_id(1)
    b, h, rows, d, rmask, x = _block(x_ptr, blk, bh, NH, S, sx_b, sx_h, sx_s, BLOCK, D)
    if SUB_MEAN:
        x = tl.where(rmask[:, None], x - tl.load(mean_ptr + bh * D + d)[None, :], 0.0)
    scale = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-30) / 448.0
    tl.store(out_ptr + b * so_b + h * so_h + rows[:, None] * so_s + d[None, :], _to_e4m3(x / scale, EMULATE),
             mask=rmask[:, None])
    tl.store(scale_ptr + bh * n_blocks + blk, scale)


@triton.jit
def _quant_v_kernel(v_ptr, scale_ptr, out_ptr, S, NH, sv_b, sv_h, sv_s,
                    BLOCK: tl.constexpr, D: tl.constexpr, EMULATE: tl.constexpr):
    """V / its per-channel scale in e4m3, written transposed: (B, G, D, S)."""
    blk, bh = tl.program_id(0), tl.program_id(1)
    _, _, rows, d, rmask, v = _block(v_ptr, blk, bh, NH, S, sv_b, sv_h, sv_s, BLOCK, D)
    v = v / tl.load(scale_ptr + bh * D + d)[None, :]
    tl.store(out_ptr + bh * D * S + d[None, :] * S + rows[:, None], _to_e4m3(v, EMULATE), mask=rmask[:, None])


def quantize_qkv(q: Tensor, k: Tensor, v: Tensor, pv_fp8: bool = True, block_m: int = 128,
                 block_n: int = 64) -> FP8QKV:
    """The FP8 copies the attention reads: q (B, H, S, D), k and v (B, G, Skv, D), any strides with the last dim
    contiguous; V kept as it is where P·V runs in bf16 (``pv_fp8`` False)."""
    B, H, S, D = q.shape
    G, Skv = k.shape[1], k.shape[2]
    dev = q.device
    k_mean = k.float().mean(dim=2).contiguous()  # (B, G, D)
    q8 = torch.empty(B, H, S, D, dtype=torch.float8_e4m3fn, device=dev)
    k8 = torch.empty(B, G, Skv, D, dtype=torch.float8_e4m3fn, device=dev)
    nq, nk = triton.cdiv(S, block_m), triton.cdiv(Skv, block_n)
    q_scale = torch.empty(B, H, nq, dtype=torch.float32, device=dev)
    k_scale = torch.empty(B, G, nk, dtype=torch.float32, device=dev)
    _quant_rows_kernel[(nq, B * H)](q, q, q8, q_scale, S, H, nq, q.stride(0), q.stride(1), q.stride(2),
                                    q8.stride(0), q8.stride(1), q8.stride(2), SUB_MEAN=False, BLOCK=block_m, D=D,
                                    EMULATE=interpreter())
    _quant_rows_kernel[(nk, B * G)](k, k_mean, k8, k_scale, Skv, G, nk, k.stride(0), k.stride(1), k.stride(2),
                                    k8.stride(0), k8.stride(1), k8.stride(2), SUB_MEAN=True, BLOCK=block_n, D=D,
                                    EMULATE=interpreter())
    if not pv_fp8:
        return FP8QKV(q8, q_scale, k8, k_scale, v, None, block_m, block_n)
    v_scale = (v.float().abs().amax(dim=2).clamp_min(1e-30) / E4M3_MAX).contiguous()  # (B, G, D)
    v8t = torch.empty(B, G, D, Skv, dtype=torch.float8_e4m3fn, device=dev)
    _quant_v_kernel[(triton.cdiv(Skv, 64), B * G)](v, v_scale, v8t, Skv, G, v.stride(0), v.stride(1), v.stride(2),
                                                   BLOCK=64, D=D, EMULATE=interpreter())
    return FP8QKV(q8, q_scale, k8, k_scale, v8t, v_scale, block_m, block_n)


@triton.jit
def _fp8_attention_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, o_ptr, sm_scale_log2,
                          S, Skv, H, G, nq, nk,
                          sq_b, sq_h, sq_s, sk_b, sk_g, sk_s, sv_b, sv_g, sv_n, sv_d, so_b, so_h, so_s,
                          CAUSAL: tl.constexpr, PV_FP8: tl.constexpr, EMULATE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    mblk, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    g = h // (H // G)
    bg = b * G + g
    m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + m[:, None] * sq_s + d[None, :], mask=(m < S)[:, None], other=0.0)
    qk_scale = tl.load(qs_ptr + bh * nq + mblk) * sm_scale_log2  # log2(e) folded in: exp2 below
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    hi = tl.minimum(Skv, (mblk + 1) * BLOCK_M) if CAUSAL else Skv
    for start in range(0, hi, BLOCK_N):
        n = start + n0
        k = tl.load(k_ptr + b * sk_b + g * sk_g + n[:, None] * sk_s + d[None, :], mask=(n < Skv)[:, None], other=0.0)
        if EMULATE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * (qk_scale * tl.load(ks_ptr + bg * nk + start // BLOCK_N))
        keep = (n < Skv)[None, :]
        if CAUSAL:
            keep = keep & (m[:, None] >= n[None, :])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vmask = n < Skv
        if PV_FP8:  # a (D, BLOCK_N) tile of V transposed: the K-major second operand FP8 MMA reads
            v_t = tl.load(v_ptr + b * sv_b + g * sv_g + d[:, None] * sv_d + n[None, :] * sv_n, mask=vmask[None, :],
                          other=0.0)
            p8 = _to_e4m3(p * 448.0, EMULATE)
            if EMULATE:
                pv = tl.dot(p8.to(tl.float32), tl.trans(v_t.to(tl.float32)), input_precision="ieee")
            else:
                pv = tl.dot(p8, tl.trans(v_t))
            pv = pv / 448.0
        else:
            v = tl.load(v_ptr + b * sv_b + g * sv_g + n[:, None] * sv_n + d[None, :] * sv_d, mask=vmask[:, None],
                        other=0.0).to(tl.bfloat16)
            if EMULATE:
                pv = tl.dot(p.to(tl.bfloat16).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(tl.bfloat16), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    if PV_FP8:
        out = out * tl.load(vs_ptr + bg * D + d)[None, :]
    tl.store(o_ptr + b * so_b + h * so_h + m[:, None] * so_s + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(m < S)[:, None])


def fp8_attention_fwd(qkv: FP8QKV, S: int, out_dtype: torch.dtype, causal: bool, scale: float,
                      num_warps: int = 8, num_stages: int = 3) -> Tensor:
    """The attention over ``quantize_qkv``'s copies: (B, H, S, D) in ``out_dtype``."""
    B, H, _, D = qkv.q.shape
    G, Skv = qkv.k.shape[1], qkv.k.shape[2]
    pv_fp8 = qkv.v_scale is not None
    v, vs = qkv.v, qkv.v_scale if pv_fp8 else qkv.q_scale  # V's scale is read only in FP8
    # strides of V's (b, g, position, channel): the transposed FP8 copy's, or V's own
    sv = (v.stride(0), v.stride(1), v.stride(3), v.stride(2)) if pv_fp8 else tuple(v.stride())
    out = torch.empty(B, H, S, D, dtype=out_dtype, device=qkv.q.device)
    _fp8_attention_kernel[(triton.cdiv(S, qkv.block_m), B * H)](
        qkv.q, qkv.q_scale, qkv.k, qkv.k_scale, v, vs, out, scale * LOG2E,
        S, Skv, H, G, qkv.q_scale.shape[2], qkv.k_scale.shape[2],
        qkv.q.stride(0), qkv.q.stride(1), qkv.q.stride(2), qkv.k.stride(0), qkv.k.stride(1), qkv.k.stride(2), *sv,
        out.stride(0), out.stride(1), out.stride(2),
        CAUSAL=causal, PV_FP8=pv_fp8, EMULATE=interpreter(), BLOCK_M=qkv.block_m, BLOCK_N=qkv.block_n, D=D,
        num_warps=num_warps, num_stages=num_stages)
    return out


def check_fp8_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    """One line naming what is wrong, before any work."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"fp8_attention takes q (B, H, S, D) and k, v (B, G, Skv, D) alike; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (B, H, S, D), G = q.shape, k.shape[1]
    if k.shape[0] != B or k.shape[3] != D or H % G:
        raise ValueError(f"fp8_attention: k (B={k.shape[0]}, G={G}, Skv, D={k.shape[3]}) must match q's B={B} and "
                         f"D={D}, and G must divide H={H}")
    if D not in (32, 64, 128):
        raise ValueError(f"fp8_attention: head dim must be 32, 64 or 128; got {D}")
    if causal and k.shape[2] != S:
        raise ValueError(f"fp8_attention: causal needs as many keys as queries; got {S} queries, {k.shape[2]} keys")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_attention: q, k, v must share a float dtype (fp16, bf16, fp32); got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")


def fp8_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
                  pv_fp8: bool = True) -> Tensor:
    """Softmax attention with e4m3 inputs (``quantize_qkv``) and fp32 accumulation: q (B, H, S, D), k and v
    (B, G, Skv, D) (GQA: G divides H), head dim 32, 64 or 128 -> (B, H, S, D) in q's dtype. Forward only (no
    gradient); where the kernels cannot run (no Triton, another device) it raises rather than run something
    else under this name."""
    check_fp8_attention(q, k, v, causal)
    if not use_triton(q, k, v):
        raise RuntimeError("fp8_attention needs the Triton kernels on this device (a CUDA GPU, or "
                           "TRITON_INTERPRET=1 on the CPU)")
    if q.requires_grad or k.requires_grad or v.requires_grad:
        raise RuntimeError("fp8_attention is a forward only: call it under torch.no_grad() or on detached inputs")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return fp8_attention_fwd(quantize_qkv(q, k, v, pv_fp8), q.shape[2], q.dtype, causal, scale)


def fp8_attention_emulated(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
                           pv_fp8: bool = True, block_m: int = 128, block_n: int = 64) -> Tensor:
    """The same quantization in PyTorch and float64 attention over its dequantized values (P exact): what the
    kernel computes up to P's rounding and the order of its sums; the reference its tests compare with."""
    H, S, D = q.shape[1:]
    G = k.shape[1]

    def blocks(x: Tensor, block: int) -> Tensor:
        n = x.shape[2]
        pad = torch.nn.functional.pad(x, (0, 0, 0, -n % block)).unflatten(2, (-1, block))  # (B, H, nb, block, D)
        s = pad.abs().amax(dim=(3, 4), keepdim=True).clamp_min(1e-30) / E4M3_MAX
        return ((pad / s).to(torch.float8_e4m3fn).double() * s).flatten(2, 3)[:, :, :n]

    qd = blocks(q.double(), block_m)
    kd = blocks(k.double() - k.double().mean(dim=2, keepdim=True), block_n)
    vs = v.double().abs().amax(dim=2, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    vd = (v.double() / vs).to(torch.float8_e4m3fn).double() * vs if pv_fp8 else v.double()
    kd, vd = (t.repeat_interleave(H // G, dim=1) for t in (kd, vd))
    scores = qd @ kd.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ vd


__all__ = ["FP8QKV", "fp8_attention", "fp8_attention_emulated", "quantize_qkv"]
