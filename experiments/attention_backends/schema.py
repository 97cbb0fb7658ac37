"""The attention_backends study's sections: G1-T2's benchmark point and G1-T1's sweep."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, PositiveInt, field_validator

from adaattn.names import ATTENTION_PROVIDERS as PROVIDERS
from adaattn_pipeline.config import ByProfile, DType, Mode, check_divides, check_names
from adaattn_pipeline.config import Section as _Section

ProviderName = str

class _AttentionCommon(_Section):
    d_model: PositiveInt  # model width; heads = d_model / head_dim
    dtypes: Annotated[list[DType], Field(min_length=1)]
    modes: Annotated[list[Mode], Field(min_length=1)]
    providers: Annotated[list[ProviderName], Field(min_length=1)]

    @field_validator("providers")
    @classmethod
    def _known_providers(cls, v: list[str]) -> list[str]:
        return check_names(v, PROVIDERS, "provider(s)")


class G1T2Shape(_AttentionCommon):
    """The guide's benchmark point: B=32, S=1024, d_model=1024, H=16 (head dim 64), forward."""

    batch: PositiveInt
    seq_len: PositiveInt
    heads: PositiveInt

    @field_validator("heads")
    @classmethod
    def _divides(cls, v: int, info) -> int:
        return check_divides([v], info.data.get("d_model"), "heads", "d_model")[0]


class G1T1Sweep(_AttentionCommon):
    """Sequence length at a fixed token count (B = tokens / S), x head dim x causal x dtype x mode."""

    tokens: PositiveInt  # B * S for every point of the sweep
    seq_lens: Annotated[list[PositiveInt], Field(min_length=1)]
    head_dims: Annotated[list[PositiveInt], Field(min_length=1)]
    causal: Annotated[list[bool], Field(min_length=1)]

    @field_validator("seq_lens")
    @classmethod
    def _divides_tokens(cls, v: list[int], info) -> list[int]:
        return check_divides(v, info.data.get("tokens"), "seq_lens", "tokens")

    @field_validator("head_dims")
    @classmethod
    def _head_dims_divide(cls, v: list[int], info) -> list[int]:
        return check_divides(v, info.data.get("d_model"), "head_dims", "d_model")


class G1T2Section(ByProfile):
    cpu: G1T2Shape
    gpu: G1T2Shape


class G1T1Section(ByProfile):
    cpu: G1T1Sweep
    gpu: G1T1Sweep


SECTIONS = {"G1-T2": G1T2Section, "G1-T1": G1T1Section}
