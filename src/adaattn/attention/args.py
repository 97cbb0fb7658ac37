"""The attention modules' argument checks (``AdaAttention``, ``AdaptiveFlashAttention``): a ValueError naming
the argument and what it allows, before any work."""

from __future__ import annotations

from adaattn.attention.precision import PRECISION_MODES
from adaattn.attention.rank import LOW_RANK_METHODS


def check_heads(embed_dim: int, num_heads: int, num_kv_heads: int) -> None:
    """Positive ints; ``embed_dim`` divisible by ``num_heads``, a multiple of ``num_kv_heads``."""
    for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive int; got {val!r}")
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def check_policy(precision_mode: str, rank_mode: str | int, low_rank_method: str, dropout: float) -> None:
    """AdaAttention's policy arguments, checked (a ValueError naming the argument and what it allows)."""
    if precision_mode not in PRECISION_MODES:
        raise ValueError(f"precision_mode {precision_mode!r} is not one of: {', '.join(PRECISION_MODES)}")
    if not (rank_mode in ("auto", "full") or (isinstance(rank_mode, int) and not isinstance(rank_mode, bool)
                                              and rank_mode >= 1)):
        raise ValueError(f"rank_mode must be 'auto', 'full' or a positive int; got {rank_mode!r}")
    if low_rank_method not in ("auto", *LOW_RANK_METHODS):
        raise ValueError(f"low_rank_method {low_rank_method!r} is not one of: auto, {', '.join(LOW_RANK_METHODS)}")
    check_dropout(dropout)


def check_dropout(p: float, name: str = "dropout") -> None:
    """A dropout probability: a number in [0, 1) (a ValueError naming ``name`` otherwise)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1); got {p!r}")
