"""AdaAttention: a drop-in for ``nn.MultiheadAttention`` with a measured backend choice, adaptive
precision and adaptive rank.

``attn(query, key, value, attn_mask=None, key_padding_mask=None, need_weights=False,
is_causal=False) -> (output, weights or None)``, with ``nn.MultiheadAttention``'s conventions:
a bool mask marks positions that may NOT be attended (True = masked), a float mask is added to
the scores; ``attn_mask`` is (L, S) or (B * heads, L, S), ``key_padding_mask`` (B, S); weights
are averaged over heads. With equal embedding sizes and as many kv heads as heads, the
parameters are ``nn.MultiheadAttention``'s (``in_proj_weight``, ``in_proj_bias``, ``out_proj``),
so its ``state_dict`` loads as it is. ``num_kv_heads`` < ``num_heads`` is GQA. Unlike
``nn.MultiheadAttention``, ``is_causal=True`` needs no mask.

Per call: the precision policy (``precision.py``) picks the compute dtype; ``rank_mode`` picks
the exact path or a low-rank path (``rank.py``: Nyström or pooled segment means,
``low_rank_method``; "auto" estimates the rank of the first call of each signature, tries the
paths on sampled rows, and takes the one within its error budget only where the module's call
through it is faster than through the exact path, timed side by side (``_low_rank_speed``); only
unmasked attention of ``min_low_rank_len`` keys or more goes low-rank); the exact path goes through the kernel manager (``kernel_manager.py``), which runs
the fastest backend measured on this machine for the inputs (timing this module's whole call with
each backend: ``_call_of``). A later call like an earlier one
(same shapes, causal, mode, grad mode and projections' dtype; no mask, no weights) replays those
decisions (``_Plan``) instead of taking every policy again.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.nn.modules.module as _nn_module  # the global hook registries nn.Module.__call__ reads
from torch import Tensor, nn

from adaattn.attention.backends import BACKENDS, Run, Signature, attention_probs
from adaattn.attention.hardware import HardwareCapabilities
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.precision import PRECISION_MODES, PrecisionPolicy
from adaattn.attention.rank import LOW_RANK_METHODS, LowRank, Speed, choose_rank, low_rank_attention

ENV_CACHE = "ADAATTN_KERNEL_CACHE"  # JSON file for the shared manager's measured choices
_shared: AttentionKernelManager | None = None
_grad_enabled = torch.is_grad_enabled  # read on every call
_tracing_state = torch._C._get_tracing_state  # torch.jit.trace in progress (nn.Module.__call__ reads it too)
_Module = nn.Module
_module_call = nn.Module.__call__  # as torch defines it (torch.fx's tracer patches it to see module calls)
# the global hook registries nn.Module.__call__ reads (torch fills and empties them, never rebinds them)
_GLOBAL_HOOKS = (_nn_module._global_forward_pre_hooks, _nn_module._global_forward_hooks,
                 _nn_module._global_backward_pre_hooks, _nn_module._global_backward_hooks)


MAX_PLANS = 256  # replay plans per module, one per kind of call; the oldest goes first
MASKED = "masked or causal: the low-rank path has no mask"  # why a call of rank_mode auto or int went exact
# what the policies read: setting one after construction drops the plans made under the old value
POLICY_ATTRS = frozenset({"precision", "rank_mode", "low_rank_method", "rank_sample_rows", "min_low_rank_len",
                          "max_rank_error", "kernel_manager", "enable_gpu_optimization", "dropout", "batch_first",
                          "_rank_choice"})
# ... and of those, what the rank policy's cached choices (``_rank_choice``) were made under
RANK_POLICY_ATTRS = frozenset({"rank_mode", "low_rank_method", "rank_sample_rows", "min_low_rank_len",
                               "max_rank_error"})


@dataclass(slots=True, eq=False)
class _Plan:
    """What the policies decided for one kind of call (the inputs' shapes, dtype and device, which of
    them are the same tensor, causal, training, grad mode), replayed on the next calls of that kind.

    Why: at a host-bound shape a call's time is its Python. Deciding again on every call (signature,
    hardware, precision, rank, the manager's ranking) cost 23-26 us of host time per forward on the
    H100 host, against a 3% goal (B=1, S=512 and 2048, E=512 bf16: 131.7 and 126.6 us with every
    policy, 108.7 and 105.0 replayed, the direct call 108.7 and 100.1; the GPU held by a sleep
    kernel). A replay then still read more than it needed. Side by side with the direct call on the
    H100 host (B=1, S=512-4096, E=512 bf16, two machines), the module took 1.019-1.078x its time when
    the key held the inputs' dtype and device and each call checked that the manager's choices still
    held and bumped its counter; 1.019-1.034x with the inline replay (``_replayed``). The counter
    alone was 0.7-1.6% of a call, so the manager counts a plan's calls when asked (``track``).
    Scratch timings during these changes, not a study.

    A plan stops applying when the precision policy is due to look again (``limit`` calls), the
    manager's choice may have changed (it sets ``limit`` to ``calls``), the projections' dtype or
    grad mode differs from the plan's, or its path fails; the call then takes every policy again.
    Setting a policy attribute (``POLICY_ATTRS``) or moving the module (``_apply``) drops the plans."""

    sig: str  # the signature key the decisions are filed under
    q_dtype: torch.dtype  # the projections' dtype they were made for
    grad: bool  # a training signature (the projections need gradients)
    dtype: torch.dtype  # compute dtype
    rank: LowRank | None  # the low-rank path and its landmarks, None: exact
    run: Run  # the path: the manager's backend, the low-rank path or SDPA
    backend: str | None  # the manager's backend, None: the low-rank path or SDPA
    manager: AttentionKernelManager | None  # the backend's: it counts the calls and may stop the plan (``track``)
    out_dtype: torch.dtype | None  # the output's dtype where it is not the compute dtype
    causal: bool
    scale: float
    limit: int  # calls before the precision policy must look again (or the manager may look again, or its choice change)
    checks: bool  # the precision policy counts the calls to its next look
    skipped: str | None  # why the low-rank path was not taken, counted per call (``MASKED``), or None
    calls: int = 0


def _low_rank(choice: LowRank) -> Run:
    def run(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float) -> Tensor:
        return low_rank_attention(q, k, v, choice, scale=scale)  # planned only for unmasked, non-causal calls

    return run


def sdpa_path(dropout_p: float) -> Run:
    """SDPA with the module's dropout (the path without the manager); GQA by SDPA's ``enable_gqa``. A plain
    function: a plan holding a bound method would keep its module alive in a reference cycle."""
    def run(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              dropout_p=dropout_p, enable_gqa=q.shape[1] != k.shape[1])

    return run


def _param(module: nn.Module, name: str) -> Tensor | None:
    """``getattr(module, name)`` for a parameter, without ``nn.Module.__getattr__``: Python tries the
    instance and its class first, fails, and only then calls it (0.7-0.8 us per access on the
    development CPU with torch 2.13, scratch timing; a replayed call reads five). A parametrized
    weight (``torch.nn.utils.parametrize``) is a property of the class and is read as one."""
    p = module._parameters
    return p[name] if name in p else getattr(module, name)


def check_policy(precision_mode: str, rank_mode: str | int, low_rank_method: str, dropout: float) -> None:
    """AdaAttention's policy arguments, checked (a ValueError naming the argument and what it allows)."""
    if precision_mode not in PRECISION_MODES:
        raise ValueError(f"precision_mode {precision_mode!r} is not one of: {', '.join(PRECISION_MODES)}")
    if not (rank_mode in ("auto", "full") or (isinstance(rank_mode, int) and not isinstance(rank_mode, bool)
                                              and rank_mode >= 1)):
        raise ValueError(f"rank_mode must be 'auto', 'full' or a positive int; got {rank_mode!r}")
    if low_rank_method not in ("auto", *LOW_RANK_METHODS):
        raise ValueError(f"low_rank_method {low_rank_method!r} is not one of: auto, {', '.join(LOW_RANK_METHODS)}")
    check_dropout(dropout)


