"""The memory_bank study's section: G3-T4's three presets, their memory and their training."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from adaattn_experiments.common.schedule import TrainSchedule
from adaattn_pipeline.config import ByProfile, check_preset
from adaattn_pipeline.config import Section as _Section

MEMORY_BANK_ROLES = ("standard", "window", "ltm")
RECALL_SPAN = 32  # a recall sequence's bytes besides its distance (the key's line, the query), at most


class PasskeyMix(_Section):
    """The recall task's lines mixed into the training text, as long-context training mixes its tasks in: about
    every ``every`` bytes a line ``passkey = "NNNNN"`` and, 16 to ``max_distance`` bytes later, the same line
    again: a model learns to read a passkey back only from text that holds the task."""

    every: PositiveInt
    max_distance: Annotated[int, Field(ge=16)]


class MemoryBankRun(_Section):
    """G3-T4: a standard decoder, the same with sliding-window attention and the same with an LTM memory bank
    (``models``: role -> preset). Memory: at each of ``contexts`` tokens (``batch`` sequences, weights in
    ``dtype``), a forward's peak over the weights (the standard model with SDPA's math backend, the scores in
    memory, and with its fused ones; the LTM model segment by segment) and the state kept for the next token
    (the standard model's KV cache, the LTM model's segment caches and banks). Quality: each model of
    ``quality_models`` (``models`` where it is null) trained on ``train``'s schedule (the same text, batches and
    steps; ``passkey_mix``: the recall task's lines mixed into it); its validation loss at each of
    ``eval_contexts``; and a passkey's recall at each of ``recall_distances`` (``recall_trials`` sequences each).
    A smaller quality trio is what lets the lookup be learned inside one GPU call: a model reads a passkey
    back only after far more steps than a 350M model can take there (docs/notebook.md, 2026-11-28,
    seventeenth session)."""

    models: dict[Literal[MEMORY_BANK_ROLES], str]  # type: ignore[valid-type]
    quality_models: dict[Literal[MEMORY_BANK_ROLES], str] | None = None  # type: ignore[valid-type]
    batch: PositiveInt = 1
    contexts: Annotated[list[PositiveInt], Field(min_length=1)]
    dtype: Literal["bf16", "fp32"] = "bf16"
    train: TrainSchedule
    eval_contexts: Annotated[list[PositiveInt], Field(min_length=1)]
    recall_distances: Annotated[list[Annotated[int, Field(ge=RECALL_SPAN)]], Field(min_length=1)]
    recall_trials: PositiveInt = 16
    passkey_mix: PasskeyMix | None = None  # null: the training text as it is
    seed: NonNegativeInt = 0

    @property
    def trained(self) -> dict[str, str]:
        """Role -> the preset trained for the quality side."""
        return self.quality_models or self.models

    @model_validator(mode="after")
    def _roles(self) -> "MemoryBankRun":
        for key in ("models", "quality_models"):
            trio = getattr(self, key)
            if trio is not None and set(trio) != set(MEMORY_BANK_ROLES):
                raise ValueError(f"{key} needs one preset for each role ({', '.join(MEMORY_BANK_ROLES)}); got "
                                 f"{', '.join(trio) or 'none'}")
        for key in ("contexts", "eval_contexts", "recall_distances"):
            values = getattr(self, key)
            if len(set(values)) != len(values):
                raise ValueError(f"{key} must not repeat a value; got {values}")
        return self


class QualityGoal(_Section):
    """G3-T4's quality goals, filed before the runs they judge and read by the report alone (outside the results'
    params hash: a change re-renders, never re-measures). The standard model's recall at the shortest distance is
    at least ``recall_floor`` (it learned the task; below it the comparisons are not readable); the window and
    LTM models' recall at each distance at most ``recall_gap`` below the standard model's, and their validation
    loss at each context at most ``loss_gap`` nats a byte above it."""

    recall_floor: float = Field(0.9, gt=0, le=1)
    recall_gap: float = Field(0.1, ge=0, le=1)
    loss_gap: float = Field(0.05, ge=0)


class G3T4Section(ByProfile):
    cpu: MemoryBankRun
    gpu: MemoryBankRun
    quality: QualityGoal = QualityGoal()


SECTIONS = {"G3-T4": G3T4Section}


def check(params) -> None:
    for profile in ("cpu", "gpu"):
        run = getattr(params.g3_t4, profile) if params.g3_t4 else None
        if run is not None:
            _check_roles(params, profile, run)


def _check_roles(params, profile: str, run: MemoryBankRun) -> None:
    """G3-T4's presets: each trio's, each its role's kind of model, and otherwise the same model; positions for
    the longest sequence the trio reads (the memory trio its contexts, the trained one its training, evaluation
    and recall sequences; one trio, all of them)."""
    quality = max(run.train.seq_len, *run.eval_contexts, max(run.recall_distances) + RECALL_SPAN)
    if run.quality_models is None:
        _check_trio(params, profile, "models", run.models, max(quality, *run.contexts))
    else:
        _check_trio(params, profile, "models", run.models, max(run.contexts))
        _check_trio(params, profile, "quality_models", run.quality_models, quality)


def _check_trio(params, profile: str, key: str, trio: dict[str, str], longest: int) -> None:
    for role, name in trio.items():  # an LTM model's positions count within a segment: any length
        check_preset(params, f"G3-T4.{profile}", name, 0 if role == "ltm" else longest)
    cfgs = {role: params.models[name] for role, name in trio.items()}
    wrong = {"standard": cfgs["standard"].memory_slots is not None or cfgs["standard"].attention_window is not None,
             "window": cfgs["window"].attention_window is None,
             "ltm": cfgs["ltm"].memory_slots is None}
    needs = {"standard": "no memory_slots and no attention_window", "window": "an attention_window",
             "ltm": "memory_slots (a memory bank)"}
    for role, bad in wrong.items():
        if bad:
            raise ValueError(f"G3-T4.{profile}.{key}.{role}: {trio[role]!r} needs {needs[role]}")
    shared = ("dim", "n_layers", "n_heads", "kv_heads", "hidden", "positions")
    for role in ("window", "ltm"):
        differ = [k for k in shared if getattr(cfgs[role], k) != getattr(cfgs["standard"], k)]
        if differ:
            raise ValueError(f"G3-T4.{profile}.{key}.{role}: {trio[role]!r} differs from the standard "
                             f"preset {trio['standard']!r} in {', '.join(differ)}: the three compare one "
                             "model with and without its memory")
