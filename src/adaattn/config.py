"""Typed, validated view of ``params.yaml``.

Every section is named after the guide table it regenerates (``G1-T2``...; the project's index of them:
``src/adaattn/report/guide_figures.yaml``) and maps to a frozen pydantic model with ``extra="forbid"``, so a
wrong type, an unknown key, an unknown provider or a non-positive size stops the run with an
error that names the key and the allowed values, before anything is measured.
"""

from __future__ import annotations

import copy
import hashlib
import json
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError,
                      field_validator, model_validator)

from adaattn.models.config import CHECKPOINTING, ModelConfig  # pydantic only: no torch
from adaattn.names import ATTENTION_PROVIDERS as PROVIDERS
from adaattn.names import BACKENDS

DType = Literal["bf16", "fp16", "fp32"]
Mode = Literal["fwd", "fwd_bwd"]
Profile = Literal["cpu", "gpu"]


class ConfigError(ValueError):
    """params.yaml (or a CLI override) is invalid; the message names the key and allowed values."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Target(_Section):
    """One hardware target: results land in ``results/<study>/<name>.csv``."""

    device: Literal["cpu", "cuda"]
    profile: Profile  # which size profile of each study section this target runs
    gpu_name: str | None = None  # substring of torch.cuda.get_device_name(); required for cuda
    gpus: PositiveInt = 1  # GPUs the target's machine has (its multi-GPU studies' world sizes)

    @field_validator("gpu_name")
    @classmethod
    def _non_empty(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("gpu_name must be a non-empty substring of the CUDA device name")
        return v


class GpuTiming(_Section):
    warmup_ms: PositiveInt = 25  # ms of warm-up per measurement (triton.testing.do_bench)
    rep_ms: PositiveInt = 100  # ms of timed repeats per measurement
    # worker processes that compile a study's torch.compile'd providers in parallel before
    # anything is timed (they fill inductor's on-disk caches); 0 compiles in the measuring process
    compile_workers: NonNegativeInt = 0


class CpuTiming(_Section):
    warmup: PositiveInt = 1  # untimed calls before timing
    repeats: PositiveInt = 5  # timed calls; quantiles are taken over these
    compile_workers: NonNegativeInt = 0  # as GpuTiming.compile_workers


class Bench(_Section):
    gpu: GpuTiming = GpuTiming()
    cpu: CpuTiming = CpuTiming()


ProviderName = str


class _AttentionCommon(_Section):
    d_model: PositiveInt  # model width; heads = d_model / head_dim
    dtypes: Annotated[list[DType], Field(min_length=1)]
    modes: Annotated[list[Mode], Field(min_length=1)]
    providers: Annotated[list[ProviderName], Field(min_length=1)]

    @field_validator("providers")
    @classmethod
    def _known_providers(cls, v: list[str]) -> list[str]:
        unknown = [p for p in v if p not in PROVIDERS]
        if unknown:
            raise ValueError(f"unknown provider(s) {unknown}; allowed: {', '.join(PROVIDERS)}")
        if len(set(v)) != len(v):
            raise ValueError("providers must not repeat")
        return v


class G1T2Shape(_AttentionCommon):
    """The guide's benchmark point: B=32, S=1024, d_model=1024, H=16 (head dim 64), forward."""

    batch: PositiveInt
    seq_len: PositiveInt
    heads: PositiveInt

    @field_validator("heads")
    @classmethod
    def _divides(cls, v: int, info) -> int:
        d_model = info.data.get("d_model")
        if d_model is not None and d_model % v:
            raise ValueError(f"heads={v} must divide d_model={d_model}")
        return v


class G1T1Sweep(_AttentionCommon):
    """Sequence length at a fixed token count (B = tokens / S), x head dim x causal x dtype x mode."""

    tokens: PositiveInt  # B * S for every point of the sweep
    seq_lens: Annotated[list[PositiveInt], Field(min_length=1)]
    head_dims: Annotated[list[PositiveInt], Field(min_length=1)]
    causal: Annotated[list[bool], Field(min_length=1)]

    @field_validator("seq_lens")
    @classmethod
    def _divides_tokens(cls, v: list[int], info) -> list[int]:
        tokens = info.data.get("tokens")
        bad = [s for s in v if tokens is not None and tokens % s]
        if bad:
            raise ValueError(f"seq_lens {bad} do not divide tokens={tokens}")
        return v

    @field_validator("head_dims")
    @classmethod
    def _head_dims_divide(cls, v: list[int], info) -> list[int]:
        d_model = info.data.get("d_model")
        bad = [d for d in v if d_model is not None and d_model % d]
        if bad:
            raise ValueError(f"head_dims {bad} do not divide d_model={d_model}")
        return v


class ByProfile(_Section):
    """A study section: one set of sizes per target profile (a 2-core CPU cannot run the GPU sizes)."""

    cpu: Any
    gpu: Any


class G1T2Section(ByProfile):
    cpu: G1T2Shape
    gpu: G1T2Shape


class G1T1Section(ByProfile):
    cpu: G1T1Sweep
    gpu: G1T1Sweep


KERNEL_PROVIDERS = ("eager", "compile", "liger", "ours", "ours_inplace")  # ours_inplace: RoPE only
KernelName = Literal["rms_norm", "swiglu", "rope", "qk_norm_rope"]


