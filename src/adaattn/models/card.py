"""A model's card: its parameter counts, its FLOPs per token (by formula and by PyTorch's FLOP counter) and a
training step's memory by component (by formula). The ``models`` stage writes one per preset; MFU and the
memory estimators everywhere else read these fields.

FLOP convention (torchtitan's, stated once here and in ``docs/methods.md``): a training token costs
``6 * N + 12 * L * H * D * S`` FLOPs, N the parameters a matmul reads per token (every block's linear
weights and the LM head, tied or not; not the embedding lookups), L layers, H query heads, D head dim, S the
context. Attention's causal half is not discounted and a recomputation (checkpointing, FlashAttention's
backward) is not counted: MFU, not hardware FLOPs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from adaattn.models.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def param_counts(model: nn.Module) -> dict[str, int]:
    """total (each tensor once: a tied head is the embedding), embedding lookups, and the matmul parameters N."""
    cfg: ModelConfig = model.cfg
    total = sum(p.numel() for p in model.parameters())
    lookup = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    blocks = sum(m.weight.numel() for m in model.blocks.modules() if isinstance(m, nn.Linear))
    blocks += sum(p.numel() for n, p in model.blocks.named_parameters() if n.endswith("_proj_weight"))  # AdaAttention
    return {"total": total, "embedding": lookup, "non_embedding": total - lookup,
            "matmul": blocks + cfg.vocab_size * cfg.dim}


def flops_per_token(cfg: ModelConfig, matmul_params: int, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token by the formula, and its two parts."""
    dense = 6.0 * matmul_params
    attention = 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return {"dense": dense, "attention": attention, "train": dense + attention, "forward": (dense + attention) / 3}


def _count_cpu_flash_attention() -> None:
    """PyTorch's FLOP counter has formulas for SDPA's CUDA kernels but not for its CPU flash kernel (torch 2.11
    and 2.13), which it then counts as 0: the same shape formula, registered for the CPU ops where missing."""
    ops = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None), \
        getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    fwd, bwd = ops
    if fwd is not None and fwd not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(fwd)(
            lambda query, key, value, *args, out_val=None, **kwargs: flop_counter.sdpa_flop_count(query, key, value))
    if bwd is not None and bwd not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(bwd)(
            lambda grad_out, query, key, value, *args, out_val=None, **kwargs:
            flop_counter.sdpa_backward_flop_count(grad_out, query, key, value))


def counted_flops_per_token(model: nn.Module, seq_len: int) -> dict[str, float]:
    """FLOPs per token of one forward and backward at (1, seq_len), from ``torch.utils.flop_counter``, on the
    meta device (no memory, no arithmetic); AdaAttention, whose policies look at values, on the CPU at the
    model's own weights. The LM head's loss is left out (as in the formula)."""
    _count_cpu_flash_attention()
    device = "cpu" if model.cfg.attention == "ada" else "meta"
    counted = _on_meta(model) if device == "meta" else model.train()
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    if device == "cpu":  # AdaAttention's policies decide on a first call (its ranking runs attention itself)
        counted(tokens).sum().backward()
        counted.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as fwd:
        logits = counted(tokens)
    forward = fwd.get_total_flops()
    with FlopCounterMode(display=False) as bwd:
        logits.sum().backward()
    return {"forward": forward / seq_len, "train": (forward + bwd.get_total_flops()) / seq_len}


