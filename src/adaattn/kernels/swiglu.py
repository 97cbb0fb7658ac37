"""SwiGLU: c = silu(a) * b, forward and backward in Triton (G4-T2, G4-C1).

Contiguous a and b (the common case) run a flat kernel over a.numel() elements, tiles of BLOCK
with no per-row index math and no partly masked tile at the end of every row (11008 = 2.7 x 4096).
a and b may also be strided rows, e.g. the two halves of one fused gate/up projection (row stride
2N): nothing is copied for them; that kernel walks tiles of ROWS x BLOCK_N. Math in fp32. Backward:
da = dc * b * s * (1 + a * (1 - s)), db = dc * a * s, with s = sigmoid(a).
Tuned on the hidden size (and dtype), never on the number of rows (``runtime.TunedLaunch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.checks import check_swiglu
from adaattn.kernels.runtime import TunedLaunch, flat_rows, needs_grad, tuned


def _prune(configs, key, kwargs):
    block = triton.next_power_of_2(key[0])
    keep = [c for c in configs if c.kwargs["BLOCK_N"] <= max(block, 256)]
    return keep or configs[:1]


_CONFIGS = tuned([triton.Config({"ROWS": r, "BLOCK_N": n}, num_warps=w) for r, n, w in
                  [(1, 1024, 4), (1, 2048, 8), (1, 4096, 8), (2, 1024, 4), (2, 2048, 8), (4, 256, 4), (4, 512, 4),
                   (4, 1024, 8), (8, 512, 8)]])


_FLAT_CONFIGS = tuned([triton.Config({"BLOCK": b}, num_warps=w) for b, w in
                       [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8)]])


@triton.jit
def _silu_mul(a, b):
    return a * tl.sigmoid(a) * b


@triton.jit
def _silu_mul_grads(dc, a, b):
    s = tl.sigmoid(a)
    return dc * b * s * (1.0 + a * (1.0 - s)), dc * a * s


@triton.jit
def _swiglu_fwd_flat_kernel(a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    a = tl.load(a_ptr + i, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + i, _silu_mul(a, b).to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_flat_kernel(dc_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    dc = tl.load(dc_ptr + i, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + i, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i, mask=mask, other=0.0).to(tl.float32)
    da, db = _silu_mul_grads(dc, a, b)
    tl.store(da_ptr + i, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + i, db.to(db_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, c_ptr, a_rs, b_rs, c_rs, n_rows, n_cols,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r < n_rows)[:, None] & (cols < n_cols)[None, :]
    a = tl.load(a_ptr + r[:, None] * a_rs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r[:, None] * b_rs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + r[:, None] * c_rs + cols[None, :], _silu_mul(a, b).to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dc_ptr, a_ptr, b_ptr, da_ptr, db_ptr, dc_rs, a_rs, b_rs, da_rs, db_rs, n_rows, n_cols,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r < n_rows)[:, None] & (cols < n_cols)[None, :]
    dc = tl.load(dc_ptr + r[:, None] * dc_rs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + r[:, None] * a_rs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r[:, None] * b_rs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    da, db = _silu_mul_grads(dc, a, b)
    tl.store(da_ptr + r[:, None] * da_rs + cols[None, :], da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + r[:, None] * db_rs + cols[None, :], db.to(db_ptr.dtype.element_ty), mask=mask)


def _grid(n_rows: int, n_cols: int):
    return lambda meta: (triton.cdiv(n_rows, meta["ROWS"]), triton.cdiv(n_cols, meta["BLOCK_N"]))


_check = check_swiglu


def _example(strided: bool, backward: bool):
    """Tuning problems: a and b of (rows, N), contiguous, or the two halves of one (rows, 2N) tensor."""
    def example(key: tuple, nbytes: int, device: torch.device):
        n_cols, dtype = key[:2]
        rows = max(1, nbytes // (n_cols * dtype.itemsize))
        if strided:
            a, b = torch.randn(rows, 2 * n_cols, device=device, dtype=dtype).chunk(2, dim=-1)
        else:
            a, b = (torch.randn(rows, n_cols, device=device, dtype=dtype) for _ in range(2))
        if not backward:
            return lambda: swiglu_fwd(a, b)
        dc = torch.randn(rows, n_cols, device=device, dtype=key[2])
        return lambda: swiglu_bwd(dc, a, b)

    return example


_fwd = TunedLaunch(_swiglu_fwd_kernel, _CONFIGS, _example(True, False), _prune)
_bwd = TunedLaunch(_swiglu_bwd_kernel, _CONFIGS, _example(True, True), _prune)
_fwd_flat = TunedLaunch(_swiglu_fwd_flat_kernel, _FLAT_CONFIGS, _example(False, False))
_bwd_flat = TunedLaunch(_swiglu_bwd_flat_kernel, _FLAT_CONFIGS, _example(False, True))


def _flat_grid(n: int):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def swiglu_fwd(a: Tensor, b: Tensor) -> Tensor:
    _check(a, b)
    n_cols, n = a.shape[-1], a.numel()
    c = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if not n:
        return c
    if a.is_contiguous() and b.is_contiguous():
        _fwd_flat((n_cols, a.dtype), _flat_grid(n), a, b, c, n)
        return c
    (a2, a_rs), (b2, b_rs) = flat_rows(a), flat_rows(b)
    n_rows = n // n_cols
    _fwd((n_cols, a.dtype), _grid(n_rows, n_cols), a2, b2, c, a_rs, b_rs, n_cols, n_rows, n_cols)
    return c


def swiglu_bwd(dc: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    n_cols, n = a.shape[-1], a.numel()
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    db = torch.empty_like(da)
    if not n:
        return da, db
    if a.is_contiguous() and b.is_contiguous() and dc.is_contiguous():
        _bwd_flat((n_cols, a.dtype, dc.dtype), _flat_grid(n), dc, a, b, da, db, n)
        return da, db
    (a2, a_rs), (b2, b_rs), (dc2, dc_rs) = flat_rows(a), flat_rows(b), flat_rows(dc)
    n_rows = n // n_cols
    _bwd((n_cols, a.dtype, dc.dtype), _grid(n_rows, n_cols), dc2, a2, b2, da, db, dc_rs, a_rs, b_rs, n_cols,
         n_cols, n_rows, n_cols)
    return da, db


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return swiglu_fwd(a, b)

    @staticmethod
    def backward(ctx, dc: Tensor):
        a, b = ctx.saved_tensors
        return swiglu_bwd(dc, a, b)


@torch.library.custom_op("adaattn::swiglu_fwd", mutates_args=())
def swiglu_fwd_op(a: Tensor, b: Tensor) -> Tensor:
    return swiglu_fwd(a, b)


@swiglu_fwd_op.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(a.shape)


@torch.library.custom_op("adaattn::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(dc: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return swiglu_bwd(dc, a, b)


@swiglu_bwd_op.register_fake
def _(dc: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return a.new_empty(a.shape), a.new_empty(a.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dc: Tensor):
    a, b = ctx.saved_tensors
    return swiglu_bwd_op(dc, a, b)


swiglu_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu_triton(a: Tensor, b: Tensor) -> Tensor:
    if torch.compiler.is_compiling():
        return swiglu_fwd_op(a, b)
    if not needs_grad(a, b):
        return swiglu_fwd(a, b)
    return SwiGLUFunction.apply(a, b)
