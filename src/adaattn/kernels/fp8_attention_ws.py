"""The 8-bit attention forward warp-specialized in Gluon, for Hopper (issue 68): work in progress, correct on an H200
and slower there than the Triton kernel (docs/notebook.md, 2026-11-29), so not used by ``fp8_attention`` or
AdaAttention; the precision study does not measure it.

Why: the Triton kernel (``kernels.fp8_attention``) reaches about cuDNN bf16's speed, where FlashAttention-3's FP8
forward reaches 1.45-1.56x its bf16 by warp specialization: producer warps on TMA, consumer warpgroups on the
tensor cores and the softmax (docs/notebook.md, 2026-11-28, twenty-second session, item 8). Upstream Triton does
not warp-specialize on Hopper; Gluon lets a kernel do it by hand (``gl.warp_specialize``).

- A producer warp loads each key block's K (int8) and V (transposed, e4m3) by TMA into a ring of ``STAGES``
  shared-memory stages, each with a ready and an empty mbarrier.
- The consumer warps (the default partition) quantize their Q block in registers (int8 over its amax / 127, as
  the Triton kernel does), then per key block: Q·K on the int8 tensor cores (int32 sums), the online softmax in
  fp32 with P scaled to e4m3's range, P·V on the FP8 tensor cores, the stage released.
- Inputs and output as ``fp8_attention_fwd``'s, from the same ``quantize_kv`` (int8 Q·K, P·V in FP8).

Compiled for sm_90 on a CPU (``sm90_ptx``; Triton 3.9: no local memory, int8 and e4m3 wgmma); the GPU box runs
Triton 3.6, whose TMA load is ``async_copy_global_to_shared`` (3.9: ``async_load``): one alias serves both. Not
done: FA3's ping-pong between the warpgroups, the quantization pass fused into the producer, a custom op.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from adaattn.kernels.fp8_attention import FP8KV
from adaattn.kernels.nystrom import LOG2E

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
LOG2_448 = gl.constexpr(8.807354922057604)


@gluon.jit
def _producer(k_desc, v_desc, k_bufs, v_bufs, ready, empty, kv_row, vt_row, lo, hi,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    i = 0
    for start in range(lo, hi, BLOCK_N):
        st = i % STAGES
        mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # a fresh barrier counts as released
        mbarrier.expect(ready.index(st), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row + start, 0], ready.index(st), k_bufs.index(st))
        _tma_load(v_desc, [vt_row, start], ready.index(st), v_bufs.index(st))
        i += 1


@gluon.jit
def _block(acc, l_i, m_i, i, start, q8, q_scale, ks_ptr, k_bufs, v_bufs, ready, empty, m, n0, Skv, qk_scale,
           MASK: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
           s_layout: gl.constexpr, o_layout: gl.constexpr, pa_layout: gl.constexpr):
    st = i % STAGES
    mbarrier.wait(ready.index(st), (i // STAGES) & 1)
    k_s = k_bufs.index(st)
    zero = gl.zeros([q8.shape[0], BLOCK_N], gl.int32, s_layout)
    s_int = warpgroup_mma(q8, k_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    s_int = warpgroup_mma_wait(0, deps=(s_int, ))
    s = s_int.to(gl.float32) * (q_scale * gl.load(ks_ptr + start // BLOCK_N) * qk_scale)
    if MASK:
        n = start + n0
        keep = (n < Skv)[None, :]
        if CAUSAL:
            keep = keep & (n[None, :] <= m[:, None])
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    # P in [0, 448]: its row's maximum less log2(448) in exp2's argument; the row sum in the same scale
    p = gl.exp2(s - (m_new - LOG2_448)[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p8 = gl.convert_layout(p.to(gl.float8e4nv), pa_layout)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    v_s = v_bufs.index(st)
    acc = warpgroup_mma(p8, v_s.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(empty.index(st), count=1)
    return acc, l_i, m_new


@gluon.jit
def _consumer(q_ptr, ks_ptr, vs_ptr, o_ptr, k_bufs, v_bufs, ready, empty, q_row, o_row, ks_row, vs_row, mblk, S,
              Skv, qk_scale, lo, split, hi, sq_s, so_s,
              CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              STAGES: gl.constexpr, num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 32])
    qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4)
    pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    # Q's block in int8 over its amax / 127, rounded half away from 0 (the library kernel's quantization)
    mq = mblk * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, ld))
    dq = gl.arange(0, D, gl.SliceLayout(0, ld))
    q = gl.load(q_ptr + q_row + mq[:, None] * sq_s + dq[None, :], mask=(mq < S)[:, None], other=0.0).to(gl.float32)
    q_scale = gl.maximum(gl.max(gl.max(gl.abs(q), axis=1), axis=0), 1e-30) / 127.0
    y = q / q_scale
    q8 = gl.convert_layout(gl.where(y >= 0, y + 0.5, y - 0.5).to(gl.int8), qa_layout)

    m = mblk * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
    n0 = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    i = 0
    for start in range(lo, split, BLOCK_N):  # whole blocks below the diagonal / inside the sequence: no mask
        acc, l_i, m_i = _block(acc, l_i, m_i, i, start, q8, q_scale, ks_ptr + ks_row, k_bufs, v_bufs, ready, empty,
                               m, n0, Skv, qk_scale, False, CAUSAL, BLOCK_N, STAGES, s_layout, o_layout, pa_layout)
        i += 1
    for start in range(split, hi, BLOCK_N):  # the diagonal block, a ragged tail
        acc, l_i, m_i = _block(acc, l_i, m_i, i, start, q8, q_scale, ks_ptr + ks_row, k_bufs, v_bufs, ready, empty,
                               m, n0, Skv, qk_scale, True, CAUSAL, BLOCK_N, STAGES, s_layout, o_layout, pa_layout)
        i += 1

    mo = mblk * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, o_layout))
    do = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    vs = gl.load(vs_ptr + vs_row + do)  # V's per-channel scale, once on the output
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None] * vs[None, :]
    gl.store(o_ptr + o_row + mo[:, None] * so_s + do[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(mo < S)[:, None])


@gluon.jit
def _fp8_attention_ws_kernel(q_ptr, k_desc, v_desc, ks_ptr, vs_ptr, o_ptr, qk_scale, S, Skv, H, G, nq, nk,
                             sq_b, sq_h, sq_s, so_b, so_h, so_s,
                             CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                             STAGES: gl.constexpr, num_warps: gl.constexpr):
    pid, bh = gl.program_id(0), gl.program_id(1)
    mblk = nq - 1 - pid if CAUSAL else pid  # causal: the longest rows first
    b = bh // H
    h = bh % H
    bg = b * G + h // (H // G)
    if CAUSAL:
        hi = gl.minimum(Skv, (mblk + 1) * BLOCK_M)
        split = mblk * BLOCK_M
    else:
        hi = Skv
        split = Skv // BLOCK_N * BLOCK_N
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    gl.warp_specialize([
        (_consumer, (q_ptr, ks_ptr, vs_ptr, o_ptr, k_bufs, v_bufs, ready, empty, b * sq_b + h * sq_h,
                     b * so_b + h * so_h, bg * nk, bg * D, mblk, S, Skv, qk_scale, 0, split, hi, sq_s, so_s,
                     CAUSAL, BLOCK_M, BLOCK_N, D, STAGES, num_warps)),
        (_producer, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, bg * Skv, bg * D, 0, hi, BLOCK_N, STAGES)),
    ], [1], [24])


def fp8_attention_ws(q: Tensor, kv: FP8KV, causal: bool, scale: float, block_m: int = 128, num_warps: int = 8,
                     stages: int = 2, maxnreg: int = 168) -> Tensor:
    """``fp8_attention_fwd``'s attention by the warp-specialized kernel: q (B, H, S, D) bf16 or fp16 (last dim
    contiguous), ``kv`` from ``quantize_kv`` with int8 Q·K and P·V in FP8; (B, H, S, D) in q's dtype. ``block_m``
    query rows a program on ``num_warps`` consumer warps (a warpgroup per 64 rows); ``maxnreg`` registers a
    thread before the partitions' reallocation (the producer keeps 24)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, H, S, D = q.shape
    G, Skv, BN = kv.k.shape[1], kv.k.shape[2], kv.block_n
    if kv.k.dtype != torch.int8 or kv.v_scale is None:
        raise ValueError("fp8_attention_ws: kv must come from quantize_kv with qk_int8=True and pv_fp8=True")
    k_layout = gl.NVMMASharedLayout.get_default_for([BN, D], gl.int8)
    v_layout = gl.NVMMASharedLayout.get_default_for([D, BN], gl.float8e4nv)
    vt = kv.v.view(B * G * D, Skv)
    if Skv % 16:  # TMA wants 16-byte row strides: V^T's rows padded (a copy, for ragged lengths only)
        vt = torch.nn.functional.pad(vt, (0, -Skv % 16))[:, :Skv]
    k_desc = TensorDescriptor.from_tensor(kv.k.view(B * G * Skv, D), [BN, D], k_layout)
    v_desc = TensorDescriptor.from_tensor(vt, [D, BN], v_layout)
    out = torch.empty(B, H, S, D, dtype=q.dtype, device=q.device)
    nq = triton.cdiv(S, block_m)
    _fp8_attention_ws_kernel[(nq, B * H)](
        q, k_desc, v_desc, kv.k_scale, kv.v_scale, out, scale * LOG2E, S, Skv, H, G, nq, kv.k_scale.shape[2],
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=BN, D=D, STAGES=stages, num_warps=num_warps, maxnreg=maxnreg)
    return out


