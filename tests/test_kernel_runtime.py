"""What every kernel launcher shares (``kernels.runtime``): tuned configs looked up once a key, per-size picks,
Triton's specialisation, the direct launcher, the tuning problems.

On a CPU machine these run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py).
"""

import importlib

import pytest
import torch

from adaattn import kernels as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, dtype=torch.float32, strided=False):
    if strided:  # a slice of a wider buffer: larger strides, last dim contiguous
        return torch.randn(*shape[:-1], shape[-1] + 37, device=DEVICE, dtype=dtype)[..., : shape[-1]]
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def test_tuned_config_is_looked_up_once_per_key():
    """The first call of a key chooses its config (the interpreter: the first config); later calls
    look it up: same config, same result."""

    rn = importlib.import_module("adaattn.kernels.rms_norm")  # the module, not the function of that name

    from adaattn.kernels.runtime import TUNE_MIB, interpreter

    x, w = _randn(33, 136), _randn(136)
    first = K.rms_norm(x, w)
    key = (136, x.dtype, w.dtype)
    chosen = rn._fwd.chosen[key]
    # the interpreter runs the first config; a GPU keeps one per tuning size
    assert chosen == (rn._fwd.configs[0].all_kwargs(),) if interpreter() else len(chosen) == len(TUNE_MIB)
    torch.testing.assert_close(K.rms_norm(x, w), first, atol=0, rtol=0)
    assert rn._fwd.chosen[key] is chosen


def test_each_size_keeps_its_fastest_config():
    """One config per tuning size, the fastest there; ties go to the smaller total; a config that
    cannot run never wins; a call runs the config of the tuning size nearest its main input."""
    from adaattn.kernels.runtime import TUNE_MIB, picks_per_size, size_index

    inf = float("inf")
    assert picks_per_size([[1.0, 20.0], [1.1, 11.0], [1.05, 10.0]]) == [0, 2]
    assert picks_per_size([[inf, 1.0], [2.0, 2.0]]) == [1, 0]
    assert picks_per_size([[2.0, 2.0], [2.0, 1.0]]) == [1, 1]
    mib = 2**20 // 4  # fp32 elements per MiB
    assert [size_index(torch.empty(int(m * mib))) for m in TUNE_MIB] == list(range(len(TUNE_MIB)))
    assert size_index(torch.empty(1)) == 0 and size_index(torch.empty(4 * TUNE_MIB[-1] * mib)) == len(TUNE_MIB) - 1
    lo, hi = TUNE_MIB[0], TUNE_MIB[1]
    assert size_index(torch.empty(int(0.9 * (lo * hi) ** 0.5 * mib))) == 0
    assert size_index(torch.empty(int(1.1 * (lo * hi) ** 0.5 * mib))) == 1


def test_specialization_separates_what_triton_compiles_for():
    """The direct launch reuses a compiled kernel only for arguments Triton would compile the same
    way: an int that is 1, a multiple of 16 or wider than i32, a tensor's dtype and 16-byte
    alignment, a constexpr's value each make a new entry; other values of an int do not."""
    from adaattn.kernels.runtime import specialization

    t = torch.zeros(64, dtype=torch.bfloat16)
    const = [False, False, True]
    base = specialization([t, 7, 4], const)
    assert specialization([t, 9, 4], const) == base  # any other int of the same class
    for other in ([t, 1, 4], [t, 32, 4], [t, 2**31, 4], [t, 2**63, 4], [t[1:], 7, 4], [t.float(), 7, 4], [t, 7, 8]):
        assert specialization(other, const) != base, other
    assert specialization([t, True, 4], const) != specialization([t, 1, 4], const)
    assert specialization([t, 0.5, 4], const) == specialization([t, 2.0, 4], const)
    assert specialization([t, "x", 4], const) is None  # a kind it does not know: Triton's own launch


def test_launcher_takes_tritons_launch_in_the_interpreter_or_when_switched_off():
    """The interpreter always takes Triton's own launch; on a GPU the direct launch is on by default
    and ``set_direct_launch(False)`` turns it off (same values either way)."""

    from adaattn.kernels import runtime

    rn = importlib.import_module("adaattn.kernels.rms_norm")
    if runtime.interpreter():
        assert not rn._fwd.launch.direct()
    was = runtime._direct
    x, w = _randn(9, 40), _randn(40)
    direct = K.rms_norm(x, w)
    runtime.set_direct_launch(False)
    try:
        assert not rn._fwd.launch.direct()
        torch.testing.assert_close(K.rms_norm(x, w), direct, atol=0, rtol=0)
    finally:
        runtime.set_direct_launch(was)
    with pytest.raises(TypeError, match="True or False"):
        runtime.set_direct_launch(1)


@pytest.mark.parametrize("kernel", ["rms_norm", "swiglu", "rope", "qk_norm_rope"])
def test_without_grad_the_forward_launches_directly(kernel):
    """Without grad the eager entry points skip the autograd Function: same values, no graph."""
    x, w, q, k = _randn(5, 40), _randn(40), _randn(2, 6, 4, 16), _randn(2, 6, 2, 16)
    cos, sin = K.rope_cache(6, 16, device=DEVICE)
    call = {"rms_norm": lambda: K.rms_norm(x, w), "swiglu": lambda: K.swiglu(x, x),
            "rope": lambda: K.apply_rope(q, k, cos, sin),
            "qk_norm_rope": lambda: K.qk_norm_rope(q, k, w[:16], w[16:32], cos, sin)}[kernel]
    for t in (x, w, q, k):
        t.requires_grad_()
    with_grad = call()
    with torch.no_grad():
        without = call()
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (with_grad, without)), strict=True):
        assert a.grad_fn is not None and b.grad_fn is None
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["rms_norm._fwd", "rms_norm._bwd", "swiglu._fwd", "swiglu._bwd", "swiglu._fwd_flat",
                                  "swiglu._bwd_flat", "rope._rope", "rope._rope_inplace", "rope._qk_fwd",
                                  "rope._qk_bwd"])
def test_tuning_problems_run(name):
    """Every launcher's tuning problem builds from its key and runs (here at a few KB, in the
    interpreter): the key layout and the example factory agree."""

    module, attr = name.split(".")
    launch = getattr(importlib.import_module(f"adaattn.kernels.{module}"), attr.removesuffix("_inplace"))
    f32 = torch.float32
    key = {"rms_norm._fwd": (40, f32, f32), "rms_norm._bwd": (40, f32, f32, f32), "swiglu._fwd": (40, f32),
           "swiglu._bwd": (40, f32, f32), "swiglu._fwd_flat": (40, f32), "swiglu._bwd_flat": (40, f32, f32),
           "rope._rope": (4, 2, 8, f32, f32, f32, False), "rope._rope_inplace": (4, 2, 8, f32, f32, f32, True),
           "rope._qk_fwd": (4, 2, 8, f32, f32, f32, f32, f32),
           "rope._qk_bwd": (4, 2, 8, f32, f32, f32, f32, f32, f32, f32)}[name]
    out = launch.example(key, 4096, torch.device(DEVICE))()
    assert all(torch.isfinite(t).all() for t in (out if isinstance(out, tuple) else (out,)))
