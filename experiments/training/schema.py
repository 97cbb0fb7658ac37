"""The training study's sections: G0-T1's ladder and G1-C1's GEMM and module claims."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from adaattn_pipeline.config import ByProfile, Rounds
from adaattn_pipeline.config import Section as _Section

RUNGS = ("fp32", "tf32", "bf16", "sdpa", "fused_adamw", "compile", "ada", "checkpointing")


class TrainingLadder(_Section):
    """G0-T1 and G0-C1: a preset's training step at one shape, climbing a ladder of optimisations, each rung
    adding its own to every rung listed before it (``fp32``: eager fp32 with naive attention and AdamW's
    foreach step; ``tf32``; ``bf16`` autocast; ``sdpa`` attention; ``fused_adamw``; ``compile`` (default
    mode); ``ada`` (AdaAttention); ``checkpointing`` (full)). The rungs' steps are timed side by side."""

    model: str  # a preset of `models`
    batch: PositiveInt
    seq_len: PositiveInt
    rungs: Annotated[list[Literal[RUNGS]], Field(min_length=1)]  # type: ignore[valid-type]
    # G0-C1's "each mode": the compile rung's step in each of these torch.compile modes, side by side with the rung
    # before it (eager), its own group of rounds; [] = the ladder's default mode only
    compile_modes: list[Literal["default", "reduce-overhead", "max-autotune"]] = []
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _modes(self) -> TrainingLadder:
        if self.compile_modes and ("compile" not in self.rungs or self.rungs[0] == "compile"):
            raise ValueError("compile_modes needs the 'compile' rung and a rung before it (the eager step it is "
                             f"timed against); got rungs {', '.join(self.rungs)}")
        if len(set(self.compile_modes)) != len(self.compile_modes):
            raise ValueError(f"compile_modes must not repeat a mode; got {', '.join(self.compile_modes)}")
        return self

    @field_validator("rungs")
    @classmethod
    def _ladder(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or sorted(v, key=RUNGS.index) != v:
            raise ValueError(f"rungs climb in this order, each once: {', '.join(RUNGS)}; got {', '.join(v)}")
        return v


class G0T1Section(ByProfile):
    cpu: TrainingLadder
    gpu: TrainingLadder


class G1C1Sweep(_Section):
    """G1-C1's GEMM and module claims, measured by the training study: an ``gemm_n``-cubed fp32 matmul with TF32
    off and on, side by side (claim: TF32 4x faster); ``nn.MultiheadAttention`` against the zoo's SDPA attention
    layer of the same width, heads and projections (non-causal, autocast to ``dtype`` over fp32 weights),
    forward and training call side by side (claim: the default MultiheadAttention is already optimised)."""

    gemm_n: PositiveInt
    batch: PositiveInt
    seq_len: PositiveInt
    dim: PositiveInt
    heads: PositiveInt
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _heads_divide(self) -> G1C1Sweep:
        if self.dim % self.heads:
            raise ValueError(f"heads={self.heads} must divide dim={self.dim}")
        return self


class G1C1Section(ByProfile):
    cpu: G1C1Sweep
    gpu: G1C1Sweep


SECTIONS = {"G0-T1": G0T1Section, "G1-C1": G1C1Section}


def check(params) -> None:
    """G0-T1's model is a preset that fits the ladder's length (and takes AdaAttention where the ladder has it)."""
    for profile in ("cpu", "gpu"):
        sec = getattr(params.g0_t1, profile, None) if params.g0_t1 else None
        if sec is None:
            continue
        if sec.model not in params.models:
            raise ValueError(f"G0-T1.{profile}.model {sec.model!r} is not a preset of models; allowed: "
                             f"{', '.join(params.models)}")
        if sec.seq_len > params.models[sec.model].max_seq_len:
            raise ValueError(f"G0-T1.{profile}.seq_len={sec.seq_len} is over models.{sec.model}.max_seq_len")
        if "ada" in sec.rungs and params.models[sec.model].positions != "learned":
            raise ValueError(f"G0-T1.{profile}.rungs: 'ada' needs models.{sec.model}.positions 'learned' "
                             "(AdaAttention takes no rotary positions)")
