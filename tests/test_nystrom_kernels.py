"""The fused Nyström and pooled forwards (kernels/nystrom.py, kernels/pooled.py) against the PyTorch paths, and
which path runs.

On a CPU machine the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py).
The interpreter rounds fp32 to bf16 by truncation (a GPU rounds to nearest even), so bf16 outputs
here differ from the PyTorch path by up to about twice bf16's rounding.
"""

import math

import pytest
import torch

import adaattn.attention.rank as rank_mod
from adaattn.kernels.nystrom import (
    MAX_FUSED_SOLVE_RANK,
    MAX_HEAD_DIM,
    MAX_RANK,
    _block,
    fused_solve,
)
from adaattn.kernels.pinv import pinv as _pinv
from adaattn.kernels.pooled import _pooled_plan
from adaattn.attention.rank import (
    _segment_means,
    nystrom_attention,
    nystrom_path,
    pooled_attention,
    pooled_path,
)
from adaattn.kernels import set_use_triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # relative L2 vs the torch path


def _qkv(B, Hq, Hkv, L, S, D, dtype, strided=False):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(B, L, Hq, D, generator=g, device=DEVICE).to(dtype).transpose(1, 2)  # (B, H, L, D) view
    q = q if strided else q.contiguous()
    k, v = (torch.randn(B, Hkv, S, D, generator=g, device=DEVICE).to(dtype) for _ in range(2))
    return q, k, v


def _torch_path(monkeypatch_ctx, *args, **kw):
    with monkeypatch_ctx.context() as m:
        m.setattr(rank_mod, "use_triton", lambda *t: False)
        assert nystrom_path(*args[:3], args[3]).startswith("torch")
        return nystrom_attention(*args, **kw)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [
    (1, 2, 2, 64, 64, 16, 8),     # r | S, one head each
    (2, 4, 2, 100, 130, 24, 12),  # GQA 2:1, uneven segments, L != S, head dim not a power of two
    (1, 4, 1, 96, 200, 64, 33),   # GQA 4:1 (MQA), odd rank
    (1, 2, 2, 80, 300, 40, 80),   # landmarks = all query rows
], ids=["plain", "gqa-uneven", "mqa-odd-rank", "r-equals-L"])
def test_fused_matches_the_torch_path(shape, dtype):
    B, Hq, Hkv, L, S, D, r = shape
    q, k, v = _qkv(B, Hq, Hkv, L, S, D, dtype, strided=True)
    assert nystrom_path(q, k, v, r) == "triton"
    out = nystrom_attention(q, k, v, r)
    ref = _torch_path(pytest.MonkeyPatch(), q, k, v, r)
    assert out.shape == ref.shape == (B, Hq, L, D) and out.dtype == dtype
    assert _rel(out, ref) < RTOL[dtype]


def test_fused_rows_and_max_rank():
    q, k, v = _qkv(1, 2, 1, MAX_RANK + 8, 2 * MAX_RANK, 32, torch.float32)
    rows = torch.tensor([0, 7, MAX_RANK + 7], device=DEVICE)
    out = nystrom_attention(q, k, v, MAX_RANK, rows=rows)
    full = nystrom_attention(q, k, v, MAX_RANK)
    assert out.shape == (1, 2, 3, 32)
    torch.testing.assert_close(out, full[:, :, rows], atol=1e-6, rtol=1e-5)
    assert _rel(full, _torch_path(pytest.MonkeyPatch(), q, k, v, MAX_RANK)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [
    (1, 4, 2, 200, 330, 24, MAX_FUSED_SOLVE_RANK + 40),  # GQA 2:1, uneven segments, 2 output blocks of landmarks
    (1, 2, 1, 160, 256, 128, 128),  # head dim 128: past the fused solve's tile limit
], ids=["rank-past-fused-solve", "rank128-d128"])
def test_batched_solve_matches_the_torch_path(shape, dtype):
    B, Hq, Hkv, L, S, D, r = shape
    q, k, v = _qkv(B, Hq, Hkv, L, S, D, dtype)
    assert nystrom_path(q, k, v, r) == "triton" and not fused_solve(r, D)
    out = nystrom_attention(q, k, v, r)
    ref = _torch_path(pytest.MonkeyPatch(), q, k, v, r)
    assert out.shape == ref.shape == (B, Hq, L, D) and out.dtype == dtype
    assert _rel(out, ref) < RTOL[dtype]