def check_dropout(p: float, name: str = "dropout") -> None:
    """A dropout probability: a number in [0, 1) (a ValueError naming ``name`` otherwise)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1); got {p!r}")


def _untrack(plans: dict) -> None:
    for plan in plans.values():
        if plan.manager is not None:
            plan.manager.untrack(plan)


def _untrack_when_gone(module: AdaAttention) -> None:
    """When ``module`` is collected, its plans' calls go to their managers' counts (which hold the plans
    until then: ``AttentionKernelManager.track``)."""
    weakref.finalize(module, _untrack, module._plans).atexit = False


def shared_kernel_manager() -> AttentionKernelManager:
    """One manager for every AdaAttention that is not given its own: layers share measurements."""
    global _shared
    if _shared is None:
        _shared = AttentionKernelManager(cache_path=os.environ.get(ENV_CACHE) or None)
    return _shared


class AdaAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 kdim: int | None = None, vdim: int | None = None, batch_first: bool = True,
                 num_kv_heads: int | None = None, enable_gpu_optimization: bool = True,
                 precision_mode: str = "auto", rank_mode: str | int = "auto", low_rank_method: str = "auto",
                 rank_sample_rows: int = 64,
                 min_low_rank_len: int = 1024, max_rank_error: float = 0.05, kernel_manager: AttentionKernelManager | None = None,
                 device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int; got {val!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        check_policy(precision_mode, rank_mode, low_rank_method, dropout)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.batch_first, self.dropout = batch_first, dropout
        kv_dim = num_kv_heads * self.head_dim
        self._packed = self.kdim == self.vdim == embed_dim and num_kv_heads == num_heads
        if self._packed:  # nn.MultiheadAttention's names and shapes
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(kv_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(kv_dim, self.vdim, **factory))
        self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * kv_dim, **factory)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.enable_gpu_optimization = enable_gpu_optimization
        self.precision = PrecisionPolicy(precision_mode)
        self.rank_mode, self.rank_sample_rows, self.min_low_rank_len = rank_mode, rank_sample_rows, min_low_rank_len
        # "auto": the policy tries every low-rank path (cheaper first) and a fixed rank_mode runs Nyström
        self.low_rank_method = low_rank_method
        if not max_rank_error > 0:
            raise ValueError(f"max_rank_error must be > 0; got {max_rank_error}")
        self.max_rank_error = max_rank_error
        self.kernel_manager = kernel_manager
        self._rank_choice: dict[str, LowRank | None] = {}  # signature -> low-rank path (None: exact)
        self._ranks: Counter[str] = Counter()
        self._precisions: Counter[torch.dtype] = Counter()
        self._low_rank_skipped: Counter[str] = Counter()
        self._plans: dict[tuple, _Plan] = {}  # kind of call -> what the policies decided for it
        _untrack_when_gone(self)
        self._reset_parameters()

    def _reset_parameters(self) -> None:  # as nn.MultiheadAttention
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    # ------------------------------------------------------------------ helpers

    @property
    def manager(self) -> AttentionKernelManager:
        return self.kernel_manager or shared_kernel_manager()

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, heads, L, D) q and (B, kv heads, S, D) k, v; self-attention with packed weights is one GEMM."""
        if self._packed and query is key and key is value:
            B, L = query.shape[:2]
            qkv = F.linear(query, _param(self, "in_proj_weight"), _param(self, "in_proj_bias")).view(
                B, L, 3, self.num_heads, self.head_dim)
            return qkv.permute(2, 0, 3, 1, 4).unbind(0)
        E, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        b = _param(self, "in_proj_bias")
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:E + kv], b[E + kv:])
        if self._packed:
            w = _param(self, "in_proj_weight")
            wq, wk, wv = w[:E], w[E:E + kv], w[E + kv:]
        else:
            wq, wk, wv = (_param(self, n) for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight"))
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        q = F.linear(query, wq, bq).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = F.linear(key, wk, bk).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = F.linear(value, wv, bv).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def _out_proj(self, out: Tensor, B: int, L: int, E: int) -> Tensor:
        """The output projection of the heads' outputs (B, heads, L, D), with ``out_proj``'s weight and bias,
        as ``nn.MultiheadAttention`` applies them (F.linear: ``out_proj``'s own forward and hooks do not run)."""
        proj = self._modules["out_proj"]
        return F.linear(out.transpose(1, 2).reshape(B, L, E), _param(proj, "weight"), _param(proj, "bias"))

    def _mask(self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool, B: int, L: int,
              S: int, device) -> tuple[Tensor | None, bool]:
        """One SDPA-style mask (bool True = may attend, or additive float) broadcastable to (B, H, L, S),
        and whether is_causal still has to be passed (True only when no other mask exists)."""
        masks = []
        if attn_mask is not None:
            if attn_mask.dim() == 2 and attn_mask.shape == (L, S):
                m = attn_mask[None, None]
            elif attn_mask.dim() == 3 and attn_mask.shape == (B * self.num_heads, L, S):
                m = attn_mask.view(B, self.num_heads, L, S)
            else:
                raise ValueError(f"attn_mask must be (L, S) = ({L}, {S}) or (B * num_heads, L, S) = "
                                 f"({B * self.num_heads}, {L}, {S}); got {tuple(attn_mask.shape)}")
            masks.append(m)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, S):
                raise ValueError(f"key_padding_mask must be (B, S) = ({B}, {S}); got {tuple(key_padding_mask.shape)}")
            masks.append(key_padding_mask[:, None, None, :])
        if not masks:
            return None, is_causal
        if is_causal:
            masks.append(torch.ones(L, S, dtype=torch.bool, device=device).triu_(1)[None, None])
        allowed: Tensor | None = None
        additive: Tensor | None = None
        for m in masks:
            if m.dtype == torch.bool:
                allowed = ~m if allowed is None else allowed & ~m
            elif m.is_floating_point():
                additive = m.float() if additive is None else additive + m.float()
            else:
                raise TypeError(f"masks must be bool or float; got {m.dtype}")
        if additive is None:
            return allowed, False
        if allowed is not None:
            additive = additive.masked_fill(~allowed, float("-inf"))
        return additive, False

    def _rank_for(self, key: str, q: Tensor, k: Tensor, v: Tensor, masked: bool,
                  speed: Callable[[LowRank], Speed]) -> LowRank | None:
        """The low-rank path and its landmarks for this call, or None for the exact path. ``speed``: the
        rank policy's timing of a low-rank path against the exact one (``_low_rank_speed``)."""
        if self.rank_mode == "full":
            return None
        if masked:
            self._low_rank_skipped[MASKED] += 1
            return None
        if isinstance(self.rank_mode, int):
            return LowRank("nystrom" if self.low_rank_method == "auto" else self.low_rank_method, self.rank_mode)
        if key not in self._rank_choice:
            methods = LOW_RANK_METHODS if self.low_rank_method == "auto" else (self.low_rank_method,)
            r, seen = choose_rank(q, k, v, sample=self.rank_sample_rows, min_len=self.min_low_rank_len,
                                  max_rel_error=self.max_rank_error, methods=methods, speed=speed)
            if seen["estimate"] is not None:
                self._ranks[f"estimated {seen['estimate']}"] += 1
            if seen["speed"] is not None and r is None:
                sp, method = seen["speed"], list(seen["sample_rel_error"])[-1]
                self._low_rank_skipped[f"{seen['tried']} landmarks ({method}): {sp.low_rank_ms:.3g} ms per call, "
                                       f"not faster than the exact path's {sp.exact} ({sp.exact_ms:.3g} ms)"] += 1
            elif seen["tried"] is not None and r is None:
                errs = ", ".join(f"{m} {e:.3g}" for m, e in seen["sample_rel_error"].items())
                self._low_rank_skipped[f"{seen['tried']} landmarks: sampled rows' relative error ({errs}) "
                                       f"> {self.max_rank_error}"] += 1
            self._rank_choice[key] = r
        return self._rank_choice[key]

    # ------------------------------------------------------------------ forward

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                 key_padding_mask: Tensor | None = None, need_weights: bool = False,
                 is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """``forward``, as ``nn.Module.__call__`` calls it when it has nothing else to do: no hook on this
        module and no global one, not compiled (``compile()``), no ``torch.jit.trace`` in progress, and
        ``nn.Module.__call__`` not patched (``torch.fx.symbolic_trace`` patches it to record module calls);
        otherwise ``nn.Module.__call__`` itself, which gets query, key and value as positional arguments
        and the others as keywords where they are not their defaults. An unmasked call without weights
        goes straight to its replay (``_replayed``).

        Why: at a host-bound shape the module's time over the direct call's is its Python. On a lent
        H100's host (torch 2.11, Python 3.12; scratch timings, E=512 bf16 forward, the module and the
        direct call side by side in 2000 shuffled rounds, ``experiments/side_by_side.py``), at B=1 S=512
        and 1024 the module took 1.010 and 1.012x the direct call's time per call when this method took
        ``*args, **kwargs`` and passed them on to ``forward`` (``nn.Module.__call__``'s two frames
        skipped), and 0.995 and 0.999x as it is: passing a keyword on through ``**kwargs`` cost 465 ns
        there, against 94 ns bound directly. At B=1 S=4096 and B=4 S=1024, where the GPU's time
        decides: 0.998x at both then, 0.999 and 1.001x as it is."""
        if _Module.__call__ is _module_call and self._compiled_call_impl is None and not (
                self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks or self._backward_hooks
                or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or _GLOBAL_HOOKS[2] or _GLOBAL_HOOKS[3]) \
                and _tracing_state() is None:
            if attn_mask is None and key_padding_mask is None and not need_weights:
                return self._replayed(query, key, value, is_causal), None
            return self.forward(query, key, value, attn_mask, key_padding_mask, need_weights, is_causal)
        kwargs = {name: val for name, val, default in (("attn_mask", attn_mask, None),
                                                       ("key_padding_mask", key_padding_mask, None),
                                                       ("need_weights", need_weights, False),
                                                       ("is_causal", is_causal, False)) if val is not default}
        return _Module.__call__(self, query, key, value, **kwargs)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                key_padding_mask: Tensor | None = None, need_weights: bool = False,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if attn_mask is not None or key_padding_mask is not None or need_weights:
            return self._forward(None, query, key, value, attn_mask, key_padding_mask, need_weights, is_causal)
        return self._replayed(query, key, value, is_causal), None

    def _replayed(self, query: Tensor, key: Tensor, value: Tensor, is_causal: bool) -> Tensor:
        """The output of an unmasked call without weights: a call like an earlier one replays what the
        policies decided for it (see _Plan); self-attention (one tensor: one GEMM projects it) and
        cross-attention keys differ in length. The inputs' dtype and device are not in the key: the
        projections' dtype is checked below, and moving the module drops the plans (``_apply``)."""
        shape = query.shape
        call = (shape, is_causal, self.training, _grad_enabled()) if query is key and key is value \
            else (shape, key.shape, value.shape, is_causal, self.training, _grad_enabled())
        plan = self._plans.get(call)
        if plan is None:
            return self._forward(call, query, key, value, None, None, False, is_causal)[0]
        if plan.calls >= plan.limit or not self.batch_first:
            return self._replay(call, plan, query, key, value)
        # the replay of a batch-first call, inline (``_replay`` in full): at a host-bound shape this Python
        # is the module's time over the direct call's, so it reads as few objects as it can (the manager
        # counts the plan's calls when asked, and stops the plan when its choice may change: ``track``)
        q, k, v = self._project(query, key, value)
        if q.dtype is not plan.q_dtype or (call[-1] and (q.requires_grad or k.requires_grad) != plan.grad):
            self._retire(call)  # autocast, frozen weights: every policy again
            return self._forward(call, query, key, value, None, None, False, is_causal, (q, k, v))[0]
        if plan.dtype is not plan.q_dtype:
            q, k, v = q.to(plan.dtype), k.to(plan.dtype), v.to(plan.dtype)
        try:
            out = plan.run(q, k, v, None, plan.causal, plan.scale)
        except Exception:  # noqa: BLE001 - _forward takes every policy again (the manager falls back, logs why)
            self._retire(call)
            return self._forward(call, query, key, value, None, None, False, is_causal, (q, k, v))[0]
        plan.calls += 1
        if plan.out_dtype is not None:
            out = out.to(plan.out_dtype)
        return self._out_proj(out, *shape)

    def _forward(self, call: tuple | None, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                 key_padding_mask: Tensor | None, need_weights: bool, is_causal: bool,
                 qkv: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """Every policy at work; files a replay plan for ``call`` (None: this kind of call has none)."""
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(f"query, key and value must be 3-D; got {query.dim()}, {key.dim()}, {value.dim()} dims")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, L, E = query.shape
        S = key.shape[1]
        if E != self.embed_dim or key.shape[2] != self.kdim or value.shape[2] != self.vdim or value.shape[:2] != (B, S) \
                or key.shape[0] != B:
            raise ValueError(f"expected query (B, L, {self.embed_dim}), key (B, S, {self.kdim}), value (B, S, "
                             f"{self.vdim}); got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        q, k, v = self._project(query, key, value) if qkv is None else qkv
        mask, causal = self._mask(attn_mask, key_padding_mask, is_causal, B, L, S, q.device)
        scale = 1 / math.sqrt(self.head_dim)
        mask_kind = "causal" if causal else "none" if mask is None else "mask"
        sig = Signature.of(q, k, mask_kind)
        key_ = sig.key()
        policy = self.enable_gpu_optimization or self.precision.mode != "auto"
        dtype = self.precision.choose(q, k, v, scale, HardwareCapabilities.detect(q.device), key_) if policy \
            else q.dtype
        self._precisions[dtype] += 1
        qc, kc, vc = (q, k, v) if q.dtype == dtype else (t.to(dtype) for t in (q, k, v))
        msig = sig if qc is q else Signature.of(qc, kc, mask_kind)  # the manager's: the compute dtype's
        call_of = self._call_of(query, key, value, mask, causal, scale, dtype, sig.grad)
        rank = self._rank_for(key_, qc, kc, vc, mask_kind != "none",
                              functools.partial(self._low_rank_speed, call_of, msig, qc, kc, vc, scale))
        backend = None
        if rank is not None:
            self._ranks[f"low-rank {rank}"] += 1
            out = low_rank_attention(qc, kc, vc, rank, scale=scale)
        else:
            self._ranks["full"] += 1
            if self._through_manager():
                out, backend = self.manager(qc, kc, vc, mask, causal, scale, sig=msig, call=call_of)
            else:
                out = sdpa_path(self.dropout if self.training else 0.0)(qc, kc, vc, mask, causal, scale)
        if call is not None:
            limit = self.precision.calls_until_check(key_) if policy else sys.maxsize
            if limit:  # None: the policy looks at every call
                checks = limit != sys.maxsize
                if backend:  # and the manager, when it has a look to come
                    limit = min(limit, self.manager.calls_until_look(msig.key()))
                skipped = MASKED if self.rank_mode != "full" and mask_kind != "none" else None
                run = _low_rank(rank) if rank is not None else BACKENDS[backend].run if backend else \
                    sdpa_path(self.dropout if self.training else 0.0)  # dropout: a policy attribute; training: in the key
                self._file(call, _Plan(key_, q.dtype, sig.grad, dtype, rank, run, backend,
                                       self.manager if backend else None, None if dtype == query.dtype else query.dtype,
                                       causal, scale, limit, checks, skipped))
        out = out if out.dtype == query.dtype else out.to(query.dtype)
        out = self._out_proj(out, B, L, E)
        weights = self._weights(q, k, mask, causal, scale) if need_weights else None
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _call_of(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool, scale: float,
                 dtype: torch.dtype, grad: bool) -> Callable[[Run], Callable[[], object]]:
        """This call (batch-first inputs) with the op made by a given backend, for the manager to time when it
        ranks the backends of a new signature (built only then): the projections, the cast to ``dtype``, the
        op, the output projection; for a training signature also the backward (of a fixed output gradient,
        into the parameters and inputs that need gradients; nothing accumulates). The op's host time then
        counts against the module's GPU work: where the module's call is host-bound, a backend with less host
        time makes it faster though its kernel is slower."""
        return functools.partial(self._timed_call, query, key, value, mask, causal, scale, dtype, grad)

    def _low_rank_speed(self, call_of: Callable[[Run], Callable[[], object]], msig: Signature, q: Tensor, k: Tensor,
                        v: Tensor, scale: float, choice: LowRank) -> Speed:
        """The rank policy's check (``choose_rank``'s ``speed``): this call through the low-rank path ``choice``
        against this call through the exact path's backend (the manager's first, which it ranks here if it
        has not yet; SDPA without the manager), timed side by side as the manager times backends
        (``AttentionKernelManager.time_calls``: by its objective)."""
        if self._through_manager():
            ranked = self.manager.ranking(msig, q, k, v, None, False, scale, call=call_of)
            if not ranked:  # every backend disabled: the low-rank path is the one that runs
                return Speed(0.0, math.inf, "none")
            exact, run = ranked[0], BACKENDS[ranked[0]].run
        else:
            exact, run = "sdpa", sdpa_path(self.dropout if self.training else 0.0)
        times = self.manager.time_calls({"low-rank": call_of(_low_rank(choice)), exact: call_of(run)}, q.device)
        return Speed(times.get("low-rank", math.inf), times.get(exact, math.inf), exact)

    def _timed_call(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool, scale: float,
                    dtype: torch.dtype, grad: bool, run: Run) -> Callable[[], object]:
        B, L, E = query.shape
        leaves: dict[int, Tensor] = {}
        for t in (query, key, value):  # self-attention stays one tensor (one GEMM projects it)
            leaves.setdefault(id(t), t.detach().requires_grad_(grad and t.requires_grad))
        x, kx, vx = leaves[id(query)], leaves[id(key)], leaves[id(value)]
        wrt = [t for t in (*self.parameters(), *leaves.values()) if t.requires_grad] if grad else []
        grad_out: list[Tensor] = []

        def forward() -> Tensor:
            q, k, v = self._project(x, kx, vx)
            if q.dtype != dtype:
                q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            out = run(q, k, v, mask, causal, scale)
            return self._out_proj(out if out.dtype == x.dtype else out.to(x.dtype), B, L, E)

        def call() -> object:
            if not wrt:
                with torch.no_grad():
                    return forward()
            with torch.enable_grad():
                out = forward()
                if not grad_out:
                    grad_out.append(torch.randn_like(out))
                return torch.autograd.grad(out, wrt, grad_out[0], allow_unused=True)

        return call

    def _through_manager(self) -> bool:
        return self.enable_gpu_optimization and not (self.dropout and self.training)  # its backends take no dropout

    def _replay(self, call: tuple, plan: _Plan, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """``_forward``'s work with its decisions taken from ``plan``: the projections, the chosen path, the
        output projection, a count. Back to ``_forward`` when the plan no longer applies. ``_replayed`` runs
        this inline for batch-first calls."""
        if plan.calls >= plan.limit:
            self._retire(call)
            return self._forward(call, query, key, value, None, None, False, plan.causal)[0]
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, E = query.shape
        q, k, v = self._project(query, key, value)
        if q.dtype != plan.q_dtype or (q.requires_grad or k.requires_grad) != plan.grad:  # autocast, frozen weights
            self._retire(call)
            return self._forward(call, *self._inputs(query, key, value), None, None, False, plan.causal, (q, k, v))[0]
        qc, kc, vc = (q, k, v) if q.dtype == plan.dtype else (q.to(plan.dtype), k.to(plan.dtype), v.to(plan.dtype))
        try:
            out = plan.run(qc, kc, vc, None, plan.causal, plan.scale)
        except Exception:  # noqa: BLE001 - _forward takes every policy again (the manager falls back, logs why)
            self._retire(call)
            return self._forward(call, *self._inputs(query, key, value), None, None, False, plan.causal, (q, k, v))[0]
        plan.calls += 1
        out = out if plan.out_dtype is None else out.to(plan.out_dtype)
        out = self._out_proj(out, B, L, E)
        return out if self.batch_first else out.transpose(0, 1)

    def _inputs(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The caller's layout back from batch-first (``_forward`` takes the caller's)."""
        return (query, key, value) if self.batch_first else (query.transpose(0, 1), key.transpose(0, 1),
                                                            value.transpose(0, 1))

    def _file(self, call: tuple, plan: _Plan) -> None:
        if call in self._plans:
            self._retire(call)
        elif len(self._plans) >= MAX_PLANS:
            self._retire(next(iter(self._plans)))  # the oldest
        self._plans[call] = plan
        if plan.manager is not None:
            plan.manager.track(plan)

    def _retire(self, call: tuple) -> None:
        """Drop a plan, its calls counted where ``_forward`` counts them."""
        plan = self._plans.pop(call)
        if plan.manager is not None:
            plan.manager.untrack(plan)
        self._count(plan, self._precisions, self._ranks, self._low_rank_skipped)
        if plan.calls and plan.checks:  # the precision policy counts calls to its next check
            self.precision.record(plan.sig, plan.calls)

    @staticmethod
    def _count(plan: _Plan, precisions: Counter, ranks: Counter, skipped: Counter) -> None:
        if plan.calls:
            precisions[plan.dtype] += plan.calls
            ranks["full" if plan.rank is None else f"low-rank {plan.rank}"] += plan.calls
            if plan.skipped:
                skipped[plan.skipped] += plan.calls

    def _retire_all(self) -> None:
        for call in list(self.__dict__.get("_plans", ())):
            self._retire(call)

    def __setattr__(self, name: str, value) -> None:
        if name in POLICY_ATTRS:
            self._retire_all()  # before the change: the counts go to the policy that made the plans
            if name in RANK_POLICY_ATTRS and "_rank_choice" in self.__dict__:
                self.__dict__["_rank_choice"] = {}  # the rank policy's choices were made under the old value
        super().__setattr__(name, value)

    def _apply(self, fn, *args, **kwargs):
        self._retire_all()  # .to(), .half(), .cuda(): the plans were made for the parameters' device and dtype
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # copies and pickles start without plans (they hold the manager and backends)
        self._retire_all()
        return super().__getstate__()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self.__dict__["_plans"] = {}  # its own (a shallow copy's state holds the original's)
        _untrack_when_gone(self)

    def _weights(self, q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
        """Attention probabilities averaged over heads (B, L, S), as nn.MultiheadAttention returns them."""
        return attention_probs(q.float(), k.float(), mask, causal, scale).mean(1).to(q.dtype)

    def get_statistics(self) -> dict:
        stats = self.manager.get_statistics()
        precisions, ranks, skipped = Counter(self._precisions), Counter(self._ranks), Counter(self._low_rank_skipped)
        for plan in self._plans.values():
            self._count(plan, precisions, ranks, skipped)
        stats.update(precisions={str(d).removeprefix("torch."): n for d, n in precisions.items()},
                     escalations=list(self.precision.escalations),
                     ranks=dict(ranks), low_rank_skipped=dict(skipped))
        return stats


# The guide's other names (AdaptiveFlashAttention with FlashAttentionConfig, fused_scaled_dot_product_attention,
# memory_efficient_attention, CUDAManager): ``flash_attention.py``.
