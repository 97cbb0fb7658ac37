"""AdaAttention's adaptive rank: the rank estimate, the Nyström and pooled paths, chunked attention, and the
rank policy that takes a low-rank path only where it is accurate and faster."""


import pytest
import torch
import torch.nn.functional as F

from adaattn.attention.ada import AdaAttention
from adaattn.attention.chunked import chunked_attention
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.rank import estimate_rank, nystrom_attention

E, H = 48, 4


def _qkv(B=2, Hq=4, Hkv=2, L=33, S=33, D=16, dtype=torch.float32):
    torch.manual_seed(2)
    return torch.randn(B, Hq, L, D, dtype=dtype), torch.randn(B, Hkv, S, D, dtype=dtype), \
        torch.randn(B, Hkv, S, D, dtype=dtype)


def _sdpa_ref(q, k, v, mask=None, causal=False):
    g = q.shape[1] // k.shape[1]
    mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    return F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(g, 1),
                                          v.double().repeat_interleave(g, 1), attn_mask=mask, is_causal=causal)






# every mask kind, both layouts, with weights (the matmul path) and without (the manager's backend)


# --------------------------------------------------------------------------- rank, chunked, Nyström


def _low_rank_keys(B, Hh, S, D, r):
    """Keys in r contiguous blocks of one vector each: every attention matrix has rank <= r."""
    torch.manual_seed(3)
    base = torch.randn(B, Hh, r, D) * 2
    return base.repeat_interleave(S // r, dim=2)


def test_rank_estimate_on_inputs_of_known_rank():
    q = torch.randn(1, 2, 256, 32) * 2
    low = estimate_rank(q, _low_rank_keys(1, 2, 256, 32, 4))
    assert (low["spectrum"] <= 4).all()
    full = estimate_rank(q, torch.randn(1, 2, 256, 32) * 2)
    assert (full["spectrum"] > 16).all()
    # entropy rank: how many keys a query attends to (not the matrix rank): all S for uniform rows
    uniform = estimate_rank(torch.zeros(1, 2, 64, 32), torch.randn(1, 2, 256, 32))
    torch.testing.assert_close(uniform["entropy"], torch.full((2,), 256.0), rtol=1e-4, atol=0)


def test_nystrom_gqa_and_uneven_segments_match_the_repeated_heads():
    """GQA runs without copying k and v: the same as repeating them per query head. Landmarks of
    segments of unequal size (r does not divide S) take the prefix-sum path; low precision keeps
    fp32 landmarks and softmaxes and stays close to the fp32 result."""
    q, k, v = torch.randn(2, 6, 96, 16), torch.randn(2, 2, 96, 16), torch.randn(2, 2, 96, 16)
    rep = [t.repeat_interleave(3, dim=1) for t in (k, v)]
    for r in (8, 7):  # 96 % 8 == 0: the view; 96 % 7 != 0: prefix sums
        torch.testing.assert_close(nystrom_attention(q, k, v, r), nystrom_attention(q, *rep, r), atol=1e-5, rtol=1e-5)
    k = _low_rank_keys(2, 2, 96, 16, 8)
    full = nystrom_attention(q, k, v, 8, pinv_iters=20)
    low = nystrom_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 8, pinv_iters=20)
    assert low.dtype == torch.bfloat16
    assert (low.float() - full).norm() / full.norm() < 2e-2


