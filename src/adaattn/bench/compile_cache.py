"""Compile a study's ``torch.compile``'d providers in parallel worker processes before timing.

torch.compile's cost is serial and per process: the attention study's FlexAttention compiles one
graph per (dtype, head dim, mask, grad mode) group, about 9 s each on the H100 host, 16 groups a
run. Inductor keeps what it compiled in on-disk caches (FX graph, AOTAutograd and Triton kernel
caches) that any later process on the machine hits. So each group's first calls run once in a
worker process, all groups at once, and the measuring process then only traces and loads.

This changes how long a run takes, never what it measures: nothing is timed while the workers
run (they share the device), the measuring process still makes every call itself, and a group
that fails to warm is compiled again there, where its failure becomes the usual status row.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
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


def compile_in_process() -> None:
    """One compile at a time, in this process: no pool of Triton compile subprocesses.

    For the workers (they are the parallelism) and for the measuring process once they are done:
    there every kernel is already in the on-disk caches, and the pool (16 processes on the H100
    host, shut down after each compile and started again by the next) cost 2-7 s per FlexAttention
    group to load what the workers had compiled.
    """
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1


def _init_worker() -> None:
    compile_in_process()


def _warm_group(study: Any, items: Sequence[WarmItem], device: str) -> list[str]:
    """First calls of one compile group, in the grad mode the harness times them in."""
    import torch

    failures = []
    for case, provider, mode in items:
        try:
            with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                w = study.setup(case, provider, requires_grad=mode != "fwd")
                y = w.fwd()
                if mode != "fwd":
                    y.backward(torch.randn_like(y))
            del w, y
        except Exception as err:  # noqa: BLE001 - the measuring process records the real failure
            failures.append(f"{case.case_id} {provider} {mode}: {type(err).__name__}: {str(err)[:120]}")
    if device == "cuda":
        torch.cuda.synchronize()
    return failures


def warm_compile_cache(study: Any, groups: Sequence[Sequence[WarmItem]], device: str, workers: int) -> WarmReport:
    """Run each group's first calls in its own worker process (``workers`` at a time)."""
    start = time.perf_counter()
    n = min(workers, len(groups))
    if n == 0:
        return WarmReport(len(groups), 0, 0.0, ())
    failures: list[str] = []
    # spawn: a forked child cannot use CUDA once the parent has touched it
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker) as pool:
        futures = [pool.submit(_warm_group, study, list(items), device) for items in groups]
        for fut in futures:
            try:
                failures += fut.result()
            except Exception as err:  # noqa: BLE001 - a dead worker costs time, not results
                failures.append(f"worker failed: {type(err).__name__}: {str(err)[:200]}")
    return WarmReport(len(groups), n, time.perf_counter() - start, tuple(failures))
