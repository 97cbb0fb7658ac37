"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, forward and backward in Triton (G4-T2, G4-C1).

One program normalises one row in the forward. The backward gives each program a contiguous
block of rows and accumulates its partial weight gradient in fp32 registers; the partials
(programs x hidden) are summed in fp32 and cast once, so a bf16 weight gradient is summed in fp32.
Statistics (mean square, rstd) are always fp32, whatever the input dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """The reference: fp32 statistics, output in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr,
    x_row_stride, y_row_stride, n_cols, eps,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
    x_row_stride, dy_row_stride, dx_row_stride, n_rows, n_cols, rows_per_program,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        if row < n_rows:
            x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x * rstd
            wdy = w * dy
            # d/dx of x*rstd(x)*w:  rstd * (w*dy - x_hat * mean(w*dy*x_hat))
            c = tl.sum(wdy * x_hat, axis=0) / n_cols
            dx = (wdy - x_hat * c) * rstd
            tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)


# --------------------------------------------------------------------------- launchers


def _rows(t: Tensor) -> Tensor:
    """(..., N) -> (M, N) without a copy when rows are evenly strided and the last dim is contiguous."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _block_and_warps(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    if block * 4 > 2**16:  # one row must fit in registers: 64 KB of fp32 per program
        raise ValueError(f"rms_norm supports hidden sizes up to {2**14}; got {n_cols}")
    # 4 warps up to 2K columns, 8 up to 8K, 16 beyond: one 16-byte vector per thread per pass
    return block, 4 if block <= 2048 else 8 if block <= 8192 else 16


def _check(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be ({x.shape[-1]},) for x of shape {tuple(x.shape)}; got {tuple(weight.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"rms_norm takes float32, float16 or bfloat16; got {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")


def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns y (x's shape and dtype) and rstd (M,) fp32."""
    _check(x, weight)
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block, warps = _block_and_warps(n_cols)
        _rms_norm_fwd_kernel[(n_rows,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), n_cols, eps,
                                        BLOCK_N=block, num_warps=warps)
    return y.view(x.shape), rstd


def _programs(n_rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 8)


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    x2, dy2 = _rows(x), _rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    programs = max(1, _programs(n_rows, x.device))
    dw_partial = torch.zeros((programs, n_cols), dtype=torch.float32, device=x.device)
    if n_rows:
        block, warps = _block_and_warps(n_cols)
        _rms_norm_bwd_kernel[(programs,)](
            x2, weight, dy2, rstd, dx, dw_partial, x2.stride(0), dy2.stride(0), dx.stride(0), n_rows, n_cols,
            math.ceil(n_rows / programs), BLOCK_N=block, num_warps=warps)
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)


# --------------------------------------------------------------------------- autograd + torch.library


@torch.library.custom_op("adaattn::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return rms_norm_fwd(x, weight, eps)


@_rms_norm_fwd_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("adaattn::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return rms_norm_bwd(dy, x, weight, rstd)


@_rms_norm_bwd_op.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy: Tensor, _drstd: Tensor):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd_op(dy.contiguous() if dy.stride(-1) != 1 else dy, x, weight, rstd)
    return dx, dw, None


_rms_norm_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim through the Triton kernels (traceable by torch.compile)."""
    return _rms_norm_fwd_op(x, weight, eps)[0]
