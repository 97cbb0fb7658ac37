"""Compile a study's ``torch.compile``'d providers in parallel worker processes before timing.

torch.compile's cost is serial and per process: the attention study's FlexAttention compiles a
graph per (dtype, head dim, mask, grad mode), about 9 s each on the H100 host. Inductor keeps
what it compiled in on-disk caches (FX graph, AOTAutograd and Triton kernel caches) that any
later process on the machine hits. So the first calls run once in worker processes, all at
once, and the measuring process then only traces and loads.

A cache hit needs the measuring process to trace the very graph a worker traced, and dynamo's
trace depends on what the process compiled before (its automatic-dynamic history of earlier
shapes). So a study's first calls are cut into *segments*: runs of consecutive calls, in the
harness's order, that share a compile key. At the start of each segment both the worker and the
measuring process reset dynamo (``FreshCompiles``), and the worker then makes the segment's calls
in the harness's order: each segment starts from the same state in both, and the traces match.

This changes how long a run takes, never what it measures: nothing is timed while the workers
run (they share the device), the measuring process still makes every call itself, and a segment
that fails to warm is compiled again there, where its failure becomes the usual status row.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

WarmItem = tuple[Any, str, str]  # (Case, provider, mode)


@dataclass(frozen=True)
class WarmReport:
    groups: int
    workers: int
    seconds: float  # wall time of the whole warm-up
    failures: tuple[str, ...]  # "case provider mode: error" for calls that failed in a worker
    meanwhile_seconds: float = 0.0  # of that, the measuring process's own warm-up calls


def compile_in_process() -> None:
    """One compile at a time, in this process: no pool of Triton compile subprocesses.

    For the workers (they are the parallelism) and for the measuring process once they are done,
    when every kernel it needs is already in the on-disk caches.
    """
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1


class FreshCompiles:
    """Resets dynamo whenever the compile key of the next first call differs from the last one.

    A study calls ``enter(key)`` in its ``setup`` for every compiled provider; the workers and the
    measuring process run the same ``setup``, so both start every segment from a fresh dynamo.
    """

    def __init__(self) -> None:
        self.key: Hashable | None = None

    def enter(self, key: Hashable) -> None:
        if key != self.key:
            import torch

            torch._dynamo.reset()
            self.key = key

    def __getstate__(self) -> dict:  # a copy sent to a worker starts with no key: it resets first
        return {"key": None}


def segments(items: Iterable[WarmItem], key: Callable[[WarmItem], Hashable]) -> list[list[WarmItem]]:
    """Cut first calls, given in the harness's order, into maximal runs of one compile key."""
    out: list[list[WarmItem]] = []
    last = object()
    for item in items:
        k = key(item)
        if not out or k != last:
            out.append([])
            last = k
        out[-1].append(item)
    return out


def _init_worker() -> None:
    compile_in_process()


def warm_calls(study: Any, items: Sequence[WarmItem], device: str) -> list[str]:
    """First calls of ``items``, each in the grad mode the harness times it in; the failures."""
    import torch

    failures = []
    for case, provider, mode in items:
        try:
            with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                w = study.setup(case, provider, requires_grad=mode != "fwd")
                y = w.fwd()
                if mode != "fwd":
                    outs = y if isinstance(y, tuple) else (y,)
                    torch.autograd.backward(outs, tuple(torch.randn_like(t) for t in outs))
            del w, y
        except Exception as err:  # noqa: BLE001 - the measuring process records the real failure
            failures.append(f"{case.case_id} {provider} {mode}: {type(err).__name__}: {str(err)[:120]}")
    if device == "cuda":
        torch.cuda.synchronize()
    return failures


def warm_compile_cache(study: Any, groups: Sequence[Sequence[WarmItem]], device: str, workers: int,
                       meanwhile: Callable[[], object] | None = None) -> WarmReport:
    """Run each group's first calls in a worker process (``workers`` at a time), longest first.

    ``meanwhile`` runs in this process while the workers compile: untimed first calls whose cost is
    on the host (cuDNN builds a graph per new shape), made here so that the timed run finds them
    built.
    """
    start = time.perf_counter()
    n = min(workers, len(groups))
    if n == 0:
        return WarmReport(len(groups), 0, 0.0, ())
    failures: list[str] = []
    meanwhile_s = 0.0
    # spawn: a forked child cannot use CUDA once the parent has touched it
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker) as pool:
        ordered = sorted(groups, key=len, reverse=True)
        futures = [pool.submit(warm_calls, study, list(items), device) for items in ordered]
        if meanwhile is not None:
            t = time.perf_counter()
            meanwhile()
            meanwhile_s = time.perf_counter() - t
        for fut in futures:
            try:
                failures += fut.result()
            except Exception as err:  # noqa: BLE001 - a dead worker costs time, not results
                failures.append(f"worker failed: {type(err).__name__}: {str(err)[:200]}")
    return WarmReport(len(groups), n, time.perf_counter() - start, tuple(failures), meanwhile_s)
