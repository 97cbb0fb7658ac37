"""Per-program fp32 partial sums (weight gradients of the persistent backward kernels), reduced in
one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.runtime import Launcher


@triton.jit
def _sum_rows_kernel(p_ptr, out_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r < n_rows)[:, None] & (cols < n_cols)[None, :]
        acc += tl.sum(tl.load(p_ptr + r[:, None] * n_cols + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


_sum_rows = Launcher(_sum_rows_kernel)


def sum_partials(partial: Tensor, dtype: torch.dtype) -> Tensor:
    """Column sums of contiguous fp32 per-program partials (P, N), summed in fp32 and cast once to
    ``dtype``: one launch (``partial.sum(0).to(dtype)`` is two for a bf16 weight)."""
    n_rows, n_cols = partial.shape
    out = torch.empty(n_cols, dtype=dtype, device=partial.device)
    if n_cols:
        # tall tiles (256 rows): a program's serial loop is short even for thousands of partial rows
        block_c = 16 if n_cols <= 256 else 32
        _sum_rows((triton.cdiv(n_cols, block_c),), partial, out, n_rows, n_cols, BLOCK_R=256, BLOCK_C=block_c,
                  num_warps=8)
    return out
