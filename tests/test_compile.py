"""AdaAttention under torch.compile: whole graphs (no graph break) forward and backward with every mask kind,
causal and GQA; a tuned decision is what the graph runs; no decision runs the hardware's default and says so;
``tune`` and ``adaattn tune`` (the persisted cache, stale entries, bad arguments). GPU: CUDA graphs and
max-autotune."""

import json

import pytest
import torch

import adaattn.attention.kernel_manager as km_mod
import adaattn.timing.rounds as rounds_mod
from adaattn.attention.ada import AdaAttention
from adaattn.attention.backends import BACKENDS, FORCED, traced_name
from adaattn.attention.kernel_manager import DEFAULT, AttentionKernelManager
from adaattn.attention.tune import Shape, cache_path, tune_shapes

E, H = 32, 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # every module compiled here is another entry in dynamo's cache of one forward
    yield
    torch._dynamo.reset()


def _masks(B, S):
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, -3:] = True
    return {"none": {}, "causal": {"is_causal": True}, "padding": {"key_padding_mask": pad},
            "float": {"attn_mask": torch.randn(S, S)}, "padding+causal": {"key_padding_mask": pad, "is_causal": True}}


# each mask kind once with MHA's packed weights, the GQA module on the kinds that change its path
@pytest.mark.parametrize("kv_heads,mask", [(4, "none"), (4, "causal"), (4, "padding"), (4, "float"),
                                           (2, "none"), (2, "padding+causal")])
def test_compiles_whole_forward_and_backward_and_matches_eager(kv_heads, mask):
    torch.manual_seed(0)
    ada = AdaAttention(E, H, batch_first=True, num_kv_heads=kv_heads, rank_mode="full",
                       kernel_manager=AttentionKernelManager())
    kw = _masks(2, 16)[mask]

    def f(x):
        return ada(x, x, x, need_weights=False, **kw)[0]

    x = torch.randn(2, 16, E)
    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    ref_x, x_c = (x.clone().requires_grad_() for _ in range(2))
    out = torch.compile(f, fullgraph=True)(x_c)
    ref = f(ref_x)  # eager: the policies decide (the compiled call ran the defaults, SDPA)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x_c.grad, ref_x.grad, atol=1e-4, rtol=1e-4)


def test_changing_lengths_compile_one_graph_a_length_bucket_and_match_eager():
    """As ``nn.MultiheadAttention``: dynamo makes the length dynamic at its first change; the module's plans are
    filed per power-of-two bucket (the policies' signatures), so a graph serves a bucket's every length, never
    one graph a length. Eager references from a copy: a decision filed in the compiled module would retrace."""
    import copy

    from torch._dynamo.testing import CompileCounter

    lengths = (16, 24, 40, 50, 64, 70, 100, 130, 200, 250)  # buckets 16 (static), 32, 64, 128, 256
    for tuned in (False, True):
        torch._dynamo.reset()  # the recompile limit counts per code object: this lambda's, across both
        ada = AdaAttention(E, H, batch_first=True, kernel_manager=AttentionKernelManager())
        eager, counter = copy.deepcopy(ada), CompileCounter()
        f = torch.compile(lambda x: ada(x, x, x, need_weights=False)[0], fullgraph=True, backend=counter)
        with torch.no_grad():
            if tuned:
                for S in (16, 32, 64, 128, 256):
                    ada.tune(torch.randn(2, S, E), grad=False)
            for S in lengths:
                x = torch.randn(2, S, E)
                torch.testing.assert_close(f(x), eager(x, x, x, need_weights=False)[0], atol=1e-5, rtol=1e-5)
        assert counter.frame_count == 5, (tuned, counter.frame_count)
        assert not tuned or ada.get_statistics()["untuned"] == []
    torch._dynamo.reset()
    mha, counter = torch.nn.MultiheadAttention(E, H, batch_first=True), CompileCounter()
    f = torch.compile(lambda x: mha(x, x, x, need_weights=False)[0], fullgraph=True, backend=counter)
    with torch.no_grad():
        for S in lengths:
            f(torch.randn(2, S, E))
    assert counter.frame_count == 2  # what MHA does: static, then one dynamic graph


