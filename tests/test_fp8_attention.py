"""The FP8 attention forward (kernels/fp8_attention.py), interpreted on the CPU: its quantization pass against
PyTorch's e4m3 casts, the attention against the same quantization emulated in float64 and against exact
attention, K's smoothing shown to matter, causal, GQA, ragged lengths, strided inputs; bad input named. The
interpreter runs the products on the FP8 values cast to fp32: the algorithm is checked here, the tensor cores
on a GPU."""

from __future__ import annotations

import pytest
import torch

from adaattn.kernels import get_kernel_status
from adaattn.kernels.fp8_attention import E4M3_MAX, fp8_attention, fp8_attention_emulated, quantize_qkv

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
def test_quantization_is_e4m3_of_each_block_over_its_amax():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 200, 64), torch.randn(1, 1, 200, 64) + 3, torch.randn(1, 1, 200, 64)
    x = quantize_qkv(q, k, v, block_m=128, block_n=64)
    assert x.q.dtype == x.k.dtype == x.v.dtype == torch.float8_e4m3fn and x.v.shape == (1, 1, 64, 200)
    smooth = k - k.mean(dim=2, keepdim=True)
    for got, scales, src, block in ((x.q, x.q_scale, q, 128), (x.k, x.k_scale, smooth, 64)):
        for i in range(scales.shape[2]):
            rows = src[:, :, i * block:(i + 1) * block]
            want_scale = rows.abs().amax(dim=(2, 3)) / E4M3_MAX
            assert torch.allclose(scales[:, :, i], want_scale, rtol=1e-6)
            want = (rows / scales[:, :, i, None, None]).to(torch.float8_e4m3fn).float()
            same = got[:, :, i * block:(i + 1) * block].float() == want
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
def test_the_kernel_computes_its_quantization_exactly_but_for_p(B, H, G, S, D, causal, pv_fp8):
    """Against float64 attention over the same quantized Q, K (and V): what is left is P's rounding, to bf16
    (2^-8) or to e4m3 (2^-4, with 448 as P's scale), and the order of the sums."""
    torch.manual_seed(1)
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, G, S, D), torch.randn(B, G, S, D)
    got = fp8_attention(q, k, v, causal, pv_fp8=pv_fp8)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert _rel(got, fp8_attention_emulated(q, k, v, causal, pv_fp8=pv_fp8)) < (0.04 if pv_fp8 else 0.01)
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
def test_on_the_gpu_fp8_tensor_cores_compute_the_same_attention(D, causal, pv_fp8):
    """On Hopper's FP8 tensor cores: the same quantization in float64 but for P's rounding, as on the CPU."""
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 4, 1000, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = fp8_attention(q, k, v, causal, pv_fp8=pv_fp8)
    want = fp8_attention_emulated(q, k, v, causal, pv_fp8=pv_fp8)
    assert _rel(got, want) < (0.04 if pv_fp8 else 0.01)
    assert _rel(got, _exact(q, k, v, causal)) < 0.08
