"""Side-by-side timing (``adaattn.timing.rounds`` and its rows, ``adaattn_pipeline.bench.side_by_side``): rounds are
shuffled permutations, the calls really interleave, a mode's call is what the harness times, and slow or
failing providers become status rows without stopping the others."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaattn_pipeline.bench.harness import Workload
from adaattn.timing.timers import quantiles
from adaattn.timing.rounds import interleaved_samples_ms, median_ci, outpaced, round_ratios, shuffled_rounds
from adaattn_pipeline.bench.side_by_side import call_of, side_by_side_rows
from adaattn_pipeline.config import Rounds

CONTENDER = Rounds(budget_ms=1, min_rounds=1, max_rounds=1).contender  # the default


def R(budget_ms: float, min_rounds: int, max_rounds: int) -> Rounds:
    return Rounds(budget_ms=budget_ms, min_rounds=min_rounds, max_rounds=max_rounds)


def test_rounds_are_reproducible_shuffled_permutations():
    rounds = shuffled_rounds(4, 30)
    assert all(sorted(r) == [0, 1, 2, 3] for r in rounds)
    assert rounds == shuffled_rounds(4, 30)
    assert len({tuple(r) for r in rounds}) > 5  # not one fixed order


def test_calls_interleave_and_each_gets_its_own_time(clock):
    log: list[int] = []

    def call(i: int, ms: float):
        def run():
            log.append(i)
            clock.sleep(ms / 1e3)
        return run

    times = [quantiles(s) for s in interleaved_samples_ms([call(0, 0.0), call(1, 5.0), call(2, 0.0)], "cpu", rounds=8)]
    assert [q.n for q in times] == [8, 8, 8]
    assert all(sorted(log[3 * j:3 * j + 3]) == [0, 1, 2] for j in range(8))  # one of each per round
    assert times[1].p50 >= 5.0 > 4 * max(times[0].p50, times[2].p50)


def test_fwd_bwd_call_clears_gradients_and_runs_backward():
    x = torch.randn(3, 4, requires_grad=True)
    call = call_of(Workload(fwd=lambda: x * 2, inputs=[x]), "fwd_bwd")
    with torch.enable_grad():
        call()
        first = x.grad.clone()
        call()
    torch.testing.assert_close(x.grad, first)  # cleared, not accumulated
    assert (first != 0).all()


def _sleeper(clock, ms: float) -> Workload:
    x = torch.zeros(1)
    return Workload(fwd=lambda: (clock.sleep(ms / 1e3), x)[1], inputs=[x])


def _fails() -> Workload:
    raise RuntimeError("backend missing here")


def test_slow_providers_are_pruned_unless_kept_and_failures_are_rows(clock):
    base = {"table_id": "T", "case_id": "c", "kernel": ""}
    # "kept" (the provider under test) is far faster than its rivals: the rivals are pruned against
    # the fastest rival, not against it
    builders = {"fast": lambda: _sleeper(clock, 10.0), "slow": lambda: _sleeper(clock, CONTENDER * 40.0), "broken": _fails,
                "kept": lambda: _sleeper(clock, 0.0)}
    rows = side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(20, 3, 5))
    status = {r["provider"]: r["status"] for r in rows}
    assert status == {"fast": "ok", "slow": "pruned", "broken": "error", "kept": "ok"}
    by = {r["provider"]: r for r in rows}
    assert "backend missing here" in by["broken"]["reason"] and "x the fastest" in by["slow"]["reason"]
    assert by["kept"]["value"] < by["fast"]["value"] and by["fast"]["metric"] == "side_by_side_ms"
    assert by["fast"]["samples"] == 3 and by["fast"]["unit"] == "ms"  # the budget (20 ms) fits fewer than the minimum


def test_a_provider_that_raises_in_the_rounds_is_an_error_row_and_the_rounds_go_on(monkeypatch, clock):
    """The warm-up passes, a later call raises (as inductor's CUDA-graph trees once did on torch 2.11): that
    provider gets an error row saying so, the block starts again without it, the others keep every round."""
    import adaattn_pipeline.bench.side_by_side as sbs

    rounds_started = []
    real = sbs.interleaved_samples_ms

    def started(*a, **k):
        rounds_started.append(True)
        return real(*a, **k)

    monkeypatch.setattr(sbs, "interleaved_samples_ms", started)
    x = torch.zeros(1)

    def flaky():
        if rounds_started:
            raise AssertionError("len(node.tensor_weakrefs) == len(node.stack_traces)")
        clock.sleep(1e-3)  # as fast as rival in the warm-up: neither is pruned
        return x

    base = {"table_id": "T", "case_id": "c", "kernel": ""}
    builders = {"kept": lambda: _sleeper(clock, 2.0), "flaky": lambda: Workload(fwd=flaky, inputs=[x]),
                "rival": lambda: _sleeper(clock, 1.0)}
    rows = side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(10, 6, 6), paired="kept")
    by = {(r["provider"], r["metric"]): r for r in rows}
    err = by[("flaky", "side_by_side_ms")]
    assert err["status"] == "error" and err["value"] is None
    assert err["reason"].startswith("AssertionError in the timed rounds: len(node.tensor_weakrefs)")
    assert {p for p, m in by if m == "paired_ratio"} == {"rival"}  # no ratio to a provider that failed
    assert by[("kept", "side_by_side_ms")]["samples"] == by[("rival", "side_by_side_ms")]["samples"] == 6
    assert len(rounds_started) == 2  # the block again, without flaky
    # every provider fails: error rows only
    builders = {"kept": lambda: Workload(fwd=flaky, inputs=[x])}
    rounds_started.clear()
    rows = side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(10, 3, 3))
    assert [(r["provider"], r["status"]) for r in rows] == [("kept", "error")]


def test_round_ratios_cancel_a_drift_between_rounds(clock):
    """The host slows down and speeds up from round to round (1x-4x): each provider's own times spread
    with it, their per-round ratio does not."""
    n = [0]

    def call(ms: float):
        def run():
            drift = 1 + (n[0] // 2) % 4  # both turns of a round see the same host speed
            n[0] += 1
            clock.sleep(ms * drift / 1e3)
        return run

    a, b = interleaved_samples_ms([call(3.0), call(2.0)], "cpu", rounds=12)
    assert len(a) == len(b) == 12
    spread = max(a) / min(a)
    r = quantiles(round_ratios(a, b))
    assert spread > 3 and 1.3 < r.p20 <= r.p50 <= r.p80 < 1.7 and r.p80 / r.p20 < 1.15
    with pytest.raises(ValueError, match="one sample of each per round"):
        round_ratios(a, b[:-1])


def test_paired_rows_name_the_other_provider_and_need_a_kept_provider(clock):
    base = {"table_id": "T", "case_id": "c", "kernel": ""}
    builders = {"kept": lambda: _sleeper(clock, 2.0), "rival": lambda: _sleeper(clock, 1.0)}
    rows = side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(10, 5, 5), paired="kept")
    (pair,) = [r for r in rows if r["metric"] == "paired_ratio"]
    assert pair["provider"] == "rival" and 1.5 < pair["value"] < 2.5 and pair["unit"] == "ratio (kept / provider)"
    # its median's confidence bounds: from the same 5 rounds, too few for 95% (5 or fewer: unbounded)
    ci = {r["metric"]: r for r in rows if r["metric"].startswith("paired_ratio_ci_")}
    assert set(ci) == {"paired_ratio_ci_low", "paired_ratio_ci_high"}
    assert all(r["provider"] == "rival" for r in ci.values())
    assert ci["paired_ratio_ci_low"]["value"] == -math.inf and ci["paired_ratio_ci_high"]["value"] == math.inf
    rows = side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(10, 12, 12), paired="kept")
    by = {r["metric"]: r["value"] for r in rows if r["provider"] == "rival"}
    assert 1 < by["paired_ratio_ci_low"] <= by["paired_ratio"] <= by["paired_ratio_ci_high"] < 3
    with pytest.raises(ValueError, match="must be one of keep"):
        side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(10, 1, 1), paired="rival")


def test_median_ci_is_the_binomial_order_statistics_and_covers_the_median():
    x = list(range(20, 0, -1))  # unsorted: 1..20
    # P(Binomial(20, 1/2) <= 5) = 0.021 <= 0.025 < P(<= 6) = 0.058: the 6th and 15th order statistics
    assert median_ci(x) == (6, 15)
    assert median_ci(list(range(6))) == (0, 5)  # P(<= 0) = 1/64: the extremes at n = 6
    assert median_ci(list(range(5))) == (-math.inf, math.inf)
    with pytest.raises(ValueError, match="level must be in"):
        median_ci(x, level=1.0)
    # coverage on skewed draws of known median (lognormal: median 1): about 95.7% at n = 30
    rng = np.random.default_rng(0)
    hits = sum(lo <= 1.0 <= hi for lo, hi in (median_ci(rng.lognormal(0, 1, 30).tolist()) for _ in range(2000)))
    assert 0.94 < hits / 2000 < 0.975


def test_outpaced_names_the_providers_another_beats_with_confidence():

    fast = [1.0 + 0.01 * (j % 3) for j in range(12)]
    samples = {"fast": fast, "slow": [2.0 * t for t in fast], "twin": [t * (1.05 if j % 2 else 0.95)
                                                                        for j, t in enumerate(fast)]}
    # slow: every round 2x fast's (and about 2x twin's); twin: ahead of fast in half the rounds, behind
    # in the other half, so nothing beats it with confidence
    assert outpaced(samples) == {"slow": "fast"}
    assert outpaced({"fast": fast[:5], "slow": [2.0 * t for t in fast[:5]]}) == {}  # 5 rounds: no 95% interval
    assert outpaced({"alone": fast}) == {}


def test_rivals_outpaced_in_the_first_rounds_leave_and_the_rest_take_the_budget(clock):
    base = {"table_id": "T", "case_id": "c", "kernel": ""}
    builders = {"kept": lambda: _sleeper(clock, 2.0), "fast": lambda: _sleeper(clock, 1.0), "slow": lambda: _sleeper(clock, 2.5)}
    rows = side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(100, 8, 40), paired="kept")
    times = {r["provider"]: r for r in rows if r["metric"] == "side_by_side_ms"}
    # slow is timed (within CONTENDER), then leaves: its rows say so in the status, not in prose
    assert {p: r["status"] for p, r in times.items()} == {"kept": "ok", "fast": "ok", "slow": "outpaced"}
    rounds = {p: r["samples"] for p, r in times.items()}
    assert rounds["slow"] == 8 < rounds["fast"] == rounds["kept"] <= 40
    assert times["slow"]["reason"] == "left the rounds after 8: fast faster with 95% confidence"
    assert times["fast"]["reason"] == times["kept"]["reason"] == ""
    # about 100 ms of calls: 8 rounds of the three (5.5 ms each, or more on a loaded host), the rest of
    # kept and fast (3 ms each)
    assert 8 < rounds["fast"] <= 8 + 22
    pairs = {r["provider"]: r for r in rows if r["metric"] == "paired_ratio"}
    assert pairs["fast"]["samples"] == rounds["fast"] and pairs["slow"]["samples"] == 8
    assert 1.5 < pairs["fast"]["value"] < 2.5 and 0.6 < pairs["slow"]["value"] < 1.0
    # the ratio rows of a rival that left say so (a goal is decided against the rivals still in the rounds)
    bounds = [r for r in rows if r["metric"].startswith("paired_ratio_ci_") and r["provider"] == "slow"]
    assert len(bounds) == 2 and {r["reason"] for r in bounds} == {pairs["slow"]["reason"]} == {times["slow"]["reason"]}
    assert {r["status"] for r in bounds} == {pairs["slow"]["status"]} == {"outpaced"}
    assert pairs["fast"]["reason"] == "" and pairs["fast"]["status"] == "ok"
    # the budget fits the first rounds only: nobody leaves, one part
    rows = side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(10, 8, 40))
    assert {r["samples"] for r in rows} == {8} and not any(r["reason"] for r in rows)
    assert {r["status"] for r in rows} == {"ok"}


def test_an_open_goal_takes_one_more_block_of_rounds(monkeypatch, clock):
    """``settle``: where the interval of the paired provider's ratio to a rival still in the rounds spans the
    goal's bound, those providers take one more block of rounds (its own seed), once; the ratios come from
    all the rounds. Scripted turns: kept's ratio to rival alternates 0.9 and 1.1, rival's twin (an exact copy)
    leaves after the first block."""
    import adaattn_pipeline.bench.side_by_side as sbs

    blocks = []

    def scripted(calls, device, rounds, seed=0):
        blocks.append((len(calls), rounds, seed))
        kept = [1.0 + (0.1 if j % 2 else -0.1) for j in range(rounds)]
        return [kept] + [[1.0 + 0.01 * i] * rounds for i in range(len(calls) - 1)]

    monkeypatch.setattr(sbs, "interleaved_samples_ms", scripted)
    base = {"table_id": "T", "case_id": "c", "kernel": ""}
    builders = {"kept": lambda: _sleeper(clock, 1.0), "rival": lambda: _sleeper(clock, 1.0), "twin": lambda: _sleeper(clock, 1.0)}

    def run(settle):
        blocks.clear()
        rows = side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(60, 10, 25), paired="kept", settle=settle)
        return {(r["provider"], r["metric"]): r for r in rows}

    rows = run(1.0)  # 0.9-1.1 spans 1.0: a second block, of kept and rival (twin left: rival beats it)
    first, more, again = blocks
    assert first[:2] == (3, 10) and more[0] == again[0] == 2 and again[2] == 2  # seed + 2
    n = 10 + more[1] + again[1]
    rival = rows[("rival", "side_by_side_ms")]
    assert rival["samples"] == n and rival["reason"].startswith(f"{again[1]} of the rounds a second block")
    assert "spanned 1" in rival["reason"] and rows[("kept", "side_by_side_ms")]["reason"] == rival["reason"]
    twin = rows[("twin", "side_by_side_ms")]
    assert twin["samples"] == 10 and twin["status"] == "outpaced"
    assert rows[("rival", "paired_ratio")]["samples"] == n
    rows = run(1.5)  # the interval lies below 1.5: no second block
    assert len(blocks) == 2 and rows[("rival", "side_by_side_ms")]["reason"] == ""
    with pytest.raises(ValueError, match="settle needs a paired provider"):
        side_by_side_rows([(base, "fwd", builders)], "cpu", keep=["kept"], rounds=R(10, 1, 1), settle=1.03)
