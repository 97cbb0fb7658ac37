"""Adaptive precision for attention: pick the compute dtype, guard its numerics, escalate when needed.

``precision_mode``: "fp32", "bf16", "fp16" (fixed) or "auto": the hardware's default
(``HardwareCapabilities.default_dtype``: Hopper and Ampere bf16, Volta fp16, CPU fp32), then two
guards, each escalating to fp32 and recording why:

- overflow (fp16 only, every eager call, two reductions): the logit bound scale * max|q| * max|k| * D
  over the fp16 range means a score may overflow before the softmax;
- accuracy (first call of each signature, then every ``recheck_every`` calls): attention of a
  sample of query rows in the chosen dtype vs float32; cosine similarity below ``min_cosine``
  or relative L1 above ``max_rel_l1`` escalates.

The guards read values on the host, so they run on eager calls only; a compiled call runs the dtype
last decided for its signature (``decided``), or the mode's base dtype where none was.

Low-precision (FP8 / INT8) attention will come from a later kernel issue: ``LOW_PRECISION`` is
where it plugs in; nothing here claims anything for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from adaattn.attention.hardware import HardwareCapabilities

MODES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_MODES = (*MODES, "auto")
LOW_PRECISION: dict[str, object] = {}  # "fp8", "int8": filled by a later kernel issue
FP16_MAX = torch.finfo(torch.float16).max


@dataclass
class PrecisionPolicy:
    mode: str = "auto"
    min_cosine: float = 0.999
    max_rel_l1: float = 0.02
    sample_rows: int = 64
    recheck_every: int = 1000
    escalations: list[dict] = field(default_factory=list)  # {"from", "to", "reason", "signature"}
    # signature -> (dtype, calls left before the next sampled check; <= 0: the next call checks)
    _checked: dict[str, tuple[torch.dtype, int]] = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in PRECISION_MODES:
            raise ValueError(f"precision_mode {self.mode!r} is not one of: {', '.join(PRECISION_MODES)}")
        if not (0 < self.min_cosine <= 1) or self.max_rel_l1 <= 0 or self.sample_rows < 1 or self.recheck_every < 1:
            raise ValueError("min_cosine in (0, 1], max_rel_l1 > 0, sample_rows >= 1 and recheck_every >= 1 required")

    def base_dtype(self, hw: HardwareCapabilities) -> torch.dtype:
        if self.mode != "auto":
            dtype = MODES[self.mode]
            if hw.is_cuda and ((dtype == torch.bfloat16 and not hw.bf16) or (dtype == torch.float16 and not hw.fp16)):
                raise ValueError(f"precision_mode {self.mode!r} is not supported by {hw.name} "
                                 f"(compute capability {hw.compute_capability})")
            return dtype
        return hw.default_dtype

    def _escalate(self, dtype: torch.dtype, reason: str, sig: str) -> torch.dtype:
        new = torch.float32  # auto starts from fp16 only where bf16 is missing (Volta, Turing)
        self.escalations.append({"from": str(dtype).removeprefix("torch."), "to": str(new).removeprefix("torch."),
                                 "reason": reason, "signature": sig})
        return new

    def choose(self, q: Tensor, k: Tensor, v: Tensor, scale: float, hw: HardwareCapabilities, sig: str) -> torch.dtype:
        """The compute dtype for this call (q, k, v in any float dtype, (B, H, L, D) layout)."""
        seen = self._checked.get(sig)
        dtype, due = seen if seen is not None else (self.base_dtype(hw), 0)
        if self.mode != "auto" or dtype == torch.float32:
            self._checked[sig] = (dtype, due)
            return dtype
        if dtype == torch.float16:
            bound = scale * q.detach().abs().amax().item() * k.detach().abs().amax().item() * q.shape[-1]
            if not math.isfinite(bound) or bound > FP16_MAX:
                dtype = self._escalate(dtype, f"logit bound {bound:.3g} exceeds the fp16 range ({FP16_MAX:.0f})",
                                       sig)
        if due <= 0 and dtype != torch.float32:
            cos, rel = self.sample_error(q, k, v, scale, dtype)
            if cos < self.min_cosine or rel > self.max_rel_l1:
                dtype = self._escalate(dtype, f"sampled rows: cosine {cos:.5f} (min {self.min_cosine}), "
                                              f"relative L1 {rel:.4f} (max {self.max_rel_l1})", sig)
            due = self.recheck_every
        self._checked[sig] = (dtype, due - 1)
        return dtype

    def decided(self, sig: str) -> torch.dtype | None:
        """The dtype ``choose`` last returned for ``sig`` (None: not decided yet); what a compiled call runs."""
        seen = self._checked.get(sig)
        return None if seen is None else seen[0]

    def sample_error(self, q: Tensor, k: Tensor, v: Tensor, scale: float, dtype: torch.dtype) -> tuple[float, float]:
        """(cosine similarity, relative L1) of attention for up to ``sample_rows`` query rows in ``dtype``
        vs float32, all keys, no mask: a check of the numerics, not of the masking."""
        with torch.no_grad():
            rows = torch.linspace(0, q.shape[2] - 1, min(self.sample_rows, q.shape[2]), device=q.device).long()
            qs = q.detach()[:, :, rows]
            g = q.shape[1] // k.shape[1]
            kk, vv = (t.detach().repeat_interleave(g, dim=1) for t in (k, v))
            ref = F.scaled_dot_product_attention(qs.float(), kk.float(), vv.float(), scale=scale)
            low = F.scaled_dot_product_attention(qs.to(dtype), kk.to(dtype), vv.to(dtype), scale=scale).float()
            cos = F.cosine_similarity(low.flatten(), ref.flatten(), dim=0).item()
            rel = ((low - ref).abs().sum() / ref.abs().sum().clamp_min(1e-30)).item()
        return cos, rel


@torch.compiler.assume_constant_result  # a constant of the compiled graph: read once, never traced
def traced_dtype(mode: str, device_type: str, index: int | None) -> torch.dtype:
    """The dtype a compiled call runs for a signature without a decision: the mode's (fixed) or the
    hardware's default (auto), without the guards, which look at data."""
    device = device_type if index is None else f"{device_type}:{index}"
    return PrecisionPolicy(mode).base_dtype(HardwareCapabilities.detect(device))