def test_a_compiled_module_runs_the_tuned_backend_and_the_default_without_one(monkeypatch):
    """Tuned: the graph holds the manager's first backend (a spy backend records what was traced) and nothing
    is untuned. Not tuned: the hardware's defaults (SDPA's own call), listed per policy in
    ``get_statistics()["untuned"]``."""
    traced, graphs = [], []

    def spy(*a):
        traced.append("math")
        return run(*a)

    def keep(gm, _):
        graphs.append(gm.code)
        return gm

    run = BACKENDS["math"].run
    monkeypatch.setitem(BACKENDS, "math", BACKENDS["math"].__class__("math", spy, BACKENDS["math"].why_not))
    x = torch.randn(2, 16, E)
    ada = AdaAttention(E, H, batch_first=True, rank_mode="auto",
                       kernel_manager=AttentionKernelManager(backends=["math", DEFAULT]))
    compiled = torch.compile(lambda x: ada(x, x, x, need_weights=False)[0], backend=keep, fullgraph=True)
    with torch.no_grad():
        compiled(x)
    assert DEFAULT == "sdpa" and traced == [] and "scaled_dot_product_attention" in graphs[-1]
    untuned = ada.get_statistics()["untuned"]
    # precision too where the hardware's default is a reduced dtype its guards never checked (not a CPU's fp32)
    assert sorted(u.rsplit(": ", 1)[1] for u in untuned) == ["backend", "rank"], untuned
    ada.manager.disable(DEFAULT)  # whatever the measurement finds, math is the choice
    decided = ada.tune(x, grad=False)
    (sig, d), = decided.items()
    assert d["dtype"] == "float32" and d["path"] == "exact" and d["backends"] == ["math"]  # sdpa not measured
    traced.clear()
    with torch.no_grad():
        out = compiled(x)  # the signature's plan is new: dynamo's guard on it retraces
    assert traced == ["math"] and ada.get_statistics()["untuned"] == [], traced
    assert "scaled_dot_product_attention" not in graphs[-1]
    torch.testing.assert_close(out, ada(x, x, x, need_weights=False)[0], atol=1e-5, rtol=1e-5)


def test_an_undecided_signature_traces_its_default_plan_once():
    """The default plan is made while tracing, a constant of the graph: a ranking another module makes later does
    not retrace (no guard on the manager's state; guards cost host time on every call); the module's own decision
    does."""
    from torch._dynamo.testing import CompileCounter

    counter, manager = CompileCounter(), AttentionKernelManager(backends=["math", DEFAULT])
    ada = AdaAttention(E, H, batch_first=True, rank_mode="full", kernel_manager=manager)
    compiled = torch.compile(lambda x: ada(x, x, x, need_weights=False)[0], backend=counter, fullgraph=True)
    x = torch.randn(2, 16, E)
    with torch.no_grad():
        compiled(x)
        AdaAttention(E, H, batch_first=True, rank_mode="full", kernel_manager=manager).tune(x, grad=False)
        assert manager.rankings
        compiled(x)
        assert counter.frame_count == 1
        ada.tune(x, grad=False)
        compiled(x)
    assert counter.frame_count == 2


def test_a_forced_sdpa_backend_that_sdpa_picks_anyway_is_traced_as_sdpas_own_call():
    """The same kernel without ``sdpa_kernel`` around it (flags and guards on every compiled call), in a tuned plan
    and in an untuned module's default plan; a forced backend SDPA would not pick stays forced."""
    q = torch.randn(1, 4, 8, 16)
    assert [n for n in FORCED if traced_name(n, q, q, None, False, None) == "sdpa"] == ["sdpa_flash"]  # CPU, fp32
    assert traced_name("sdpa_math", q, q, None, False, None) == "sdpa_math"
    assert traced_name("math", q, q, None, True, None) == "math"
    manager = AttentionKernelManager(backends=["sdpa_flash"])
    tuned, untuned = (AdaAttention(E, H, batch_first=True, rank_mode="full", kernel_manager=manager) for _ in range(2))
    x = torch.randn(2, 16, E)
    graphs = []

    def keep(gm, _):
        graphs.append(gm.code)
        return gm

    with torch.no_grad():
        (d,) = tuned.tune(x, grad=False).values()
        for ada in (tuned, untuned):  # the untuned one reads the shared manager's ranking
            out = torch.compile(lambda x, ada=ada: ada(x, x, x, need_weights=False)[0], backend=keep, fullgraph=True)(x)
            torch.testing.assert_close(out, ada(x, x, x, need_weights=False)[0])
    assert d["backends"] == ["sdpa_flash"] and [plan[2] for plan in tuned._plans.values()] == [None]  # SDPA's own
    assert len(graphs) == 2 and not any("sdpa_kernel" in g for g in graphs)
    assert "scaled_dot_product_attention" in graphs[1]


