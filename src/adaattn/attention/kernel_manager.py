"""AttentionKernelManager: the fastest attention backend that is correct for the inputs, by measurement.

For each signature (hardware, dtype, batch, heads, kv heads, head dim, query and key lengths
rounded up to a power of two, mask kind, grad mode) the manager times every backend that can run
those inputs, once, on the inputs of the first call, and keeps the ranking (in memory and, with a
``cache_path``, in a JSON file written atomically, so the next process does not measure again; a
file written under another torch version, measuring method or objective is ignored). A training signature
(inputs that need gradients) is timed on forward and backward, an inference one on the forward.

What is timed (``timing.timed``): the host time to issue a call; on a GPU the GPU time of its work,
taken with the GPU held by a sleep kernel while the host issues the timed calls, so that host
gaps do not count as GPU time; and the time per call of calls made back to back (CUDA events on a
GPU: the host's time where the call is host-bound, the GPU's where it is GPU-bound; on a CPU, the
host time). The call timed is the caller's whole call when the caller gives it (``call``:
AdaAttention's projections, the op and the output projection, so that the op's host time is
weighed against the module's GPU work, not its own), otherwise the op alone. The backends take
turns in ``ROUNDS`` rounds (``_measure``): a slow spell of the host lands on one turn of several
backends, not on every call of one. Under objective "call" the backends within ``CALL_SPREAD`` of the
fastest then take paired rounds (``_paired``: up to about ``call_budget_ms`` of calls per signature,
1.5 s by default, less where one backend is ahead with confidence) and their time per call is their
typical turn, not their fastest: at a host-bound shape the host's noise is most of a fastest burst.
Those contenders take paired rounds again later (``looks_s``: at the signature's first call 10 s after
its first look, and again 60 s after that), and the ranking goes by each one's worst ratio to the fastest over the
looks (``_look``): a ranking taken once is taken in one spell of the host, and at a host-bound shape
the fastest backend can change with the host's speed.

The ranking (``rank_timings``) is by ``objective``: "call" (the default) by time per call, which is
what a caller that makes one call after another waits for; "gpu" by GPU time, which is what the
choice changes wherever the host runs ahead of the GPU (a CUDA graph, a GPU-bound model around the
call). The two part ways only where the call is host-bound: in the scaling study's H100 run at code
961666b0 (E=512 bf16, forward, B=1 S=512-2048 and B=4 S=1024; the op alone, as the manager timed it
then, ranking by GPU time), SDPA's own dispatch (cuDNN) took 2.4-4.1x less GPU time than forced
efficient attention and 8-14 us more host time per call, and the module, which ran SDPA, took
1.11-1.23x the time per call of the module around forced efficient attention (side by side). Under
"gpu" host time decides only where it is far out of line: a backend
whose issue time exceeds both its GPU time and ``HOST_SLACK`` (2x) times the leanest backend's goes
after the others. Ties (within ``TIE``, 2%, of each other's time) go first to a backend that does not
hold the (L, S) score matrix in memory (``SCORES_KEPT``: math and forced SDPA math), then to one that calls
SDPA without forcing one of its backends (``_sdpa_forced``), then to the faster call (objective
"call") or the leaner host ("gpu"); under "call" on a GPU only backends whose GPU times are within
``TIE`` too tie (the same kernel through two dispatch paths). Calls then go to the first. A backend that fails on a call falls back to
the next one of the ranking; the reason is logged once per (backend, reason) and counted in
``get_statistics()``.

Backends and signatures: ``backends.py``; how one call is timed: ``timing.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from adaattn.attention import timing
from adaattn.attention.backends import BACKENDS, FLASH_LIKE, Run, Signature
from adaattn.attention.paired import paired_times
from adaattn.attention.timing import Timing

log = logging.getLogger(__name__)

HOST_SLACK = 2.0  # a GPU backend is host-heavy when its issue time exceeds its GPU time and this x the leanest's
# Times within 2% are a tie (the ranking's time: per call, or GPU time): SDPA's own dispatch and the
# backend it dispatches to, forced, run the same kernel (H100 scaling run at code 1a538248: SDPA's and
# forced cuDNN's GPU times within 1.5% at all 18 signatures), and forcing costs host time every call,
# which the manager's few calls do not resolve: a tie goes first to the backend not forced. When forcing
# still entered ``sdpa_kernel`` (see ``_sdpa_forced``): on the CPU (scaling run at code
# 4622cc24) forced flash measured 0.554 ms, SDPA 0.557 ms at B=1 S=256, and the module through forced
# flash then took 1.074x the direct SDPA call per round; on the H100 (run at code ea179147) forced
# cuDNN's host time came out 0.255 ms, SDPA's 0.274 ms at B=4 S=1024 forward and backward, and the
# module through forced cuDNN took 1.091x the direct SDPA call per round. Setting the flags costs less,
# but still more than not forcing. Under objective "call" two different kernels do not tie: in the H100
# scaling run at code c10e18f2 (the tie then took any backend within 2%, the leaner GPU first) the paired
# rounds put the module's call through forced flash ahead of forced cuDNN, by less than 2%, at B=16
# S=1024 forward and backward; the tie gave it to cuDNN's leaner GPU, and the module took 1.087x the direct flash call per round
TIE = 0.02
WRAPPED = frozenset(b.name for b in BACKENDS.values() if b.wrapped)
# A tie goes to a backend that does not hold the score matrix before one that does (``rank_timings``). Why: where
# attention is a small part of the call, backends tie on time and the choice decided the call's peak memory.
# The CPU precision study's fp16 block (B=2 S=256 E=256, forward; the module's call timed with each backend) on
# the development CPU, two runs at code 9cc0577d (scratch): forced math first (11.36 ms per call; forced flash
# 11.58, SDPA 11.63) in one, SDPA first (12.54; forced math 12.31, within the tie) in the other; the block's
# forward peaked at 7.50 MiB through forced math and 2.75 MiB through SDPA's flash kernel
SCORES_KEPT = frozenset(b.name for b in BACKENDS.values() if b.keeps_scores)
ROUNDS = 5  # the backends' turns per signature, interleaved
CONTENDER_ROUNDS, CONTENDER = 2, 3.0  # after this many rounds, a backend this much slower than the fastest stops
# objective "call": the backends within CALL_SPREAD x the fastest time per call (its fastest burst) then take
# paired rounds (``_paired``): at least, at most CALL_ROUNDS, about call_budget_ms of calls, a look every
# CALL_BATCH rounds (it stops when the fastest is ahead of every other with CI_LEVEL confidence)
CALL_SPREAD = 2.0
CALL_ROUNDS = (10, 100)
CALL_BATCH = 10
CALL_BUDGET_MS = 1500.0
# objective "call": the contenders of the paired rounds (``_paired``) take them again at the signature's first call
# this long (s) after its last look, one look per gap, and rank by their worst ratio to the fastest over the looks (``_look``).
# Why: in the H100 scaling run at code 9dc0b0e8 the manager's paired rounds at B=1 S=4096 forward put forced
# flash (0.209 ms per call) ahead of SDPA (0.22), both host-bound in a slow spell of the host; in the study's
# side-by-side rounds later SDPA's shorter kernel won and the module took 1.130x its time per call, and a
# manager ranking the same signature by GPU time after the sweep timed SDPA's call at 0.113 ms, flash's at 0.138
LOOKS_S = (10.0, 60.0)
LOOK_EVERY = 256  # calls: a replay of a choice with a look still to come asks the manager again this often
METHOD = 10  # how rankings are made (10: paired rounds, looked at again, ties by memory); a cache made otherwise is not trusted
OBJECTIVES = ("call", "gpu")  # what a ranking is by: time per call, or GPU time


@dataclass(frozen=True)
class Look:
    """One look of paired rounds at a signature's contenders (objective "call")."""

    at_s: float  # seconds after the signature's first look (0: the first)
    ms: dict[str, float] = field(default_factory=dict)  # typical time per call (``paired_times``), per contender
    rounds: int = 0


