"""Triton kernels against their fp32 references: forward, backward, odd and strided shapes, GQA,
torch.compile(fullgraph=True), the on/off switches.

On a CPU machine these run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py).
"""

import importlib

import pytest
import torch

from adaattn import kernels as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same inputs whatever ran before it in its process (pytest-xdist deals tests out)."""
    torch.manual_seed(0)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (atol, rtol) for outputs and input gradients vs the fp32 reference, by dtype
TOL = {"fp32": (1e-5, 1e-5), "fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}


def _randn(*shape, dtype=torch.float32, strided=False):
    if strided:  # a slice of a wider buffer: larger strides, last dim contiguous
        return torch.randn(*shape[:-1], shape[-1] + 37, device=DEVICE, dtype=dtype)[..., : shape[-1]]
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def _run(fn, inputs, grads_out=None, seed=1):
    """Outputs and input gradients of fn(*inputs) for output gradients drawn from ``seed``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if grads_out is None:
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        grads_out = [torch.randn(o.shape, generator=g, device=DEVICE, dtype=o.dtype) for o in outs]
    torch.autograd.backward(outs, grads_out)
    return outs, [t.grad for t in leaves], grads_out


def _compare(fn, ref, inputs, dtype, n_weights=0, rows=1):
    """fn in ``dtype`` vs ref on the same values in fp32; the last n_weights inputs are weights
    (gradients summed over ``rows``: compared relative to their scale)."""
    outs, grads, g_out = _run(fn, inputs)
    ref_outs, ref_grads, _ = _run(ref, [t.float() for t in inputs], [g.float() for g in g_out])
    atol, rtol = TOL[dtype]
    for o, r in zip(outs, ref_outs, strict=True):
        assert o.dtype == DTYPES[dtype] and o.shape == r.shape
        torch.testing.assert_close(o.float(), r, atol=atol, rtol=rtol)
    n_act = len(inputs) - n_weights
    for g, r in zip(grads[:n_act], ref_grads[:n_act], strict=True):
        torch.testing.assert_close(g.float(), r, atol=atol, rtol=rtol)
    for g, r in zip(grads[n_act:], ref_grads[n_act:], strict=True):
        assert g.dtype == DTYPES[dtype]
        assert (g.float() - r).abs().max() <= rtol * r.abs().max() + atol * rows**0.5


def test_kernels_are_on_here():
    status = K.get_kernel_status()
    assert status["use_triton_kernels"], status["reason"]  # else every test below checks the reference


# rows 1 / 199 / 1023; hidden 96 and 770 (not powers of two, 770 not a multiple of 16); strided rows
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows,hidden", [(1, 96), (199, 770), (1023, 96)])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm(dtype, rows, hidden, strided):
    x = _randn(rows, hidden, dtype=DTYPES[dtype], strided=strided)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(DTYPES[dtype])
    _compare(K.rms_norm, K.rms_norm_ref, [x, w], dtype, n_weights=1, rows=rows)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows,hidden", [(1, 96), (199, 770), (1023, 96)])
@pytest.mark.parametrize("fused", [False, True])
def test_swiglu(dtype, rows, hidden, fused):
    if fused:  # the two halves of one gate/up projection: row stride 2 * hidden, no copy
        h = _randn(rows, 2 * hidden, dtype=DTYPES[dtype])
        a, b = h.split(hidden, dim=-1)
        assert a.stride(0) == 2 * hidden
    else:
        a, b = _randn(rows, hidden, dtype=DTYPES[dtype]), _randn(rows, hidden, dtype=DTYPES[dtype])
    _compare(K.swiglu, K.swiglu_ref, [a, b], dtype)


# (B, S, Hq, Hkv, D): MHA, GQA 4:1 and 3:1 (non-power-of-two head counts), odd S, head dims 64 / 96 / 2
ROPE_SHAPES = [(1, 1, 4, 4, 64), (2, 199, 8, 2, 64), (1, 33, 12, 4, 96), (3, 5, 3, 1, 2)]


