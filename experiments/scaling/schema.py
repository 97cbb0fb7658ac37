"""The scaling study's section: G2-B's batch and sequence sweeps, the compiled goal and the stack check."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator

from adaattn_experiments.common.modules_schema import ModuleCommon as _ModuleCommon
from adaattn_experiments.common.modules_schema import backend_names as _backend_names
from adaattn_experiments.common.modules_schema import module_provider_names as _module_provider_names
from adaattn_pipeline.config import ByProfile, DType, Rounds
from adaattn_pipeline.config import Section as _Section
from adaattn_pipeline.config import check_names as _check_names

class StackCheck(_Section):
    """A stack of transformer blocks, AdaAttention's vs SDPA's, both compiled: a training step (forward and
    backward), side by side."""

    layers: PositiveInt
    embed_dim: PositiveInt
    heads: PositiveInt
    mlp_ratio: PositiveInt
    batch: PositiveInt
    seq_len: PositiveInt
    dtype: DType
    side_by_side: Rounds


class G2BSweep(_ModuleCommon):
    """Batch sweep at one sequence length, sequence sweep at one batch (up to 16K tokens)."""

    batch_sweep_seq_len: PositiveInt
    batches: Annotated[list[PositiveInt], Field(min_length=1)]
    seq_sweep_batch: PositiveInt
    seq_lens: Annotated[list[PositiveInt], Field(min_length=1)]
    causal: Annotated[list[bool], Field(min_length=1)]
    utilization_s: float = Field(0.5, ge=0)  # NVML utilization over this many seconds of calls; 0: none
    utilization_providers: list[str] = []  # which providers it is sampled for (it costs the time above)
    # the compiled goal: AdaAttention compiled (compile_mode) beside the module compiled around each of these
    # backends called directly, at every shape; []: not taken
    compiled_backends: list[str] = []
    compile_mode: Literal["reduce-overhead", "default", "max-autotune-no-cudagraphs"] = "reduce-overhead"
    stack: StackCheck | None = None  # the stack check; null: not taken
    # the kernel-time goal: rounds of one call of each provider in one profiler trace; 0: not taken (a CPU)
    goal_kernel_calls: NonNegativeInt = 0

    @field_validator("utilization_providers")
    @classmethod
    def _util(cls, v: list[str]) -> list[str]:
        return _check_names(v, _module_provider_names(), "utilization provider(s)")

    @field_validator("compiled_backends")
    @classmethod
    def _compiled(cls, v: list[str]) -> list[str]:
        return _check_names(v, _backend_names(), "compiled backend(s)")


class G2BSection(ByProfile):
    cpu: G2BSweep
    gpu: G2BSweep


SECTIONS = {"G2-B": G2BSection}
