"""HYDRA's parts (guide 004; ``docs/models.md`` says where each follows its paper and where the guide):
compressed convolutional GQA attention (CCGQA, arXiv 2510.04476) and token routing, Mixture-of-Depths (MoD,
arXiv 2404.02258) and Mixture-of-Recursions (MoR, arXiv 2507.10524), on the zoo's blocks.

Routing keeps shapes static in training: a router scores each token, the top ``k`` of a sequence (``k`` from
the capacity) are gathered in their order, run through the block(s) with their original positions, and
scattered back as ``x + sigmoid(score) * (block(x) - x)`` (the gate carries the router's gradient); the rest
skip on the residual. Top-k reads the whole sequence, which a decoder cannot at inference: each router also
learns, by a binary cross-entropy on its own scores, whether a token lands in the top k, and in eval mode a
token is routed when its score is above 0 (the papers' causal auxiliary loss).

Shapes: B batch, S sequence, E dim, H latent query heads, G latent kv heads, D head dim, L = H D latent.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaattn.layers import RotaryEmbedding
from adaattn.models.config import ModelConfig


def rotate_at(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor) -> Tensor:
    """Rotary embedding of x (B, S, heads, D) at positions ``pos`` (B, S) of the (max, D/2) tables: for tokens
    that a router gathered out of their sequence (the fused kernel takes one table for every row)."""
    # in x's dtype, as the fused kernel's output is: an fp32 copy of q and k would be what the backward keeps
    c, s = cos[pos][:, :, None, :].to(x.dtype), sin[pos][:, :, None, :].to(x.dtype)  # (B, S, 1, D/2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _causal_conv(x: Tensor, weight: Tensor, groups: int) -> Tensor:
    """x (B, S, C) through a Conv1d weight (C, C / groups, K), padded on the left: position t sees t-K+1..t.
    Eager: cuDNN's convolution. Compiled: the same sums as taps and one grouped GEMM (``_causal_conv_taps``),
    which inductor fuses with the ops around them: the compiled layer ran faster so on the H100, the eager one
    slower (docs/notebook.md)."""
    if torch.compiler.is_compiling():
        return _causal_conv_taps(x, weight, groups)
    K = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), weight, groups=groups)
    return y.transpose(1, 2)  # channels-first: the caller makes the last convolution's output contiguous


def _causal_conv_taps(x: Tensor, weight: Tensor, groups: int) -> Tensor:
    """``_causal_conv`` as shifted multiply-adds (depthwise) or the taps side by side times the weight, one
    batched GEMM over the groups: (B S, K Cg) x (K Cg, Cg)."""
    B, S, C = x.shape
    K, per_group = weight.shape[-1], weight.shape[1]
    xp = F.pad(x, (0, 0, K - 1, 0))  # zeros before the first position
    if per_group == 1:
        w = weight[:, 0, :].to(x.dtype)  # (C, K), in x's dtype as autocast's conv1d has it (fp32 would promote)
        return sum(xp[:, k:k + S] * w[:, k] for k in range(K))
    Cg = C // groups
    taps = torch.stack([xp[:, k:k + S] for k in range(K)], dim=2).view(B, S, K, groups, Cg)  # (B, S, K, G, Cg)
    w = weight.view(groups, Cg, per_group, K)  # (G, out, in, K)
    return torch.einsum("bskgi,goik->bsgo", taps, w).reshape(B, S, C)


class CCGQAttention(nn.Module):
    """Attention in a compressed latent: down-project x (E) to q (L = E / compression), k and v (G D each);
    value shift (half of v's channels come from the previous token); two causal convolutions on q and on k
    (depthwise over the sequence, then over the sequence and the channels of each head); q-k mean coupling;
    L2-normalised q and k with a learned temperature; RoPE; causal SDPA with GQA; up-project L -> E."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        H, G, D, K = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.conv_kernel
        self.down = nn.Linear(cfg.dim, (H + 2 * G) * D, bias=False)
        self.out = nn.Linear(H * D, cfg.dim, bias=False)
        # Conv1d weights (out, in / groups, K), initialised as Conv1d does, plus 1 on each channel's own last tap
        # (the current token): a fresh layer starts near the identity
        self.q_seq, self.q_mix = nn.Parameter(torch.empty(H * D, 1, K)), nn.Parameter(torch.empty(H * D, D, K))
        self.k_seq, self.k_mix = nn.Parameter(torch.empty(G * D, 1, K)), nn.Parameter(torch.empty(G * D, D, K))
        for w in (self.q_seq, self.q_mix, self.k_seq, self.k_mix):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            with torch.no_grad():  # out channel c reads its own channel (c mod D within its head) at the last tap
                c = torch.arange(w.shape[0])
                w[c, c % w.shape[1], -1] += 1.0
        self.temperature = nn.Parameter(torch.full((1,), math.sqrt(D)))  # 1-D: FSDP shards no 0-d parameter

    def forward(self, x: Tensor, pos: Tensor | None = None) -> Tensor:
        B, S, _ = x.shape
        H, G, D = self.cfg.n_heads, self.cfg.kv_heads, self.cfg.head_dim
        q0, k0, v = self.down(x).split([H * D, G * D, G * D], dim=-1)  # (B, S, L), (B, S, G D) x 2
        half = G * D // 2  # value shift: the second half of v's channels from the token before
        v = torch.cat((v[..., :half], F.pad(v[:, :-1, half:], (0, 0, 1, 0))), dim=-1)
        # contiguous (B, S, C): a head dim that is not contiguous sends SDPA to its math path
        q = _causal_conv(_causal_conv(q0, self.q_seq, H * D), self.q_mix, H).contiguous()
        k = _causal_conv(_causal_conv(k0, self.k_seq, G * D), self.k_mix, G).contiguous()
        # q-k mean coupling: each q head gets half the mean k head (before the convolutions), and each k head
        # half the mean q head, so q and k share a component whatever the grouping
        q = q.view(B, S, H, D) + 0.5 * k0.view(B, S, G, D).mean(2, keepdim=True)
        k = k.view(B, S, G, D) + 0.5 * q0.view(B, S, H, D).mean(2, keepdim=True)
        # in the compute dtype: autocast runs the norm inside F.normalize in fp32, and SDPA's fused kernels take
        # q, k and v of one low-precision dtype
        q = F.normalize(q, dim=-1).to(v.dtype)
        k = (F.normalize(k, dim=-1) * self.temperature).to(v.dtype)
        if pos is None:
            q, k = self.rope(q, k)
        else:
            self.rope.ensure(S)  # gathered positions reach the whole sequence's: the first block ensured it
            q = rotate_at(q, self.rope.cos, self.rope.sin, pos)
            k = rotate_at(k, self.rope.cos, self.rope.sin, pos)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, S, G, D).transpose(1, 2)
        # logits = cos(q, k) * temperature: the norms replace SDPA's 1/sqrt(D)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, enable_gqa=G != H)
        return self.out(out.transpose(1, 2).reshape(B, S, H * D))