def _qk(B, S, Hq, Hkv, D, dtype, layout):
    if layout == "bhsd":  # a (B, H, S, D) tensor passed as its (B, S, H, D) view
        return (torch.randn(B, Hq, S, D, device=DEVICE, dtype=dtype).transpose(1, 2),
                torch.randn(B, Hkv, S, D, device=DEVICE, dtype=dtype).transpose(1, 2))
    if layout == "fused_qkv":  # slices of one qkv projection
        qkv = torch.randn(B, S, (Hq + 2 * Hkv) * D, device=DEVICE, dtype=dtype)
        q = qkv[..., : Hq * D].unflatten(-1, (Hq, D))
        k = qkv[..., Hq * D: (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
        return q, k
    return (torch.randn(B, S, Hq, D, device=DEVICE, dtype=dtype), torch.randn(B, S, Hkv, D, device=DEVICE, dtype=dtype))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "fused_qkv"])
def test_rope(dtype, shape, layout):
    B, S, Hq, Hkv, D = shape
    q, k = _qk(B, S, Hq, Hkv, D, DTYPES[dtype], layout)
    cos, sin = K.rope_cache(S + 7, D, device=DEVICE)  # a cache longer than the sequence
    _compare(lambda q, k: K.apply_rope(q, k, cos, sin), lambda q, k: K.rope_ref(q, k, cos[:S], sin[:S]), [q, k], dtype)


@pytest.mark.parametrize("triton_on", [True, False])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "fused_qkv"])
def test_rope_in_place(triton_on, layout):
    """inplace=True rotates q and k where they lie (any layout with a contiguous head dim), returns
    them, equals the out-of-place result, bumps their version counters, and trains through autograd
    on non-leaf inputs with the same gradients; the Triton path and the reference path alike."""
    B, S, Hq, Hkv, D = 2, 7, 6, 2, 16
    q, k = _qk(B, S, Hq, Hkv, D, torch.float32, layout)
    cos, sin = K.rope_cache(S + 3, D, device=DEVICE)
    from adaattn.kernels import runtime

    was = runtime._use_triton
    K.set_use_triton_kernels(triton_on)
    try:
        want = K.apply_rope(q, k, cos, sin)
        qi, ki = q.clone(), k.clone()
        if layout == "fused_qkv":  # slices of one buffer, as _qk gives: rotate those very views
            qi, ki = q, k
        versions = (qi._version, ki._version)
        got = K.apply_rope(qi, ki, cos, sin, inplace=True)
        assert got[0] is qi and got[1] is ki
        assert qi._version > versions[0] and ki._version > versions[1]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        # autograd: in place on non-leaf inputs, gradients equal the out-of-place path's
        leaves = [t.detach().clone().requires_grad_() for t in (q, k)]
        out = K.apply_rope(leaves[0] * 1, leaves[1] * 1, cos, sin, inplace=True)
        g = [torch.randn_like(o) for o in out]
        torch.autograd.backward(out, g)
        ref = [t.detach().clone().requires_grad_() for t in (q, k)]
        torch.autograd.backward(K.apply_rope(*ref, cos, sin), g)
        for a, b in zip(leaves, ref, strict=True):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)
        # a leaf that requires grad: refused, nothing rotated
        leaf = q.detach().clone().requires_grad_()
        before = leaf.detach().clone()
        with pytest.raises(RuntimeError, match="leaf"):
            K.apply_rope(leaf, k.clone(), cos, sin, inplace=True)
        assert torch.equal(leaf.detach(), before)
        # a non-leaf q beside a leaf k: refused before q is written, on either path
        q_nonleaf = q.detach().clone().requires_grad_() * 1
        before = q_nonleaf.detach().clone()
        with pytest.raises(RuntimeError, match="k is a leaf"):
            K.apply_rope(q_nonleaf, k.detach().clone().requires_grad_(), cos, sin, inplace=True)
        assert torch.equal(q_nonleaf.detach(), before)
    finally:
        K.set_use_triton_kernels(was)


def test_rope_in_place_is_tuned_apart():
    """In place and out of place are separate tuning keys (their fastest configs differ)."""

    if not K.get_kernel_status()["use_triton_kernels"]:
        pytest.skip("the Triton kernels are off here")
    rope = importlib.import_module("adaattn.kernels.rope")
    q, k = _randn(1, 5, 3, 12), _randn(1, 5, 1, 12)  # a head shape no other test uses
    cos, sin = K.rope_cache(5, 12, device=DEVICE)
    K.apply_rope(q, k, cos, sin)
    K.apply_rope(q.clone(), k.clone(), cos, sin, inplace=True)
    base = (3, 1, 6, q.dtype, k.dtype, cos.dtype)
    assert (*base, False) in rope._rope.chosen and (*base, True) in rope._rope.chosen