class _KernelCommon(_Section):
    dtypes: Annotated[list[DType], Field(min_length=1)]
    modes: Annotated[list[Literal["fwd", "bwd", "fwd_bwd"]], Field(min_length=1)]
    providers: Annotated[list[Literal[KERNEL_PROVIDERS]], Field(min_length=1)]  # type: ignore[valid-type]
    head_dim: PositiveInt = 128  # rope kernels: heads = hidden / head_dim
    gqa: PositiveInt = 4  # rope kernels: query heads per kv head

    @field_validator("head_dim")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError(f"head_dim must be even (rotary pairs); got {v}")
        return v


class G4T2Point(_KernelCommon):
    """The guide's point: B=4, S=512, D=768, for RoPE, SwiGLU, RMSNorm."""

    batch: PositiveInt
    seq_len: PositiveInt
    dim: PositiveInt
    kernels: Annotated[list[KernelName], Field(min_length=1)]


class RopeCache(_Section):
    layers: PositiveInt  # G4-T1: 24 layers
    head_dim: PositiveInt
    max_seq_len: PositiveInt


class G4T1Sweep(_KernelCommon):
    """Hidden size x token count per kernel; GB/s against the copy bandwidth measured in the run."""

    tokens: Annotated[list[PositiveInt], Field(min_length=1)]
    hidden: Annotated[dict[KernelName, Annotated[list[PositiveInt], Field(min_length=1)]], Field(min_length=1)]
    rope_cache: RopeCache
    # the kernels study's harness (G4-T2's cases too), CUDA: host time per call (calls back to back, no sync)
    # and kernel time per call (profiled calls)
    host_calls: NonNegativeInt = 20
    kernel_calls: NonNegativeInt = 10


class G4T2Section(ByProfile):
    cpu: G4T2Point
    gpu: G4T2Point


class G4T1Section(ByProfile):
    cpu: G4T1Sweep
    gpu: G4T1Sweep


# ---------------------------------------------------------------------- G2: the AdaAttention studies

# Whole attention modules (projections + attention + output projection), compared in
# G2-T1 (cpu_baseline) and G2-B (scaling); ``direct:<backend>`` is the same module calling one of
# the kernel manager's backends itself (no manager, no precision policy).
MODULE_PROVIDERS = ("mha", "standard", "adaattn", "adaattn_auto", "adaattn_noopt")


def _module_provider_names() -> tuple[str, ...]:
    return (*MODULE_PROVIDERS, *(f"direct:{b}" for b in BACKENDS))


def _backend_names() -> tuple[str, ...]:
    return BACKENDS


def _check_names(v: list[str], allowed: tuple[str, ...], what: str) -> list[str]:
    unknown = [p for p in v if p not in allowed]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; allowed: {', '.join(allowed)}")
    if len(set(v)) != len(v):
        raise ValueError(f"{what} must not repeat")
    return v


class Rounds(_Section):
    """Calls side by side (``side_by_side.py``, docs/methods.md): about ``budget_ms`` of calls per group, in
    ``min_rounds`` to ``max_rounds`` shuffled rounds; a rival slower than ``contender`` x the fastest in
    warm-up is not timed in them."""

    budget_ms: float = Field(gt=0)
    min_rounds: PositiveInt
    max_rounds: PositiveInt
    contender: float = Field(3.0, gt=1)

    @model_validator(mode="after")
    def _order(self) -> "Rounds":
        if self.min_rounds > self.max_rounds:
            raise ValueError(f"min_rounds={self.min_rounds} must be at most max_rounds={self.max_rounds}")
        return self


class _ModuleCommon(_Section):
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
        e = info.data.get("embed_dim")
        if e is not None and e % v:
            raise ValueError(f"heads={v} must divide embed_dim={e}")
        return v

    @field_validator("providers")
    @classmethod
    def _providers(cls, v: list[str]) -> list[str]:
        return _check_names(v, _module_provider_names(), "module provider(s)")

    @field_validator("manager_backends")
    @classmethod
    def _backends(cls, v: list[str] | None) -> list[str] | None:
        return v if v is None else _check_names(v, _backend_names(), "attention backend(s)")


class G2T1Point(_ModuleCommon):
    """The guide's CPU points B4_S128, B4_S512, B1_S1024 (embed 512, 8 heads: the guide's examples)."""

    points: Annotated[list[tuple[PositiveInt, PositiveInt]], Field(min_length=1)]  # (batch, seq_len)


class G2T1Section(_Section):
    cpu: G2T1Point  # a CPU table: no GPU profile


class StackCheck(_Section):
    """A stack of transformer blocks, AdaAttention's vs SDPA's, both compiled: a training step (forward and
    backward), side by side."""

    layers: PositiveInt
    embed_dim: PositiveInt
    heads: PositiveInt
    mlp_ratio: PositiveInt
    batch: PositiveInt
    seq_len: PositiveInt
    dtype: DType
    side_by_side: Rounds


class G2BSweep(_ModuleCommon):
    """Batch sweep at one sequence length, sequence sweep at one batch (up to 16K tokens)."""

    batch_sweep_seq_len: PositiveInt
    batches: Annotated[list[PositiveInt], Field(min_length=1)]
    seq_sweep_batch: PositiveInt
    seq_lens: Annotated[list[PositiveInt], Field(min_length=1)]
    causal: Annotated[list[bool], Field(min_length=1)]
    utilization_s: float = Field(0.5, ge=0)  # NVML utilization over this many seconds of calls; 0: none
    utilization_providers: list[str] = []  # which providers it is sampled for (it costs the time above)
    # the compiled goal: AdaAttention compiled (compile_mode) beside the module compiled around each of these
    # backends called directly, at every shape; []: not taken
    compiled_backends: list[str] = []
    compile_mode: Literal["reduce-overhead", "default", "max-autotune-no-cudagraphs"] = "reduce-overhead"
    stack: StackCheck | None = None  # the stack check; null: not taken
    # the kernel-time goal: rounds of one call of each provider in one profiler trace; 0: not taken (a CPU)
    goal_kernel_calls: NonNegativeInt = 0

    @field_validator("utilization_providers")
    @classmethod
    def _util(cls, v: list[str]) -> list[str]:
        return _check_names(v, _module_provider_names(), "utilization provider(s)")

    @field_validator("compiled_backends")
    @classmethod
    def _compiled(cls, v: list[str]) -> list[str]:
        return _check_names(v, _backend_names(), "compiled backend(s)")


