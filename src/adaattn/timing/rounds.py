"""Calls timed side by side: every call takes one turn per round, in an order shuffled per round, so a
drift of the host's speed between rounds lands on every call alike. The one measurement the kernel
manager (ranking backends) and the studies (their speed goals) share.

A turn is one of two kinds (``TURNS``):

- ``"call"``: time per call, what a caller that makes one call after another waits for. On a GPU the
  L2 is flushed and the queue drained, one call is not counted (its host time runs on an idle GPU),
  then ``BURST`` - 1 calls back to back between two CUDA events: the host's time where the call is
  host-bound, the GPU's where it is GPU-bound. On a CPU, one call timed with ``perf_counter``.
- ``"gpu"``: the GPU time of the call's work, as a CUDA graph runs it: the call is captured once (after a
  warm-up on a side stream) and a turn replays it ``GPU_CALLS`` times between two events, so no host time
  shows. A call that cannot be captured (it synchronises, say) is timed behind a sleep kernel that holds
  the stream while the host issues the calls, doubled and taken again where it ended too soon. On a CPU,
  as ``"call"``.

Ratios are read round by round (``round_ratios``: both turns of a round see the same host) and their
median comes with a distribution-free confidence interval (``median_ci``). See ``docs/methods.md``.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch

SEED = 0  # the round orders
WARMUP_CALLS = 3  # per call, before the rounds (the fastest also estimates one call)
BURST = 4  # "call" turns on a GPU: calls back to back; the first is not counted
GPU_CALLS = 2  # "gpu" turns: calls issued behind one hold
HOLD_TRIES = 4  # "gpu" turns: holds tried, each twice the last, before a turn is taken as it came
CI_LEVEL = 0.95  # of a median's confidence interval
TURNS = ("call", "gpu")


def shuffled_rounds(n_calls: int, rounds: int, seed: int = SEED) -> list[list[int]]:
    """The order of each round: every index once, shuffled (reproducibly)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        order = list(range(n_calls))
        rng.shuffle(order)
        out.append(order)
    return out


def warm_ms(call: Callable[[], object], device: str, calls: int = WARMUP_CALLS) -> float:
    """The fastest of ``calls`` calls (ms, synchronised): the warm-up, and an estimate of one call."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = math.inf
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


@functools.cache
def sleep_cycles_per_ms(index: int) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per ms on this GPU (read once per process)."""
    with torch.cuda.device(index):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        return 20_000_000 / max(start.elapsed_time(end), 1e-3)


