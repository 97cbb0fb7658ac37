"""AdaAttention's replay plans: a call like an earlier one reuses the policies' decisions. The replayed
call must equal a call that takes every policy (outputs and gradients), count in the statistics,
and stop replaying when a decision may change (precision recheck due, backend disabled or failing,
autocast, frozen weights)."""

import copy
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import adaattn.attention.ada as ada_mod
from adaattn.attention.ada import AdaAttention
from adaattn.attention.backends import BACKENDS, Backend, Signature
from adaattn.attention.hardware import HardwareCapabilities
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.precision import PrecisionPolicy

E, H = 48, 4


def _module(**kw) -> AdaAttention:
    torch.manual_seed(0)
    ada = AdaAttention(E, H, kernel_manager=AttentionKernelManager(backends=["sdpa", "math", "chunked"]), **kw)
    with torch.no_grad():
        ada.in_proj_bias.normal_()
    return ada


def _calls(ada: AdaAttention, x: torch.Tensor, n: int, **kw) -> None:
    """``n`` self-attention calls without autograd."""
    with torch.no_grad():
        for _ in range(n):
            ada(x, x, x, **kw)


def _fresh_call(ada: AdaAttention, *args, **kw):
    """The same call taking every policy: no plan filed yet."""
    ada._plans.clear()
    return ada(*args, **kw)


# self-attention (one GEMM), cross-attention, sequence-first layout, GQA, causal, low rank: every
# branch a plan replays
@pytest.mark.parametrize("kw,cross,causal", [
    ({}, False, False),
    ({}, True, True),
    ({"batch_first": False}, False, True),
    ({"num_kv_heads": 2}, True, False),
    ({"rank_mode": 8}, False, False),
    ({"enable_gpu_optimization": False}, False, True),
])
def test_replay_equals_a_call_through_every_policy(kw, cross, causal):
    ada = _module(**kw)
    x = torch.randn(3, 37, E) if kw.get("batch_first", True) else torch.randn(37, 3, E)
    kv = torch.randn_like(x) if cross else x
    leaves = [[t.clone().requires_grad_() for t in (x, kv)] for _ in range(2)]
    ada(x, kv, kv, is_causal=causal)  # files the plans (one for grad mode on)
    with torch.no_grad():
        ada(x, kv, kv, is_causal=causal)
    assert len(ada._plans) == 2
    grads = []
    for i, (q_in, kv_in) in enumerate(leaves):
        ada.zero_grad()
        kv_in = kv_in if cross else q_in
        out = ada(q_in, kv_in, kv_in, is_causal=causal)[0] if i == 0 else _fresh_call(ada, q_in, kv_in, kv_in,
                                                                                       is_causal=causal)[0]
        out.square().sum().backward()
        grads.append((out.detach(), q_in.grad, [p.grad.clone() for p in ada.parameters()]))
    (o1, g1, p1), (o2, g2, p2) = grads
    torch.testing.assert_close(o1, o2, atol=0, rtol=0)
    torch.testing.assert_close(g1, g2, atol=0, rtol=0)
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_replayed_calls_are_counted():
    ada = _module(rank_mode="full")
    x = torch.randn(2, 16, E)
    _calls(ada, x, 5)
    _calls(ada, x, 3, is_causal=True)
    stats = ada.get_statistics()
    assert stats["total_calls"] == 8 and sum(stats["calls"].values()) == 8
    assert stats["ranks"] == {"full": 8} and stats["precisions"] == {"float32": 8}
    assert ada.get_statistics() == stats  # reading them changes nothing


def test_plans_are_bounded_and_their_calls_kept(monkeypatch):
    monkeypatch.setattr(ada_mod, "MAX_PLANS", 2)
    ada = _module(rank_mode="full")
    with torch.no_grad():
        for S in (8, 9, 10, 8, 11):
            x = torch.randn(1, S, E)
            ada(x, x, x)
            ada(x, x, x)
    assert len(ada._plans) == 2
    assert ada.get_statistics()["ranks"] == {"full": 10}


def test_a_disabled_backend_is_not_replayed():
    ada = _module(rank_mode="full")
    x = torch.randn(2, 16, E)
    with torch.no_grad():
        ada(x, x, x)
        first = next(iter(ada.manager.calls))
        _calls(ada, x, 2)  # replayed
        ada.manager.disable(first)
        _calls(ada, x, 2)
    calls = ada.get_statistics()["calls"]
    assert calls[first] == 3 and sum(calls.values()) == 5
    assert [p.backend for p in ada._plans.values()] != [first]
    with pytest.raises(ValueError, match="unknown attention backend"):
        ada.manager.disable("no_such_backend")


