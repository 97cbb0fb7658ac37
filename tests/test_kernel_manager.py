"""AttentionKernelManager and its backends: each backend correct where it claims to run, the hardware's
candidates, the ranking from GPU-time rounds, persistence with stale entries, what a compiled region runs,
fallback."""

import json

import pytest
import torch
import torch.nn.functional as F

import adaattn.attention.kernel_manager as km_mod
import adaattn.timing.rounds as rounds_mod
from adaattn.attention.backends import BACKENDS, SDP_FLAGS, Signature
from adaattn.attention.kernel_manager import DEFAULT, IN_THE_RUNNING, AttentionKernelManager
from adaattn.attention.ranking_cache import METHOD
from test_ada_rank import _qkv, _sdpa_ref


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


def _fixed_rounds(monkeypatch, ms: dict[str, float], seen: list | None = None):
    """GPU-time rounds that return ``ms`` per backend (matched by the call's position among those timed)."""
    def rounds(calls, device, n, seed=0, turn="call"):
        assert turn == "gpu"  # rankings are by GPU time
        names = list(ms_order)
        if seen is not None:
            seen.append((names[:len(calls)], n))
        return [[ms[name]] * n for name in names[:len(calls)]]

    ms_order = list(ms)
    monkeypatch.setattr(rounds_mod, "interleaved_samples_ms", rounds)


