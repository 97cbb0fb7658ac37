"""Peak memory of one call, relative to what was allocated before it.

CUDA: the caching allocator's peak over the call minus the allocation before it.
CPU: the peak of the running sum of every allocation and free the profiler records (its
``[memory]`` events, in time order) during the call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch


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


def peak_memory_bytes(fn: Callable[[], object], device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return int(peak)
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return int(peak)
