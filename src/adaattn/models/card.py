"""A model's card: its parameter counts, its FLOPs per token (by formula and by PyTorch's FLOP counter) and a
training step's memory by component (by formula). The ``models`` stage writes one per preset; MFU and the
memory estimators everywhere else read these fields.

FLOP convention (torchtitan's, stated once here and in ``docs/methods.md``): a training token costs
``6 * N + 12 * L * H * D * S`` FLOPs, N the parameters a matmul reads per token (every block's linear
weights and the LM head, tied or not; not the embedding lookups), L layers, H query heads, D head dim, S the
context. Attention's causal half is not discounted and a recomputation (checkpointing, FlashAttention's
backward) is not counted: MFU, not hardware FLOPs. A routed model (HYDRA) counts each block as often as it
runs and for the tokens it takes (``applications``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from adaattn.models.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _block_matmul(block: nn.Module) -> int:
    """Parameters a block's matmuls and convolutions read per token it takes (its MoD router's left out)."""
    n = sum(m.weight.numel() for name, m in block.named_modules() if isinstance(m, nn.Linear) and "router" not in name)
    n += sum(p.numel() for name, p in block.named_parameters()
             if name.endswith("_proj_weight") or name.endswith(("_seq", "_mix")))  # AdaAttention; CCGQA's convs
    return n


def param_counts(model: nn.Module) -> dict:
    """total (each tensor once: a tied head is the embedding), embedding lookups, the matmul parameters N
    (every block once, and the LM head) and each block's (``per_block``: a shared block runs more than once)."""
    cfg: ModelConfig = model.cfg
    total = sum(p.numel() for p in model.parameters())
    lookup = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    per_block = [_block_matmul(b) for b in model.blocks]
    return {"total": total, "embedding": lookup, "non_embedding": total - lookup,
            "matmul": sum(per_block) + cfg.vocab_size * cfg.dim, "per_block": per_block}


def applications(cfg: ModelConfig, seq_len: int) -> list[tuple[int, int]]:
    """Every block a training forward runs, in order: (its index in ``blocks``, the tokens of a sequence it
    takes). A plain stack: each block once on all; HYDRA: the first block, the shared middle stack once per
    recursion on (R - r) / R of the tokens, the last block; a MoD block on ``mod_capacity`` of its input."""
    from adaattn.models.hydra import capacity

    def stack(indices, n):
        every = cfg.mod_every
        return [(i, capacity(n, cfg.mod_capacity) if cfg.mod_capacity is not None and i % every == every - 1 else n)
                for i in indices]

    L, R = cfg.n_layers, cfg.recursions
    if R == 1:
        return stack(range(L), seq_len)
    runs = stack([0], seq_len)
    for r in range(R):
        runs += stack(range(1, L - 1), capacity(seq_len, (R - r) / R))
    return runs + stack([L - 1], seq_len)


