"""AttentionKernelManager and its backends: each backend correct where it claims to run, the ranking (time
per call, GPU time, ties), measuring rounds, paired rounds and looks, persistence, fallback, the timing of
one call (host, GPU, time per call)."""

import json
import math
import sys
import time
import types

import pytest
import torch
import torch.nn.functional as F

from adaattn.attention.ada import AdaAttention
from adaattn.attention.backends import BACKENDS, SDP_FLAGS, Backend, Signature
from adaattn.attention.kernel_manager import ROUNDS, SCORES_KEPT, WRAPPED, AttentionKernelManager, rank_timings
from adaattn.attention.timing import Timing
from test_ada_attention import _qkv, _sdpa_ref

E, H = 48, 4


def test_every_cpu_backend_is_correct_where_it_claims_to_run():
    q, k, v = _qkv()
    for mask_kind, mask, causal in [("none", None, False), ("causal", None, True),
                                    ("mask", torch.rand(2, 1, 33, 33) > 0.3, False)]:
        sig = Signature.of(q, k, mask_kind)
        ref = _sdpa_ref(q, k, v, mask, causal)
        ran = []
        for name, backend in BACKENDS.items():
            if backend.why_not(sig) is None:
                torch.testing.assert_close(backend.run(q, k, v, mask, causal, None).double(), ref, atol=1e-5, rtol=1e-5)
                ran.append(name)
        assert {"sdpa", "sdpa_math", "chunked", "math"} <= set(ran), (mask_kind, ran)


