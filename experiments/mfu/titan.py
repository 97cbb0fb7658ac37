"""torchtitan's llama3 training step at a preset's shape: the peer a training engineer would pick (issue 67),
timed in the mfu study beside the zoo's configs, same batch, same rounds.

torchtitan 0.2.2, the newest release that imports on the GPU box's torch 2.11 (0.3.0 imports FSDP names that
torch 2.11 lacks: the notebook, 2026-11-28). What is torchtitan's own: the model (its llama3 ``Transformer``:
separate q/k/v projections, ``nn.RMSNorm``, complex RoPE, SDPA, the attention its llama3 8B-405B configs train
with), each block compiled with ``fullgraph=True`` (its ``apply_compile``), the loss (its compiled
``cross_entropy_loss``: a sum over the whole logits cast to fp32, divided by the tokens, as its trainer divides
it), AdamW fused, gradients clipped at 1 (its defaults). What is ours: the loop around them, and bf16 autocast
over fp32 weights, which is how torchtitan's config says it trains on one device without FSDP (its trainer wraps
even one GPU in FSDP2, whose mixed-precision policy casts the same way); no activation checkpointing, as in the
zoo's configs. Its own initialisation (the step's time does not depend on the values); the same tokens as the
zoo's configs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from adaattn.models.config import ModelConfig
from adaattn.models.train import Trainer



def why_not(device: str, cfg: ModelConfig, seq_len: int) -> str | None:
    """Why torchtitan's step cannot run here for ``cfg`` (None: it can)."""
    dense = (cfg.kind, cfg.norm, cfg.mlp, cfg.positions, cfg.attention) == ("decoder", "rmsnorm", "swiglu", "rope",
                                                                           "sdpa")
    if not dense or cfg.bias or cfg.routed or cfg.memory_slots is not None or cfg.attention_window is not None:
        return f"{cfg.norm}, {cfg.mlp}, {cfg.positions}, {cfg.attention}: torchtitan's llama3 is a dense RMSNorm, " \
               "SwiGLU, RoPE decoder without biases"
    if cfg.tie_embeddings:
        return "tied embeddings: torchtitan 0.2.2's llama3 keeps its output projection apart"
    try:
        from torchtitan.models.llama3.model.model import Transformer  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the import error is the reason
        return f"torchtitan not importable: {type(err).__name__}: {err}"[:300]
    return None


def model_args(cfg: ModelConfig, seq_len: int):
    """torchtitan's ``TransformerModelArgs`` at the preset's shape. Its SwiGLU width is computed (2/3 of 4 x dim,
    times ``ffn_dim_multiplier``, rounded up to ``multiple_of``): the multiplier and the rounding are set so that
    it lands on the preset's width; RoPE without the Llama-3.1 frequency scaling, as the preset's."""
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    return TransformerModelArgs(
        dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads, vocab_size=cfg.vocab_size,
        multiple_of=cfg.hidden, ffn_dim_multiplier=cfg.hidden / int(2 * 4 * cfg.dim / 3), norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_base, rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0), max_seq_len=seq_len,
        attn_type="sdpa")


class TitanStep:
    """torchtitan's model, compiled per block, its compiled loss and AdamW; ``train_step(batch)`` one step."""

    def __init__(self, cfg: ModelConfig, seq_len: int, device: str, dtype: str = "bf16", lr: float = 3e-4):
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.models.llama3.model.model import Transformer

        with torch.device("meta"):
            self.model: nn.Module = Transformer(model_args(cfg, seq_len))
        self.model.to_empty(device=device)
        with torch.no_grad():
            self.model.init_weights(buffer_device=torch.device(device))  # as its trainer does after to_empty
        for name, block in self.model.layers.named_children():  # torchtitan's apply_compile
            self.model.layers.register_module(name, torch.compile(block, fullgraph=True))
        self.loss = torch.compile(cross_entropy_loss)  # its build_cross_entropy_loss with "loss" compiled
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                           fused=device == "cuda")
        self.device, self.autocast = device, dtype == "bf16"  # fp32: a CPU's profile, no autocast

    held_bytes = Trainer.held_bytes  # weights and AdamW's state: the trainer's count reads only these two

    def train_step(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """One step, called as the zoo's ``Trainer.train_step`` is: its trainer's forward_backward_step."""
        inputs, labels = batch
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
            pred = self.model(inputs)
            loss = self.loss(pred, labels) / labels.numel()  # its sum, over the tokens (none ignored here)
        del pred  # as its trainer does: the logits freed before the backward
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
