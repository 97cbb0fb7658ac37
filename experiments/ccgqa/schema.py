"""The ccgqa study's section: G4-C1's CCGQA layer against SDPA GQA."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from adaattn_pipeline.config import ByProfile, Rounds
from adaattn_pipeline.config import Section as _Section

class CcgqaSweep(_Section):
    """G4-C1's attention: HYDRA's CCGQA attention layer against the SDPA GQA layer of the same width, query and kv
    heads, a training call (forward and backward) per length, side by side, eager and in each of ``compile_modes``;
    ``tokens`` per call (batch = tokens / length), autocast to ``dtype`` over fp32 weights as in training."""

    models: Annotated[list[str], Field(min_length=1)]  # presets of `models` with attention ccgqa
    seq_lens: Annotated[list[PositiveInt], Field(min_length=1)]
    tokens: PositiveInt
    # torch.compile modes, each mode's pair timed side by side apart from the eager pair; each pair gets its own
    # verdict, and the goal means the one verdicts.ccgqa_mode names; [] = eager only
    compile_modes: list[Literal["default", "reduce-overhead", "max-autotune"]] = ["default", "reduce-overhead"]
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _whole_batches(self) -> CcgqaSweep:
        for s in self.seq_lens:
            if self.tokens % s:
                raise ValueError(f"tokens={self.tokens} must be a multiple of every seq_lens entry; got {s}")
        if len(set(self.compile_modes)) != len(self.compile_modes):
            raise ValueError(f"compile_modes must not repeat a mode; got {', '.join(self.compile_modes)}")
        return self


class G4C1Section(ByProfile):
    cpu: CcgqaSweep
    gpu: CcgqaSweep


SECTIONS = {"G4-C1": G4C1Section}


def check(params) -> None:
    """G4-C1's presets exist and have CCGQA attention (a layer, not the model: its lengths may pass max_seq_len);
    the pair the goal means (verdicts.ccgqa_mode) is one the GPU sweep measures."""
    gpu = params.g4_c1.gpu if params.g4_c1 else None
    mode = params.verdicts.ccgqa_mode
    if gpu is not None and mode not in ("eager", *gpu.compile_modes):
        raise ValueError(f"verdicts.ccgqa_mode={mode!r} is not a pair G4-C1.gpu measures; allowed: "
                         f"{', '.join(('eager', *gpu.compile_modes))}")
    for profile in ("cpu", "gpu"):
        run = getattr(params.g4_c1, profile, None) if params.g4_c1 else None
        for name in run.models if run else ():
            if name not in params.models:
                raise ValueError(f"G4-C1.{profile}.models: {name!r} is not a preset of models; allowed: "
                                 f"{', '.join(params.models)}")
            if params.models[name].attention != "ccgqa":
                raise ValueError(f"G4-C1.{profile}.models: {name!r} has attention "
                                 f"{params.models[name].attention!r}; the study compares 'ccgqa' presets")
