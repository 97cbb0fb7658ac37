"""Launches that skip ``Launcher``'s per-launch specialisation once a kind of call has been seen: the
first call records the compiled kernels it ran, later calls of that kind launch them directly."""

from __future__ import annotations

from adaattn.kernels.runtime import Launcher, _driver, specialization

_MISSING = object()


class RecordedLaunches:
    """The launches of one call of a launcher chain (``nystrom_forward``'s four, ``pooled_forward``'s two). The first call of a kind (shapes, strides,
    dtypes, alignment: ``key``) goes through ``Launcher`` and records the compiled kernels it ran;
    later calls of that kind launch those directly, skipping ``Launcher``'s specialisation of some
    20 arguments per launch (``specialization``; its host time per launch is in ``docs/notebook.md``).
    Every argument ``specialization`` reads is a function of ``key``."""

    __slots__ = ("key", "bound", "record", "stream", "i")

    def __init__(self, first: Launcher, key: tuple):
        self.key, self.i = key, 0
        direct = first.direct()  # off under launch hooks (a profiler) or when turned off
        self.bound = BOUND.get(key) if direct else None
        self.record: list | None = [] if direct and self.bound is None else None
        self.stream = _driver().get_current_stream(_driver().get_current_device()) if self.bound else None

    def __call__(self, launcher: Launcher, grid: tuple[int, ...], *args, **kwargs) -> None:
        if self.bound is not None:
            kernel, consts = self.bound[self.i]
            self.i += 1
            kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, self.stream,
                       kernel.function, kernel.packed_metadata, None, None, None, *args, *consts)
            return
        launcher(grid, *args, **kwargs)
        if self.record is None:
            return
        kernel = launcher.compiled.get((_driver().get_current_device(), specialization(args, launcher.constexpr),
                                        *kwargs.items()))
        consts = [kwargs.get(n, _MISSING) for n in launcher.names[len(args):]]
        if kernel is None or _MISSING in consts:  # not compiled for a direct launch: Launcher's path every call
            self.record = None
            return
        self.record.append((kernel, consts))

    def done(self) -> None:
        if self.record is not None and len(BOUND) < MAX_BOUND:
            BOUND[self.key] = self.record


BOUND: dict[tuple, list] = {}  # kind of call -> (compiled kernel, constexpr values) per launch, in order
MAX_BOUND = 1024