def test_rope_in_place_rejects_bad_input():
    q, k = _randn(1, 4, 2, 8), _randn(1, 4, 2, 8)
    cos, sin = K.rope_cache(4, 8, device=DEVICE)
    with pytest.raises(TypeError, match="True or False"):
        K.apply_rope(q, k, cos, sin, inplace=1)
    strided = torch.randn(1, 4, 2, 16, device=DEVICE)[..., ::2]  # head dim not contiguous
    if K.get_kernel_status()["use_triton_kernels"]:
        with pytest.raises(ValueError, match="contiguous head dim"):
            K.apply_rope(strided, k, cos, sin, inplace=True)


def test_rope_in_place_compiles_fullgraph():
    """Under torch.compile the rotation is the custom op, copied into q and k."""
    S, D = 5, 16
    cos, sin = K.rope_cache(S, D, device=DEVICE)
    q, k = _randn(2, S, 4, D), _randn(2, S, 2, D)

    def fn(q, k):
        q, k = q * 2, k * 2
        return K.apply_rope(q, k, cos, sin, inplace=True)

    ops, outs = _ops_in_graph(fn, q, k)
    assert any("adaattn.rope" in o for o in ops), ops
    for got, want in zip(outs, K.apply_rope(q * 2, k * 2, cos, sin), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("layout", ["bshd", "fused_qkv"])
def test_qk_norm_rope(dtype, shape, layout):
    B, S, Hq, Hkv, D = shape
    q, k = _qk(B, S, Hq, Hkv, D, DTYPES[dtype], layout)
    wq, wk = ((1 + 0.1 * torch.randn(D, device=DEVICE)).to(DTYPES[dtype]) for _ in range(2))
    cos, sin = K.rope_cache(S, D, device=DEVICE)
    _compare(lambda q, k, wq, wk: K.qk_norm_rope(q, k, wq, wk, cos, sin),
             lambda q, k, wq, wk: K.qk_norm_rope_ref(q, k, wq, wk, cos, sin), [q, k, wq, wk], dtype,
             n_weights=2, rows=B * S * Hq)


def test_bf16_weight_gradient_is_summed_in_fp32():
    """Summing 4096 bf16 terms in bf16 loses ~2 digits; the kernels' fp32 partials do not."""
    x = _randn(4096, 64, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, device=DEVICE)).to(torch.bfloat16)
    _, (_, dw), g = _run(K.rms_norm, [x, w])
    _, (_, dw_ref), _ = _run(K.rms_norm_ref, [x.double(), w.double()], [t.double() for t in g])
    assert ((dw.double() - dw_ref).norm() / dw_ref.norm()).item() < 8e-3  # one bf16 rounding + fp32 noise


def test_batched_rms_norm_keeps_shape():
    x, w = _randn(2, 3, 5, 40), _randn(40)
    y = K.rms_norm(x, w)
    assert y.shape == x.shape
    torch.testing.assert_close(y, K.rms_norm_ref(x, w), atol=1e-5, rtol=1e-5)


