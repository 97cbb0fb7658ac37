"""When the Triton kernels run, and what every kernel launcher shares.

The switches (G4-C1): ``get_kernel_status()``, ``set_use_triton_kernels(bool)`` and the environment
variable ``ADAATTN_DISABLE_TRITON=1``. With the kernels off, without Triton, or for tensors on a
device the kernels cannot run on, the same public functions run the PyTorch references. On a CPU
machine the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI
tests them; it checks correctness, never speed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

ENV_DISABLE = "ADAATTN_DISABLE_TRITON"
KERNELS = ("rms_norm", "swiglu", "rope", "qk_norm_rope")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_use_triton: bool = True  # set_use_triton_kernels; the environment variable overrides it


def interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton() -> tuple[str | None, str | None]:
    """(version, None) when Triton imports, else (None, why not)."""
    try:
        import triton
    except Exception as err:  # noqa: BLE001 - the import error is the reason
        return None, f"triton not importable: {type(err).__name__}: {err}"
    return triton.__version__, None


def set_use_triton_kernels(enabled: bool) -> None:
    """Turn the Triton kernels on or off for this process (new calls and new compilations)."""
    global _use_triton
    if not isinstance(enabled, bool):
        raise TypeError(f"set_use_triton_kernels takes True or False; got {enabled!r}")
    _use_triton = enabled


def _disabled_by_env() -> bool:
    return os.environ.get(ENV_DISABLE, "0").strip().lower() not in ("", "0", "false", "no")


def _why_off() -> str | None:
    version, why = _triton()
    if version is None:
        return why
    if _disabled_by_env():
        return f"disabled by {ENV_DISABLE}={os.environ[ENV_DISABLE]}"
    if not _use_triton:
        return "disabled by set_use_triton_kernels(False)"
    if not torch.cuda.is_available() and not interpreter():
        return "no CUDA device (and TRITON_INTERPRET is not set): PyTorch references run instead"
    return None


def get_kernel_status() -> dict[str, Any]:
    """Whether the Triton kernels run here, and if not, why."""
    version, _ = _triton()
    why = _why_off()
    return {
        "triton_available": version is not None,
        "triton_version": version,
        "use_triton_kernels": why is None,
        "reason": why or "",
        "interpreter": interpreter(),
        "cuda_available": torch.cuda.is_available(),
        "env_var": ENV_DISABLE,
        "kernels": list(KERNELS),
    }


@torch.compiler.assume_constant_result
def kernels_on() -> bool:
    """Read once per compilation under torch.compile (a constant of the graph), every call in eager."""
    return _why_off() is None


def use_triton(*tensors: Tensor) -> bool:
    """True when the kernels are on and can run on these tensors' device."""
    if not kernels_on():
        return False
    devices = {t.device.type for t in tensors}
    return devices == {"cuda"} or (devices == {"cpu"} and interpreter())


