"""The harness: runs a study's cases x providers x modes and turns them into result rows.

A study supplies its cases, and for each (case, provider, mode) a ``Workload``: a thunk that runs
the op once on prepared inputs, the leaf inputs, and the FLOPs from a written formula. The
harness owns warm-up and timing (through the timer), backward, peak memory, accuracy against
the study's float64 reference, the roofline units, the kernels that ran, and the status rows for
cases that are unavailable, unsupported, out of memory or fail: the study always goes on.

Kernel time (CUDA, ``kernel_calls``) is taken once a case's providers have all been measured: their
workloads are held, and one profiler trace per mode runs their calls interleaved, so that the
providers' ratios do not depend on the order they run in (a few-us kernel's time was seen to
move with the provider measured before it). A workload too large to hold beside the others is
measured alone; the row's reason says which.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from adaattn_pipeline.bench.accuracy import accuracy
from adaattn.timing.memory import Profiled, profiled_call
from adaattn_pipeline.bench.roofline import Ceilings, gbps, mode_bytes, mode_flops, tflops
from adaattn.timing.timers import UncutTrace, gpu_utilization, host_time_ms, kernel_times_ms, quantiles
from adaattn.errors import classify_error


Outputs = Tensor | tuple[Tensor, ...]


@dataclass
class Workload:
    fwd: Callable[[], Outputs]  # one forward call on prepared inputs (a tensor or a tuple of them)
    inputs: Sequence[Tensor]  # leaf tensors (requires_grad for backward modes)
    flops_fwd: float = 0.0  # written formula, e.g. 4*B*H*S^2*D (halved if causal); 0: not compute-bound work
    # written byte counts per mode ("fwd", "bwd"; fwd_bwd is their sum): memory-bound work
    bytes_by_mode: dict[str, float] | None = None
    # maps the forward output onto the study's reference (layout, the slice the reference covers)
    to_reference_layout: Callable[[Outputs], Outputs] = lambda out: out


def _tensors(out: Outputs) -> tuple[Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _clearing(fn: Callable[[], object], leaves: Sequence[Tensor] | None) -> Callable[[], object]:
    """``fn`` after setting the leaves' grads to None, as the timers do before every call: each call
    then starts from the same state (no gradient accumulated into, nor aliased by, a previous one)."""
    if not leaves:
        return fn

    def call() -> object:
        for t in leaves:
            t.grad = None
        return fn()

    return call


def _flat(out: Outputs) -> Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in _tensors(out)])


@dataclass(frozen=True)
class Case:
    case_id: str
    table_id: str
    config: dict[str, Any]  # the case's knobs, one column each in the results
    providers: tuple[str, ...]
    modes: tuple[str, ...]


class Study(Protocol):
    name: str

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload: ...

    def reference(self, case: Case) -> Tensor | None: ...

    def unavailable(self, provider: str, device: str) -> str | None: ...

    def has_backward(self, provider: str) -> bool: ...  # on the device the study is bound to


@dataclass
class _KernelTimeItem:
    """A measured workload whose kernel time is still to be taken (its thunk keeps it alive)."""
    case: Case
    provider: str
    mode: str
    call: Callable[[], object]  # one call in the mode's grad mode, clearing the leaves' grads first
    peak_bytes: int  # the call's peak allocation over what was allocated before it
    kernels: str


@dataclass
class Harness:
    device: str
    timer: Callable
    ceilings: Ceilings
    host_calls: int = 0  # > 0: also time the host side of this many back-to-back calls (CUDA only)
    kernel_calls: int = 0  # > 0: also sum the kernel time of each of this many calls (CUDA only)
    # workloads held for one interleaved kernel-time trace per case and mode, while what is allocated
    # plus the largest held call's peak stays within this fraction of the device's memory
    interleave_memory_fraction: float = 0.25
    kernel_timer: Callable = kernel_times_ms  # (fns, calls) -> KernelTrace, or raises UncutTrace
    utilization_s: float = 0.0  # > 0: NVML GPU utilization over this many seconds of calls (CUDA only)
    utilization_providers: tuple[str, ...] = ()  # ... of these providers
    rows: list[dict] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # where the run's wall time went
    _refs: dict[str, Tensor | None] = field(default_factory=dict)
    _held: list[_KernelTimeItem] = field(default_factory=list)

    @contextmanager
    def _phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.perf_counter() - start

    def _row(self, case: Case, provider: str, mode: str, metric: str, value: float | None, *, unit: str = "",
             p20: float | None = None, p80: float | None = None, mean: float | None = None,
             std: float | None = None, samples: int | None = None, status: str = "ok", reason: str = "",
             kernel: str = "") -> None:
        self.rows.append({
            "table_id": case.table_id, "case_id": case.case_id, "provider": provider, "mode": mode,
            "metric": metric, "value": value, "p20": p20, "p80": p80, "mean": mean, "std": std, "samples": samples,
            "unit": unit, "status": status,
            "reason": reason, "kernel": kernel, **case.config,
        })

    def run(self, study: Study, cases: Iterable[Case], progress: Callable[[str], None] = lambda _: None,
            log: Callable[[str], None] = lambda _: None) -> list[dict]:
        last = time.perf_counter()
        try:
            for case in cases:
                if time.perf_counter() - last > 30:
                    last = time.perf_counter()
                    log(f"{case.case_id}: " + self.phase_summary())
                for provider in case.providers:
                    progress(f"{case.case_id} {provider}")
                    self.run_provider(study, case, provider)
                self._kernel_times_of_held()
                self._refs.pop(case.case_id, None)
                self._release()
        finally:
            self._held.clear()
            gc.unfreeze()  # the caller's collections see everything again
        return self.rows

    def run_provider(self, study: Study, case: Case, provider: str) -> None:
        reason = study.unavailable(provider, self.device)
        for mode in case.modes:
            if reason is not None:
                self._row(case, provider, mode, "time_ms", None, status="unavailable", reason=reason)
            elif mode != "fwd" and not study.has_backward(provider):
                self._row(case, provider, mode, "time_ms", None, status="unsupported",
                          reason=f"{provider} has no backward on {self.device}")
            else:
                self.run_mode(study, case, provider, mode)

    def run_mode(self, study: Study, case: Case, provider: str, mode: str, retry: bool = True) -> None:
        workload = None
        again = False
        try:
            with self._phase("setup"):
                workload = study.setup(case, provider, requires_grad=mode != "fwd")
            self._measure(study, case, provider, mode, workload)
        except Exception as err:  # noqa: BLE001 - every failure becomes a status row; the study goes on
            status, reason = classify_error(err)
            # out of memory while workloads are held for the kernel-time trace: free them, then try again
            again = status == "oom" and retry and bool(self._held)
            if not again:
                self._row(case, provider, mode, "time_ms", None, status=status, reason=reason)
            del workload
        else:
            return
        # outside the except block: the error's traceback no longer keeps the failed call's tensors
        if again:
            self._kernel_times_of_held()
        if status == "oom":
            self._release(unfreeze=True)
        if again:
            self.run_mode(study, case, provider, mode, retry=False)

    def phase_summary(self) -> str:
        return ", ".join(f"{k} {v:.0f}s" for k, v in sorted(self.phase_seconds.items(), key=lambda kv: -kv[1]))

    def _release(self, unfreeze: bool = False) -> None:
        """Free the case's memory: once per case, and after an out-of-memory error.

        With dynamo and inductor loaded a full ``gc.collect()`` walks a few million long-lived
        objects (0.25 s on the H100 host, 12 s a sweep). What survives a collection here is
        long-lived (modules, compiled graphs, caches), so it is frozen out of later collections;
        tensors are freed by reference counting either way. After an out-of-memory error
        everything is unfrozen first, so no cycle can keep device memory alive.
        """
        with self._phase("release memory"):
            if unfreeze:
                gc.unfreeze()
            gc.collect()
            gc.freeze()
            if self.device == "cuda":
                torch.cuda.empty_cache()

    def _measure(self, study: Study, case: Case, provider: str, mode: str, w: Workload) -> None:
        acc: dict[str, float] = {}
        # every call in the grad mode of the timed calls (compiled providers guard on it)
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            with self._phase(f"first call ({provider})"):
                first = w.fwd()
            if mode == "fwd":
                # accuracy from the first call, before timing: an in-place provider (Liger's RoPE)
                # rewrites its inputs on every later call
                with self._phase("float64 reference"):
                    ref = self._reference(study, case)
                    if ref is not None:
                        acc = accuracy(_flat(w.to_reference_layout(first)), _flat(ref))
                thunk = w.fwd
            else:
                outs = _tensors(first)
                grads = tuple(torch.randn_like(t) for t in outs)
                if mode == "fwd_bwd":
                    del outs  # and their autograd graph

                    def thunk() -> Outputs:
                        y = w.fwd()
                        torch.autograd.backward(_tensors(y), grads)
                        return y
                elif mode == "bwd":  # the backward alone, through a graph kept for repeated use

                    def thunk() -> None:
                        torch.autograd.backward(outs, grads, retain_graph=True)
                else:
                    raise ValueError(f"unknown mode {mode!r}; allowed: fwd, bwd, fwd_bwd")
            del first
            clear = w.inputs if mode != "fwd" else None
            with self._phase("timing"):
                t = self.timer(thunk, grad_to_none=clear)
            host_ms = None
            if self.host_calls and self.device == "cuda":
                with self._phase("host time"):
                    host_ms = host_time_ms(thunk, self.host_calls, clear)
            util: float | str | None = None
            if self.utilization_s and self.device == "cuda" and provider in self.utilization_providers:
                with self._phase("GPU utilization (NVML)"):
                    try:
                        util = gpu_utilization(thunk, self.utilization_s, clear)
                    except Exception as err:  # noqa: BLE001 - no NVML: a status row says why
                        util = f"{type(err).__name__}: {err}"
            with self._phase("peak memory + kernel names (profiler)"):
                profiled = profiled_call(_clearing(thunk, clear), self.device)
        common = dict(kernel=profiled.kernels)
        self._row(case, provider, mode, "time_ms", t.p50, p20=t.p20, p80=t.p80, mean=t.mean, std=t.std, unit="ms",
                  **common)
        if isinstance(util, float):
            self._row(case, provider, mode, "gpu_util_pct", util, unit="%",
                      **common)
        elif isinstance(util, str):
            self._row(case, provider, mode, "gpu_util_pct", None, status="error", reason=util[:300], **common)
        if host_ms is not None:
            self._row(case, provider, mode, "host_ms", host_ms, unit="ms", **common)
        if w.flops_fwd:
            flops = mode_flops(w.flops_fwd, mode)
            # rate quantiles: the fast end (p20 time) is the high rate
            self._row(case, provider, mode, "tflops", tflops(flops, t.p50), p20=tflops(flops, t.p80),
                      p80=tflops(flops, t.p20), unit="TFLOP/s", **common)
            self._row(case, provider, mode, "frac_gemm_peak", tflops(flops, t.p50) / self.ceilings.gemm_tflops,
                      unit="fraction", **common)
        if w.bytes_by_mode:
            nbytes = mode_bytes(w.bytes_by_mode, mode)
            self._row(case, provider, mode, "gbps", gbps(nbytes, t.p50), p20=gbps(nbytes, t.p80),
                      p80=gbps(nbytes, t.p20), unit="GB/s", **common)
            self._row(case, provider, mode, "frac_copy_bw", gbps(nbytes, t.p50) / self.ceilings.copy_gbps,
                      unit="fraction", **common)
        self._row(case, provider, mode, "peak_mem_mb", profiled.peak_bytes / 2**20, unit="MiB", **common)
        for metric, value in acc.items():
            self._row(case, provider, mode, metric, value, unit="ratio", **common)
        if self.kernel_calls and self.device == "cuda":
            self._kernel_time_later(case, provider, mode, thunk, clear, profiled)

    def _kernel_time_later(self, case: Case, provider: str, mode: str, thunk: Callable[[], object],
                           clear: Sequence[Tensor] | None, profiled: Profiled) -> None:
        """Hold the workload for its case's interleaved kernel-time trace, or, when holding it would
        take too much of the device's memory, take its kernel time alone now."""
        grad_mode = torch.no_grad if mode == "fwd" else torch.enable_grad  # the grad mode it was timed in
        cleared = _clearing(thunk, clear)

        def call() -> object:
            with grad_mode():
                return cleared()

        item = _KernelTimeItem(case, provider, mode, call, profiled.peak_bytes, profiled.kernels)
        allocated, total = self._device_memory()
        peak = max([item.peak_bytes] + [h.peak_bytes for h in self._held])
        if allocated + peak <= self.interleave_memory_fraction * total:
            self._held.append(item)
        else:
            self._kernel_times([item])

    def _device_memory(self) -> tuple[int, int]:
        """(bytes allocated now, the device's total bytes)."""
        return torch.cuda.memory_allocated(), torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

    def _kernel_times_of_held(self) -> None:
        """The kernel times of the case's held workloads: one trace per mode, their calls interleaved."""
        held, self._held = self._held, []
        for mode in dict.fromkeys(h.mode for h in held):
            self._kernel_times([h for h in held if h.mode == mode])

    def _kernel_times(self, items: list[_KernelTimeItem]) -> None:
        """Kernel time of each item from one profiler session, their calls round robin
        (``timing.timers.kernel_times_ms``); one ``kernel_ms`` row each, its reason saying with how many
        other workloads its calls were interleaved and whether the trace was taken again."""
        trace, status, reason = None, "error", ""
        try:
            with self._phase("kernel time (profiler)"):
                trace = self.kernel_timer([h.call for h in items], self.kernel_calls)
        except UncutTrace as err:
            reason = str(err)
        except Exception as err:  # noqa: BLE001 - a failed trace becomes status rows; the study goes on
            status, reason = classify_error(err)
            if status == "oom":
                self._release(unfreeze=True)
        others = len(items) - 1
        how = f"interleaved with {others} other workload{'s' * (others != 1)}" if others else "measured alone"
        for i, h in enumerate(items):
            if trace is None:
                self._row(h.case, h.provider, h.mode, "kernel_ms", None, status=status, reason=reason, kernel=h.kernels)
                continue
            q = quantiles(trace.samples[i])
            self._row(h.case, h.provider, h.mode, "kernel_ms", q.p50, p20=q.p20, p80=q.p80,
                      samples=len(trace.samples[i]), unit="ms", reason=f"calls {how}{trace.note()}", kernel=h.kernels)

    def _reference(self, study: Study, case: Case) -> Tensor | None:
        if case.case_id not in self._refs:
            self._refs[case.case_id] = study.reference(case)
        return self._refs[case.case_id]

    def ceiling_rows(self) -> list[dict]:
        base = {"table_id": "", "case_id": "machine", "provider": "machine", "mode": "", "status": "ok",
                "reason": "", "kernel": "", "p20": None, "p80": None}
        return [
            {**base, "metric": "copy_gbps", "value": self.ceilings.copy_gbps, "unit": "GB/s"},
            {**base, "metric": "gemm_tflops", "value": self.ceilings.gemm_tflops,
             "unit": "TFLOP/s", "kernel": f"{self.ceilings.gemm_dtype} GEMM {self.ceilings.gemm_size}^3"},
        ]
