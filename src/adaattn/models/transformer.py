"""The zoo's transformer: one config-driven model (``ModelConfig``), decoder or encoder, in the spirit of
nanoGPT and gpt-fast: token embedding, ``n_layers`` pre-norm blocks (attention, MLP, residuals), a final
norm and an LM head (tied to the embedding by default).

Shapes: B batch, S sequence, E dim, H query heads, G kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaattn.attention.ada import AdaAttention
from adaattn.attention.flexible import flexible_attention
from adaattn.layers import GradientCheckpointMixin, RMSNorm, RotaryEmbedding, SwiGLUMLP
from adaattn.models import decode_step
from adaattn.models.config import ModelConfig
from adaattn.models.kv_cache import KVCache
from adaattn.models.ltm import Compressor, SegmentCache, empty_banks, memory_kv, memory_stats, segment_mask, write
from adaattn.models.hydra import CCGQAttention, Router, capacity, gather, rotate_at, routed, scatter


def _norm(cfg: ModelConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, cfg.norm_eps) if cfg.norm == "rmsnorm" else nn.LayerNorm(dim, cfg.norm_eps, bias=cfg.bias)


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden, bias=bias), nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


def window_mask(S: int, window: int, device=None) -> Tensor:
    """(S, S) bool: query i sees keys i - window + 1 .. i."""
    i = torch.arange(S, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA under a boolean mask, the kv heads expanded to the query heads (SDPA's fused kernels that take a
    mask take no GQA)."""
    r = q.shape[1] // k.shape[1]
    if r > 1:
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """matmul, softmax, matmul with the S x S scores in memory: the guides' standard attention."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, S, S)
    if causal:
        S = q.shape[2]
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class Attention(nn.Module):
    """Self-attention: one fused q/k/v projection (GQA: G kv heads), positions, the attention core, output
    projection. ``rope``: the model's one ``RotaryEmbedding`` (its cache shared by every layer)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding | None):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        H, G, D = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        # the heads this module computes: all of them, or its rank's share under tensor parallelism
        self.n_heads, self.n_kv_heads = H, G
        self.qkv = nn.Linear(cfg.dim, (H + 2 * G) * D, bias=cfg.bias)
        self.out = nn.Linear(H * D, cfg.dim, bias=cfg.bias)
        if cfg.positions == "qk_norm_rope":
            self.q_norm, self.k_norm = nn.Parameter(torch.ones(D)), nn.Parameter(torch.ones(D))
        self.cache: KVCache | None = None  # inference: ``generate.setup_kv_cache``

    def forward(self, x: Tensor, pos: Tensor | None = None, memory: Tensor | None = None) -> Tensor:
        """x (B, S, E); ``pos`` (B, S): the tokens' positions where a router gathered them, or where a KV cache
        decodes (None: 0..S-1); ``memory`` (B, N, E): an LTM layer's bank, normalised, attended before the
        segment (``models.ltm``)."""
        B, S, _ = x.shape
        H, G, D = self.n_heads, self.n_kv_heads, self.cfg.head_dim
        q, k, v = self.qkv(x).split([H * D, G * D, G * D], dim=-1)
        q, k, v = q.view(B, S, H, D), k.view(B, S, G, D), v.view(B, S, G, D)
        if pos is not None and self.rope is not None:
            if self.cfg.positions == "qk_norm_rope":
                q = F.rms_norm(q, (D,), self.q_norm, self.cfg.norm_eps)
                k = F.rms_norm(k, (D,), self.k_norm, self.cfg.norm_eps)
            q, k = rotate_at(q, self.rope.cos, self.rope.sin, pos), rotate_at(k, self.rope.cos, self.rope.sin, pos)
        elif self.cfg.positions == "rope":
            q, k = self.rope(q, k)
        elif self.cfg.positions == "qk_norm_rope":
            q, k = self.rope.with_qk_norm(q, k, self.q_norm, self.k_norm, self.cfg.norm_eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or G, S, D)
        causal = self.cfg.causal
        if isinstance(self.cache, SegmentCache):  # LTM decoding: the bank's slots, then the segment so far
            k, v, mask = self.cache.update(pos[0], k, v)
            out = masked_attention(q, k, v, mask)
        elif self.cache is not None:  # the new tokens against every cached position up to theirs
            if pos is None:
                raise ValueError("a layer with a KV cache needs the tokens' positions (Transformer input_pos)")
            k, v = self.cache.update(pos[0], k, v)  # (B, G, M, D)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.cache.mask(pos[0]), enable_gqa=G != H)
        elif memory is not None:  # the bank's slots, then the segment causally
            km, vm = self.memory_kv(memory)
            k, v = torch.cat([km, k], dim=2), torch.cat([vm, v], dim=2)
            out = masked_attention(q, k, v, segment_mask(km.shape[2], S, x.device))
        elif self.cfg.attention_window is not None:  # causal within the window: a band mask
            out = masked_attention(q, k, v, window_mask(S, self.cfg.attention_window, x.device))
        elif self.cfg.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=G != H)
        elif self.cfg.attention == "flexible":
            out = flexible_attention(q, k, v, is_causal=causal, backend=self.cfg.flexible_backend)
        else:
            out = naive_attention(q, k, v, causal)
        return self.out(out.transpose(1, 2).reshape(B, S, H * D))

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """An LTM bank's slots (B, N, E), normalised, as keys and values (B, G, N, D): no positions (they are past)."""
        H, G, D = self.cfg.n_heads, self.cfg.kv_heads, self.cfg.head_dim
        km, vm = memory_kv(memory, self.qkv.weight, self.qkv.bias, H, G, D)
        if self.cfg.positions == "qk_norm_rope":  # the slots' keys normalised as the segment's are
            km = F.rms_norm(km, (D,), self.k_norm, self.cfg.norm_eps)
        return km, vm


