"""The pooled low-rank path's forward in two Triton launches (``rank.pooled_attention`` picks it): the
segment means of k and v (``_pooled_means``), then Nyström's output pass (``kernels.nystrom._nystrom_out``)
with V~ for its W. ``kernels.nystrom``'s docstring has the numerics of both paths."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.nystrom import (
    LOG2E,
    _block,
    _cdiv,
    _landmark,
    _launch_nystrom_out,
    _mean_params,
)
from adaattn.kernels.recorded import RecordedLaunches
from adaattn.kernels.runtime import Launcher, interpreter, last_dim_contiguous


@triton.jit
def _pooled_means(K, V, WS, off_w, S, rank,
                  sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                  n_kv_heads, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The pooled path's means (``rank.pooled_attention``): segment i of (batch, kv head) ``pid``, summed in
    fp32. K~ to WS[0:] and V~ to WS[off_w:], each (B, Hkv, rank, D) in the input dtype (WS's), as the
    PyTorch path rounds them."""
    i, pid = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    at = (pid * rank + i).to(tl.int64) * HEAD_DIM + d
    km = _landmark(K, sk_b, sk_h, sk_s, S, pid, n_kv_heads, i, rank, d, dmask, BLOCK_T, BLOCK_D)
    tl.store(WS + at, km.to(WS.dtype.element_ty), mask=dmask)
    vm = _landmark(V, sv_b, sv_h, sv_s, S, pid, n_kv_heads, i, rank, d, dmask, BLOCK_T, BLOCK_D)
    tl.store(WS + off_w + at, vm.to(WS.dtype.element_ty), mask=dmask)


_launch_pooled_means = Launcher(_pooled_means)


class _PooledPlan(NamedTuple):
    """The pooled forward's launch parameters: the means' (``_mean_params``) and the output pass's."""

    mean_rows: int
    mean_warps: int
    block_d: int
    block_m: int
    block_r: int
    one_block: bool
    warps: int
    stages: int


# the pooled output pass (products in the input dtype), by padded head dim: every landmark in one block
# up to POOLED_ONE_BLOCK_R, else (BLOCK_M, BLOCK_R, warps, stages) of the online-softmax loop. From a sweep
# of whole pooled calls on an H100 (bf16, 8 heads, S 8192 and 16384; head dim 64: 16-1024 landmarks, 128:
# 32-512): within 2% of the fastest of up to 44 configurations at every point from 128 landmarks up.
POOLED_ONE_BLOCK_R = {64: 64, 128: 32}
POOLED_LOOP = {64: (128, 64, 8, 3), 128: (64, 32, 4, 3)}
POOLED_ONE_BLOCK = (64, 4, 3)  # BLOCK_M, warps, stages


@functools.lru_cache(maxsize=256)
def _pooled_plan(S: int, D: int, rank: int) -> _PooledPlan:
    block_d, block_r = _block(D), _block(rank)
    means = _mean_params(_cdiv(S, rank), block_d)
    dk = max(64, block_d)
    if block_r <= POOLED_ONE_BLOCK_R[dk]:
        block_m, warps, stages = POOLED_ONE_BLOCK
        return _PooledPlan(*means, block_d, block_m, block_r, True, warps, stages)
    block_m, block_r, warps, stages = POOLED_LOOP[dk]
    return _PooledPlan(*means, block_d, block_m, block_r, False, warps, stages)


def pooled_forward(q: Tensor, k: Tensor, v: Tensor, rank: int, scale: float, rows: Tensor | None = None) -> Tensor:
    """softmax(q K~^T * scale) V~ over ``rank`` segment means of k and v, segments of equal size (no size
    bias), without autograd: two launches, the means (``_pooled_means``) and the output pass that
    Nyström's last launch is (``_nystrom_out``, with V~ for its W). q (B, Hq, L, D); k, v (B, Hkv, S, D),
    S a multiple of ``rank``; ``rows``: only these query rows. Output in q's dtype.

    K~ and V~ are stored in the input dtype, and with bf16 or fp16 inputs the output pass multiplies P by
    V~ in that dtype, as flash attention multiplies P by V: the path is then attention over r keys at
    flash's precision. (Nyström's W is an fp32 solve result, so its pass keeps P W at fp32 accuracy.)"""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if S % rank:
        raise ValueError(f"the fused pooled path needs S ({S}) a multiple of rank ({rank})")
    group = Hq // Hkv
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    p = _pooled_plan(S, D, rank)
    qr = q if rows is None else q[:, :, rows]
    Lr = qr.shape[2]
    ks, vs, qrs = k.stride(), v.stride(), qr.stride()
    launch = RecordedLaunches(_launch_pooled_means, ("pooled", B, Hq, Hkv, S, D, rank, Lr, q.device, q.dtype, k.dtype, v.dtype, ks, vs, qrs,
                        k.data_ptr() % 16, v.data_ptr() % 16, qr.data_ptr() % 16))
    off_w = B * Hkv * rank * D
    ws = torch.empty(2 * off_w, device=q.device, dtype=q.dtype)  # K~ | V~, per kv head
    launch(_launch_pooled_means, (rank, B * Hkv),
        k, v, ws, off_w, S, rank, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], Hkv,
        HEAD_DIM=D, BLOCK_T=p.mean_rows, BLOCK_D=p.block_d, num_warps=p.mean_warps)
    out = torch.empty(B, Hq, Lr, D, device=q.device, dtype=q.dtype)
    fp32 = q.dtype == torch.float32 or interpreter()
    launch(_launch_nystrom_out, (_cdiv(Lr, p.block_m), B * Hq),
        qr, ws, out, 0, off_w, Lr, rank, Hq, group, scale * LOG2E,
        qrs[0], qrs[1], qrs[2], Hq * Lr * D, Lr * D, D,  # out: (B, Hq, Lr, D), contiguous
        HEAD_DIM=D, BLOCK_M=p.block_m, BLOCK_R=p.block_r, BLOCK_D=p.block_d, FP32=fp32,
        ONE_BLOCK=p.one_block, LOWP=not fp32, W_PER_KV=True, num_warps=p.warps, num_stages=p.stages)
    launch.done()
    return out
