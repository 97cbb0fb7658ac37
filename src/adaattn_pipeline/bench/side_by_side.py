"""Time per call side by side, as rows: the calls of a goal's providers interleaved in shuffled rounds
(``timing.rounds``, which the kernel manager shares), each group's rivals pruned and outpaced, and the goal's
ratio read round by round with its median's confidence interval (``docs/methods.md``, "Calls side by side").

A group's rounds come in two parts. First ``min_rounds`` rounds of every provider timed; then a rival (a
provider not under test) that another rival beats with ``CI_LEVEL`` confidence (``outpaced``) leaves the
rounds (status ``outpaced``): it cannot be the fastest rival, which is what a goal compares against, and the
rest of the budget goes to the others. Where a goal's question is still open after that (``settle``: the interval of the
ratio to a rival still in the rounds spans the goal's bound), those providers take one block more, once.

A provider whose call raises in the rounds (a compiler's assertion on the tenth call, say) gets an error row
naming it, and the block's rounds start again without it: its rivals' rows and the study's other rows stand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from adaattn_pipeline.bench.harness import Workload
from adaattn.timing.rounds import BURST, CI_LEVEL, interleaved_samples_ms, median_ci, outpaced, round_ratios, warm_ms
from adaattn.timing.timers import Quantiles, quantiles
from adaattn_pipeline.config import Rounds


def call_of(w: Workload, mode: str) -> Callable[[], object]:
    """One call of ``w`` in ``mode``, as the harness times it: "fwd" (run it under ``torch.no_grad``),
    "fwd_bwd" (forward and backward with fixed output gradients, the inputs' gradients cleared first; run it
    under ``torch.enable_grad``) or "step" (``w.fwd`` is a whole training step; under ``torch.enable_grad``)."""
    if mode in ("fwd", "step"):  # step: the call is a whole training step (its own backward)
        return w.fwd
    if mode != "fwd_bwd":
        raise ValueError(f"mode {mode!r} is not one of: fwd, fwd_bwd, step")
    with torch.enable_grad():
        out = w.fwd()
    outs = out if isinstance(out, tuple) else (out,)
    grads = tuple(torch.randn_like(t) for t in outs)
    del out, outs  # and their graph

    def fwd_bwd() -> None:
        for t in w.inputs:
            t.grad = None
        y = w.fwd()
        torch.autograd.backward(y if isinstance(y, tuple) else (y,), grads)

    return fwd_bwd


class _Failed(Exception):
    """A provider's call raised in the rounds: which one and what."""

    def __init__(self, index: int, err: Exception) -> None:
        super().__init__(index, err)
        self.index, self.err = index, err


def _tagged(index: int, call: Callable[[], object]) -> Callable[[], object]:
    def run():
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - re-raised with the provider's index
            raise _Failed(index, err) from err
    return run


