"""The train study's section: each preset trained from fresh weights on the schedule; FP8 training's price."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from adaattn_experiments.common.float8 import Recipe
from adaattn_experiments.common.schedule import TrainSchedule
from adaattn_pipeline.config import ByProfile, check_preset
from adaattn_pipeline.config import Section as _Section


class CompiledSchedule(TrainSchedule):
    """A schedule whose model is compiled as ``optimize_model`` compiles it (``compile_mode`` None: eager).
    ``blocks``: each block compiled in place, one graph the blocks share (HYDRA's whole forward compiles much
    longer as one graph: docs/notebook.md, twenty-first session, item 11). ``reduce-overhead``: CUDA graphs, which
    HYDRA's many small launches need (the trainer sets gradients to None each step, as graph replay requires)."""

    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] | None = None
    compile_scope: Literal["model", "blocks"] = "blocks"


class Float8Price(CompiledSchedule):
    """Issue 67's price of FP8 training: each of ``models`` trained twice on this schedule, from the same fresh
    weights on the same batches, in bf16 and with torchao's float8 training (``recipe``) on its blocks' linears;
    the validation loss curves side by side (a GPU's: FP8 GEMMs need compute capability 8.9)."""

    models: Annotated[list[str], Field(min_length=1)]  # presets of `models`
    recipe: Recipe = "rowwise"


class TrainRun(CompiledSchedule):
    """The train stage: each of ``models`` trained from fresh weights on the schedule; ``float8``, FP8's price."""

    models: Annotated[list[str], Field(min_length=1)]  # presets of `models`
    float8: Float8Price | None = None


class TrainGoals(_Section):
    """Issue 67's goals, read by the report alone (outside the results' params hash). ``fp8_val_loss`` (filed
    2026-11-28 before any run of it): after the same tokens, the FP8 run's final validation loss within this
    fraction of its bf16 twin's, either way. ``hydra_pairs`` (filed 2026-11-30 before any run read it): each HYDRA
    preset and its dense peer, trained in the same run; HYDRA's tokens/s at least ``hydra_tokens_ratio`` x its
    peer's, and its wall-clock to the validation loss both reach at most ``hydra_time_ratio`` x its peer's."""

    fp8_val_loss: float = Field(0.01, gt=0)
    hydra_pairs: dict[str, str] = {"hydra_1b": "llama_1b", "hydra_100m": "dense_100m"}
    hydra_tokens_ratio: float = Field(1.0, gt=0)
    hydra_time_ratio: float = Field(1.0, gt=0)


class TrainSection(ByProfile):
    cpu: TrainRun | None = None
    gpu: TrainRun | None = None
    goals: TrainGoals = TrainGoals()


SECTIONS = {"train": TrainSection}


def check(params) -> None:
    for profile in ("cpu", "gpu"):
        run = getattr(params.train, profile, None) if params.train else None
        for name in run.models if run else ():
            check_preset(params, f"train.{profile}", name, run.seq_len)
        for name in run.float8.models if run and run.float8 else ():
            check_preset(params, f"train.{profile}.float8", name, run.float8.seq_len)
    for hydra, dense in params.train.goals.hydra_pairs.items() if params.train else ():
        for name in (hydra, dense):
            if name not in params.models:
                raise ValueError(f"train.goals.hydra_pairs: {name!r} is not a preset of models; allowed: "
                                 f"{', '.join(params.models)}")
