"""How the kernel manager (``kernel_manager.py``) times one call: host time, GPU time, time per call.

``timed``: the host time to issue a call; on a GPU the GPU time of its work, taken with the GPU held by
a sleep kernel while the host issues the timed calls, so that host gaps do not count as GPU time; and
the time per call of calls made back to back (``turn``: CUDA events on a GPU, the host's time where the
call is host-bound, the GPU's where it is GPU-bound; on a CPU, the host time).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from adaattn.attention.backends import Run
from adaattn.attention.paired import median_ci, paired_times, round_ratios

BURSTS = 3  # GPU: bursts of calls back to back per turn, for the time per call (the fastest counts)
HOLD_TRIES = 4  # sleeps tried, each twice the last, before a GPU time is taken as it came


@dataclass(frozen=True)
class Timing:
    """One backend's time per call on one signature (ms)."""

    host_ms: float  # host time to issue the call (on a CPU, the call)
    gpu_ms: float | None  # GPU time of the call's work (None on a CPU)
    # time per call of calls made back to back: with ``rounds``, the typical turn of the paired rounds
    # (``paired_times``); without, the fastest burst (on a CPU, host_ms)
    call_ms: float
    rounds: int = 0  # paired rounds it took (objective "call": ``AttentionKernelManager._paired``)


@functools.cache
def sleep_cycles_per_ms(index: int) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per ms on this GPU (calibrated once per process)."""
    with torch.cuda.device(index):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        return 20_000_000 / max(start.elapsed_time(end), 1e-3)


def timed(call: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> Timing:
    """Host time to issue one ``call`` (the fastest of ``repeats`` calls: the host's noise only adds
    time), on a GPU the GPU time of its work (the mean of ``repeats`` calls), and the time per call of
    ``repeats`` calls back to back, in ms.

    On a GPU a sleep kernel holds the stream while the host issues the timed calls, so the events
    around them measure GPU work, not host gaps; the sleep is sized from one issue of the call and
    doubled (up to ``HOLD_TRIES`` tries) while it was over before the host had issued the last call
    (the event after it had completed). Why that test and not the host's time against the sleep's
    length: the length in ms follows the GPU's clock, which ``sleep_cycles_per_ms`` reads once. On
    a lent H100 (scratch run, module calls with backward at B=1 S=512-1024) a sleep sized for 8.8 ms
    held the stream for 4.7 ms, and the host's 5.2-5.3 ms of calls outlasted it; in the scaling run at
    code f4b8b2d7 the manager that ranks by GPU time put forced efficient attention first at B=1
    S=1024 forward and backward, whose kernels took 2.0x SDPA's in the study's trace. Time per call, as the scaling
    study's side-by-side turns take it: the queue drained, one call not counted (its host time runs on
    an idle GPU), then ``repeats`` calls between two events: the host's time where the call is
    host-bound, the GPU's where it is GPU-bound; the fastest of ``BURSTS`` such bursts."""
    for _ in range(warmup):
        call()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        call()
        issue_ms = (time.perf_counter() - t0) * 1e3  # the GPU was idle: host time (or the whole call if it syncs)
        torch.cuda.synchronize(device)
        sleep_ms = 2 * repeats * issue_ms + 0.5
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(HOLD_TRIES if cuda else 1):
        if cuda:
            torch.cuda._sleep(int(sleep_ms * sleep_cycles_per_ms(device.index or 0)))
            start.record()
        host = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            host.append((time.perf_counter() - t0) * 1e3)
        if not cuda:
            return Timing(min(host), None, min(host))
        held = not start.query()  # the sleep still held the stream when the last call was issued
        end.record()
        end.synchronize()
        if held:
            break
        sleep_ms *= 2
    gpu_ms = start.elapsed_time(end) / repeats
    return Timing(min(host), gpu_ms, min(turn(call, device, repeats) for _ in range(BURSTS)))


def turn(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Time per call (ms) of one turn: on a GPU, the queue drained, one call not counted (its host time
    runs on an idle GPU), then ``repeats`` calls back to back between two CUDA events (as the scaling
    study's side-by-side turns); on a CPU, one call."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        call()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    call()
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def workload(run: Run, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
             scale: float | None, grad: bool) -> Callable[[], object]:
    """One call as the signature makes it: the forward, or forward and backward for a training signature
    (gradients of the inputs that need them, of a fixed output gradient; nothing accumulates)."""
    if not grad:
        def forward():
            with torch.no_grad():
                return run(q, k, v, attn_mask, is_causal, scale)

        return forward
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
    wrt = [t for t in leaves if t.requires_grad]
    grad_out: list[Tensor] = []

    def forward_backward():
        with torch.enable_grad():
            out = run(*leaves, attn_mask, is_causal, scale)
            if not grad_out:
                grad_out.append(torch.randn_like(out))
            return torch.autograd.grad(out, wrt, grad_out[0])

    return forward_backward


def combined(turns: list[Timing]) -> Timing:
    """One backend's timing from its turns: host time and time per call the fastest turn's (the host's
    noise only adds time), GPU time the median."""
    gpu = None if turns[0].gpu_ms is None else statistics.median(t.gpu_ms for t in turns)
    return Timing(min(t.host_ms for t in turns), gpu, min(t.call_ms for t in turns))


def settled(samples: dict[str, list[float]]) -> bool:
    """The fastest of the paired rounds (``paired_times``) is faster than every other, each by the
    ``CI_LEVEL`` confidence interval of the median of their round-by-round ratios."""
    typical = paired_times(samples)
    lead = min(typical, key=typical.get)
    return all(median_ci(round_ratios(samples[n], samples[lead]))[0] > 1 for n in samples if n != lead)