class Router(nn.Module):
    """A token's score for a routed block or recursion: one linear map of its state, r = w.x."""

    def __init__(self, dim: int):
        super().__init__()
        self.score = nn.Linear(dim, 1, bias=False)
        nn.init.normal_(self.score.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        # x . w rather than Linear then squeeze: the score is no view (a view returned from an FSDP2 unit loses
        # the unit's pre-backward hook to any in-place op on it)
        return x @ self.score.weight[0]  # (B, S)


def capacity(n: int, fraction: float) -> int:
    """Tokens of n that a route with this capacity takes (at least one)."""
    return max(1, min(n, math.ceil(fraction * n)))


def select(scores: Tensor, k: int, training: bool, aux: list[Tensor] | None) -> Tensor:
    """Indices (B, k') of the routed tokens, ascending: the top k by score in training (and the causal
    auxiliary loss appended to ``aux``), the tokens scoring above 0 at inference (one row at a time)."""
    if training:
        top = scores.topk(k, dim=1).indices.sort(dim=1).values
        if aux is not None:
            target = torch.zeros_like(scores).scatter_(1, top, 1.0)
            aux.append(F.binary_cross_entropy_with_logits(scores.float(), target.float()))
        return top
    if scores.shape[0] != 1:
        raise ValueError("inference routing takes one sequence at a time (the model loops over the batch)")
    return (scores[0] > 0).nonzero()[:, 0][None]


def gather(x: Tensor, idx: Tensor) -> Tensor:
    """x (B, S, ...) at idx (B, k) -> (B, k, ...)."""
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))


def scatter(x: Tensor, idx: Tensor, values: Tensor) -> Tensor:
    """x with rows idx (B, k) replaced by values (B, k, E) (out of place: autograd keeps x)."""
    return x.scatter(1, idx[..., None].expand(-1, -1, x.shape[-1]), values)


def routed(run, x: Tensor, pos: Tensor, scores: Tensor, k: int, training: bool,
           aux: list[Tensor] | None) -> tuple[Tensor, Tensor]:
    """``run(xs, pos)`` on the routed tokens of x (B, S, E), gated by their scores and scattered back; the
    others unchanged. Returns (x, the routed tokens' indices into x)."""
    idx = select(scores, k, training, aux)
    if idx.shape[1] == 0:
        return x, idx
    xs, gate = gather(x, idx), torch.sigmoid(gather(scores, idx))[..., None].to(x.dtype)
    ys = run(xs, gather(pos, idx))
    return scatter(x, idx, xs + gate * (ys - xs)), idx
