"""How a distributed run lays a model over processes (``params.yaml`` ``parallel``), and what the torchrun entry
points read of ``params.yaml``: the model presets (``models``) and that layout, validated before any process
group starts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError, model_validator

from adaattn.errors import ConfigError
from adaattn.models.config import ModelConfig
from adaattn.params import format_errors, load_raw, with_overrides


class Layout(BaseModel):
    """How a run spreads over processes (``params.yaml`` ``parallel``; ``adaattn.distributed``): ``dp`` replicas
    (DDP, or HSDP's replicate dimension where ``fsdp`` > 1), ``fsdp`` shards of each replica's parameters,
    gradients and optimizer state (FSDP2), ``tp`` tensor-parallel ranks; their product is ``world_size``, the
    processes torchrun starts. ``reshard_after_forward``: FSDP frees each block's gathered parameters after its
    forward (less memory, one more all-gather in the backward). ``param_dtype`` / ``reduce_dtype``: FSDP's
    mixed-precision policy (compute and gradient-reduction dtypes; the sharded weights stay fp32)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    world_size: PositiveInt = 1
    dp: PositiveInt = 1
    fsdp: PositiveInt = 1
    tp: PositiveInt = 1
    reshard_after_forward: bool = True
    param_dtype: Literal["bf16", "fp32"] = "bf16"
    reduce_dtype: Literal["bf16", "fp32"] = "fp32"

    @model_validator(mode="after")
    def _product(self) -> Layout:
        if self.dp * self.fsdp * self.tp != self.world_size:
            raise ValueError(f"parallel.world_size={self.world_size} must be dp x fsdp x tp = {self.dp} x "
                             f"{self.fsdp} x {self.tp} = {self.dp * self.fsdp * self.tp}")
        return self


class RunParams(BaseModel):
    """The sections of params.yaml a torchrun job reads; the rest of the file is the pipeline's."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    models: dict[str, ModelConfig] = {}
    parallel: Layout = Layout()


def load_run_params(path: Path, overrides: list[str] | None = None) -> RunParams:
    """``models`` and ``parallel`` of ``path`` with ``KEY=VALUE`` overrides; a bad key stops here with its name."""
    raw = with_overrides(load_raw(path), overrides)
    source = str(path) + (" (with overrides)" if overrides else "")
    try:
        return RunParams.model_validate({k: raw[k] for k in ("models", "parallel") if k in raw})
    except ValidationError as err:
        raise ConfigError(format_errors(err, source, RunParams)) from None