def check_float(name: str, t: Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16; got {t.dtype}")


def last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def rows(t: Tensor) -> Tensor:
    """(..., N) -> (M, N) without a copy when rows are evenly strided and the last dim is contiguous."""
    t2 = last_dim_contiguous(t).reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def flat_rows(t: Tensor) -> tuple[Tensor, int]:
    """(t as (M, N) rows, row stride) with the fewest host ops: a contiguous t as it is (its rows are
    N apart; no reshape or view, each a few us of host time), otherwise ``rows(t)``."""
    if t.is_contiguous():
        return t, t.shape[-1]
    t2 = rows(t)
    return t2, t2.stride(0)


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_for(n: int, device: torch.device, per_sm: int = 4) -> int:
    """Persistent-style grid for kernels that accumulate per program: ``per_sm`` per SM (8 in the
    interpreter), at most n."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n, per_sm * sm_count(index)))
    return max(1, min(n, 8))


def tuned(configs: list) -> list:
    """Autotune configs; the interpreter gets the first only (it checks correctness, never speed)."""
    return configs[:1] if interpreter() else configs


TUNE_MIB = (4, 16, 64)  # the tuning problems: the main input of each is this many MiB


def worst_case_pick(table: list[list[float]]) -> int:
    """Index of the config whose worst ratio (fastest time at a size / its time there) over the
    sizes is the largest; ties go to the smaller total time. ``table[config][size]``: times, inf
    for a config that cannot run."""
    best = [min(col) for col in zip(*table)]
    def score(i: int) -> tuple[float, float]:
        return min(b / t for b, t in zip(best, table[i])), -sum(table[i])
    return max(range(len(table)), key=score)


class TunedLaunch:
    """Launch a Triton kernel with a config tuned once per key (the hidden size, or the head counts
    and head dim, and the dtypes), never per number of rows or tokens.

    Tuning: every config of a new key is timed on synthetic problems of that key whose main input
    is ``TUNE_MIB`` MiB each. ``example(key, nbytes, device)`` builds one problem and returns the
    call that runs it through the public launcher, so a backward's partial-sum launch is timed with
    it. Each config runs captured in a CUDA graph over enough copies of the problem to cover twice
    the L2 cache: no host time and no cache reuse in the times. The config kept is the one whose
    worst ratio to the fastest config at each size is best (``worst_case_pick``).

    Why not ``triton.autotune``: it tunes on the first call's arguments, so the config depends on
    the first call's token count (one tuned at 2K tokens can be far off at 64K); it times each
    config with CUDA events per call, whose noise at a few-us kernel exceeds the differences
    between configs; and it rebuilds its key from every argument on every call (22 us of host time
    on the H100 host with Triton 3.6). Here a call of a known key is one dict lookup and the launch.

    Config kwargs named in ``grid_only`` shape the grid (read by the launcher's grid function) and
    are not passed to the kernel: they cost no compilation. In the interpreter, or while a CUDA
    graph is being captured, the first config runs untimed (not kept in the latter case).
    """

    def __init__(self, kernel: Any, configs: list, example: Callable[[tuple, int, torch.device], Callable[[], object]],
                 prune: Callable[[list, tuple, dict], list] | None = None, grid_only: tuple[str, ...] = ()):
        self.jit = kernel
        self.configs = tuned(configs)
        self.example = example
        self.prune = prune
        self.grid_only = grid_only
        self.chosen: dict[tuple, dict[str, Any]] = {}
        self.timings: dict[tuple, list[tuple[dict[str, Any], list[float]]]] = {}  # key -> (meta, ms per size)
        self._forced: dict[str, Any] | None = None

    def __call__(self, key: tuple, grid: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Launch; returns the config's meta-parameters it ran with (for grids that depend on them)."""
        meta = self._forced or self.chosen.get(key) or self._choose(key, args, kwargs)
        launch = {k: v for k, v in meta.items() if k not in self.grid_only}
        self.jit[grid(meta) if callable(grid) else grid](*args, **kwargs, **launch)
        return meta

    def _choose(self, key: tuple, args: tuple, kwargs: dict) -> dict[str, Any]:
        configs = self.prune(self.configs, key, kwargs) if self.prune else self.configs
        metas = [c.all_kwargs() for c in configs] or [self.configs[0].all_kwargs()]
        if len(metas) > 1 and not interpreter():
            if torch.cuda.is_current_stream_capturing():
                return metas[0]
            device = next(a.device for a in args if isinstance(a, Tensor))
            with torch.cuda.device(device):
                times = self._time(key, metas, device)
            self.timings[key] = list(zip(metas, times))
            metas = [metas[worst_case_pick(times)]]
        self.chosen[key] = metas[0]
        return metas[0]

    def _time(self, key: tuple, metas: list[dict[str, Any]], device: torch.device) -> list[list[float]]:
        """ms per call of each config (rows) at each tuning size (columns); inf where it cannot run."""
        from triton.runtime.errors import OutOfResources

        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20)
        times: list[list[float]] = [[] for _ in metas]
        for mib in TUNE_MIB:
            nbytes = mib * 2**20
            problems = [self.example(key, nbytes, device) for _ in range(max(2, -(-2 * l2 // nbytes)))]
            for meta, row in zip(metas, times):
                self._forced = meta
                try:
                    row.append(_graph_ms(problems))
                except OutOfResources:
                    row.append(float("inf"))
                finally:
                    self._forced = None
            del problems
        return times


def _graph_ms(problems: list[Callable[[], object]], min_calls: int = 32, replays: int = 3) -> float:
    """ms per call of the problems run round-robin inside one CUDA graph (best of ``replays``)."""
    for p in problems:  # compiles the config (outside the capture)
        p()
    torch.cuda.synchronize()
    reps = max(1, -(-min_calls // len(problems)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for p in problems:
                p()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best / (reps * len(problems))
