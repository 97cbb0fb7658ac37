"""An 8-bit attention forward: Q·Kᵀ in int8 (or e4m3) with int32 (fp32) sums, the online softmax in fp32, P·V in
FP8 e4m3 (V quantized per channel, P scaled to e4m3's range) or in bf16, Q and K quantized a block of rows at a
time, K first smoothed by its mean.

- Why int8 for Q·K by default (docs/notebook.md, 2026-11-28, eighteenth session): e4m3's 3 mantissa bits put a
  relative L2 error of 0.035-0.046 on the output for MiniLM's real q, k, v at head dim 32 (0.05 on N(0, 1) at
  128), over the 0.03 filed as the goal; int8 with a scale per block (7 bits) cuts the Q·K part about 3x at a
  5-10% cost in speed on an H200 (the int32 sums converted to fp32). ``qk_int8=False`` keeps e4m3 (the precision
  study measures both). SageAttention 2 makes the same split: int8 Q·K, FP8 P·V.
- Smoothing K: q·(k - mean) = q·k - q·mean, and q·mean is the same for every key of a query, so the softmax is
  unchanged (any one vector would do: the mean of a strided sample of rows serves); what it removes is the
  channels' common offset, which would otherwise set the blocks' scales and leave the keys' differences few of
  the 8 bits (SageAttention's observation).
- Scales: one per block of query rows and one per block of key rows (amax / 127, or / 448 in e4m3), folded into
  the fp32 scores with the softmax scale (one multiply-add with the running maximum); V's per-channel scale
  applied once to the output.
- P·V in FP8: P in [0, 448] (its row's running maximum less log2(448) subtracted in exp2's argument), the 448
  divided out at the end with the row sum; V transposed in the quantization pass, the layout Hopper's FP8 MMA
  takes its second operand in.
- Passes: V's per-channel amax (one reduction; K's offset is a sample's mean), one kernel writing K and V in 8
  bits (``quantize_kv``); Q is quantized inside the attention kernel, a block at a time as it is loaded: it is
  read once.
- Loop: the key blocks wholly below the diagonal (causal) or wholly inside the sequence run without a mask; only
  the diagonal block and a ragged tail are masked. Causal programs start with the longest rows (load balance).

On the CPU interpreter (whose tl.dot gets FP8 and bf16 operands wrong) the products run on the 8-bit values cast
to fp32, so a test there checks the quantization and the algorithm, not the tensor cores.

AdaAttention runs it (``precision_mode="fp8"``) only where its accuracy guard allows (``attention/precision.py``).
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
KEY_SAMPLE = 1024  # rows of K its smoothing offset is the mean of


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query rows a program (and a Q scale)
    block_n: int  # key rows a loop step (and a K scale)
    num_warps: int
    num_stages: int


def launch_config(causal: bool) -> LaunchConfig:
    """The blocks and warps a call runs with: the fastest of a sweep on an H200 (docs/notebook.md, 2026-11-28,
    eighteenth session): 64 x 64 on 4 warps without a mask, 128 x 128 on 8 causal (fewer diagonal blocks)."""
    return LaunchConfig(128, 128, 8, 3) if causal else LaunchConfig(64, 64, 4, 3)


@dataclass(frozen=True)
class FP8KV:
    """K in int8 (Q·K in int8, the default) or e4m3 with a scale per block of rows; for P·V in FP8 V transposed
    in e4m3 with a scale per channel."""

    k: Tensor  # (B, G, Skv, D) int8 (or e4m3), K minus its offset (``key_offset``)
    k_scale: Tensor  # (B, G, cdiv(Skv, block_n)) fp32
    v: Tensor  # P·V in FP8: V transposed, (B, G, D, Skv) e4m3; else V itself (B, G, Skv, D)
    v_scale: Tensor | None  # P·V in FP8: (B, G, D) fp32
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
def _quant_block(x, EMULATE: tl.constexpr, INT8: tl.constexpr = False):
    """A block in e4m3 over its amax / 448 (``INT8``: in int8 over its amax / 127, rounded to nearest), and that
    scale."""
    amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-30)
    if INT8:
        scale = amax / 127.0
        y = x / scale
        out = tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int8)  # the conversion truncates: half away from 0
    else:
        scale = amax / 448.0
        out = _to_e4m3(x / scale, EMULATE)
    return out, scale  # one return: Triton takes no two of different types


@triton.jit
def _quant_kv_kernel(k_ptr, v_ptr, kmean_ptr, vscale_ptr, k8_ptr, ks_ptr, v8t_ptr, Skv, G, nk,
                     sk_b, sk_g, sk_s, sv_b, sv_g, sv_s, PV_FP8: tl.constexpr, QK_INT8: tl.constexpr,
                     BLOCK: tl.constexpr, D: tl.constexpr, EMULATE: tl.constexpr):
    """One block of key rows of one (batch, kv head): (k - mean) over the block's amax / 448 in e4m3, and (P·V in
    FP8) the same rows of V over V's per-channel scale, written transposed, (B, G, D, Skv)."""
    blk, bg = tl.program_id(0), tl.program_id(1)
    b, g = bg // G, bg % G
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    rmask = (rows < Skv)[:, None]
    k = tl.load(k_ptr + b * sk_b + g * sk_g + rows[:, None] * sk_s + d[None, :], mask=rmask, other=0.0)
    k = tl.where(rmask, k.to(tl.float32) - tl.load(kmean_ptr + bg * D + d)[None, :], 0.0)
    k8, scale = _quant_block(k, EMULATE, QK_INT8)
    tl.store(k8_ptr + (bg * Skv + rows[:, None]) * D + d[None, :], k8, mask=rmask)
    tl.store(ks_ptr + bg * nk + blk, scale)
    if PV_FP8:
        v = tl.load(v_ptr + b * sv_b + g * sv_g + rows[:, None] * sv_s + d[None, :], mask=rmask, other=0.0)
        v8 = _to_e4m3(v.to(tl.float32) / tl.load(vscale_ptr + bg * D + d)[None, :], EMULATE)
        # stored as a (D, BLOCK) tile: the positions run along the tile's contiguous axis, as along memory's
        tl.store(v8t_ptr + bg * D * Skv + d[:, None] * Skv + rows[None, :], tl.trans(v8), mask=tl.trans(rmask))


