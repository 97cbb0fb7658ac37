"""Adaptive precision for attention: pick the compute dtype, guard its numerics, escalate when needed.

``precision_mode``: "fp32", "bf16", "fp16" (fixed), "fp8" (8 bits where the FP8 guard allows, else bf16) or
"auto": the hardware's default
(``HardwareCapabilities.default_dtype``: Hopper and Ampere bf16, Volta fp16, CPU fp32), then two
guards, each escalating to fp32 and recording why:

- overflow (fp16 only, every eager call, two reductions): the logit bound scale * max|q| * max|k| * D
  over the fp16 range means a score may overflow before the softmax;
- accuracy (first call of each signature, then every ``recheck_every`` calls): attention of a
  sample of query rows in the chosen dtype vs float32; cosine similarity below ``min_cosine``
  or relative L1 above ``max_rel_l1`` escalates.

FP8 (``precision_mode="fp8"``, opt-in: forward only, and lossier than bf16 by design): the attention of
``kernels/fp8_attention.py`` (e4m3 Q, K and V, bf16 in and out) where it can run (FP8 tensor cores, no gradient,
no arbitrary mask, head dim 32, 64 or 128, causal only over as many keys as queries) and where the guard
accepts it, else bf16. The guard runs the FP8 kernel on a few whole query blocks (``fp8_sample_blocks``: first,
middle, last) against float32 attention over the same inputs: a block's rows come out of the sample exactly as
out of the whole call (same quantization, same kernel), so the estimate is the call's own error on those rows,
and it takes the largest block's relative L2 error, an upper bound of the sampled rows' joint error. FP8 is
chosen where that estimate is at most ``fp8_max_rel_l2``; every check is kept (``fp8_checks``).

The guards read values on the host, so they run on eager calls only; a compiled call runs the dtype
last decided for its signature (``decided``), or the mode's base dtype where none was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from adaattn.attention.hardware import HardwareCapabilities

MODES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_MODES = (*MODES, "fp8", "auto")
FP8 = torch.float8_e4m3fn  # the policy's name for the FP8 attention (its inputs and output are bf16)
FP16_MAX = torch.finfo(torch.float16).max


@dataclass
class PrecisionPolicy:
    mode: str = "auto"
    min_cosine: float = 0.999
    max_rel_l1: float = 0.02
    sample_rows: int = 64
    recheck_every: int = 1000
    fp8_max_rel_l2: float = 0.03
    fp8_sample_blocks: int = 3
    escalations: list[dict] = field(default_factory=list)  # {"from", "to", "reason", "signature"}
    # signature -> the FP8 guard's last check: {"accepted", "estimate" (None: not run), "bound", "reason"}
    fp8_checks: dict[str, dict] = field(default_factory=dict)
    # signature -> (dtype, calls left before the next sampled check; <= 0: the next call checks)
    _checked: dict[str, tuple[torch.dtype, int]] = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in PRECISION_MODES:
            raise ValueError(f"precision_mode {self.mode!r} is not one of: {', '.join(PRECISION_MODES)}")
        if not (0 < self.min_cosine <= 1) or self.max_rel_l1 <= 0 or self.sample_rows < 1 or self.recheck_every < 1:
            raise ValueError("min_cosine in (0, 1], max_rel_l1 > 0, sample_rows >= 1 and recheck_every >= 1 required")
        if not self.fp8_max_rel_l2 > 0 or self.fp8_sample_blocks < 1:
            raise ValueError(f"fp8_max_rel_l2 must be > 0 and fp8_sample_blocks >= 1; got {self.fp8_max_rel_l2}, "
                             f"{self.fp8_sample_blocks}")

    def base_dtype(self, hw: HardwareCapabilities) -> torch.dtype:
        if self.mode == "fp8":  # FP8's fallback, and a compiled call's without a decision
            return torch.bfloat16 if hw.bf16 or not hw.is_cuda else hw.default_dtype
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

    def choose(self, q: Tensor, k: Tensor, v: Tensor, scale: float, hw: HardwareCapabilities, sig: str,
               mask_kind: str = "none", dropout: bool = False) -> torch.dtype:
        """The compute dtype for this call (q, k, v in any float dtype, (B, H, L, D) layout); ``FP8`` for the FP8
        attention (mode "fp8")."""
        if self.mode == "fp8":
            return self._choose_fp8(q, k, v, scale, hw, sig, mask_kind, dropout)
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

    def _choose_fp8(self, q: Tensor, k: Tensor, v: Tensor, scale: float, hw: HardwareCapabilities, sig: str,
                    mask_kind: str, dropout: bool) -> torch.dtype:
        seen = self._checked.get(sig)
        if seen is not None and seen[1] > 0:
            self._checked[sig] = (seen[0], seen[1] - 1)
            return seen[0]
        why = fp8_why_not(q, k, hw, mask_kind, dropout)
        estimate = None if why else self.fp8_estimate(q, k, v, scale, mask_kind == "causal")
        accepted = why is None and estimate <= self.fp8_max_rel_l2
        if why is None:
            why = None if accepted else f"estimated relative L2 {estimate:.4f} over the bound {self.fp8_max_rel_l2}"
        self.fp8_checks[sig] = {"accepted": accepted, "estimate": estimate, "bound": self.fp8_max_rel_l2,
                                "reason": why}
        dtype = FP8 if accepted else self.base_dtype(hw)
        self._checked[sig] = (dtype, self.recheck_every - 1)
        return dtype

    def fp8_estimate(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> float:
        """The FP8 attention's relative L2 error against float32 on ``fp8_sample_blocks`` whole query blocks
        (evenly spaced), the largest block's: each block's rows are the very values the whole call gives."""
        from adaattn.kernels.fp8_attention import fp8_attention_fwd, launch_config, quantize_kv

        with torch.no_grad():
            q, k, v = (t.detach().to(torch.bfloat16) for t in (q, k, v))
            q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
            L, S = q.shape[2], k.shape[2]
            cfg = launch_config(causal)
            block_m = cfg.block_m
            n_blocks = -(-L // block_m)
            picks = sorted({round(i * (n_blocks - 1) / max(1, self.fp8_sample_blocks - 1))
                            for i in range(min(self.fp8_sample_blocks, n_blocks))})
            kv = quantize_kv(k, v, block_n=cfg.block_n)
            g = q.shape[1] // k.shape[1]
            kf, vf = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
            worst = 0.0
            for b in picks:
                rows = slice(b * block_m, min(L, (b + 1) * block_m))
                got = fp8_attention_fwd(q[:, :, rows], kv, causal, scale, q_offset=b * block_m).float()
                mask = None
                if causal:  # the block's positions among the keys: b * block_m ...
                    pos = torch.arange(rows.start, rows.stop, device=q.device)
                    mask = pos[:, None] >= torch.arange(S, device=q.device)[None, :]
                ref = F.scaled_dot_product_attention(q[:, :, rows].float(), kf, vf, attn_mask=mask, scale=scale)
                worst = max(worst, ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item())
        return worst

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


def fp8_why_not(q: Tensor, k: Tensor, hw: HardwareCapabilities, mask_kind: str, dropout: bool = False) -> str | None:
    """Why the FP8 attention cannot run this call (None: it can)."""
    from adaattn.kernels.runtime import interpreter, use_triton

    if not (hw.fp8 or (not hw.is_cuda and interpreter())):
        return f"{hw.name} has no FP8 tensor cores (compute capability 8.9 or newer)"
    if not use_triton(q, k):
        return "the Triton kernels are off or cannot run here"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return "the FP8 attention is a forward only; this call needs a gradient"
    if mask_kind == "mask":
        return "the FP8 attention takes no mask (causal or none)"
    if dropout:
        return "the FP8 attention has no dropout (a module in training with dropout)"
    if q.shape[-1] not in (32, 64, 128):
        return f"head dim {q.shape[-1]}: the FP8 attention takes 32, 64 or 128"
    if mask_kind == "causal" and q.shape[2] != k.shape[2]:
        return "causal over more keys than queries"
    return None


@torch.compiler.assume_constant_result  # a constant of the compiled graph: read once, never traced
def traced_dtype(mode: str, device_type: str, index: int | None) -> torch.dtype:
    """The dtype a compiled call runs for a signature without a decision: the mode's (fixed) or the
    hardware's default (auto), without the guards, which look at data."""
    device = device_type if index is None else f"{device_type}:{index}"
    return PrecisionPolicy(mode).base_dtype(HardwareCapabilities.detect(device))
