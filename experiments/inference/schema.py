"""The inference study's section: G3-T3's prefill and decode configs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from adaattn_pipeline.config import ByProfile, Rounds, check_preset
from adaattn_pipeline.config import Section as _Section

INFERENCE_CONFIGS = ("base", "flash", "int8", "compiled", "compiled_int8", "compiled_torchao_int8", "no_cache")


class InferenceSweep(_Section):
    """G3-T3 and issue 48's decode goals: a dense decoder's prefill and decode in each of ``configs`` at each of
    ``batches``, side by side per batch: ``base`` (eager, SDPA's math backend: the scores materialised),
    ``flash`` (SDPA's fused backends), ``int8`` (flash with INT8 weight-only linears), ``compiled`` (flash, the
    decode step compiled with CUDA graphs), ``compiled_int8`` (the same over INT8 weights),
    ``compiled_torchao_int8`` (the same over torchao's ``Int8WeightOnlyConfig``: the peer) and ``no_cache``
    (flash without the KV cache: each new token runs the whole prefix again). ``prompt_len`` tokens of prompt;
    the cache holds ``prompt_len + new_tokens``; weights in ``dtype``."""

    model: str  # a preset of `models`: a dense decoder with SDPA attention
    batches: Annotated[list[PositiveInt], Field(min_length=1)]
    prompt_len: PositiveInt
    new_tokens: PositiveInt
    configs: Annotated[list[Literal[INFERENCE_CONFIGS]], Field(min_length=1)]  # type: ignore[valid-type]
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _configs(self) -> InferenceSweep:
        if len(set(self.configs)) != len(self.configs) or len(set(self.batches)) != len(self.batches):
            raise ValueError(f"configs and batches must not repeat one; got configs {', '.join(self.configs)}, "
                             f"batches {self.batches}")
        return self


class G3T3Section(ByProfile):
    cpu: InferenceSweep
    gpu: InferenceSweep


SECTIONS = {"G3-T3": G3T3Section}


def check(params) -> None:
    from adaattn.models.generate import check_decodable

    for profile in ("cpu", "gpu"):
        run = getattr(params.g3_t3, profile) if params.g3_t3 else None
        if run is not None:
            check_preset(params, f"G3-T3.{profile}", run.model, run.prompt_len + run.new_tokens)
            try:
                check_decodable(params.models[run.model])
            except ValueError as err:
                raise ValueError(f"G3-T3.{profile}.model {run.model!r}: {err}") from None
