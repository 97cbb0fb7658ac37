"""GPU checks (skipped without CUDA): forced backends run their own kernels, timer, memory, accuracy."""

import time

import pytest
import torch

from adaattn.attention.providers import PROVIDERS, AttentionCase
from adaattn.attention.reference import attention_ref
from adaattn.timing.memory import kernels_ran, peak_memory_bytes
from adaattn.timing.timers import CudaTimer
from adaattn.errors import Unsupported

pytestmark = pytest.mark.gpu

# provider -> a substring every kernel name of that backend carries (torch 2.11 - 2.13 on Hopper)
FORCED_KERNELS = {"sdpa_flash": "flash", "sdpa_efficient": "fmha_cutlass", "sdpa_cudnn": "cudnn", "sdpa_math": "gemm"}


def _case(b, h, s, d, causal, dtype):
    return AttentionCase(batch=b, heads=h, seq_len=s, head_dim=d, causal=causal, dtype=dtype, device="cuda")


def _qkv(case, layout="bhsd"):
    shape = (case.batch, case.heads, case.seq_len, case.head_dim)
    qkv = [torch.randn(shape, device="cuda", dtype=case.torch_dtype) for _ in range(3)]
    return qkv if layout == "bhsd" else [t.transpose(1, 2).contiguous() for t in qkv]


@pytest.mark.parametrize("provider", sorted(FORCED_KERNELS))
def test_forced_backend_runs_its_kernel(provider):
    case = _case(4, 8, 1024, 64, False, "bf16")
    q, k, v = _qkv(case)
    fn = PROVIDERS[provider].build(case)
    names = kernels_ran(lambda: fn(q, k, v), "cuda", top=5)
    assert FORCED_KERNELS[provider] in names.lower(), names


