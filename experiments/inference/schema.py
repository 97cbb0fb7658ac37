"""The inference study's section: G3-T3's prefill and decode configs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from adaattn_pipeline.config import ByProfile, Rounds, check_preset
from adaattn_pipeline.config import Section as _Section
from adaattn_experiments.common.schedule import TrainSchedule

INFERENCE_CONFIGS = ("base", "flash", "int8", "compiled", "compiled_plain", "compiled_int8", "compiled_int4",
                     "compiled_torchao_int8", "compiled_torchao_int4", "no_cache")


class QualityRun(TrainSchedule):
    """Weight-only quantization's price (issue 66): ``model`` trained on the schedule (real text, fresh weights),
    then its validation loss over the schedule's held-out windows with its weights in the sweep's dtype, in INT8
    and in INT4 (the sweep's ``int4_group_size``)."""

    model: str  # a preset of `models`


class LTMDecode(_Section):
    """Issue 66's LTM decode under CUDA graphs: ``model`` (an LTM preset, ``memory_slots``) at batch 1, the README's
    ``generate`` for ``new_tokens`` after a prompt of ``prompt_len``, a segment's end among the new tokens (the bank
    written between steps), with the step eager (``ltm_eager``) and compiled with CUDA graphs (``ltm_compiled``:
    ``torch.compile(decode_one, mode="reduce-overhead")``, not ``fullgraph``: the bank's write runs on the host
    between graphs); the compiled step's dynamo graphs."""

    model: str  # a preset of `models` with memory_slots
    prompt_len: PositiveInt
    new_tokens: Annotated[int, Field(ge=2)]  # a decode step at least: generate's first token is the prefill's


class FieldDecode(_Section):
    """Issue 66 like for like: our decode on the model the field's published decode benchmarks run. ``model`` (a
    dense preset of that model's shape, random weights: a step's time does not depend on their values) at batch
    1, the README's ``generate`` with the compiled step (the ``compiled`` config's: the fused decode step,
    ``GraphedStep``) for ``new_tokens`` after a prompt of ``prompt_len``, as the field times its steps (the cache
    growing over them); a CUDA trace of one step. The field's own figures are quoted in ``G3-T3.field_published``,
    not measured here."""

    model: str  # a preset of `models`: a dense decoder the fused step runs
    prompt_len: PositiveInt
    new_tokens: Annotated[int, Field(ge=4)]  # the timed steps, then two more for the trace


class FloorDecode(_Section):
    """Issue 66: the decode step's floor, what it costs whatever its bytes. The sweep's model at these widths (its
    layers, so the step's kernels and their order, with weights of a few MB that sit in L2), random weights, the
    README's ``generate`` with the ``compiled`` config's step at batch 1 after the sweep's prompt, a token; a trace
    of one step (its kernels, to be the sweep model's count)."""

    dim: PositiveInt
    n_heads: PositiveInt
    n_kv_heads: PositiveInt
    mlp_hidden: PositiveInt
    vocab_size: PositiveInt


class FieldPublished(_Section):
    """The field's published step times for the model of ``G3-T3.<profile>.field``, quoted with their ``source``
    (read by the report beside ours; outside the results' params hash): ``model`` the preset of that model's
    shape, ``step_us`` a GPU's name as the results name it (a part of it, ``H200``) -> decoder -> microseconds a
    step."""

    source: str
    model: str
    step_us: dict[str, dict[str, PositiveFloat]]


class InferenceSweep(_Section):
    """G3-T3 and issues 48 and 66's decode goals: a dense decoder's prefill and decode in each of ``configs`` at
    each of ``batches``, side by side per batch. Eager, the model's own layers (the guide's ladder): ``base``
    (SDPA's math backend: the scores materialised), ``flash`` (SDPA's fused backends), ``int8`` (flash with INT8
    weight-only linears). Compiled with CUDA graphs (``torch.compile(decode_one, mode="reduce-overhead")``, the
    README's path): ``compiled`` (the fused decode step, ``models.decode_step``), ``compiled_plain`` (the
    model's own layers: plain compiled PyTorch, the gpt-fast pattern), ``compiled_int8`` and ``compiled_int4``
    (INT8, and INT4 in groups of ``int4_group_size``: the fused step at batch 1, the model's own layers above it,
    INT4's rows there through tinygemm), ``compiled_torchao_int8`` and
    ``compiled_torchao_int4`` (the model's own layers over torchao's ``Int8WeightOnlyConfig`` and
    ``Int4WeightOnlyConfig``: the peers). ``no_cache``: flash without the KV cache (each new token runs the
    whole prefix again). ``prompt_len`` tokens of prompt; the cache holds ``prompt_len + new_tokens``; weights
    in ``dtype``."""

    model: str  # a preset of `models`: a dense decoder with SDPA attention
    batches: Annotated[list[PositiveInt], Field(min_length=1)]
    prompt_len: PositiveInt
    new_tokens: PositiveInt
    configs: Annotated[list[Literal[INFERENCE_CONFIGS]], Field(min_length=1)]  # type: ignore[valid-type]
    dtype: Literal["bf16", "fp32"] = "bf16"
    int4_group_size: Literal[32, 64, 128, 256] = 64  # INT4: input columns sharing a scale and an offset
    quality: QualityRun | None = None  # INT8 and INT4's validation-loss price on a trained preset (None: not run)
    ltm: LTMDecode | None = None  # an LTM preset's decode, eager and under CUDA graphs (None: not run)
    field: FieldDecode | None = None  # our decode on the field's published model (None: not run)
    floor: FloorDecode | None = None  # the sweep's model, narrow: the step's cost whatever its bytes (None: not run)
    side_by_side: Rounds
    seed: NonNegativeInt = 0
    # the seconds from the study's first model build that the field, floor and LTM runs must end inside, each
    # guessed at the longest run after the sweep so far (the quality run's, which always runs; the first at
    # nothing): one that would not is a row that says why, and the file is written with the rest (a device call's
    # kill would keep nothing). None: no limit
    budget_s: PositiveFloat | None = None

    @model_validator(mode="after")
    def _configs(self) -> InferenceSweep:
        if len(set(self.configs)) != len(self.configs) or len(set(self.batches)) != len(self.batches):
            raise ValueError(f"configs and batches must not repeat one; got configs {', '.join(self.configs)}, "
                             f"batches {self.batches}")
        return self


class DecodeGoals(_Section):
    """Issue 66's decode goals, filed before their first run and read by the report alone (outside the results'
    params hash). Read on the ``compiled`` config (bf16, the decode step in CUDA graphs), a step's time from the
    side-by-side rounds: bytes a step must read (the weights, and the KV cache's positions filled at that step)
    over that time, against the copy bandwidth measured in the same run, at least ``roofline_b1`` at batch 1 and
    ``roofline_batched`` at every larger batch; at most ``max_kernels_b1`` kernels in a batch-1 step (a CUDA trace
    of one step); INT4 weight-only (``compiled_int4``) at least ``int4_speedup`` x bf16 at batch 1 (the paired
    rounds' ratio); the README's ``generate`` at batch 1 at most ``generate_within`` slower a token than the
    step's side-by-side time (one-sided: its sampling and output write are extra work, a faster loop is no
    miss; filed 2026-11-28 before its first run)."""

    roofline_b1: float = Field(0.85, gt=0, le=1)
    roofline_batched: float = Field(0.80, gt=0, le=1)
    max_kernels_b1: PositiveInt = 120
    int4_speedup: float = Field(2.5, gt=0)
    generate_within: float = Field(0.05, gt=0)


class G3T3Section(ByProfile):
    cpu: InferenceSweep
    gpu: InferenceSweep
    decode_goals: DecodeGoals = DecodeGoals()
    field_published: FieldPublished | None = None


SECTIONS = {"G3-T3": G3T3Section}


def check(params) -> None:
    from adaattn.models.generate import check_decodable

    for profile in ("cpu", "gpu"):
        run = getattr(params.g3_t3, profile) if params.g3_t3 else None
        if run is not None:
            check_preset(params, f"G3-T3.{profile}", run.model, run.prompt_len + run.new_tokens)
            try:
                check_decodable(params.models[run.model])
            except ValueError as err:
                raise ValueError(f"G3-T3.{profile}.model {run.model!r}: {err}") from None
            if run.quality is not None:
                check_preset(params, f"G3-T3.{profile}.quality", run.quality.model, run.quality.seq_len)
            if run.ltm is not None:
                check_ltm(params, f"G3-T3.{profile}.ltm", run.ltm)
            if run.field is not None:
                where = f"G3-T3.{profile}.field"
                check_preset(params, where, run.field.model, run.field.prompt_len + run.field.new_tokens)
                try:
                    check_decodable(params.models[run.field.model])
                except ValueError as err:
                    raise ValueError(f"{where}.model {run.field.model!r}: {err}") from None
            if run.floor is not None:
                floor_config(params, f"G3-T3.{profile}.floor", run)
    published = params.g3_t3.field_published if params.g3_t3 else None
    if published is not None and published.model not in params.models:
        raise ValueError(f"G3-T3.field_published.model {published.model!r} is not a preset of models; allowed: "
                         f"{', '.join(params.models)}")


def floor_config(params, where: str, run: InferenceSweep):
    """The sweep's model at the floor's widths, validated as a preset is, and one the fused step decodes."""
    from adaattn.kernels.decode_proj import ROPE_ROWS
    from adaattn.models.config import ModelConfig

    try:
        cfg = ModelConfig(**{**params.models[run.model].model_dump(), **run.floor.model_dump()})
    except ValueError as err:
        raise ValueError(f"{where}: models.{run.model} at these widths is no model: {err}") from None
    D = cfg.head_dim
    if D % (2 * ROPE_ROWS) or D & (D - 1):  # the rest the fused step needs is the sweep model's, unchanged here
        raise ValueError(f"{where}: dim / n_heads = {D}: the fused step takes a power of two head dim, at least "
                         f"{2 * ROPE_ROWS}")
    return cfg


def check_ltm(params, where: str, run: LTMDecode) -> None:
    """An LTM preset, and a segment's end among the decode steps (positions prompt_len .. prompt_len + new_tokens
    - 2: generate's first new token comes from the prefill)."""
    from adaattn.models.generate import check_decodable

    check_preset(params, where, run.model, run.prompt_len + run.new_tokens)
    cfg = params.models[run.model]
    if cfg.memory_slots is None:
        raise ValueError(f"{where}.model {run.model!r} is not an LTM preset (no memory_slots)")
    check_decodable(cfg)
    L, P, N = cfg.segment_len, run.prompt_len, run.new_tokens
    if (P + N - 1) // L == P // L:
        raise ValueError(f"{where}: no segment ends among the decode steps (prompt_len={P}, new_tokens={N}, "
                         f"models.{run.model}.segment_len={L}): the new tokens must cross a multiple of {L}")
