"""Timers with one interface: ``timer(fn, grad_to_none) -> Quantiles`` in milliseconds.

GPU: CUDA events around each call, L2 flushed before every call, warm-up and repeat budgets in
ms (``triton.testing.do_bench``'s method; see ``CudaTimer`` for the two differences). CPU: ``time.perf_counter`` around each call,
after untimed warm-up calls; no cache flush (a 2-core CPU run is dominated by compute).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from adaattn.timing.trace import profiler_session

QUANTILES = (0.2, 0.5, 0.8)


@dataclass(frozen=True)
class Quantiles:
    p20: float
    p50: float
    p80: float
    n: int  # number of timed repeats behind the quantiles
    mean: float = float("nan")
    std: float = float("nan")  # sample standard deviation (ddof=1); nan for one sample


def quantiles(samples: Sequence[float]) -> Quantiles:
    """p20/p50/p80 with linear interpolation (numpy's default), as triton's do_bench; mean and std."""
    if len(samples) == 0:
        raise ValueError("no samples to take quantiles of")
    a = np.asarray(samples, dtype=np.float64)
    p20, p50, p80 = np.quantile(a, QUANTILES)
    std = float(a.std(ddof=1)) if len(a) > 1 else float("nan")
    return Quantiles(float(p20), float(p50), float(p80), len(samples), float(a.mean()), std)


class CudaTimer:
    """CUDA-event timing in the manner of ``triton.testing.do_bench``, with two changes that matter
    for a sweep whose calls range from 50 us to 150 ms: the cost estimate uses 2 calls (do_bench
    always spends 5) that count toward the warm-up budget, and at least ``MIN_REPEATS`` calls are timed (do_bench times a single call
    when one call exceeds ``rep_ms``, which gives p20 = p50 = p80).

    Before every timed call the L2 cache is flushed by zeroing a 256 MB buffer (as do_bench).
    """

    MIN_REPEATS = 5
    MAX_REPEATS = 1000

    def __init__(self, warmup_ms: int, rep_ms: int):
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self._flush: torch.Tensor | None = None

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> Quantiles:
        if self._flush is None:
            self._flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")

        def clear() -> None:
            for t in grad_to_none or []:
                t.grad = None

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(2):
            clear()
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / 2, 1e-3)
        # the two estimate calls are warm-up too: a 50 ms call needs no more of it
        n_warmup = max(0, math.ceil((self.warmup_ms - 2 * estimate) / estimate))
        n_rep = min(self.MAX_REPEATS, max(self.MIN_REPEATS, math.ceil(self.rep_ms / estimate)))
        for _ in range(n_warmup):
            clear()
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        for i in range(n_rep):
            clear()
            self._flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return quantiles([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


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


def host_time_ms(fn: Callable[[], object], calls: int, grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
    """Host (CPU) time per call of ``calls`` back-to-back calls, without waiting for the device.

    What a training step pays on the CPU per call (Python, dispatch, launch). Few enough calls that
    the launch queue never fills, so the device never throttles the host; synchronised after.
    """
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        for t in grad_to_none or []:
            t.grad = None
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e3 / calls


FLUSH_MARK = "bitwise_not"  # the kernel that separates calls in a kernel-time trace; no workload uses it
# Kernels each trace launches before its first marker and after its closing one, outside every call:
# records a trace loses there cost nothing. Traces do lose records (some of ours did not hold one
# marker per call; cause not established); pytorch/pytorch#192021 reports CUPTI handing back a session's
# first kernel records with timestamps from another clock, which the profiler drops as outside its
# window (CUPTI before CUDA 13.1's; the lent H100's torch is built with CUDA 13.0).
TRACE_EDGE = 8
TRACE_ATTEMPTS = 3  # traces taken before a kernel time gives up: one that loses a marker is taken again


class UncutTrace(RuntimeError):
    """No trace of the calls could be cut into calls: each lost (or gained) flush markers."""

    def __init__(self, expected: int, found: Sequence[int]):
        self.expected, self.found = expected, tuple(found)
        super().__init__(f"the kernel trace could not be cut into calls: {len(found)} trace"
                         f"{'s' * (len(found) != 1)} held {', '.join(map(str, found))} flush markers of "
                         f"{expected}")


@dataclass(frozen=True)
class KernelTrace:
    """Per-call kernel times (ms) of each function, and what the traces before the one cut held."""

    samples: list[list[float]]  # one list of ``calls`` samples per function, in the order given
    uncut: tuple[int, ...] = ()  # flush markers in each earlier trace that could not be cut (taken again)
    expected: int = 0  # flush markers a trace holds

    def note(self) -> str:
        """'' when the first trace was cut; otherwise what the earlier traces held, for a row's unit."""
        if not self.uncut:
            return ""
        n = len(self.uncut)
        return (f"; the trace taken again after {n} that could not be cut (held "
                f"{', '.join(map(str, self.uncut))} flush markers of {self.expected})")


def per_call_kernel_ms(kernels: Sequence[tuple[str, int, int]], calls: int) -> list[float] | None:
    """Per-call sums of kernel durations from a trace of ``calls`` calls, each after a flush kernel and
    the last followed by one more.

    ``kernels``: (name, start_ns, duration_ns) of every GPU kernel and memset in the trace. A call is
    everything between one flush kernel and the next; what comes before the first and after the last
    is not a call's (``TRACE_EDGE``). None when the trace does not hold exactly ``calls + 1`` flush
    kernels (a record lost, or a workload that launches the marker itself): no numbers rather than
    wrong ones.
    """
    sums: list[float] = []
    for name, _, duration in sorted(kernels, key=lambda k: k[1]):
        if FLUSH_MARK in name:
            sums.append(0.0)
        elif sums:
            sums[-1] += duration / 1e6
    return sums[:-1] if len(sums) == calls + 1 else None


def kernel_time_ms(fn: Callable[[], object], calls: int,
                   grad_to_none: Sequence[torch.Tensor] | None = None) -> Quantiles:
    """GPU time of the kernels one call launches, summed (CUPTI through the profiler), over ``calls``
    calls, each after an L2 flush: the device's share of a call, with no host time in it. Raises
    ``UncutTrace`` when no trace can be cut into calls (see ``kernel_times_ms``)."""
    return quantiles(kernel_times_ms([fn], calls, grad_to_none).samples[0])


def round_robin(n_fns: int, calls: int) -> list[int]:
    """The order ``kernel_times_ms`` calls its functions in: one call of each in turn, ``calls`` rounds."""
    return [i for _ in range(calls) for i in range(n_fns)]


def split_round_robin(sums: Sequence[float], n_fns: int, calls: int) -> list[list[float]]:
    """Per-call samples in ``round_robin`` order -> one list of ``calls`` samples per function."""
    if len(sums) != n_fns * calls:
        raise ValueError(f"{len(sums)} samples for {n_fns} functions x {calls} calls")
    return [list(sums[i::n_fns]) for i in range(n_fns)]


def kernel_times_ms(fns: Sequence[Callable[[], object]], calls: int,
                    grad_to_none: Sequence[torch.Tensor] | None = None,
                    attempts: int = TRACE_ATTEMPTS) -> KernelTrace:
    """``kernel_time_ms``'s per-call samples for several functions from one profiler session, each
    call after an L2 flush. The calls go round robin (one of each function in turn, ``calls``
    rounds), not one function's calls and then the next's: whatever drifts over a session (clocks,
    the state earlier work leaves behind) then lands on every function alike, so their ratios do
    not depend on the order they are listed in. A trace that cannot be cut into calls (a flush
    marker lost or gained) is taken again, up to ``attempts`` traces in all, and the result says so
    (``KernelTrace.note``); ``UncutTrace`` when none can be cut."""
    from torch.profiler import ProfilerActivity

    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    edge = torch.zeros(1, device="cuda")
    expected = calls * len(fns) + 1
    found: list[int] = []
    for _ in range(attempts):
        torch.cuda.synchronize()
        with profiler_session([ProfilerActivity.CUDA]) as prof:
            for _ in range(TRACE_EDGE):
                edge.add_(1)
            for i in round_robin(len(fns), calls):
                for t in grad_to_none or []:
                    t.grad = None
                flush.bitwise_not_()
                fns[i]()
            flush.bitwise_not_()  # the last call's end
            for _ in range(TRACE_EDGE):
                edge.add_(1)
            torch.cuda.synchronize()
        kernels = [(e.name(), e.start_ns(), e.duration_ns()) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA]
        sums = per_call_kernel_ms(kernels, calls * len(fns))
        if sums is not None:
            return KernelTrace(split_round_robin(sums, len(fns), calls), tuple(found), expected)
        found.append(sum(FLUSH_MARK in name for name, _, _ in kernels))
    raise UncutTrace(expected, found)


def gpu_utilization(fn: Callable[[], object], seconds: float,
                    grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
    """NVML's GPU utilization (% of its last sample period, 1/6 to 1 s, in which a kernel ran) read
    while calls of ``fn`` run back to back for ``seconds``: the period it covers is all calls.
    Raises (ModuleNotFoundError without nvidia-ml-py) rather than guessing."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for t in grad_to_none or []:
            t.grad = None
        fn()
    util = torch.cuda.utilization()  # read while the queued calls still run
    torch.cuda.synchronize()
    return float(util)


def make_timer(device: str, bench) -> CudaTimer | CpuTimer:
    """The timer for a device from the ``bench`` section of params.yaml."""
    if device == "cuda":
        return CudaTimer(bench.gpu.warmup_ms, bench.gpu.rep_ms)
    return CpuTimer(bench.cpu.warmup, bench.cpu.repeats)
