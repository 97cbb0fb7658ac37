"""Roofline units from written formulas, and the machine's measured ceilings.

At the start of a run the harness measures the device's copy bandwidth and GEMM rate once
(bf16 on a GPU, fp32 on a CPU) so every result can be reported as a fraction of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# backward of attention is 2.5x the forward FLOPs (FlashAttention-2 paper's accounting)
BWD_FLOPS_FACTOR = 2.5


def mode_flops(flops_fwd: float, mode: str) -> float:
    if mode == "fwd":
        return flops_fwd
    if mode == "bwd":
        return BWD_FLOPS_FACTOR * flops_fwd
    if mode == "fwd_bwd":
        return (1.0 + BWD_FLOPS_FACTOR) * flops_fwd
    raise ValueError(f"unknown mode {mode!r}; allowed: fwd, bwd, fwd_bwd")


def mode_bytes(bytes_by_mode: dict[str, float], mode: str) -> float:
    """Bytes a mode moves from per-pass counts: fwd_bwd is fwd + bwd."""
    if mode == "fwd_bwd":
        return bytes_by_mode["fwd"] + bytes_by_mode["bwd"]
    if mode not in ("fwd", "bwd"):
        raise ValueError(f"unknown mode {mode!r}; allowed: fwd, bwd, fwd_bwd")
    return bytes_by_mode[mode]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written
    gemm_tflops: float  # dense GEMM rate
    gemm_dtype: str
    gemm_size: int


def measure_ceilings(device: str, timer) -> Ceilings:
    """Copy bandwidth (1 GiB GPU / 64 MiB CPU) and GEMM rate (8192^3 bf16 GPU / 1024^3 fp32 CPU)."""
    if device == "cuda":
        copy_bytes, gemm_n, dtype, dname = 1 << 30, 8192, torch.bfloat16, "bf16"
    else:
        copy_bytes, gemm_n, dtype, dname = 64 << 20, 1024, torch.float32, "fp32"
    src = torch.randn(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src)).p50
    del src, dst
    a = torch.randn(gemm_n, gemm_n, device=device, dtype=dtype)
    b = torch.randn(gemm_n, gemm_n, device=device, dtype=dtype)
    gemm_ms = timer(lambda: a @ b).p50
    return Ceilings(
        copy_gbps=gbps(2 * copy_bytes, copy_ms),
        gemm_tflops=tflops(2.0 * gemm_n**3, gemm_ms),
        gemm_dtype=dname,
        gemm_size=gemm_n,
    )


def fp8_gemm_tflops(timer, n: int = 8192) -> float:
    """The FP8 GEMM rate the FP8 configs are judged against: ``torch._scaled_mm`` of two n x n float8 e4m3
    operands with tensorwise scales and a bf16 result (torchao's float8 training GEMM), on the same timer
    as the bf16 rate. Needs a GPU of compute capability 8.9 or newer."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    ms = timer(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)).p50
    return tflops(2.0 * n**3, ms)