def test_tune_decides_both_grad_modes_and_rejects_bad_arguments():
    ada = AdaAttention(E, H, batch_first=True, rank_mode="full",
                       kernel_manager=AttentionKernelManager(backends=["sdpa", "math"]))
    x = torch.randn(1, 8, E)
    decided = ada.tune(x)
    assert len(decided) == 2 and {k.split("|")[-2] for k in decided} == {"0", "1"}  # inference and training
    with pytest.raises(ValueError, match="grad must be True, False or None"):
        ada.tune(x, grad="yes")
    with pytest.raises(TypeError, match="tune takes tensors"):
        ada.tune([1, 2])
    with pytest.raises(ValueError, match="expected query"):
        ada.tune(torch.randn(1, 8, E + 1))


def test_tune_shapes_fill_the_cache_that_a_compiled_model_reads(tmp_path, monkeypatch):
    """``adaattn tune``'s work: rankings for every shape and grad mode in the cache file; a manager reading it
    (another process) has them, so a compiled module emits the tuned backend with nothing untuned; an entry made
    under another torch is ignored with its reason."""
    path = tmp_path / "attn.json"
    rows = tune_shapes(E, H, [Shape.parse("2x16"), Shape.parse("1x8x16")], path, dtype="fp32", mode="both",
                       device="cpu")
    assert len(rows) == 4 and all(r["ranking"] for r in rows)
    entries = json.loads(path.read_text())["entries"]
    assert set(entries) == {r["signature"] for r in rows}
    reader = AttentionKernelManager(cache_path=path)
    ada = AdaAttention(E, H, batch_first=True, precision_mode="fp32", rank_mode="full", kernel_manager=reader)
    x = torch.randn(2, 16, E)
    with torch.no_grad():
        torch.compile(lambda x: ada(x, x, x, need_weights=False)[0], backend="eager", fullgraph=True)(x)
    assert ada.get_statistics()["untuned"] == [] and reader.calls == {}  # nothing measured, nothing untuned
    key = next(iter(entries))
    path.write_text(json.dumps({"entries": {key: {**entries[key], "torch": "1.0"}}}))
    (stale,) = AttentionKernelManager(cache_path=path).get_statistics()["stale"]
    assert stale["signature"] == key and "torch 1.0" in stale["reason"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="fp8"), "dtype 'fp8' is not one of: fp32, bf16, fp16"),
    (dict(mask="banded"), "mask 'banded' is not one of: none, causal, padding"),
    (dict(mode="train"), "mode 'train' is not one of: fwd, fwd_bwd, both"),
    (dict(device="tpu"), "device 'tpu' is not one of: cpu"),
    (dict(shapes=[]), "at least one"),
])
def test_tune_shapes_reject_bad_arguments_before_any_work(tmp_path, kwargs, match):
    args = dict(embed_dim=E, heads=H, shapes=[Shape(1, 8, 8)], cache=tmp_path / "c.json", dtype="fp32") | kwargs
    with pytest.raises(ValueError, match=match):
        tune_shapes(**args)
    assert not (tmp_path / "c.json").exists()