def sm90_ptx(causal: bool, block_m: int = 128, block_n: int = 128, d: int = 128, num_warps: int = 8,
             stages: int = 2, maxnreg: int = 168) -> str:
    """The kernel compiled for sm_90 without a GPU (Gluon's ``triton.compile`` with an explicit target): its PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kl = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.int8)
    vl = gl.NVMMASharedLayout.get_default_for([d, block_n], gl.float8e4nv)
    sig = {"q_ptr": "*bf16", "k_desc": f"tensordesc<i8[{block_n}, {d}],{kl!r}>",
           "v_desc": f"tensordesc<fp8e4nv[{d}, {block_n}],{vl!r}>", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
           "o_ptr": "*bf16", "qk_scale": "fp32", **{n: "i32" for n in ("S", "Skv", "H", "G", "nq", "nk", "sq_b", "sq_h",
                                                                     "sq_s", "so_b", "so_h", "so_s")},
           **{n: "constexpr" for n in ("CAUSAL", "BLOCK_M", "BLOCK_N", "D", "STAGES", "num_warps")}}
    consts = {"CAUSAL": causal, "BLOCK_M": block_m, "BLOCK_N": block_n, "D": d, "STAGES": stages,
              "num_warps": num_warps}
    src = GluonASTSource(_fp8_attention_ws_kernel, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "maxnreg": maxnreg}).asm["ptx"]
