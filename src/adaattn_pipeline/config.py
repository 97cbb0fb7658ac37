"""Typed, validated view of ``params.yaml``.

The sections every study shares are defined here: ``targets`` (hardware), ``study_targets`` (which target each
study measures), ``bench`` (timing), ``verdicts`` (tolerances and goals), ``models`` (the zoo's presets) and
``parallel`` (a distributed layout). Each study defines its own sections beside its code
(``experiments/<study>/schema.py``: ``SECTIONS``, named after the guide table they regenerate, ``G1-T2``...) and
``params_model`` puts them together. Every section is a frozen pydantic model with ``extra="forbid"``: a wrong
type, an unknown key or a non-positive size stops the run with an error that names the key and the allowed
values, before anything is measured.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError, create_model,
                      field_validator, model_validator)

from adaattn.distributed.layout import Layout  # pydantic only: no torch
from adaattn.errors import ConfigError
from adaattn.models.config import ModelConfig
from adaattn.params import format_errors, load_raw, with_overrides
from adaattn_pipeline import registry

DType = Literal["bf16", "fp16", "fp32"]
Mode = Literal["fwd", "fwd_bwd"]
Profile = Literal["cpu", "gpu"]

__all__ = ["ConfigError", "DType", "Mode", "Profile", "Section", "ByProfile", "Target", "Bench", "Rounds", "Verdicts",
           "Params", "check_names", "check_preset", "params_model", "validate", "load_params", "params_hash",
           "param_values"]


class Section(BaseModel):
    """A section of params.yaml, or part of one: frozen, and an unknown key is an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ByProfile(Section):
    """A study section: one set of sizes per target profile (a 2-core CPU cannot run the GPU sizes)."""

    cpu: Any
    gpu: Any


class Target(Section):
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

    def hardware(self) -> str:
        """What a result of this target must be measured on, in words: ``H100``, ``2 x H100``, ``the CPU``."""
        if self.device == "cpu":
            return "the CPU"
        return f"{self.gpus} x {self.gpu_name}" if self.gpus > 1 else str(self.gpu_name)


class GpuTiming(Section):
    warmup_ms: PositiveInt = 25  # ms of warm-up per measurement (triton.testing.do_bench)
    rep_ms: PositiveInt = 100  # ms of timed repeats per measurement
    # worker processes that compile a study's torch.compile'd providers in parallel before
    # anything is timed (they fill inductor's on-disk caches); 0 compiles in the measuring process
    compile_workers: NonNegativeInt = 0


class CpuTiming(Section):
    warmup: PositiveInt = 1  # untimed calls before timing
    repeats: PositiveInt = 5  # timed calls; quantiles are taken over these
    compile_workers: NonNegativeInt = 0  # as GpuTiming.compile_workers


class Bench(Section):
    gpu: GpuTiming = GpuTiming()
    cpu: CpuTiming = CpuTiming()


class Rounds(Section):
    """Calls side by side (``bench.side_by_side``, docs/methods.md): about ``budget_ms`` of calls per group, in
    ``min_rounds`` to ``max_rounds`` shuffled rounds; a rival slower than ``contender`` x the fastest in
    warm-up is not timed in them."""

    budget_ms: float = Field(gt=0)
    min_rounds: PositiveInt
    max_rounds: PositiveInt
    contender: float = Field(3.0, gt=1)

    @model_validator(mode="after")
    def _order(self) -> Rounds:
        if self.min_rounds > self.max_rounds:
            raise ValueError(f"min_rounds={self.min_rounds} must be at most max_rounds={self.max_rounds}")
        return self


class Verdicts(Section):
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
    # G4-C1: the pair (eager or a compile mode) the goal means; every pair measured gets a verdict of its own
    ccgqa_mode: Literal["eager", "default", "reduce-overhead", "max-autotune"] = "default"
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


def check_names(v: list[str], allowed: tuple[str, ...], what: str) -> list[str]:
    """``v`` when every name is one of ``allowed``, once each; else the error names the unknown ones."""
    unknown = [p for p in v if p not in allowed]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; allowed: {', '.join(allowed)}")
    if len(set(v)) != len(v):
        raise ValueError(f"{what} must not repeat")
    return v


def check_divides(parts: list[int], whole: int | None, what: str, whole_name: str) -> list[int]:
    """``parts`` when each divides ``whole`` (``None``: ``whole`` failed its own check, reported there)."""
    bad = [p for p in parts if whole is not None and whole % p]
    if bad:
        raise ValueError(f"{what} {bad} must divide {whole_name}={whole}")
    return parts


