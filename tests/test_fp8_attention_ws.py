"""The warp-specialized 8-bit attention (kernels/fp8_attention_ws.py, Gluon, Hopper; not yet wired in): on the
CPU, compiled for sm_90 (int8 and e4m3 wgmma, no local memory: nothing spills); on a GPU, the same attention as
the Triton kernel's over the same quantized K and V."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _gluon_compiles_without_a_gpu() -> bool:
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401  (Triton 3.9; 3.6 lacks it)
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _gluon_compiles_without_a_gpu(), reason="this Triton cannot compile Gluon for a target "
                    "without its GPU")
@pytest.mark.parametrize("causal, d", [(False, 128), (True, 128), (True, 64)])
def test_it_compiles_for_hopper_onto_both_8_bit_tensor_core_kinds_without_spilling(causal, d, tmp_path):
    # in a process of its own: the CPU tests interpret Triton (TRITON_INTERPRET=1), under which Gluon's decorator
    # makes interpreter functions that cannot be compiled
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "kernel.ptx"
    code = ("import sys; from adaattn.kernels.fp8_attention_ws import sm90_ptx; "
            f"open(sys.argv[1], 'w').write(sm90_ptx({causal}, d={d}))")
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, capture_output=True)
    ptx = out.read_text()
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert any(".s32.s8.s8" in line for line in mma)  # Q·K: int8 in, int32 sums
    assert any(".f32.e4m3.e4m3" in line for line in mma)  # P·V: e4m3 in, fp32 sums
    assert ".local" not in ptx  # no spill space: the consumer's accumulators fit its registers
    assert "setmaxnreg" in ptx  # the partitions' registers reallocated: the producer keeps few


@pytest.mark.gpu
@pytest.mark.parametrize("D, causal", [(128, False), (128, True), (64, False)])
def test_on_the_gpu_it_computes_the_triton_kernels_attention(D, causal):
    from adaattn.kernels.fp8_attention import fp8_attention_fwd, quantize_kv
    from adaattn.kernels.fp8_attention_ws import fp8_attention_ws

    torch.manual_seed(6)
    q = torch.randn(2, 4, 1000, D, device="cuda", dtype=torch.bfloat16)  # ragged: 1000 rows, blocks of 128
    k, v = (torch.randn(2, 2, 1000, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))  # GQA
    kv = quantize_kv(k, v, True, 128, True)
    got = fp8_attention_ws(q, kv, causal, D**-0.5)
    want = fp8_attention_fwd(q, kv, causal, D**-0.5, block_m=128, num_warps=8)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 5e-3