def test_manager_measures_once_persists_and_reloads(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    km = AttentionKernelManager(backends=["sdpa", "math", "chunked"], cache_path=path)
    q, k, v = _qkv()
    _, first = km(q, k, v)
    _, again = km(q, k, v)
    assert first == again and km.get_statistics()["calls"] == {first: 2}
    entries = json.loads(path.read_text())["entries"]
    (key, entry), = entries.items()
    assert sorted(entry["ranking"]) == ["chunked", "math", "sdpa"] and entry["torch"] == torch.__version__
    assert entry["method"] == METHOD and set(entry["ms"]) == {"chunked", "math", "sdpa"}
    assert km.get_statistics()["measure_s"][key] > 0
    # a new process (manager) reads the ranking instead of measuring
    km2 = AttentionKernelManager(backends=["sdpa", "math", "chunked"], cache_path=path)
    monkeypatch.setattr(km2, "measure", lambda *a: pytest.fail("measured again despite the cache"))
    assert km2(q, k, v)[1] == first and km2.get_statistics()["stale"] == []
    # entries measured under another torch, Triton or method are ignored, and said why; others are kept
    for stale, why in (({"torch": "0.0"}, "torch 0.0"), ({"method": 1}, "method 1"), ({"triton": "0.1"}, "triton 0.1")):
        path.write_text(json.dumps({"entries": {key: {**entry, **stale}, "other|sig": entry}}))
        fresh = AttentionKernelManager(backends=["sdpa", "math", "chunked"], cache_path=path)
        assert key not in fresh.rankings and "other|sig" in fresh.rankings
        (note,) = fresh.get_statistics()["stale"]
        assert note["signature"] == key and why in note["reason"] and "this is" in note["reason"], note
        fresh(q, k, v)  # measured again, and written beside the other entries
        assert set(json.loads(path.read_text())["entries"]) == {key, "other|sig"} and not fresh.stale
    path.write_text("{not json")
    assert AttentionKernelManager(cache_path=path).rankings == {}


def test_ranking_is_by_the_median_gpu_time_turn_of_the_contenders(monkeypatch):
    """Candidates warm up (the estimate), those within CONTENDER x the fastest take rounds, the ranking is by
    their median turn, then the rest by their warm-up."""
    seen = []
    _fixed_rounds(monkeypatch, {"math": 2.0, "sdpa": 1.0, "chunked": 3.0}, seen)
    warm = {"math": 1.0, "sdpa": 1.0, "chunked": 1.0, "sdpa_math": 50.0}
    name_of = {BACKENDS[n].run: n for n in warm}
    monkeypatch.setattr(km_mod, "workload", lambda run, *a: name_of[run])  # a "call" is its backend's name
    monkeypatch.setattr(rounds_mod, "warm_ms", lambda call, device, calls=2: warm[call])
    km = AttentionKernelManager(backends=["math", "sdpa", "chunked", "sdpa_math"])
    q, k, v = _qkv()
    sig = Signature.of(q, k, "none")
    assert km.measure(sig, q, k, v, None, False, None) == ["sdpa", "math", "chunked", "sdpa_math"]
    (names, rounds), = seen
    assert names == ["math", "sdpa", "chunked"] and km_mod.ROUNDS[0] <= rounds <= km_mod.ROUNDS[1]
    assert km.times_ms[sig.key()] == {"math": 2.0, "sdpa": 1.0, "chunked": 3.0, "sdpa_math": 50.0}


def test_a_default_manager_measures_the_hardwares_candidates():
    q, k, v = _qkv()
    km = AttentionKernelManager()
    assert [n for n, _ in km.candidates(Signature.of(q, k, "none"))] == list(IN_THE_RUNNING["cpu"])
    with torch.no_grad():
        km(q, k, v)
    (ranking,) = km.rankings.values()
    assert set(ranking) <= set(IN_THE_RUNNING["cpu"]) and "chunked" not in ranking
    assert IN_THE_RUNNING["cuda"][:4] == ("flash_attn", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient")


def test_training_signature_is_ranked_on_forward_and_backward():
    """A training signature's calls run forward and backward; the measurement leaves the caller's graph alone."""
    km = AttentionKernelManager(backends=["sdpa", "math"])
    q, k, v = _qkv()
    with torch.no_grad():
        km(q, k, v)
    q.requires_grad_(True)
    out, _ = km(q, k, v)
    assert len(km.rankings) == 2 and Signature.of(q, k, "none").grad
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_a_compiled_region_runs_the_ranking_s_first_traceable_backend_or_the_default(monkeypatch):
    q, k, v = _qkv()
    km = AttentionKernelManager(backends=["sdpa", "math"])
    sig = Signature.of(q, k, "none")
    assert km.traced_backend(sig) == DEFAULT and km.get_statistics()["untuned"] == [sig.key()]
    km.rankings[sig.key()] = ["xformers", "math", "sdpa"]  # xformers does not trace (nor run on a CPU)
    assert km.traced_backend(sig) == "math"
    compiled = torch.compile(lambda q, k, v: km(q, k, v)[0], backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v).double(), _sdpa_ref(q, k, v), atol=1e-5, rtol=1e-5)
    assert km.calls == {}  # traced calls are not counted
    monkeypatch.setattr(km, "rankings", {})
    km.untuned.clear()
    km.measure(sig, q, k, v, None, False, None)  # an eager decision: no longer untuned
    assert km.get_statistics()["untuned"] == []


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


def test_unavailable_backend_falls_back_with_its_reason_logged_once(caplog, monkeypatch):
    from adaattn.attention import kernel_manager

    # another test in the same worker can leave the module's logger disabled (a library's logging config with
    # disable_existing_loggers): this test reads the records, not the process's logging setup
    monkeypatch.setattr(kernel_manager.log, "disabled", False)
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
    reasons = dict(AttentionKernelManager(backends=list(BACKENDS)).candidates(sig))
    assert "needs CUDA" in reasons["flash_attn"]
    assert reasons["sdpa"] is None and reasons["chunked"] is None
    with pytest.raises(ValueError, match="mask kind"):
        Signature.of(q, k, "padding")


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
def test_gpu_turns_time_the_gpu_work_not_the_host():
    """A "gpu" turn replays the call as a CUDA graph: a sleep kernel's duration for a GPU-bound call, a tiny
    kernel's for a call with 2 ms of host time around it; a call that cannot be captured (it synchronises) is
    timed behind a hold, its GPU time still a small kernel's."""
    import statistics
    import time

    from adaattn.timing.rounds import graphed, interleaved_samples_ms

    cycles = 4_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    alone = []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        alone.append(start.elapsed_time(end))
    x = torch.ones(16, device="cuda")

    def syncing():
        x.add_(1)
        torch.cuda.current_stream().synchronize()

    calls = [lambda: torch.cuda._sleep(cycles), lambda: (time.sleep(0.002), x.add_(1)), syncing]
    assert graphed(calls[2]) is None and graphed(calls[1]) is not None
    gpu, host, sync = (statistics.median(s) for s in interleaved_samples_ms(calls, "cuda", 3, turn="gpu"))
    print(alone, gpu, host, sync)
    assert 0.8 * min(alone) < gpu < 1.2 * max(alone) and host < 0.2 and sync < 0.5
    torch.nn.Linear(4, 4, device="cuda")  # random ops still run after a failed capture (not "offset increment")
    assert torch.randn(2, device="cuda").isfinite().all()


def test_a_signature_key_reads_back():
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 12, 16)
    sig = Signature.of(q, k, "causal")
    assert Signature.from_key(sig.key()) == sig
    with pytest.raises(ValueError, match="not a signature key"):
        Signature.from_key("cpu|x86_64|float32")
