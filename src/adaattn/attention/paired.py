"""Times taken in paired rounds: every contender takes one turn per round, so a drift of the host's speed
between rounds lands on all of them alike. The kernel manager ranks backends this way (``paired_times``),
and the studies' side-by-side goals are judged this way (``round_ratios``, ``median_ci``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

CI_LEVEL = 0.95  # of a median's confidence interval


def round_ratios(test: Sequence[float], other: Sequence[float]) -> list[float]:
    """``test``'s time over ``other``'s in each round. The two turns of a round are seconds apart at most,
    so a drift of the host's speed between rounds cancels in each ratio: far tighter than the ratio of
    the two medians when the drift is larger than the gap."""
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


def paired_times(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each contender's typical time from paired rounds (``samples[name][j]``: its turn in round j, every
    contender one turn per round): the median over rounds of its turn over the round's geometric mean,
    times the median of the rounds' geometric means. Ordered as the medians of the round-by-round ratios
    are; in the time's units. A single contender's is its median."""
    names = list(samples)
    n = {len(samples[name]) for name in names}
    if len(n) != 1 or not n.pop():
        raise ValueError(f"need the same number (>= 1) of rounds of every contender; got "
                         f"{ {name: len(samples[name]) for name in names} }")
    rounds = list(zip(*(samples[name] for name in names), strict=True))
    if any(t <= 0 for r in rounds for t in r):
        raise ValueError("times must be > 0")
    means = [math.exp(statistics.fmean(math.log(t) for t in r)) for r in rounds]
    scale = statistics.median(means)
    return {name: scale * statistics.median(r[i] / g for r, g in zip(rounds, means, strict=True))
            for i, name in enumerate(names)}