def test_fused_equals_float64_nystrom_on_its_own_landmarks():
    """Every fp32 step of the fused path (tf32x3 products) against the same maths in float64."""
    q, k, v = _qkv(1, 2, 2, 96, 160, 32, torch.float32)
    r, sc = 20, 1 / math.sqrt(32)
    qd, kd, vd = (t.double() for t in (q, k, v))
    ql, kl = _segment_means(qd, r).double(), _segment_means(kd, r).double()
    sm = lambda x: torch.softmax(x * sc, -1)  # noqa: E731
    ref = sm(qd @ kl.mT) @ (_pinv(sm(ql @ kl.mT), 6) @ (sm(ql @ kd.mT) @ vd))
    assert _rel(nystrom_attention(q, k, v, r), ref) < 1e-5


def test_path_choice_and_reasons():
    q, k, v = _qkv(1, 2, 2, 64, 64, 16, torch.float32)
    assert nystrom_path(q, k, v, 8) == "triton"
    assert "autograd" in nystrom_path(q.requires_grad_(), k, v, 8)
    with torch.no_grad():
        assert nystrom_path(q, k, v, 8) == "triton"
    q = q.detach()
    wide = torch.randn(1, 1, 2 * MAX_RANK, 16, device=DEVICE)
    assert f"rank {MAX_RANK + 1} > {MAX_RANK}" in nystrom_path(wide, wide, wide, MAX_RANK + 1)
    assert nystrom_path(wide, wide, wide, MAX_RANK + 1).startswith("torch")
    assert nystrom_path(wide, wide, wide, MAX_RANK) == "triton"
    big_d = torch.randn(1, 1, 32, MAX_HEAD_DIM + 8, device=DEVICE)
    assert f"head dim {MAX_HEAD_DIM + 8}" in nystrom_path(big_d, big_d, big_d, 4)
    # the r x r solve: fused up to its rank and tile limits, batched matmuls past them
    assert fused_solve(MAX_FUSED_SOLVE_RANK, 64) and not fused_solve(MAX_FUSED_SOLVE_RANK + 1, 64)
    assert fused_solve(64, 128) and not fused_solve(128, 128)
    set_use_triton_kernels(False)
    try:
        assert "set_use_triton_kernels(False)" in nystrom_path(q, k, v, 8)
    finally:
        set_use_triton_kernels(True)


def test_backward_runs_the_differentiable_path():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 64, 64, 16, torch.float32))
    nystrom_attention(q, k, v, 8).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D,r", [(torch.bfloat16, 64, 16), (torch.bfloat16, 64, 64), (torch.bfloat16, 64, 128),
                                       (torch.bfloat16, 128, 64), (torch.float16, 128, 32), (torch.float32, 128, 64),
                                       (torch.float32, 64, 16), (torch.bfloat16, 64, 512), (torch.bfloat16, 128, 128)])