def flops_per_token(cfg: ModelConfig, params: dict, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token by the formula, and its two parts: 6 x the matmul parameters each token
    passes through (a shared block as often as it runs, a routed one for the tokens it takes) and 12 x H x D
    x the tokens each attention attends over. The routers' width-E scores are left out (under 0.1%)."""
    runs = applications(cfg, seq_len)
    share = sum(params["per_block"][i] * n for i, n in runs) / seq_len
    dense = 6.0 * (share + cfg.vocab_size * cfg.dim)
    if cfg.memory_slots is not None:  # LTM: each segment also attends over its layer's bank, written by matmuls
        slots = [n for n, _ in memory_segments(cfg, seq_len)]
        keys = sum(s * (n + s) for n, s in memory_segments(cfg, seq_len))
        G, D, E, L = cfg.kv_heads, cfg.head_dim, cfg.dim, cfg.n_layers
        # the slots' k and v projections, and the compressor's projection of a segment's new slots
        writes = sum(s // cfg.memory_compression for _, s in memory_segments(cfg, seq_len))
        dense += 6.0 * L * (2 * G * D * E * sum(slots) + E * E * writes) / seq_len
        attention = 12.0 * cfg.n_heads * cfg.head_dim * L * keys / seq_len
    else:
        attention = 12.0 * cfg.n_heads * cfg.head_dim * sum(n * n for _, n in runs) / seq_len
    return {"dense": dense, "attention": attention, "train": dense + attention, "forward": (dense + attention) / 3}


def ltm_bytes_per_layer(cfg: ModelConfig, seq_len: int, b: int, w: int) -> float:
    """What an LTM layer keeps for the backward beyond a dense layer's, per sequence (not yet measured on a GPU):
    per segment, the bank it reads (its fp32 slots and their normalised low-precision copy), the slots' k and v,
    the keys and values expanded to the query heads over slots and segment, and the compressor's pooled input
    and output for the slots it writes."""
    H, G, D, E = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.dim
    out = 0.0
    for n, s in memory_segments(cfg, seq_len):
        out += n * (E * w + E * b + 2 * G * D * b) + (n + s) * 2 * H * D * b
        out += (s // cfg.memory_compression) * (E * w + E * b)
    return out


def memory_segments(cfg: ModelConfig, seq_len: int) -> list[tuple[int, int]]:
    """An LTM forward over ``seq_len`` tokens, segment by segment: (the slots each layer's bank holds when the
    segment reads it, the segment's tokens)."""
    out, filled = [], 0
    for start in range(0, seq_len, cfg.segment_len):
        s = min(cfg.segment_len, seq_len - start)
        out.append((filled, s))
        filled = min(cfg.memory_slots, filled + s // cfg.memory_compression)
    return out


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
    meta.set_checkpointing("none")  # model FLOPs: a checkpointed preset's recomputation is not counted
    meta.train()
    return meta


def estimate_memory(cfg: ModelConfig, params: dict, batch: int, seq_len: int, dtype: str = "bf16",
                    checkpointing: str = "none", weights: str = "fp32") -> dict[str, float]:
    """Bytes of one training step by component, as ``models.train.Trainer`` runs it on a GPU (the zoo's
    kernels; their CPU references keep fp32 copies): ``weights`` and gradients in that dtype (fp32: autocast
    computes in ``dtype`` from fp32 weights, and the residual stream stays fp32), AdamW's two fp32 states, and
    the activations the backward keeps (per block run, the tensors its ops save; with checkpointing, what the
    recomputed blocks keep instead), the low-precision copies of the weights autocast keeps, and the loss's
    fp32 log-probabilities.

    ``total`` is the step's peak, the largest of three moments: the backward's start (the activations kept, the
    loss's log-probabilities and its two fp32 gradients of the logits' size, the head's gradient); a checkpointed
    block's recomputation (the activations kept and that block's, the loss's tensors freed); the backward's end
    (every gradient, the activations freed: the trainer sets gradients to None after each step)."""
    if checkpointing not in ("none", "full", "selective", "every_k"):
        raise ValueError(f"checkpointing {checkpointing!r} is not one of: none, full, selective, every_k")
    b, w = DTYPE_BYTES[dtype], DTYPE_BYTES[weights]
    n = params["total"]
    E, H, G, D, F, V = cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden, cfg.vocab_size
    norm = E * w + E * b  # a norm keeps its (residual, fp32) input; the next matmul its low-precision copy

    def attn(tokens: int, n_seq: int) -> float:
        if cfg.attention == "ccgqa":
            # the down-projection's output ((H + 2G) D), the convolutions' padded inputs (2 each of q and k),
            # the normalised q and k's inputs, the temperature's input (G D), and attention's q, k, v, output
            # and the output's reshape: 7 H + 8 G head-widths in all (eager: cuDNN's convolutions)
            kept = (7 * H + 8 * G) * D
        else:
            # the q, k, v projection's output ((H + 2G) D: v is a view of it), rotated q and k ((H + G) D, not
            # with learned positions), attention's output (H D) and its reshape for the output projection (H D)
            kept = (H + 2 * G) * D + (0 if cfg.positions == "learned" else (H + G) * D) + 2 * H * D
        out = tokens * (norm + kept * b + H * 4)  # + the log-sum-exp (H, fp32)
        if cfg.attention == "naive":  # the S x S probabilities, and the causal mask
            out += batch * H * n_seq * n_seq * b + n_seq * n_seq
        return out

    def mlp(tokens: int) -> float:  # hidden tensors (SwiGLU: gate and up, and their product; GELU: 2F)
        return tokens * (norm + (3 * F if cfg.mlp == "swiglu" else 2 * F) * b)

    runs = applications(cfg, seq_len)
    whole = [attn(batch * k, k) + mlp(batch * k) for _, k in runs]
    inputs = [batch * k * E * w for _, k in runs]  # a block's input: the residual stream
    # autocast's low-precision weights: one copy each a step, kept by the ops that save it for the backward; a
    # checkpointed region saves none (its recomputation casts again). The LM head's is always kept.
    copy = b if b < w else 0
    if checkpointing == "none":
        layers, recompute, kept_weights = sum(whole), 0.0, params["matmul"]
    elif checkpointing == "full":  # each block keeps its input; one block's activations live in its recompute
        layers, recompute, kept_weights = sum(inputs), max(whole), V * E
    elif checkpointing == "every_k":  # the blocks run 0, k, 2k, ... keep their inputs only
        plain = [j % cfg.checkpoint_every != 0 for j in range(len(runs))]
        layers, recompute = sum(a if p else i for i, a, p in zip(inputs, whole, plain)), max(whole)
        kept_weights = V * E + sum(params["per_block"][i] for i in {i for (i, _), p in zip(runs, plain) if p})
    else:  # selective: the attention sub-layers keep their inputs only (their weights' copies counted as kept)
        layers = sum(i + mlp(batch * k) for i, (_, k) in zip(inputs, runs))
        recompute, kept_weights = max(attn(batch * k, k) for _, k in runs), params["matmul"]
    # routes: MoD blocks and recursions after the first keep the gathered tokens, the sequence scattered back
    # and the gates
    every = cfg.mod_every
    routes = [k for i, k in runs if cfg.mod_capacity is not None and i % every == every - 1] + \
        [seq_len] * (cfg.recursions - 1)
    routing = sum(batch * (k + seq_len) * E * w + batch * k * 4 for k in routes)
    tokens = batch * seq_len
    kept = layers + routing + tokens * norm + kept_weights * copy  # + the final norm's input
    if cfg.memory_slots is not None:
        kept += cfg.n_layers * batch * ltm_bytes_per_layer(cfg, seq_len, b, w)
    log_probs = tokens * V * 4  # fp32, the loss's
    # as the backward starts: the gradient of the log-probabilities and the log-softmax's input gradient (fp32
    # each, beside the kept log-probabilities), and the head's gradient. A recomputed block's activations come
    # later, once the loss's tensors are freed, beside the head's gradient
    transient = tokens * V * 8 + V * E * w
    gradients = n * w
    peak = max(kept + log_probs + transient, kept + recompute + V * E * w, gradients)
    return {"weights": n * w, "gradients": gradients, "optimizer": 8 * n, "activations": kept + log_probs + recompute,
            "loss_transient": transient, "total": n * w + 8 * n + peak}


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
    formula, counted = flops_per_token(cfg, params, S), counted_flops_per_token(model, S)
    memory = {g: estimate_memory(cfg, params, 1, S, "bf16", g) for g in ("none", "full", "selective", "every_k")}
    return {
        "name": name, "config": cfg.model_dump(), "params": params,
        "flops_per_token": {"seq_len": S, "formula": formula, "counted": counted,
                            "counted_over_formula": counted["train"] / formula["train"]},
        "memory_estimate_bytes": {"batch": 1, "seq_len": S, "dtype": "bf16", "weights": "fp32",
                                  "by_checkpointing": memory},
        "step_check": step_check(cfg) if check else None,
    }