def _on_meta(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with meta tensors (the same modules and config; the weights' values are not kept)."""
    from adaattn.models.transformer import Transformer

    with torch.device("meta"):
        meta = Transformer(model.cfg)
    meta.train()
    return meta


def estimate_memory(cfg: ModelConfig, params: dict[str, int], batch: int, seq_len: int, dtype: str = "bf16",
                    checkpointing: str = "none", weights: str = "fp32") -> dict[str, float]:
    """Bytes of one training step by component, as ``models.train.Trainer`` runs it: ``weights`` and their
    gradients in that dtype (fp32: autocast computes in ``dtype`` from fp32 weights), AdamW's two fp32 states,
    and the activations the backward keeps, in ``dtype`` (per layer, the tensors each op saves; with
    checkpointing, what the recomputed blocks keep instead). Attention through a fused kernel keeps its output
    and log-sum-exp; the naive one its S x S probabilities too."""
    b, w = DTYPE_BYTES[dtype], DTYPE_BYTES[weights]
    n = params["total"]
    tokens = batch * seq_len
    E, H, G, D, F = cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden
    # saved per layer: the attention sub-layer keeps its norm's input and output (2E), q, k, v ((H + 2G) D), the
    # attention output (H D) and the log-sum-exp (H, fp32); the naive one its S x S probabilities and mask too
    attn = tokens * ((2 * E + (H + 2 * G) * D + H * D) * b + H * 4)
    if cfg.attention == "naive":
        attn += batch * H * seq_len * seq_len * (b + 1)
    # the MLP sub-layer: its norm's input and output (2E) and hidden tensors (SwiGLU: gate and up, 2F, and
    # their product, F; GELU: its input and output, 2F)
    mlp = tokens * (2 * E + (3 * F if cfg.mlp == "swiglu" else 2 * F)) * b
    block_input = tokens * E * b
    L = cfg.n_layers
    if checkpointing == "none":
        layers = L * (attn + mlp)
    elif checkpointing == "full":  # each block keeps its input; one block's activations live in its recompute
        layers = L * block_input + attn + mlp
    elif checkpointing == "every_k":  # blocks 0, k, 2k, ... keep their inputs only
        kept = -(-L // cfg.checkpoint_every)
        layers = kept * block_input + (L - kept) * (attn + mlp) + attn + mlp
    elif checkpointing == "selective":  # the attention sub-layers keep their inputs only
        layers = L * (block_input + mlp) + attn
    else:
        raise ValueError(f"checkpointing {checkpointing!r} is not one of: none, full, selective, every_k")
    logits = tokens * cfg.vocab_size * (b + 4)  # the logits and their fp32 copy in the loss
    activations = layers + tokens * E * b + logits
    return {"weights": n * w, "gradients": n * w, "optimizer": 8 * n, "activations": activations,
            "total": 2 * n * w + 8 * n + activations}


def step_check(cfg: ModelConfig, batch: int = 1, seq_len: int = 32, seed: int = 0) -> dict[str, float | bool]:
    """One forward and backward of the preset itself (fp32, on the CPU) on a tiny batch of random tokens: the
    loss at initialisation beside ln(vocab) (what a model that predicts uniformly scores), and whether every
    gradient is finite."""
    import math

    from adaattn.models.transformer import Transformer

    torch.manual_seed(seed)
    model = Transformer(cfg).train()
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
    return {"batch": batch, "seq_len": seq_len, "loss_at_init": loss.item(), "ln_vocab": math.log(cfg.vocab_size),
            "grads_finite": finite}


def model_card(name: str, cfg: ModelConfig, check: bool = True) -> dict:
    """Everything the ``models`` stage writes for one preset (``models/<name>.json``)."""
    from adaattn.models.transformer import Transformer

    with torch.device("cpu" if cfg.attention == "ada" else "meta"):  # AdaAttention computes on real tensors
        model = Transformer(cfg)
    params = param_counts(model)
    S = cfg.max_seq_len
    formula, counted = flops_per_token(cfg, params["matmul"], S), counted_flops_per_token(model, S)
    memory = {g: estimate_memory(cfg, params, 1, S, "bf16", g) for g in ("none", "full", "selective", "every_k")}
    return {
        "name": name, "config": cfg.model_dump(), "params": params,
        "flops_per_token": {"seq_len": S, "formula": formula, "counted": counted,
                            "counted_over_formula": counted["train"] / formula["train"]},
        "memory_estimate_bytes": {"batch": 1, "seq_len": S, "dtype": "bf16", "weights": "fp32",
                                  "by_checkpointing": memory},
        "step_check": step_check(cfg) if check else None,
    }
