"""A model's typed config: every knob of the zoo's transformer, validated before anything is built.

Presets live in ``params.yaml`` (``models``); ``ModelConfig(**preset)`` checks one and says which key is
wrong and what it allows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

Attention = Literal["sdpa", "ada", "flexible", "naive", "ccgqa"]
CHECKPOINTING = ("none", "full", "selective", "every_k")
Checkpointing = Literal[CHECKPOINTING]  # type: ignore[valid-type]


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

    HYDRA (guide 004; ``docs/models.md``): ``attention="ccgqa"`` attends in a latent of ``dim / compression``
    (``n_heads`` and ``n_kv_heads`` are the latent's heads), ``recursions > 1`` makes the middle blocks one
    shared stack applied that many times (Mixture-of-Recursions, Middle-Cycle: the first and last blocks are
    unique), each recursion routing fewer tokens (expert choice, capacity (R - r) / R), and ``mod_capacity``
    routes that fraction of the tokens through every ``mod_every``-th block (Mixture-of-Depths); the rest
    skip it on the residual.
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
    compression: PositiveInt = 1  # ccgqa: the latent's width is dim / compression
    conv_kernel: PositiveInt = 3  # ccgqa: the causal convolutions' width over the sequence
    recursions: PositiveInt = 1  # MoR: applications of the shared middle stack (1: no sharing, no routing)
    mod_capacity: float | None = Field(None, gt=0, le=1)  # MoD: the fraction of tokens a routed block takes
    mod_every: PositiveInt = 2  # MoD: every mod_every-th block of the stack is routed
    router_aux_weight: float = Field(0.01, ge=0)  # the routers' causal (BCE) auxiliary loss, scaled
    # sliding-window attention: a token sees itself and the window - 1 before it (None: the whole prefix)
    attention_window: PositiveInt | None = None
    # LTM (guide 003; docs/models.md): each layer's memory bank of this many slots (None: no memory)
    memory_slots: PositiveInt | None = None
    segment_len: PositiveInt = 512  # LTM: the sequence runs in segments of this many tokens
    memory_compression: PositiveInt = 4  # LTM: a segment of S tokens writes S / this slots
    memory_merge: bool = True  # LTM: a full bank merges its oldest slots in pairs (False: evicts them)
    memory_grad: bool = True  # LTM: gradients flow through the banks across a sequence's segments

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.dim % self.compression:
            raise ValueError(f"compression={self.compression} must divide dim={self.dim}")
        if self.compression > 1 and self.attention != "ccgqa":
            raise ValueError(f"compression={self.compression} needs attention='ccgqa'; got {self.attention!r}")
        if self.latent_dim % self.n_heads:
            latent = f" / compression={self.compression} = {self.latent_dim}" if self.compression > 1 else ""
            raise ValueError(f"n_heads={self.n_heads} must divide dim={self.dim}{latent}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.positions != "learned" and self.head_dim % 2:
            raise ValueError(f"positions={self.positions!r} needs an even head dim; dim / n_heads = {self.head_dim}")
        if self.attention == "ada" and self.positions != "learned":
            raise ValueError(f"attention='ada' takes no rotary positions (AdaAttention projects q and k itself): "
                             f"positions must be 'learned'; got {self.positions!r}")
        if self.attention == "ccgqa" and (self.positions != "rope" or self.kind != "decoder"):
            raise ValueError(f"attention='ccgqa' is a causal decoder's with its own L2 QK-norm: kind must be "
                             f"'decoder' and positions 'rope'; got kind={self.kind!r}, positions={self.positions!r}")
        if self.routed and self.kind != "decoder":
            raise ValueError(f"routing (recursions > 1 or mod_capacity) is a decoder's: kind must be 'decoder'; "
                             f"got {self.kind!r}")
        if self.routed and self.attention == "ada":
            raise ValueError("attention='ada' does not take routed (MoD / MoR) tokens: set recursions=1 and "
                             "mod_capacity=null, or another attention")
        if self.attention_window is not None and (self.attention != "sdpa" or self.kind != "decoder"
                                                  or self.memory_slots is not None or self.routed):
            raise ValueError(f"attention_window is a dense causal decoder's with attention 'sdpa' and no memory; "
                             f"got attention={self.attention!r}, kind={self.kind!r}")
        if self.memory_slots is not None:
            if self.attention != "sdpa" or self.routed or self.kind != "decoder":
                raise ValueError(f"memory_slots (LTM) is a dense causal decoder's with attention 'sdpa'; got "
                                 f"attention={self.attention!r}, kind={self.kind!r}, routed={self.routed}")
            if self.segment_len % self.memory_compression:
                raise ValueError(f"memory_compression={self.memory_compression} must divide "
                                 f"segment_len={self.segment_len}")
            if self.memory_slots < self.segment_len // self.memory_compression:
                raise ValueError(f"memory_slots={self.memory_slots} must hold one segment's slots: at least "
                                 f"segment_len / memory_compression = {self.segment_len // self.memory_compression}")
            if self.positions == "learned" and self.segment_len > self.max_seq_len:
                raise ValueError(f"segment_len={self.segment_len} is over max_seq_len={self.max_seq_len} "
                                 "(learned positions count within a segment)")
        if self.recursions > 1 and self.n_layers < 3:
            raise ValueError(f"recursions={self.recursions} shares the blocks between the first and the last: "
                             f"n_layers must be >= 3; got {self.n_layers}")
        return self

    @property
    def routed(self) -> bool:
        """Whether tokens take different depths (MoR recursions or MoD)."""
        return self.recursions > 1 or self.mod_capacity is not None

    @property
    def latent_dim(self) -> int:
        return self.dim // self.compression

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.latent_dim // self.n_heads

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