def test_fused_long_sequence_on_cuda(dtype, D, r):
    """S = 8192, GQA 4:1: the fused path within its output dtype's rounding of float64 Nyström on
    the same landmarks (every launch configuration of the fixed table compiles and runs)."""
    q, k, v = _qkv(1, 8, 2, 8192, 8192, D, dtype)
    sc = 1 / math.sqrt(D)
    qd, kd, vd = (t.double() for t in (q, k, v))
    ql = _segment_means(q, r).double()
    kl = _segment_means(k, r).to(k.dtype).double().repeat_interleave(4, 1)
    kd, vd = kd.repeat_interleave(4, 1), vd.repeat_interleave(4, 1)
    sm = lambda x: torch.softmax(x * sc, -1)  # noqa: E731
    ref = sm(qd @ kl.mT) @ (_pinv(sm(ql @ kl.mT), 6) @ (sm(ql @ kd.mT) @ vd))
    out = nystrom_attention(q, k, v, r)
    assert nystrom_path(q, k, v, r) == "triton"
    rounding = _rel(ref.to(dtype), ref)
    assert _rel(out, ref) < 2 * rounding + (1e-5 if dtype == torch.float32 else 1e-3)


def test_launch_plan_integer_helpers_match_triton():
    """The cached launch plan uses plain-int helpers in place of triton's constexpr functions (host
    time): they agree with triton's on every size up to 4096."""
    import triton

    from adaattn.kernels.nystrom import _block, _cdiv

    assert all(_block(n) == max(16, triton.next_power_of_2(n)) for n in range(1, 4097))
    assert all(_cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 600) for b in (1, 7, 16, 64, 128))


@pytest.mark.gpu
def test_repeat_calls_launch_the_recorded_kernels_and_equal_launcher_calls():
    """Calls of a kind seen before launch the compiled kernels ``RecordedLaunches`` recorded: bit-equal to
    calls through ``Launcher``, over the layouts, alignments, dtypes and paths whose
    specialisation differs (a view at an odd element offset, sequence-first strides, query rows,
    the batched solve)."""
    import adaattn.kernels.recorded as recorded
    from adaattn.kernels.runtime import set_direct_launch

    base = torch.randn(1, 4, 777 * 32 + 1, device="cuda", dtype=torch.bfloat16)
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = _qkv(1, 4, 2, 777, 777, 32, dtype, strided=True)
        cases += [(q, k, v, 16, None), (q, k, v, 200, None), (q, k, v, 16, torch.tensor([0, 5, 776], device="cuda"))]
    odd = base[:, :, 1:].view(1, 4, 777, 32)  # 2-byte offset: not 16-byte aligned
    cases.append((odd, odd[:, :2], odd[:, 2:], 16, None))
    recorded.BOUND.clear()
    for q, k, v, r, rows in cases:
        first = nystrom_attention(q, k, v, r, rows=rows)  # through Launcher, recorded
        again = nystrom_attention(q, k, v, r, rows=rows)  # the recorded kernels
        set_direct_launch(False)
        try:
            triton_launch = nystrom_attention(q, k, v, r, rows=rows)  # Triton's own launch
        finally:
            set_direct_launch(True)
        assert torch.equal(first, again) and torch.equal(first, triton_launch)
    assert len(recorded.BOUND) == len(cases)  # every kind recorded once, the odd offset its own


def test_batched_solve_is_not_graphed_off_cuda():
    """In the interpreter and on a CPU the batched solve runs launch by launch on a fresh workspace."""
    import adaattn.kernels.nystrom_solve as nt

    assert nt._SolveGraph.get((1, 2, 2, 200, 24, 0.2, 6), 1000, torch.device("cpu"), lambda ws: None) is None
    q, k, v = _qkv(1, 2, 2, 64, 300, 24, torch.float32)
    nystrom_attention(q, k, v, MAX_FUSED_SOLVE_RANK + 8)
    if DEVICE == "cpu":
        assert not nt._SOLVE_GRAPHS


