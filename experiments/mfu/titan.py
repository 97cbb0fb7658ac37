"""torchtitan's llama3 training step at a preset's shape: the peer a training engineer would pick (issue 67),
timed in the mfu study beside the zoo's configs, same batch, same rounds.

What is torchtitan's own (0.3.0, a pure-Python wheel): the model (``Llama3Model`` from its builders: fused
q/k/v, its RMSNorm, complex RoPE, FlexAttention with its causal document mask, which its llama3 configs train
with; SDPA is refused there), each block compiled with ``fullgraph=True`` (its ``apply_compile``), the loss
(``ChunkedLossWrapper`` over a compiled ``CrossEntropyLoss``: the head and the loss a chunk of the sequence
at a time, never the whole logits), AdamW fused, gradients clipped at 1 (its defaults). What is ours:
the loop around them, and bf16 autocast over fp32 weights, which is how torchtitan's config says it
trains on one device without FSDP (its trainer wraps even one GPU in FSDP2, whose mixed-precision policy casts
the same way); no activation checkpointing, as in the zoo's configs. Its own initialisation (the step's time
does not depend on the values); the same tokens as the zoo's configs.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from adaattn.models.config import ModelConfig
from adaattn.models.train import Trainer

CHUNKS = 8  # ChunkedLossWrapper's default: the sequence in 8 pieces through the head and the loss


def why_not(device: str, cfg: ModelConfig, seq_len: int) -> str | None:
    """Why torchtitan's step cannot run here for ``cfg`` (None: it can)."""
    if device != "cuda":
        return "torchtitan's llama3 attention (FlexAttention) has no backward on a CPU"
    dense = (cfg.kind, cfg.norm, cfg.mlp, cfg.positions, cfg.attention) == ("decoder", "rmsnorm", "swiglu", "rope",
                                                                           "sdpa")
    if not dense or cfg.bias or cfg.routed or cfg.memory_slots is not None or cfg.attention_window is not None:
        return f"{cfg.norm}, {cfg.mlp}, {cfg.positions}, {cfg.attention}: torchtitan's llama3 is a dense RMSNorm, " \
               "SwiGLU, RoPE decoder without biases"
    if seq_len % CHUNKS:
        return f"seq_len {seq_len}: torchtitan's chunked loss needs a multiple of {CHUNKS}"
    try:
        import torchtitan.models.llama3  # noqa: F401
        from torchtitan.components.loss import ChunkedLossWrapper  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the import error is the reason
        return f"torchtitan not importable: {type(err).__name__}: {err}"[:300]
    return None


def model_config(cfg: ModelConfig, seq_len: int):
    """``Llama3Model.Config`` at the preset's shape, through torchtitan's own layer builder (its inits, fused
    q/k/v, FlexAttention)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _EMBEDDING_SKIP_INIT, _NORM_INIT, Llama3Model,
                                          _build_llama3_layers, _output_linear_init)

    dim, heads = cfg.dim, cfg.n_heads
    layers = _build_llama3_layers(
        n_layers=cfg.n_layers, dim=dim, n_heads=heads, n_kv_heads=cfg.kv_heads, hidden_dim=cfg.hidden,
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq_len, theta=cfg.rope_base, scaling="none"),
        attn_backend="flex")
    for layer in layers:  # the preset's epsilon (torchtitan's RMSNorm config carries one)
        layer.attention_norm = dataclasses.replace(layer.attention_norm, eps=cfg.norm_eps)
        layer.ffn_norm = dataclasses.replace(layer.ffn_norm, eps=cfg.norm_eps)
    embed_init = _EMBEDDING_SKIP_INIT if cfg.tie_embeddings else _EMBEDDING_INIT  # tied: the head's init
    return Llama3Model.Config(
        dim=dim, vocab_size=cfg.vocab_size, enable_weight_tying=cfg.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=dim, param_init=embed_init),
        norm=RMSNorm.Config(normalized_shape=dim, eps=cfg.norm_eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=cfg.vocab_size, param_init=_output_linear_init(dim)),
        layers=layers)


class TitanStep:
    """torchtitan's model, compiled per block, its chunked loss and AdamW; ``train_step(batch)`` one step."""

    def __init__(self, cfg: ModelConfig, seq_len: int, device: str, lr: float = 3e-4):
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
        from torchtitan.config import CompileConfig

        with torch.device(device):
            self.model: nn.Module = model_config(cfg, seq_len).build()
            self.model.init_states(buffer_device=torch.device(device))
        for block in self.model.layers.values():  # torchtitan's apply_compile
            block.compile(fullgraph=True)
        self.model._skip_lm_head = True  # the loss wrapper runs the head a chunk at a time
        compile_loss = CompileConfig(enable=True, components=["model", "loss"])
        self.loss = ChunkedLossWrapper.Config(num_chunks=CHUNKS, loss_fn=CrossEntropyLoss.Config()).build(
            compile_config=compile_loss)
        self.loss.set_lm_head(self.model.lm_head)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                           fused=device == "cuda")
        self.device = device

    held_bytes = Trainer.held_bytes  # weights and AdamW's state: the trainer's count reads only these two

    def train_step(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """One step, called as the zoo's ``Trainer.train_step`` is."""
        inputs, labels = batch
        B, S = inputs.shape
        positions = torch.arange(S, device=inputs.device).expand(B, S)  # one document a row
        with torch.autocast(self.device, dtype=torch.bfloat16):
            hidden = self.model(inputs, positions, self.model.get_attention_masks(positions))
            # the tokens the loss is averaged over, made on the device (a host tensor copied each step would wait)
            tokens = torch.full((), labels.numel(), dtype=torch.float32, device=labels.device)
            loss, _ = self.loss(hidden, labels, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