# 1023: not a multiple of any tile; head dim 128 and 64; both masks
@pytest.mark.parametrize("provider", [n for n, p in PROVIDERS.items() if "cuda" in p.devices])
@pytest.mark.parametrize("shape", [(2, 8, 1023, 128), (3, 4, 256, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_providers_match_float64(provider, shape, causal):
    p = PROVIDERS[provider]
    if reason := p.unavailable("cuda"):
        pytest.skip(reason)
    case = _case(*shape, causal, "bf16")
    q, k, v = _qkv(case)
    ref = attention_ref(q, k, v, causal)
    lowp = PROVIDERS["standard"].build(case)(q, k, v)
    args = (q, k, v) if p.layout == "bhsd" else [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    try:
        out = p.build(case)(*args)
    except Unsupported as err:
        pytest.skip(str(err))
    out = out if p.layout == "bhsd" else out.transpose(1, 2)
    assert (out.double() - ref).abs().max() <= 2 * (lowp.double() - ref).abs().max() + 1e-2


def test_cuda_timer_and_memory():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    q = CudaTimer(warmup_ms=5, rep_ms=20)(lambda: a @ a)
    assert 0 < q.p20 <= q.p50 <= q.p80 and q.n >= CudaTimer.MIN_REPEATS
    peak = peak_memory_bytes(lambda: torch.empty(64 * 2**20, device="cuda", dtype=torch.uint8), "cuda")
    assert peak == 64 * 2**20


def test_kernel_time_is_the_device_share_of_a_call():
    """Kernel time of a GPU-bound call matches its event time; of a host-bound call it is far below."""
    from adaattn.timing.timers import kernel_time_ms

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    events = CudaTimer(warmup_ms=5, rep_ms=20)(lambda: a @ a)
    kernel = kernel_time_ms(lambda: a @ a, 10)
    assert kernel.n == 10
    assert 0.8 < kernel.p50 / events.p50 < 1.1
    x = torch.randn(64, device="cuda")

    def host_bound():
        time.sleep(0.002)  # 2 ms of host work before a tiny kernel
        return x * 2

    assert kernel_time_ms(host_bound, 5).p50 < 0.1 < CudaTimer(warmup_ms=5, rep_ms=20)(host_bound).p50


def test_kernel_times_round_robin_keeps_each_functions_samples():
    """Calls interleaved in one trace come back per function: a large GEMM's samples all exceed a
    small one's, whichever is listed first."""
    from adaattn.timing.timers import kernel_times_ms

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    for order in ((a, b), (b, a)):
        samples = kernel_times_ms([lambda m=m: m @ m for m in order], 6).samples
        assert [len(s) for s in samples] == [6, 6]
        big, small = samples if order[0] is a else samples[::-1]
        assert min(big) > 10 * max(small)


def test_direct_launch_matches_tritons_launch():
    """The cached direct launch gives Triton's own results, also when a later call changes what
    Triton specialises on (an unaligned slice, a stride of 1): each gets its own compiled kernel."""
    import importlib

    from adaattn import kernels as K
    from adaattn.kernels import runtime

    rope = importlib.import_module("adaattn.kernels.rope")

    cos, sin = K.rope_cache(64, 128, device="cuda")
    base = torch.randn(2, 64, 9, 128, device="cuda", dtype=torch.bfloat16)
    flat = torch.randn(3 + base.numel(), device="cuda", dtype=torch.bfloat16)
    unaligned = flat[3:].view(base.shape)  # 6 bytes past a 16-byte boundary
    assert unaligned.data_ptr() % 16
    cases = [(base[:, :, :8], base[:, :, 8:]), (unaligned[:, :, :8], unaligned[:, :, 8:]),
             (base[:1, :1, :8], base[:1, :1, 8:])]
    before = len(rope._rope.launch.compiled)
    for q, k in cases:
        direct = [K.apply_rope(q, k, cos, sin) for _ in range(2)]  # the second call launches directly
        runtime.set_direct_launch(False)
        try:
            plain = K.apply_rope(q, k, cos, sin)
        finally:
            runtime.set_direct_launch(True)
        for d in direct:
            for a, b in zip(d, plain, strict=True):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert len(rope._rope.launch.compiled) >= before + len(cases)


def test_tuning_times_kernels_from_a_trace():
    """A new key is tuned on kernel times from a CUPTI trace: one finite time per config and size."""
    import importlib

    from adaattn.kernels import runtime

    rms_norm = importlib.import_module("adaattn.kernels.rms_norm")
    x, w = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16), torch.ones(1000, device="cuda")
    rms_norm.rms_norm_fwd(x, w, 1e-6)
    timings = rms_norm._fwd.timings[(1000, torch.bfloat16, torch.float32)]
    assert len(timings) > 1 and all(len(t) == len(runtime.TUNE_MIB) for _, t in timings)
    assert all(0 < ms < 1 for _, t in timings for ms in t)
    chosen = rms_norm._fwd.chosen[(1000, torch.bfloat16, torch.float32)]
    assert len(chosen) == len(runtime.TUNE_MIB)
    for j, meta in enumerate(chosen):  # the fastest config at each tuning size
        assert next(t[j] for m, t in timings if m == meta) == min(t[j] for _, t in timings)


def test_tuning_inside_a_profiler_times_cuda_graphs():
    """While another profiler runs (no second trace can start), tuning times configs in CUDA graphs."""
    import importlib

    rms_norm = importlib.import_module("adaattn.kernels.rms_norm")
    x, w = torch.randn(64, 1001, device="cuda", dtype=torch.bfloat16), torch.ones(1001, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        y, _ = rms_norm.rms_norm_fwd(x, w, 1e-6)
    timings = rms_norm._fwd.timings[(1001, torch.bfloat16, torch.float32)]
    assert len(timings) > 1 and all(0 < ms < 1 for _, t in timings for ms in t)
    torch.testing.assert_close(y.float(), rms_norm_ref_fp32(x, w), atol=2e-2, rtol=2e-2)


def rms_norm_ref_fp32(x, w):
    from adaattn.kernels.reference import rms_norm_ref

    return rms_norm_ref(x.float(), w.float(), 1e-6)