@pytest.mark.gpu
def test_graphed_batched_solve_equals_launch_by_launch(monkeypatch):
    """The batched solve replayed from its CUDA graph gives the bits of the same solve launched op by
    op, call after call with new inputs in the persistent workspace, GQA and query rows too; another
    stream gets its own graph; the cache keeps ``MAX_SOLVE_GRAPHS`` (least recently used out); a
    caller capturing its own graph gets the launches in it, not a graph of ours."""
    import adaattn.kernels.nystrom as nystrom
    import adaattn.kernels.nystrom_solve as nt

    nt._SOLVE_GRAPHS.clear()
    r = MAX_FUSED_SOLVE_RANK + 72
    calls = []
    for seed in range(3):
        torch.manual_seed(seed)
        q, k, v = _qkv(1, 8, 2, 1000, 1000, 64, torch.bfloat16)
        q, k, v = q * (1 + seed), k * (1 - 0.2 * seed), v + seed
        calls.append((q, k, v, None))
    calls.append((q, k, v, torch.tensor([3, 500, 999], device="cuda")))  # rows change only the output pass
    calls.append((*_qkv(1, 8, 2, 300, 300, 64, torch.bfloat16), None))  # the same heads and rank, more key splits
    graphed = [nystrom_attention(q, k, v, r, rows=rows) for q, k, v, rows in calls]
    assert len(nt._SOLVE_GRAPHS) == 2
    assert len({nystrom._plan(1, 8, 2, S, 64, r, torch.device("cuda", 0)).splits for S in (1000, 300)}) == 2
    monkeypatch.setattr(nt, "GRAPH_SOLVE", False)
    eager = [nystrom_attention(q, k, v, r, rows=rows) for q, k, v, rows in calls]
    monkeypatch.setattr(nt, "GRAPH_SOLVE", True)
    assert all(torch.equal(a, b) for a, b in zip(graphed, eager))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = nystrom_attention(*calls[0][:3], r)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, eager[0]) and len(nt._SOLVE_GRAPHS) == 3

    nt._SOLVE_GRAPHS.clear()
    nystrom_attention(*calls[0][:3], r)
    with torch.cuda.stream(side):
        nystrom_attention(*calls[0][:3], r)
    torch.cuda.synchronize()
    monkeypatch.setattr(nt, "MAX_SOLVE_GRAPHS", 2)
    q, k, v = calls[0][:3]
    nystrom_attention(q, k, v, r + 8)  # a third kind: the least recently used goes
    main = torch.cuda.current_stream().cuda_stream
    assert sorted((key[3], key[-3] == main) for key in nt._SOLVE_GRAPHS) == [(r, False), (r + 8, True)]

    nt._SOLVE_GRAPHS.clear()
    outer = torch.cuda.CUDAGraph()
    nystrom_attention(q, k, v, r)  # warm-up: compiles, records the launches
    nt._SOLVE_GRAPHS.clear()
    with torch.cuda.graph(outer):
        captured = nystrom_attention(q, k, v, r)
    assert not nt._SOLVE_GRAPHS
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager[0])


