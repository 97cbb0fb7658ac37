"""The allocator study's section: a training step under each allocator setting."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from adaattn_pipeline.config import ByProfile, check_preset
from adaattn_pipeline.config import Section as _Section

ALLOCATOR_SETTINGS = ("default", "split_512", "expandable", "fraction_95")


class AllocatorRun(_Section):
    """G0-C1's allocator lines ("512 MB chunks", "95% of GPU memory allowed"): a preset's eager training step
    (bf16 autocast, fused AdamW) under each of ``settings``, each in a fresh process (the caching allocator
    reads its settings once): ``default``; ``split_512`` (``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512``, the
    guide's chunks); ``expandable`` (``expandable_segments:True``); ``fraction_95``
    (``torch.cuda.set_per_process_memory_fraction(0.95)``). Per setting: ``steps`` steps of ``tokens`` tokens
    whose length cycles through ``seq_lens`` (differently shaped tensors: what fragments a caching allocator),
    their time and the allocator's peaks; then the largest batch of ``probe_seq_len`` tokens a step fits, up to
    ``probe_limit``."""

    model: str  # a preset of `models`
    settings: Annotated[list[Literal[ALLOCATOR_SETTINGS]], Field(min_length=1)] = list(ALLOCATOR_SETTINGS)  # type: ignore[valid-type]
    seq_lens: Annotated[list[PositiveInt], Field(min_length=1)]
    tokens: PositiveInt
    steps: PositiveInt
    probe_seq_len: PositiveInt
    probe_limit: PositiveInt
    timeout_s: float = Field(300, gt=0)  # one setting's process
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _shapes(self) -> AllocatorRun:
        for s in self.seq_lens:
            if self.tokens % s:
                raise ValueError(f"tokens={self.tokens} must be a multiple of every seq_lens entry; got {s}")
        if len(set(self.settings)) != len(self.settings):
            raise ValueError(f"settings must not repeat one; got {', '.join(self.settings)}")
        return self


class AllocatorSection(ByProfile):
    cpu: AllocatorRun | None = None
    gpu: AllocatorRun | None = None


SECTIONS = {"allocator": AllocatorSection}


def check(params) -> None:
    for profile in ("cpu", "gpu"):
        run = getattr(params.allocator, profile) if params.allocator else None
        if run is not None:
            check_preset(params, f"allocator.{profile}", run.model, max(*run.seq_lens, run.probe_seq_len))
