"""Timers with one interface: ``timer(fn, grad_to_none) -> Quantiles`` in milliseconds.

GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed by writing a 256 MB buffer before
every repeat, warm-up and repeat budgets in ms). CPU: ``time.perf_counter`` around each call,
after untimed warm-up calls; no cache flush (a 2-core CPU run is dominated by compute).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

QUANTILES = (0.2, 0.5, 0.8)


@dataclass(frozen=True)
class Quantiles:
    p20: float
    p50: float
    p80: float
    n: int  # number of timed repeats behind the quantiles


def quantiles(samples: Sequence[float]) -> Quantiles:
    """p20/p50/p80 with linear interpolation (numpy's default), as triton's do_bench."""
    if len(samples) == 0:
        raise ValueError("no samples to take quantiles of")
    p20, p50, p80 = np.quantile(np.asarray(samples, dtype=np.float64), QUANTILES)
    return Quantiles(float(p20), float(p50), float(p80), len(samples))


class CudaTimer:
    def __init__(self, warmup_ms: int, rep_ms: int):
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> Quantiles:
        from triton.testing import do_bench

        p20, p50, p80 = do_bench(
            fn, warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=list(grad_to_none or []) or None,
            quantiles=list(QUANTILES),
        )
        # do_bench sizes its repeat count from a 5-call estimate to fill rep_ms
        return Quantiles(float(p20), float(p50), float(p80), n=-1)


class CpuTimer:
    def __init__(self, warmup: int, repeats: int):
        self.warmup, self.repeats = warmup, repeats

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> Quantiles:
        def clear() -> None:
            for t in grad_to_none or []:
                t.grad = None

        for _ in range(self.warmup):
            clear()
            fn()
        samples = []
        for _ in range(self.repeats):
            clear()
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return quantiles(samples)


def make_timer(device: str, bench) -> CudaTimer | CpuTimer:
    """The timer for a device from the ``bench`` section of params.yaml."""
    if device == "cuda":
        return CudaTimer(bench.gpu.warmup_ms, bench.gpu.rep_ms)
    return CpuTimer(bench.cpu.warmup, bench.cpu.repeats)
