"""The memory_analysis study's section: G3-T1's sweeps of an LTM preset."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from adaattn_pipeline.config import ByProfile, check_preset
from adaattn_pipeline.config import Section as _Section

MEMORY_SWEEPS = ("batch", "seq_len", "memory_slots", "dim", "n_layers")


class MemorySweep(_Section):
    """G3-T1: where an LTM transformer's memory goes, each component measured over sweeps of one variable at a time
    (the others at ``batch``, ``seq_len`` and the preset's own): parameters (bytes; over ``n_layers`` and ``dim``),
    the memory bank (the banks' bytes after a sequence long enough to fill them; over ``memory_slots`` and
    ``dim``), attention (one attention layer's training call's peak, SDPA's math backend and its fused ones; over
    ``batch`` and ``seq_len``) and activations (a training step's forward and backward peak over the weights;
    over ``batch``, ``seq_len`` and ``dim``), and each component's optimisation (quantisation, compression,
    FlashAttention, checkpointing). The report fits each component's exponent in each variable."""

    model: str  # an LTM preset of `models` (memory_slots set)
    batch: PositiveInt
    seq_len: PositiveInt
    sweeps: dict[Literal[MEMORY_SWEEPS], Annotated[list[PositiveInt], Field(min_length=2)]]  # type: ignore[valid-type]
    dtype: Literal["bf16", "fp32"] = "bf16"
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _distinct(self) -> MemorySweep:
        for key, values in self.sweeps.items():
            if len(set(values)) < 2:
                raise ValueError(f"sweeps.{key} needs two distinct values or more to fit an exponent; got {values}")
        return self


class G3T1Section(ByProfile):
    cpu: MemorySweep
    gpu: MemorySweep


SECTIONS = {"G3-T1": G3T1Section}


def check(params) -> None:
    for profile in ("cpu", "gpu"):
        run = getattr(params.g3_t1, profile) if params.g3_t1 else None
        if run is not None:
            longest = max([run.seq_len, *run.sweeps.get("seq_len", [])])
            check_preset(params, f"G3-T1.{profile}", run.model, longest)
            if params.models[run.model].memory_slots is None:
                raise ValueError(f"G3-T1.{profile}.model {run.model!r} has no memory bank (memory_slots): the study "
                                 "measures an LTM preset")