def test_contiguous_rows_with_a_stray_size_one_stride():
    """A size-1 dim's stride is free in a contiguous tensor: rows must be walked N apart regardless."""
    base = _randn(4 * 40)
    x = base.as_strided((4, 1, 40), (40, 7, 1))
    a, b = base.as_strided((4, 1, 40), (40, 3, 1)), _randn(4, 1, 40)
    assert x.is_contiguous() and x.stride(1) != 40
    w = _randn(40)
    torch.testing.assert_close(K.rms_norm(x, w), K.rms_norm_ref(x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(K.swiglu(a, b), K.swiglu_ref(a, b), atol=1e-5, rtol=1e-5)


def test_compile_fullgraph_uses_the_custom_ops():
    S, D = 9, 64
    cos, sin = K.rope_cache(S, D, device=DEVICE)
    x, w = _randn(2, S, 96), _randn(96)
    q, k = _randn(2, S, 4, D), _randn(2, S, 2, D)
    wq, wk = _randn(D), _randn(D)

    def block(x, w, q, k, wq, wk):
        y = K.swiglu(K.rms_norm(x, w), x)
        q1, k1 = K.apply_rope(q, k, cos, sin)
        q2, k2 = K.qk_norm_rope(q, k, wq, wk, cos, sin)
        return y, q1, k1, q2, k2

    ops, outs = _ops_in_graph(block, x, w, q, k, wq, wk)
    for op in ("adaattn.rms_norm_fwd", "adaattn.swiglu_fwd", "adaattn.rope", "adaattn.qk_norm_rope_fwd"):
        assert any(op in o for o in ops), (op, ops)
    for got, want in zip(outs, block(x, w, q, k, wq, wk), strict=True):
        torch.testing.assert_close(got, want)
    # and the backward through the compiled graph
    leaves = [t.clone().requires_grad_() for t in (x, w, q, k, wq, wk)]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    sum(o.float().sum() for o in compiled(*leaves)).backward()
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, q, k, wq, wk)]
    sum(o.float().sum() for o in block(*ref_leaves)).backward()
    for a, b in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_switches(monkeypatch):
    calls = []
    x, w = _randn(3, 16), _randn(16)
    monkeypatch.setattr(K, "rms_norm_ref", lambda *a: calls.append("ref") or torch.zeros(3, 16))
    K.set_use_triton_kernels(False)
    try:
        status = K.get_kernel_status()
        assert not status["use_triton_kernels"] and "set_use_triton_kernels(False)" in status["reason"]
        K.rms_norm(x, w)
        assert calls == ["ref"]
    finally:
        K.set_use_triton_kernels(True)
    assert K.get_kernel_status()["use_triton_kernels"]
    K.rms_norm(x, w)
    assert calls == ["ref"]  # the kernel ran, not the reference
    monkeypatch.setenv(K.ENV_DISABLE, "1")
    status = K.get_kernel_status()
    assert not status["use_triton_kernels"] and K.ENV_DISABLE in status["reason"]
    K.rms_norm(x, w)
    assert calls == ["ref", "ref"]
    with pytest.raises(TypeError, match="True or False"):
        K.set_use_triton_kernels("yes")


def test_a_compiled_graph_follows_the_switch():
    """Flipping set_use_triton_kernels recompiles a compiled function (a guard), and each setting keeps its graph:
    the MFU study times a model with our kernels and without them side by side in one process."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    graphs: list[bool] = []  # whether each compiled graph holds our custom op
    fn = torch.compile(lambda x, w: K.rms_norm(x, w) * 2, backend=counter, fullgraph=True)
    x, w = _randn(3, 16), _randn(16)
    try:
        for on in (True, False, True, False):
            K.set_use_triton_kernels(on)
            torch.testing.assert_close(fn(x, w), K.rms_norm_ref(x, w) * 2, atol=1e-5, rtol=1e-5)
            graphs = [any("adaattn" in str(n.target) for n in g.graph.nodes) for g in counter.graphs]
    finally:
        K.set_use_triton_kernels(True)
        torch._dynamo.reset()
    assert counter.frame_count == 2 and graphs == [True, False]  # one graph per setting, each reused


def test_without_interpreter_or_cuda_the_references_run(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernels run")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    status = K.get_kernel_status()
    assert not status["use_triton_kernels"] and "no CUDA device" in status["reason"]
    x, w = _randn(3, 16), _randn(16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.testing.assert_close(K.rms_norm(x, w), K.rms_norm_ref(x, w))
    assert not any("adaattn" in e.name for e in prof.events())  # no custom op: the reference ran


def test_bad_inputs_are_rejected():
    """At the public functions, whichever path runs: the argument's name and the expected shape or dtype."""
    x = _randn(4, 8)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16; got torch.int64"):
        K.rms_norm(x.long(), torch.ones(8, device=DEVICE))
    for eps in (-1e-6, 0.0, float("nan"), float("inf"), "1e-6", True):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            K.rms_norm(x, torch.ones(8, device=DEVICE), eps)
    with pytest.raises(ValueError, match=r"weight must be \(hidden,\) = \(8,\) for x of shape \(4, 8\); got \(8, 1\)"):
        K.rms_norm(x, torch.ones(8, 1, device=DEVICE))
    with pytest.raises(ValueError, match="swiglu needs a and b of one shape, dtype and device"):
        K.swiglu(x, x.int())
    cos16, sin16 = K.rope_cache(16, 8, device=DEVICE)
    sdpa_layout = _randn(1, 2, 16, 8)  # (B, H, S, D): 2 heads of 16 tokens
    with pytest.raises(ValueError, match=r"SDPA's \(B, H, S, D\) layout; apply_rope takes \(B, S, H, D\)"):
        K.apply_rope(sdpa_layout, sdpa_layout.clone(), cos16, sin16)
    K.apply_rope(sdpa_layout.transpose(1, 2), sdpa_layout.transpose(1, 2), cos16, sin16)  # as it says: fine
    with pytest.raises(ValueError, match=r"q's heads \(3\) must be a multiple of k's \(2\)"):
        K.apply_rope(_randn(1, 4, 3, 8), _randn(1, 4, 2, 8), cos16, sin16)
    with pytest.raises(ValueError, match=r"q_weight must be \(8,\)"):
        K.qk_norm_rope(_randn(1, 4, 2, 8), _randn(1, 4, 2, 8), torch.ones(4, device=DEVICE), torch.ones(8, device=DEVICE),
                       cos16, sin16)
    with pytest.raises(ValueError, match="weight must be"):
        K.rms_norm(x, torch.ones(7, device=DEVICE))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        K.rms_norm(x.double(), torch.ones(8, device=DEVICE, dtype=torch.float64))  # float64: the *_ref functions
    with pytest.raises(ValueError, match="one shape"):
        K.swiglu(x, _randn(4, 9))
    cos, sin = K.rope_cache(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"\(>= S, D/2\)"):
        K.apply_rope(_randn(1, 5, 2, 8), _randn(1, 5, 1, 8), cos, sin)  # cache shorter than S
    with pytest.raises(ValueError, match="even"):
        K.rope_cache(4, 7)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "fused_qkv", "bhds"])
