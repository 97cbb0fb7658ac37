"""AdaAttention and its parts: vs nn.MultiheadAttention and a float64 reference, precision escalation,
rank estimation and the rank policy, chunked and Nyström paths, argument errors (the kernel manager:
test_kernel_manager.py)."""

import inspect
import math

import pytest
import torch
from torch import nn

from adaattn.attention.ada import AdaAttention
from adaattn.attention.backends import BACKENDS
from adaattn.attention.flash_attention import AdaptiveFlashAttention
from adaattn.attention.hardware import HardwareCapabilities
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.precision import PrecisionPolicy

E, H = 48, 4


def _pair(batch_first=True, **kw):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first)
    with torch.no_grad():
        mha.in_proj_bias.normal_()  # non-zero biases: their slicing is checked too
        mha.out_proj.bias.normal_()
    ada = AdaAttention(E, H, batch_first=batch_first, kernel_manager=AttentionKernelManager(), **kw)
    ada.load_state_dict(mha.state_dict())
    return mha, ada


def _masks(B, L, S):
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, -3:] = True
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)
    float_mask = torch.randn(L, S)
    per_head = torch.rand(B * H, L, S) < 0.2
    return [{}, {"key_padding_mask": kpm}, {"attn_mask": causal}, {"attn_mask": causal, "key_padding_mask": kpm},
            {"attn_mask": float_mask}, {"attn_mask": per_head}, {"attn_mask": float_mask, "key_padding_mask": kpm}]