class AdaSelfAttention(nn.Module):
    """AdaAttention as a block's self-attention (its own projections, GQA, policies and kernel manager)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.causal = cfg.causal
        self.attn = AdaAttention(cfg.dim, cfg.n_heads, batch_first=True, num_kv_heads=cfg.kv_heads, bias=cfg.bias)

    def forward(self, x: Tensor, pos: Tensor | None = None) -> Tensor:
        return self.attn(x, x, x, need_weights=False, is_causal=self.causal)[0]


class Block(GradientCheckpointMixin, nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)); with ``selective`` checkpointing the attention
    sub-layer's activations are recomputed in the backward. ``routed``: a MoD block, with its router; it routes
    in its own forward, so that compiling the block compiles its router, top-k, gathers and scatter with it (a
    HYDRA step's routing glue otherwise runs eager between compiled blocks: hundreds of small launches)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding | None, routed: bool = False):
        super().__init__()
        self.capacity = cfg.mod_capacity if routed else None
        self.norm1, self.norm2 = _norm(cfg, cfg.dim), _norm(cfg, cfg.dim)
        if cfg.attention == "ada":
            self.attn = AdaSelfAttention(cfg)
        else:
            self.attn = CCGQAttention(cfg, rope) if cfg.attention == "ccgqa" else Attention(cfg, rope)
        self.router = Router(cfg.dim) if routed else None
        self.mlp = SwiGLUMLP(cfg.dim, cfg.hidden, bias=cfg.bias) if cfg.mlp == "swiglu" else \
            GeluMLP(cfg.dim, cfg.hidden, cfg.bias)

    def _attend(self, x: Tensor, pos: Tensor | None, memory: Tensor | None = None) -> Tensor:
        if memory is None:
            return self.attn(self.norm1(x), pos)
        return self.attn(self.norm1(x), pos, self.norm1(memory))  # the slots are past inputs of this layer

    def _layer(self, x: Tensor, pos: Tensor | None = None, memory: Tensor | None = None) -> Tensor:
        x = x + self.checkpointed(self._attend, x, pos, memory)
        return x + self.mlp(self.norm2(x))

    def forward(self, x: Tensor, pos: Tensor | None = None, memory: Tensor | None = None):
        """x (B, S, E) -> (B, S, E); a routed block (B, S, E) and its router's auxiliary loss (None in eval)."""
        if self.router is None:
            return self._layer(x, pos, memory)
        if pos is None:  # the routed tokens keep their positions in the sequence
            pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        aux: list[Tensor] = []
        x, _ = routed(self._layer, x, pos, self.router(x), capacity(x.shape[1], self.capacity), self.training, aux)
        return x, aux[0] if aux else None


