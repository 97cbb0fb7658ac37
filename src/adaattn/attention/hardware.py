"""What the machine can do for attention: the guide's CUDAManager, with CPU-only machines a first-class case.

``HardwareCapabilities.detect(device)`` reads the device once: compute capability, which reduced
precisions it runs natively (bf16 from Ampere, fp16 from Volta, fp8 from Ada/Hopper), TF32, and
the memory budget. ``default_dtype`` is the precision ``precision_mode="auto"`` starts from:
bf16 on Ampere and newer, fp16 on Volta and Turing, fp32 on a CPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HardwareCapabilities:
    device: str  # "cpu" or "cuda:<index>"
    name: str
    compute_capability: tuple[int, int] | None  # None on a CPU
    bf16: bool
    fp16: bool
    fp8: bool
    tf32: bool
    memory_bytes: int  # total device memory (CUDA) or physical RAM (CPU)

    @property
    def is_cuda(self) -> bool:
        return self.compute_capability is not None

    @property
    def default_dtype(self) -> torch.dtype:
        """Precision of ``precision_mode="auto"``: Hopper/Ampere bf16, Volta/Turing fp16, CPU fp32."""
        if not self.is_cuda:
            return torch.float32
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @staticmethod
    def detect(device: str | torch.device | None = None) -> HardwareCapabilities:
        dev = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        if dev.type == "cuda":
            return _cuda(dev.index if dev.index is not None else torch.cuda.current_device())
        if dev.type != "cpu":
            raise ValueError(f"device {dev} is not supported; allowed: cpu, cuda[:index]")
        return _cpu()


@functools.cache
def _cuda(index: int) -> HardwareCapabilities:
    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    return HardwareCapabilities(device=f"cuda:{index}", name=props.name, compute_capability=cc, bf16=cc >= (8, 0),
                                fp16=cc >= (7, 0), fp8=cc >= (8, 9), tf32=cc >= (8, 0), memory_bytes=props.total_memory)


@functools.cache
def _cpu() -> HardwareCapabilities:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        memory = 0
    import platform

    return HardwareCapabilities(device="cpu", name=platform.processor() or platform.machine(), compute_capability=None,
                                bf16=False, fp16=False, fp8=False, tf32=False, memory_bytes=memory)


CUDAManager = HardwareCapabilities  # the guide's name