class G2BSection(ByProfile):
    cpu: G2BSweep
    gpu: G2BSweep


Precision = Literal["fp32", "tf32", "fp16", "bf16"]


class G2T3Point(_Section):
    """Precision of the attention op and of AdaAttention in a transformer block, vs float64."""

    batch: PositiveInt
    seq_len: PositiveInt
    embed_dim: PositiveInt
    heads: PositiveInt
    ops: Annotated[list[Literal["attention", "block"]], Field(min_length=1)]
    inputs: Annotated[list[Literal["normal", "outliers"]], Field(min_length=1)]
    outlier_prob: float = Field(0.001, gt=0, lt=1)  # N(0,1) + N(0, outlier_std^2) x Bernoulli(outlier_prob)
    outlier_std: float = Field(10.0, gt=0)
    precisions: Annotated[list[Precision], Field(min_length=1)]
    modes: Annotated[list[Mode], Field(min_length=1)]

    @field_validator("heads")
    @classmethod
    def _heads_divide(cls, v: int, info) -> int:
        e = info.data.get("embed_dim")
        if e is not None and e % v:
            raise ValueError(f"heads={v} must divide embed_dim={e}")
        return v

    @field_validator("precisions")
    @classmethod
    def _fp32_first(cls, v: list[str]) -> list[str]:
        if "fp32" not in v:
            raise ValueError("precisions must include fp32 (every ratio is vs fp32)")
        return _check_names(v, ("fp32", "tf32", "fp16", "bf16"), "precision(s)")


class G2T3Section(ByProfile):
    cpu: G2T3Point
    gpu: G2T3Point


class G2C1Rank(_Section):
    """Adaptive rank: Nyström error and speed by rank and sequence length; the rank estimators."""

    batch: PositiveInt
    heads: PositiveInt
    head_dim: PositiveInt
    seq_lens: Annotated[list[PositiveInt], Field(min_length=1)]
    dtype: DType
    ranks: Annotated[list[PositiveInt], Field(min_length=1)]  # Nyström landmarks
    true_ranks: Annotated[list[PositiveInt], Field(min_length=1)]  # clustered inputs of known rank
    cluster_noise: float = Field(0.05, ge=0)  # std of each token around its cluster centre
    # where a cluster's tokens sit: spread uniformly over the sequence, or one contiguous run each
    cluster_layouts: Annotated[list[Literal["spread", "contiguous"]], Field(min_length=1)]
    random_inputs: bool = True  # also N(0, 1) q and k (no low-rank structure)
    exact_providers: Annotated[list[str], Field(min_length=1)]  # exact backends timed beside the low-rank path
    error_tolerance: float = Field(0.05, gt=0)  # the oracle rank: fewest landmarks with rel_l2 below this
    sample_rows: PositiveInt = 64  # AdaAttention's rank_sample_rows (the policy's sample)
    full_spectrum_max_len: PositiveInt = 4096  # the full-matrix effective rank up to this length
    energy: float = Field(0.99, gt=0, lt=1)  # the rank estimators: singular values holding this share of the energy
    # CUDA: the goal's cases timed side by side (exact backends and the goal's landmark counts), and the
    # summed kernel time of this many profiled calls per provider (0: none)
    side_by_side: Rounds | None = None
    kernel_calls: NonNegativeInt = 0
    # real inputs: q, k, v of these all-MiniLM-L6-v2 layers (0-5) over windows of these lengths
    # (word pieces, at most its 512 positions); both empty: none
    real_layers: list[Annotated[int, Field(ge=0, le=5)]] = []
    real_seq_lens: list[Annotated[int, Field(ge=16, le=512)]] = []

    @model_validator(mode="after")
    def _real(self) -> G2C1Rank:
        if bool(self.real_layers) != bool(self.real_seq_lens):
            raise ValueError("real_layers and real_seq_lens are both set (real inputs) or both empty (none); got "
                             f"real_layers={self.real_layers}, real_seq_lens={self.real_seq_lens}")
        return self

    @field_validator("exact_providers")
    @classmethod
    def _exact(cls, v: list[str]) -> list[str]:
        return _check_names(v, _backend_names(), "exact backend(s)")


class G2C1Section(ByProfile):
    cpu: G2C1Rank
    gpu: G2C1Rank


RUNGS = ("fp32", "tf32", "bf16", "sdpa", "fused_adamw", "compile", "ada", "checkpointing")


