"""The precision study's section: G2-T3's ops, inputs and precisions."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveInt, field_validator

from adaattn_pipeline.config import ByProfile, Mode, check_divides
from adaattn_pipeline.config import Section as _Section
from adaattn_pipeline.config import check_names as _check_names

Precision = Literal["fp32", "tf32", "fp16", "bf16"]


class G2T3Point(_Section):
    """Precision of the attention op and of AdaAttention in a transformer block, vs float64."""

    batch: PositiveInt
    seq_len: PositiveInt
    embed_dim: PositiveInt
    heads: PositiveInt
    ops: Annotated[list[Literal["attention", "block"]], Field(min_length=1)]
    inputs: Annotated[list[Literal["normal", "outliers"]], Field(min_length=1)]
    outlier_prob: float = Field(0.001, gt=0, lt=1)  # N(0,1) + N(0, outlier_std^2) x Bernoulli(outlier_prob)
    outlier_std: float = Field(10.0, gt=0)
    precisions: Annotated[list[Precision], Field(min_length=1)]
    modes: Annotated[list[Mode], Field(min_length=1)]

    @field_validator("heads")
    @classmethod
    def _heads_divide(cls, v: int, info) -> int:
        return check_divides([v], info.data.get("embed_dim"), "heads", "embed_dim")[0]

    @field_validator("precisions")
    @classmethod
    def _fp32_first(cls, v: list[str]) -> list[str]:
        if "fp32" not in v:
            raise ValueError("precisions must include fp32 (every ratio is vs fp32)")
        return _check_names(v, ("fp32", "tf32", "fp16", "bf16"), "precision(s)")


class G2T3Section(ByProfile):
    cpu: G2T3Point
    gpu: G2T3Point


SECTIONS = {"G2-T3": G2T3Section}
