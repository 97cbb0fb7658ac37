"""RMSNorm Triton kernels against the fp32 reference: forward, backward, odd and strided shapes, compile.

On a CPU machine these run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py).
"""

import pytest
import torch

from adaattn.kernels.rms_norm import rms_norm, rms_norm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# One tolerance table keyed by dtype: (atol, rtol) for outputs and input gradients vs the fp32 reference.
TOL = {"fp32": (1e-5, 1e-5), "fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}


def _data(rows: int, hidden: int, dtype: torch.dtype, strided: bool = False):
    if strided:  # rows of a wider buffer: row stride > hidden, last dim contiguous
        x = torch.randn(rows, hidden + 37, device=DEVICE, dtype=dtype)[:, :hidden]
    else:
        x = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    return x, w


def _grads(fn, x, w, dy):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y, x.grad, w.grad


# rows 1 / 199 / 1023 (single row, odd, one short of a power of two); hidden 96 and 770 (not powers
# of two, 770 not a multiple of 16); strided rows; every dtype
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows,hidden", [(1, 96), (199, 770), (1023, 96)])
@pytest.mark.parametrize("strided", [False, True])
def test_forward_backward_match_reference(dtype, rows, hidden, strided):
    x, w = _data(rows, hidden, DTYPES[dtype], strided)
    dy = torch.randn(rows, hidden, device=DEVICE, dtype=DTYPES[dtype])
    y, dx, dw = _grads(rms_norm, x, w, dy)
    # reference in fp32 on upcast inputs
    y_ref, dx_ref, dw_ref = _grads(lambda a, b: rms_norm_ref(a, b), x.float(), w.float(), dy.float())
    atol, rtol = TOL[dtype]
    assert y.dtype == x.dtype and dw.dtype == w.dtype
    torch.testing.assert_close(y.float(), y_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx.float(), dx_ref, atol=atol, rtol=rtol)
    # the weight gradient sums over rows: compare relative to its scale (summed in fp32, cast once)
    scale = dw_ref.abs().max()
    assert (dw.float() - dw_ref).abs().max() <= rtol * scale + atol * rows**0.5


def test_bf16_weight_gradient_is_summed_in_fp32():
    """Summing 4096 bf16 terms in bf16 loses ~2 digits; the kernel's fp32 partials do not."""
    x, w = _data(4096, 64, torch.bfloat16)
    dy = torch.randn(4096, 64, device=DEVICE, dtype=torch.bfloat16)
    _, _, dw = _grads(rms_norm, x, w, dy)
    _, _, dw_ref = _grads(rms_norm_ref, x.double(), w.double(), dy.double())
    rel = ((dw.double() - dw_ref).norm() / dw_ref.norm()).item()
    assert rel < 8e-3  # one bf16 rounding of the result (2^-8 = 3.9e-3) plus fp32 noise


def test_batched_input_keeps_shape():
    x = torch.randn(2, 3, 5, 40, device=DEVICE)
    w = torch.randn(40, device=DEVICE)
    y = rms_norm(x, w)
    assert y.shape == x.shape
    torch.testing.assert_close(y, rms_norm_ref(x, w), atol=1e-5, rtol=1e-5)


def test_compiles_fullgraph():
    def block(x, w):
        return rms_norm(x, w) * 2 + 1

    x, w = _data(33, 96, torch.float32)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), block(x, w))
    xg = x.clone().requires_grad_()
    compiled(xg, w).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


def test_bad_inputs_are_rejected():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7, device=DEVICE))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        rms_norm(x.double(), torch.ones(8, device=DEVICE, dtype=torch.float64))