def worst_ratios(looks: Sequence[Look]) -> dict[str, float]:
    """Each backend timed in every look: its highest ratio, over the looks, to the fastest of that look."""
    names = [n for n in looks[0].ms if all(n in look.ms for look in looks)] if looks else []
    return {n: max(look.ms[n] / min(look.ms[m] for m in names) for look in looks) for n in names}


def rank_timings(times: dict[str, Timing], objective: str = "call", host_slack: float = HOST_SLACK, tie: float = TIE,
                 wrapped: frozenset[str] = WRAPPED, scores_kept: frozenset[str] = SCORES_KEPT) -> list[str]:
    """Backends fastest first by ``objective``: "call", time per call; "gpu", GPU time with host-heavy
    backends last (on a CPU both are time per call). A tie (within ``tie``) goes first to the backends
    not in ``scores_kept``, then to those not in ``wrapped``, then to the faster call ("call") or the
    leaner host ("gpu"). Under "call" on a GPU,
    backends tie only where their GPU times are within ``tie`` too: the same kernel through two dispatch
    paths (SDPA's own and the backend it dispatches to, forced), not two kernels whose calls came out
    close."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of: {', '.join(OBJECTIVES)}")
    cpu = any(t.gpu_ms is None for t in times.values())
    by_gpu = objective == "gpu" and not cpu
    lean = min(t.host_ms for t in times.values())

    def time_of(n: str) -> float:  # what the ranking is by
        return times[n].gpu_ms if by_gpu else times[n].call_ms

    def heavy(n: str) -> bool:
        return by_gpu and times[n].host_ms > max(times[n].gpu_ms, host_slack * lean)

    def leaner(n: str) -> float:
        return times[n].host_ms if by_gpu or cpu else times[n].call_ms

    def same_kernel(n: str, head: str) -> bool:  # "call" on a GPU: GPU times within the tie as well
        gpu = (times[n].gpu_ms, times[head].gpu_ms)
        return by_gpu or cpu or max(gpu) <= (1 + tie) * min(gpu)

    rest = sorted(times, key=lambda n: (heavy(n), time_of(n), leaner(n)))
    out: list[str] = []
    while rest:  # the next backend and those tied with it
        head = rest[0]
        tied = [n for n in rest if heavy(n) == heavy(head) and time_of(n) <= (1 + tie) * time_of(head)
                and same_kernel(n, head)]
        out += sorted(tied, key=lambda n: (n in scores_kept, n in wrapped, leaner(n)))
        rest = [n for n in rest if n not in tied]
    return out


def _reason(err: BaseException) -> str:
    first = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {first}"


class AttentionKernelManager:
    """Picks, per signature, the fastest backend measured on this machine; falls back down its ranking."""

    def __init__(self, backends: list[str] | None = None, cache_path: str | os.PathLike | None = None,
                 warmup: int = 1, repeats: int = 5, objective: str = "call", call_budget_ms: float = CALL_BUDGET_MS,
                 looks_s: Sequence[float] = LOOKS_S):
        names = list(BACKENDS) if backends is None else list(backends)
        unknown = [n for n in names if n not in BACKENDS]
        if unknown or not names:
            raise ValueError(f"unknown attention backend(s) {unknown or names}; allowed: {', '.join(BACKENDS)}")
        if warmup < 0 or repeats < 1:
            raise ValueError(f"warmup >= 0 and repeats >= 1 required; got {warmup}, {repeats}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective {objective!r} is not one of: {', '.join(OBJECTIVES)}")
        if not call_budget_ms >= 0:  # NaN too
            raise ValueError(f"call_budget_ms must be >= 0 (0: no paired rounds); got {call_budget_ms}")
        looks_s = tuple(looks_s)
        if not all(isinstance(t, int | float) and 0 < t < math.inf for t in looks_s):
            raise ValueError(f"looks_s must be finite times > 0 (s from one look at a signature to the next; () for "
                             f"none); got {looks_s}")
        self.looks_s = looks_s
        # True: looks that come due wait for a call made with it False (a benchmark holds them through its timed
        # calls, where a look's paired rounds would count as the call's time and memory, and lets them run in
        # its warm-up)
        self.hold_looks = False
        self.backends = names
        self.objective = objective
        self.call_budget_ms = call_budget_ms
        self.warmup, self.repeats = warmup, repeats
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.timings: dict[str, dict[str, Timing]] = {}  # signature -> backend -> what its ranking came from
        self.timed: dict[str, str] = {}  # signature -> what was timed: "call" (the caller's) or "op" (the op alone)
        self.looks: dict[str, list[Look]] = {}  # signature -> its looks of paired rounds (objective "call")
        self._first: dict[str, float] = {}  # signature -> time.monotonic() of its first look (a cache's: its last at the load)
        self._due: dict[str, float] = {}  # signature -> time.monotonic() its next look is due at (none: no more)
        self.rankings: dict[str, list[str]] = self._load()
        self.calls: Counter[str] = Counter()
        self.fallbacks: Counter[tuple[str, str]] = Counter()  # (backend, reason)
        self._disabled: frozenset[str] = frozenset()  # backends made unavailable (tests, user choice): disable()
        # callers' replays of a backend this manager chose (AdaAttention's plans: ``backend``, ``calls``,
        # ``limit``), calling it without the manager: counted here when asked, stopped when a choice may change
        self._tracked: set = set()

    @property
    def disabled(self) -> frozenset[str]:
        return self._disabled

    def disable(self, *names: str) -> None:
        """Make backends unavailable to this manager; calls go down the ranking past them."""
        self._set_disabled(self._disabled | set(names))

    def enable(self, *names: str) -> None:
        self._set_disabled(self._disabled - set(names))

    def _set_disabled(self, names: frozenset[str]) -> None:
        unknown = sorted(n for n in names if n not in BACKENDS)
        if unknown:
            raise ValueError(f"unknown attention backend(s) {unknown}; allowed: {', '.join(BACKENDS)}")
        self._disabled = frozenset(names)
        for plan in tuple(self._tracked):  # a choice already made may change: its next call asks again
            plan.limit = plan.calls

    def track(self, plan) -> None:
        """A replay of one of this manager's choices (an object with ``backend``, ``calls`` and ``limit``)
        that calls the backend itself: its ``calls`` count as this manager's until ``untrack``, and a
        change of choice sets its ``limit`` to its ``calls`` (the caller asks again on its next call)."""
        self._tracked.add(plan)

    def untrack(self, plan) -> None:
        """The replay ends: its calls go to this manager's own count."""
        if plan in self._tracked:
            self._tracked.remove(plan)
            if plan.calls:
                self.calls[plan.backend] += plan.calls

    def __getstate__(self) -> dict:
        """Copies and pickles hold the replays' calls in their own count, not the replays: those stay
        with their callers and this manager (and may hold backends that do not pickle)."""
        state = self.__dict__.copy()
        state["calls"], state["_tracked"] = self.call_counts(), set()
        return state

    def call_counts(self) -> Counter[str]:
        """Calls per backend: through the manager and in the replays it tracks."""
        calls = Counter(self.calls)
        for plan in tuple(self._tracked):  # a snapshot: another thread may file or retire plans
            if plan.calls:
                calls[plan.backend] += plan.calls
        return calls

    # ------------------------------------------------------------------ persistence

    def _load(self) -> dict[str, list[str]]:
        if self.cache_path is None or not self.cache_path.exists():
            return {}
        try:
            data = json.loads(self.cache_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            log.warning("ignoring unreadable kernel choice cache %s: %s", self.cache_path, err)
            return {}
        seen = (data.get("torch"), data.get("method"), data.get("objective"))
        if seen != (torch.__version__, METHOD, self.objective):
            log.warning("ignoring kernel choice cache %s: measured under torch %s, method %s, objective %s; this is "
                        "%s, method %s, objective %s", self.cache_path, *seen, torch.__version__, METHOD, self.objective)
            return {}
        rankings = {k: v for k, v in data.get("rankings", {}).items() if all(b in BACKENDS for b in v)}
        for key, times in data.get("timings", {}).items():
            if key in rankings:
                self.timings[key] = {b: Timing(*t) for b, t in times.items()}
        self.timed = {k: v for k, v in data.get("timed", {}).items() if k in rankings}
        now = time.monotonic()
        for key, looks in data.get("looks", {}).items():  # looks still to come: as if the last were taken now
            if key in rankings and looks:
                self.looks[key] = [Look(at, dict(ms), rounds) for at, ms, rounds in looks]
                self._first[key] = now - self.looks[key][-1].at_s
                self._schedule(key)
        return rankings

    def _save(self) -> None:
        if self.cache_path is None:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"torch": torch.__version__, "method": METHOD, "objective": self.objective, "rankings": self.rankings,
                   "timings": {k: {b: [t.host_ms, t.gpu_ms, t.call_ms, t.rounds] for b, t in times.items()}
                               for k, times in self.timings.items()}, "timed": self.timed,
                   "looks": {k: [[look.at_s, look.ms, look.rounds] for look in looks] for k, looks in self.looks.items()}}
        fd, tmp = tempfile.mkstemp(dir=self.cache_path.parent, prefix=self.cache_path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
        os.replace(tmp, self.cache_path)  # atomic: an interrupted write never leaves half a file

    # ------------------------------------------------------------------ choice

    def candidates(self, sig: Signature) -> list[tuple[str, str | None]]:
        """(backend, reason it cannot run or None) for every configured backend."""
        out = []
        for name in self.backends:
            why = "disabled" if name in self._disabled else BACKENDS[name].why_not(sig)
            out.append((name, why))
        return out

    def ranking(self, sig: Signature, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                scale: float | None, call: Callable[[Run], Callable[[], object]] | None = None) -> list[str]:
        """The signature's backends, fastest first, measured on these inputs when it has no ranking yet.
        ``call(run)``: the caller's whole call with the op made by ``run`` (for a training signature,
        forward and backward), timed instead of the op alone."""
        key = sig.key()
        ranked = self.rankings.get(key)
        if ranked is None:
            ranked = self._measure(sig, q, k, v, attn_mask, is_causal, scale, call)
            self.rankings[key] = ranked
            self._save()
        elif key in self._due and not self.hold_looks and time.monotonic() >= self._due[key]:
            ranked = self._look(sig, self._calls(sig, q, k, v, attn_mask, is_causal, scale, call), q.device)
            self._save()
        return [b for b in ranked if b not in self._disabled] if self._disabled else ranked

    def _measure(self, sig, q, k, v, attn_mask, is_causal, scale, call=None) -> list[str]:
        """Every candidate timed in ``ROUNDS`` rounds, one turn each per round, the order rotated: host time
        and time per call the fastest of all its turns (the host's noise only adds time), GPU time the median
        of its turns. One backend after another, a slow spell of the host made all of one backend's calls slow
        (H100 scaling run at code 4622cc24, B=1 S=2048 forward and backward: SDPA's issue time 2.52 ms,
        0.2-0.3 ms at the signatures around it, so it went last as host-heavy and the module called forced
        cuDNN, the same kernel behind a context manager). After ``CONTENDER_ROUNDS`` rounds a backend more than
        ``CONTENDER`` times slower than the fastest (by the ranking's time) takes no more turns: it cannot
        come first, and at long sequences the math backends' calls are most of the measurement."""
        calls = self._calls(sig, q, k, v, attn_mask, is_causal, scale, call)
        times = self._timings(calls, q.device)
        if not times:
            raise RuntimeError(f"no attention backend can run {sig}: " + "; ".join(
                f"{n}: {w}" for n, w in self.candidates(sig) if w))
        key = sig.key()
        self.timings[key] = times
        self.timed[key] = "op" if call is None else "call"
        paired = {n: t for n, t in times.items() if t.rounds}  # their times are typical turns, the others' fastest
        rest = {n: t for n, t in times.items() if not t.rounds}
        if len(paired) > 1:
            self.looks[key] = [Look(0.0, {n: t.call_ms for n, t in paired.items()}, max(t.rounds for t in paired.values()))]
            self._first[key] = time.monotonic()
            self._schedule(key)
        return (rank_timings(paired, self.objective) if paired else []) + (rank_timings(rest, self.objective) if rest else [])

    def _timings(self, calls: dict[str, Callable[[], object]], device: torch.device) -> dict[str, Timing]:
        """``calls`` timed in ``ROUNDS`` interleaved rounds (``_measure``), then, under objective "call", the paired
        rounds of those within ``CALL_SPREAD`` of the fastest (``_paired``). A call that fails is left out, its
        reason noted."""
        turns: dict[str, list[Timing]] = {name: [] for name in calls}
        names = list(calls)
        for r in range(ROUNDS):
            if r == CONTENDER_ROUNDS and turns:
                lead = {n: self._time_of(timing.combined(ts)) for n, ts in turns.items()}
                names = [n for n in names if n in lead and lead[n] <= CONTENDER * min(lead.values())]
            first = r % len(names) if names else 0
            for name in names[first:] + names[:first]:
                if name not in turns:
                    continue
                try:
                    turns[name].append(timing.timed(calls[name], device, self.warmup if r == 0 else 0, self.repeats))
                except Exception as err:  # noqa: BLE001 - a backend that fails is not a candidate
                    self._note_fallback(name, f"rejected while measuring: {_reason(err)}")
                    del turns[name]
        times = {name: timing.combined(ts) for name, ts in turns.items()}
        if self.objective == "call" and self.call_budget_ms > 0:
            times = self._paired(calls, times, device)
        return times

    def time_calls(self, calls: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
        """Alternatives that are not this manager's backends, timed as it times its backends and by what it
        ranks them by (``objective``): ms per call of each of ``calls`` (a name that failed is left out, its
        reason noted as a fallback). AdaAttention's rank policy weighs its low-rank path against the exact
        path's backend with it (``rank.choose_rank``'s ``speed``). A call timed for the first time takes its
        warm-up turns here."""
        return {name: self._time_of(t) for name, t in self._timings(calls, device).items()}

    def _calls(self, sig, q, k, v, attn_mask, is_causal, scale, call=None) -> dict[str, Callable[[], object]]:
        """The call to time per backend that can run ``sig``: the caller's (``call(run)``) or the op alone."""
        return {name: call(BACKENDS[name].run) if call is not None else
                timing.workload(BACKENDS[name].run, q, k, v, attn_mask, is_causal, scale, sig.grad)
                for name, why in self.candidates(sig) if why is None}

    def _schedule(self, key: str) -> None:
        """When ``key``'s next look is due (its gap in ``looks_s`` after the last), or none when it has had them all."""
        looks = self.looks[key]
        if len(looks) <= len(self.looks_s):
            self._due[key] = self._first[key] + looks[-1].at_s + self.looks_s[len(looks) - 1]
        else:
            self._due.pop(key, None)

    def calls_until_look(self, key: str) -> int:
        """How many calls of signature ``key`` a caller may make without asking the manager (a replay of its
        choice: AdaAttention's plans): ``LOOK_EVERY`` while a look is to come (the calls that ask find out
        whether it is due), otherwise any number."""
        return LOOK_EVERY if key in self._due else sys.maxsize

    def _look(self, sig: Signature, calls: dict[str, Callable[[], object]], device: torch.device) -> list[str]:
        """A look that came due: the first look's contenders that can still run take paired rounds again
        (``_rounds``, on this call's inputs); the signature's ranking then puts those timed in every look
        first, by their worst ratio to the fastest over the looks (``worst_ratios``; ties as ``rank_timings``),
        then the rest as before. A backend that fails here is not a candidate. Where the first backend
        changes, the replays of the old choice ask again (``track``; those of other signatures with the same
        backend too: they find their own choice unchanged)."""
        key = sig.key()
        looks, old = self.looks[key], self.rankings[key]
        est = {n: looks[-1].ms[n] for n in looks[0].ms if n in calls}
        typical, rounds = self._rounds(calls, list(est), est, device) if len(est) > 1 else ({}, 0)
        looks.append(Look(time.monotonic() - self._first[key], typical, rounds))
        self._schedule(key)
        worst = worst_ratios(looks)
        times = self.timings[key]
        timed = rank_timings({n: Timing(times[n].host_ms, times[n].gpu_ms, r, rounds) for n, r in worst.items()},
                             self.objective) if worst else []
        failed = {n for n in est if n not in typical} if len(est) > 1 else set()
        ranked = timed + [n for n in old if n not in timed and n not in failed]
        self.rankings[key] = ranked
        if ranked[:1] != old[:1]:
            for plan in tuple(self._tracked):
                if plan.backend == old[0]:
                    plan.limit = plan.calls
        return [b for b in ranked if b not in self._disabled] if self._disabled else ranked

    def _paired(self, calls: dict[str, Callable[[], object]], times: dict[str, Timing],
                device: torch.device) -> dict[str, Timing]:
        """Objective "call": the backends within ``CALL_SPREAD`` x the fastest time per call (its fastest
        burst) take paired rounds, one turn each per round (``timing.turn``), the order rotated; their time per
        call becomes the typical turn (``paired_times``), ranked before the others. A fastest burst says
        little of a host-bound call's typical time. On a lent H100's host (scratch run at code 18844d3c, E=512
        bf16, forward and backward, five shapes from B=1 S=1024 to B=16 S=1024, each call made three ways:
        as the manager times it, as the scaling study's direct call, through the module) the fastest bursts
        of five rounds put the call through forced cuDNN at 0.79-1.05 ms and through forced flash at
        0.76-0.94, and the three ways ranked the two differently at three of the shapes; the medians of 150
        side-by-side rounds put cuDNN 2-10% behind flash at every shape, each way (its host time is longer;
        its GPU time, shorter, hides under it). Rounds: at least ``CALL_ROUNDS[0]``, then every ``CALL_BATCH`` a
        look, until the fastest's ratio to every other is below 1 with ``CI_LEVEL`` confidence, about
        ``call_budget_ms`` of calls are spent, or ``CALL_ROUNDS[1]`` rounds. A backend that fails here is
        not a candidate."""
        best = min((t.call_ms for t in times.values()), default=math.inf)
        names = [n for n, t in times.items() if t.call_ms <= CALL_SPREAD * best]
        if len(names) < 2:
            return times
        typical, done = self._rounds(calls, names, {n: times[n].call_ms for n in names}, device)
        times = {n: t for n, t in times.items() if n in typical or n not in names}  # those that failed are out
        for name, ms in typical.items():
            t = times[name]
            times[name] = Timing(t.host_ms, t.gpu_ms, ms, done)
        return times

    def _rounds(self, calls: dict[str, Callable[[], object]], names: list[str], est_ms: dict[str, float],
                device: torch.device) -> tuple[dict[str, float], int]:
        """Paired rounds of ``names`` (``_paired``; ``est_ms``: each one's time per call, for the budget): their
        typical turns (``paired_times``) and the rounds taken; a backend that fails is left out, its reason noted."""
        per_round = sum(est_ms[n] for n in names) * (self.repeats + 1 if device.type == "cuda" else 1)
        most = min(CALL_ROUNDS[1], max(CALL_ROUNDS[0], math.ceil(self.call_budget_ms / per_round)))
        samples: dict[str, list[float]] = {n: [] for n in names}
        for r in range(most):
            first = r % len(names)
            for name in names[first:] + names[:first]:
                try:
                    samples[name].append(timing.turn(calls[name], device, self.repeats))
                except Exception as err:  # noqa: BLE001 - a backend that fails is not a candidate
                    self._note_fallback(name, f"rejected while measuring: {_reason(err)}")
                    del samples[name]
            names = [n for n in names if n in samples]
            if len(names) < 2 or (r + 1 >= CALL_ROUNDS[0] and (r + 1) % CALL_BATCH == 0 and timing.settled(samples)):
                break
        if not samples:
            return {}, 0
        return paired_times(samples), len(next(iter(samples.values())))

    def _time_of(self, t: Timing) -> float:
        """What the ranking is by (``rank_timings``)."""
        return t.gpu_ms if self.objective == "gpu" and t.gpu_ms is not None else t.call_ms

    def _note_fallback(self, name: str, reason: str) -> None:
        if (name, reason) not in self.fallbacks:
            log.warning("attention backend %s unavailable: %s", name, reason)
        self.fallbacks[(name, reason)] += 1

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
                 scale: float | None = None, sig: Signature | None = None,
                 call: Callable[[Run], Callable[[], object]] | None = None) -> tuple[Tensor, str]:
        """Attention through the fastest backend that runs; returns (output, backend name). ``sig``: the
        caller's ``Signature.of(q, k, mask kind)``, when it has it; ``call``: the caller's whole call, timed
        instead of the op alone when the signature is measured (``ranking``)."""
        if sig is None:
            sig = Signature.of(q, k, "causal" if is_causal else "none" if attn_mask is None else "mask")
        for name in self.ranking(sig, q, k, v, attn_mask, is_causal, scale, call):
            try:
                out = BACKENDS[name].run(q, k, v, attn_mask, is_causal, scale)
            except Exception as err:  # noqa: BLE001 - fall back down the ranking, reason logged once
                self._note_fallback(name, _reason(err))
                continue
            self.calls[name] += 1
            return out, name
        raise RuntimeError(f"every attention backend failed for {sig}; fallbacks: {dict(self.fallbacks)}")

    def get_statistics(self) -> dict:
        calls = self.call_counts()
        total = sum(calls.values())
        return {"calls": dict(calls), "total_calls": total,
                "flash_ratio": sum(n for b, n in calls.items() if b in FLASH_LIKE) / total if total else 0.0,
                "fallbacks": [{"backend": b, "reason": r, "count": n} for (b, r), n in self.fallbacks.items()],
                "signatures": len(self.rankings), "objective": self.objective}
