"""The mfu study's section: each case's training step in each config."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from adaattn_pipeline.config import ByProfile, Rounds, check_preset
from adaattn_pipeline.config import Section as _Section

MFU_CONFIGS = ("plain", "kernels", "loss", "fused_loss", "liger_loss", "fp8", "fp8_rowwise", "torchtitan")
FP8_CONFIGS = ("fp8", "fp8_rowwise")  # counted against the FP8 GEMM rate, never the bf16 one
PEERS = ("torchtitan",)  # another library's step at the same shape: timed beside ours, adds no setting to ours
# branches: a config that takes the settings listed before it, which the configs after it do not take (the head
# and loss fused, ours or Liger's: the fp8 configs after them keep the plain head and the compiled loss)
BRANCHES = ("fused_loss", "liger_loss")
NOT_ZOO = (*PEERS, "liger_loss")  # another library's work: compared with, never one of, the zoo's configs


class MfuCase(_Section):
    """One model's training step at one shape, in each of ``configs`` (``plain`` first: the baseline; each of the
    zoo's configs adds its setting to every one listed before it; a peer, ``torchtitan``, is its own step)."""

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
    fuse, the loss eager), ``kernels`` (our Triton kernels), ``loss`` (the loss compiled too), ``fused_loss``
    (the head and the loss fused by chunks, ``models.loss``) and ``liger_loss`` (Liger-Kernel's, the peer), ``fp8``
    (torchao's float8 training on the blocks' linears, tensorwise) and ``fp8_rowwise`` (its rowwise recipe), each
    config adding its setting to those listed before it (but ``BRANCHES``', which no later config takes); ``torchtitan``: torchtitan's llama3 step at the same shape (``titan.py``). Each case's models are
    resident together: their weights and AdamW state must fit."""

    cases: Annotated[list[MfuCase], Field(min_length=1)]
    compile_mode: Literal["default", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    compile_scope: Literal["model", "blocks"] = "blocks"  # blocks: one compiled block shared by every layer
    dtype: Literal["bf16", "fp32"] = "bf16"
    side_by_side: Rounds
    seed: NonNegativeInt = 0


class MfuGoals(_Section):
    """Issue 67's goals, read by the report alone (outside the results' params hash), per preset:

    - ``peer_speedup`` (filed 2026-11-28 before its first run): the zoo's fastest bf16 config (plain, kernels or
      loss: not an FP8 one, since the peer trains in bf16) at least this x torchtitan's tokens/s;
    - ``fp8_speedup`` (filed 2026-11-28 before the first run of ``fp8_rowwise``): ``fp8_rowwise``, the recipe the
      train study prices in validation loss, at least this x the zoo's fastest bf16 config's tokens/s;
    - ``mfu`` (filed 2026-11-28): the best bf16 config's MFU against the bf16 GEMM rate measured in the same run,
      as ``verdicts.mfu_goals`` reads its own (an earlier goal's) figure;
    - ``plain_speedup`` (filed 2026-11-29, after the 8 x 2,048 case's first run; the notebook gives both readings):
      the zoo's fastest bf16 config at least this x plain compiled PyTorch's tokens/s, issue 67's 1.1x as its text
      reads ("best bf16 config"); ``verdicts.mfu_speedup`` reads an earlier goal on the zoo's fastest config of any
      precision;
    - ``batch`` (filed 2026-11-29, before the first run of a second llama_1b case): the batch of the GPU case a
      preset's goals are read on, these and ``verdicts.mfu_goals`` / ``mfu_speedup`` alike (the issue asks for the
      batch picked for the GPU; every config of that case, plain and the peer included, runs at it). A preset
      without one is judged on each of its cases.

    A speedup of two configs is read from the rounds' paired ratios to plain, one over the other; its interval the
    quotient of the two ratios' intervals taken at their far ends (wider than a ratio paired directly: no verdict
    it cannot carry)."""

    peer_speedup: dict[str, Annotated[float, Field(gt=0)]] = {"llama_1b": 1.05}
    fp8_speedup: dict[str, Annotated[float, Field(gt=0)]] = {"llama_1b": 1.25}
    mfu: dict[str, Annotated[float, Field(gt=0, le=1)]] = {"llama_1b": 0.62}
    plain_speedup: dict[str, Annotated[float, Field(gt=0)]] = {"llama_1b": 1.1}
    batch: dict[str, PositiveInt] = {}


def judged(goals: MfuGoals, model: str, batch: int) -> bool:
    """Whether a case of ``model`` at ``batch`` casts the preset's goal verdicts (``MfuGoals.batch``)."""
    return goals.batch.get(model, batch) == batch


class MfuSection(ByProfile):
    cpu: MfuSweep
    gpu: MfuSweep
    goals: MfuGoals = MfuGoals()

    @model_validator(mode="after")
    def _goal_batch_is_a_case(self) -> MfuSection:
        for model, batch in self.goals.batch.items():
            batches = [c.batch for c in self.gpu.cases if c.model == model]
            if batch not in batches:
                raise ValueError(f"goals.batch.{model}={batch} is not the batch of a gpu case of {model}; allowed: "
                                 f"{', '.join(map(str, batches)) or 'none (no gpu case of it)'}")
        return self


SECTIONS = {"mfu": MfuSection}


def check(params) -> None:
    for profile in ("cpu", "gpu"):
        for i, case in enumerate(getattr(params.mfu, profile).cases if params.mfu else ()):
            check_preset(params, f"mfu.{profile}.cases[{i}]", case.model, case.seq_len)
