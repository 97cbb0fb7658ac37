"""The decode step of a dense decoder in few kernels (issue 66): what ``Transformer`` runs for one new token a
sequence over its KV caches when the kernels can.

A layer is five launches (``kernels.decode_proj``, ``kernels.decode_attention_out``): RMSNorm + q/k/v projection +
RoPE + the cache write; the split-K attention's partials over the cache's filled positions; their combine, head by
head, fused with the output projection added into the residual stream; RMSNorm + gate/up projection + SwiGLU; the
down projection added into the residual stream (with INT8 and INT4 weights the combine and the output projection
stay two launches). The residual stream is fp32 for the step (the projections add their K splits into it with
atomics; the model's own forward keeps it in the weights' dtype), the logits in the weights' dtype. With
``reduce-overhead`` the whole step is one CUDA graph; on Hopper the projections launch with Programmatic Dependent
Launch, each starting while the one before drains.

Anything these kernels do not cover runs the model's own layers (``why_not`` names it, and the step is the same
function either way): the switch ``Transformer.fused_decode``, more than ``FUSED_MAX_BATCH`` sequences, the kernels
off or on a device they cannot run on, a gradient, LayerNorm, a GELU MLP, learned positions or QK-norm, biases, an
LTM or sliding-window model, quantized layers these kernels cannot read (torchao's, a DTensor), forward hooks
(tensor parallelism's all-reduce).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from adaattn.kernels.decode_attention import decode_attention
from adaattn.kernels.decode_attention_out import attention_out_
from adaattn.kernels.decode_proj import ROPE_ROWS, QuantWeight, add_linear_, norm_linear, norm_qkv_rope, norm_swiglu
from adaattn.kernels.runtime import use_triton
from adaattn.models.kv_cache import KVCache

# Sequences a step the fused kernels run for: one row reads every weight with fp32 multiply-adds (GEMV), faster
# than plain compiled PyTorch; for more rows the kernels' tensor-core tiles lose to cuBLAS (docs/notebook.md), so
# larger batches run the model's own layers until they do not.
FUSED_MAX_BATCH = 1

# Weight widths whose attention combine and output projection stay two launches (decode_attention, add_linear_):
# in the H200 A/B of llama_1b's step (notebook, 2026-11-29) the fused kernel won in bf16 only; INT8's separate
# kernels were as fast and INT4's faster (the fused INT4 tile holds a head's codes and both half-heads of o).
SEPARATE_ATTENTION_OUT: tuple[int, ...] = (8, 4)


def quant_weight(linear: nn.Module) -> QuantWeight | None:
    """A linear layer's weight as ``kernels.decode_proj`` reads it: an ``nn.Linear``'s, or what a quantized layer's
    ``quant_weight()`` gives (``models.quant``'s INT8 and INT4); None for a layer the kernels cannot read (a bias,
    a tensor subclass such as torchao's or a DTensor, a forward hook such as tensor parallelism's all-reduce)."""
    if linear._forward_hooks or linear._forward_pre_hooks or getattr(linear, "bias", None) is not None:
        return None
    if hasattr(linear, "quant_weight"):
        return linear.quant_weight()
    if type(linear) is nn.Linear and type(linear.weight) in (Tensor, nn.Parameter):
        return QuantWeight(linear.weight)
    return None


def _linears(model: nn.Module) -> list[nn.Module]:
    out = [model.head]
    for block in model.blocks:
        out += [block.attn.qkv, block.attn.out, block.mlp.gate_up, block.mlp.down]
    return out


def why_not(model: nn.Module, tokens: Tensor) -> str | None:
    """Why ``model``'s decode step of ``tokens`` (B, S) does not run the fused kernels (None: it does). Read on
    the host from the model's structure: under torch.compile, at trace time only."""
    cfg = model.cfg
    if not getattr(model, "fused_decode", True):
        return "fused_decode is off"
    if tokens.shape[1] != 1:
        return f"{tokens.shape[1]} tokens a sequence: the fused step decodes one"
    if tokens.shape[0] > FUSED_MAX_BATCH:
        return f"batch {tokens.shape[0]}: the fused step runs up to FUSED_MAX_BATCH={FUSED_MAX_BATCH} sequences"
    if cfg.norm != "rmsnorm" or cfg.mlp != "swiglu" or cfg.positions != "rope":
        return f"norm={cfg.norm}, mlp={cfg.mlp}, positions={cfg.positions}: the fused step is rmsnorm, swiglu, rope"
    if cfg.memory_slots is not None or cfg.attention_window is not None:
        return "an LTM or sliding-window cache"
    if cfg.head_dim % (2 * ROPE_ROWS) or cfg.head_dim & (cfg.head_dim - 1):
        return f"head_dim={cfg.head_dim}: the fused step takes a power of two, at least {2 * ROPE_ROWS}"
    if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
        return "a gradient: the fused step is inference only"
    if not isinstance(model.blocks[0].attn.cache, KVCache):
        return "no static KV cache"
    if any(quant_weight(m) is None for m in _linears(model)):
        return "a linear layer the kernels cannot read (a bias, a tensor subclass, a forward hook)"
    if not use_triton(tokens, model.embed.weight):
        return "the Triton kernels are off or cannot run on this device"
    return None


def pdl_on(device: torch.device) -> bool:
    """Programmatic Dependent Launch: CUDA on Hopper (sm_90) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def fused_decode(model: nn.Module, tokens: Tensor, input_pos: Tensor) -> Tensor:
    """Logits (B, 1, V) of ``tokens`` (B, 1) at position ``input_pos`` (1,), each layer's cache written there."""
    cfg = model.cfg
    eps, pdl = cfg.norm_eps, pdl_on(tokens.device)
    pos = input_pos[-1:]  # a view: the attention reads pos + 1 filled positions itself
    x = model.embed(tokens[:, 0]).float()  # (B, E): the residual stream, fp32 for the step
    cos, sin = model.rope.cos, model.rope.sin
    for block in model.blocks:
        attn, mlp, cache = block.attn, block.mlp, block.attn.cache
        q = norm_qkv_rope(x, block.norm1.weight, eps, quant_weight(attn.qkv), cos, sin, pos, cache.k, cache.v,
                          attn.n_heads, pdl)
        wo = quant_weight(attn.out)
        if wo.bits in SEPARATE_ATTENTION_OUT:
            o = decode_attention(q, cache.k, cache.v, pos, pdl=pdl, length_offset=1)  # (B, H, D)
            add_linear_(x, o.reshape(o.shape[0], -1), wo, pdl)
        else:
            attention_out_(x, q, cache.k, cache.v, pos, wo, pdl=pdl, length_offset=1)
        h = norm_swiglu(x, block.norm2.weight, eps, quant_weight(mlp.gate_up), pdl)
        add_linear_(x, h, quant_weight(mlp.down), pdl)
    return norm_linear(x, model.norm.weight, eps, quant_weight(model.head), model.norm.weight.dtype, pdl)[:, None]
