"""When the Triton kernels run, and what every kernel launcher shares.

The switches (G4-C1): ``get_kernel_status()``, ``set_use_triton_kernels(bool)`` and the environment
variable ``ADAATTN_DISABLE_TRITON=1``. With the kernels off, without Triton, or for tensors on a
device the kernels cannot run on, the same public functions run the PyTorch references. On a CPU
machine the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI
tests them; it checks correctness, never speed.

Every launch goes through ``Launcher``: after a kernel's first call with a given specialisation it
calls the compiled kernel directly, skipping Triton's per-call argument binding
(``ADAATTN_TRITON_DIRECT_LAUNCH=0`` turns that off).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

ENV_DISABLE = "ADAATTN_DISABLE_TRITON"
ENV_DIRECT = "ADAATTN_TRITON_DIRECT_LAUNCH"
KERNELS = ("rms_norm", "swiglu", "rope", "qk_norm_rope")

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
    if _platform_why() is None and not _use_triton:
        return "disabled by set_use_triton_kernels(False)"
    return _platform_why()


def _platform_why() -> str | None:
    """Why the kernels cannot run here, the process switch aside (None: they can)."""
    version, why = _triton()
    if version is None:
        return why
    if _disabled_by_env():
        return f"disabled by {ENV_DISABLE}={os.environ[ENV_DISABLE]}"
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


def needs_grad(*tensors: Tensor) -> bool:
    """Whether autograd would record a call on these tensors; when not, the eager entry points call
    the forward launcher directly (an autograd Function's apply costs host time even without grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def refuse_grad_leaves(op: str, **tensors: Tensor) -> None:
    """Raise before an in-place op writes any of ``tensors`` when one is a leaf that requires grad,
    or a view of one (autograd checks only once a write has happened, after the first tensor of
    several may already have been written)."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        leaf = t if t._base is None else t._base
        if leaf.is_leaf and leaf.requires_grad:
            raise RuntimeError(f"{op} in place: {name} is a leaf that requires grad, or a view of one, and autograd "
                               "allows no in-place op on it; pass inplace=False or rotate a non-leaf (a projection "
                               "output)")


def kernels_on() -> bool:
    """Whether the kernels run. Under torch.compile the process switch (``set_use_triton_kernels``) is a guard of
    the graph: flipping it recompiles, so a compiled model follows the switch as an eager one does; the rest
    (Triton, the environment, the device) is read once per compilation, a constant of the graph."""
    return _use_triton and _platform_on()


@torch.compiler.assume_constant_result
def _platform_on() -> bool:
    return _platform_why() is None


def use_triton(*tensors: Tensor) -> bool:
    """True when the kernels are on and can run on these tensors' device."""
    if not kernels_on():
        return False
    devices = {t.device.type for t in tensors}
    return devices == {"cuda"} or (devices == {"cpu"} and interpreter())


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


def _hooks_set() -> bool:
    """Whether Triton launch hooks are installed (a profiler such as proton): launches then take
    Triton's own path, which calls them. Triton 3.6 keeps None when unset, 3.9 an empty HookChain."""
    runtime = _triton_runtime_knobs()
    if runtime is None:
        return True
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return True
    return False


@functools.cache
def _triton_runtime_knobs() -> Any:
    import triton

    return getattr(getattr(triton, "knobs", None), "runtime", None)


@functools.cache
def _driver() -> Any:
    from triton.runtime.driver import driver

    return driver.active


_I32, _U64 = 2**31, 2**63


def specialization(values: Sequence[Any], constexpr: Sequence[bool]) -> tuple | None:
    """What Triton specialises a compiled kernel on, per argument, or None for an argument of a kind
    this does not know (that call then takes Triton's own launch). Triton's rules: a tensor by its
    dtype and whether its address is a multiple of 16; an int by being 1 (then a compile-time
    constant), being a multiple of 16, and its width (i32, i64, u64); a bool or float by its type;
    a constexpr by its value."""
    out: list[Any] = []
    for v, const in zip(values, constexpr):
        if const:
            out.append(v)
        elif isinstance(v, Tensor):
            out.append((v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, bool):
            out.append(bool)
        elif isinstance(v, int):
            out.append(1 if v == 1 else (v % 16 == 0) + (0 if -_I32 <= v < _I32 else 4 if v >= _U64 else 2))
        elif isinstance(v, float):
            out.append(float)
        else:
            return None
    return tuple(out)


_direct = os.environ.get(ENV_DIRECT, "1").strip().lower() not in ("0", "false", "no")


def set_direct_launch(enabled: bool) -> None:
    """Turn ``Launcher``'s direct launch on or off for this process (``ADAATTN_TRITON_DIRECT_LAUNCH=0``
    turns it off from the start)."""
    global _direct
    if not isinstance(enabled, bool):
        raise TypeError(f"set_direct_launch takes True or False; got {enabled!r}")
    _direct = enabled


class Launcher:
    """Launch a ``triton.jit`` kernel with less host time per call than ``kernel[grid](...)``.

    Triton's launch binds and specialises every argument on every call, in Python, at several times
    the host time of the compiled kernel's own launcher for a kernel of many arguments. Here the
    first call with a given specialisation (``specialization`` of the positional arguments, the
    keyword arguments, which must be constexprs or launch options, and the device) goes through
    Triton, which compiles and returns the compiled kernel; later calls with the same
    specialisation call that kernel's launcher directly. Triton's own launch runs instead in the
    interpreter, with launch hooks installed, for a runtime argument passed by keyword or of
    another kind, after ``set_direct_launch(False)`` or with ``ADAATTN_TRITON_DIRECT_LAUNCH=0``, and
    on a Triton whose compiled kernel lacks the launcher attributes used here (``run``,
    ``function``, ``packed_metadata``).
    """

    def __init__(self, kernel: Any):
        self.jit = kernel
        params = getattr(kernel, "params", None)
        self.ok = params is not None and not interpreter()
        self.names = [p.name for p in params] if params is not None else []
        self.constexpr = [p.is_constexpr for p in params] if params is not None else []
        self.runtime_names = {p.name for p in params if not p.is_constexpr} if params is not None else set()
        self.compiled: dict[tuple, Any] = {}

    def direct(self) -> bool:
        return self.ok and _direct and not _hooks_set()

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not self.direct() or not self.runtime_names.isdisjoint(kwargs):
            self.jit[grid](*args, **kwargs)
            return
        spec = specialization(args, self.constexpr)
        if spec is None:
            self.jit[grid](*args, **kwargs)
            return
        driver = _driver()
        device = driver.get_current_device()
        key = (device, spec, *kwargs.items())
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.jit[grid](*args, **kwargs)
            if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
                self.compiled[key] = kernel
            return
        try:
            values = [*args, *(kwargs[n] for n in self.names[len(args):])]
        except KeyError:  # a parameter left to its default: Triton's launch fills it in
            self.jit[grid](*args, **kwargs)
            return
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                   driver.get_current_stream(device), kernel.function, kernel.packed_metadata, None, None, None,
                   *values)


# the tuning problems: the main input of each is this many MiB. Spaced by 2x up to 16 MiB, where
# the best config changes fastest with size (a few-us kernel: the grid is a few waves of programs)
TUNE_MIB = (2, 4, 8, 16, 64)
TUNE_CALLS = 10  # profiled calls per config and size


def picks_per_size(table: list[list[float]]) -> list[int]:
    """For each size (column), the index of the fastest config (row); ties go to the config of the
    smaller total time. ``table[config][size]``: times, inf for a config that cannot run."""
    totals = [sum(row) for row in table]
    return [min(range(len(table)), key=lambda i: (table[i][j], totals[i])) for j in range(len(table[0]))]


_SIZE_BOUNDS = [(a * b) ** 0.5 * 2**20 for a, b in itertools.pairwise(TUNE_MIB)]


def size_index(t: Tensor) -> int:
    """Which tuning size a call whose main input is ``t`` runs the config of: the nearest on a log
    scale (bounds at the geometric means of neighbouring sizes)."""
    return bisect.bisect(_SIZE_BOUNDS, t.numel() * t.element_size())


class TunedLaunch:
    """Launch a Triton kernel with a config tuned once per key (the hidden size, or the head counts
    and head dim, and the dtypes), never per number of rows or tokens.

    Tuning: every config of a new key is timed on synthetic problems of that key whose main input
    is ``TUNE_MIB`` MiB each. ``example(key, nbytes, device)`` builds one problem and returns the
    call that runs it through the public launcher, so a backward's partial-sum launch is timed with
    it. A config's time at a size is the median GPU time of its kernels over ``TUNE_CALLS`` calls,
    each after an L2 flush, from one CUPTI trace for every config and size, their calls round robin
    (``timing.timers.kernel_times_ms``): the kernel time the kernels study reports, with no host
    time in it, and no config favoured by where it comes in the order. Back-to-back calls in a CUDA
    graph, timed with events, rank configs differently at small problems (the next kernel's start
    hides the previous one's tail and no call starts from a cold cache); they remain the fallback
    while another profiler is running, where a second trace cannot start, and where no trace could
    be cut into calls (``timing.timers.UncutTrace``).

    The fastest config at each tuning size is kept (``picks_per_size``); a call runs the one kept
    for the tuning size nearest its own main input (the kernel's first argument, ``size_index``):
    a lookup among at most ``len(TUNE_MIB)`` configs, compiled while tuning. No single config is
    within a few percent of the fastest at every size (the persistent backward grids want fewer
    programs per SM at 2 MiB than at 64 MiB); the tuning itself still runs once per key.

    Why not ``triton.autotune``: it tunes on the first call's arguments, so the config depends on
    the first call's token count (one tuned at 2K tokens can be far off at 64K); it times each
    config with CUDA events per call, whose noise at a few-us kernel exceeds the differences
    between configs; and it rebuilds its key from every argument on every call. Here a call of a
    known key is one dict lookup and the launch (``Launcher``).

    Config kwargs named in ``grid_only`` shape the grid (read by the launcher's grid function) and
    are not passed to the kernel: they cost no compilation. In the interpreter, or while a CUDA
    graph is being captured, the first config runs untimed (not kept in the latter case).
    """

    def __init__(self, kernel: Any, configs: list, example: Callable[[tuple, int, torch.device], Callable[[], object]],
                 prune: Callable[[list, tuple, dict], list] | None = None, grid_only: tuple[str, ...] = ()):
        self.jit = kernel
        self.launch = Launcher(kernel)
        self.configs = tuned(configs)
        self.example = example
        self.prune = prune
        self.grid_only = grid_only
        self.chosen: dict[tuple, tuple[dict[str, Any], ...]] = {}  # key -> config per tuning size (or one)
        self.timings: dict[tuple, list[tuple[dict[str, Any], list[float]]]] = {}  # key -> (meta, ms per size)
        self._forced: dict[str, Any] | None = None

    def __call__(self, key: tuple, grid: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Launch; returns the config's meta-parameters it ran with (for grids that depend on them)."""
        meta = self._forced
        if meta is None:
            metas = self.chosen.get(key) or self._choose(key, args, kwargs)
            meta = metas[0] if len(metas) == 1 else metas[size_index(args[0])]
        launch = {k: v for k, v in meta.items() if k not in self.grid_only}
        self.launch(grid(meta) if callable(grid) else grid, *args, **kwargs, **launch)
        return meta

    def _choose(self, key: tuple, args: tuple, kwargs: dict) -> tuple[dict[str, Any], ...]:
        configs = self.prune(self.configs, key, kwargs) if self.prune else self.configs
        metas = [c.all_kwargs() for c in configs] or [self.configs[0].all_kwargs()]
        if len(metas) > 1 and not interpreter():
            if torch.cuda.is_current_stream_capturing():
                return (metas[0],)
            device = next(a.device for a in args if isinstance(a, Tensor))
            with torch.cuda.device(device):
                times = self._time(key, metas, device)
            self.timings[key] = list(zip(metas, times))
            chosen = tuple(metas[i] for i in picks_per_size(times))
        else:
            chosen = (metas[0],)
        self.chosen[key] = chosen
        return chosen

    def _time(self, key: tuple, metas: list[dict[str, Any]], device: torch.device) -> list[list[float]]:
        """ms per call of each config (rows) at each tuning size (columns); inf where it cannot run.
        One profiler session for every config and size."""
        problems = [self.example(key, mib * 2**20, device) for mib in TUNE_MIB]
        pairs = [(i, j) for i, meta in enumerate(metas) for j, problem in enumerate(problems)
                 if self._compiles(meta, problem)]
        calls = [self._forcing(metas[i], problems[j]) for i, j in pairs]
        column = None
        if not torch.autograd._profiler_enabled():
            from adaattn.timing.timers import UncutTrace, kernel_times_ms

            try:
                column = [statistics.median(x) for x in kernel_times_ms(calls, TUNE_CALLS).samples]
            except UncutTrace:
                column = None
        if column is None:  # another profiler is running (or no trace could be cut): back-to-back calls in a CUDA graph
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20)
            copies = [[problem] + [self.example(key, mib * 2**20, device) for _ in range(max(1, -(-2 * l2 // (mib * 2**20)) - 1))]
                      for mib, problem in zip(TUNE_MIB, problems)]
            column = [_graph_ms([self._forcing(metas[i], p) for p in copies[j]]) for i, j in pairs]
        times = [[float("inf")] * len(TUNE_MIB) for _ in metas]
        for (i, j), ms in zip(pairs, column):
            times[i][j] = ms
        return times

    def _forcing(self, meta: dict[str, Any], problem: Callable[[], object]) -> Callable[[], object]:
        """The problem run with this config."""
        def call() -> object:
            self._forced = meta
            try:
                return problem()
            finally:
                self._forced = None
        return call

    def _compiles(self, meta: dict[str, Any], problem: Callable[[], object]) -> bool:
        """Run the problem once with this config (compiling it); False when it cannot run."""
        from triton.runtime.errors import OutOfResources

        try:
            self._forcing(meta, problem)()
            return True
        except OutOfResources:
            return False


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