class TrainingLadder(_Section):
    """G0-T1 and G0-C1: a preset's training step at one shape, climbing a ladder of optimisations, each rung
    adding its own to every rung listed before it (``fp32``: eager fp32 with naive attention and AdamW's
    foreach step; ``tf32``; ``bf16`` autocast; ``sdpa`` attention; ``fused_adamw``; ``compile`` (default
    mode); ``ada`` (AdaAttention); ``checkpointing`` (full)). The rungs' steps are timed side by side."""

    model: str  # a preset of `models`
    batch: PositiveInt
    seq_len: PositiveInt
    rungs: Annotated[list[Literal[RUNGS]], Field(min_length=1)]  # type: ignore[valid-type]
    # G0-C1's "each mode": the compile rung's step in each of these torch.compile modes, side by side with the rung
    # before it (eager), its own group of rounds; [] = the ladder's default mode only
    compile_modes: list[Literal["default", "reduce-overhead", "max-autotune"]] = []
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _modes(self) -> TrainingLadder:
        if self.compile_modes and ("compile" not in self.rungs or self.rungs[0] == "compile"):
            raise ValueError("compile_modes needs the 'compile' rung and a rung before it (the eager step it is "
                             f"timed against); got rungs {', '.join(self.rungs)}")
        if len(set(self.compile_modes)) != len(self.compile_modes):
            raise ValueError(f"compile_modes must not repeat a mode; got {', '.join(self.compile_modes)}")
        return self

    @field_validator("rungs")
    @classmethod
    def _ladder(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or sorted(v, key=RUNGS.index) != v:
            raise ValueError(f"rungs climb in this order, each once: {', '.join(RUNGS)}; got {', '.join(v)}")
        return v


class G0T1Section(ByProfile):
    cpu: TrainingLadder
    gpu: TrainingLadder


class G1C1Sweep(_Section):
    """G1-C1's GEMM and module claims, measured by the training study: an ``gemm_n``-cubed fp32 matmul with TF32
    off and on, side by side (claim: TF32 4x faster); ``nn.MultiheadAttention`` against the zoo's SDPA attention
    layer of the same width, heads and projections (non-causal, autocast to ``dtype`` over fp32 weights),
    forward and training call side by side (claim: the default MultiheadAttention is already optimised)."""

    gemm_n: PositiveInt
    batch: PositiveInt
    seq_len: PositiveInt
    dim: PositiveInt
    heads: PositiveInt
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _heads_divide(self) -> G1C1Sweep:
        if self.dim % self.heads:
            raise ValueError(f"heads={self.heads} must divide dim={self.dim}")
        return self


class G1C1Section(ByProfile):
    cpu: G1C1Sweep
    gpu: G1C1Sweep


class CheckpointingSweep(_Section):
    """G4-T3 and G4-T1's checkpointing line: each preset's training step (eager, autocast to ``dtype``, fused
    AdamW on a GPU) at every granularity, ``none`` first: peak memory, the forward's memory, step time side
    by side, and the card's estimate beside the measured peak."""

    models: Annotated[list[str], Field(min_length=1)]  # presets of `models`
    batch: PositiveInt
    seq_len: PositiveInt
    granularities: Annotated[list[Literal[CHECKPOINTING]], Field(min_length=2)]  # type: ignore[valid-type]
    every: PositiveInt = 2  # every_k's k
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @field_validator("granularities")
    @classmethod
    def _none_first(cls, v: list[str]) -> list[str]:
        if v[0] != "none" or len(set(v)) != len(v):
            raise ValueError(f"granularities start with 'none' (the baseline), each once; allowed: "
                             f"{', '.join(CHECKPOINTING)}; got {', '.join(v)}")
        return v


class CcgqaSweep(_Section):
    """G4-C1's attention: HYDRA's CCGQA attention layer against the SDPA GQA layer of the same width, query and kv
    heads, a training call (forward and backward) per length, side by side, eager and in each of ``compile_modes``;
    ``tokens`` per call (batch = tokens / length), autocast to ``dtype`` over fp32 weights as in training."""

    models: Annotated[list[str], Field(min_length=1)]  # presets of `models` with attention ccgqa
    seq_lens: Annotated[list[PositiveInt], Field(min_length=1)]
    tokens: PositiveInt
    # torch.compile modes, each mode's pair timed side by side apart from the eager pair; the goal is read on
    # the last (reduce-overhead: CUDA graphs take the host's launch work off a small layer); [] = eager only
    compile_modes: list[Literal["default", "reduce-overhead", "max-autotune"]] = ["default", "reduce-overhead"]
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _whole_batches(self) -> CcgqaSweep:
        for s in self.seq_lens:
            if self.tokens % s:
                raise ValueError(f"tokens={self.tokens} must be a multiple of every seq_lens entry; got {s}")
        if len(set(self.compile_modes)) != len(self.compile_modes):
            raise ValueError(f"compile_modes must not repeat a mode; got {', '.join(self.compile_modes)}")
        return self


class G4C1Section(ByProfile):
    cpu: CcgqaSweep
    gpu: CcgqaSweep


MFU_CONFIGS = ("plain", "kernels", "loss", "fp8")


class MfuCase(_Section):
    """One model's training step at one shape, in each of ``configs`` (``plain`` first: the baseline; each config
    adds its setting to every config listed before it)."""

    model: str
    batch: PositiveInt
    seq_len: PositiveInt
    configs: Annotated[list[Literal[MFU_CONFIGS]], Field(min_length=1)] = ["plain", "kernels"]  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _plain_first(self) -> MfuCase:
        if self.configs[0] != "plain" or len(set(self.configs)) != len(self.configs):
            raise ValueError(f"configs must start with 'plain' (the baseline) and not repeat one; got "
                             f"{', '.join(self.configs)} (allowed: {', '.join(MFU_CONFIGS)})")
        return self


class MfuSweep(_Section):
    """The MFU goals: each case's training step (``Trainer.train_step``) in each config, side by side: ``plain``
    (compiled PyTorch: SDPA, bf16 autocast, TF32, fused AdamW, PyTorch's norm and activation ops for inductor to
    fuse, the loss eager), ``kernels`` (our Triton kernels), ``loss`` (the loss compiled too) and ``fp8``
    (torchao's float8 training on the blocks' linears), each config adding its setting to those listed before
    it. Each case's models are resident together: their weights and AdamW state must fit."""

    cases: Annotated[list[MfuCase], Field(min_length=1)]
    compile_mode: Literal["default", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    compile_scope: Literal["model", "blocks"] = "blocks"  # blocks: one compiled block shared by every layer
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0


class MfuSection(ByProfile):
    cpu: MfuSweep
    gpu: MfuSweep


MEMORY_SWEEPS = ("batch", "seq_len", "memory_slots", "dim", "n_layers")


class MemorySweep(_Section):
    """G3-T1: where an LTM transformer's memory goes, each component measured over sweeps of one variable at a time
    (the others at ``batch``, ``seq_len`` and the preset's own): parameters (bytes; over ``n_layers`` and ``dim``),
    the memory bank (the banks' bytes after a sequence long enough to fill them; over ``memory_slots`` and
    ``dim``), attention (one attention layer's training call's peak, SDPA's math backend and its fused ones; over
    ``batch`` and ``seq_len``) and activations (a training step's forward and backward peak over the weights;
    over ``batch``, ``seq_len`` and ``dim``), and each component's optimisation (quantisation, compression,
    FlashAttention, checkpointing). The report fits each component's exponent in each variable."""

    model: str  # an LTM preset of `models` (memory_slots set)
    batch: PositiveInt
    seq_len: PositiveInt
    sweeps: dict[Literal[MEMORY_SWEEPS], Annotated[list[PositiveInt], Field(min_length=2)]]  # type: ignore[valid-type]
    dtype: Literal["bf16", "fp32"] = "bf16"
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _distinct(self) -> MemorySweep:
        for key, values in self.sweeps.items():
            if len(set(values)) < 2:
                raise ValueError(f"sweeps.{key} needs two distinct values or more to fit an exponent; got {values}")
        return self


class G3T1Section(ByProfile):
    cpu: MemorySweep
    gpu: MemorySweep


INFERENCE_CONFIGS = ("base", "flash", "int8", "compiled", "compiled_int8", "compiled_torchao_int8", "no_cache")


class InferenceSweep(_Section):
    """G3-T3 and issue 48's decode goals: a dense decoder's prefill and decode in each of ``configs`` at each of
    ``batches``, side by side per batch: ``base`` (eager, SDPA's math backend: the scores materialised),
    ``flash`` (SDPA's fused backends), ``int8`` (flash with INT8 weight-only linears), ``compiled`` (flash, the
    decode step compiled with CUDA graphs), ``compiled_int8`` (the same over INT8 weights),
    ``compiled_torchao_int8`` (the same over torchao's ``Int8WeightOnlyConfig``: the peer) and ``no_cache``
    (flash without the KV cache: each new token runs the whole prefix again). ``prompt_len`` tokens of prompt;
    the cache holds ``prompt_len + new_tokens``; weights in ``dtype``."""

    model: str  # a preset of `models`: a dense decoder with SDPA attention
    batches: Annotated[list[PositiveInt], Field(min_length=1)]
    prompt_len: PositiveInt
    new_tokens: PositiveInt
    configs: Annotated[list[Literal[INFERENCE_CONFIGS]], Field(min_length=1)]  # type: ignore[valid-type]
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _configs(self) -> InferenceSweep:
        if len(set(self.configs)) != len(self.configs) or len(set(self.batches)) != len(self.batches):
            raise ValueError(f"configs and batches must not repeat one; got configs {', '.join(self.configs)}, "
                             f"batches {self.batches}")
        return self


class G3T3Section(ByProfile):
    cpu: InferenceSweep
    gpu: InferenceSweep


DISTRIBUTED_LAYOUTS = ("ddp", "fsdp", "tp", "fsdp_tp")  # fsdp_tp: FSDP2 over tensor-parallel pairs (a 2-D mesh)


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
    first, and a later round's job starts only if its first-round time still fits (a row says which did not):
    a machine lent for a few minutes a call keeps what was measured."""

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
        return self


class G3T2Section(ByProfile):
    cpu: DistributedRun
    gpu: DistributedRun
    gpu4: DistributedRun | None = None  # a GPU target of 4 GPUs or more runs this one, where given (else gpu)


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


class TrainRun(TrainSchedule):
    """The train stage: each of ``models`` trained from fresh weights on the schedule."""

    models: Annotated[list[str], Field(min_length=1)]  # presets of `models`


MEMORY_BANK_ROLES = ("standard", "window", "ltm")
RECALL_SPAN = 32  # a recall sequence's bytes besides its distance (the key's line, the query), at most


class MemoryBankRun(_Section):
    """G3-T4: a standard decoder, the same with sliding-window attention and the same with an LTM memory bank
    (``models``: role -> preset). Memory: at each of ``contexts`` tokens (``batch`` sequences, weights in
    ``dtype``), a forward's peak over the weights (the standard model with SDPA's math backend, the scores in
    memory, and with its fused ones; the LTM model segment by segment) and the state kept for the next token
    (the standard model's KV cache, the LTM model's segment caches and banks). Quality: each model trained on ``train``'s schedule
    (the same text, batches and steps); its validation loss at each of ``eval_contexts``; and a passkey's recall
    at each of ``recall_distances`` (``recall_trials`` sequences each)."""

    models: dict[Literal[MEMORY_BANK_ROLES], str]  # type: ignore[valid-type]
    batch: PositiveInt = 1
    contexts: Annotated[list[PositiveInt], Field(min_length=1)]
    dtype: Literal["bf16", "fp32"] = "bf16"
    train: TrainSchedule
    eval_contexts: Annotated[list[PositiveInt], Field(min_length=1)]
    recall_distances: Annotated[list[Annotated[int, Field(ge=RECALL_SPAN)]], Field(min_length=1)]
    recall_trials: PositiveInt = 16
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _roles(self) -> "MemoryBankRun":
        if set(self.models) != set(MEMORY_BANK_ROLES):
            raise ValueError(f"models needs one preset for each role ({', '.join(MEMORY_BANK_ROLES)}); got "
                             f"{', '.join(self.models) or 'none'}")
        for key in ("contexts", "eval_contexts", "recall_distances"):
            values = getattr(self, key)
            if len(set(values)) != len(values):
                raise ValueError(f"{key} must not repeat a value; got {values}")
        return self


class G3T4Section(ByProfile):
    cpu: MemoryBankRun
    gpu: MemoryBankRun


class TrainSection(ByProfile):
    cpu: TrainRun | None = None
    gpu: TrainRun | None = None
    # the targets of study_targets.train split by what their stage keeps: keep_weights, the results and the
    # weights (a DVC output, models/weights/<target>); results_only, the results (the GPU machines here return
    # no file over 16 MiB, and a clean clone without the weights would rerun a GPU stage it cannot run)
    keep_weights: dict[str, Profile] = {}
    results_only: dict[str, Profile] = {}


class G4T3Section(ByProfile):
    cpu: CheckpointingSweep
    gpu: CheckpointingSweep


class Verdicts(_Section):
    """The verdict rule's tolerances and the project's goals' bounds (docs/methods.md, Verdicts): what the
    reports judge by, so that every verdict is regenerated from parameters."""

    guide_ratio_tolerance: float = Field(0.10, ge=0)  # a guide's ratio or ms from other hardware (G1, G4)
    guide_memory_tolerance: float = Field(0.25, ge=0)  # G1-T2's memory figures
    precision_tolerance: float = Field(0.20, ge=0)  # G2-T3's "~1.8x" and "~0.5x"
    same_time_tolerance: float = Field(0.10, ge=0)  # G2-T1's "the same ms"
    goal_overhead: float = Field(1.03, gt=1)  # G2-B: AdaAttention at most this x the fastest direct backend
    first_call_budget_s: float = Field(0.5, gt=0)  # G2-B: a new signature's first call, over the direct one's
    stack_bound: float = Field(1.02, gt=1)  # G2-B: the 12-block stack's step time over SDPA's
    low_rank_speedup: float = Field(2.0, gt=1)  # G2-C1: the low-rank path over the best exact backend
    low_rank_min_len: PositiveInt = 8192  # G2-C1: ... at S at least this
    low_rank_landmarks_div: PositiveInt = 16  # G2-C1: ... with at most S / this landmarks
    gpu_bound: float = Field(3.0, gt=0)  # G2-B: a shape is GPU-bound where the kernel time is this x the host time
    kernel_peer_ratio: float = Field(0.97, gt=0)  # G4-T1: our kernels at least this x the best peer's speed
    kernel_copy_fraction: float = Field(0.90, gt=0, le=1)  # G4-T1: forward at least this of copy bandwidth
    memory_estimate: float = Field(0.10, gt=0)  # G4-T3: the card's estimate within this of the measured peak
    ccgqa_bound: float = Field(1.2, gt=0)  # G4-C1: CCGQA's training call at most this x SDPA GQA's (compiled)
    # the MFU goals (the mfu study): a preset's best config at least this MFU against the measured bf16 GEMM
    # rate, and at least mfu_speedup x the plain compiled model's tokens/s where the preset is listed there
    mfu_goals: dict[str, Annotated[float, Field(gt=0, le=1)]] = {"g0_transformer": 0.55, "llama_1b": 0.60}
    mfu_speedup: dict[str, Annotated[float, Field(gt=0)]] = {"llama_1b": 1.1}
    decode_roofline: float = Field(0.80, gt=0, le=1)  # G3-T3: batch-1 decode's bytes / time over the copy bandwidth
    int8_decode_speedup: float = Field(1.7, gt=0)  # G3-T3: INT8 weight-only decode over bf16's, batch 1, compiled
    scaling_efficiency: float = Field(0.95, gt=0, le=1)  # G3-T2: tokens/s per GPU at N GPUs over one GPU's
    tp_decode_latency: float = Field(0.6, gt=0)  # G3-T3: TP=2 batch-1 decode ms a token over one GPU's, at most
    exponent_tolerance: float = Field(0.15, ge=0)  # G3-T1: a fitted exponent within this fraction of the O()'s
    ltm_memory_ratio: float = Field(8.0, gt=1)  # G3-T4: the standard model's memory at 32K over the LTM model's


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


class Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    targets: Annotated[dict[str, Target], Field(min_length=1)]
    bench: Bench = Bench()
    verdicts: Verdicts = Verdicts()
    g1_t2: G1T2Section = Field(alias="G1-T2")
    g1_t1: G1T1Section = Field(alias="G1-T1")
    g4_t2: G4T2Section = Field(alias="G4-T2")
    g4_t1: G4T1Section = Field(alias="G4-T1")
    g2_t1: G2T1Section = Field(alias="G2-T1")
    g2_t3: G2T3Section = Field(alias="G2-T3")
    g2_b: G2BSection = Field(alias="G2-B")
    g2_c1: G2C1Section = Field(alias="G2-C1")
    study_targets: dict[str, dict[str, Profile]] = {}
    models: dict[str, ModelConfig] = {}  # the model zoo's presets (adaattn.models)
    g0_t1: G0T1Section | None = Field(None, alias="G0-T1")
    g4_t3: G4T3Section | None = Field(None, alias="G4-T3")
    g1_c1: G1C1Section | None = Field(None, alias="G1-C1")
    g4_c1: G4C1Section | None = Field(None, alias="G4-C1")
    train: TrainSection | None = None
    mfu: MfuSection | None = None
    allocator: AllocatorSection | None = None
    g3_t3: G3T3Section | None = Field(None, alias="G3-T3")
    g3_t2: G3T2Section | None = Field(None, alias="G3-T2")
    g3_t1: G3T1Section | None = Field(None, alias="G3-T1")
    g3_t4: G3T4Section | None = Field(None, alias="G3-T4")
    parallel: Layout = Layout()  # adaattn.distributed: the processes' layout

    @model_validator(mode="after")
    def _ladder_models(self) -> Params:
        for profile in ("cpu", "gpu"):
            sec = getattr(self.g0_t1, profile, None) if self.g0_t1 else None
            if sec is None:
                continue
            if sec.model not in self.models:
                raise ValueError(f"G0-T1.{profile}.model {sec.model!r} is not a preset of models; allowed: "
                                 f"{', '.join(self.models)}")
            if sec.seq_len > self.models[sec.model].max_seq_len:
                raise ValueError(f"G0-T1.{profile}.seq_len={sec.seq_len} is over models.{sec.model}.max_seq_len")
            if "ada" in sec.rungs and self.models[sec.model].positions != "learned":
                raise ValueError(f"G0-T1.{profile}.rungs: 'ada' needs models.{sec.model}.positions 'learned' "
                                 "(AdaAttention takes no rotary positions)")
        if self.train is not None:
            both = set(self.train.keep_weights) & set(self.train.results_only)
            split = {**self.train.keep_weights, **self.train.results_only}
            if both or split != self.study_targets.get("train", split):
                raise ValueError(f"train.keep_weights and train.results_only must split study_targets.train between "
                                 f"them, each target once; got keep_weights {sorted(self.train.keep_weights)}, "
                                 f"results_only {sorted(self.train.results_only)}, study_targets.train "
                                 f"{sorted(self.study_targets.get('train', {}))}")
        for profile in ("cpu", "gpu"):
            run = getattr(self.g3_t1, profile) if self.g3_t1 else None
            if run is not None:
                longest = max([run.seq_len, *run.sweeps.get("seq_len", [])])
                self._check_preset(f"G3-T1.{profile}", run.model, longest)
                if self.models[run.model].memory_slots is None:
                    raise ValueError(f"G3-T1.{profile}.model {run.model!r} has no memory bank (memory_slots): the study "
                                     "measures an LTM preset")
        for profile in ("cpu", "gpu"):
            run = getattr(self.g3_t4, profile) if self.g3_t4 else None
            if run is not None:
                self._check_memory_bank(profile, run)
        for profile in ("cpu", "gpu"):
            run = getattr(self.g3_t3, profile) if self.g3_t3 else None
            if run is not None:
                self._check_preset(f"G3-T3.{profile}", run.model, run.prompt_len + run.new_tokens)
                from adaattn.models.generate import check_decodable

                try:
                    check_decodable(self.models[run.model])
                except ValueError as err:
                    raise ValueError(f"G3-T3.{profile}.model {run.model!r}: {err}") from None
        for profile in ("cpu", "gpu", "gpu4"):
            run = getattr(self.g3_t2, profile) if self.g3_t2 else None
            for name in run.models if run else ():
                self._check_preset(f"G3-T2.{profile}", name, run.seq_len)
            if run is not None and run.decode is not None:
                dec = run.decode
                self._check_preset(f"G3-T2.{profile}.decode", dec.model, dec.prompt_len + dec.new_tokens)
                from adaattn.models.generate import check_decodable

                try:
                    check_decodable(self.models[dec.model])
                except ValueError as err:
                    raise ValueError(f"G3-T2.{profile}.decode.model {dec.model!r}: {err}") from None
        for profile in ("cpu", "gpu"):
            run = getattr(self.allocator, profile) if self.allocator else None
            if run is not None:
                self._check_preset(f"allocator.{profile}", run.model, max(*run.seq_lens, run.probe_seq_len))
        for section, key in ((self.train, "train"), (self.g4_t3, "G4-T3")):
            for profile in ("cpu", "gpu"):
                run = getattr(section, profile, None) if section else None
                for name in run.models if run else ():
                    self._check_preset(f"{key}.{profile}", name, run.seq_len)
        for profile in ("cpu", "gpu"):
            for i, case in enumerate(getattr(self.mfu, profile).cases if self.mfu else ()):
                self._check_preset(f"mfu.{profile}.cases[{i}]", case.model, case.seq_len)
        for profile in ("cpu", "gpu"):
            run = getattr(self.g4_c1, profile, None) if self.g4_c1 else None
            for name in run.models if run else ():
                if name not in self.models:  # a layer, not the model: its lengths may pass max_seq_len
                    raise ValueError(f"G4-C1.{profile}.models: {name!r} is not a preset of models; allowed: "
                                     f"{', '.join(self.models)}")
                if self.models[name].attention != "ccgqa":
                    raise ValueError(f"G4-C1.{profile}.models: {name!r} has attention "
                                     f"{self.models[name].attention!r}; the study compares 'ccgqa' presets")
        return self

    def _check_memory_bank(self, profile: str, run: MemoryBankRun) -> None:
        """G3-T4's three presets: each its role's kind of model, and otherwise the same model."""
        longest = max(run.train.seq_len, *run.contexts, *run.eval_contexts, max(run.recall_distances) + RECALL_SPAN)
        for role, name in run.models.items():  # an LTM model's positions count within a segment: any length
            self._check_preset(f"G3-T4.{profile}", name, 0 if role == "ltm" else longest)
        cfgs = {role: self.models[name] for role, name in run.models.items()}
        wrong = {"standard": cfgs["standard"].memory_slots is not None or cfgs["standard"].attention_window is not None,
                 "window": cfgs["window"].attention_window is None,
                 "ltm": cfgs["ltm"].memory_slots is None}
        needs = {"standard": "no memory_slots and no attention_window", "window": "an attention_window",
                 "ltm": "memory_slots (a memory bank)"}
        for role, bad in wrong.items():
            if bad:
                raise ValueError(f"G3-T4.{profile}.models.{role}: {run.models[role]!r} needs {needs[role]}")
        shared = ("dim", "n_layers", "n_heads", "kv_heads", "hidden", "positions")
        for role in ("window", "ltm"):
            differ = [k for k in shared if getattr(cfgs[role], k) != getattr(cfgs["standard"], k)]
            if differ:
                raise ValueError(f"G3-T4.{profile}.models.{role}: {run.models[role]!r} differs from the standard "
                                 f"preset {run.models['standard']!r} in {', '.join(differ)}: the three compare one "
                                 "model with and without its memory")

    def _check_preset(self, where: str, name: str, seq_len: int) -> None:
        if name not in self.models:
            raise ValueError(f"{where}.models: {name!r} is not a preset of models; allowed: {', '.join(self.models)}")
        if seq_len > self.models[name].max_seq_len:
            raise ValueError(f"{where}.seq_len={seq_len} is over models.{name}.max_seq_len")

    @field_validator("models")
    @classmethod
    def _model_names(cls, v: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in v:
            if not name.replace("_", "").isalnum() or name != name.lower():
                raise ValueError(f"model preset name {name!r} must be lower-case letters, digits or '_'")
        return v

    @field_validator("study_targets")
    @classmethod
    def _study_targets(cls, v: dict[str, dict[str, str]], info) -> dict[str, dict[str, str]]:
        targets = info.data.get("targets") or {}
        for study, entries in v.items():
            for name, profile in entries.items():
                if name not in targets:
                    raise ValueError(f"study_targets.{study}: {name!r} is not a target; allowed: {', '.join(targets)}")
                if targets[name].profile != profile:
                    raise ValueError(f"study_targets.{study}.{name}: profile {profile!r} but targets.{name} has "
                                     f"profile {targets[name].profile!r}")
        return v

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: dict[str, Target]) -> dict[str, Target]:
        for name, t in v.items():
            if not name.replace("_", "").isalnum() or name != name.lower():
                raise ValueError(f"target name {name!r} must be lower-case letters, digits or '_'")
            if t.device == "cuda" and not t.gpu_name:
                raise ValueError(f"target {name!r}: device cuda needs gpu_name (e.g. 'H100')")
            if t.device == "cpu" and t.profile != "cpu":
                raise ValueError(f"target {name!r}: a cpu device runs profile 'cpu'")
        return v


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source} is invalid:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            parent = _allowed_keys(e["loc"][:-1])
            msg = f"unknown key; allowed keys here: {', '.join(parent)}" if parent else "unknown key"
        got = e.get("input")
        # a check across sections names its keys in the message; the input it got is the whole file
        shown = f" (got {got!r})" if not isinstance(got, dict) or len(repr(got)) <= 200 else ""
        lines.append(f"  {loc or 'params'}: {msg}{shown}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    """Keys allowed at ``loc`` in the schema (aliases as written in params.yaml), for error messages."""
    model: Any = Params
    parts = iter(loc)
    for part in parts:
        fields = model.model_fields
        name = next((n for n, f in fields.items() if part in (n, f.alias)), None)
        if name is None:
            return []
        ann = fields[name].annotation
        if typing.get_origin(ann) is dict:  # dict[str, Model]: the next part is a free key
            next(parts, None)
            ann = typing.get_args(ann)[1]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [f.alias or n for n, f in model.model_fields.items()]


def set_override(raw: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c=value`` in a raw params dict; the path must already exist (no new keys)."""
    parts = dotted.split(".")
    node = raw
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            allowed = ", ".join(node) if isinstance(node, dict) else "(not a section)"
            where = ".".join(parts[:i]) or "params.yaml"
            raise ConfigError(f"override {dotted!r}: no key {part!r} under {where}; allowed: {allowed}")
        if i == len(parts) - 1:
            node[part] = value
        else:
            node = node[part]


def parse_override(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE parsed as YAML (``[512, 1024]``, ``false``, ``bf16``)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like KEY=VALUE, e.g. G1-T1.gpu.seq_lens=[512,1024]")
    key, value = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: VALUE is not valid YAML ({_yaml_problem(err)})") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or type(err).__name__}{where}"


def load_raw(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path} not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return raw


def validate(raw: dict, source: str = "params.yaml") -> Params:
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_params(path: Path = Path("params.yaml"), overrides: list[str] | None = None) -> tuple[Params, dict]:
    """Load, apply ``KEY=VALUE`` overrides, validate. Returns the typed config and the raw dict."""
    raw = load_raw(path)
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        key, value = parse_override(item)
        set_override(raw, key, value)
    return validate(raw, source=str(path) + (" (with overrides)" if overrides else "")), raw


def params_hash(sections: dict[str, Any]) -> str:
    """Stable short hash of the params a result depends on (canonical JSON, sha256)."""
    blob = json.dumps(sections, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