def check_preset(params: Params, where: str, name: str, seq_len: int) -> None:
    """``name`` is a preset of ``models`` long enough for ``seq_len`` tokens (a study's cross-section check)."""
    if name not in params.models:
        raise ValueError(f"{where}.models: {name!r} is not a preset of models; allowed: {', '.join(params.models)}")
    if seq_len > params.models[name].max_seq_len:
        raise ValueError(f"{where}.seq_len={seq_len} is over models.{name}.max_seq_len")


def _lower_name(name: str, what: str) -> str:
    if not name.replace("_", "").isalnum() or name != name.lower():
        raise ValueError(f"{what} name {name!r} must be lower-case letters, digits or '_'")
    return name


class Params(BaseModel):
    """The shared sections. ``params_model()`` extends it with every study's sections, as attributes named after
    the section (``G1-T2`` -> ``g1_t2``); that is the type ``load_params`` returns."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    targets: Annotated[dict[str, Target], Field(min_length=1)]
    bench: Bench = Bench()
    verdicts: Verdicts = Verdicts()
    study_targets: dict[str, dict[str, Profile]] = {}
    models: dict[str, ModelConfig] = {}  # the model zoo's presets (adaattn.models)
    parallel: Layout = Layout()  # adaattn.distributed: the processes' layout

    @field_validator("models")
    @classmethod
    def _model_names(cls, v: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in v:
            _lower_name(name, "model preset")
        return v

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: dict[str, Target]) -> dict[str, Target]:
        for name, t in v.items():
            _lower_name(name, "target")
            if t.device == "cuda" and not t.gpu_name:
                raise ValueError(f"target {name!r}: device cuda needs gpu_name (e.g. 'H100')")
            if t.device == "cpu" and t.profile != "cpu":
                raise ValueError(f"target {name!r}: a cpu device runs profile 'cpu'")
        return v

    @field_validator("study_targets")
    @classmethod
    def _study_targets(cls, v: dict[str, dict[str, str]], info) -> dict[str, dict[str, str]]:
        targets = info.data.get("targets") or {}
        known = registry.study_names()
        for study, entries in v.items():
            if study not in known:
                raise ValueError(f"study_targets: {study!r} is not a study (a folder of experiments/ with a study.py); "
                                 f"allowed: {', '.join(known)}")
            for name, profile in entries.items():
                if name not in targets:
                    raise ValueError(f"study_targets.{study}: {name!r} is not a target; allowed: {', '.join(targets)}")
                if targets[name].profile != profile:
                    raise ValueError(f"study_targets.{study}.{name}: profile {profile!r} but targets.{name} has "
                                     f"profile {targets[name].profile!r}")
        return v


def section_attr(section_id: str) -> str:
    """The attribute a section has on the loaded params: ``G1-T2`` -> ``g1_t2``, ``train`` -> ``train``."""
    return section_id.lower().replace("-", "_")


@functools.cache
def params_model() -> type[Params]:
    """``Params`` with every registered study's sections (optional: a study checks its own are there when it
    runs) and each study's cross-section ``check`` run once the sections are valid."""
    fields = {section_attr(sid): (schema | None, Field(None, alias=sid))
              for sid, (_, schema) in registry.sections().items()}
    checks = registry.checks()

    def _study_checks(self):
        for check in checks:
            check(self)
        return self

    return create_model("Params", __base__=Params, __validators__={"_study_checks": model_validator(mode="after")(
        _study_checks)}, **fields)


def validate(raw: dict, source: str = "params.yaml") -> Params:
    model = params_model()
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_errors(err, source, model)) from None


def load_params(path: Path = Path("params.yaml"), overrides: list[str] | None = None) -> tuple[Params, dict]:
    """Load, apply ``KEY=VALUE`` overrides, validate. Returns the typed config and the raw dict."""
    raw = with_overrides(load_raw(path), overrides)
    return validate(raw, source=str(path) + (" (with overrides)" if overrides else "")), raw


def param_values(raw: dict, keys: list[str]) -> dict[str, Any]:
    """The value at each dotted key of ``raw`` (``targets.h100``, ``G1-T2.gpu``, ``models.llama_1b``)."""
    out = {}
    for key in keys:
        node: Any = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


def params_hash(values: dict[str, Any]) -> str:
    """Stable short hash of the params a result depends on (canonical JSON, sha256)."""
    blob = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