def key_offset(k: Tensor) -> Tensor:
    """What K is smoothed by, (B, G, D) fp32: the mean of at most ``KEY_SAMPLE`` evenly strided rows. Any one vector
    subtracted from every key leaves the softmax as it is; the channels' common offset is all it has to catch, and
    a sample catches it without a pass over K."""
    step = max(1, k.shape[2] // KEY_SAMPLE)
    return torch.mean(k[:, :, ::step], dim=2, dtype=torch.float32).contiguous()


def quantize_kv(k: Tensor, v: Tensor, pv_fp8: bool = True, block_n: int = 64, qk_int8: bool = True) -> FP8KV:
    """The 8-bit copies the attention reads: k and v (B, G, Skv, D), any strides with the last dim contiguous; V
    kept as it is where P·V runs in bf16 (``pv_fp8`` False); K in int8 with ``qk_int8``."""
    B, G, Skv, D = k.shape
    dev = k.device
    k_mean = key_offset(k)
    k8 = torch.empty(B, G, Skv, D, dtype=torch.int8 if qk_int8 else torch.float8_e4m3fn, device=dev)
    nk = triton.cdiv(Skv, block_n)
    k_scale = torch.empty(B, G, nk, dtype=torch.float32, device=dev)
    if pv_fp8:
        v_amax = torch.linalg.vector_norm(v, float("inf"), dim=2, dtype=torch.float32)  # one reduction
        v_scale = (v_amax.clamp_min(1e-30) / E4M3_MAX).contiguous()  # (B, G, D)
        v8t = torch.empty(B, G, D, Skv, dtype=torch.float8_e4m3fn, device=dev)
    else:
        v_scale, v8t = k_mean, k8  # not read
    _quant_kv_kernel[(nk, B * G)](k, v, k_mean, v_scale, k8, k_scale, v8t, Skv, G, nk,
                                  k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                                  PV_FP8=pv_fp8, QK_INT8=qk_int8, BLOCK=block_n, D=D, EMULATE=interpreter())
    if not pv_fp8:
        return FP8KV(k8, k_scale, v, None, block_n)
    return FP8KV(k8, k_scale, v8t, v_scale, block_n)


@triton.jit
def _steps(acc, l_i, m_i, q8, qk_scale, k_base, ks_base, v_base, m, lo, hi, Skv, sk_s, sv_n, sv_d,
           MASK: tl.constexpr, CAUSAL: tl.constexpr, PV_FP8: tl.constexpr, QK_INT8: tl.constexpr,
           EMULATE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """The online softmax over key blocks ``lo ... hi``; ``MASK``: the diagonal block or the ragged tail. With P·V
    in FP8, P comes out of exp2 already scaled to e4m3's range (log2(448) subtracted from the running maximum),
    the row sums in the same scale: no multiply an element."""
    shift = 8.807354922057604 if PV_FP8 else 0.0  # log2(448)
    n0 = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        n = start + n0
        if MASK:
            k = tl.load(k_base + n[:, None] * sk_s + d[None, :], mask=(n < Skv)[:, None], other=0.0)
        else:
            k = tl.load(k_base + n[:, None] * sk_s + d[None, :])
        if EMULATE:  # int8 products and their sums are exact in fp32 here (|sum| < 2^24)
            s = tl.dot(q8.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif QK_INT8:
            s = tl.dot(q8, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        else:
            s = tl.dot(q8, tl.trans(k))
        c = qk_scale * tl.load(ks_base + start // BLOCK_N)  # > 0: max(s) * c is max(s * c)
        if MASK:
            keep = (n < Skv)[None, :]
            if CAUSAL:
                keep = keep & (m[:, None] >= n[None, :])
            s = tl.where(keep, s * c, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - (m_new - shift)[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * c)
            p = tl.exp2(s * c - (m_new - shift)[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if PV_FP8:  # a (D, BLOCK_N) tile of V transposed: the K-major second operand FP8 MMA reads
            if MASK:
                v_t = tl.load(v_base + d[:, None] * sv_d + n[None, :] * sv_n, mask=(n < Skv)[None, :], other=0.0)
            else:
                v_t = tl.load(v_base + d[:, None] * sv_d + n[None, :] * sv_n)
            p8 = _to_e4m3(p, EMULATE)  # at most 448: divided out with the row sum at the end
            if EMULATE:
                acc = tl.dot(p8.to(tl.float32), tl.trans(v_t.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(p8, tl.trans(v_t), acc)
        else:
            if MASK:
                v = tl.load(v_base + n[:, None] * sv_n + d[None, :] * sv_d, mask=(n < Skv)[:, None], other=0.0)
            else:
                v = tl.load(v_base + n[:, None] * sv_n + d[None, :] * sv_d)
            v = v.to(tl.bfloat16)
            if EMULATE:
                acc = tl.dot(p.to(tl.bfloat16).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(tl.bfloat16), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fp8_attention_kernel(q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, o_ptr, sm_scale_log2, S, Skv, H, G, nq, nk, q_off,
                          sq_b, sq_h, sq_s, sk_b, sk_g, sk_s, sv_b, sv_g, sv_n, sv_d, so_b, so_h, so_s,
                          CAUSAL: tl.constexpr, PV_FP8: tl.constexpr, QK_INT8: tl.constexpr, EMULATE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    mblk, bh = tl.program_id(0), tl.program_id(1)
    if CAUSAL:
        mblk = nq - 1 - mblk  # the longest rows first: the short ones fill the last wave
    b, h = bh // H, bh % H
    g = h // (H // G)
    bg = b * G + g
    m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # q's rows; their positions among the keys: q_off + m
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + m[:, None] * sq_s + d[None, :], mask=(m < S)[:, None], other=0.0)
    q8, q_scale = _quant_block(q.to(tl.float32), EMULATE, QK_INT8)
    qk_scale = q_scale * sm_scale_log2  # log2(e) folded in: exp2 below
    k_base = k_ptr + b * sk_b + g * sk_g
    v_base = v_ptr + b * sv_b + g * sv_g
    ks_base = ks_ptr + bg * nk
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    if CAUSAL:  # every key before this block's first position exists; the diagonal block is masked
        split = q_off + mblk * BLOCK_M
        hi = tl.minimum(Skv, split + BLOCK_M)
    else:
        split = (Skv // BLOCK_N) * BLOCK_N
        hi = Skv
    pos = q_off + m
    acc, l_i, m_i = _steps(acc, l_i, m_i, q8, qk_scale, k_base, ks_base, v_base, pos, 0, split, Skv, sk_s, sv_n,
                           sv_d, False, CAUSAL, PV_FP8, QK_INT8, EMULATE, BLOCK_N, D)
    acc, l_i, m_i = _steps(acc, l_i, m_i, q8, qk_scale, k_base, ks_base, v_base, pos, split, hi, Skv, sk_s, sv_n,
                           sv_d, True, CAUSAL, PV_FP8, QK_INT8, EMULATE, BLOCK_N, D)
    if PV_FP8:  # acc and l_i both carry P's 448
        out = acc / l_i[:, None] * tl.load(vs_ptr + bg * D + d)[None, :]
    else:
        out = acc / l_i[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + m[:, None] * so_s + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(m < S)[:, None])


def fp8_attention_fwd(q: Tensor, kv: FP8KV, causal: bool, scale: float, q_offset: int = 0, block_m: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None) -> Tensor:
    """The attention of q (B, H, S, D) (last dim contiguous; quantized here, ``block_m`` rows a scale) over
    ``quantize_kv``'s copies: (B, H, S, D) in q's dtype. ``q_offset``: the position of q's first row among the keys
    (causal; a multiple of ``block_m``): rows ``q_offset ...`` of a longer q give the very values the whole call
    gives them (the accuracy guard's sample)."""
    B, H, S, D = q.shape
    G, Skv = kv.k.shape[1], kv.k.shape[2]
    cfg = launch_config(causal)
    block_m, num_warps, num_stages = block_m or cfg.block_m, num_warps or cfg.num_warps, num_stages or cfg.num_stages
    if block_m % kv.block_n or q_offset % block_m:
        raise ValueError(f"fp8_attention: block_m ({block_m}) must be a multiple of block_n ({kv.block_n}), and "
                         f"q_offset ({q_offset}) of block_m")
    pv_fp8 = kv.v_scale is not None
    vs = kv.v_scale if pv_fp8 else kv.k_scale  # V's scale is read only in FP8
    # strides of V's (b, g, position, channel): the transposed FP8 copy's, or V's own
    v = kv.v
    sv = (v.stride(0), v.stride(1), v.stride(3), v.stride(2)) if pv_fp8 else tuple(v.stride())
    out = torch.empty(B, H, S, D, dtype=q.dtype, device=q.device)
    nq = triton.cdiv(S, block_m)
    _fp8_attention_kernel[(nq, B * H)](
        q, kv.k, kv.k_scale, v, vs, out, scale * LOG2E, S, Skv, H, G, nq, kv.k_scale.shape[2], q_offset,
        q.stride(0), q.stride(1), q.stride(2), kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), *sv,
        out.stride(0), out.stride(1), out.stride(2),
        CAUSAL=causal, PV_FP8=pv_fp8, QK_INT8=kv.k.dtype == torch.int8, EMULATE=interpreter(), BLOCK_M=block_m,
        BLOCK_N=kv.block_n, D=D,
        num_warps=num_warps, num_stages=num_stages)
    return out


def _fp8_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, pv_fp8: bool,
                   qk_int8: bool) -> Tensor:
    kv = quantize_kv(k, v, pv_fp8, launch_config(causal).block_n, qk_int8)
    return fp8_attention_fwd(q, kv, causal, scale)


@torch.library.custom_op("adaattn::fp8_attention", mutates_args=())
def fp8_attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, pv_fp8: bool,
                     qk_int8: bool) -> Tensor:
    return _fp8_attention(q, k, v, causal, scale, pv_fp8, qk_int8)


@fp8_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, pv_fp8: bool, qk_int8: bool) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


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
                  pv_fp8: bool = True, qk_int8: bool = True) -> Tensor:
    """Softmax attention with e4m3 inputs and fp32 accumulation: q (B, H, S, D), k and v (B, G, Skv, D) (GQA: G
    divides H), head dim 32, 64 or 128 -> (B, H, S, D) in q's dtype; ``qk_int8``: Q·K in int8 instead (int32
    sums), P·V as ``pv_fp8`` says. Forward only (no gradient); a custom op under
    ``torch.compile``. Where the kernels cannot run (no Triton, another device) it raises rather than run
    something else under this name."""
    check_fp8_attention(q, k, v, causal)
    if not use_triton(q, k, v):
        raise RuntimeError("fp8_attention needs the Triton kernels on this device (a CUDA GPU, or "
                           "TRITON_INTERPRET=1 on the CPU)")
    if q.requires_grad or k.requires_grad or v.requires_grad:
        raise RuntimeError("fp8_attention is a forward only: call it under torch.no_grad() or on detached inputs")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if torch.compiler.is_compiling():
        return fp8_attention_op(q, k, v, causal, scale, pv_fp8, qk_int8)
    return _fp8_attention(q, k, v, causal, scale, pv_fp8, qk_int8)


def fp8_attention_emulated(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
                           pv_fp8: bool = True, block_m: int | None = None, block_n: int | None = None,
                           qk_int8: bool = True) -> Tensor:
    """The same quantization in PyTorch and float64 attention over its dequantized values (P exact): what the
    kernel computes up to P's rounding and the order of its sums; the reference its tests compare with."""
    H, S, D = q.shape[1:]
    G = k.shape[1]

    def blocks(x: Tensor, block: int) -> Tensor:
        n = x.shape[2]
        pad = torch.nn.functional.pad(x, (0, 0, 0, -n % block)).unflatten(2, (-1, block))  # (B, H, nb, block, D)
        amax = pad.abs().amax(dim=(3, 4), keepdim=True).clamp_min(1e-30)
        if qk_int8:  # to nearest, half away from zero, as the kernel rounds
            y = pad / (amax / 127)
            return (torch.sign(y) * torch.floor(y.abs() + 0.5) * (amax / 127)).flatten(2, 3)[:, :, :n]
        s = amax / E4M3_MAX
        return ((pad / s).to(torch.float8_e4m3fn).double() * s).flatten(2, 3)[:, :, :n]

    cfg = launch_config(causal)
    qd = blocks(q.double(), block_m or cfg.block_m)
    kd = blocks(k.double() - key_offset(k).double()[:, :, None], block_n or cfg.block_n)
    vs = v.double().abs().amax(dim=2, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    vd = (v.double() / vs).to(torch.float8_e4m3fn).double() * vs if pv_fp8 else v.double()
    kd, vd = (t.repeat_interleave(H // G, dim=1) for t in (kd, vd))
    scores = qd @ kd.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ vd


__all__ = ["FP8KV", "fp8_attention", "fp8_attention_emulated", "fp8_attention_fwd", "quantize_kv"]
