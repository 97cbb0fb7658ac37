"""The distributed study's section: G3-T2's torchrun jobs, the all-reduce and the TP decode row."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from adaattn_pipeline.config import ByProfile, check_preset
from adaattn_pipeline.config import Section as _Section

DISTRIBUTED_LAYOUTS = ("ddp", "fsdp", "tp", "fsdp_tp")  # fsdp_tp: FSDP2 over tensor-parallel pairs (a 2-D mesh)
GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the compile modes that record CUDA graphs (a test ties them)
# models.train.COMPILE_MODES, spelled out so that params validate without importing torch (a test ties them)
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# the layouts whose jobs may record CUDA graphs with micro-batches (the training job says the same): the Trainer
# accumulates into gradients it allocated first, on one GPU and under DDP; FSDP2's sharded gradients ran slower or
# not at all under them and tensor parallelism outlasted its timeout (notebook, 2026-12-01)
GRAPH_MICRO_LAYOUTS = ("ddp",)


class DistributedDecode(_Section):
    """G3-T3's +TensorParallel row: ``model`` decoded on one GPU and tensor-parallel over each world size of the
    study (``adaattn.distributed.decode``): a ``prompt_len`` prefill and ``new_tokens`` greedy steps a round, at
    each of ``batches``, ``rounds`` timed rounds after one untimed; the step compiled with CUDA graphs on GPUs,
    its all-reduces by each of ``allreduce``."""

    model: str  # a preset of `models`: a dense decoder
    batches: Annotated[list[PositiveInt], Field(min_length=1)]
    prompt_len: PositiveInt
    new_tokens: Annotated[int, Field(ge=2)]
    rounds: PositiveInt = 3
    compile: bool = True
    # the tensor-parallel jobs' all-reduces, a job each: NCCL's, or symmetric memory's one-shot (GPUs, compiled)
    allreduce: Annotated[list[Literal["nccl", "one_shot"]], Field(min_length=1)] = ["nccl"]


class DistributedRun(_Section):
    """G3-T2 and issue 49's scaling goal: each of ``models`` trained in each of ``layouts`` at each of
    ``world_sizes`` (one GPU, or CPU process over gloo, a rank), every run a torchrun job of its own
    (``adaattn.distributed.train``); at world size 1 one run, the baseline of both layouts. The batch per rank is
    fixed (weak scaling: ``batch_per_rank`` x data-parallel ranks a step; each rank's in ``micro_batches`` parts,
    the gradients reduced once a step), ``seq_len`` tokens a sequence,
    ``warmup`` untimed steps, then ``steps`` timed, then on GPUs ``trace_steps`` traced (the share of a step's
    communication no computation hid). ``repeats`` rounds of every job, the layouts interleaved in each round:
    the scaling efficiency is read per round. NCCL's (gloo's) all-reduce bus bandwidth at each of
    ``allreduce_mib`` in the same run, at the largest world size: the ceiling for the gradients' traffic.
    ``budget_s``: the run's time from its first job; the first round, the decode jobs and the all-reduce run
    first, and a job starts only if its guessed time still fits: a later round's job its first-round time, a
    first-round job its model's longest so far, a decode job the longest decode job so far (a row says which did
    not): a machine lent for a few minutes a call keeps what was measured."""

    models: Annotated[list[str], Field(min_length=1)]  # presets of `models`
    layouts: Annotated[list[Literal[DISTRIBUTED_LAYOUTS]], Field(min_length=1)]  # type: ignore[valid-type]
    world_sizes: Annotated[list[PositiveInt], Field(min_length=1)]
    batch_per_rank: PositiveInt
    micro_batches: PositiveInt = 1  # a rank's batch a step in this many parts (gradient accumulation)
    reshard_after_forward: bool = True  # the FSDP2 jobs' parallel.reshard_after_forward
    seq_len: PositiveInt
    steps: PositiveInt
    warmup: NonNegativeInt = 2
    dtype: Literal["bf16", "fp32"] = "bf16"
    # every training job's blocks compiled in this mode (the one-rank baselines too); None: eager
    compile_mode: CompileMode | None = None
    # a layout whose jobs compile in another mode than compile_mode; its one-rank baseline runs in that mode too, so
    # that the layout is read against one rank of the same mode (like with like)
    layout_compile_modes: dict[Literal[DISTRIBUTED_LAYOUTS], CompileMode] = {}  # type: ignore[valid-type]
    allreduce_mib: Annotated[list[PositiveFloat], Field(min_length=1)]
    repeats: PositiveInt = 1  # every job this many times, the layouts' jobs interleaved in each round
    trace_steps: NonNegativeInt = 0  # GPU: steps after the timed ones, traced: the exposed communication
    timeout_s: float = Field(300, gt=0)  # one torchrun job
    budget_s: PositiveFloat | None = None  # the whole run's jobs (None: no limit)
    decode: DistributedDecode | None = None  # G3-T3's +TensorParallel row

    @model_validator(mode="after")
    def _lists(self) -> DistributedRun:
        for name in ("models", "layouts", "world_sizes"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name} must not repeat one; got {values}")
        if 1 not in self.world_sizes:
            raise ValueError(f"world_sizes must hold 1 (the baseline the scaling is read against); got "
                             f"{self.world_sizes}")
        if self.batch_per_rank % self.micro_batches:
            raise ValueError(f"micro_batches={self.micro_batches} must divide batch_per_rank={self.batch_per_rank}")
        if extra := sorted(set(self.layout_compile_modes) - set(self.layouts)):
            raise ValueError(f"layout_compile_modes names {extra}, not in layouts; allowed: {self.layouts}")
        for layout in self.layouts:
            mode = self.mode_of(layout)
            if mode in GRAPH_MODES and self.micro_batches > 1 and layout not in GRAPH_MICRO_LAYOUTS:
                key = f"layout_compile_modes.{layout}" if layout in self.layout_compile_modes else "compile_mode"
                raise ValueError(f"{key}={mode} records CUDA graphs, which with micro_batches={self.micro_batches} "
                                 f"run under {', '.join(GRAPH_MICRO_LAYOUTS)} only, not {layout}; allowed for "
                                 f"{layout}: default, max-autotune-no-cudagraphs")
        return self

    def mode_of(self, layout: str) -> str | None:
        """The compile mode of a layout's jobs (a one-rank baseline's is given by the layout it serves)."""
        return self.layout_compile_modes.get(layout, self.compile_mode)


class G3T2Section(ByProfile):
    cpu: DistributedRun
    gpu: DistributedRun
    gpu4: DistributedRun | None = None  # a GPU target of 4 GPUs or more runs this one, where given (else gpu)


SECTIONS = {"G3-T2": G3T2Section}


def check(params) -> None:
    from adaattn.models.generate import check_decodable

    for profile in ("cpu", "gpu", "gpu4"):
        run = getattr(params.g3_t2, profile) if params.g3_t2 else None
        for name in run.models if run else ():
            check_preset(params, f"G3-T2.{profile}", name, run.seq_len)
        if run is not None and run.decode is not None:
            dec = run.decode
            check_preset(params, f"G3-T2.{profile}.decode", dec.model, dec.prompt_len + dec.new_tokens)
            try:
                check_decodable(params.models[dec.model])
            except ValueError as err:
                raise ValueError(f"G3-T2.{profile}.decode.model {dec.model!r}: {err}") from None
