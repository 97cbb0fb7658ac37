"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, forward and backward in Triton (G4-T2, G4-C1).

Forward: each program normalises ROWS rows held in registers (several rows per program for small
hidden sizes, one for large). Backward: a persistent grid (PPS programs per SM, tuned) walks blocks of
rows (a software pipeline STAGES deep) and accumulates its partial weight gradient in fp32 registers; the partials (programs x
hidden) are summed in fp32 and cast once, so a bf16 weight gradient is summed in fp32.
Statistics (mean square, rstd) are fp32 whatever the input dtype. Tuned on the hidden size
(and dtype), never on the number of rows (``runtime.TunedLaunch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.partials import sum_partials
from adaattn.kernels.checks import check_rms_norm_args
from adaattn.kernels.runtime import TunedLaunch, flat_rows, needs_grad, programs_for, tuned

MAX_HIDDEN = 2**16 // 4  # one row of fp32 must fit in a program's registers


def _prune(configs, key, kwargs):
    """Tiles of at most 16K elements, 2 to 64 of them per thread."""
    block = kwargs["BLOCK_N"]
    keep = [c for c in configs if c.kwargs["ROWS"] * block <= 16384
            and 2 <= c.kwargs["ROWS"] * block // (c.num_warps * 32) <= 64]
    return keep or configs[:1]


_CONFIGS = tuned([triton.Config({"ROWS": r}, num_warps=w) for r, w in
                  [(1, 4), (1, 1), (1, 2), (1, 8), (1, 16), (2, 2), (2, 4), (2, 8), (4, 2), (4, 4), (4, 8), (8, 4),
                   (8, 8), (16, 4), (16, 8)]])
# backward: the persistent grid, PPS programs per SM (grid only: few rows per program hide too
# little latency; many programs write many fp32 partial rows), and STAGES, the depth of the
# software pipeline over the program's blocks of rows
_BWD_CONFIGS = tuned([triton.Config({"ROWS": r, "STAGES": s, "PPS": p}, num_warps=w) for r, w, s in
                      [(1, 4, 3), (1, 4, 1), (1, 8, 3), (1, 8, 1), (1, 16, 3), (1, 16, 1), (2, 4, 3), (2, 8, 3),
                       (4, 4, 3), (4, 8, 3), (8, 8, 3), (16, 8, 3)] for p in (2, 4, 8, 16)])


def _max_pps(block_n: int) -> int:
    """The largest backward grid for a hidden size: its fp32 partials stay under 256 KB per SM."""
    return max(1, min(16, 2**16 // block_n))


def _prune_bwd(configs, key, kwargs):
    return _prune([c for c in configs if c.kwargs["PPS"] <= _max_pps(kwargs["BLOCK_N"])] or configs[:1], key, kwargs)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr,
    x_row_stride, y_row_stride, n_rows, eps,
    n_cols: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rmask = r < n_rows
    cmask = cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + r[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + r, rstd, mask=rmask)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + r[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
    x_row_stride, dy_row_stride, dx_row_stride, n_rows,
    n_cols: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    blocks_per_program = tl.cdiv(tl.cdiv(n_rows, ROWS), tl.num_programs(0))
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in tl.range(0, blocks_per_program, num_stages=STAGES):
        r = (pid * blocks_per_program + i) * ROWS + tl.arange(0, ROWS)
        rmask = r < n_rows
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + r[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=rmask, other=0.0)
        x_hat = x * rstd[:, None]
        wdy = w[None, :] * dy
        # d/dx of x*rstd(x)*w:  rstd * (w*dy - x_hat * mean(w*dy*x_hat))
        c = tl.sum(wdy * x_hat, axis=1) / n_cols
        dx = (wdy - x_hat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + r[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=cmask)


# --------------------------------------------------------------------------- launchers


def _block(n_cols: int) -> int:
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"rms_norm supports hidden sizes up to {MAX_HIDDEN}; got {n_cols}")
    return triton.next_power_of_2(n_cols)


_check = check_rms_norm_args


def _rows(nbytes: int, n_cols: int, dtype: torch.dtype) -> int:
    return max(1, nbytes // (n_cols * dtype.itemsize))


def _fwd_example(key: tuple, nbytes: int, device: torch.device):
    n_cols, x_dtype, w_dtype = key
    x = torch.randn(_rows(nbytes, n_cols, x_dtype), n_cols, device=device, dtype=x_dtype)
    w = torch.ones(n_cols, device=device, dtype=w_dtype)
    return lambda: rms_norm_fwd(x, w, 1e-6)


def _bwd_example(key: tuple, nbytes: int, device: torch.device):
    n_cols, x_dtype, w_dtype, dy_dtype = key
    n_rows = _rows(nbytes, n_cols, x_dtype)
    x = torch.randn(n_rows, n_cols, device=device, dtype=x_dtype)
    dy = torch.randn(n_rows, n_cols, device=device, dtype=dy_dtype)
    w = torch.ones(n_cols, device=device, dtype=w_dtype)
    rstd = torch.ones(n_rows, device=device, dtype=torch.float32)
    return lambda: rms_norm_bwd(dy, x, w, rstd)


_fwd = TunedLaunch(_rms_norm_fwd_kernel, _CONFIGS, _fwd_example, _prune)
_bwd = TunedLaunch(_rms_norm_bwd_kernel, _BWD_CONFIGS, _bwd_example, _prune_bwd, grid_only=("PPS",))


def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns y (x's shape and dtype, contiguous) and rstd (M,) fp32."""
    _check(x, weight)
    n_cols = x.shape[-1]
    x2, x_rs = flat_rows(x)
    n_rows = x.numel() // n_cols if n_cols else 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        _fwd((n_cols, x.dtype, weight.dtype), lambda meta: (triton.cdiv(n_rows, meta["ROWS"]),),
             x2, weight, y, rstd, x_rs, n_cols, n_rows, eps, n_cols=n_cols, BLOCK_N=_block(n_cols))
    return y, rstd


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    n_cols = x.shape[-1]
    (x2, x_rs), (dy2, dy_rs) = flat_rows(x), flat_rows(dy)
    n_rows = rstd.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not n_rows:
        return dx, torch.zeros_like(weight)
    # rows for the largest grid; the chosen grid's programs each write their row, and only those are summed
    block = _block(n_cols)
    dw_partial = torch.empty((programs_for(n_rows, x.device, _max_pps(block)), n_cols), dtype=torch.float32,
                             device=x.device)
    def programs(meta) -> int:  # never more programs than blocks of rows: each writes a partial row
        return programs_for(triton.cdiv(n_rows, meta["ROWS"]), x.device, meta["PPS"])

    meta = _bwd((n_cols, x.dtype, weight.dtype, dy.dtype), lambda meta: (programs(meta),),
                x2, weight, dy2, rstd, dx, dw_partial, x_rs, dy_rs, n_cols, n_rows, n_cols=n_cols, BLOCK_N=block)
    return dx, sum_partials(dw_partial[:programs(meta)], weight.dtype)


# --------------------------------------------------------------------------- autograd: eager and compiled


class RMSNormFunction(torch.autograd.Function):
    """Eager path: the launchers directly (the torch.library ops below add dispatch cost per call)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, rstd = rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, x, weight, rstd)
        return dx, dw, None


@torch.library.custom_op("adaattn::rms_norm_fwd", mutates_args=())
def rms_norm_fwd_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return rms_norm_fwd(x, weight, eps)


@rms_norm_fwd_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("adaattn::rms_norm_bwd", mutates_args=())
def rms_norm_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return rms_norm_bwd(dy, x, weight, rstd)


@rms_norm_bwd_op.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy: Tensor, _drstd: Tensor):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd_op(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    if torch.compiler.is_compiling():
        return rms_norm_fwd_op(x, weight, eps)[0]
    if not needs_grad(x, weight):
        return rms_norm_fwd(x, weight, eps)[0]
    return RMSNormFunction.apply(x, weight, eps)
