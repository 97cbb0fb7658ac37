"""The rank study's section: G2-C1's ranks, inputs and the low-rank goal's timing."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from adaattn_experiments.common.modules_schema import backend_names as _backend_names
from adaattn_pipeline.config import ByProfile, DType, Rounds
from adaattn_pipeline.config import Section as _Section
from adaattn_pipeline.config import check_names as _check_names

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


SECTIONS = {"G2-C1": G2C1Section}