def test_a_backend_failing_on_replay_falls_back_and_says_why(monkeypatch, caplog):
    state = {"calls": 0}
    math_run = BACKENDS["math"].run

    def flaky(*args):
        state["calls"] += 1
        if state["calls"] > 2:
            raise RuntimeError("flaky kernel")
        return math_run(*args)

    monkeypatch.setitem(BACKENDS, "flaky", Backend("flaky", flaky, lambda sig: None))
    km = AttentionKernelManager(backends=["flaky", "chunked"])
    ada = AdaAttention(E, H, rank_mode="full", kernel_manager=km)
    x = torch.randn(2, 16, E)
    q, k, _ = ada._project(x, x, x)
    km.rankings[Signature.of(q.detach(), k.detach(), "none").key()] = ["flaky", "chunked"]
    with torch.no_grad(), caplog.at_level("WARNING"):
        outs = [ada(x, x, x)[0] for _ in range(4)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)
    stats = ada.get_statistics()
    assert stats["calls"] == {"flaky": 2, "chunked": 2}
    assert stats["fallbacks"] == [{"backend": "flaky", "reason": "RuntimeError: flaky kernel", "count": 1}]
    assert sum("flaky kernel" in r.message for r in caplog.records) == 1


def test_precision_rechecks_are_kept_on_replay(monkeypatch):
    """auto precision on bf16 hardware samples its error every ``recheck_every`` calls: a plan ends there."""
    hw = HardwareCapabilities(device="cpu", name="fake bf16", compute_capability=(9, 0), bf16=True, fp16=True,
                              fp8=True, tf32=True, memory_bytes=0)
    monkeypatch.setattr(HardwareCapabilities, "detect", staticmethod(lambda device=None: hw))
    ada = _module(rank_mode="full", precision_mode="auto")
    ada.precision = PrecisionPolicy("auto", recheck_every=4)
    checks = []
    real = ada.precision.sample_error
    monkeypatch.setattr(ada.precision, "sample_error", lambda *a: checks.append(1) or real(*a))
    x = torch.randn(2, 16, E)
    with torch.no_grad():
        for _ in range(10):
            assert ada(x, x, x)[0].dtype == torch.float32
    assert len(checks) == 3  # calls 0, 4, 8
    assert ada.get_statistics()["precisions"] == {"bfloat16": 10}


def test_fp16_auto_guards_every_call():
    policy = PrecisionPolicy("auto")
    q = torch.randn(1, 2, 8, 16)
    hw = HardwareCapabilities(device="cuda:0", name="fake", compute_capability=(7, 0), bf16=False, fp16=True,
                              fp8=False, tf32=False, memory_bytes=0)
    assert policy.choose(q, q, q, 0.25, hw, "s") == torch.float16
    assert policy.calls_until_check("s") is None
    fixed = PrecisionPolicy("fp32")  # fixed modes never look again
    fixed.choose(q, q, q, 0.25, HardwareCapabilities.detect("cpu"), "s")
    assert fixed.calls_until_check("s") > 10**9
    bf16 = PrecisionPolicy("auto", recheck_every=5)
    bf16_hw = HardwareCapabilities(device="cpu", name="fake bf16", compute_capability=(9, 0), bf16=True, fp16=True,
                                   fp8=True, tf32=True, memory_bytes=0)
    assert bf16.choose(q, q, q, 0.25, bf16_hw, "s") == torch.bfloat16  # checked on the first call
    assert bf16.calls_until_check("s") == 4  # the next sampled check is call 5
    bf16.record("s", 3)
    assert bf16.calls_until_check("s") == 1
    bf16.record("s", 7)  # two plans of one signature used up more than the interval: check at once
    assert bf16.calls_until_check("s") == 0


