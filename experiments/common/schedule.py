"""A training run's schedule, the shape the train study's runs and the memory_bank study's training share."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from adaattn_pipeline.config import Section as _Section


class TrainSchedule(_Section):
    """A training run's schedule: ``steps`` steps of ``batch`` x ``seq_len`` byte tokens (vocabulary 256) of
    Python's standard-library sources, AdamW at ``lr`` with ``warmup`` linear steps then a cosine to a tenth;
    the training loss every ``log_every`` steps, the validation loss (over ``eval_batches`` fixed windows of the
    held-out files) every ``eval_every`` and at the end."""

    batch: PositiveInt
    seq_len: PositiveInt
    steps: PositiveInt
    lr: float = Field(gt=0)
    warmup: NonNegativeInt = 0
    log_every: PositiveInt = 10
    eval_every: PositiveInt = 100
    eval_batches: PositiveInt = 8
    dtype: Literal["bf16", "fp32"] = "bf16"
    val_percent: float = Field(5.0, gt=0, lt=100)  # the held-out share of the files
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _schedule(self) -> "TrainSchedule":
        if self.warmup >= self.steps:
            raise ValueError(f"warmup={self.warmup} must be below steps={self.steps}")
        return self
