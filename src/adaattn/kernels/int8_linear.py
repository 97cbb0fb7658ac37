"""INT8 weight-only linear for decoding: y = (x @ W_int8^T) * scale (+ bias), W dequantized in registers.

Decoding at small batch reads every weight once per token, so its time is the weights' bytes over memory
bandwidth; int8 weights halve them only if the matmul reads the int8 bytes themselves. Casting W to the
activation dtype first (``F.linear(x, W.to(x.dtype))``) writes and reads a full-precision copy every call
unless a compiler folds the cast into the matmul's loads; these kernels do so by construction. Two kernels,
both reading each int8 tile once:

- one row (batch-1 decode): a GEMV, each program BLOCK_N output channels, a multiply and a row sum over
  BLOCK_K-wide tiles of W in fp32 (no tensor cores: one row would use 1/16 of an MMA);
- 2 to ``MAX_ROWS`` rows (batched decode): ``tl.dot`` over BLOCK_M x BLOCK_K activations and
  BLOCK_K x BLOCK_N weight tiles converted to the activation dtype, accumulated in fp32.

More rows than that (prefill) is compute-bound: the cast and cuBLAS, as the reference. The per-channel
scale and the bias are applied to the fp32 accumulator before the one cast and store. Configs are tuned as
the other kernels' are (``runtime.TunedLaunch``: CUPTI kernel times, not ``triton.autotune``'s per-call
events, whose noise at few-us kernels exceeds the differences between configs), by the weight's size; N and K
are runtime arguments, so one compiled kernel serves every layer shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from adaattn.kernels.reference import int8_linear_ref
from adaattn.kernels.runtime import TunedLaunch, interpreter, tuned

MAX_ROWS = 64  # above this the matmul is compute-bound: cast + cuBLAS


# GEMV: a whole row of W per program where it fits (K <= BLOCK_K: every load issued at once, nothing
# loop-carried), a few rows per program; the loop over K for longer rows
_GEMV_CONFIGS = tuned([triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in
                       [(4, 2048, 4, 2), (1, 2048, 4, 2), (2, 2048, 4, 2), (4, 2048, 8, 2), (8, 2048, 8, 2),
                        (2, 4096, 8, 2), (1, 4096, 4, 2), (4, 1024, 4, 3), (8, 1024, 8, 3), (2, 1024, 2, 3),
                        (16, 512, 4, 3)]])

_MM_CONFIGS = tuned([triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in
                     [(32, 128, 4, 4), (16, 256, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (16, 512, 4, 3),
                      (64, 256, 8, 3), (128, 128, 8, 3), (32, 64, 2, 5), (64, 64, 4, 5), (16, 1024, 4, 2),
                      (32, 512, 8, 2), (16, 128, 2, 6)]])


@triton.jit
def _int8_gemv_kernel(w_ptr, x_ptr, s_ptr, b_ptr, y_ptr, N, K,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    nmask = n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        kmask = kk < K
        x = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1) * tl.load(s_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _int8_mm_kernel(w_ptr, x_ptr, s_ptr, b_ptr, y_ptr, M, N, K, x_row_stride,
                    HAS_BIAS: tl.constexpr, FP32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    mmask, nmask = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        kmask = kk < K
        x = tl.load(x_ptr + m[:, None] * x_row_stride + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :] * K + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0)
        if FP32:  # fp32 activations: the exact product, not TF32's; also the interpreter, whose bf16 tl.dot is wrong
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    acc = acc * tl.load(s_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _prune(configs, key, kwargs):
    """No K tile wider than the row (a GEMV of K=2048 gains nothing from 4096-wide masked tiles)."""
    return [c for c in configs if c.kwargs["BLOCK_K"] <= max(16, triton.next_power_of_2(key[0]))] or configs[:1]


def _problem(key: tuple, nbytes: int, device: torch.device, rows: int):
    k_in, dtype, bias = key[0], key[-2], key[-1]
    n_out = max(16, nbytes // k_in)
    w = torch.randint(-127, 128, (n_out, k_in), dtype=torch.int8, device=device)
    scale = torch.rand(n_out, device=device, dtype=dtype) / 64
    b = torch.randn(n_out, device=device, dtype=dtype) if bias else None
    x = torch.randn(rows, k_in, device=device, dtype=dtype)
    return lambda: int8_linear_fwd(x, w, scale, b)


_gemv = TunedLaunch(_int8_gemv_kernel, _GEMV_CONFIGS, lambda key, nbytes, device: _problem(key, nbytes, device, 1),
                    _prune)
_mm = TunedLaunch(_int8_mm_kernel, _MM_CONFIGS, lambda key, nbytes, device: _problem(key, nbytes, device, key[1]),
                  _prune)


def int8_linear_fwd(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., K) float, weight (N, K) int8 contiguous, scale (N,), bias (N,) or None -> (..., N) in x's dtype.
    Tuned per (K, rows bucket, dtype, bias) at weights of 2-64 MiB (``runtime.TunedLaunch``); a call runs the
    config tuned at the size nearest its weight's."""
    n_out, k_in = weight.shape
    x2 = x.reshape(-1, k_in)
    rows = x2.shape[0]
    if rows > MAX_ROWS or rows == 0:
        return int8_linear_ref(x, weight, scale, bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    b = bias if bias is not None else scale  # never read without HAS_BIAS
    has_bias = bias is not None
    if rows == 1:
        _gemv((k_in, x.dtype, has_bias), lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]),),
              weight, x2, scale, b, y, n_out, k_in, HAS_BIAS=has_bias)
    else:
        block_m = max(16, triton.next_power_of_2(rows))
        _mm((k_in, block_m, x.dtype, has_bias),
            lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]), triton.cdiv(rows, block_m)),
            weight, x2, scale, b, y, rows, n_out, k_in, x2.stride(0), HAS_BIAS=has_bias,
            FP32=x.dtype == torch.float32 or interpreter(), BLOCK_M=block_m)
    return y.reshape(*x.shape[:-1], n_out)


@torch.library.custom_op("adaattn::int8_linear", mutates_args=())
def int8_linear_op(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    return int8_linear_fwd(x, weight, scale, bias)


@int8_linear_op.register_fake
def _(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def int8_linear_triton(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """Inference only (the int8 weight takes no gradient; x's gradient is not built)."""
    if torch.compiler.is_compiling():
        return int8_linear_op(x, weight, scale, bias)
    return int8_linear_fwd(x, weight, scale, bias)