def test_tune_cli_parses_shapes_and_needs_a_cache(monkeypatch):
    assert Shape.parse("8x4096") == Shape(8, 4096, 4096) and Shape.parse("1X1x64") == Shape(1, 1, 64)
    for bad in ("8", "8x0", "ax4", "1x2x3x4"):
        with pytest.raises(ValueError, match="must be BxS or BxLxS"):
            Shape.parse(bad)
    monkeypatch.delenv("ADAATTN_KERNEL_CACHE", raising=False)
    with pytest.raises(ValueError, match="pass --cache PATH or set ADAATTN_KERNEL_CACHE"):
        cache_path(None)
    monkeypatch.setenv("ADAATTN_KERNEL_CACHE", "/tmp/x.json")
    assert str(cache_path(None)) == "/tmp/x.json"


def test_a_measured_signature_costs_a_few_rounds_not_seconds(monkeypatch):
    """The first call of a new signature ranks only the candidates within CONTENDER of the fastest warm-up, in
    at most ROUNDS[1] rounds of GPU-time turns: counted here in calls, not timed."""
    calls = []
    monkeypatch.setattr(rounds_mod, "interleaved_samples_ms",
                        lambda c, device, rounds, seed=0, turn="call": calls.append((len(c), rounds)) or [[1.0]] * len(c))
    # warm-ups as equal as the manager's candidates' (a loaded machine's real ones can leave one contender alone)
    def warm(times):
        def warm_ms(call, device, calls=2):
            call()  # a candidate that cannot run still fails here
            return next(times)
        return warm_ms

    monkeypatch.setattr(rounds_mod, "warm_ms", warm(iter([1.0] * 100)))
    km = AttentionKernelManager()
    q = torch.randn(1, 4, 64, 8)
    km(q, q, q)
    (n, rounds), = calls
    assert 1 < n <= 4 and km_mod.ROUNDS[0] <= rounds <= km_mod.ROUNDS[1]
    # a candidate whose warm-up is more than CONTENDER x the fastest's takes no rounds; one left takes none
    spread = iter(range(100))
    monkeypatch.setattr(rounds_mod, "warm_ms", warm(10.0 ** next(spread) for _ in range(100)))
    calls.clear()
    AttentionKernelManager()(q, q, q)
    assert calls == [] and next(spread) == n  # every candidate warmed up, none ranked in rounds


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compiles_whole_on_cuda_in_every_mode(mode):
    """fullgraph=True, forward and backward, masks, causal and GQA (one small shape for max-autotune: it
    autotunes every GEMM), outputs and gradients equal to eager's."""
    torch.manual_seed(0)
    dev, B, S = "cuda", 2, 128
    cases = [(4, "none"), (4, "padding"), (2, "causal")] if mode != "max-autotune-no-cudagraphs" else [(2, "padding")]
    for kv_heads, mask in cases:
        torch._dynamo.reset()
        ada = AdaAttention(256, 4, batch_first=True, num_kv_heads=kv_heads, rank_mode="full",
                           kernel_manager=AttentionKernelManager(),
                           device=dev, dtype=torch.bfloat16)
        kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in _masks(B, S)[mask].items()}
        x = torch.randn(B, S, 256, device=dev, dtype=torch.bfloat16)
        ada.tune(x, key_padding_mask=kw.get("key_padding_mask"), attn_mask=kw.get("attn_mask"),
                 is_causal=kw.get("is_causal", False))

        def f(x):
            return ada(x, x, x, need_weights=False, **kw)[0]

        xc = x.clone().requires_grad_()  # one input buffer that stays put, as a training loop's
        torch._dynamo.mark_static_address(xc)
        compiled = torch.compile(lambda: f(xc), fullgraph=True, mode=mode)
        grad = torch.randn_like(x)
        for _ in range(3):  # CUDA graphs record after warm-up calls; each call a new step
            torch.compiler.cudagraph_mark_step_begin()
            for t in (xc, *ada.parameters()):  # a gradient is a CUDA graph's output: set to None, not accumulated
                t.grad = None
            out = compiled()
            torch.autograd.backward(out, grad)
        out, dx = out.clone(), xc.grad.clone()
        xe = x.clone().requires_grad_()
        ref = f(xe)
        torch.autograd.backward(ref, grad)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(dx.float(), xe.grad.float(), atol=5e-2, rtol=5e-2)
        assert ada.get_statistics()["untuned"] == [], (mode, mask)
