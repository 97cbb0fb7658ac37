"""Nyström attention forward in four Triton launches (inference; ``rank.nystrom_attention`` picks it);
the pooled low-rank path's forward (``kernels.pooled``) reuses its landmark means and output pass.

The PyTorch path runs some 90 small launches per call (segment means, softmaxes, casts, 6
iterations of a 4-matmul pseudo-inverse), so on a GPU its time per call is host time and hardly
depends on S. Here the same maths runs in four kernels, all fp32 intermediates in one workspace:

1. ``_landmarks``: the segment means Q~ (fp32) and K~ (rounded to the input dtype), one program
   per landmark and head.
2. ``_bv_partial``: b v = softmax(Q~ k^T) v, the landmark queries attending to every key: a flash
   forward over splits of the keys (split-K, as flash-decoding: r landmark rows are too few
   programs for one pass over S), writing each split's row max, row sum and unnormalised
   product. GQA: the landmark rows of a kv head's g query heads are stacked, k and v read once.
3. ``_landmark_solve``: one program per query head merges the splits, builds the r x r kernel
   softmax(Q~ K~^T), runs the Newton-Schulz pseudo-inverse in registers and writes
   W = pinv(kernel) (b v), an (r, D) fp32 matrix. Past ``MAX_FUSED_SOLVE_RANK`` landmarks (or
   its tile limit at head dim 128) the iterates no longer fit one program, and one head's solve
   on one SM would be most of the call's time: ``nystrom_solve._solve_batched`` runs the same maths as
   batched fp32 matmuls over all heads. Those are some 35 launches: on the H100 host of the rank
   study their issue took 1.8 ms per call and the GPU 0.97 ms with the gaps between them (scratch
   timing, 256 landmarks, 8 heads), so on a GPU they are captured once per kind of call as a CUDA
   graph and replayed: 0.05 ms of host time and 0.42 ms on the GPU there, the same bits
   (``_SolveGraph``). Below that rank the one-program solve was faster than the graphed one at
   every shape tried (S 4096-16384, 8-32 heads, 16-128 landmarks).
4. ``_nystrom_out``: out = softmax(q K~^T) W, a flash forward with r keys (in blocks of at most
   128, an online softmax across them).

The pooled low-rank path (``rank.pooled_attention``, ``pooled.pooled_forward``) is two launches:
``_pooled_means`` (K~ and V~ summed in fp32, stored in the input dtype) and ``_nystrom_out`` with V~
for W. V~ holds input-dtype values, so there P V~ runs in the input dtype (bf16 / fp16 inputs), as
flash attention's P V: the path is attention over r keys at flash's precision. In fp32 (tf32x3, as
Nyström's W) the product bounded the pass: on the H100 of the rank study, P V~ in tf32x3 made the
pass several times slower at 256-1024 landmarks (scratch sweep).

Numerics: what the module docstring of ``rank`` requires in fp32 (landmarks, Q~ k^T, b v, the
r x r kernel and its pseudo-inverse, W) runs as fp32 products on tensor cores at fp32 accuracy:
three TF32 products (``input_precision="tf32x3"``), or two where one operand is exact in TF32
(bf16 and fp16 k and v: ``_split_tf32``). q K~^T runs in the input dtype with fp32 accumulation
(fp32 inputs: tf32x3); the batched solve is fp32 matmuls (TF32 only where the user allows it
for every fp32 matmul). Ranks up to ``MAX_RANK`` and head dims up to ``MAX_HEAD_DIM``; beyond
them, and whenever autograd needs the graph, the PyTorch path runs. The pseudo-inverse's 48 r^3
flops per head grow fastest with the rank: they bound the rank at which the low-rank path pays.
Launch parameters are fixed (below), not tuned per shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.nystrom_solve import _SOLVE_LOCK, _solve_batched, _SolveGraph
from adaattn.kernels.recorded import RecordedLaunches
from adaattn.kernels.runtime import (
    Launcher,
    interpreter,
    last_dim_contiguous,
    programs_for,
)

MAX_RANK = 1024  # landmarks of the Triton path
MAX_FUSED_SOLVE_RANK = 128  # the r x r solve in one program per head up to here
MAX_HEAD_DIM = 128
MAX_RANK_X_HEAD_DIM = 128 * 64  # fused solve: padded rank x padded head dim (128 x 128 fails on an H100)
LOG2E = 1.4426950408889634


@triton.jit
def _dot32(a, b):
    """fp32 x fp32 product at fp32 accuracy on tensor cores (three TF32 products)."""
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _split_tf32(x):
    """x = hi + lo with hi exact in TF32 (the low 13 mantissa bits cleared): a product with an
    operand that is exact in TF32 (bf16 or fp16 values) is then two TF32 products at fp32 accuracy."""
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _segment_sum(base, stride, lo, hi, d, dmask, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 sum of rows lo .. hi - 1 (row stride ``stride``) of a (rows, D) slice."""
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        x = tl.load(base + t[:, None].to(tl.int64) * stride + d[None, :], mask=(t < hi)[:, None] & dmask[None, :],
                    other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
    return acc


@triton.jit
def _landmark(X, sx_b, sx_h, sx_s, n, pid, n_heads, i, rank, d, dmask, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 landmark i of (batch, head) ``pid`` of X (B, H, n, D): the mean of its segment i."""
    b = pid // n_heads
    h = pid % n_heads
    lo = (i * n) // rank
    hi = ((i + 1) * n) // rank
    base = X + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    return _segment_sum(base, sx_s, lo, hi, d, dmask, BLOCK_T, BLOCK_D) / (hi - lo)


@triton.jit
def _landmarks(Q, K, WS, off_kl, Lq, S, rank, n_q_heads, n_kv_heads, n_q_programs,
               sq_b, sq_h, sq_l, sk_b, sk_h, sk_s,
               HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Landmark i = program 0 of every q head (programs 1 < n_q_programs) and kv head (the rest):
    the mean of rows floor(i n / rank) .. floor((i + 1) n / rank) - 1, as ``rank._segment_means``.
    Q~ to WS[0 : B Hq rank D] in fp32, K~ to WS[off_kl:] as (B, Hkv, rank, D), rounded to the
    input dtype (fp32 holding those values: every later product uses the same rounded K~)."""
    i, pid = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    if pid < n_q_programs:
        m = _landmark(Q, sq_b, sq_h, sq_l, Lq, pid, n_q_heads, i, rank, d, dmask, BLOCK_T, BLOCK_D)
        tl.store(WS + (pid * rank + i).to(tl.int64) * HEAD_DIM + d, m, mask=dmask)
    else:
        pk = pid - n_q_programs
        m = _landmark(K, sk_b, sk_h, sk_s, S, pk, n_kv_heads, i, rank, d, dmask, BLOCK_T, BLOCK_D)
        tl.store(WS + off_kl + (pk * rank + i).to(tl.int64) * HEAD_DIM + d,
                 m.to(K.dtype.element_ty).to(tl.float32), mask=dmask)


@triton.jit
def _bv_partial(WS, K, V, off_m, off_l, off_acc,
                n_rows, S, chunk, n_kv_heads, qk_scale,
                sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                KV_TF32: tl.constexpr):
    """Landmark rows [pid_m BLOCK_M, +BLOCK_M) of kv head pid_bh against keys of split pid_s.
    In the fp32 workspace WS: Q~ at 0 as (B * Hkv, n_rows, HEAD_DIM); the partials (B * Hkv,
    splits, n_rows[, HEAD_DIM]) at the offsets, the max in log2 units (scores times log2 e).
    KV_TF32: k and v are exact in TF32 (bf16, fp16), so each product is two TF32 products."""
    QL, M_out, L_out, ACC_out = WS, WS + off_m, WS + off_l, WS + off_acc
    pid_m, pid_bh, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_splits = tl.num_programs(2)
    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    dmask = d < HEAD_DIM
    ql = tl.load(QL + (pid_bh * n_rows + rows[:, None]).to(tl.int64) * HEAD_DIM + d[None, :],
                 mask=rmask[:, None] & dmask[None, :], other=0.0)
    ql = ql * qk_scale  # scale * log2(e): exp2 below
    ql_hi, ql_lo = _split_tf32(ql)
    k_base = K + b.to(tl.int64) * sk_b + h.to(tl.int64) * sk_h
    v_base = V + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, S)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        kv_mask = nmask[:, None] & dmask[None, :]
        kt = tl.load(k_base + n[:, None].to(tl.int64) * sk_s + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        if KV_TF32:
            s = tl.dot(ql_hi, tl.trans(kt), input_precision="tf32")
            s = tl.dot(ql_lo, tl.trans(kt), s, input_precision="tf32")
        else:
            s = _dot32(ql, tl.trans(kt))
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + n[:, None].to(tl.int64) * sv_s + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        if KV_TF32:
            p_hi, p_lo = _split_tf32(p)
            acc = tl.dot(p_lo, vt, acc * alpha[:, None], input_precision="tf32")
            acc = tl.dot(p_hi, vt, acc, input_precision="tf32")
        else:
            acc = acc * alpha[:, None] + _dot32(p, vt)
        m_i = m_new
    part = (pid_bh * n_splits + pid_s).to(tl.int64) * n_rows + rows
    tl.store(M_out + part, m_i, mask=rmask)
    tl.store(L_out + part, l_i, mask=rmask)
    tl.store(ACC_out + part[:, None] * HEAD_DIM + d[None, :], acc, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _landmark_solve(WS, off_kl, off_m, off_l, off_acc, off_w,
                    rank, n_splits, n_heads, group, qk_scale, iters,
                    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                    MERGE_STAGES: tl.constexpr):
    """Query head pid: W = pinv(softmax(Q~ K~^T)) (b v), (rank, HEAD_DIM) fp32.
    WS as in ``_bv_partial`` and ``_landmarks``; W to WS[off_w:] as (B, Hq, rank, HEAD_DIM)."""
    KL = WS + off_kl
    QL, M_part, L_part, ACC_part, W_out = WS, WS + off_m, WS + off_l, WS + off_acc, WS + off_w
    pid = tl.program_id(0)
    b = pid // n_heads
    hq = pid % n_heads
    n_kv_heads = n_heads // group
    kv = b * n_kv_heads + hq // group
    j = hq % group  # which of the kv head's stacked landmark blocks
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rmask = r < rank
    tile_mask = rmask[:, None] & (d < HEAD_DIM)[None, :]

    # b v: merge the key splits (rows j rank + r of the kv head's partials)
    n_rows = group * rank
    m = tl.zeros([BLOCK_R], tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    bv = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for sp in tl.range(0, n_splits, num_stages=MERGE_STAGES):
        part = (kv * n_splits + sp).to(tl.int64) * n_rows + j * rank + r
        m_s = tl.load(M_part + part, mask=rmask, other=0.0)
        l_s = tl.load(L_part + part, mask=rmask, other=0.0)
        acc_s = tl.load(ACC_part + part[:, None] * HEAD_DIM + d[None, :], mask=tile_mask, other=0.0)
        m_new = tl.where(sp == 0, m_s, tl.maximum(m, m_s))
        alpha = tl.where(sp == 0, 0.0, tl.exp2(m - m_new))
        beta = tl.exp2(m_s - m_new)
        l = l * alpha + l_s * beta
        bv = bv * alpha[:, None] + acc_s * beta[:, None]
        m = m_new
    bv = tl.where(rmask[:, None], bv / tl.where(rmask, l, 1.0)[:, None], 0.0)

    # the landmark kernel a = softmax(Q~ K~^T), padded rows and columns zero
    ql = tl.load(QL + (pid * rank + r[:, None]).to(tl.int64) * HEAD_DIM + d[None, :], mask=tile_mask, other=0.0)
    kl = tl.load(KL + (kv * rank + r[:, None]).to(tl.int64) * HEAD_DIM + d[None, :], mask=tile_mask, other=0.0)
    s = _dot32(ql * qk_scale, tl.trans(kl))
    s = tl.where((c < rank)[None, :], s, float("-inf"))
    p = tl.exp2(s - tl.max(s, 1)[:, None])
    a = tl.where(rmask[:, None], p / tl.sum(p, 1)[:, None], 0.0)

    # Newton-Schulz pseudo-inverse (Razavi et al. 2014), as rank._pinv; the zero padding stays zero
    eye = (r[:, None] == c[None, :]).to(tl.float32)
    norm = tl.max(tl.sum(tl.abs(a), 1), 0) * tl.max(tl.sum(tl.abs(a), 0), 0)
    z = tl.trans(a) / norm
    for _ in range(iters):
        az = _dot32(a, z)
        t = 7.0 * eye - az
        t = 15.0 * eye - _dot32(az, t)
        t = 13.0 * eye - _dot32(az, t)
        z = 0.25 * _dot32(z, t)
    w = _dot32(z, bv)
    tl.store(W_out + (pid * rank + r[:, None]).to(tl.int64) * HEAD_DIM + d[None, :], w, mask=tile_mask)


@triton.jit
def _out_scores(q, KL, W, kv, wh, rank, r, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                FP32: tl.constexpr):
    """Scores q K~^T (log2 units, padded landmarks -inf) and the rows of W's head ``wh`` of landmarks ``r``."""
    d = tl.arange(0, BLOCK_D)
    lmask = (r < rank)[:, None] & (d < HEAD_DIM)[None, :]
    kl = tl.load(KL + (kv * rank + r[:, None]).to(tl.int64) * HEAD_DIM + d[None, :], mask=lmask, other=0.0)
    if FP32:  # fp32 inputs; also the interpreter, whose bf16 tl.dot is wrong (Triton 3.9)
        s = _dot32(q.to(tl.float32), tl.trans(kl.to(tl.float32)))
    else:  # K~ holds values of q's dtype: the cast is exact
        s = tl.dot(q, tl.trans(kl.to(q.dtype)))
    s = tl.where((r < rank)[None, :], s * qk_scale, float("-inf"))
    w = tl.load(W + (wh * rank + r[:, None]).to(tl.int64) * HEAD_DIM + d[None, :], mask=lmask, other=0.0)
    return s, w


@triton.jit
def _p_times_w(p, w, dtype, LOWP: tl.constexpr):
    """P W: LOWP, P rounded to ``dtype`` (flash attention's rounding; W holds values of ``dtype``), else
    at fp32 accuracy (tf32x3)."""
    if LOWP:
        return tl.dot(p.to(dtype), w.to(dtype))
    return _dot32(p, w.to(tl.float32))


@triton.jit
def _nystrom_out(Q, WS, O, off_kl, off_w, L, rank, n_heads, group, qk_scale,
                 sq_b, sq_h, sq_l, so_b, so_h, so_l,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 FP32: tl.constexpr, ONE_BLOCK: tl.constexpr, LOWP: tl.constexpr, W_PER_KV: tl.constexpr):
    """Rows [pid_m BLOCK_M, +BLOCK_M) of query head pid_bh: softmax(q K~^T) W, W at WS[off_w:], one per
    query head (W_PER_KV: per kv head). ONE_BLOCK: every landmark in one block of BLOCK_R (up to the fused
    solve's rank); otherwise blocks of BLOCK_R with an online softmax across them (a loop costs the single
    block ~15%). LOWP: P W in q's dtype (``_p_times_w``)."""
    KL, W = WS + off_kl, WS + off_w
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b = pid_bh // n_heads
    hq = pid_bh % n_heads
    kv = b * (n_heads // group) + hq // group
    wh = kv if W_PER_KV else pid_bh
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dmask = (d < HEAD_DIM)[None, :]
    qmask = (rows < L)[:, None] & dmask
    q = tl.load(Q + b.to(tl.int64) * sq_b + hq.to(tl.int64) * sq_h + rows[:, None].to(tl.int64) * sq_l + d[None, :],
                mask=qmask, other=0.0)
    if ONE_BLOCK:
        s, w = _out_scores(q, KL, W, kv, wh, rank, tl.arange(0, BLOCK_R), qk_scale, HEAD_DIM, BLOCK_D, FP32)
        p = tl.exp2(s - tl.max(s, 1)[:, None])
        if LOWP:  # P unnormalised in the low-precision product, as flash attention: one rounding of P
            o = _p_times_w(p, w, q.dtype, LOWP) / tl.sum(p, 1)[:, None]
        else:
            o = _p_times_w(p / tl.sum(p, 1)[:, None], w, q.dtype, LOWP)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            s, w = _out_scores(q, KL, W, kv, wh, rank, r0 + tl.arange(0, BLOCK_R), qk_scale, HEAD_DIM, BLOCK_D,
                               FP32)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _p_times_w(p, w, q.dtype, LOWP)
            m_i = m_new
        o = acc / l_i[:, None]
    tl.store(O + b.to(tl.int64) * so_b + hq.to(tl.int64) * so_h + rows[:, None].to(tl.int64) * so_l + d[None, :],
             o.to(O.dtype.element_ty), mask=qmask)


def supported(q: Tensor, rank: int) -> str | None:
    """None when the Triton path can run these shapes, else why not."""
    if rank > MAX_RANK:
        return f"rank {rank} > {MAX_RANK} (the Triton path's landmark limit)"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    return None


def fused_solve(rank: int, head_dim: int) -> bool:
    """Whether the r x r solve runs fused in one program per head (else batched fp32 matmuls)."""
    return rank <= MAX_FUSED_SOLVE_RANK and _block(rank) * _block(head_dim) <= MAX_RANK_X_HEAD_DIM


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())  # the next power of two, at least 16


# launch parameters, fixed: chosen from a sweep of kernel times on an H100 (S = 8192, 8 heads, D = 64,
# ranks 16-128); the rank study records the kernel time of the fused path at each rank and length
BV_BLOCK_N = 64  # keys per step of the b v pass
BV_PROGRAMS_PER_SM = 1  # the key splits fill about this many programs per SM
# a segment mean's step: the segment's rows (a power of two, 16 to MEAN_MAX_ROWS; a wider step than the
# segment only loads masked rows) times the padded head dim, at most MEAN_MAX_TILE elements, with a warp
# per MEAN_PER_WARP of them (2-16 warps). From a sweep of the pooled means kernel on an H100 (bf16, 8 heads,
# head dim 64, S 8192 and 16384, segments of 16-1024 rows, tiles of 2048-32768 elements, 2-16 warps):
# the fastest at every segment length tried had a step within 2x of the segment's rows and 1024-2048
# elements per warp; the rule takes the segment's rows and the lower end. The fixed step it replaced (8192
# elements, 4 warps) took more than twice as long at both ends of the sweep.
MEAN_MAX_ROWS = 512
MEAN_MAX_TILE = 32768
MEAN_PER_WARP = 1024
SOLVE_WARPS = {16: 4, 32: 4, 64: 4, 128: 8}  # by padded rank
MERGE_STAGES = 3
OUT_BLOCK_M = {16: 64, 32: 64, 64: 64, 128: 64}  # by padded rank (head dim <= 64; halved above)
OUT_MAX_BLOCK_R = 128  # landmarks per step of the output pass (head dim <= 64; halved above)
OUT_WARPS = 4


_launch_landmarks, _launch_bv_partial, _launch_landmark_solve, _launch_nystrom_out = (
    Launcher(k) for k in (_landmarks, _bv_partial, _landmark_solve, _nystrom_out))


@dataclass(frozen=True)
class _Plan:
    """A shape's launch parameters and workspace layout (offsets in fp32 elements)."""

    block_d: int
    block_r: int
    bv_block_m: int
    m_blocks: int
    splits: int
    chunk: int
    n_rows: int
    off_kl: int
    off_m: int
    off_l: int
    off_acc: int
    off_w: int
    numel: int
    fused: bool
    out_block_m: int
    out_block_r: int
    out_one_block: bool


def _cdiv(a: int, b: int) -> int:  # plain ints: triton.cdiv is a constexpr function, slower on the host
    return -(-a // b)


@functools.lru_cache(maxsize=256)
def _plan(B: int, Hq: int, Hkv: int, S: int, D: int, rank: int, device: torch.device) -> _Plan:
    """Computed once per shape: on the GPU machine's host this integer work cost more than a launch."""
    group = Hq // Hkv
    block_d, block_r = _block(D), _block(rank)
    n_rows = group * rank  # landmark rows per kv head
    bv_block_m = min(32 if block_d > 64 else 64, _block(n_rows))
    m_blocks = _cdiv(n_rows, bv_block_m)
    want = programs_for(1 << 30, device, per_sm=BV_PROGRAMS_PER_SM)
    splits = max(1, min(_cdiv(S, BV_BLOCK_N), want // (m_blocks * B * Hkv)))
    chunk = _cdiv(_cdiv(S, splits), BV_BLOCK_N) * BV_BLOCK_N
    splits = _cdiv(S, chunk)
    # workspace: Q~ | K~ | row max | row sum | unnormalised b v per split | W
    n_ql = B * Hq * rank * D
    n_part = B * Hkv * splits * n_rows
    off_kl = n_ql
    off_m = off_kl + B * Hkv * rank * D
    off_l, off_acc = off_m + n_part, off_m + 2 * n_part
    off_w = off_acc + n_part * D
    return _Plan(block_d, block_r, bv_block_m, m_blocks, splits, chunk, n_rows, off_kl, off_m, off_l, off_acc, off_w,
                 off_w + n_ql, fused_solve(rank, D), *_out_params(block_d, block_r))


def _out_params(block_d: int, block_r: int) -> tuple[int, int, bool]:
    """``_nystrom_out``'s (BLOCK_M, BLOCK_R, ONE_BLOCK) for a padded head dim and rank."""
    halve = 2 if block_d > 64 else 1
    out_block_r = min(block_r, OUT_MAX_BLOCK_R // halve)
    return OUT_BLOCK_M[out_block_r] // halve, out_block_r, block_r <= OUT_MAX_BLOCK_R // halve


def nystrom_forward(q: Tensor, k: Tensor, v: Tensor, rank: int, scale: float, pinv_iters: int,
                    rows: Tensor | None = None) -> Tensor:
    """softmax(q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ k^T) v with ``rank`` segment-mean
    landmarks, without autograd: four launches (landmarks, b v over key splits, the r x r solve,
    the output). q (B, Hq, L, D); k, v (B, Hkv, S, D); ``rows``: only these query rows of the
    output (the landmarks still come from every row). Output (B, Hq, L or len(rows), D) in q's
    dtype. Every fp32 intermediate lives in one workspace allocation (few host calls per call)."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = Hq // Hkv
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    qk_scale = scale * LOG2E
    p = _plan(B, Hq, Hkv, S, D, rank, q.device)
    qr = q if rows is None else q[:, :, rows]
    Lr = qr.shape[2]
    # the workspace and the output are fresh allocations: aligned, strides set by the shape
    qs, ks, vs, qrs = q.stride(), k.stride(), v.stride(), qr.stride()
    launch = RecordedLaunches(_launch_landmarks, (B, Hq, Hkv, L, S, D, rank, Lr, pinv_iters, q.device, q.dtype, k.dtype, v.dtype, qs, ks, vs,
                        qrs, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, qr.data_ptr() % 16))
    solve = None if p.fused else functools.partial(_solve_batched, B=B, Hq=Hq, Hkv=Hkv, rank=rank, D=D, splits=p.splits,
                                                   off_kl=p.off_kl, off_m=p.off_m, off_acc=p.off_acc, off_w=p.off_w,
                                                   scale=scale, pinv_iters=pinv_iters)
    # the batched solve's workspace may persist (``_SolveGraph``): one call's launches at a time, in order
    if solve is not None:
        _SOLVE_LOCK.acquire()
    try:
        # the solve's kind: every argument it takes (the plan holds the workspace layout: the key splits vary with S)
        graph = None if solve is None else _SolveGraph.get((B, Hq, Hkv, rank, D, p, scale, pinv_iters), p.numel,
                                                           q.device, solve)
        ws = torch.empty(p.numel, device=q.device, dtype=torch.float32) if graph is None else graph.ws

        mean_rows, mean_warps = _mean_params(_cdiv(max(L, S), rank), p.block_d)
        launch(_launch_landmarks, (rank, B * (Hq + Hkv)),
            q, k, ws, p.off_kl, L, S, rank, Hq, Hkv, B * Hq,
            qs[0], qs[1], qs[2], ks[0], ks[1], ks[2],
            HEAD_DIM=D, BLOCK_T=mean_rows, BLOCK_D=p.block_d, num_warps=mean_warps)
        launch(_launch_bv_partial, (p.m_blocks, B * Hkv, p.splits),
            ws, k, v, p.off_m, p.off_l, p.off_acc, p.n_rows, S, p.chunk, Hkv, qk_scale,
            ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
            HEAD_DIM=D, BLOCK_M=p.bv_block_m, BLOCK_N=BV_BLOCK_N, BLOCK_D=p.block_d,
            KV_TF32=k.dtype in (torch.bfloat16, torch.float16) and v.dtype == k.dtype, num_warps=4)
        if p.fused:
            launch(_launch_landmark_solve, (B * Hq,),
                ws, p.off_kl, p.off_m, p.off_l, p.off_acc, p.off_w, rank, p.splits, Hq, group, qk_scale, pinv_iters,
                HEAD_DIM=D, BLOCK_R=p.block_r, BLOCK_D=p.block_d, MERGE_STAGES=MERGE_STAGES,
                num_warps=SOLVE_WARPS[p.block_r])
        elif graph is not None:
            graph.graph.replay()
        else:
            solve(ws)

        out = torch.empty(B, Hq, Lr, D, device=q.device, dtype=q.dtype)
        launch(_launch_nystrom_out, (_cdiv(Lr, p.out_block_m), B * Hq),
            qr, ws, out, p.off_kl, p.off_w, Lr, rank, Hq, group, qk_scale,
            qrs[0], qrs[1], qrs[2], Hq * Lr * D, Lr * D, D,  # out: (B, Hq, Lr, D), contiguous
            HEAD_DIM=D, BLOCK_M=p.out_block_m, BLOCK_R=p.out_block_r, BLOCK_D=p.block_d,
            FP32=q.dtype == torch.float32 or interpreter(), ONE_BLOCK=p.out_one_block, LOWP=False, W_PER_KV=False,
            num_warps=OUT_WARPS)
    finally:
        if solve is not None:
            _SOLVE_LOCK.release()
    launch.done()
    return out


@functools.lru_cache(maxsize=256)
def _mean_params(segment: int, block_d: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps) of a segment-mean kernel for segments of up to ``segment`` rows."""
    rows = min(_block(segment), MEAN_MAX_ROWS, max(16, MEAN_MAX_TILE // block_d))
    return rows, min(16, max(2, rows * block_d // MEAN_PER_WARP))