class Transformer(GradientCheckpointMixin, nn.Module):
    """tokens (B, S) int64 -> logits (B, S, V). ``set_checkpointing`` changes the granularity after building.

    A routed config (HYDRA: ``recursions > 1`` or ``mod_capacity``) runs ``_routed``: the first block, the
    shared middle stack ``recursions`` times (the r-th on the (R - r) / R of the sequence its router picks
    among the tokens of the recursion before), the last block; in every stack, the MoD blocks take their
    router's top ``mod_capacity``. ``forward(tokens, return_aux=True)`` also returns the routers' causal
    auxiliary loss, which ``loss`` and the trainer add.

    Decoding one token a sequence over static KV caches runs ``models.decode_step``'s fused kernels where they
    can (``decode_step.why_not`` says why not, elsewhere); ``fused_decode = False`` runs the model's own layers
    (the plain PyTorch step the inference study compares them with)."""

    fused_decode: bool = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.positions == "learned" else None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_base) \
            if cfg.positions != "learned" else None
        mod = cfg.mod_capacity is not None  # MoD: every mod_every-th block routes
        self.blocks = nn.ModuleList(Block(cfg, self.rope, routed=mod and i % cfg.mod_every == cfg.mod_every - 1)
                                    for i in range(cfg.n_layers))
        # recursion r >= 1 of the shared stack has its own router (recursion 0 takes every token)
        self.recursion_routers = nn.ModuleList(Router(cfg.dim) for _ in range(cfg.recursions - 1))
        self.norm = _norm(cfg, cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        # LTM: each layer's bank writer; the banks themselves are state, passed in and out (``models.ltm``)
        self.compressors = nn.ModuleList(Compressor(cfg.dim, cfg.memory_compression) for _ in range(cfg.n_layers)) \
            if cfg.memory_slots is not None else None
        self.memory_capacity = cfg.memory_slots
        self.last_memory: list[Tensor] | None = None  # the banks after the last forward (detached)
        self.apply(self._init)
        for c in self.compressors or ():
            c.reset_parameters()
        self.set_checkpointing(cfg.checkpointing, cfg.checkpoint_every)

    def _init(self, m: nn.Module) -> None:
        """GPT-2's: N(0, 0.02) weights, zero biases, and the residual projections scaled by 1/sqrt(2 x layers)."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        for name in ("out", "down"):
            proj = getattr(m, name, None)
            if isinstance(proj, nn.Linear) and isinstance(m, (Attention, CCGQAttention, GeluMLP, SwiGLUMLP)) \
                    and not (isinstance(m, CCGQAttention) and name == "down"):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layers))

    def set_checkpointing(self, granularity: str, every: int = 2) -> None:
        super().set_checkpointing(granularity, every)
        for block in self.blocks:  # selective: inside each block; the rest: around blocks (``run_blocks``)
            block.set_checkpointing("selective" if granularity == "selective" else "none")

    def forward(self, tokens: Tensor, return_aux: bool = False, input_pos: Tensor | None = None,
                memory: list[Tensor] | None = None, return_memory: bool = False):
        """``input_pos`` (S,): the tokens' positions, decoding with KV caches (``generate``; None: 0..S-1). An LTM
        model reads ``memory`` (each layer's bank, as returned; None: empty banks) and with ``return_memory``
        returns (logits, banks): a stream continued call by call equals one call over the whole sequence."""
        B, S = tokens.shape
        if input_pos is not None:
            return self._decode(tokens, input_pos)
        if self.cfg.memory_slots is not None:
            logits, banks = self._segments(tokens, memory)
            out = (logits, logits.new_zeros((), dtype=torch.float32)) if return_aux else logits
            return (out, banks) if return_memory else out
        if memory is not None or return_memory:
            raise ValueError("memory / return_memory are an LTM model's (memory_slots); this config has none")
        if S > self.cfg.max_seq_len and self.pos is not None:
            raise ValueError(f"sequence length {S} is over max_seq_len={self.cfg.max_seq_len} (learned positions)")
        if self.cfg.routed and not self.training and B > 1:  # inference routing is per sequence
            outs = [self(tokens[b:b + 1], return_aux) for b in range(B)]
            if not return_aux:
                return torch.cat(outs)
            return torch.cat([o[0] for o in outs]), torch.stack([o[1] for o in outs]).mean()
        x = self.embed(tokens)  # (B, S, E)
        if self.pos is not None:
            x = x + self.pos(torch.arange(S, device=tokens.device))
        aux: list[Tensor] = []
        x = self._routed(x, aux) if self.cfg.routed else self.run_blocks(self.blocks, x)
        logits = self.head(self.norm(x))  # (B, S, V)
        if not return_aux:
            return logits
        return logits, torch.stack(aux).mean() if aux else logits.new_zeros((), dtype=torch.float32)

    def _segments(self, tokens: Tensor, banks: list[Tensor] | None) -> tuple[Tensor, list[Tensor]]:
        """LTM: the tokens (B, S) in segments of ``segment_len``; before a segment runs through a layer, the
        layer's inputs for it are compressed and written to its bank, which the next segment reads."""
        cfg = self.cfg
        B = tokens.shape[0]
        if banks is None:
            banks = empty_banks(len(self.blocks), B, cfg.dim, self.embed.weight)
        elif len(banks) != len(self.blocks) or any(b.shape[0] != B or b.shape[2] != cfg.dim for b in banks):
            raise ValueError(f"memory: one (B={B}, slots, {cfg.dim}) bank per layer ({len(self.blocks)}) expected")
        outs = []
        for start in range(0, tokens.shape[1], cfg.segment_len):
            seg = tokens[:, start:start + cfg.segment_len]
            x = self.embed(seg)  # (B, S, E)
            if self.pos is not None:  # positions count within the segment
                x = x + self.pos(torch.arange(seg.shape[1], device=seg.device))
            written = []
            for i, block in enumerate(self.blocks):
                written.append(write(banks[i], self.compressors[i](x), self.memory_capacity, cfg.memory_merge))
                x = self.run_block(block, i, x, None, banks[i] if banks[i].shape[1] else None)
            banks = written if cfg.memory_grad else [b.detach() for b in written]
            outs.append(self.head(self.norm(x)))
        self.last_memory = [b.detach() for b in banks]
        return torch.cat(outs, dim=1), banks

    def get_memory_stats(self) -> dict:
        """The banks after the last forward: slots filled per layer, capacity, utilization (guide 003's name)."""
        if self.cfg.memory_slots is None:
            raise ValueError("get_memory_stats is an LTM model's (memory_slots); this config has none")
        return memory_stats(self.last_memory, self.memory_capacity)

    def reduce_memory_slots(self, slots: int | None = None) -> int:
        """Shrink the banks of later writes to ``slots`` (default: half), at least one segment's slots; returns
        the new capacity (guide 003's name)."""
        if self.cfg.memory_slots is None:
            raise ValueError("reduce_memory_slots is an LTM model's (memory_slots); this config has none")
        floor = self.cfg.segment_len // self.cfg.memory_compression
        self.memory_capacity = max(floor, slots if slots is not None else self.memory_capacity // 2)
        return self.memory_capacity

    def _decode(self, tokens: Tensor, input_pos: Tensor) -> Tensor:
        """Logits (B, S, V) of tokens (B, S) at positions ``input_pos`` (S,), every layer reading and writing its
        KV cache (a dense decoder: ``generate.check_decodable``)."""
        B, S = tokens.shape
        if getattr(self.blocks[0].attn, "cache", None) is None:
            raise ValueError("input_pos decodes with KV caches: call generate.setup_kv_cache(model, batch) first")
        if self.cfg.memory_slots is not None:
            return self._decode_segments(tokens, input_pos)
        if decode_step.why_not(self, tokens) is None:
            return decode_step.fused_decode(self, tokens, input_pos)
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(input_pos)
        pos = input_pos.expand(B, S)
        for block in self.blocks:
            x = block(x, pos)
        return self.head(self.norm(x))

    def _decode_segments(self, tokens: Tensor, input_pos: Tensor) -> Tensor:
        """LTM decoding, the same function as ``_segments`` over the whole prefix: each layer attends over its bank
        and its segment cache; once a segment is complete, every layer's inputs for it are compressed into its
        bank. In order only: ``input_pos`` must continue from the tokens read so far (the bank holds their past).

        One token a call (``generate``'s steps) has the same shapes at every position: the host's part (the order
        check, the token count, the bank's write at a segment's end) runs outside the graph, before and after
        the step (``torch.compiler.disable``), so a compiled step is one graph whatever the position. Longer calls
        (a prefill) go in chunks that stay within a segment, eagerly."""
        caches: list[SegmentCache] = [block.attn.cache for block in self.blocks]
        if tokens.shape[1] == 1:
            self._ltm_check_order(caches, input_pos)
            logits = self._decode_segment_chunk(tokens, input_pos % self.cfg.segment_len, caches)
            self._ltm_advance(caches, 1)
            return logits
        cfg, S = self.cfg, tokens.shape[1]
        first = self._ltm_check_order(caches, input_pos)
        outs, start = [], 0
        while start < S:
            offset = (first + start) % cfg.segment_len
            n = min(S - start, cfg.segment_len - offset)
            offsets = torch.arange(offset, offset + n, device=tokens.device)
            outs.append(self._decode_segment_chunk(tokens[:, start:start + n], offsets, caches))
            self._ltm_advance(caches, n)
            start += n
        return torch.cat(outs, dim=1)

    def _decode_segment_chunk(self, tokens: Tensor, offsets: Tensor, caches: list[SegmentCache]) -> Tensor:
        """Tokens (B, n) at ``offsets`` (n,) of the current segment through every layer: logits (B, n, V)."""
        x = self.embed(tokens)
        if self.pos is not None:  # positions count within the segment
            x = x + self.pos(offsets)
        for block, cache in zip(self.blocks, caches):
            cache.inputs.index_copy_(1, offsets, x.to(cache.inputs.dtype))
            x = block(x, offsets.expand(tokens.shape[0], -1))
        return self.head(self.norm(x))

    @torch.compiler.disable
    def _ltm_check_order(self, caches: list[SegmentCache], input_pos: Tensor) -> int:
        """The tokens read so far, after checking that ``input_pos`` continues from them: on the host for a
        position on the CPU or a longer call, by a device-side assert for one token's position on a GPU (no
        host sync a token)."""
        seen, S = caches[0].seen, input_pos.shape[0]
        if input_pos.device.type != "cpu" and S == 1:
            torch._assert_async(input_pos[0] == seen, "input_pos must continue from the tokens read so far")
            return seen
        if not torch.equal(input_pos.cpu(), torch.arange(seen, seen + S)):
            raise ValueError(f"input_pos must continue from the {seen} tokens read so far, one after another; got "
                             f"{input_pos.tolist()[:4]}...")
        return seen

    @torch.compiler.disable
    def _ltm_advance(self, caches: list[SegmentCache], n: int) -> None:
        """``n`` more tokens read; at a segment's end every layer's inputs for it are compressed into its bank."""
        for i, (block, cache) in enumerate(zip(self.blocks, caches)):
            cache.seen += n
            if cache.seen % self.cfg.segment_len == 0:
                bank = write(cache.memory(), self.compressors[i](cache.inputs), self.memory_capacity,
                             self.cfg.memory_merge)
                cache.set_bank(bank, *block.attn.memory_kv(block.norm1(bank)))
        self.last_memory = [c.memory() for c in caches]

    def _routed(self, x: Tensor, aux: list[Tensor]) -> Tensor:
        B, S, _ = x.shape
        pos = torch.arange(S, device=x.device).expand(B, S)
        R, count = self.cfg.recursions, iter(range(1 << 30))  # count: the blocks run, for every_k checkpointing
        if R == 1:
            return self._stack(range(len(self.blocks)), x, pos, aux, count)
        middle = range(1, len(self.blocks) - 1)
        x = self._stack([0], x, pos, aux, count)
        x = self._stack(middle, x, pos, aux, count)  # recursion 0: every token
        idx = None  # the tokens of the last recursion (None: all), indices into the sequence
        for r in range(1, R):
            xs, ps = (x, pos) if idx is None else (gather(x, idx), gather(pos, idx))
            xs, local = routed(lambda h, p: self._stack(middle, h, p, aux, count), xs, ps,
                               self.recursion_routers[r - 1](xs), capacity(S, (R - r) / R), self.training, aux)
            x, idx = (xs, local) if idx is None else (scatter(x, idx, xs), gather(idx, local))
        return self._stack([len(self.blocks) - 1], x, pos, aux, count)

    def _stack(self, indices, x: Tensor, pos: Tensor, aux: list[Tensor], count) -> Tensor:
        """The blocks at ``indices`` in order on x (B, n, E) at positions pos (B, n); MoD blocks route."""
        for i in indices:
            block = self.blocks[i]
            x = self.run_block(block, next(count), x, pos)
            if block.router is not None:  # a MoD block routed in its forward
                x, loss = x
                if loss is not None:
                    aux.append(loss)
        return x

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of the logits at every position against ``targets`` (B, S); -100 is ignored. A
        routed model adds its routers' auxiliary loss times ``router_aux_weight``."""
        logits, aux = self(tokens, return_aux=True)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return ce + self.cfg.router_aux_weight * aux


def build_model(cfg: ModelConfig | dict, device=None, dtype=None) -> Transformer:
    """A ``Transformer`` from a config or a preset's dict (validated first: a bad key is named)."""
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig(**cfg)
    with torch.device(device or "cpu"):
        model = Transformer(cfg)
    return model if dtype is None else model.to(dtype)


def tiny(cfg: ModelConfig) -> ModelConfig:
    """The same architecture at toy sizes (the CPU tests' variant of a preset): 2 layers (3 with recursions),
    width 32 x compression, the preset's head grouping kept where it fits, LTM segments of 8."""
    heads = 4
    kv = max(1, heads // (cfg.n_heads // cfg.kv_heads))
    layers = 3 if cfg.recursions > 1 else 2  # a shared stack between a first and a last block
    # LTM: segments of 8 writing 2 slots into banks of 4, so a short input reads, writes and merges
    ltm = {"segment_len": 8, "memory_compression": 4, "memory_slots": 4} if cfg.memory_slots is not None else {}
    return ModelConfig(**{**cfg.model_dump(), "dim": 32 * cfg.compression, "n_layers": layers, "n_heads": heads,
                          "n_kv_heads": kv, "vocab_size": 256, "mlp_hidden": None, "max_seq_len": 64, **ltm})
