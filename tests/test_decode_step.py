"""The fused decode step (kernels/decode_proj.py, models/decode_step.py), interpreted on the CPU: each projection
kernel against its PyTorch reference for 16-bit, INT8 and INT4 weights, one row (GEMV) and several (tensor
cores), K split across programs; the model's fused step against its own layers and its full forward; what the
fused step refuses, by name; INT4 quantization's error bound and bad input; generate's loop on the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import adaattn.kernels.decode_proj as dp
from adaattn.kernels.decode_attention import decode_attention_ref
from adaattn.kernels.quant_weight import _norm_ref
from adaattn.models import decode_step
from adaattn.models.config import ModelConfig
from adaattn.models.generate import clear_kv_cache, decode_one, generate, prefill, setup_kv_cache
from adaattn.models.decode_step import quant_weight
from adaattn.models.quant import Int4WeightOnlyLinear, quantize_weight_only
from adaattn.models.transformer import build_model

E, H, G, D, HID, M = 64, 4, 2, 32, 96, 16  # D / 2 = 16: a RoPE program's rows with tensor cores


def _weight(n_out: int, n_in: int, bits: int, group: int = 32) -> dp.QuantWeight:
    linear = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(linear.weight, std=0.1)
    if bits == 16:
        return dp.QuantWeight(linear.weight.detach())
    model = nn.Sequential(linear)
    quantize_weight_only(model, bits, group, skip=())
    return quant_weight(model[0])


GEMV = {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1, "GEMV": True}


@pytest.fixture(params=["table", "gemv"])
def launch(request, monkeypatch):
    """The shipped configs, and a GEMV with narrow K tiles (several K steps, RoPE rows of 8)."""
    if request.param == "gemv":
        monkeypatch.setattr(dp, "config", lambda *a: GEMV)
    return request.param


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("B", [1, 3])
def test_each_projection_matches_its_reference(bits, B, launch):
    torch.manual_seed(bits + B)
    x, nw = torch.randn(B, E), torch.rand(E) + 0.5
    cos, sin, pos = torch.randn(M, D // 2), torch.randn(M, D // 2), torch.tensor([5])
    w = _weight((H + 2 * G) * D, E, bits)
    caches = [torch.zeros(B, G, M, D) for _ in range(4)]
    q = dp.norm_qkv_rope(x, nw, 1e-5, w, cos, sin, pos, caches[0], caches[1], H)
    want = dp.norm_qkv_rope_ref(x, nw, 1e-5, w, cos, sin, pos, caches[2], caches[3], H)
    torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-5)
    for got, ref in zip(caches[:2], caches[2:]):  # k rotated and v, at the position only
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert got[:, :, 5].abs().sum() > 0 and got[:, :, :5].abs().sum() == got[:, :, 6:].abs().sum() == 0
    w = _weight(2 * HID, E, bits)
    torch.testing.assert_close(dp.norm_swiglu(x, nw, 1e-5, w), dp.norm_swiglu_ref(x, nw, 1e-5, w),
                               atol=1e-5, rtol=1e-5)
    w, h = _weight(E, HID, bits), torch.randn(B, HID)
    res, want = torch.randn(B, E), None
    want = res.clone()
    dp.add_linear_(res, h, w)  # K split across programs: their partials add up in the residual
    dp.add_linear_ref(want, h, w)
    torch.testing.assert_close(res, want, atol=1e-5, rtol=1e-5)
    w = _weight(200, E, bits)
    torch.testing.assert_close(dp.norm_linear(x, nw, 1e-5, w, torch.float32),
                               dp.norm_linear_ref(x, nw, 1e-5, w, torch.float32), atol=1e-5, rtol=1e-5)


def test_the_rope_reference_is_the_models_rotation():
    """The kernels' reference rotates as the model's RoPE does (rotate-half, the table at the position)."""
    from adaattn.kernels.reference import rope_cache, rope_ref

    torch.manual_seed(0)
    x, nw = torch.randn(2, E), torch.ones(E)
    w = _weight((H + 2 * G) * D, E, 16)
    cos, sin = rope_cache(M, D)
    k_cache, v_cache = torch.zeros(2, G, M, D), torch.zeros(2, G, M, D)
    q = dp.norm_qkv_rope_ref(x, nw, 1e-6, w, cos, sin, torch.tensor([7]), k_cache, v_cache, H)
    qkv = (_norm_ref(x, nw, 1e-6) @ w.data.t()).view(2, 1, -1, D)  # (B, S=1, heads, D)
    want_q, want_k = rope_ref(qkv[:, :, :H], qkv[:, :, H:H + G], cos[7:8], sin[7:8])
    torch.testing.assert_close(q, want_q[:, 0])
    torch.testing.assert_close(k_cache[:, :, 7], want_k[:, 0])
    torch.testing.assert_close(v_cache[:, :, 7], qkv[:, 0, H + G:])


def _model(**update) -> nn.Module:
    base = {"vocab_size": 97, "dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32}
    cfg = ModelConfig(**{**base, **update})
    torch.manual_seed(0)
    return build_model(cfg).eval().requires_grad_(False)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_the_fused_step_matches_the_models_own_layers_and_its_forward(bits, monkeypatch):
    monkeypatch.setattr(decode_step, "FUSED_MAX_BATCH", 2)  # two sequences: the kernels' tensor-core tiles too
    calls = {"fused": 0, "separate": 0}  # which attention-out path the step takes
    for name, key in (("attention_out_", "fused"), ("decode_attention", "separate")):
        fn = getattr(decode_step, name)
        monkeypatch.setattr(decode_step, name, lambda *a, fn=fn, key=key, **k: calls.__setitem__(key, calls[key] + 1)
                            or fn(*a, **k))
    model = _model()
    if bits < 16:
        quantize_weight_only(model, bits, 32)
    tokens = torch.randint(0, 97, (2, 11))
    got = {}
    with torch.no_grad():
        for fused in (True, False):
            model.fused_decode = fused
            setup_kv_cache(model, 2, 16)
            prefill(model, tokens[:, :10])
            assert (decode_step.why_not(model, tokens[:, 10:]) is None) == fused
            got[fused] = decode_one(model, tokens[:, 10:], torch.tensor([10]))
            caches = [b.attn.cache.k[:, :, :11].clone() for b in model.blocks]
        clear_kv_cache(model)
        full = model(tokens)[:, -1]
    torch.testing.assert_close(got[True], got[False], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[True], full, atol=1e-4, rtol=1e-4)
    assert all(c.abs().sum() > 0 for c in caches)
    assert calls == ({"fused": 0, "separate": 2} if bits in decode_step.SEPARATE_ATTENTION_OUT
                     else {"fused": 2, "separate": 0})  # one a layer


def test_what_the_fused_step_cannot_run_is_named():
    tokens = torch.zeros(1, 1, dtype=torch.long)
    cases = [({"mlp": "gelu"}, "mlp=gelu"), ({"norm": "layernorm"}, "norm=layernorm"),
             ({"positions": "learned"}, "positions=learned"), ({"bias": True}, "a bias"),
             ({"attention_window": 8}, "sliding-window"), ({"n_heads": 8, "n_kv_heads": 2}, "head_dim=16")]
    for update, why in cases:
        model = _model(**update)
        setup_kv_cache(model, 1, 16)
        with torch.no_grad():
            assert why in decode_step.why_not(model, tokens), update
    model = _model()
    setup_kv_cache(model, 1, 16)
    with torch.no_grad():
        assert decode_step.why_not(model, tokens) is None
        assert "2 tokens" in decode_step.why_not(model, torch.zeros(1, 2, dtype=torch.long))
        assert "FUSED_MAX_BATCH=1" in decode_step.why_not(model, torch.zeros(2, 1, dtype=torch.long))
        model.blocks[0].mlp.down.register_forward_hook(lambda *a: None)  # tensor parallelism's all-reduce
        assert "forward hook" in decode_step.why_not(model, tokens)
    model = _model().requires_grad_(True)
    setup_kv_cache(model, 1, 16)
    assert "gradient" in decode_step.why_not(model, tokens)


def test_int4_codes_are_within_half_a_step_and_bad_groups_are_named():
    torch.manual_seed(0)
    linear = nn.Linear(128, 24, bias=True)
    q = Int4WeightOnlyLinear.from_linear(linear, 32)
    dense = q.quant_weight().dense(torch.float32)
    step = q.scale.repeat_interleave(32, dim=1)
    assert ((dense - linear.weight).abs() <= step / 2 + 1e-6).all()
    assert q.weight.dtype == torch.uint8 and q.weight.shape == (24, 64)
    x = torch.randn(5, 128)
    torch.testing.assert_close(q(x), x @ dense.t() + linear.bias, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4WeightOnlyLinear.from_linear(nn.Linear(48, 8), 32)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize_weight_only(nn.Sequential(nn.Linear(8, 8)), 2)


def test_int4_rows_past_one_run_tinygemm_where_packed_and_give_the_same_product():
    """tinygemm's form (w = (q - 8) * scale + zero, its scales and zeros (K / group, N, 2)) converted from ours,
    checked through its CPU twin: 2-64 bf16 rows go through it and match our dequantized weight; one row, other
    dtypes and a model quantized on the CPU do not; the packed copy stays out of the state dict."""
    from adaattn.models import quant

    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=True).to(torch.bfloat16)
    q = Int4WeightOnlyLinear.from_linear(linear, 64)
    dense = q.quant_weight().dense(torch.float32)
    assert getattr(q, "tiny_weight", None) is None and q.pack_tinygemm() is q
    for rows in (1, 2, 8, 64):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        y = q._tinygemm(x)
        assert (y is None) == (rows not in quant.TINYGEMM_ROWS)
        if y is not None:
            torch.testing.assert_close(y.float(), x.float() @ dense.t(), atol=0.05, rtol=0.02)
            torch.testing.assert_close(q(x).float(), x.float() @ dense.t() + linear.bias.float(), atol=0.05,
                                       rtol=0.02)
    assert q._tinygemm(torch.randn(8, 256)) is None  # tinygemm takes bf16 rows only
    assert set(q.state_dict()) == {"weight", "scale", "offset", "bias"}
    with pytest.raises(ValueError, match="tinygemm needs out_features % 8 == 0"):
        Int4WeightOnlyLinear.from_linear(nn.Linear(256, 12), 64).pack_tinygemm()
    model = quantize_weight_only(nn.Sequential(nn.Linear(256, 64)), 4, 64, skip=())
    assert getattr(model[0], "tiny_weight", None) is None  # packed on a GPU only: the CPU keeps its path


def test_int4_tinygemm_copy_follows_new_codes_and_stays_on_its_device_kind():
    """Codes loaded from a state dict are packed again (the copy never describes the old ones); a copy on a device
    of another kind than it was packed on (``.to()`` moves buffers, not layouts) is not used."""
    torch.manual_seed(0)
    a = Int4WeightOnlyLinear.from_linear(nn.Linear(256, 64, bias=False).to(torch.bfloat16), 64).pack_tinygemm()
    b = Int4WeightOnlyLinear.from_linear(nn.Linear(256, 64, bias=False).to(torch.bfloat16), 64)
    a.load_state_dict(b.state_dict())
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    want = x.float() @ b.quant_weight().dense(torch.float32).t()
    torch.testing.assert_close(a._tinygemm(x).float(), want, atol=0.05, rtol=0.02)
    a.tiny_device_type = "cuda"  # as if packed on a GPU and moved here
    assert a._tinygemm(x) is None
    torch.testing.assert_close(a(x).float(), want, atol=0.05, rtol=0.02)


def test_int4_tinygemm_rows_trace_with_a_dynamic_batch():
    """The row check holds under torch.compile with the batch a SymInt (the inference study compiles one decode
    function for every batch, so its second batch is traced dynamic)."""
    torch.manual_seed(0)
    q = Int4WeightOnlyLinear.from_linear(nn.Linear(256, 64, bias=False).to(torch.bfloat16), 64).pack_tinygemm()
    dense = q.quant_weight().dense(torch.float32)
    f = torch.compile(q, backend="eager", dynamic=True, fullgraph=True)
    for rows in (2, 8):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        torch.testing.assert_close(f(x).float(), x.float() @ dense.t(), atol=0.05, rtol=0.02)


def test_generate_advances_the_position_on_the_device_and_holds_finished_sequences():
    model = _model()
    setup_kv_cache(model, 2, 16)
    seen, calls = [], []

    def decode(m, token, pos):
        seen.append(pos)
        calls.append(int(pos))  # the test's own read; generate never reads it
        logits = decode_one(m, token, pos)
        if len(calls) == 2:  # sequence 0 ends at its third new token
            logits[0] = -1e9
            logits[0, 5] = 0.0
        return logits

    out = generate(model, torch.randint(0, 97, (2, 4)), 6, decode=decode, eos_token=5)
    assert calls == [4, 5, 6, 7, 8] and all(p is seen[0] for p in seen)  # one tensor, advanced in place
    assert (out[0, 7:] == 5).all() and out.shape == (2, 10)


@pytest.mark.gpu
def test_gpu_compiled_fused_step_matches_the_plain_compiled_step(monkeypatch):
    monkeypatch.setattr(decode_step, "FUSED_MAX_BATCH", 2)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, dim=512, n_layers=2, n_heads=8, n_kv_heads=2, max_seq_len=256)
    model = build_model(cfg).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    tokens = torch.randint(0, 512, (2, 65), device="cuda")
    got = {}
    for fused in (True, False):
        model.fused_decode = fused
        setup_kv_cache(model, 2, 128)
        step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            prefill(model, tokens[:, :64])
            for _ in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                got[fused] = step(model, tokens[:, 64:], torch.tensor([64], device="cuda")).float().clone()
        torch._dynamo.reset()
    assert ((got[True] - got[False]).norm() / got[False].norm()).item() < 0.02


def test_decode_attention_reads_the_positions_up_to_an_offset():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    pos = torch.tensor([6])
    torch.testing.assert_close(decode_attention_ref(q, k, v, pos, length_offset=1),
                               decode_attention_ref(q, k, v, pos + 1))


def test_bad_projection_input_is_named():
    w = _weight(2 * HID, E, 16)
    with pytest.raises(ValueError, match=r"norm_swiglu: x must be \(rows, 64\)"):
        dp.norm_swiglu(torch.randn(2, E + 1), torch.ones(E + 1), 1e-5, w)
    with pytest.raises(ValueError, match="the norm's weight must be"):
        dp.norm_swiglu(torch.randn(2, E), torch.ones(3), 1e-5, w)
    with pytest.raises(ValueError, match="the residual must be fp32"):
        dp.add_linear_(torch.zeros(2, E, dtype=torch.float64), torch.randn(2, HID), _weight(E, HID, 16))
    with pytest.raises(ValueError, match="INT4 groups must be a power of two"):
        dp.norm_linear(torch.randn(2, E), None, 1e-5, dp.QuantWeight(torch.zeros(8, E // 2, dtype=torch.uint8), 4,
                                                                     torch.ones(8, 2), torch.zeros(8, 2), 24),
                       torch.float32)
    with pytest.raises(ValueError, match="caches"):
        dp.norm_qkv_rope(torch.randn(2, E), torch.ones(E), 1e-5, _weight((H + 2 * G) * D, E, 16),
                         torch.zeros(M, D // 2), torch.zeros(M, D // 2), torch.tensor([0]),
                         torch.zeros(2, G, M, D), torch.zeros(2, G, M, D), H + 1)