@pytest.mark.gpu
def test_graphed_batched_solve_from_threads_on_one_stream():
    """Threads on one stream share a graphed solve's workspace: each call issues its launches as one
    (``_SOLVE_LOCK``), so every thread's result equals its call made alone."""
    import threading

    r = MAX_FUSED_SOLVE_RANK + 72
    inputs = []
    for seed in range(4):
        torch.manual_seed(seed)
        q, k, v = _qkv(1, 8, 2, 1000, 1000, 64, torch.bfloat16)
        inputs.append((q * (1 + seed), k, v + seed))
    alone = [nystrom_attention(q, k, v, r) for q, k, v in inputs]
    results: dict[int, list] = {i: [] for i in range(len(inputs))}

    def work(i):
        for _ in range(20):
            results[i].append(nystrom_attention(*inputs[i], r))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert all(torch.equal(out, alone[i]) for i, outs in results.items() for out in outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [
    (1, 2, 2, 64, 64, 16, 8),      # one head each
    (2, 4, 2, 100, 132, 24, 12),   # GQA 2:1, L != S, head dim not a power of two
    (1, 4, 1, 96, 198, 64, 33),    # GQA 4:1 (MQA), odd rank
    (1, 2, 2, 80, 512, 32, 256),   # landmarks in blocks of the output pass (online softmax)
    (1, 4, 2, 70, 320, 80, 64),    # GQA, head dim padded to 128: landmarks in blocks too
], ids=["plain", "gqa", "mqa-odd-rank", "landmark-blocks", "wide-head-blocks"])
def test_fused_pooled_matches_the_torch_path(shape, dtype):
    B, Hq, Hkv, L, S, D, r = shape
    q, k, v = _qkv(B, Hq, Hkv, L, S, D, dtype, strided=True)
    assert pooled_path(q, k, v, r) == "triton"
    out = pooled_attention(q, k, v, r)
    rows = torch.tensor([0, 3, L - 1], device=DEVICE)
    with pytest.MonkeyPatch().context() as m:
        m.setattr(rank_mod, "use_triton", lambda *t: False)
        assert pooled_path(q, k, v, r).startswith("torch")
        ref = pooled_attention(q, k, v, r)
    assert out.shape == ref.shape == (B, Hq, L, D) and out.dtype == dtype
    assert _rel(out, ref) < RTOL[dtype]
    # On a GPU a row's output does not depend on which other rows its program computes: bit-equal. The
    # interpreter's fp32 tile products go through numpy's matmul, whose summation order may change with the
    # tile's row count (a few ulp apart on some x86 CPUs), so there fp32 is held to a few ulp
    tol = {"atol": 0, "rtol": 0} if DEVICE == "cuda" or dtype != torch.float32 else {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(pooled_attention(q, k, v, r, rows=rows), out[:, :, rows], **tol)


@pytest.mark.parametrize("D", [16, 24, 64, 80, 128])
@pytest.mark.parametrize("rank", [1, 7, 16, 33, 64, 65, 128, 256, MAX_RANK])
def test_pooled_plan_covers_every_landmark(D, rank):
    S = 16 * MAX_RANK
    p = _pooled_plan(S, D, rank)
    assert p.block_d >= D and p.block_m >= 16
    # a mean's step: a power of two of rows, no wider than the segment (past 16 rows), at most 32768 elements
    assert p.mean_rows >= 16 and p.mean_rows & (p.mean_rows - 1) == 0 and p.mean_rows * p.block_d <= 32768
    assert p.mean_rows <= max(16, _block(-(-S // rank))) and 2 <= p.mean_warps <= 16
    if p.one_block:  # every landmark in the one block
        assert p.block_r >= rank
    else:  # whole blocks of the padded rank, more than one
        assert _block(rank) % p.block_r == 0 and p.block_r < _block(rank)
    assert p.one_block == (rank <= (64 if D <= 64 else 32))  # the rule the sweep chose (kernels.nystrom)


def test_fused_pooled_equals_float64_on_its_own_means():
    q, k, v = _qkv(1, 2, 2, 96, 160, 32, torch.float32)
    r, sc = 20, 1 / math.sqrt(32)
    kl, vl = (_segment_means(t.double(), r, torch.float64) for t in (k, v))
    ref = torch.softmax(q.double() @ kl.mT * sc, -1) @ vl
    assert pooled_path(q, k, v, r) == "triton" and _rel(pooled_attention(q, k, v, r), ref) < 1e-5


def test_pooled_path_choice_and_reasons():
    q, k, v = _qkv(1, 2, 2, 64, 64, 16, torch.float32)
    assert pooled_path(q, k, v, 8) == "triton"
    assert "not a multiple of rank 7" in pooled_path(q, k, v, 7)  # segments of unequal size: a bias
    assert "autograd" in pooled_path(q.requires_grad_(), k, v, 8)
    q = q.detach()
    assert "float64" in pooled_path(q.double(), k.double(), v.double(), 8)
    assert "float16" in pooled_path(q, k.half(), v.half(), 8)  # mixed dtypes
    wide = torch.randn(1, 1, 2 * MAX_RANK + 2, 16, device=DEVICE)
    assert f"rank {MAX_RANK + 1} > {MAX_RANK}" in pooled_path(wide, wide, wide, MAX_RANK + 1)