# every mask kind, both layouts, with weights (the matmul path) and without (the manager's backend)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", range(7))
def test_matches_multihead_attention(batch_first, case, need_weights):
    mha, ada = _pair(batch_first, rank_mode="full")
    B, L, S = 2, 11, 13
    kw = _masks(B, L, S)[case]
    q, kv = torch.randn(B, L, E), torch.randn(B, S, E)
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    leaves_a = [t.clone().requires_grad_() for t in (q, kv)]
    leaves_b = [t.clone().requires_grad_() for t in (q, kv)]
    o1, w1 = mha(leaves_a[0], leaves_a[1], leaves_a[1], need_weights=True, **kw)
    o2, w2 = ada(leaves_b[0], leaves_b[1], leaves_b[1], need_weights=need_weights, **kw)
    torch.testing.assert_close(o2, o1, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(w2, w1, atol=1e-5, rtol=1e-5)
    else:
        assert w2 is None
    o1.square().sum().backward()
    o2.square().sum().backward()
    for a, b in zip(leaves_a, leaves_b, strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4)
    for (n, p1), p2 in zip(mha.named_parameters(), ada.parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p1.grad, atol=1e-4, rtol=1e-4, msg=n)


def _qkv(B=2, Hq=4, Hkv=2, L=33, S=33, D=16, dtype=torch.float32):
    torch.manual_seed(2)
    return torch.randn(B, Hq, L, D, dtype=dtype), torch.randn(B, Hkv, S, D, dtype=dtype), \
        torch.randn(B, Hkv, S, D, dtype=dtype)




def test_defaults_weights_per_head_and_unbatched_inputs_are_multihead_attention_s():
    """MHA's defaults (``out, w = attn(x, x, x)`` gives averaged weights), ``average_attn_weights=False`` and
    unbatched (L, E) inputs with their (S,) padding and (heads, L, S) masks, in both layouts."""
    for batch_first in (True, False):
        mha, ada = _pair(batch_first, rank_mode="full")
        x, kv = torch.randn(2, 6, E), torch.randn(2, 9, E)
        if not batch_first:
            x, kv = x.transpose(0, 1), kv.transpose(0, 1)
        for kw in [{}, {"average_attn_weights": False}]:
            (o1, w1), (o2, w2) = mha(x, kv, kv, **kw), ada(x, kv, kv, **kw)
            torch.testing.assert_close(o2, o1, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(w2, w1, atol=1e-5, rtol=1e-5)
        q1, kv1 = torch.randn(6, E), torch.randn(9, E)
        kpm = torch.zeros(9, dtype=torch.bool)
        kpm[-2:] = True
        for kw in [{}, {"key_padding_mask": kpm}, {"attn_mask": torch.rand(H, 6, 9) < 0.2},
                   {"need_weights": False, "attn_mask": torch.randn(6, 9)}, {"average_attn_weights": False}]:
            (o1, w1), (o2, w2) = mha(q1, kv1, kv1, **kw), ada(q1, kv1, kv1, **kw)
            assert o2.shape == (6, E)
            torch.testing.assert_close(o2, o1, atol=1e-5, rtol=1e-5)
            assert (w1 is None) == (w2 is None)
            if w1 is not None:
                torch.testing.assert_close(w2, w1, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unbatched query"):
        ada(q1, kv, kv)


def test_is_causal_needs_no_mask():
    mha, ada = _pair(rank_mode="full")
    x = torch.randn(2, 9, E)
    torch.testing.assert_close(ada(x, x, x, is_causal=True)[0],
                               mha(x, x, x, attn_mask=torch.ones(9, 9, dtype=torch.bool).triu(1))[0], atol=1e-5, rtol=1e-5)


def test_projections_read_the_current_parameters():
    """A replaced or parametrized weight is the one used, on the first call and on later ones."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    mha, ada = _pair(rank_mode="full")
    x = torch.randn(2, 7, E)
    ada(x, x, x, need_weights=False)  # the policies have decided
    new = nn.Parameter(0.2 * torch.randn_like(ada.in_proj_weight))
    ada.in_proj_weight = new
    parametrize.register_parametrization(ada.out_proj, "weight", Double())
    with torch.no_grad():
        mha.in_proj_weight.copy_(new)
        mha.out_proj.weight.mul_(2)
    for weights in (False, True):
        torch.testing.assert_close(ada(x, x, x, need_weights=weights)[0], mha(x, x, x)[0], atol=1e-4, rtol=1e-4)
    x2 = torch.randn(2, 5, E)  # cross-attention: q, k and v projected apart, from slices of the weight
    torch.testing.assert_close(ada(x, x2, x2)[0], mha(x, x2, x2)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_cross_attention_vs_float64(kv_heads):
    torch.manual_seed(1)
    ada = AdaAttention(E, H, batch_first=True, num_kv_heads=kv_heads, kdim=20, vdim=24, rank_mode="full",
                       kernel_manager=AttentionKernelManager())
    B, L, S, hd = 3, 7, 19, E // H
    q, k, v = torch.randn(B, L, E), torch.randn(B, S, 20), torch.randn(B, S, 24)
    out, _ = ada(q, k, v)
    d = ada.double()
    qp = (q.double() @ d.q_proj_weight.T + d.in_proj_bias[:E]).view(B, L, H, hd).transpose(1, 2)
    kp = (k.double() @ d.k_proj_weight.T + d.in_proj_bias[E:E + kv_heads * hd]).view(B, S, kv_heads, hd).transpose(1, 2)
    vp = (v.double() @ d.v_proj_weight.T + d.in_proj_bias[E + kv_heads * hd:]).view(B, S, kv_heads, hd).transpose(1, 2)
    g = H // kv_heads
    p = torch.softmax(qp @ kp.repeat_interleave(g, 1).transpose(-2, -1) / math.sqrt(hd), -1)
    ref = d.out_proj((p @ vp.repeat_interleave(g, 1)).transpose(1, 2).reshape(B, L, E))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- kernel manager


def _hw(**kw):
    base = dict(device="cuda:0", name="fake", compute_capability=(7, 0), bf16=False, fp16=True, fp8=False, tf32=False,
                memory_bytes=0)
    return HardwareCapabilities(**{**base, **kw})


def test_auto_precision_by_hardware():
    assert HardwareCapabilities.detect("cpu").default_dtype == torch.float32
    assert _hw().default_dtype == torch.float16
    assert _hw(compute_capability=(9, 0), bf16=True).default_dtype == torch.bfloat16


def test_fp16_overflow_escalates_and_says_why():
    q, k, v = _qkv()
    policy = PrecisionPolicy("auto")
    assert policy.choose(q, k, v, 0.25, _hw(), "small") == torch.float16
    big = q * 300  # N(0,1) + outliers of ~N(0,300): logits past 65504
    assert policy.choose(big, k * 300, v, 0.25, _hw(), "big") == torch.float32  # no bf16 on Volta
    (esc,) = policy.escalations
    assert esc["from"] == "float16" and esc["to"] == "float32" and "fp16 range" in esc["reason"]


def test_accuracy_budget_escalates():
    q, k, v = _qkv()
    policy = PrecisionPolicy("auto", min_cosine=1.0)  # no bf16 result is exactly equal to fp32
    assert policy.choose(q, k, v, 0.25, _hw(bf16=True, compute_capability=(9, 0)), "s") == torch.float32
    assert "cosine" in policy.escalations[0]["reason"]
    fixed = PrecisionPolicy("bf16", min_cosine=1.0)  # a fixed mode is never changed
    assert fixed.choose(q, k, v, 0.25, _hw(bf16=True, compute_capability=(9, 0)), "s") == torch.bfloat16


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("kw,match", [
    ({"rank_mode": 0}, "rank_mode"), ({"rank_mode": "low"}, "rank_mode"), ({"precision_mode": "int8"}, "precision_mode"),
    ({"low_rank_method": "pca"}, "low_rank_method 'pca' is not one of: auto, pooled, nystrom"),
    ({"num_kv_heads": 3}, "num_kv_heads"), ({"embed_dim": 50}, "divisible"), ({"dropout": 1.5}, "dropout"),
    ({"fp8_max_rel_l2": 0}, "fp8_max_rel_l2 must be > 0"),
])
def test_bad_arguments_are_rejected(kw, match):
    args = {"embed_dim": E, "num_heads": H, **kw}
    with pytest.raises(ValueError, match=match):
        AdaAttention(**args)


@pytest.mark.parametrize("cls", [AdaAttention, AdaptiveFlashAttention])
def test_defaults_are_multihead_attentions(cls):
    # a drop-in keeps nn.MultiheadAttention's defaults: sequence-first code gets the same result unchanged
    ours, theirs = (inspect.signature(c.__init__).parameters for c in (cls, nn.MultiheadAttention))
    shared = sorted(set(ours) & set(theirs) - {"self", "embed_dim", "num_heads"})
    assert "batch_first" in shared
    assert {n: ours[n].default for n in shared} == {n: theirs[n].default for n in shared}
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H)
    ada = cls(E, H)
    ada.load_state_dict(mha.state_dict())
    x = torch.randn(7, 2, E)  # (L, B, E)
    torch.testing.assert_close(ada(x, x, x, need_weights=False)[0], mha(x, x, x, need_weights=False)[0],
                               atol=1e-5, rtol=1e-5)


def test_inputs_of_another_dtype_than_the_module_are_named():
    x = torch.randn(2, 5, E, dtype=torch.float64)
    with pytest.raises(ValueError, match="must have the module's dtype torch.float32.*got torch.float64"):
        AdaAttention(E, H, batch_first=True, kernel_manager=AttentionKernelManager())(x, x, x)


def test_bad_shapes_are_rejected():
    ada = AdaAttention(E, H, batch_first=True, kernel_manager=AttentionKernelManager())
    x = torch.randn(2, 5, E)
    with pytest.raises(ValueError, match="attn_mask"):
        ada(x, x, x, attn_mask=torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        ada(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="expected query"):
        ada(torch.randn(2, 5, E + 1), x, x)
    with pytest.raises(ValueError, match="backend"):
        AttentionKernelManager(backends=["nope"])


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_ada_attention_on_cuda_auto_precision():
    torch.manual_seed(6)
    mha = nn.MultiheadAttention(256, 4, batch_first=True, device="cuda")
    ada = AdaAttention(256, 4, batch_first=True, rank_mode="full", kernel_manager=AttentionKernelManager(),
                       device="cuda")
    ada.load_state_dict(mha.state_dict())
    x = torch.randn(2, 512, 256, device="cuda")
    for kw in [{}, {"key_padding_mask": torch.rand(2, 512, device="cuda") < 0.1}]:
        torch.testing.assert_close(ada(x, x, x, need_weights=False, **kw)[0], mha(x, x, x, **kw)[0], atol=3e-2,
                                   rtol=3e-2)
    stats = ada.get_statistics()
    assert stats["precisions"] == {"bfloat16": 2}  # Hopper / Ampere: bf16 compute from fp32 parameters
    assert stats["total_calls"] == 2 and set(stats["calls"]) <= set(BACKENDS), stats


def test_a_reduced_compute_dtype_returns_the_projections_dtype():
    """fp32 parameters computing attention in bf16 (as auto precision does on a GPU): the output projection gets
    fp32 back, eager and compiled."""
    ada = AdaAttention(E, H, batch_first=True, precision_mode="bf16", rank_mode="full",
                       kernel_manager=AttentionKernelManager())
    x = torch.randn(2, 8, E)
    out, _ = ada(x, x, x, need_weights=False)
    assert out.dtype == torch.float32 and ada.get_statistics()["precisions"] == {"bfloat16": 1}
    compiled = torch.compile(lambda x: ada(x, x, x, need_weights=False)[0], backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), out)
