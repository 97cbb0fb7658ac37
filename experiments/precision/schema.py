"""The precision study's section: G2-T3's ops, inputs and precisions."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveInt, field_validator

from adaattn_pipeline.config import ByProfile, Mode, check_divides
from adaattn_pipeline.config import Section as _Section
from adaattn_pipeline.config import check_names as _check_names

Precision = Literal["fp32", "tf32", "fp16", "bf16"]
FP8_PROVIDERS = ("sdpa_bf16", "sdpa_cudnn_bf16", "fp8", "fp8_pv_bf16", "fp8_e4m3_qk", "sage")


class FP8Point(_Section):
    """8-bit attention beside bf16 (issue 68), forward only: ``providers`` side by side in one run on bf16 inputs of
    (batch, heads, S, head_dim) at each of ``seq_lens``, causal or not, N(0, 1) and outlier-heavy inputs;
    TFLOP/s and error against float64. ``sdpa_bf16``: SDPA's own choice (what users get), ``sdpa_cudnn_bf16``:
    its cuDNN backend; ``fp8``: ours as AdaAttention runs it (kernels/fp8_attention.py: int8 Q·K, FP8 P·V),
    ``fp8_pv_bf16``: with P·V in bf16, ``fp8_e4m3_qk``: with Q·K in e4m3;
    ``sage``: SageAttention 1.0.6 (INT8 Q·K). ``real_layers``: the error on the rank study's captured MiniLM
    q, k, v of these layers at ``real_seq_len`` (data/real_inputs, the real_inputs stage; head dim 32)."""

    batch: PositiveInt
    heads: PositiveInt
    head_dim: Literal[64, 128]
    seq_lens: Annotated[list[PositiveInt], Field(min_length=1)]
    causal: Annotated[list[bool], Field(min_length=1)]
    inputs: Annotated[list[Literal["normal", "outliers"]], Field(min_length=1)]
    providers: Annotated[list[Literal[FP8_PROVIDERS]], Field(min_length=1)]  # type: ignore[valid-type]
    real_seq_len: PositiveInt = 512
    real_layers: list[int] = []
    # AdaAttention's FP8 guard (precision_mode "fp8"): its bound on the estimated relative L2 error; the guard runs
    # on every case's inputs and its decisions are scored against ``fp8``'s measured error (issue 68's
    # ``precision.fp8_max_rel_l2``)
    fp8_max_rel_l2: float = Field(0.03, gt=0)

    @field_validator("providers")
    @classmethod
    def _providers(cls, v: list[str]) -> list[str]:
        return _check_names(v, FP8_PROVIDERS, "provider(s)")


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
    fp8: FP8Point | None = None  # the 8-bit rows (None: none)

    @field_validator("heads")
    @classmethod
    def _heads_divide(cls, v: int, info) -> int:
        return check_divides([v], info.data.get("embed_dim"), "heads", "embed_dim")[0]

    @field_validator("precisions")
    @classmethod
    def _fp32_first(cls, v: list[str]) -> list[str]:
        if "fp32" not in v:
            raise ValueError("precisions must include fp32 (every ratio is vs fp32)")
        return _check_names(v, ("fp32", "tf32", "fp16", "bf16"), "precision(s)")


class FP8Goal(_Section):
    """Issue 68's goals for the 8-bit rows, filed before their first run and read by the report alone (outside the
    results' params hash): ``fp8`` at least ``speedup_vs_cudnn`` x SDPA's cuDNN bf16 TFLOP/s and
    ``speedup_vs_sage`` x SageAttention's at S >= ``min_seq_len`` (head dim 128, causal and not, N(0, 1)
    inputs); on the real inputs a cosine of at least ``min_cosine`` and a relative L2 error of at most
    ``max_rel_l2`` against float64."""

    speedup_vs_cudnn: float = Field(1.3, gt=0)
    speedup_vs_sage: float = Field(1.5, gt=0)
    min_seq_len: PositiveInt = 4096
    min_cosine: float = Field(0.999, gt=0, le=1)
    max_rel_l2: float = Field(0.03, gt=0)


class G2T3Section(ByProfile):
    cpu: G2T3Point
    gpu: G2T3Point
    fp8_goals: FP8Goal = FP8Goal()


SECTIONS = {"G2-T3": G2T3Section}
