"""Model layers on the fused kernels (G4-C1): RMSNorm, SwiGLUMLP, RotaryEmbedding, flexible_attention,
GradientCheckpointMixin, compute_memory_footprint."""

from adaattn.layers.attention import flexible_attention, get_attention_backend, set_attention_backend
from adaattn.layers.common import RMSNorm, RotaryEmbedding, SwiGLUMLP
from adaattn.layers.memory import GradientCheckpointMixin, compute_memory_footprint

__all__ = [
    "RMSNorm", "SwiGLUMLP", "RotaryEmbedding", "flexible_attention", "set_attention_backend",
    "get_attention_backend", "GradientCheckpointMixin", "compute_memory_footprint",
]