def side_by_side_rows(groups: Sequence[tuple[dict, str, dict[str, Callable[[], Workload]]]], device: str,
                      keep: Sequence[str], rounds: Rounds, seed: int = 0, paired: str | None = None,
                      settle: float | None = None, prefix: str = "") -> list[dict]:
    """``side_by_side_ms`` rows, one per (group, provider). A group: (the rows' common fields: table,
    case and config columns; mode; provider -> a function that builds its workload). Each group's
    providers are warmed up and timed alone first; ``keep`` names the providers under test, always
    timed; any other one more than ``rounds.contender`` x the fastest of those others cannot be the best
    of them and is left out of the rounds (a "pruned" row).
    Then as many rounds as fit ``rounds.budget_ms``, within [min_rounds, max_rounds]: ``min_rounds`` of every
    provider timed, then, where the budget has more, rounds without the rivals another rival beats
    with confidence (status ``outpaced``; the reason says after how many rounds, beaten by which), and
    each row's ``samples`` says how many rounds it took part in; ``seed``: the rounds' orders. A provider
    whose workload fails to build or run, in its warm-up or in the rounds, gets an error row; the others still run. ``paired`` (one of
    ``keep``): also a ``paired_ratio`` row per other timed provider, ``paired``'s time over that
    provider's, round by round over the rounds both took part in (``round_ratios``), and its median's
    ``CI_LEVEL`` confidence bounds (``paired_ratio_ci_low`` and ``paired_ratio_ci_high`` rows: ``median_ci``). ``settle`` (a goal's
    bound on ``paired``'s ratio): where, after those rounds, the interval of ``paired``'s ratio to a
    provider still in them spans it, the providers still in take one more block of rounds, about
    ``budget_ms`` of calls (at most ``max_rounds``), and the ratios come from all the rounds: a question
    the budget left open gets one more look, not as many as it takes (each look would be one more
    chance of an interval that misses). The rows' reason says how many rounds that block held. ``prefix``: before
    every metric's name (``compiled_side_by_side_ms``: another goal's rounds in the same results)."""
    if paired is not None and paired not in keep:
        raise ValueError(f"paired provider {paired!r} must be one of keep: {', '.join(keep)}")
    if settle is not None and paired is None:
        raise ValueError("settle needs a paired provider (the bound is on its ratio)")
    min_rounds, max_rounds, budget_ms = rounds.min_rounds, rounds.max_rounds, rounds.budget_ms
    rows = []
    for base, mode, builders in groups:
        row = {**base, "mode": mode, "metric": f"{prefix}side_by_side_ms", "value": None, "unit": "ms"}
        names, calls, est = [], [], []
        grad = torch.enable_grad if mode != "fwd" else torch.no_grad
        with grad():
            for name, build in builders.items():
                try:
                    call = call_of(build(), mode)
                    est.append(warm_ms(call, device))  # a provider that cannot run these inputs fails here
                except Exception as err:  # noqa: BLE001 - a status row says why; the group goes on
                    rows.append({**row, "provider": name, "status": "error",
                                 "reason": f"{type(err).__name__}: {err}"[:300]})
                    continue
                names.append(name)
                calls.append(call)
            if not calls:
                continue
            rivals = [t for n, t in zip(names, est, strict=True) if n not in keep]
            fastest = min(rivals) if rivals else math.inf
            timed = [i for i, (n, t) in enumerate(zip(names, est, strict=True))
                     if n in keep or t <= rounds.contender * fastest]
            for i in set(range(len(names))) - set(timed):
                rows.append({**row, "provider": names[i], "status": "pruned",
                             "reason": f"warm-up {est[i]:.3g} ms > {rounds.contender:g}x the fastest "
                                       f"({fastest:.3g} ms)"})
            per_turn = BURST if device == "cuda" else 1

            def fit(idx: Sequence[int], ms: float) -> int:  # rounds of these providers in about ms
                return math.ceil(ms / per_turn / sum(est[i] for i in idx))

            failed: dict[int, str] = {}  # provider index -> why its call raised in the rounds

            def block(idx: Sequence[int], n: int, block_seed: int) -> dict[int, list[float]]:
                """n rounds of the providers idx; one that raises leaves, and the block starts again without it
                (a round's samples pair only providers timed in the same rounds)."""
                idx = [i for i in idx if i not in failed]
                while idx:
                    try:
                        samples = interleaved_samples_ms([_tagged(i, calls[i]) for i in idx], device, n, block_seed)
                        return dict(zip(idx, samples, strict=True))
                    except _Failed as f:
                        failed[f.index] = f"{type(f.err).__name__} in the timed rounds: {f.err}"[:300]
                        idx = [i for i in idx if i != f.index]
                return {}

            n_rounds = min(max_rounds, max(min_rounds, fit(timed, budget_ms)))
            first = min(n_rounds, min_rounds)  # every timed provider; then the rivals outpaced leave
            by_index = block(timed, first, seed)
            left = outpaced({names[i]: x for i, x in by_index.items() if names[i] not in keep}) if n_rounds > first \
                else {}
            rest = [i for i in by_index if names[i] not in left]
            more = min(max_rounds - first, fit(rest, budget_ms - first * per_turn * sum(est[i] for i in by_index))) \
                if rest else 0
            if more > 0:
                for i, x in block(rest, more, seed + 1).items():
                    by_index[i] += x
            again = 0  # rounds of the block that settles an open question (``settle``)
            rest = [i for i in rest if i not in failed]
            if settle is not None and paired in names and names.index(paired) in rest:
                mine = by_index[names.index(paired)]
                if any(_spans(median_ci(round_ratios(mine, by_index[i])), settle) for i in rest if names[i] != paired):
                    again = min(max_rounds, fit(rest, budget_ms))
                    for i, x in block(rest, again, seed + 2).items():
                        by_index[i] += x
            for i, why in failed.items():  # its samples (if any) are from rounds it did not finish: dropped
                by_index.pop(i, None)
                rows.append({**row, "provider": names[i], "status": "error", "reason": why})
        by_name = {names[i]: by_index[i] for i in timed if i in by_index}
        settled = (f"{again} of the rounds a second block: the interval of {paired}'s ratio to a provider in the "
                   f"rounds spanned {settle:g}") if again else ""
        gone = {name: why_left(first, by) for name, by in left.items()}
        for name, x in by_name.items():
            rows.append({**row, "provider": name, **_stats(quantiles(x)), "samples": len(x),
                         "status": "outpaced" if name in left else "ok", "reason": gone.get(name, settled)})
        if paired in by_name:
            others = {name: x for name, x in by_name.items() if name != paired}
            rows += paired_ratio_rows(row, f"{prefix}paired_ratio", paired, by_name[paired], others, gone)
        del calls
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def why_left(rounds: int, by: str) -> str:
    return f"left the rounds after {rounds}: {by} faster with {CI_LEVEL:.0%} confidence"


def paired_ratio_rows(row: dict, metric: str, mine: str, my_samples: Sequence[float],
                      others: Mapping[str, Sequence[float]], reasons: Mapping[str, str] | None = None) -> list[dict]:
    """``metric`` rows, one per provider of ``others``, with their ``<metric>_ci_low`` and ``_ci_high``: ``mine``'s
    time over that provider's, round by round over the rounds both took part in (sample j of each from round
    j: ``round_ratios``), the median and its ``CI_LEVEL`` confidence bounds (``median_ci``, distribution-free).
    ``reasons``: why a provider left the rounds early (``why_left``): its rows' status is ``outpaced``."""
    rows = []
    for name, x in others.items():
        per_round = round_ratios(my_samples[:len(x)], x)
        why = (reasons or {}).get(name, "")
        common = {**row, "provider": name, "unit": f"ratio ({mine} / provider)", "samples": len(x),
                  "status": "outpaced" if why else "ok", "reason": why}
        rows.append({**common, "metric": metric, **_stats(quantiles(per_round))})
        for side, bound in zip(("low", "high"), median_ci(per_round), strict=True):
            rows.append({**common, "metric": f"{metric}_ci_{side}", "value": bound})
    return rows


def _spans(interval: tuple[float, float], bound: float) -> bool:
    return interval[0] <= bound <= interval[1]


def _stats(q: Quantiles) -> dict:
    return {"value": q.p50, "p20": q.p20, "p80": q.p80, "mean": q.mean, "std": q.std}
