"""The model zoo: one config-driven transformer (``config.ModelConfig``, ``transformer.Transformer``), its presets in
``params.yaml`` (``models``), and its card (parameters, FLOPs per token, memory by component).

Importing the package imports the config only (pydantic: params.yaml validates presets without torch);
``transformer.build_model`` builds a preset."""

from adaattn.models.config import ModelConfig

__all__ = ["ModelConfig"]
