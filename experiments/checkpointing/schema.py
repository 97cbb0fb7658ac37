"""The checkpointing study's section: G4-T3's presets and granularities."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator

from adaattn.models.config import CHECKPOINTING
from adaattn_pipeline.config import ByProfile, Rounds, check_preset
from adaattn_pipeline.config import Section as _Section

class CheckpointingSweep(_Section):
    """G4-T3 and G4-T1's checkpointing line: each preset's training step (eager, autocast to ``dtype``, fused
    AdamW on a GPU) at every granularity, ``none`` first: peak memory, the forward's memory, step time side
    by side, and the card's estimate beside the measured peak."""

    models: Annotated[list[str], Field(min_length=1)]  # presets of `models`
    batch: PositiveInt
    seq_len: PositiveInt
    granularities: Annotated[list[Literal[CHECKPOINTING]], Field(min_length=2)]  # type: ignore[valid-type]
    every: PositiveInt = 2  # every_k's k
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @field_validator("granularities")
    @classmethod
    def _none_first(cls, v: list[str]) -> list[str]:
        if v[0] != "none" or len(set(v)) != len(v):
            raise ValueError(f"granularities start with 'none' (the baseline), each once; allowed: "
                             f"{', '.join(CHECKPOINTING)}; got {', '.join(v)}")
        return v


class G4T3Section(ByProfile):
    cpu: CheckpointingSweep
    gpu: CheckpointingSweep


SECTIONS = {"G4-T3": G4T3Section}


def check(params) -> None:
    for profile in ("cpu", "gpu"):
        run = getattr(params.g4_t3, profile, None) if params.g4_t3 else None
        for name in run.models if run else ():
            check_preset(params, f"G4-T3.{profile}", name, run.seq_len)
