"""The model zoo: one config-driven transformer (``ModelConfig``, ``Transformer``), its presets in
``params.yaml`` (``models``), and its card (parameters, FLOPs per token, memory by component).

Importing the package imports the config only (``adaattn.config`` validates presets without torch);
``Transformer`` and ``build_model`` import the model when first used."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaattn.models.config import ModelConfig

if TYPE_CHECKING:
    from adaattn.models.transformer import Transformer


def __getattr__(name: str):
    if name == "Transformer":
        from adaattn.models.transformer import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(cfg: ModelConfig | dict, device=None, dtype=None) -> Transformer:
    """A ``Transformer`` from a config or a preset's dict (validated first: a bad key is named)."""
    import torch

    from adaattn.models.transformer import Transformer

    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig(**cfg)
    with torch.device(device or "cpu"):
        model = Transformer(cfg)
    return model if dtype is None else model.to(dtype)


def tiny(cfg: ModelConfig) -> ModelConfig:
    """The same architecture at toy sizes (the CPU tests' variant of a preset): 2 layers (3 with recursions),
    width 32 x compression, the preset's head grouping kept where it fits, LTM segments of 8."""
    heads = 4
    kv = max(1, heads // (cfg.n_heads // cfg.kv_heads))
    layers = 3 if cfg.recursions > 1 else 2  # a shared stack between a first and a last block
    # LTM: segments of 8 writing 2 slots into banks of 4, so a short input reads, writes and merges
    ltm = {"segment_len": 8, "memory_compression": 4, "memory_slots": 4} if cfg.memory_slots is not None else {}
    return ModelConfig(**{**cfg.model_dump(), "dim": 32 * cfg.compression, "n_layers": layers, "n_heads": heads,
                          "n_kv_heads": kv, "vocab_size": 256, "mlp_hidden": None, "max_seq_len": 64, **ltm})


__all__ = ["ModelConfig", "Transformer", "build_model", "tiny"]
