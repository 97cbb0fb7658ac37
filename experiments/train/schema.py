"""The train study's section: each preset trained from fresh weights on the schedule."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from adaattn_experiments.common.schedule import TrainSchedule
from adaattn_pipeline.config import ByProfile, check_preset

class TrainRun(TrainSchedule):
    """The train stage: each of ``models`` trained from fresh weights on the schedule."""

    models: Annotated[list[str], Field(min_length=1)]  # presets of `models`


class TrainSection(ByProfile):
    cpu: TrainRun | None = None
    gpu: TrainRun | None = None


SECTIONS = {"train": TrainSection}


def check(params) -> None:
    for profile in ("cpu", "gpu"):
        run = getattr(params.train, profile, None) if params.train else None
        for name in run.models if run else ():
            check_preset(params, f"train.{profile}", name, run.seq_len)