def test_pinv_runs_the_counted_products():
    """The rank study prices the r x r solve as PINV_ITERS x PINV_MATMULS_PER_ITER batched products:
    that is what ``_pinv`` runs (counted at the dispatcher), and it inverts a well-conditioned matrix."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from adaattn.attention.rank import PINV_ITERS, PINV_MATMULS_PER_ITER
    from adaattn.kernels.pinv import pinv as _pinv

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.mm,
                                       torch.ops.aten.addmm, torch.ops.aten.matmul):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    a = torch.eye(24).expand(3, 24, 24) + 0.05 * torch.randn(3, 24, 24)
    with Count():
        z = _pinv(a, PINV_ITERS)
    assert Count.n == PINV_ITERS * PINV_MATMULS_PER_ITER
    torch.testing.assert_close(z @ a, torch.eye(24).expand(3, 24, 24), atol=1e-4, rtol=0)


def test_nystrom_is_exact_on_block_low_rank_keys_and_chunked_is_exact():
    q = torch.randn(1, 2, 128, 16)
    k = _low_rank_keys(1, 2, 128, 16, 8)
    v = torch.randn(1, 2, 128, 16)
    ref = _sdpa_ref(q, k, v)
    torch.testing.assert_close(nystrom_attention(q, k, v, 8, pinv_iters=20).double(), ref, atol=2e-3, rtol=2e-3)
    q, k, v = _qkv(L=37, S=45)
    mask = torch.rand(2, 4, 37, 45) > 0.3
    for kw in [{}, {"is_causal": True}, {"attn_mask": mask}, {"attn_mask": torch.randn(37, 45)}]:
        ref = _sdpa_ref(q, k, v, kw.get("attn_mask"), kw.get("is_causal", False))
        torch.testing.assert_close(chunked_attention(q, k, v, chunk_size=8, **kw).double(), ref, atol=1e-5, rtol=1e-5)


def test_rank_modes_pick_the_path():
    torch.manual_seed(4)
    x = torch.randn(1, 1024, E)
    for mode, method, expect in [("full", "auto", "full"), (16, "auto", "low-rank nystrom 16"),
                                 (16, "nystrom", "low-rank nystrom 16"), (16, "pooled", "low-rank pooled 16")]:
        ada = AdaAttention(E, H, batch_first=True, rank_mode=mode, low_rank_method=method,
                           kernel_manager=AttentionKernelManager())
        ada(x, x, x, need_weights=False)
        assert ada.get_statistics()["ranks"] == {expect: 1}
    ada = AdaAttention(E, H, batch_first=True, rank_mode=16, kernel_manager=AttentionKernelManager())
    ada(x, x, x, is_causal=True, need_weights=False)  # no masked low-rank path: exact, and said so
    stats = ada.get_statistics()
    assert stats["ranks"] == {"full": 1} and stats["low_rank_skipped"]
    # "auto": at initialisation, small logits make nearly uniform rows (a low estimate), but their
    # Nyström error on the sampled rows is too high: exact, and the reason is recorded; tokens 10x
    # larger make peaked rows (a high estimate): exact without trying
    for scale, tried in [(1, True), (10, False)]:
        auto = AdaAttention(E, H, batch_first=True, rank_mode="auto", kernel_manager=AttentionKernelManager())
        auto(x * scale, x * scale, x * scale, need_weights=False)
        stats = auto.get_statistics()
        assert "full" in stats["ranks"] and any(r.startswith("estimated") for r in stats["ranks"]), stats["ranks"]
        assert any("sampled rows' relative error" in k for k in stats["low_rank_skipped"]) == tried, stats


def _clustered(S: int, r: int, contiguous: bool, seed: int = 0, noise: float = 0.05) -> torch.Tensor:
    centres = torch.randn(r, 32, generator=torch.Generator().manual_seed(0))  # shared by q and k
    g = torch.Generator().manual_seed(seed)
    which = torch.arange(S) * r // S if contiguous else torch.randint(0, r, (S,), generator=g)
    return (centres[which] + noise * torch.randn(S, 32, generator=g))[None, None]


def test_rank_policy_takes_low_rank_only_when_its_sampled_error_is_small():
    """Rank-8 attention either way; segment-mean landmarks fit contiguous clusters, not spread ones."""
    from adaattn.attention.rank import LowRank, choose_rank

    v = torch.randn(1, 1, 1024, 32)
    q, k = _clustered(1024, 8, True, 1), _clustered(1024, 8, True, 2, noise=0.1)
    r, seen = choose_rank(q, k, v, sample=64, min_len=512, methods=("nystrom",))
    assert seen["estimate"] == 8 and r == LowRank("nystrom", 16) and seen["sample_rel_error"]["nystrom"] < 0.05
    torch.testing.assert_close(nystrom_attention(q, k, v, r.rank), _sdpa_ref(q, k, v).float(), atol=2e-2, rtol=0)
    q, k = _clustered(1024, 8, False, 1), _clustered(1024, 8, False, 2)
    r, seen = choose_rank(q, k, v, sample=64, min_len=512)
    assert seen["estimate"] == 8 and seen["tried"] == 16 and r is None
    assert seen["sample_rel_error"].keys() == {"pooled", "nystrom"} and min(seen["sample_rel_error"].values()) > 0.05
    # shorter than min_len: no estimate at all
    assert choose_rank(q[:, :, :256], k[:, :, :256], v[:, :, :256], min_len=512) == (
        None, {"estimate": None, "tried": None, "sample_rel_error": {}, "speed": None})
    with pytest.raises(ValueError, match="methods must be a non-empty tuple of: pooled, nystrom"):
        choose_rank(q, k, v, methods=("pca",))


def test_rank_policy_tries_the_pooled_path_first():
    """Keys equal within each segment: pooling is exact and the policy stops there; keys that vary
    within a segment (noise 0.1) fail the pooled path's check and pass Nyström's."""
    from adaattn.attention.rank import LowRank, choose_rank

    v = torch.randn(1, 1, 1024, 32)
    q = _clustered(1024, 8, True, 1)
    r, seen = choose_rank(q, _clustered(1024, 8, True, 2, noise=0.0), v, sample=64, min_len=512)
    assert r == LowRank("pooled", 16) and list(seen["sample_rel_error"]) == ["pooled"]
    assert seen["sample_rel_error"]["pooled"] < 1e-5
    r, seen = choose_rank(q, _clustered(1024, 8, True, 2, noise=0.1), v, sample=64, min_len=512)
    assert r == LowRank("nystrom", 16) and list(seen["sample_rel_error"]) == ["pooled", "nystrom"]
    assert seen["sample_rel_error"]["pooled"] > 0.05 > seen["sample_rel_error"]["nystrom"]
    # the module: the same choice, and the reason when neither path passes
    x = torch.randn(1, 1024, E)
    for method, tried in [("auto", ["pooled", "nystrom"]), ("pooled", ["pooled"])]:
        ada = AdaAttention(E, H, batch_first=True, rank_mode="auto", low_rank_method=method, min_low_rank_len=512,
                           kernel_manager=AttentionKernelManager())
        ada(x, x, x, need_weights=False)
        (why,) = ada.get_statistics()["low_rank_skipped"]
        assert [m for m in ("pooled", "nystrom") if f"{m} " in why] == tried, why


def test_rank_policy_takes_a_low_rank_path_only_where_it_is_faster():
    """The path within the error budget is timed against the exact path (``speed``) and taken only where it
    is faster; a path that fails the error check is not timed."""
    from adaattn.attention.rank import LowRank, Speed, choose_rank

    v = torch.randn(1, 1, 1024, 32)
    q, k = _clustered(1024, 8, True, 1), _clustered(1024, 8, True, 2, noise=0.1)
    timed = []

    def speed(low: float):
        return lambda choice: timed.append(choice) or Speed(low, 1.0, "sdpa")

    r, seen = choose_rank(q, k, v, sample=64, min_len=512, methods=("nystrom",), speed=speed(0.5))
    assert r == LowRank("nystrom", 16) == timed[-1] and seen["speed"] == Speed(0.5, 1.0, "sdpa")
    r, seen = choose_rank(q, k, v, sample=64, min_len=512, methods=("nystrom",), speed=speed(1.0))
    assert r is None and seen["speed"] == Speed(1.0, 1.0, "sdpa") and seen["sample_rel_error"]["nystrom"] < 0.05
    # the first path within the budget is the one timed (pooled fails here, Nystrom passes)
    r, seen = choose_rank(q, k, v, sample=64, min_len=512, speed=speed(2.0))
    assert r is None and timed[-1] == LowRank("nystrom", 16) and len(timed) == 3
    q, k = _clustered(1024, 8, False, 1), _clustered(1024, 8, False, 2)  # spread: no path within the budget
    r, seen = choose_rank(q, k, v, sample=64, min_len=512, speed=speed(0.5))
    assert r is None and seen["speed"] is None and len(timed) == 3


def _low_rank_module(**kw) -> tuple[AdaAttention, torch.Tensor]:
    """A module whose projections are identities (q = k = v = x) and an input of 8 contiguous clusters: its
    attention has rank 8 in every head, and a low-rank path passes the policy's error check."""
    ada = AdaAttention(E, H, batch_first=True, rank_mode="auto", min_low_rank_len=512, **kw)
    with torch.no_grad():
        ada.in_proj_weight.copy_(torch.eye(E).repeat(3, 1))
        ada.in_proj_bias.zero_()
    centres = torch.randn(8, E, generator=torch.Generator().manual_seed(0))
    x = centres[torch.arange(1024) * 8 // 1024] + 0.01 * torch.randn(1024, E, generator=torch.Generator().manual_seed(1))
    return ada, x[None]


@pytest.mark.parametrize("faster", [True, False])
def test_adaattention_times_its_low_rank_path_against_the_exact_one(monkeypatch, faster):
    """rank_mode "auto": the policy's low-rank path and the manager's first backend, timed by the manager
    (``time_ops``) on this call's inputs; the path runs only where it is faster, and where it is not the
    reason says so with both times."""
    manager = AttentionKernelManager(backends=["sdpa", "math"])
    ada, x = _low_rank_module(kernel_manager=manager)
    seen = {}

    def time_ops(calls, device):
        seen.update(calls)
        outs = {n: c() for n, c in calls.items()}  # each is the attention op through its path
        assert all(o.shape == (1, H, 1024, E // H) for o in outs.values())
        return {"low-rank": 1.0 if faster else 3.0, **{n: 2.0 for n in calls if n != "low-rank"}}

    monkeypatch.setattr(manager, "time_ops", time_ops)
    with torch.no_grad():  # an inference signature: the forward is what is timed
        ada(x, x, x, need_weights=False)
    exact = manager.rankings[next(iter(manager.rankings))][0]  # the manager ranked the exact path's backends
    assert set(seen) == {"low-rank", exact}
    stats = ada.get_statistics()
    if faster:
        assert [r for r in stats["ranks"] if r.startswith("low-rank")] and not stats["low_rank_skipped"], stats
    else:
        assert stats["ranks"].get("full") == 1 and stats["calls"] == {exact: 1}, stats
        (why,) = stats["low_rank_skipped"]
        assert f"3 ms per call, not faster than the exact path's {exact} (2 ms)" in why, why
    seen.clear()
    with torch.no_grad():
        ada(x, x, x, need_weights=False)  # the choice is kept: no second timing
    assert not seen and ada.get_statistics()["ranks"].get("full" if not faster else next(
        r for r in stats["ranks"] if r.startswith("low-rank"))) == 2


def test_kernel_manager_times_calls_that_are_not_its_backends(monkeypatch):
    """``time_ops``: ms per call of each, as rankings are timed; one that fails is left out, with a fallback
    noted. Without the manager (enable_gpu_optimization=False) the exact side is SDPA."""
    manager = AttentionKernelManager(backends=["sdpa"])
    a = torch.randn(64, 64)

    def boom():
        raise RuntimeError("no")

    times = manager.time_ops({"mm": lambda: a @ a, "add": lambda: a + a, "boom": boom}, torch.device("cpu"))
    assert set(times) == {"mm", "add"} and all(0 < t < 1e3 for t in times.values())
    assert any(b == "boom" and "rejected while measuring: RuntimeError: no" in r for b, r in manager.fallbacks)
    ada, x = _low_rank_module(kernel_manager=manager, enable_gpu_optimization=False)
    names = []
    monkeypatch.setattr(manager, "time_ops", lambda calls, device: names.extend(calls) or {"low-rank": 2, "sdpa": 1})
    ada(x, x, x, need_weights=False)
    assert names == ["low-rank", "sdpa"] and not manager.rankings  # the manager ranked nothing
    (why,) = ada.get_statistics()["low_rank_skipped"]
    assert "not faster than the exact path's sdpa (1 ms)" in why, why


def test_pooled_attention_is_exact_on_keys_equal_within_segments(monkeypatch):
    """Uneven segments (a log-size bias), GQA, a subset of rows, float64; and differentiable. The
    PyTorch path (the fused one: test_nystrom_kernels.py)."""
    import adaattn.attention.rank as rank_mod
    from adaattn.attention.rank import pooled_attention

    monkeypatch.setattr(rank_mod, "use_triton", lambda *t: False)

    torch.manual_seed(0)
    for S, r in [(96, 8), (100, 7)]:
        bounds = torch.arange(r + 1) * S // r
        seg = torch.bucketize(torch.arange(S), bounds[1:], right=True)  # segment of each key
        k = torch.randn(1, 2, r, 16, dtype=torch.float64)[:, :, seg]  # equal within a segment
        q = torch.randn(1, 4, 33, 16, dtype=torch.float64)
        v = torch.randn(1, 2, S, 16, dtype=torch.float64)
        rep = [t.repeat_interleave(2, dim=1) for t in (k, v)]
        ref = _sdpa_ref(q, *rep)
        torch.testing.assert_close(pooled_attention(q, k, v, r), ref, atol=1e-10, rtol=1e-10)
        rows = torch.tensor([0, 5, 32])
        torch.testing.assert_close(pooled_attention(q, k, v, r, rows=rows), ref[:, :, rows], atol=1e-10, rtol=1e-10)
    # bf16: the means of equal segments in one reduction each, the same bits as fp32 means rounded once
    from adaattn.attention.rank import _segment_means

    qb, kb, vb = (torch.randn(1, 2, 256, 16).bfloat16() for _ in range(3))
    means = [_segment_means(t, 16).bfloat16() for t in (kb, vb)]
    assert torch.equal(pooled_attention(qb, kb, vb, 16), F.scaled_dot_product_attention(qb, *means))
    q, k, v = (torch.randn(1, 2, 64, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: pooled_attention(q, k, v, 6), (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: pooled_attention(q, k, v, 8), (q, k, v))
    with pytest.raises(ValueError, match="rank must be a positive int"):
        pooled_attention(q, k, v, 0)


def test_setting_a_rank_policy_attribute_drops_its_cached_choices():
    x = torch.randn(1, 1024, E)
    ada = AdaAttention(E, H, batch_first=True, rank_mode="auto", min_low_rank_len=512,
                       kernel_manager=AttentionKernelManager())
    ada(x, x, x, need_weights=False)
    assert ada._rank_choice
    ada.low_rank_method = "pooled"
    assert not ada._rank_choice
    ada(x, x, x, need_weights=False)
    (why,) = [w for w in ada.get_statistics()["low_rank_skipped"] if "nystrom" not in w]
    assert "pooled" in why
