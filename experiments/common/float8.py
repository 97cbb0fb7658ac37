"""torchao's float8 training on a zoo model's blocks, as the mfu study times it and the train study prices it.

Recipes are torchao's own (``Float8LinearConfig.from_recipe_name``): ``tensorwise`` (one scale a tensor, cuBLAS's
FP8 GEMM; torchao's fastest) and ``rowwise`` (a scale a row, rounded down to a power of two; CUTLASS's rowwise
GEMM; the recipe torchtitan's FP8 runs name for accuracy)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

Recipe = Literal["tensorwise", "rowwise"]


def compile_options(recipe: Recipe) -> dict[str, bool]:
    """The inductor options ``recipe``'s model compiles with. Rowwise: ``emulate_precision_casts``, which rounds
    the compiled graph's low-precision intermediates as eager does. Without it the backward's recompute of a
    cast differs from the forward's (pytorch/pytorch#150859), and compiled rowwise training ends several percent
    above bf16's validation loss where eager rowwise matches it (docs/notebook.md, 2026-11-29). Torchtitan sets
    it for rowwise too; tensorwise is left as torchtitan leaves it."""
    return {"emulate_precision_casts": True} if recipe == "rowwise" else {}


def float8_unavailable(device: str) -> str | None:
    """Why torchao's float8 training cannot run on ``device`` (None: it can)."""
    if device != "cuda":
        return "float8 GEMMs need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper)"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"float8 GEMMs need compute capability 8.9 or newer; this GPU is {torch.cuda.get_device_capability()}"
    try:
        import torchao.float8  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the import error is the reason
        return f"torchao.float8 not importable: {type(err).__name__}: {err}"[:300]
    return None


def to_float8(model: nn.Module, recipe: Recipe = "tensorwise") -> nn.Module:
    """The blocks' linears as torchao ``Float8Linear`` under ``recipe``; the LM head (the loss's precision) and any
    linear whose sides are not multiples of 16 (an FP8 GEMM's) stay as they are."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def blocks_only(mod: nn.Module, fqn: str) -> bool:
        return fqn.startswith("blocks.") and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    return convert_to_float8_training(model, module_filter_fn=blocks_only,
                                      config=Float8LinearConfig.from_recipe_name(recipe))
