"""AttentionKernelManager: per input signature, the attention backend measured fastest on this machine.

Dispatch: a signature (hardware, dtype, batch, heads, kv heads, head dim, query and key lengths rounded up
to a power of two, mask kind, grad mode) is looked up in the rankings, measured on an eager call when it has
none, and run by the first backend that works, falling back down the ranking (each reason logged once and
counted in ``get_statistics()``). Under ``torch.compile`` nothing is measured: ``traced_backend`` names the
backend to emit, the ranking's first that traces, or ``DEFAULT`` (the signature is then listed as untuned).

Measurement (``timing.rounds``, shared with the studies): the backends named, or the few the hardware leaves
in the running (``IN_THE_RUNNING``), each warmed up, then a few shuffled rounds of GPU-time turns (the call
captured as a CUDA graph and replayed: the host's time kept out, as compiled models run it), about
``budget_ms`` of calls, ranked by the median turn. Rankings persist (``cache_path``, ``ranking_cache.py``)
with the GPU, torch and Triton versions and the ``METHOD``; an entry made under others is ignored, the reason
kept in ``get_statistics()["stale"]``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch import Tensor

from adaattn.attention.backends import BACKENDS, FLASH_LIKE, Signature, workload
from adaattn.attention.ranking_cache import RankingCache
from adaattn.timing.rounds import ranked_ms

log = logging.getLogger(__name__)

DEFAULT = "sdpa"  # the hardware's default: SDPA's own dispatch, for a signature without a ranking under tracing
# what a manager without ``backends`` measures, per device: the fused kernels on a GPU (math, forced SDPA math and
# chunked hold or loop over the scores, built for memory rather than speed; flex compiles per shape)
IN_THE_RUNNING = {"cuda": ("flash_attn", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa"),
                  "cpu": ("sdpa", "sdpa_flash", "sdpa_math", "math")}
# On a CPU, a backend whose warm-up call took this much longer than the fastest's takes no rounds; then rounds,
# at least and at most, within about BUDGET_MS of calls. Sized for a first call of a new signature within
# 0.5 s of the direct backend's (the scaling study's first_call_s rows; docs/notebook.md, 2026-11-26)
CONTENDER = 2.0
ROUNDS = (3, 10)
BUDGET_MS = 100.0


def _reason(err: BaseException) -> str:
    first = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {first}"


class AttentionKernelManager:
    """Picks, per signature, the fastest backend measured on this machine; falls back down its ranking."""

    def __init__(self, backends: list[str] | None = None, cache_path: str | os.PathLike | None = None,
                 budget_ms: float = BUDGET_MS):
        if backends is not None:
            unknown = [n for n in backends if n not in BACKENDS]
            if unknown or not backends:
                raise ValueError(f"unknown attention backend(s) {unknown or backends}; allowed: {', '.join(BACKENDS)}")
        if not budget_ms > 0:  # NaN too
            raise ValueError(f"budget_ms must be > 0; got {budget_ms}")
        self.backends = None if backends is None else list(backends)
        self.budget_ms = budget_ms
        self.rankings: dict[str, list[str]] = {}  # signature -> backends, fastest first
        self.times_ms: dict[str, dict[str, float]] = {}  # signature -> backend -> median GPU-time turn (ms)
        self.measure_s: dict[str, float] = {}  # signature -> seconds its ranking took here
        self.stale: dict[str, str] = {}  # signature -> why its persisted ranking was ignored
        self.untuned: set[str] = set()  # signatures traced without a ranking (they ran DEFAULT)
        self.calls: Counter[str] = Counter()  # eager calls per backend
        self.fallbacks: Counter[tuple[str, str]] = Counter()  # (backend, reason)
        self._disabled: frozenset[str] = frozenset()
        self._cache = RankingCache(cache_path) if cache_path is not None else None
        if self._cache is not None:
            self.rankings, self.times_ms, self.stale = self._cache.load()

    # ------------------------------------------------------------------ candidates

    def disable(self, *names: str) -> None:
        """Make backends unavailable to this manager; calls go down the ranking past them."""
        unknown = sorted(n for n in names if n not in BACKENDS)
        if unknown:
            raise ValueError(f"unknown attention backend(s) {unknown}; allowed: {', '.join(BACKENDS)}")
        self._disabled |= set(names)

    def candidates(self, sig: Signature) -> list[tuple[str, str | None]]:
        """(backend, reason it is not measured or None) for every backend this manager may measure."""
        names = self.backends if self.backends is not None else IN_THE_RUNNING.get(sig.device, tuple(BACKENDS))
        return [(n, "disabled" if n in self._disabled else BACKENDS[n].why_not(sig)) for n in names]

    # ------------------------------------------------------------------ choice

    def ranking(self, sig: Signature) -> list[str] | None:
        """The signature's backends, fastest first, without the disabled ones; None: not measured."""
        ranked = self.rankings.get(sig.key())
        return None if ranked is None else [b for b in ranked if b not in self._disabled]

    def measure(self, sig: Signature, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                scale: float | None) -> list[str]:
        """Rank the signature's candidates on these inputs (``timing.rounds``: GPU-time turns), keep and persist
        the ranking. A candidate that fails here is left out, its reason noted."""
        t0 = time.perf_counter()
        calls = {n: workload(BACKENDS[n].run, q, k, v, attn_mask, is_causal, scale, sig.grad)
                 for n, why in self.candidates(sig) if why is None}
        ms, failed = ranked_ms(calls, q.device.type, ROUNDS, self.budget_ms, CONTENDER)
        for name, why in failed.items():
            self._note_fallback(name, f"rejected while measuring: {why}")
        if not ms:
            raise RuntimeError(f"no attention backend can run {sig}: " + "; ".join(
                f"{n}: {w}" for n, w in self.candidates(sig) if w) + f"; fallbacks: {dict(self.fallbacks)}")
        ranked = list(ms)
        key = sig.key()
        self.rankings[key], self.times_ms[key] = ranked, ms
        self.stale.pop(key, None)
        self.untuned.discard(key)
        self.measure_s[key] = time.perf_counter() - t0
        if self._cache is not None:
            self._cache.save(key, ranked, ms)
        return self.ranking(sig)

    def traced_backend(self, sig: Signature) -> str:
        """The backend a compiled region emits for ``sig``: the ranking's first that traces and can run, else
        ``DEFAULT`` (the signature is then listed as untuned)."""
        for name in self.rankings.get(sig.key(), ()):
            b = BACKENDS[name]
            if name not in self._disabled and b.traceable and b.why_not(sig) is None:
                return name
        self.untuned.add(sig.key())
        return DEFAULT

    def time_ops(self, calls: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
        """Alternatives that are not backends (the rank policy's low-rank path against the exact one), timed as
        rankings are: median GPU-time turn (ms) of each; a call that fails is left out, its reason noted."""
        ms, failed = ranked_ms(calls, device.type, (ROUNDS[0],) * 2, self.budget_ms)
        for name, why in failed.items():
            self._note_fallback(name, f"rejected while measuring: {why}")
        return ms

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
                 scale: float | None = None, sig: Signature | None = None) -> tuple[Tensor, str]:
        """Attention through the fastest backend that runs (measuring the signature first if it has no
        ranking); returns (output, backend name). Under tracing, the traced choice (no measurement)."""
        if sig is None:
            sig = Signature.of(q, k, "causal" if is_causal else "none" if attn_mask is None else "mask")
        if torch.compiler.is_compiling():
            name = self.traced_backend(sig)
            return BACKENDS[name].run(q, k, v, attn_mask, is_causal, scale), name
        ranked = self.ranking(sig)
        if ranked is None:
            ranked = self.measure(sig, q, k, v, attn_mask, is_causal, scale)
        for name in ranked:
            try:
                out = BACKENDS[name].run(q, k, v, attn_mask, is_causal, scale)
            except Exception as err:  # noqa: BLE001 - fall back down the ranking, reason logged once
                self._note_fallback(name, _reason(err))
                continue
            self.calls[name] += 1
            return out, name
        raise RuntimeError(f"every attention backend failed for {sig}; fallbacks: {dict(self.fallbacks)}")

    def _note_fallback(self, name: str, reason: str) -> None:
        if (name, reason) not in self.fallbacks:
            log.warning("attention backend %s unavailable: %s", name, reason)
        self.fallbacks[(name, reason)] += 1

    def get_statistics(self) -> dict:
        total = sum(self.calls.values())
        return {"calls": dict(self.calls), "total_calls": total,
                "flash_ratio": sum(n for b, n in self.calls.items() if b in FLASH_LIKE) / total if total else 0.0,
                "fallbacks": [{"backend": b, "reason": r, "count": n} for (b, r), n in self.fallbacks.items()],
                "signatures": len(self.rankings), "measure_s": dict(self.measure_s),
                "stale": [{"signature": k, "reason": r} for k, r in self.stale.items()],
                "untuned": sorted(self.untuned)}
