"""Model layers on the fused kernels (G4-C1): RMSNorm, SwiGLUMLP, RotaryEmbedding, GradientCheckpointMixin,
compute_memory_footprint. (``flexible_attention`` is an attention function: ``adaattn.attention.flexible``.)"""

from adaattn.layers.common import RMSNorm, RotaryEmbedding, SwiGLUMLP
from adaattn.layers.memory import GradientCheckpointMixin, compute_memory_footprint

__all__ = ["RMSNorm", "SwiGLUMLP", "RotaryEmbedding", "GradientCheckpointMixin", "compute_memory_footprint"]
