"""A model's typed config: every knob of the zoo's transformer, validated before anything is built.

Presets live in ``params.yaml`` (``models``); ``ModelConfig(**preset)`` checks one and says which key is
wrong and what it allows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

Attention = Literal["sdpa", "ada", "flexible", "naive"]
Checkpointing = Literal["none", "full", "selective", "every_k"]


class ModelConfig(BaseModel):
    """A decoder (causal attention, trained on the next token) or an encoder (bidirectional attention; its loss
    is over the targets a caller gives, -100 ignored, so masked-token training masks the inputs itself).

    ``attention``: ``sdpa`` (F.scaled_dot_product_attention), ``ada`` (AdaAttention: its own projections and
    policies; it takes no rotary positions, so its presets use learned ones), ``flexible`` (the layers'
    ``flexible_attention``, backend ``flexible_backend``) or ``naive`` (matmul, softmax, matmul: the guides'
    standard attention). ``positions``: ``learned``, ``rope`` (one cos/sin cache shared by every layer) or
    ``qk_norm_rope`` (per-head RMSNorm of q and k, then the rotation, one fused kernel). ``mlp``: ``gelu``
    (Linear, GELU, Linear) or ``swiglu`` (ours). ``checkpointing``: ``full`` (each block recomputed in the
    backward), ``selective`` (attention only), ``every_k`` (every ``checkpoint_every``-th block).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["decoder", "encoder"] = "decoder"
    vocab_size: PositiveInt = 50304
    dim: PositiveInt
    n_layers: PositiveInt
    n_heads: PositiveInt
    n_kv_heads: PositiveInt | None = None  # GQA: query heads per kv head = n_heads / n_kv_heads; None: n_heads
    mlp: Literal["gelu", "swiglu"] = "swiglu"
    # the MLP's hidden width; None: 4 x dim (gelu), or 8/3 x dim rounded up to a multiple of 256 (swiglu, as
    # Llama: the same parameters as a 4x GELU MLP)
    mlp_hidden: PositiveInt | None = None
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    norm_eps: float = Field(1e-5, gt=0)
    positions: Literal["learned", "rope", "qk_norm_rope"] = "rope"
    rope_base: float = Field(10000.0, gt=1)
    attention: Attention = "sdpa"
    flexible_backend: Literal["auto", "flash", "xformers", "sdpa", "math"] = "auto"
    max_seq_len: PositiveInt = 2048
    tie_embeddings: bool = True
    bias: bool = False
    checkpointing: Checkpointing = "none"
    checkpoint_every: PositiveInt = 2  # every_k: this k

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide dim={self.dim}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.positions != "learned" and self.head_dim % 2:
            raise ValueError(f"positions={self.positions!r} needs an even head dim; dim / n_heads = {self.head_dim}")
        if self.attention == "ada" and self.positions != "learned":
            raise ValueError(f"attention='ada' takes no rotary positions (AdaAttention projects q and k itself): "
                             f"positions must be 'learned'; got {self.positions!r}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp == "gelu":
            return 4 * self.dim
        return -(-(8 * self.dim // 3) // 256) * 256

    @property
    def causal(self) -> bool:
        return self.kind == "decoder"
