"""Autoregressive inference for the zoo's dense decoders: a static KV cache per attention layer (gpt-fast's
pattern: preallocated (B, G, max, D) buffers written in place at the tokens' positions, so a decode step has
the same shapes at every position and compiles to one graph, which ``reduce-overhead`` can replay as a CUDA
graph), prefill, one-token decode and greedy or sampled generation. An LTM model (``memory_slots``) decodes
with a ``models.ltm.SegmentCache`` per layer instead: the current segment's keys and values and the bank, a
state of constant size whatever the context, allocated at the bank's capacity (its one-token step compiles to one
graph too).

``decode_next`` is the fast path: one call a token that runs the step, picks the token, writes it into the output
and advances the position, all in place on ``model.decode_state`` (buffers ``setup_kv_cache`` allocates, so their
addresses never change and a CUDA graph replays with no input copied and no eager op between tokens);
``models.decode_graph.GraphedStep`` compiles it and captures it into that graph.

Shapes: B batch, S new tokens, G kv heads, D head dim, M the cache's length (``max_seq_len``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from adaattn.models.config import ModelConfig
from adaattn.models.kv_cache import KVCache
from adaattn.models.ltm import SegmentCache


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    from adaattn.models.transformer import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def check_decodable(cfg: ModelConfig) -> None:
    """KV-cache decoding runs a dense causal decoder with SDPA attention (an LTM one too); anything else is named
    here."""
    if cfg.kind != "decoder":
        raise ValueError(f"kind={cfg.kind!r}: KV-cache decoding needs kind 'decoder' (causal)")
    if cfg.attention != "sdpa":
        raise ValueError(f"attention={cfg.attention!r}: KV-cache decoding supports attention 'sdpa' (ccgqa's "
                         "convolutions and routing need their own decode state)")
    if cfg.routed:
        raise ValueError("recursions / mod_capacity: KV-cache decoding supports dense models (routing picks "
                         "tokens from the whole sequence)")


class DecodeState(nn.Module):
    """What ``decode_next`` keeps between tokens, at fixed addresses: the last token of each sequence (B, 1), the
    position it sits at (1,), the sequences so far (B, M) and which have produced the end token (B, 1)."""

    def __init__(self, batch: int, max_seq_len: int, device: torch.device | str | None = None):
        super().__init__()
        for name, shape, dtype in (("token", (batch, 1), torch.long), ("pos", (1,), torch.long),
                                   ("out", (batch, max_seq_len), torch.long), ("done", (batch, 1), torch.bool)):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)


def setup_kv_cache(model: nn.Module, batch: int, max_seq_len: int | None = None,
                   dtype: torch.dtype | None = None) -> None:
    """Give every attention layer of ``model`` (a ``Transformer``) a ``KVCache`` of ``batch`` sequences of up to
    ``max_seq_len`` tokens (default: the config's) in ``dtype`` (default: the weights'; bf16 under a bf16
    autocast), on the weights' device."""
    cfg: ModelConfig = model.cfg
    check_decodable(cfg)
    M = max_seq_len or cfg.max_seq_len
    if M < 1 or batch < 1:
        raise ValueError(f"batch={batch} and max_seq_len={M} must be at least 1")
    if model.pos is not None and M > cfg.max_seq_len:
        raise ValueError(f"max_seq_len={M} is over the config's {cfg.max_seq_len} (learned positions)")
    weight = next(model.parameters())
    if model.rope is not None:
        model.rope.ensure(M)  # before any compilation: the cache does not grow inside a graph
    for layer in _attention_layers(model):
        if cfg.memory_slots is not None:  # LTM: a segment's cache and the bank, whatever max_seq_len
            layer.cache = SegmentCache(batch, cfg.kv_heads, cfg.segment_len, cfg.head_dim, cfg.dim,
                                       model.memory_capacity, dtype or weight.dtype, weight.device)
        else:
            layer.cache = KVCache(batch, layer.n_kv_heads, M, cfg.head_dim, dtype or weight.dtype, weight.device,
                                  cfg.attention_window)
    model.decode_state = DecodeState(batch, M, weight.device)


def reset_kv_cache(model: nn.Module) -> None:
    """Start the caches over without new buffers (a compiled step's graphs keep theirs): an LTM model's segment
    caches forget what they read; a KV cache needs nothing (a prefill from position 0 overwrites it)."""
    for layer in _attention_layers(model):
        if isinstance(layer.cache, SegmentCache):
            layer.cache.reset()


def clear_kv_cache(model: nn.Module) -> None:
    for layer in _attention_layers(model):
        layer.cache = None
    model.decode_state = None


def prefill(model: nn.Module, prompt: Tensor) -> Tensor:
    """Run ``prompt`` (B, P) through the model into the caches; the logits at its last position (B, V)."""
    pos = torch.arange(prompt.shape[1], device=prompt.device)
    return model(prompt, input_pos=pos)[:, -1]


def decode_one(model: nn.Module, token: Tensor, pos: Tensor) -> Tensor:
    """One new token per sequence, ``token`` (B, 1) at position ``pos`` (1,): its logits (B, V). Shapes do not
    depend on the position: compile it once (``torch.compile(decode_one, mode="reduce-overhead")``)."""
    return model(token, input_pos=pos)[:, -1]


