"""The schema the module studies share (cpu_baseline's G2-T1, scaling's G2-B): whole attention modules side by
side (``modules.py``), and the names their providers and backends may take."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator

from adaattn.names import BACKENDS
from adaattn_pipeline.config import DType, Mode, Rounds, check_divides, check_names
from adaattn_pipeline.config import Section as _Section

# Whole attention modules (projections + attention + output projection), compared in
# G2-T1 (cpu_baseline) and G2-B (scaling); ``direct:<backend>`` is the same module calling one of
# the kernel manager's backends itself (no manager, no precision policy).
MODULE_PROVIDERS = ("mha", "standard", "adaattn", "adaattn_auto", "adaattn_noopt")


def module_provider_names() -> tuple[str, ...]:
    return (*MODULE_PROVIDERS, *(f"direct:{b}" for b in BACKENDS))


def backend_names() -> tuple[str, ...]:
    return BACKENDS


class ModuleCommon(_Section):
    embed_dim: PositiveInt
    heads: PositiveInt
    dtype: DType
    modes: Annotated[list[Mode], Field(min_length=1)]
    providers: Annotated[list[str], Field(min_length=1)]
    # the kernel manager's candidates for adaattn / adaattn_auto; null: the hardware's (what a user gets)
    manager_backends: Annotated[list[str], Field(min_length=1)] | None = None
    side_by_side: Rounds  # the providers' time per call side by side
    seed: NonNegativeInt = 0  # the modules' weights (an nn.MultiheadAttention from this seed) and the rounds' order
    # the harness's CUDA extras per provider: host time (calls back to back, no sync) and kernel time (profiled)
    host_calls: NonNegativeInt = 20
    kernel_calls: NonNegativeInt = 10

    @field_validator("heads")
    @classmethod
    def _heads_divide(cls, v: int, info) -> int:
        return check_divides([v], info.data.get("embed_dim"), "heads", "embed_dim")[0]

    @field_validator("providers")
    @classmethod
    def _providers(cls, v: list[str]) -> list[str]:
        return check_names(v, module_provider_names(), "module provider(s)")

    @field_validator("manager_backends")
    @classmethod
    def _backends(cls, v: list[str] | None) -> list[str] | None:
        return v if v is None else check_names(v, backend_names(), "attention backend(s)")
