"""One profiled call: its peak memory, relative to what was allocated before it, and its kernels.

CUDA: the caching allocator's peak over the call minus the allocation before it.
CPU: the peak of the running sum of every allocation and free the profiler records (its
``[memory]`` events, in time order) during the call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from adaattn.timing.trace import profiler_session


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence C++ prints to fd 2 (the CPU profiler's start/stop lines) around a profiled call."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass(frozen=True)
class Profiled:
    peak_bytes: int  # peak allocation over the call, relative to before it
    kernels: str  # the kernels (CUDA) or attention/matmul ops (CPU) that ran, longest first


def profiled_call(fn: Callable[[], object], device: str, top: int = 3) -> Profiled:
    """One call under the profiler: its peak memory and the kernels it ran (one call for both)."""
    from torch.profiler import ProfilerActivity

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with quiet_stderr(), profiler_session(activities, profile_memory=not cuda) as prof:
        if cuda:  # the caching allocator's peak; the profiler's own buffers are not allocator memory
            peak = _allocator_peak(fn)
        else:
            fn()
    if not cuda:
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        running = peak = 0
        for _, nbytes in events:
            running += nbytes
            peak = max(peak, running)
    return Profiled(int(peak), _kernel_names(prof.events(), cuda, top))


def _kernel_names(events, cuda: bool, top: int) -> str:
    totals: dict[str, float] = {}
    for ev in events:
        if cuda:
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                totals[ev.name] = totals.get(ev.name, 0.0) + ev.device_time
        elif ev.name.startswith("aten::") and any(
            key in ev.name for key in ("attention", "flash", "bmm", "mm", "softmax", "flex")
        ):
            totals[ev.name] = totals.get(ev.name, 0.0) + ev.self_cpu_time_total
    if not totals and not cuda:  # compiled CPU code runs outside aten ops
        totals = {ev.name: ev.self_cpu_time_total for ev in events if not ev.name.startswith("[")}
    names = sorted(totals, key=totals.get, reverse=True)[:top]
    return " | ".join(n[:90] for n in names)


def _allocator_peak(fn: Callable[[], object]) -> int:
    """CUDA: the caching allocator's peak over ``fn``, minus what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - before


def peak_memory_bytes(fn: Callable[[], object], device: str) -> int:
    """``fn``'s peak over what was allocated before it. On CUDA the allocator's statistics alone: the same peak
    as under the profiler, without its cost (a call of many steps, a decode loop, records a kernel each)."""
    return _allocator_peak(fn) if device == "cuda" else profiled_call(fn, device).peak_bytes


def kernels_ran(fn: Callable[[], object], device: str, top: int = 3) -> str:
    return profiled_call(fn, device, top).kernels


def peak_row(row: dict, fn: Callable[[], object], device: str, held: int = 0, reason: str = "") -> dict:
    """``row`` with the value (MiB) of ``held`` bytes and ``fn``'s peak over them, grad enabled; a call that
    fails (out of memory, say) is the row's status and reason, so that the rows after it still run."""
    from adaattn.errors import classify_error

    try:
        with torch.enable_grad():
            peak = peak_memory_bytes(fn, device)
    except Exception as err:  # noqa: BLE001 - a status row says why
        status, why = classify_error(err)
        return {**row, "value": None, "unit": "MiB", "status": status, "reason": why}
    return {**row, "value": (held + peak) / 2**20, "unit": "MiB", "status": "ok", "reason": reason}