def decode_next(model: nn.Module, temperature: float = 0.0, eos_token: int | None = None) -> None:
    """One new token per sequence, in place on ``model.decode_state``: the logits of its ``token`` at ``pos``, the
    next token picked (the argmax at temperature 0, else a draw from softmax(logits / temperature) by the
    Gumbel-max trick: one ``rand`` the graph holds, where ``multinomial`` would need the host's generator), a
    finished sequence's token kept at ``eos_token``, the token written into ``out`` at ``pos + 1`` and ``pos``
    advanced. ``GraphedStep()`` (``models.decode_graph``) is this step compiled and captured into a CUDA graph,
    for ``generate(..., step=...)``; ``torch.compile(decode_next, mode="reduce-overhead", fullgraph=True)`` works
    too, with more host work a token. Every tensor it reads or writes is a buffer, so its CUDA graph replays with
    no input copied and nothing else launched between tokens."""
    s = model.decode_state
    logits = model(s.token, input_pos=s.pos)[:, -1]
    if temperature == 0.0:
        token = logits.argmax(-1, keepdim=True)
    else:
        gumbel = -torch.log(-torch.log(torch.rand_like(logits, dtype=torch.float32).clamp_min(1e-20)))
        token = (logits.float() / temperature + gumbel).argmax(-1, keepdim=True)
    if eos_token is not None:
        token = torch.where(s.done, eos_token, token)
        s.done |= token == eos_token
    s.token.copy_(token)
    s.out.index_copy_(1, s.pos + 1, token)
    s.pos.add_(1)


def sample(logits: Tensor, temperature: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
    """(B, V) -> (B, 1): the argmax at temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature == 0.0:
        return logits.argmax(-1, keepdim=True)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(model: nn.Module, prompt: Tensor, new_tokens: int, temperature: float = 0.0,
             decode: Callable[[nn.Module, Tensor, Tensor], Tensor] = decode_one,
             generator: torch.Generator | None = None, eos_token: int | None = None,
             step: Callable[[nn.Module, float, int | None], None] | None = None) -> Tensor:
    """``prompt`` (B, P) and ``new_tokens`` more (B, P + new_tokens): prefill, then one ``decode`` per token (pass
    a compiled ``decode_one``), or with ``step`` one call of it a token (``GraphedStep()`` or a compiled
    ``decode_next``: the fast path, the token picked and written inside the graph; no ``generator``, its draws
    are the device's). The caches must hold B sequences of P + new_tokens (``setup_kv_cache``).

    Nothing is read back to the host between tokens: the position is a device tensor advanced in place, each
    token is sampled and written into the output on the device, and a sequence that has produced ``eos_token``
    continues with it (no early stop, which would need a host sync a token: every sequence runs the same
    ``new_tokens`` steps). The host only queues work, so a compiled step runs back to back."""
    if new_tokens < 0:
        raise ValueError(f"new_tokens={new_tokens} must be at least 0")
    layers = _attention_layers(model)
    cache = layers[0].cache if layers else None
    if cache is None:
        raise ValueError("no KV cache: call setup_kv_cache(model, batch, max_seq_len) first")
    if prompt.dim() != 2:
        raise ValueError(f"prompt must be token ids (B, P); got shape {tuple(prompt.shape)} (one sequence: "
                         f"prompt[None])")
    B, P = prompt.shape
    if B != cache.k.shape[0] or (isinstance(cache, KVCache) and P + new_tokens > cache.k.shape[2]):
        raise ValueError(f"prompt (B={B}, P={P}) + {new_tokens} new tokens does not fit the cache "
                         f"(batch {cache.k.shape[0]}, max_seq_len {cache.k.shape[2]})")
    if step is not None and P + new_tokens > model.decode_state.out.shape[1]:
        raise ValueError(f"prompt (P={P}) + {new_tokens} new tokens does not fit decode_state's "
                         f"{model.decode_state.out.shape[1]} positions (setup_kv_cache's max_seq_len)")
    if step is not None and generator is not None:
        raise ValueError("generator: a step compiled from decode_next draws on the device's generator (seed it "
                         "with torch.manual_seed); pass decode= to sample with a generator of your own")
    if new_tokens == 0:
        return prompt
    if step is not None:
        return _generate_in_place(model, prompt, new_tokens, temperature, eos_token, step)
    out = torch.empty(B, P + new_tokens, dtype=prompt.dtype, device=prompt.device)
    out[:, :P] = prompt
    token = sample(prefill(model, prompt), temperature, generator)
    done = token == eos_token if eos_token is not None else None
    out[:, P:P + 1] = token
    pos = torch.full((1,), P, dtype=torch.long, device=prompt.device)
    for i in range(1, new_tokens):
        torch.compiler.cudagraph_mark_step_begin()  # a compiled step's graph is replayed, not recorded again
        token = sample(decode(model, token, pos), temperature, generator)
        if done is not None:  # a finished sequence repeats its end token
            token = torch.where(done, eos_token, token)
            done |= token == eos_token
        out[:, P + i:P + i + 1] = token
        pos += 1
    return out


def _generate_in_place(model: nn.Module, prompt: Tensor, new_tokens: int, temperature: float,
                       eos_token: int | None, step: Callable[[nn.Module, float, int | None], None]) -> Tensor:
    """``generate`` through ``step`` (``decode_next``): the prefill and its token eager, then one call a token."""
    s: DecodeState = model.decode_state
    P = prompt.shape[1]
    token = sample(prefill(model, prompt), temperature)
    s.out[:, :P] = prompt
    s.out[:, P:P + 1] = token
    s.token.copy_(token)
    s.pos.fill_(P)
    s.done.copy_(token == eos_token if eos_token is not None else torch.zeros_like(s.done))
    for _ in range(1, new_tokens):
        torch.compiler.cudagraph_mark_step_begin()  # a compiled step's graph is replayed, not recorded again
        step(model, temperature, eos_token)
    return s.out[:, :P + new_tokens].clone()
