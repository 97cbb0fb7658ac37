"""The kernels study's sections: G4-T2's point and G4-T1's sweep."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator

from adaattn_pipeline.config import ByProfile, DType
from adaattn_pipeline.config import Section as _Section

KERNEL_PROVIDERS = ("eager", "compile", "liger", "ours", "ours_inplace")  # ours_inplace: RoPE only
KernelName = Literal["rms_norm", "swiglu", "rope", "qk_norm_rope"]


class _KernelCommon(_Section):
    dtypes: Annotated[list[DType], Field(min_length=1)]
    modes: Annotated[list[Literal["fwd", "bwd", "fwd_bwd"]], Field(min_length=1)]
    providers: Annotated[list[Literal[KERNEL_PROVIDERS]], Field(min_length=1)]  # type: ignore[valid-type]
    head_dim: PositiveInt = 128  # rope kernels: heads = hidden / head_dim
    gqa: PositiveInt = 4  # rope kernels: query heads per kv head

    @field_validator("head_dim")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError(f"head_dim must be even (rotary pairs); got {v}")
        return v


class G4T2Point(_KernelCommon):
    """The guide's point: B=4, S=512, D=768, for RoPE, SwiGLU, RMSNorm."""

    batch: PositiveInt
    seq_len: PositiveInt
    dim: PositiveInt
    kernels: Annotated[list[KernelName], Field(min_length=1)]


class RopeCache(_Section):
    layers: PositiveInt  # G4-T1: 24 layers
    head_dim: PositiveInt
    max_seq_len: PositiveInt


class G4T1Sweep(_KernelCommon):
    """Hidden size x token count per kernel; GB/s against the copy bandwidth measured in the run."""

    tokens: Annotated[list[PositiveInt], Field(min_length=1)]
    hidden: Annotated[dict[KernelName, Annotated[list[PositiveInt], Field(min_length=1)]], Field(min_length=1)]
    rope_cache: RopeCache
    # the kernels study's harness (G4-T2's cases too), CUDA: host time per call (calls back to back, no sync)
    # and kernel time per call (profiled calls)
    host_calls: NonNegativeInt = 20
    kernel_calls: NonNegativeInt = 10


class G4T2Section(ByProfile):
    cpu: G4T2Point
    gpu: G4T2Point


class G4T1Section(ByProfile):
    cpu: G4T1Sweep
    gpu: G4T1Sweep


SECTIONS = {"G4-T2": G4T2Section, "G4-T1": G4T1Section}