def _issue_ms(call: Callable[[], object]) -> float:
    """Host time to issue one call on an idle GPU (ms)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return ms


def _gpu_turn(call: Callable[[], object], hold_ms: float, cycles_per_ms: float) -> tuple[float, float]:
    """(GPU ms per call of ``GPU_CALLS`` calls issued behind a hold, the hold that held them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(HOLD_TRIES):
        torch.cuda._sleep(int(hold_ms * cycles_per_ms))
        start.record()
        for _ in range(GPU_CALLS):
            call()
        held = not start.query()  # the hold still ran when the last call was issued
        end.record()
        end.synchronize()
        if held:
            break
        hold_ms *= 2
    return start.elapsed_time(end) / GPU_CALLS, hold_ms


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    """One warm-up stream per device: a new stream's first kernels set up its own library handles."""
    return torch.cuda.Stream(index)


def graphed(call: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
    """``call`` captured as a CUDA graph, or None where it cannot be."""
    side = _side_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture needs its warm-up on a side stream
        call()
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            call()
    except Exception:  # noqa: BLE001 - e.g. a call that synchronises: timed behind a hold instead
        torch.cuda.synchronize()
        _end_rng_capture()
        return None
    return graph


def _end_rng_capture() -> None:
    """A failed capture leaves the CUDA generator in capture mode (torch 2.11, 2.13): every later random op on
    the device raises "Offset increment outside graph capture". A capture that succeeds ends it."""
    flag = torch.zeros(1, device="cuda")
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        flag.add_(1)


def _replay_turn(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GPU_CALLS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / GPU_CALLS


def interleaved_samples_ms(calls: Sequence[Callable[[], object]], device: str, rounds: int, seed: int = SEED,
                           turn: str = "call") -> list[list[float]]:
    """Each call's time (ms) in each of ``rounds`` shuffled rounds of one turn each, in round order
    (sample j of every call comes from round j). ``turn``: "call" or "gpu" (the module docstring)."""
    if not calls or rounds < 1:
        raise ValueError(f"need calls and rounds >= 1; got {len(calls)} calls, {rounds} rounds")
    if turn not in TURNS:
        raise ValueError(f"turn {turn!r} is not one of: {', '.join(TURNS)}")
    order = shuffled_rounds(len(calls), rounds, seed)
    samples: list[list[float]] = [[] for _ in calls]
    if device != "cuda":
        for r in order:
            for i in r:
                t0 = time.perf_counter()
                calls[i]()
                samples[i].append((time.perf_counter() - t0) * 1e3)
        return samples
    if turn == "gpu":
        graphs = [graphed(c) for c in calls]
        cycles = sleep_cycles_per_ms(torch.cuda.current_device())
        # the hold outlasts the host's issue of the turn's calls with room to spare; doubled where it did not
        holds = [0.0 if g is not None else 2 * GPU_CALLS * _issue_ms(c) + 0.5 for c, g in zip(calls, graphs,
                                                                                             strict=True)]
        for r in order:
            for i in r:
                if graphs[i] is not None:
                    samples[i].append(_replay_turn(graphs[i]))
                else:
                    ms, holds[i] = _gpu_turn(calls[i], holds[i], cycles)
                    samples[i].append(ms)
        del graphs
        return samples
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")  # the L2, as CudaTimer
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(rounds * len(calls))]
    turns = []
    for r in order:
        for i in r:
            flush.zero_()
            torch.cuda.synchronize()
            calls[i]()
            s, e = events[len(turns)]
            s.record()
            for _ in range(BURST - 1):
                calls[i]()
            e.record()
            turns.append(i)
    torch.cuda.synchronize()
    for i, (s, e) in zip(turns, events, strict=True):
        samples[i].append(s.elapsed_time(e) / (BURST - 1))
    return samples


def ranked_ms(calls: Mapping[str, Callable[[], object]], device: str, rounds: tuple[int, int], budget_ms: float,
              contender: float = math.inf) -> tuple[dict[str, float], dict[str, str]]:
    """Alternatives ranked by the median of their GPU-time turns (ms), fastest first: each warmed up (one that
    raises is left out, its reason returned), then shuffled rounds, at least and at most ``rounds``, within
    about ``budget_ms`` of calls. On a CPU a call whose warm-up took more than ``contender`` times the fastest's
    takes no rounds and ranks last by its warm-up time; on a GPU the warm-up holds host time, which a ranking by
    GPU time must not prune by. Returns (ms per call in rank order, reasons of the calls that failed)."""
    est, failed = {}, {}
    for name, call in calls.items():
        try:
            est[name] = warm_ms(call, device, calls=2)  # the first call pays the call's setup
        except Exception as err:  # noqa: BLE001 - a call that fails is not a contender
            failed[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    names = [n for n in est if device == "cuda" or est[n] <= contender * min(est.values())]
    ms = dict(est)
    if len(names) > 1:
        per_round = sum(est[n] for n in names) * (GPU_CALLS if device == "cuda" else 1)
        n_rounds = max(rounds[0], min(rounds[1], int(budget_ms / per_round)))
        samples = interleaved_samples_ms([calls[n] for n in names], device, n_rounds, turn="gpu")
        ms.update({n: statistics.median(s) for n, s in zip(names, samples, strict=True)})
    order = sorted(names, key=ms.get) + sorted((n for n in est if n not in names), key=ms.get)
    return {n: ms[n] for n in order}, failed


def round_ratios(test: Sequence[float], other: Sequence[float]) -> list[float]:
    """``test``'s time over ``other``'s in each round: a drift of the host's speed between rounds cancels."""
    if len(test) != len(other) or not test:
        raise ValueError(f"need one sample of each per round; got {len(test)} and {len(other)}")
    return [t / o for t, o in zip(test, other, strict=True)]


def median_ci(samples: Sequence[float], level: float = CI_LEVEL) -> tuple[float, float]:
    """A confidence interval of the median of ``samples`` that assumes nothing of their distribution (only
    that they are independent draws): the order statistics x_(l) and x_(n+1-l), l the largest with
    P(Binomial(n, 1/2) <= l - 1) <= (1 - level) / 2. (-inf, inf) when there are too few samples for
    ``level`` (5 or fewer at 95%)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level}")
    x, n = sorted(samples), len(samples)
    tail, cum, low = (1 - level) / 2, 0.0, 0
    for j in range(n):
        cum += math.comb(n, j) / 2**n  # P(Binomial(n, 1/2) <= j)
        if cum > tail:
            break
        low = j + 1
    if low == 0:
        return -math.inf, math.inf
    return x[low - 1], x[n - low]


def outpaced(samples: Mapping[str, Sequence[float]], level: float = CI_LEVEL) -> dict[str, str]:
    """Calls that another of ``samples`` (their turns in the same rounds) beats with ``level`` confidence:
    the confidence interval of the median of the other's time over theirs, round by round, lies below 1.
    Each maps to the first such other."""
    out = {}
    for name, x in samples.items():
        for other, y in samples.items():
            if other != name and median_ci(round_ratios(y, x), level)[1] < 1:
                out[name] = other
                break
    return out
