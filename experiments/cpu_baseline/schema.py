"""The cpu_baseline study's section: G2-T1's CPU points (a CPU table: no GPU profile)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, PositiveInt

from adaattn_experiments.common.modules_schema import ModuleCommon as _ModuleCommon
from adaattn_pipeline.config import Section as _Section

class G2T1Point(_ModuleCommon):
    """The guide's CPU points B4_S128, B4_S512, B1_S1024 (embed 512, 8 heads: the guide's examples)."""

    points: Annotated[list[tuple[PositiveInt, PositiveInt]], Field(min_length=1)]  # (batch, seq_len)


class G2T1Section(_Section):
    cpu: G2T1Point  # a CPU table: no GPU profile


SECTIONS = {"G2-T1": G2T1Section}