def test_autocast_and_frozen_weights_take_the_policies_again():
    ada = _module(rank_mode="full")
    x = torch.randn(2, 16, E)
    ada(x, x, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ada(x, x, x)[0]
        assert [p.q_dtype for p in ada._plans.values()] == [torch.bfloat16]  # the fp32 plan retired
        ref = _fresh_call(ada, x, x, x)[0]
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    for p in ada.parameters():
        p.requires_grad_(False)
    ada(x, x, x)
    grads = {key.split("|")[10] for key in ada.manager.rankings}
    assert grads == {"0", "1"}  # the frozen call is an inference signature, ranked as one


def test_copies_and_pickles_start_without_plans():
    ada = _module(rank_mode="full")
    x = torch.randn(2, 16, E)
    _calls(ada, x, 3)
    twin = copy.deepcopy(ada)
    assert not twin._plans and twin.get_statistics()["ranks"] == {"full": 3}
    shallow = copy.copy(ada)
    _calls(shallow, x, 2)
    assert shallow._plans and not ada._plans  # each files its own plans
    back = pickle.loads(pickle.dumps(ada.cpu()))
    with torch.no_grad():
        torch.testing.assert_close(back(x, x, x)[0], ada(x, x, x)[0], atol=0, rtol=0)


def test_the_manager_counts_replays_of_live_copied_and_collected_modules():
    """A replay calls its backend without the manager; the manager still counts it, while the module
    lives (``get_statistics``) and after it is gone (its calls settle into the manager's own count)."""
    km = AttentionKernelManager(backends=["sdpa", "math"])
    ada = AdaAttention(E, H, rank_mode="full", kernel_manager=km)
    x = torch.randn(2, 16, E)
    _calls(ada, x, 4)
    assert km.get_statistics()["total_calls"] == 4 and sum(km.calls.values()) == 1  # 3 replays not settled
    twin = copy.deepcopy(ada)
    assert twin.kernel_manager is not km  # a deep copy copies its manager too
    twin.kernel_manager = km
    _calls(twin, x, 3)
    assert km.get_statistics()["total_calls"] == 7
    del ada, twin
    gc.collect()
    assert not km._tracked and km.get_statistics()["total_calls"] == 7 and sum(km.calls.values()) == 7


@pytest.mark.parametrize("kw", [dict(rank_mode="full"), dict(rank_mode="full", enable_gpu_optimization=False),
                                dict(rank_mode=8, min_low_rank_len=16)])
def test_plans_do_not_keep_their_module_alive(kw):
    """No reference cycle through a plan: a module with plans goes as soon as its last reference does."""
    ada = AdaAttention(E, H, kernel_manager=AttentionKernelManager(backends=["sdpa"]), **kw)
    x = torch.randn(2, 32, E)
    _calls(ada, x, 3)
    assert ada._plans
    gone = weakref.ref(ada)
    gc.disable()
    try:
        del ada
        assert gone() is None
    finally:
        gc.enable()


def test_a_shared_manager_pickles_with_another_module_s_plans_live():
    """A forced SDPA backend's run is a closure, which does not pickle: a manager shared with a module
    that replays one still pickles (with that module's calls counted, without its plan)."""
    km = AttentionKernelManager(backends=["sdpa_math"])
    a, b = (AdaAttention(E, H, rank_mode="full", kernel_manager=km) for _ in range(2))
    x = torch.randn(2, 16, E)
    _calls(a, x, 3)
    assert km._tracked
    back = pickle.loads(pickle.dumps(b))
    assert not back.kernel_manager._tracked and back.kernel_manager.calls == {"sdpa_math": 3}
    assert km._tracked and sum(km.calls.values()) == 1  # the original keeps tracking a's plan
    with torch.no_grad():
        torch.testing.assert_close(back(x, x, x)[0], b(x, x, x)[0], atol=0, rtol=0)


def test_moving_the_module_drops_the_plans():
    """The key holds no device or dtype: ``.to()`` and the like retire the plans they were made for."""
    ada = _module(rank_mode="full")
    x = torch.randn(2, 16, E)
    _calls(ada, x, 2)
    assert ada._plans
    ada.double()
    assert not ada._plans and ada.get_statistics()["ranks"] == {"full": 2}
    with torch.no_grad():
        out = ada(x.double(), x.double(), x.double())[0]
        assert out.dtype == torch.float64 and [p.q_dtype for p in ada._plans.values()] == [torch.float64]
        torch.testing.assert_close(ada(x.double(), x.double(), x.double())[0], out, atol=0, rtol=0)


def test_a_module_and_its_parameters_are_still_nn_multihead_attentions():
    """Plans live outside the state dict: it loads into nn.MultiheadAttention after replays."""
    ada = _module(rank_mode="full")
    x = torch.randn(2, 16, E)
    with torch.no_grad():
        ada(x, x, x)
        ada(x, x, x)
        mha = nn.MultiheadAttention(E, H, batch_first=True)
        mha.load_state_dict(ada.state_dict())
        torch.testing.assert_close(mha(x, x, x, need_weights=False)[0], ada(x, x, x)[0], atol=1e-5, rtol=1e-5)


def test_changing_a_policy_setting_drops_the_plans():
    ada = _module(rank_mode="full")
    x = torch.randn(2, 64, E)
    _calls(ada, x, 3)
    ada.rank_mode = 8
    _calls(ada, x, 1)
    _calls(ada, x, 2, is_causal=True)  # causal: exact, and counted as skipped on every call
    stats = ada.get_statistics()
    assert stats["ranks"] == {"full": 5, "low-rank nystrom 8": 1}
    assert stats["low_rank_skipped"] == {ada_mod.MASKED: 2}
    ada.eval()  # not a policy setting: the plans stay
    assert len(ada._plans) == 2


def test_hooks_compile_and_tracing_take_nn_module_call(monkeypatch):
    """``AdaAttention.__call__`` skips ``nn.Module.__call__`` only when that would just call ``forward``:
    module and global hooks still run and may change the inputs and output, a compiled module runs its
    compiled call, a ``torch.jit.trace`` goes through ``nn.Module.__call__``, and so does a call while
    ``torch.fx`` has patched it (a tracer that keeps the module as a leaf sees one call of it)."""
    ada, x = _module(rank_mode="full"), torch.randn(2, 6, E)
    want = ada(x, x, x)[0].detach()
    module_calls = []
    real_impl = nn.Module._call_impl  # what nn.Module.__call__ runs for a module not compiled
    monkeypatch.setattr(nn.Module, "_call_impl", lambda self, *a, **k: module_calls.append(1) or real_impl(self, *a, **k))
    torch.testing.assert_close(ada(x, x, x)[0], want)
    assert not module_calls  # nothing to do for nn.Module.__call__: forward directly
    forwards = []
    with monkeypatch.context() as m:  # an unmasked call without weights goes straight to its replay
        m.setattr(ada, "forward", lambda *a, **k: forwards.append(1) or AdaAttention.forward(ada, *a, **k))
        torch.testing.assert_close(ada(x, x, x, is_causal=False)[0], want)
        assert not forwards
        mask = torch.zeros(6, 6, dtype=torch.bool)
        torch.testing.assert_close(ada(x, x, x, mask)[0], want)  # nothing masked: the same output, through forward
        assert len(forwards) == 1 and not module_calls

    seen_args = []  # with a hook, nn.Module.__call__ gets q, k, v and the arguments that are not their defaults
    h = ada.register_forward_pre_hook(lambda m, args, kwargs: seen_args.append((len(args), sorted(kwargs))),
                                      with_kwargs=True)
    ada(x, x, x, None, None, False, True)
    ada(x, x, x, attn_mask=mask, need_weights=True)
    h.remove()
    assert seen_args == [(3, ["is_causal"]), (3, ["attn_mask", "need_weights"])]
    assert len(module_calls) == 2
    module_calls.clear()
    with pytest.raises(TypeError, match="average_attn_weights"):
        ada(x, x, x, average_attn_weights=True)

    seen = []
    handles = [ada.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 0, *args[1:]), kwargs),
                                             with_kwargs=True),
               ada.register_forward_hook(lambda m, args, out: (out[0] + 1, out[1]))]
    got = ada(x, x, x, is_causal=False)[0]
    q_zero = torch.zeros_like(x)
    torch.testing.assert_close(got, ada.forward(q_zero, x, x)[0] + 1)
    assert len(module_calls) == 1
    for h in handles:
        h.remove()
    h = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    try:
        ada(x, x, x)
    finally:
        h.remove()
    assert "AdaAttention" in seen and len(module_calls) == 2

    xg = x.clone().requires_grad_()
    grads = []
    h = ada.register_full_backward_hook(lambda m, gin, gout: grads.append(gout[0]))
    ada(xg, xg, xg)[0].sum().backward()
    h.remove()
    assert len(grads) == 1 and len(module_calls) == 3

    monkeypatch.setattr(ada, "_compiled_call_impl", lambda *a, **k: ("compiled", a, k))
    assert ada(x, x, x, is_causal=True) == ("compiled", (x, x, x), {"is_causal": True})
    monkeypatch.setattr(ada, "_compiled_call_impl", None)

    with monkeypatch.context() as m:
        m.setattr(ada_mod, "_tracing_state", lambda: object())  # as under torch.jit.trace
        torch.testing.assert_close(ada(x, x, x)[0], want)
    assert len(module_calls) == 4

    class Leaf(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, AdaAttention) or super().is_leaf_module(m, qualname)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = ada

        def forward(self, x):
            return self.attn(x, x, x)[0] + x

    graph = Leaf().trace(Block())
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["attn"]
