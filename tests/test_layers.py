"""Layers (G4-C1): RMSNorm, SwiGLUMLP, RotaryEmbedding (shared, growing cache), flexible_attention
(backends, GQA, forced backends that cannot run), GradientCheckpointMixin, compute_memory_footprint.

On a CPU machine the kernels behind the layers run in Triton's interpreter (conftest.py).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adaattn.kernels import reference as R
from adaattn.attention.flexible import flexible_attention, get_attention_backend, set_attention_backend
from adaattn.layers import GradientCheckpointMixin, RMSNorm, RotaryEmbedding, SwiGLUMLP, compute_memory_footprint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _attention_ref(q, k, v, causal):
    """float64, kv heads repeated: (B, Hq, S, D)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def test_rms_norm_layer_matches_reference_and_trains():
    layer = RMSNorm(96, eps=1e-5, device=DEVICE)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, 96))
    x = torch.randn(3, 7, 96, device=DEVICE, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, R.rms_norm_ref(x, layer.weight, 1e-5), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    assert layer.weight.grad is not None and x.grad is not None and torch.isfinite(layer.weight.grad).all()
    assert "96, eps=1e-05" in repr(layer)


def test_swiglu_mlp_matches_unfused_projections():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(64, 160, device=DEVICE)
    x = torch.randn(2, 5, 64, device=DEVICE)
    gate_w, up_w = mlp.gate_up.weight.split(160, 0)
    want = F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), mlp.down.weight)
    torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)


def test_rotary_embedding_is_shared_and_grows():
    rope = RotaryEmbedding(64, max_seq_len=16, device=DEVICE)
    layers = [rope for _ in range(4)]  # what a model does: one instance held by every layer
    assert all(layer.cos.data_ptr() == rope.cos.data_ptr() for layer in layers)
    assert rope.cache_bytes() == 2 * 16 * 32 * 4
    q, k = torch.randn(2, 40, 8, 64, device=DEVICE), torch.randn(2, 40, 2, 64, device=DEVICE)
    qo, ko = rope(q, k)  # 40 > 16: grows to the next power of two
    assert rope.max_seq_len == 64
    cos, sin = R.rope_cache(40, 64, device=DEVICE)
    want_q, want_k = R.rope_ref(q, k, cos, sin)
    torch.testing.assert_close(qo, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ko, want_k, atol=1e-5, rtol=1e-5)
    qn, kn = rope.with_qk_norm(q, k, torch.ones(64, device=DEVICE), torch.ones(64, device=DEVICE))
    want = R.qk_norm_rope_ref(q, k, torch.ones(64, device=DEVICE), torch.ones(64, device=DEVICE), cos, sin, 1e-6)
    torch.testing.assert_close(qn, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kn, want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [dict(head_dim=63), dict(head_dim=64, max_seq_len=0)])
def test_rotary_embedding_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match="head_dim|max_seq_len"):
        RotaryEmbedding(**bad)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "math"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_flexible_attention_matches_float64(backend, causal, heads):
    hq, hkv = heads
    q = torch.randn(2, hq, 33, 16, device=DEVICE)
    k, v = torch.randn(2, hkv, 33, 16, device=DEVICE), torch.randn(2, hkv, 33, 16, device=DEVICE)
    out = flexible_attention(q, k, v, is_causal=causal, backend=backend)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), _attention_ref(q, k, v, causal), atol=1e-5, rtol=1e-5)


def test_math_backend_expands_kv_as_a_view():
    k = torch.randn(1, 2, 8, 4)
    from adaattn.attention.flexible import _expand_kv

    e = _expand_kv(k, 3)
    assert e.shape == (1, 6, 8, 4) and torch.equal(e[:, 1], k[:, 0]) and torch.equal(e[:, 3], k[:, 1])


@pytest.mark.skipif(DEVICE == "cuda", reason="on CPU tensors the CUDA-only backends cannot run")
@pytest.mark.parametrize("backend", ["flash", "xformers"])
def test_forced_backend_that_cannot_run_raises(backend):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match=f"'{backend}' was forced but cannot run: .*CUDA"):
        flexible_attention(q, q, q, backend=backend)


def test_set_attention_backend_validates_and_applies():
    assert get_attention_backend() == "auto"
    with pytest.raises(ValueError, match="one of: auto, flash, xformers, sdpa, math"):
        set_attention_backend("fast")
    q = torch.randn(1, 2, 8, 16)
    try:
        set_attention_backend("math")
        assert get_attention_backend() == "math"
        torch.testing.assert_close(flexible_attention(q, q, q).double(), _attention_ref(q, q, q, False), atol=1e-5,
                                   rtol=1e-5)
    finally:
        set_attention_backend("auto")


@pytest.mark.parametrize("shapes", [((1, 4, 8, 16), (1, 3, 8, 16)), ((1, 4, 8, 16), (1, 4, 8, 8)), ((4, 8, 16),) * 2])
def test_flexible_attention_rejects_bad_shapes(shapes):
    q, k = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    with pytest.raises(ValueError, match="multiple of kv heads|must be"):
        flexible_attention(q, k, k)


class _Stack(GradientCheckpointMixin, nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.dim = 32
        self.blocks = nn.ModuleList(nn.Sequential(RMSNorm(32), SwiGLUMLP(32, 64)) for _ in range(3))

    def forward(self, x):
        return self.run_blocks(self.blocks, x)


def test_gradient_checkpointing_gives_the_same_gradients():
    x = torch.randn(2, 6, 32, device=DEVICE)
    grads = []
    for on in (False, True):
        model = _Stack().to(DEVICE)
        if on:
            model.enable_gradient_checkpointing()
        assert model.gradient_checkpointing is on
        model(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_compute_memory_footprint_is_measured():
    model = _Stack().to(DEVICE)
    small = compute_memory_footprint(model, 2, 16)
    large = compute_memory_footprint(model, 8, 64)
    n = sum(p.numel() for p in model.parameters())
    assert small["parameters"] == small["gradients"] == 4 * n and small["optimizer"] == 8 * n
    assert 0 < small["activations"] < large["activations"]
    assert large["total"] == sum(large[k] for k in ("parameters", "gradients", "optimizer", "activations"))
    with pytest.raises(ValueError, match="batch_size and seq_len"):
        compute_memory_footprint(model, 0, 16)
