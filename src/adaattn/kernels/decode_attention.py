"""Decode attention over a KV cache that reads only the filled positions (split-K, "flash-decoding").

A decode step's query is one token a sequence; its keys and values are the cache's first ``length`` positions.
SDPA over the whole cache with a mask (``models.kv_cache.KVCache.mask``) reads all ``max_seq_len`` positions a
step however few are filled, and one (batch, head) pair is too little work to fill a GPU. Here:

- the cache's positions are cut into ``splits`` chunks, one program per (sequence, kv head, chunk); a program
  computes the chunk's partial softmax (its max, its sum and the weighted values, in fp32) for all the query
  heads that share the kv head (GQA: the group's rows ride one tile, each key and value read once), looping
  only over the chunk's filled positions: chunks past ``length`` return at once;
- a second kernel combines each (sequence, query head)'s chunks (rescaled by their maxima).

``length`` is a tensor (one per sequence, or one for all) read by the kernels on the device, so the launch is the
same every step and a CUDA graph replays it while the cache fills; ``splits`` depends only on the cache's shape.
``window``: only the last ``window`` filled positions (a sliding-window model's cache).

The models' fused decode step (``models.decode_step``) runs it for every layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.runtime import interpreter, use_triton

BLOCK_N = 64  # cache positions a loop step reads


def decode_attention_ref(q: Tensor, k: Tensor, v: Tensor, length: Tensor, window: int | None = None,
                         scale: float | None = None, length_offset: int = 0) -> Tensor:
    """q (B, H, D), k and v (B, G, M, D), ``length`` (B,) or () filled positions -> (B, H, D) in q's dtype;
    the softmax in fp32. Each query sees positions [length - window, length) (all from 0 without a window)."""
    B, H, D = q.shape
    G, M = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    slots = torch.arange(M, device=q.device)
    n = length.reshape(-1, 1).expand(B, 1) + length_offset
    seen = slots[None, :] < n
    if window is not None:
        seen &= slots[None, :] >= n - window
    kk = k.float().repeat_interleave(H // G, dim=1)  # (B, H, M, D)
    vv = v.float().repeat_interleave(H // G, dim=1)
    scores = torch.einsum("bhd,bhmd->bhm", q.float(), kk) * scale
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    return torch.einsum("bhm,bhmd->bhd", torch.softmax(scores, dim=-1), vv).to(q.dtype)


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, len_ptr, pacc_ptr, pm_ptr, pl_ptr,
                    G, M, CHUNK, SPLITS, len_stride, len_offset, scale,
                    sq_b, sq_h, sk_b, sk_g, sk_m, sv_b, sv_g, sv_m,
                    R: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr):
    bg, split = tl.program_id(0), tl.program_id(1)
    b, g = bg // G, bg % G
    if PDL:  # launched while the kernel before drains: wait for it before reading anything it wrote
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n_filled = tl.load(len_ptr + b * len_stride) + len_offset
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, n_filled)
    if WINDOW > 0:
        lo = tl.maximum(lo, n_filled - WINDOW)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    rmask = r < R
    q = tl.load(q_ptr + b * sq_b + (g * R + r)[:, None] * sq_h + d[None, :], mask=rmask[:, None], other=0.0)
    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, D), tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):  # nothing for a chunk past the filled positions
        pos = start + n
        nmask = pos < hi
        k = tl.load(k_ptr + b * sk_b + g * sk_g + pos[:, None] * sk_m + d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(v_ptr + b * sv_b + g * sv_g + pos[:, None] * sv_m + d[None, :], mask=nmask[:, None], other=0.0)
        if FP32:  # fp32 inputs exactly (not TF32), and the interpreter, whose reduced-precision tl.dot is wrong
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    row = (bg * SPLITS + split) * R + r  # partials laid out (B, G, SPLITS, R)
    tl.store(pm_ptr + row, m_i, mask=rmask)
    tl.store(pl_ptr + row, l_i, mask=rmask)
    tl.store(pacc_ptr + row[:, None] * D + d[None, :], acc, mask=rmask[:, None])


@triton.jit
def _combine_kernel(pacc_ptr, pm_ptr, pl_ptr, o_ptr, H, SPLITS, so_b, so_h,
                    R: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    g, r = h // R, h % R
    s = tl.arange(0, BLOCK_S)
    smask = s < SPLITS
    row = ((b * (H // R) + g) * SPLITS + s) * R + r  # (BLOCK_S,)
    m = tl.load(pm_ptr + row, mask=smask, other=float("-inf"))
    l = tl.load(pl_ptr + row, mask=smask, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # an empty chunk weighs nothing
    d = tl.arange(0, D)
    acc = tl.load(pacc_ptr + row[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(o_ptr + b * so_b + h * so_h + d, out.to(o_ptr.dtype.element_ty))


def num_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Chunks a cache is cut into: enough programs for about two waves of the GPU's SMs, each chunk at least one
    loop step; a function of the cache's shape alone (the same launch every step)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    most = triton.cdiv(max_seq_len, BLOCK_N)
    return max(1, min(most, triton.cdiv(2 * sms, batch * kv_heads)))


def launch_partials(q: Tensor, k: Tensor, v: Tensor, length: Tensor, window: int | None, scale: float | None,
                    pdl: bool, length_offset: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """The first kernel: each chunk's partials, (pacc (rows, D), pm (rows,), pl (rows,)) fp32 in rows (B, G, splits,
    R), and the number of chunks. ``pdl`` is already off in the interpreter."""
    B, H, D = q.shape
    G, M = k.shape[1], k.shape[2]
    R = H // G
    splits = num_splits(B, G, M, q.device)
    chunk = triton.cdiv(triton.cdiv(M, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(M, chunk)
    rows = B * G * splits * R
    pacc = torch.empty(rows, D, dtype=torch.float32, device=q.device)
    pm, pl = (torch.empty(rows, dtype=torch.float32, device=q.device) for _ in range(2))
    lengths = length.reshape(-1)
    _partial_kernel[(B * G, splits)](
        q, k, v, lengths, pacc, pm, pl, G, M, chunk, splits, 0 if lengths.numel() == 1 else 1, length_offset,
        D ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        R=R, D=D, WINDOW=window or 0, BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_N=BLOCK_N,
        FP32=q.dtype == torch.float32 or interpreter(), PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    return pacc, pm, pl, splits


def decode_attention_fwd(q: Tensor, k: Tensor, v: Tensor, length: Tensor, window: int | None = None,
                         scale: float | None = None, pdl: bool = False, length_offset: int = 0) -> Tensor:
    """The kernels: q (B, H, D), k and v (B, G, M, D) (last dim contiguous), ``length`` int (B,) or () on the
    same device -> (B, H, D). ``pdl``: launched with Programmatic Dependent Launch (Hopper and newer)."""
    B, H, D = q.shape
    pdl = pdl and not interpreter()
    pacc, pm, pl, splits = launch_partials(q, k, v, length, window, scale, pdl, length_offset)
    out = torch.empty_like(q)
    _combine_kernel[(B * H,)](pacc, pm, pl, out, H, splits, out.stride(0), out.stride(1),
                              R=H // k.shape[1], D=D, BLOCK_S=max(2, triton.next_power_of_2(splits)), PDL=pdl,
                              **({"launch_pdl": True} if pdl else {}))
    return out


@torch.library.custom_op("adaattn::decode_attention", mutates_args=())
def decode_attention_op(q: Tensor, k: Tensor, v: Tensor, length: Tensor, window: int | None,
                        scale: float | None, pdl: bool, length_offset: int) -> Tensor:
    return decode_attention_fwd(q, k, v, length, window, scale, pdl, length_offset)


@decode_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, length: Tensor, window: int | None, scale: float | None, pdl: bool,
      length_offset: int) -> Tensor:
    return torch.empty_like(q)


def check_decode_attention(q: Tensor, k: Tensor, v: Tensor, length: Tensor, window: int | None) -> None:
    """One line naming what is wrong, before any work."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"decode_attention takes q (B, H, D) and k, v (B, G, M, D) alike; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (B, H, D), G = q.shape, k.shape[1]
    if k.shape[0] != B or k.shape[3] != D or H % G:
        raise ValueError(f"decode_attention: k (B={k.shape[0]}, G={G}, M, D={k.shape[3]}) must match q's B={B} and "
                         f"D={D}, and G must divide H={H}")
    if D & (D - 1) or D < 16:
        raise ValueError(f"decode_attention: head dim {D} must be a power of two, at least 16")
    if length.dtype not in (torch.int32, torch.int64) or length.numel() not in (1, B):
        raise ValueError(f"decode_attention: length must be an int tensor of 1 or B={B} values; got "
                         f"{length.dtype} of {length.numel()}")
    if window is not None and window < 1:
        raise ValueError(f"decode_attention: window must be at least 1 or None; got {window}")


def decode_attention(q: Tensor, k: Tensor, v: Tensor, length: Tensor, window: int | None = None,
                     scale: float | None = None, pdl: bool = False, length_offset: int = 0) -> Tensor:
    """Attention of one new token a sequence over its cache's first ``length + length_offset`` positions (the
    last ``window`` of them with a window): q (B, H, D), k and v (B, G, M, D) -> (B, H, D). The kernels where
    they can run, else the reference; inference only (no gradient). The filled count is at least 1 (it is not
    read on the host); ``length_offset=1`` with the step's position as ``length`` saves computing it (a kernel
    under torch.compile). ``pdl``: the kernels launch with Programmatic Dependent Launch (Hopper and newer)."""
    check_decode_attention(q, k, v, length, window)
    if not use_triton(q, k, v, length) or q.requires_grad:
        return decode_attention_ref(q, k, v, length, window, scale, length_offset)
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    q = q if q.stride(-1) == 1 else q.contiguous()
    if torch.compiler.is_compiling():
        return decode_attention_op(q, k, v, length, window, scale, pdl, length_offset)
    return decode_attention_fwd(q, k, v, length, window, scale, pdl, length_offset)


__all__ = ["decode_attention", "decode_attention_ref", "num_splits"]
