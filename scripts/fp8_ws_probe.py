"""Issue 68's warp-specialized 8-bit attention (``kernels.fp8_attention_ws``, not yet in the precision study) on a
GPU, scratch numbers for docs/notebook.md: its error against the Triton kernel over the same quantized K and V and
against cuDNN bf16, and the three's TFLOP/s at the precision study's shape (B = 2, H = 16, D = 128), S = 4K and
16K, causal and not. The Triton kernel runs its own launch config (``launch_config``) and quantization blocks.

    . scripts/device_setup.sh && python3 scripts/fp8_ws_probe.py      # on the GPU box
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaattn.kernels.fp8_attention import fp8_attention_fwd, launch_config, quantize_kv
from adaattn.kernels.fp8_attention_ws import fp8_attention_ws

B, H, D = 2, 16, 128


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def tflops(ms: float, S: int, causal: bool) -> float:
    return 4 * B * H * S * S * D / (2 if causal else 1) / ms / 1e9


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40)


def cudnn(q, k, v, causal):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main() -> None:
    scale = D**-0.5
    for S in (4096, 16384):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            kv = quantize_kv(k, v, True, 128, True)
            try:
                out = fp8_attention_ws(q, kv, causal, scale)
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - a probe: the failure is the reading
                print(f"S={S} causal={causal} FAILED {type(err).__name__}: {str(err)[:800]}", flush=True)
                continue
            lib = fp8_attention_fwd(q, kv, causal, scale, block_m=128, num_warps=8)
            ref = cudnn(q, k, v, causal)
            own = quantize_kv(k, v, True, launch_config(causal).block_n, True)  # the Triton kernel's own blocks
            t_ws = bench(lambda: fp8_attention_ws(q, kv, causal, scale))
            t_lib = bench(lambda: fp8_attention_fwd(q, own, causal, scale))
            t_cu = bench(lambda: cudnn(q, k, v, causal))
            print(f"S={S} causal={causal} rel_l2 ws/triton {rel(out, lib):.4f} ws/cudnn {rel(out, ref):.4f} "
                  f"triton/cudnn {rel(lib, ref):.4f}; TFLOP/s ws {tflops(t_ws, S, causal):.0f} triton "
                  f"{tflops(t_lib, S, causal):.0f} cudnn {tflops(t_cu, S, causal):.0f}", flush=True)


if __name__ == "__main__":
    main()