def test_custom_ops_fake_kernels_match_the_real_ones(layout):
    """opcheck: each op's fake kernel gives the real one's shapes, dtypes and strides, whatever layout the
    inputs have (inductor plans buffers from the fake: a mismatch fails at run time as an assert on strides)."""
    B, S, Hq, Hkv, D = 2, 5, 4, 2, 8
    if layout == "bhds":  # the head dim not contiguous: a (B, H, D, S) tensor seen as (B, S, H, D)
        q = torch.randn(B, Hq, D, S, device=DEVICE).permute(0, 3, 1, 2)
        k = torch.randn(B, Hkv, D, S, device=DEVICE).permute(0, 3, 1, 2)
    else:
        q, k = _qk(B, S, Hq, Hkv, D, torch.float32, layout)
    cos, sin = K.rope_cache(S, D, device=DEVICE)
    wq, wk = _randn(D), _randn(D)
    rope = importlib.import_module("adaattn.kernels.rope")
    torch.library.opcheck(rope.rope_op, (q, k, cos, sin, False))
    qo, ko, rq, rk = rope.qk_norm_rope_fwd_op(q, k, wq, wk, cos, sin, 1e-6)
    torch.library.opcheck(rope.qk_norm_rope_fwd_op, (q, k, wq, wk, cos, sin, 1e-6))
    torch.library.opcheck(rope.qk_norm_rope_bwd_op, (torch.randn_like(qo), torch.randn_like(ko), q, k, wq, wk, rq, rk,
                                                     cos, sin))
    x = q.flatten(-2)  # (B, S, Hq D), contiguous or not as q is
    rms_norm, swiglu = (importlib.import_module(f"adaattn.kernels.{m}") for m in ("rms_norm", "swiglu"))
    y, rstd = rms_norm.rms_norm_fwd_op(x, _randn(Hq * D), 1e-6)
    torch.library.opcheck(rms_norm.rms_norm_fwd_op, (x, _randn(Hq * D), 1e-6))
    torch.library.opcheck(rms_norm.rms_norm_bwd_op, (torch.randn_like(y), x, _randn(Hq * D), rstd))
    torch.library.opcheck(swiglu.swiglu_fwd_op, (x, torch.randn_like(x)))
    torch.library.opcheck(swiglu.swiglu_bwd_op, (torch.randn_like(x), x, torch.randn_like(x)))


def _ops_in_graph(fn, *args):
    """Compile fn with fullgraph=True; return the op names of its captured graph and the output."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return seen, out
