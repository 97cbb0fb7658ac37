"""The phase-3 guide's names (G2-C1): AdaptiveFlashAttention with FlashAttentionConfig, fused SDPA with
fallback through the kernel manager, memory_efficient_attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adaattn.attention.ada import AdaAttention
from adaattn.attention.chunked import chunked_attention
from adaattn.attention.flash_attention import (
    AdaptiveFlashAttention,
    FlashAttentionConfig,
    fused_scaled_dot_product_attention,
    memory_efficient_attention,
)
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.reference import attention_ref


def _pair(**fields) -> tuple[AdaptiveFlashAttention, nn.MultiheadAttention]:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    attn = AdaptiveFlashAttention(batch_first=True, embed_dim=64, num_heads=4, **fields)
    attn.load_state_dict(mha.state_dict())
    return attn, mha


def test_adaptive_flash_attention_as_the_guide_calls_it():
    # the guide's call, with a manager of its own (backends) so that its counts are this module's alone
    attn, mha = _pair(precision_mode="auto", enable_flash=True, backends=("sdpa", "math"))
    x = torch.randn(2, 24, 64)
    for causal in (False, True):
        mask = torch.ones(24, 24, dtype=torch.bool).triu(1) if causal else None
        out, weights = attn(x, x, x, need_weights=False, is_causal=causal)
        ref = mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)[0]
        assert weights is None and torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    attn(x, x, x, need_weights=False)
    out, weights = attn(x, x, x)  # nn.MultiheadAttention's default: weights, through the matmul path (not counted)
    assert weights.shape == (2, 24, 24)
    stats = attn.get_flash_statistics()
    assert stats["flash_calls"] + stats["other_calls"] == sum(stats["calls"].values()) == 3
    assert set(stats["calls"]) <= {"sdpa", "math"} and stats["fallbacks"] == []
    assert stats["flash_ratio"] == 0.0  # neither candidate is a flash-like kernel
    assert attn.config == FlashAttentionConfig(precision_mode="auto", backends=("sdpa", "math"))
    assert attn.rank_mode == "full" and attn.enable_gpu_optimization


def test_adaptive_flash_attention_takes_a_config_and_overrides_it():
    config = FlashAttentionConfig(precision_mode="fp32", backends=["sdpa"])
    attn = AdaptiveFlashAttention(64, 4, config, batch_first=True, rank_mode="auto")
    assert attn.config == FlashAttentionConfig(precision_mode="fp32", rank_mode="auto", backends=("sdpa",))
    assert attn.rank_mode == "auto" and attn.precision.mode == "fp32"
    assert attn.manager.backends == ["sdpa"] and attn.manager is config.manager()  # one manager per config
    assert FlashAttentionConfig().manager() is AdaAttention(64, 4).manager  # the shared one


def test_adaptive_flash_attention_without_flash_runs_sdpa_outside_the_manager():
    attn, mha = _pair(enable_flash=False, backends=("math",))
    x = torch.randn(1, 16, 64)
    assert torch.allclose(attn(x, x, x, need_weights=False)[0], mha(x, x, x, need_weights=False)[0], atol=1e-5,
                          rtol=1e-5)
    stats = attn.get_flash_statistics()
    assert stats["calls"] == {} and stats["flash_calls"] == stats["other_calls"] == 0
    assert attn.get_statistics()["ranks"] == {"full": 1}


@pytest.mark.parametrize(("fields", "names"), [
    ({"precision_mode": "int8"}, "precision_mode 'int8' is not one of: fp32, bf16, fp16, fp8, auto"),
    ({"rank_mode": "low"}, "rank_mode must be 'auto', 'full' or a positive int"),
    ({"rank_mode": 0}, "rank_mode must be 'auto', 'full' or a positive int"),
    ({"dropout": 1.0}, r"dropout must be a number in \[0, 1\)"),
    ({"dropout": "0.1"}, r"dropout must be a number in \[0, 1\)"),
    ({"enable_flash": 1}, "enable_flash must be True or False"),
    ({"backends": ("sdpa", "flash3")}, "backends: unknown 'flash3'; allowed: flash_attn, .*, math"),
    ({"backends": "sdpa"}, "backends must be a non-empty sequence"),
    ({"backends": ()}, "backends must be a non-empty sequence"),
])
def test_flash_attention_config_rejects_bad_values(fields, names):
    with pytest.raises(ValueError, match=names):
        FlashAttentionConfig(**fields)
    with pytest.raises(ValueError, match=names):
        AdaptiveFlashAttention(64, 4, **fields)


def test_adaptive_flash_attention_rejects_unknown_arguments():
    with pytest.raises(ValueError, match="unknown argument.*chunk_threshold.*config's fields: enable_flash"):
        AdaptiveFlashAttention(64, 4, chunk_threshold=2048)
    with pytest.raises(ValueError, match="config must be a FlashAttentionConfig; got dict"):
        AdaptiveFlashAttention(64, 4, {"enable_flash": True})


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "float"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_fused_scaled_dot_product_attention_is_sdpa_through_the_manager(mask_kind, kv_heads):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 19, 8), torch.randn(2, kv_heads, 23, 8), torch.randn(2, kv_heads, 23, 8)
    mask = {"bool": torch.rand(19, 23) > 0.3, "float": torch.randn(19, 23)}.get(mask_kind)
    mask = mask if mask is None or mask.dtype != torch.bool else mask | torch.eye(19, 23, dtype=torch.bool)
    causal = mask_kind == "causal"
    manager = AttentionKernelManager(backends=["sdpa", "chunked", "math"])
    out = fused_scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, manager=manager)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True,
                                         attn_mask=mask if mask is None or mask.dtype == torch.bool else mask.double())
    assert out.shape == q.shape and torch.allclose(out.double(), ref, atol=1e-5)
    assert sum(manager.get_statistics()["calls"].values()) == 1  # the manager ran it


def test_fused_scaled_dot_product_attention_falls_back_where_a_backend_fails(monkeypatch):
    from adaattn.attention import kernel_manager as km

    def broken(*args):
        raise RuntimeError("made unavailable by the test")

    manager = AttentionKernelManager(backends=["sdpa", "math"])
    q = torch.randn(1, 2, 8, 4)
    fused_scaled_dot_product_attention(q, q, q, manager=manager)  # ranks the signature
    first = manager.rankings[next(iter(manager.rankings))][0]
    monkeypatch.setitem(km.BACKENDS, first, dataclasses.replace(km.BACKENDS[first], run=broken))
    out = fused_scaled_dot_product_attention(q, q, q, manager=manager)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, q, q), atol=1e-6)
    fallbacks = manager.get_statistics()["fallbacks"]
    assert [(f["backend"], f["count"]) for f in fallbacks] == [(first, 1)]
    assert "made unavailable by the test" in fallbacks[0]["reason"]


@pytest.mark.parametrize(("args", "kwargs", "names"), [
    ((torch.randn(2, 8, 4),) * 3, {}, r"q must be \(B, Hq, L, D\)"),
    ((torch.randn(1, 3, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)), {}, "multiple of kv heads"),
    ((torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4).double(), torch.randn(1, 2, 8, 4)), {}, "one floating dtype"),
    ((torch.randn(1, 2, 8, 4),) * 3, {"is_causal": True, "attn_mask": torch.ones(8, 8, dtype=torch.bool)},
     "either attn_mask or is_causal"),
    ((torch.randn(1, 2, 8, 4),) * 3, {"dropout_p": 1.0}, r"dropout_p must be a number in \[0, 1\)"),
])
def test_fused_scaled_dot_product_attention_rejects_bad_inputs(args, kwargs, names):
    with pytest.raises(ValueError, match=names):
        fused_scaled_dot_product_attention(*args, **kwargs)


def test_fused_scaled_dot_product_attention_with_dropout_runs_sdpa():
    q = torch.randn(1, 2, 64, 8)
    torch.manual_seed(3)
    out = fused_scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(out, F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))


def test_memory_efficient_attention_is_the_chunked_path():
    assert memory_efficient_attention is chunked_attention
    q, k, v = (torch.randn(1, 2, 300, 8) for _ in range(3))
    out = memory_efficient_attention(q, k, v, is_causal=True, chunk_size=64)
    assert torch.allclose(out.double(), attention_ref(q, k, v, causal=True), atol=1e-5)
