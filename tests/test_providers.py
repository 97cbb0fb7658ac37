"""Every CPU-capable attention provider against the float64 reference, forward and backward.

Tolerance (flash-attention's rule): max|out - ref_fp64| <= 2 * max|out_torch_lowp - ref_fp64| + atol,
where out_torch_lowp is plain matmul-softmax-matmul in the same low precision.
"""

from pathlib import Path

import pytest
import torch

from adaattn.attention.providers import PROVIDERS, AttentionCase
from adaattn.errors import Unsupported
from adaattn.attention.reference import attention_ref

ATOL = {"fp32": 1e-5, "bf16": 1e-2}
CPU_PROVIDERS = [n for n, p in PROVIDERS.items() if p.unavailable("cpu") is None and n != "flex"]

# S=1 (single token), 199 (odd, not a multiple of any tile), 1023 (one short of a power of two);
# head dims 64 and 40 (not a multiple of 16); batch 3 and heads 5 so no dim is a power of two.
SHAPES = [(1, 2, 1, 64), (3, 5, 199, 40), (2, 3, 1023, 64)]


def _inputs(shape, dtype, requires_grad=False):
    return [torch.randn(shape, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def _case(shape, causal, dtype):
    b, h, s, d = shape
    return AttentionCase(batch=b, heads=h, seq_len=s, head_dim=d, causal=causal, dtype=dtype, device="cpu")


def _run(provider, case, q, k, v):
    p = PROVIDERS[provider]
    if p.layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = p.build(case)(q, k, v)
    return out.transpose(1, 2) if p.layout == "bshd" else out


@pytest.mark.parametrize("provider", CPU_PROVIDERS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forward_matches_float64(provider, shape, causal, dtype):
    case = _case(shape, causal, dtype)
    q, k, v = _inputs(shape, case.torch_dtype)
    ref = attention_ref(q, k, v, causal)
    lowp = PROVIDERS["standard"].build(case)(q, k, v)
    try:
        out = _run(provider, case, q, k, v)
    except Unsupported as err:
        pytest.skip(str(err))
    assert out.shape == ref.shape and out.dtype == case.torch_dtype
    bound = 2 * (lowp.double() - ref).abs().max() + ATOL[dtype]
    assert (out.double() - ref).abs().max() <= bound


@pytest.mark.parametrize("provider", CPU_PROVIDERS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_float64(provider, causal):
    shape = (2, 3, 199, 40)
    case = _case(shape, causal, "fp32")
    q, k, v = _inputs(shape, torch.float32, requires_grad=True)
    grad = torch.randn(shape)
    _run(provider, case, q, k, v).backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    attention_ref(q64, k64, v64, causal).backward(grad.double())
    for ours, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert (ours.double() - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-5


@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_rows_sum_to_one(provider):
    """Invariant: with v = 1 every output is exactly a convex combination of ones."""
    shape = (2, 2, 77, 32)
    case = _case(shape, True, "fp32")
    q, k, _ = _inputs(shape, torch.float32)
    out = _run(provider, case, q, k, torch.ones(shape))
    torch.testing.assert_close(out, torch.ones(shape), atol=1e-5, rtol=0)


def test_flex_compiled_matches_float64():
    """FlexAttention through torch.compile on CPU (one shape: a compile costs ~20 s on 2 cores)."""
    shape = (2, 3, 199, 64)
    case = _case(shape, True, "fp32")
    q, k, v = _inputs(shape, torch.float32)
    out = _run("flex", case, q, k, v)
    ref = attention_ref(q, k, v, True)
    assert (out.double() - ref).abs().max() <= 2 * (PROVIDERS["standard"].build(case)(q, k, v).double()
                                                   - ref).abs().max() + ATOL["fp32"]
    assert "cpu" not in PROVIDERS["flex"].backward_devices  # flex has no CPU backward: recorded as such


def test_forced_backend_raises_instead_of_falling_back():
    """sdpa_flash on CPU with an input flash cannot take must raise, not quietly run math."""
    case = _case((1, 2, 16, 64), False, "fp32")
    q, k, _ = _inputs((1, 2, 16, 64), torch.float32)
    v = torch.randn(1, 2, 16, 32)  # a value head dim unlike the query's: flash has no kernel for it
    with pytest.raises(Unsupported, match="SDPA FLASH_ATTENTION rejected"):
        PROVIDERS["sdpa_flash"].build(case)(q, k, v)
    assert PROVIDERS["sdpa_math"].build(case)(q, k, v).shape == (1, 2, 16, 32)  # math takes it


def test_gpu_only_providers_say_why_on_cpu():
    for name in ("sdpa_cudnn", "sdpa_efficient", "xformers_cutlass", "flash_attn"):
        assert "no cpu implementation" in PROVIDERS[name].unavailable("cpu")


def test_reference_is_chunk_invariant():
    q, k, v = _inputs((1, 2, 300, 16), torch.float64)
    torch.testing.assert_close(attention_ref(q, k, v, True, chunk=64), attention_ref(q, k, v, True, chunk=4096))
    with pytest.raises(ValueError, match="B, H, S, D"):
        attention_ref(q[0], k[0], v[0])


def test_attention_study_compile_groups():
    from adaattn_pipeline.config import load_params
    from adaattn_experiments.attention_backends.study import AttentionBackends

    params, _ = load_params(Path(__file__).parents[1] / "params.yaml")
    for device, target in (("cpu", "cpu"), ("cuda", "h100")):
        study = AttentionBackends(device)
        cases = study.cases(params, params.targets[target])
        groups = study.compile_groups(cases)
        # every flex first call the harness will make, in the harness's order, cut into segments
        expected = [(c, "flex", m) for c in cases if "flex" in c.providers for m in c.modes
                    if m == "fwd" or study.has_backward("flex")]
        assert [item for g in groups for item in g] == expected
        keys = [{study.compile_key(c, p) for c, p, _ in g} for g in groups]
        assert all(len(k) == 1 for k in keys)  # one compile key per segment
        assert all(a != b for a, b in zip(keys, keys[1:]))  # maximal runs
        if device == "cuda":  # B = 1 (S = 16384 at 16384 tokens) is a segment of its own
            assert any(c.config["batch"] == 1 for g in groups for c, _, _ in g)
            assert all(len({c.config["batch"] == 1 for c, _, _ in g}) == 1 for g in groups)
            host = study.host_warm_items(cases)
            assert {p for _, p, _ in host} == {"sdpa", "sdpa_cudnn"}
            assert {m for _, _, m in host} == {"fwd", "fwd_bwd"}
    assert all(m == "fwd" for g in AttentionBackends("cpu").compile_groups(
        AttentionBackends("cpu").cases(params, params.targets["cpu"])) for _, _, m in g)  # no CPU flex backward
