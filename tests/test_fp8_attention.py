"""The FP8 attention forward (kernels/fp8_attention.py), interpreted on the CPU: its quantization pass against
PyTorch's e4m3 casts, the attention against the same quantization emulated in float64 and against exact
attention, K's smoothing shown to matter, causal, GQA, ragged lengths, strided inputs; bad input named. The
interpreter runs the products on the FP8 values cast to fp32: the algorithm is checked here, the tensor cores
on a GPU."""

from __future__ import annotations

import pytest
import torch

from adaattn.kernels import get_kernel_status
from adaattn.kernels.fp8_attention import (E4M3_MAX, fp8_attention, fp8_attention_emulated, launch_config,
                                           quantize_kv)

# the CPU tests run the kernels interpreted; on a GPU machine the GPU tests at the end run them
_STATUS = get_kernel_status()
_interpreted = pytest.mark.skipif(not (_STATUS["use_triton_kernels"] and _STATUS["interpreter"]),
                                  reason=_STATUS["reason"] or "a GPU machine: the GPU tests run the kernels")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _exact(q, k, v, causal):
    H, G = q.shape[1], k.shape[1]
    k, v = (t.double().repeat_interleave(H // G, 1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, is_causal=causal)


@_interpreted
@pytest.mark.parametrize("qk_int8", [True, False])
def test_quantization_is_8_bits_of_each_block_over_its_amax(qk_int8):
    """K less its mean, a scale per block of 64 rows (int8: amax / 127, to nearest; e4m3: amax / 448); V over its
    per-channel amax in e4m3, transposed (Q is quantized inside the attention kernel, checked through the
    attention below)."""
    torch.manual_seed(0)
    k, v = torch.randn(1, 1, 200, 64) + 3, torch.randn(1, 1, 200, 64)
    x = quantize_kv(k, v, block_n=64, qk_int8=qk_int8)
    assert x.k.dtype == (torch.int8 if qk_int8 else torch.float8_e4m3fn) and x.v.dtype == torch.float8_e4m3fn
    assert x.v.shape == (1, 1, 64, 200)
    smooth = k - k.mean(dim=2, keepdim=True)
    top = 127 if qk_int8 else E4M3_MAX
    for i in range(x.k_scale.shape[2]):
        rows = smooth[:, :, i * 64:(i + 1) * 64]
        assert torch.allclose(x.k_scale[:, :, i], rows.abs().amax(dim=(2, 3)) / top, rtol=1e-6)
        y = rows / x.k_scale[:, :, i, None, None]
        want = (torch.sign(y) * torch.floor(y.abs() + 0.5)) if qk_int8 else y.to(torch.float8_e4m3fn).float()
        same = x.k[:, :, i * 64:(i + 1) * 64].float() == want
        assert same.float().mean() > 0.99  # a tie may round the other way (fp32 division here, fp64 there)
    v_want = (v / x.v_scale[:, :, None, :]).to(torch.float8_e4m3fn).float()
    assert (x.v.float().transpose(-1, -2) == v_want).float().mean() > 0.99


@_interpreted
@pytest.mark.parametrize("B, H, G, S, D, causal", [
    (1, 2, 1, 200, 64, False),  # MQA, a partial last block
    (2, 4, 2, 190, 128, True),  # GQA, causal, head dim 128
    (1, 2, 2, 64, 64, True),  # one block each way
    (1, 3, 3, 150, 32, False),  # MiniLM's head dim (the precision study's real inputs)
])
@pytest.mark.parametrize("pv_fp8", [True, False])
@pytest.mark.parametrize("qk_int8", [True, False])
def test_the_kernel_computes_its_quantization_exactly_but_for_p(B, H, G, S, D, causal, pv_fp8, qk_int8):
    """Against float64 attention over the same quantized Q, K (and V): what is left is P's rounding, to bf16
    (2^-8) or to e4m3 (2^-4, with 448 as P's scale), and the order of the sums."""
    torch.manual_seed(1)
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, G, S, D), torch.randn(B, G, S, D)
    got = fp8_attention(q, k, v, causal, pv_fp8=pv_fp8, qk_int8=qk_int8)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = fp8_attention_emulated(q, k, v, causal, pv_fp8=pv_fp8, qk_int8=qk_int8)
    assert _rel(got, want) < (0.04 if pv_fp8 else 0.01)
    assert _rel(got, _exact(q, k, v, causal)) < 0.08


@_interpreted
def test_smoothing_k_keeps_a_channel_offset_from_costing_accuracy():
    """Keys with a large common offset (as real activations have): without subtracting K's mean the blocks' scales
    follow the offset and the keys' differences keep few of e4m3's bits."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 256, 64), torch.randn(1, 2, 256, 64), torch.randn(1, 2, 256, 64)
    offset = 10 * torch.randn(1, 2, 1, 64)
    plain = _rel(fp8_attention(q, k, v), _exact(q, k, v, False))
    shifted = _rel(fp8_attention(q, k + offset, v), _exact(q, k + offset, v, False))
    assert shifted < 1.5 * plain


@_interpreted
def test_strided_inputs_give_the_contiguous_result():
    """q, k, v as projections give them: (B, S, H, D) transposed to (B, H, S, D)."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 100, 2, 64), torch.randn(1, 100, 1, 64), torch.randn(1, 100, 1, 64)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    assert torch.equal(fp8_attention(q, k, v), fp8_attention(q.contiguous(), k.contiguous(), v.contiguous()))


@_interpreted
@pytest.mark.parametrize("shapes, causal, message", [
    (((1, 2, 64, 16), (1, 1, 64, 16)), False, "head dim must be 32, 64 or 128"),
    (((1, 3, 64, 64), (1, 2, 64, 64)), False, "G must divide H=3"),
    (((1, 2, 64, 64), (1, 2, 96, 64)), True, "causal needs as many keys as queries"),
    (((2, 64, 64), (1, 2, 64, 64)), False, r"takes q \(B, H, S, D\)"),
])
def test_bad_input_is_named(shapes, causal, message):
    qs, ks = shapes
    with pytest.raises(ValueError, match=message):
        fp8_attention(torch.randn(qs), torch.randn(ks), torch.randn(ks), causal)
    with pytest.raises(RuntimeError, match="forward only"):
        fp8_attention(torch.randn(1, 2, 8, 64, requires_grad=True), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("D, causal", [(128, False), (128, True), (64, True)])
@pytest.mark.parametrize("pv_fp8", [True, False])
@pytest.mark.parametrize("qk_int8", [True, False])
def test_on_the_gpu_fp8_tensor_cores_compute_the_same_attention(D, causal, pv_fp8, qk_int8):
    """On Hopper's 8-bit tensor cores: the same quantization in float64 but for P's rounding, as on the CPU."""
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 4, 1000, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = fp8_attention(q, k, v, causal, pv_fp8=pv_fp8, qk_int8=qk_int8)
    want = fp8_attention_emulated(q, k, v, causal, pv_fp8=pv_fp8, qk_int8=qk_int8)
    assert _rel(got, want) < (0.04 if pv_fp8 else 0.01)
    assert _rel(got, _exact(q, k, v, causal)) < 0.08


# ---------------------------------------------------------------- AdaAttention's FP8 guard (precision_mode "fp8")

def _ada(bound: float = 0.03, **kw):
    from adaattn.attention.ada import AdaAttention
    from adaattn.attention.kernel_manager import AttentionKernelManager

    torch.manual_seed(7)
    return AdaAttention(128, 2, batch_first=True, precision_mode="fp8", rank_mode="full", fp8_max_rel_l2=bound,
                        kernel_manager=AttentionKernelManager(backends=["math"]), **kw)


def _qkv(ada, x):
    q, k, v = ada._project(x, x, x)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@_interpreted
@pytest.mark.parametrize("causal", [False, True])
def test_the_guard_accepts_fp8_under_its_bound_and_the_module_runs_it(causal):
    """A bound FP8 meets: the signature's dtype is float8_e4m3fn, its check is in decisions() and get_statistics(),
    and the output is the FP8 attention's on the projections (bf16 in and out)."""
    ada, x = _ada(bound=0.2), torch.randn(1, 300, 128)
    with torch.no_grad():
        out = ada(x, x, x, need_weights=False, is_causal=causal)[0]
        (sig, d), = ada.decisions().items()
        assert d["dtype"] == "float8_e4m3fn" and d["fp8_guard"]["accepted"] and d["fp8_guard"]["reason"] is None
        assert 0 < d["fp8_guard"]["estimate"] <= 0.2 and ada.get_statistics()["fp8_guard"][sig] == d["fp8_guard"]
        want = fp8_attention(*_qkv(ada, x), causal).float()
        want = ada.out_proj(want.transpose(1, 2).reshape(1, 300, 128))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert ada.get_statistics()["precisions"] == {"float8_e4m3fn": 1}


@_interpreted
def test_the_guard_refuses_fp8_over_its_bound_and_names_the_estimate():
    ada, x = _ada(bound=1e-4), torch.randn(1, 300, 128)
    with torch.no_grad():
        ada(x, x, x, need_weights=False)
    (d,) = ada.decisions().values()
    assert d["dtype"] == "bfloat16" and not d["fp8_guard"]["accepted"]
    assert d["fp8_guard"]["reason"].startswith("estimated relative L2") and d["fp8_guard"]["estimate"] > 1e-4


@_interpreted
@pytest.mark.parametrize("causal", [False, True])
def test_the_estimate_is_the_whole_calls_error_on_the_sampled_blocks(causal):
    """Each sampled block's rows come out of the estimate's runs as out of the whole call: the estimate is the
    largest of those blocks' relative L2 errors against float32, computed here from the whole call's output."""
    from adaattn.attention.precision import PrecisionPolicy

    torch.manual_seed(8)
    m = launch_config(causal).block_m
    q, k, v = (torch.randn(1, 2, 4 * m + m // 2, 64).bfloat16() for _ in range(3))  # 5 blocks: 0, 2, 4 sampled
    policy = PrecisionPolicy("fp8", fp8_sample_blocks=3)
    est = policy.fp8_estimate(q, k, v, 64 ** -0.5, causal)
    full = fp8_attention(q, k, v, causal).float()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    errs = [float((full[:, :, r] - ref[:, :, r]).norm() / ref[:, :, r].norm())
            for r in (slice(0, m), slice(2 * m, 3 * m), slice(4 * m, 5 * m))]
    assert est == pytest.approx(max(errs), rel=1e-5)


@_interpreted
@pytest.mark.parametrize("case, reason", [
    ("grad", "forward only"), ("mask", "takes no mask"), ("head_dim", "head dim 16"), ("dropout", "no dropout"),
])
def test_where_fp8_cannot_run_the_module_runs_bf16_and_says_why(case, reason):
    from adaattn.attention.ada import AdaAttention
    from adaattn.attention.kernel_manager import AttentionKernelManager

    ada = _ada(dropout=0.1 if case == "dropout" else 0.0) if case != "head_dim" else AdaAttention(
        32, 2, batch_first=True, precision_mode="fp8", rank_mode="full",
        kernel_manager=AttentionKernelManager(backends=["math"]))
    E = ada.embed_dim
    x = torch.randn(1, 40, E, requires_grad=case == "grad")
    mask = torch.rand(1, 40) < 0.2 if case == "mask" else None
    with torch.set_grad_enabled(case == "grad"):
        ada(x, x, x, need_weights=False, key_padding_mask=mask)
    (d,) = ada.decisions().values()
    assert d["dtype"] == "bfloat16" and not d["fp8_guard"]["accepted"] and d["fp8_guard"]["estimate"] is None
    assert reason in d["fp8_guard"]["reason"]


@_interpreted
def test_a_compiled_module_runs_the_fp8_its_guard_accepted_and_bf16_without_a_decision():
    from torch._dynamo.testing import CompileCounterWithBackend

    ada, x = _ada(bound=0.2), torch.randn(1, 300, 128)
    backend, graphs = CompileCounterWithBackend("eager"), []
    f = torch.compile(lambda x: ada(x, x, x, need_weights=False)[0], backend=backend, fullgraph=True)
    with torch.no_grad():
        untuned = f(x)
        assert any("precision" in u for u in ada.get_statistics()["untuned"])
        want_bf16 = torch.nn.functional.scaled_dot_product_attention(*_qkv(ada, x)).float()
        torch.testing.assert_close(untuned, ada.out_proj(want_bf16.transpose(1, 2).reshape(1, 300, 128)))
        decided = ada.tune(x, grad=False)
        assert next(iter(decided.values()))["dtype"] == "float8_e4m3fn"
        out = f(x)
        torch.testing.assert_close(out, ada(x, x, x, need_weights=False)[0], atol=1e-5, rtol=1e-5)
    assert backend.frame_count == 2
    assert "fp8_attention" in str(backend.graphs[-1].code)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_on_the_gpu_the_estimate_is_the_whole_calls_error_and_a_compiled_module_runs_fp8(causal):
    """On FP8 tensor cores: the guard's sampled blocks are the whole call's rows (its estimate is their largest
    block error), and AdaAttention compiled by inductor runs the FP8 its guard accepted, as eager does."""
    from adaattn.attention.precision import PrecisionPolicy

    torch.manual_seed(9)
    m = launch_config(causal).block_m
    q, k, v = (torch.randn(2, 4, 7 * m + m // 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    est = PrecisionPolicy("fp8").fp8_estimate(q, k, v, 128 ** -0.5, causal)
    full = fp8_attention(q, k, v, causal).float()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    errs = [float((full[:, :, r] - ref[:, :, r]).norm() / ref[:, :, r].norm())
            for r in (slice(0, m), slice(4 * m, 5 * m), slice(7 * m, 8 * m))]  # 8 blocks: 0, round(3.5) = 4, 7
    assert est == pytest.approx(max(errs), rel=1e-4)
    ada = _ada(bound=1.0, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 1000, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert next(iter(ada.tune(x, grad=False).values()))["dtype"] == "float8_e4m3fn"
        eager = ada(x, x, x, need_weights=False, is_causal=False)[0]
        compiled = torch.compile(lambda x: ada(x, x, x, need_weights=False)[0], fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=2e-2)