def test_manager_measures_once_persists_and_reloads(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    km = AttentionKernelManager(backends=["sdpa", "math", "chunked"], cache_path=path)
    q, k, v = _qkv()
    _, first = km(q, k, v)
    _, again = km(q, k, v)
    assert first == again and km.get_statistics()["calls"] == {first: 2}
    saved = json.loads(path.read_text())["rankings"]
    assert len(saved) == 1 and sorted(next(iter(saved.values()))) == ["chunked", "math", "sdpa"]
    # a new process (manager) reads the ranking instead of measuring
    km2 = AttentionKernelManager(backends=["sdpa", "math", "chunked"], cache_path=path)
    monkeypatch.setattr(km2, "_measure", lambda *a: pytest.fail("measured again despite the cache"))
    assert km2(q, k, v)[1] == first
    assert km2.timings == km.timings and set(km2.timings[next(iter(saved))]) == {"chunked", "math", "sdpa"}
    # rankings measured under another torch version or by another method are not trusted
    data = json.loads(path.read_text())
    for stale in ({"torch": "0.0"}, {"method": None}, {"objective": "gpu"}):
        path.write_text(json.dumps({**data, **stale}))
        assert AttentionKernelManager(backends=["sdpa", "math", "chunked"], cache_path=path).rankings == {}
    # nor are those of the other objective
    path.write_text(json.dumps(data))
    assert AttentionKernelManager(backends=["sdpa", "math", "chunked"], cache_path=path, objective="gpu").rankings == {}


def _t(host: float, gpu: float | None, call: float | None = None) -> Timing:
    return Timing(host, gpu, host if call is None else call)


def test_ranking_by_gpu_time_with_host_heavy_backends_last():
    cpu = {"a": _t(2.0, None), "b": _t(1.0, None), "c": _t(1.04, None)}
    assert rank_timings(cpu, "gpu") == rank_timings(cpu) == ["b", "c", "a"]  # no GPU time: time per call
    # a, b, c: host-bound, host times within 2x of the leanest (e's), ranked by GPU time like the GPU-bound e;
    # f: the least GPU time, but an issue time over its GPU time and over twice the leanest
    gpu = {"a": _t(0.20, 0.05), "b": _t(0.22, 0.02), "c": _t(0.15, 0.03), "e": _t(0.12, 0.5),
           "f": _t(0.5, 0.001)}
    assert rank_timings(gpu, "gpu") == ["b", "c", "a", "e", "f"]
    assert rank_timings(gpu, "gpu", host_slack=5.0) == ["f", "b", "c", "a", "e"]
    # GPU times within 2% tie (the same kernel through two dispatch paths): the leaner host goes first;
    # a backend 3% slower on the GPU is no tie, however lean its host
    tie = {"forced": _t(0.10, 1.000), "own": _t(0.05, 1.015), "other": _t(0.01, 1.03)}
    assert rank_timings(tie, "gpu") == ["own", "forced", "other"]
    assert rank_timings(tie, "gpu", tie=0.0) == ["forced", "own", "other"]
    # a tie goes first to the backend without a context manager, whatever the hosts' noisy times say
    same_kernel = {"sdpa_cudnn": _t(0.255, 0.0966), "sdpa": _t(0.274, 0.0965), "sdpa_flash": _t(0.2, 0.134)}
    assert rank_timings(same_kernel, "gpu") == ["sdpa", "sdpa_cudnn", "sdpa_flash"]
    assert rank_timings(same_kernel, "gpu", wrapped=frozenset()) == ["sdpa_cudnn", "sdpa", "sdpa_flash"]
    with pytest.raises(ValueError, match="objective 'wall' is not one of: call, gpu"):
        rank_timings(gpu, "wall")
    with pytest.raises(ValueError, match="objective 'wall' is not one of: call, gpu"):
        AttentionKernelManager(objective="wall")


def test_ranking_by_time_per_call():
    """The default objective ranks by time per call: where the call is host-bound a backend with a slower
    kernel and a leaner host goes first (the shape of the H100's SDPA vs forced efficient attention inside
    the module: more GPU time, less host time); where it is GPU-bound, the faster kernel. Times per call
    within 2% tie where their GPU times are within 2% too (one kernel): the backend not forced first, then
    the faster call."""
    host_bound = {"sdpa": _t(0.118, 0.045, 0.119), "sdpa_efficient": _t(0.104, 0.075, 0.105)}
    assert rank_timings(host_bound) == ["sdpa_efficient", "sdpa"]
    assert rank_timings(host_bound, "gpu") == ["sdpa", "sdpa_efficient"]
    gpu_bound = {"sdpa": _t(0.118, 0.300, 0.301), "sdpa_efficient": _t(0.104, 0.900, 0.901)}
    assert rank_timings(gpu_bound) == rank_timings(gpu_bound, "gpu") == ["sdpa", "sdpa_efficient"]
    tie = {"sdpa_cudnn": _t(0.10, 0.050, 0.100), "sdpa": _t(0.11, 0.051, 0.101), "sdpa_math": _t(0.09, 0.06, 0.1015),
           "chunked": _t(0.05, 0.01, 0.103)}
    assert rank_timings(tie) == ["sdpa", "sdpa_cudnn", "sdpa_math", "chunked"]
    assert rank_timings(tie, wrapped=frozenset()) == ["sdpa_cudnn", "sdpa", "sdpa_math", "chunked"]
    # two kernels whose calls came out within 2% do not tie: the faster call goes first (here forced flash,
    # its GPU time the longest); SDPA and forced cuDNN (one kernel: GPU times within 2%) tie, SDPA first
    close = {"sdpa_flash": _t(0.89, 0.943, 1.040), "sdpa_cudnn": _t(0.71, 0.789, 1.059), "sdpa": _t(0.95, 0.790, 1.060)}
    assert rank_timings(close) == ["sdpa_flash", "sdpa", "sdpa_cudnn"]
    assert rank_timings(close, "gpu") == ["sdpa", "sdpa_cudnn", "sdpa_flash"]


def test_cpu_tie_goes_to_the_backend_not_forced():
    """On a CPU, times per call within 2% are a tie: SDPA's own choice before a forced SDPA backend (the
    same kernel with SDPA's flags set around it), each kind in order of time; 3% apart is no tie."""
    cpu = {"sdpa_flash": _t(0.554, None), "sdpa": _t(0.557, None), "sdpa_math": _t(0.556, None),
           "chunked": _t(0.570, None), "math": _t(0.58, None)}
    assert rank_timings(cpu) == ["sdpa", "sdpa_flash", "sdpa_math", "chunked", "math"]
    assert rank_timings(cpu, tie=0.0) == ["sdpa_flash", "sdpa_math", "sdpa", "chunked", "math"]
    assert rank_timings(cpu, wrapped=frozenset(), scores_kept=frozenset()) == ["sdpa_flash", "sdpa_math", "sdpa",
                                                                                "chunked", "math"]
    assert {"sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"} <= WRAPPED and "sdpa" not in WRAPPED


def test_tie_goes_to_the_backend_that_does_not_hold_the_scores():
    """Within a tie a backend holding the (L, S) score matrix (math, forced SDPA math) goes after the others,
    before the preference for SDPA's own dispatch: where attention is a small part of the call, the backends
    tie on time and the choice decides the call's peak memory. Out of the tie the faster call still goes first."""
    assert SCORES_KEPT == {"math", "sdpa_math"}
    # the CPU precision study's fp16 block, as two runs timed it (ms per call)
    first = {"sdpa_math": _t(11.30, None, 11.36), "sdpa_flash": _t(11.36, None, 11.58), "sdpa": _t(11.66, None, 11.63)}
    assert rank_timings(first) == ["sdpa_flash", "sdpa_math", "sdpa"]
    assert rank_timings(first, scores_kept=frozenset()) == ["sdpa_math", "sdpa_flash", "sdpa"]
    second = {"sdpa": _t(11.22, None, 12.54), "sdpa_math": _t(11.03, None, 12.31), "sdpa_flash": _t(11.24, None, 12.59)}
    assert rank_timings(second) == ["sdpa", "sdpa_math", "sdpa_flash"]  # flash 2.3% behind math: out of the tie
    # 3% faster is no tie: math first
    apart = {"math": _t(1.65, None, 1.75), "sdpa": _t(1.74, None, 1.81)}
    assert rank_timings(apart) == ["math", "sdpa"]
    # under "gpu" too (GPU times within the tie)
    gpu = {"sdpa_math": _t(0.1, 0.500), "sdpa_efficient": _t(0.1, 0.505)}
    assert rank_timings(gpu, "gpu") == ["sdpa_efficient", "sdpa_math"]


def test_forced_sdpa_backend_runs_that_backend_and_restores_the_flags():
    """A forced SDPA backend runs SDPA with only that backend enabled: the kernel that ran is that
    backend's, a backend that cannot take the inputs raises instead of falling back, and SDPA's flags are
    as the caller left them afterwards (after an error too, a flag the caller turned off included). Under
    torch.compile it enters ``sdpa_kernel``, which dynamo traces into one graph."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v)

    def ops_of(name):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = BACKENDS[name].run(q, k, v, None, False, None)
        torch.testing.assert_close(out, ref)
        return {e.name for e in prof.events()}

    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops_of("sdpa_flash")
    math_ops = ops_of("sdpa_math")
    assert "aten::_scaled_dot_product_attention_math" in math_ops
    assert not any("flash" in n for n in math_ops)
    get = {n: getattr(torch._C, f"_get_{n}_sdp_enabled") for n in SDP_FLAGS}
    before = {n: g() for n, g in get.items()}
    torch.backends.cuda.enable_math_sdp(False)  # the caller's own setting
    try:
        with pytest.raises(RuntimeError):  # no CPU kernel: SDPA must not fall back to flash or math
            BACKENDS["sdpa_efficient"].run(q, k, v, None, False, None)
        assert {n: g() for n, g in get.items()} == {**before, "math": False}
        torch.testing.assert_close(BACKENDS["sdpa_flash"].run(q, k, v, None, False, None), ref)
        assert {n: g() for n, g in get.items()} == {**before, "math": False}
    finally:
        torch.backends.cuda.enable_math_sdp(before["math"])
    compiled = torch.compile(lambda q, k, v: BACKENDS["sdpa_flash"].run(q, k, v, None, False, None),
                             backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), ref)
    assert {n: g() for n, g in get.items()} == before


def _sleeping(clock, name: str, delay) -> Backend:
    """A backend that sleeps ``delay()`` seconds on ``clock``, then runs math."""
    def run(q, k, v, m, c, s):
        clock.sleep(delay())
        return BACKENDS["math"].run(q, k, v, m, c, s)

    return Backend(name, run, BACKENDS["math"].why_not)


def test_measurement_rounds_keep_a_slow_spell_off_one_backend(monkeypatch, clock):
    """The backends take turns in rounds: a slow spell during one backend's first turn (its first calls
    take 15 ms, then 0.5 ms) does not make it look slower than a steady 4 ms backend."""
    seen = {"n": 0}

    def spell() -> float:
        seen["n"] += 1
        return 0.015 if seen["n"] <= 6 else 0.0005  # the warm-up and the first turn's 5 calls

    monkeypatch.setitem(BACKENDS, "spell", _sleeping(clock, "spell", spell))
    monkeypatch.setitem(BACKENDS, "steady", _sleeping(clock, "steady", lambda: 0.004))
    km = AttentionKernelManager(backends=["spell", "steady"])
    q, k, v = _qkv()
    with torch.no_grad():
        assert km(q, k, v)[1] == "spell"
    times = km.timings[Signature.of(q, k, "none").key()]
    assert times["spell"].host_ms < 4 < times["steady"].host_ms
    assert seen["n"] == 1 + ROUNDS * km.repeats + 1  # one warm-up, its turns, the call itself


def test_measurement_stops_timing_a_backend_that_cannot_come_first(monkeypatch, clock):
    """After ``CONTENDER_ROUNDS`` rounds a backend more than ``CONTENDER`` times slower than the fastest
    takes no more turns (its calls are most of a measurement at long sequences); it is still ranked."""
    from adaattn.attention.kernel_manager import CONTENDER, CONTENDER_ROUNDS

    seen = {"slow": 0}

    def slow() -> float:
        seen["slow"] += 1
        return 0.002 * (CONTENDER + 1)

    monkeypatch.setitem(BACKENDS, "slow", _sleeping(clock, "slow", slow))
    monkeypatch.setitem(BACKENDS, "fast", _sleeping(clock, "fast", lambda: 0.002))
    km = AttentionKernelManager(backends=["slow", "fast"])
    q, k, v = _qkv()
    with torch.no_grad():
        assert km(q, k, v)[1] == "fast"
    assert km.rankings[Signature.of(q, k, "none").key()] == ["fast", "slow"]
    assert CONTENDER_ROUNDS < ROUNDS and seen["slow"] == 1 + CONTENDER_ROUNDS * km.repeats  # warm-up, its turns


def test_time_per_call_is_the_typical_turn_not_the_fastest(monkeypatch, clock):
    """Ranked by time per call, a backend whose calls are mostly slow goes after a steady one, though its
    fastest calls are the fastest of all (a fastest burst is where the host's noise hides at a host-bound
    shape): the backends within ``CALL_SPREAD`` of the fastest take paired rounds and are ranked by their
    typical turn. Without paired rounds (``call_budget_ms=0``) the fastest burst decides."""
    from adaattn.attention.kernel_manager import CALL_ROUNDS

    seen = {"n": 0}

    def lucky() -> float:  # every third call 1.5 ms, the others 4 ms
        seen["n"] += 1
        return 0.0015 if seen["n"] % 3 == 0 else 0.004

    monkeypatch.setitem(BACKENDS, "lucky", _sleeping(clock, "lucky", lucky))
    monkeypatch.setitem(BACKENDS, "steady", _sleeping(clock, "steady", lambda: 0.0025))
    q, k, v = _qkv()
    key = Signature.of(q, k, "none").key()
    with torch.no_grad():
        km = AttentionKernelManager(backends=["lucky", "steady"])
        assert km(q, k, v)[1] == "steady", km.timings
        times = km.timings[key]
        assert all(CALL_ROUNDS[0] <= t.rounds <= CALL_ROUNDS[1] for t in times.values())
        assert times["lucky"].host_ms < 2.5 <= times["steady"].call_ms < 3.75 < 4.0 <= times["lucky"].call_ms
        fastest = AttentionKernelManager(backends=["lucky", "steady"], call_budget_ms=0)
        assert fastest(q, k, v)[1] == "lucky" and not any(t.rounds for t in fastest.timings[key].values())


def test_paired_rounds_stop_at_a_confident_lead_or_the_budget(monkeypatch, clock):
    """Paired rounds stop at the first look (``CALL_ROUNDS[0]`` rounds) when one backend is faster than
    every other in every round; with a tie they go on until the budget (here none: the least rounds) or
    ``CALL_ROUNDS[1]``. A backend that fails in them is not a candidate, its reason noted. Times per call are
    the typical turns; a backend outside ``CALL_SPREAD`` of the fastest takes no paired rounds and goes last."""
    import adaattn.attention.kernel_manager as kmod
    import adaattn.attention.timing as timing

    typical = {"a": 1.0, "b": 1.1, "c": 1.0, "far": 5.0}
    ran, paired = [], {"on": False}

    def backend(name: str) -> Backend:
        def run(q, k, v, m, c, s):
            ran.append(name)
            if name == "c" and paired["on"]:
                raise RuntimeError("fails in the paired rounds")
            clock.sleep(0.003 if name == "far" else 0.0005)  # far: over CALL_SPREAD x the others in the first rounds
            return BACKENDS["math"].run(q, k, v, m, c, s)

        return Backend(name, run, BACKENDS["math"].why_not)

    def turn(call, device, repeats):
        paired["on"] = True
        call()
        return typical[ran[-1]]

    for name in typical:
        monkeypatch.setitem(BACKENDS, name, backend(name))
    monkeypatch.setattr(timing, "turn", turn)
    q, k, v = _qkv()
    key = Signature.of(q, k, "none").key()
    with torch.no_grad():
        km = AttentionKernelManager(backends=["far", "b", "c", "a"])
        assert km(q, k, v)[1] == "a" and km.rankings[key] == ["a", "b", "far"]
        times = km.timings[key]
        assert times["a"].rounds == times["b"].rounds == kmod.CALL_ROUNDS[0] and times["far"].rounds == 0
        assert times["a"].call_ms == pytest.approx(1.0) and times["b"].call_ms == pytest.approx(1.1)
        assert km.get_statistics()["fallbacks"] == [{"backend": "c", "count": 1, "reason":
                                                     "rejected while measuring: RuntimeError: fails in the paired rounds"}]
        typical["b"] = 1.0
        for budget, rounds in ((1e-9, kmod.CALL_ROUNDS[0]), (1e9, kmod.CALL_ROUNDS[1])):
            km = AttentionKernelManager(backends=["a", "b"], call_budget_ms=budget)
            km(q, k, v)
            assert {t.rounds for t in km.timings[key].values()} == {rounds}
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="call_budget_ms must be >= 0"):
            AttentionKernelManager(call_budget_ms=bad)


def test_a_ranking_is_looked_at_again_and_goes_by_the_worst_ratio(monkeypatch, tmp_path, clock):
    """Objective "call": the paired rounds' contenders take them again at the signature's first call each gap of
    ``looks_s`` after the last look, and rank by their worst ratio to the fastest over the looks: a backend fastest in one
    spell of the host and 20% behind in the next goes after one 5% behind in the first. A module's replay asks
    the manager every ``LOOK_EVERY`` calls while a look is to come (no look before it is due), runs the new
    first backend after it, and asks no more after the last look; while ``hold_looks`` a due look waits. The looks persist with the ranking; a cache's
    looks still to come are due from its load."""

    import adaattn.attention.kernel_manager as kmod
    import adaattn.attention.timing as timing

    typical, ran, wall = {"a": 1.0, "b": 1.05}, [], {"s": 1000.0}  # wall: the looks' clock (time.monotonic)

    def backend(name: str) -> Backend:
        def run(q, k, v, m, c, s):
            ran.append(name)
            clock.sleep(0.001)  # the first timing: a tie, whatever the host's load (the paired turns are ``typical``)
            return BACKENDS["math"].run(q, k, v, m, c, s)

        return Backend(name, run, BACKENDS["math"].why_not)

    def turn(call, device, repeats):
        call()
        return typical[ran[-1]]

    for name in typical:
        monkeypatch.setitem(BACKENDS, name, backend(name))
    monkeypatch.setattr(timing, "turn", turn)
    monkeypatch.setattr(kmod, "time", types.SimpleNamespace(monotonic=lambda: wall["s"]))
    path = tmp_path / "choices.json"
    km = AttentionKernelManager(backends=["a", "b"], cache_path=path, looks_s=(10.0, 60.0))
    ada = AdaAttention(E, H, kernel_manager=km, precision_mode="fp32", rank_mode="full")
    x = torch.randn(2, 16, E)
    with torch.no_grad():
        ada(x, x, x)
        (key,) = km.rankings
        assert km.rankings[key] == ["a", "b"] and km.calls_until_look(key) == kmod.LOOK_EVERY
        assert [(look.at_s, look.ms) for look in km.looks[key]] == [(0.0, pytest.approx(typical))]
        saved = json.loads(path.read_text())["looks"][key]
        assert len(saved) == 1 and saved[0][1] == pytest.approx(typical)
        wall["s"] += 9.0
        for _ in range(2 * kmod.LOOK_EVERY):  # the replay asks twice; the look is not due yet
            ada(x, x, x)
        assert len(km.looks[key]) == 1 and ada.get_statistics()["calls"] == {"a": 1 + 2 * kmod.LOOK_EVERY}
        wall["s"] += 1.0
        typical.update(a=1.2, b=1.0)
        km.hold_looks = True  # a benchmark's timed calls: the look waits
        for _ in range(kmod.LOOK_EVERY + 1):
            ada(x, x, x)
        assert len(km.looks[key]) == 1
        km.hold_looks = False
        for _ in range(kmod.LOOK_EVERY):  # the replay asks at its LOOK_EVERY-th call: the look is due
            ada(x, x, x)
        assert [look.at_s for look in km.looks[key]] == [0.0, 10.0] and km.rankings[key] == ["b", "a"]
        assert kmod.worst_ratios(km.looks[key]) == pytest.approx({"a": 1.2, "b": 1.05})
        calls = ada.get_statistics()["calls"]
        assert sum(calls.values()) == 2 + 4 * kmod.LOOK_EVERY and calls["b"] and [p.backend for p in ada._plans.values()] == ["b"]
        loaded = AttentionKernelManager(backends=["a", "b"], cache_path=path, looks_s=(10.0, 60.0))
        assert loaded.rankings == km.rankings and [look.ms for look in loaded.looks[key]] == \
            [look.ms for look in km.looks[key]] and loaded._due[key] == wall["s"] + 60.0
        wall["s"] += 59.0  # 60 s after the first look, 49 after the last: not due
        for _ in range(kmod.LOOK_EVERY + 1):
            ada(x, x, x)
        assert len(km.looks[key]) == 2
        wall["s"] += 11.0
        typical.update(a=1.0, b=1.1)  # a spell like the first: b's worst ratio is still the lower
        for _ in range(kmod.LOOK_EVERY):
            ada(x, x, x)
        assert [look.at_s for look in km.looks[key]] == [0.0, 10.0, 80.0] and km.rankings[key] == ["b", "a"]
        assert km.calls_until_look(key) == sys.maxsize and key not in km._due
        assert max(p.limit for p in ada._plans.values()) == sys.maxsize  # no more looks: the replay asks no more
    for bad in ((0.0,), (10.0, -1.0), (math.inf,), (math.nan,), ("10",)):
        with pytest.raises(ValueError, match="looks_s must be finite times > 0"):
            AttentionKernelManager(looks_s=bad)


def _slow_backward(clock, delay: float) -> Backend:
    class Delayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            clock.sleep(delay)
            return g

    return Backend("slow_bwd", lambda q, k, v, m, c, s: Delayed.apply(BACKENDS["sdpa"].run(q, k, v, m, c, s)),
                   BACKENDS["sdpa"].why_not)


def _slow_forward(clock, delay: float) -> Backend:
    def run(q, k, v, m, c, s):
        clock.sleep(delay)
        return BACKENDS["sdpa"].run(q, k, v, m, c, s)

    return Backend("slow_fwd", run, BACKENDS["sdpa"].why_not)


def test_training_signature_is_ranked_on_forward_and_backward(monkeypatch, clock):
    """A backend with a fast forward and a slow backward wins inference, not training."""
    monkeypatch.setitem(BACKENDS, "slow_bwd", _slow_backward(clock, 0.03))
    monkeypatch.setitem(BACKENDS, "slow_fwd", _slow_forward(clock, 0.005))
    km = AttentionKernelManager(backends=["slow_bwd", "slow_fwd"])
    q, k, v = _qkv()
    with torch.no_grad():
        assert km(q, k, v)[1] == "slow_bwd"
    q.requires_grad_(True)
    out, used = km(q, k, v)
    assert used == "slow_fwd" and len(km.rankings) == 2
    train = km.timings[Signature.of(q, k, "none").key()]
    assert train["slow_bwd"].host_ms == pytest.approx(30) and train["slow_fwd"].host_ms == pytest.approx(5)
    out.sum().backward()  # the measurement left the caller's graph alone
    assert q.grad is not None and q.grad.shape == q.shape


def test_module_call_is_what_the_manager_times(monkeypatch, clock):
    """AdaAttention gives the manager its whole call to time: the projections and the output projection
    count in every backend's time (here the output projection sleeps 4 ms), a training signature is timed
    on forward and backward without touching the parameters' gradients or the caller's graph, and what
    was timed is on record. Called alone, the manager times the op."""
    monkeypatch.setitem(BACKENDS, "slow_bwd", _slow_backward(clock, 0.01))
    km = AttentionKernelManager(backends=["sdpa", "slow_bwd"])
    ada = AdaAttention(32, 4, kernel_manager=km, precision_mode="fp32", rank_mode="full")
    out_proj = ada._out_proj
    projected = {"n": 0}

    def slow_out_proj(*a):
        projected["n"] += 1
        clock.sleep(0.004)
        return out_proj(*a)

    monkeypatch.setattr(ada, "_out_proj", slow_out_proj)
    x = torch.randn(2, 16, 32, requires_grad=True)
    with torch.no_grad():
        ada(x, x, x)
    (key,) = km.rankings
    assert km.timed[key] == "call" and all(t.host_ms == pytest.approx(4) for t in km.timings[key].values())
    paired = sum(t.rounds for t in km.timings[key].values())  # on a CPU a paired turn is one call
    assert projected["n"] == 2 * (1 + ROUNDS * km.repeats) + paired + 1  # two backends' turns, the call itself
    out, _ = ada(x, x, x)  # a training signature: forward and backward timed, the slow backward last
    train = next(k for k in km.rankings if k != key)
    assert km.rankings[train] == ["sdpa", "slow_bwd"] and km.timings[train]["slow_bwd"].host_ms == pytest.approx(14)
    assert x.grad is None and all(p.grad is None for p in ada.parameters())
    out.sum().backward()
    assert x.grad is not None and ada.in_proj_weight.grad is not None
    q, k, v = _qkv()
    km(q, k, v)
    assert km.timed[Signature.of(q, k, "none").key()] == "op"


def test_unavailable_backend_falls_back_with_its_reason_logged_once(caplog):
    km = AttentionKernelManager(backends=["math", "chunked"])
    q, k, v = _qkv()
    km.rankings[Signature.of(q, k, "none").key()] = ["math", "chunked"]
    original = BACKENDS["math"]

    def broken(*args):
        raise RuntimeError("no kernel for these inputs")

    try:
        BACKENDS["math"] = original.__class__("math", broken, original.why_not)
        with caplog.at_level("WARNING"):
            for _ in range(3):
                out, used = km(q, k, v)
    finally:
        BACKENDS["math"] = original
    assert used == "chunked"
    torch.testing.assert_close(out.double(), _sdpa_ref(q, k, v), atol=1e-5, rtol=1e-5)
    stats = km.get_statistics()
    assert stats["fallbacks"] == [{"backend": "math", "reason": "RuntimeError: no kernel for these inputs", "count": 3}]
    assert sum("no kernel for these inputs" in r.message for r in caplog.records) == 1
    # a backend made unavailable is skipped without an attempt
    km.disable("chunked")
    assert km(q, k, v)[1] == "math"


def test_mask_kind_excludes_backends_that_cannot_take_it():
    q, k, v = _qkv(dtype=torch.float32)
    sig = Signature.of(q, k, "mask")
    reasons = dict(AttentionKernelManager().candidates(sig))
    assert "needs CUDA" in reasons["flash_attn"]
    assert reasons["sdpa"] is None and reasons["chunked"] is None
    with pytest.raises(ValueError, match="mask kind"):
        Signature.of(q, k, "padding")


# --------------------------------------------------------------------------- precision


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 8, 2, 1023, 64), (1, 4, 4, 256, 128)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "mask"])
def test_cuda_backends_are_correct_where_they_claim_to_run(shape, mask_kind):
    B, Hq, Hkv, S, D = shape
    torch.manual_seed(5)
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = (torch.rand(B, 1, S, S, device="cuda") > 0.3) if mask_kind == "mask" else None
    ref = _sdpa_ref(q, k, v, mask, mask_kind == "causal")
    sig = Signature.of(q, k, mask_kind)
    ran, raised = [], {}
    for name, backend in BACKENDS.items():
        if backend.why_not(sig) is not None:
            continue
        try:
            out = backend.run(q, k, v, mask, mask_kind == "causal", None)
        except Exception as err:  # noqa: BLE001 - the manager falls back; listed below
            raised[name] = f"{type(err).__name__}: {err}"[:200]
            continue
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2, msg=name)
        ran.append(name)
    print(f"ran {ran}; raised {raised}")
    assert "sdpa" in ran and "math" in ran and "chunked" in ran
    if mask_kind != "mask":
        assert set(ran) & {"sdpa_flash", "sdpa_cudnn", "flex", "sdpa_efficient"}, (ran, raised)


@pytest.mark.gpu
def test_manager_timing_separates_host_from_gpu_time():
    """GPU time excludes host gaps (the sleep kernel holds the stream while the host issues calls); host
    time is the issue time. Two calls of known cost: GPU work with little host time (a sleep kernel, its
    duration timed alone with events), and 2 ms of host time around a tiny kernel."""
    from adaattn.attention.timing import timed

    dev = torch.device("cuda", torch.cuda.current_device())
    cycles = 4_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    alone = []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        alone.append(start.elapsed_time(end))
    x = torch.ones(16, device=dev)
    gpu_bound = timed(lambda: torch.cuda._sleep(cycles), dev, warmup=1, repeats=3)
    host_bound = timed(lambda: (time.sleep(0.002), x.add_(1)), dev, warmup=1, repeats=3)
    print(alone, gpu_bound, host_bound)
    assert 0.8 * min(alone) < gpu_bound.gpu_ms < 1.2 * max(alone) and gpu_bound.host_ms < 0.5
    assert host_bound.host_ms > 1.9 and host_bound.gpu_ms < 0.2
    # time per call, back to back: the GPU's where the call is GPU-bound, the host's where it is host-bound
    assert 0.8 * min(alone) < gpu_bound.call_ms < 1.2 * max(alone) and 1.9 < host_bound.call_ms < 3


@pytest.mark.gpu
def test_module_gpu_work_hides_a_backends_host_time(monkeypatch):
    """Ranked by time per call of the module's call, a backend whose op spends 0.5 ms on the host goes
    before one whose op spends 0.3 ms on the GPU when the module around it keeps the GPU busy for 1 ms per
    call (the host's time hides under it); called alone, the manager ranks them the other way."""
    from adaattn.attention.timing import sleep_cycles_per_ms

    per_ms = sleep_cycles_per_ms(torch.cuda.current_device())

    def hostly(q, k, v, m, c, s):
        time.sleep(0.0005)
        return q.clone()

    def gpuy(q, k, v, m, c, s):
        torch.cuda._sleep(int(0.3 * per_ms))
        return q.clone()

    why = BACKENDS["sdpa"].why_not
    monkeypatch.setitem(BACKENDS, "hostly", Backend("hostly", hostly, why))
    monkeypatch.setitem(BACKENDS, "gpuy", Backend("gpuy", gpuy, why))
    km = AttentionKernelManager(backends=["hostly", "gpuy"])
    q, k, v = (t.cuda() for t in _qkv())
    assert km(q, k, v)[1] == "gpuy", km.timings
    ada = AdaAttention(64, 4, kernel_manager=km, precision_mode="fp32", rank_mode="full", device="cuda")
    out_proj = ada._out_proj

    def busy_out_proj(*a):
        torch.cuda._sleep(int(per_ms))
        return out_proj(*a)

    monkeypatch.setattr(ada, "_out_proj", busy_out_proj)
    x = torch.randn(2, 16, 64, device="cuda")
    with torch.no_grad():
        ada(x, x, x)
    key = next(k for k, what in km.timed.items() if what == "call")
    assert km.rankings[key] == ["hostly", "gpuy"], km.timings[key]


def test_manager_gpu_timing_lengthens_the_hold_until_it_outlasts_the_host(monkeypatch, clock):
    """The sleep that holds the stream while the host issues the timed calls is doubled while it was over before
    the last call was issued (its event completed), whatever the calibrated length in ms said: here the GPU
    runs the sleep three times as fast as calibrated (a lent H100 ran it at 1.9x, at a higher clock than it
    was calibrated at, while the host was as fast as the first issue said). CUDA simulated on the CPU: the
    sleep ends at a time the fake events read."""
    from adaattn.attention import timing

    class Gpu:
        free_at = 0.0  # clock time the simulated sleep ends
        sleeps: list[float] = []  # each sleep's true length (s)
        ends: list[float] = []  # the clock time each sleep ends

    def sleep(cycles):
        true_s = cycles / 3e6 / 1e3  # runs at 3e6 cycles/ms, three times the calibrated 1e6
        Gpu.sleeps.append(true_s)
        Gpu.free_at = clock.s + true_s
        Gpu.ends.append(Gpu.free_at)

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = Gpu.free_at  # recorded after the sleep: completes when it ends

        def query(self):
            return clock.perf_counter() >= self.at

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(torch.cuda, "_sleep", sleep)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "sleep_cycles_per_ms", lambda index: 1e6)
    monkeypatch.setattr(timing, "turn", lambda call, device, repeats: 1.0)
    issued = []

    def call():  # 2 ms of host time per call, on the simulated clock
        clock.sleep(0.002)
        issued.append(clock.s)

    timed = timing.timed(call, torch.device("cuda", 0), warmup=0, repeats=3)
    assert len(Gpu.sleeps) >= 2 and all(b == pytest.approx(2 * a) for a, b in zip(Gpu.sleeps, Gpu.sleeps[1:]))
    # issued[0] is the issue that sized the first sleep; try i issues calls 1 + 3i .. 3 + 3i
    assert len(issued) == 1 + 3 * len(Gpu.sleeps)
    assert Gpu.ends[-1] > issued[-1]  # the last sleep outlasted the host's issue of the timed calls
    assert all(end <= issued[3 + 3 * i] for i, end in enumerate(Gpu.ends[:-1]))  # each one before it did not
    assert len(Gpu.sleeps) <= timing.HOLD_TRIES and timed.gpu_ms == pytest.approx(1 / 3)
