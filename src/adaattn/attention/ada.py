"""AdaAttention: a drop-in for ``nn.MultiheadAttention`` with a measured backend choice, adaptive
precision and adaptive rank, that compiles whole (``torch.compile(fullgraph=True)``, CUDA graphs).

Its call, defaults, masks and ``state_dict`` are ``nn.MultiheadAttention``'s (batched or unbatched inputs; a
bool mask marks positions that may NOT be attended; with equal embedding sizes and as many kv heads as heads
its parameters are MHA's). ``num_kv_heads`` < ``num_heads`` is GQA; ``is_causal=True`` needs no mask.

Three policies decide per input signature (shapes, dtype, mask kind, grad mode): the compute dtype
(``precision.py``), the exact path or a low-rank one (``rank.py``) and the exact path's backend (the kernel
manager). They decide on an eager call, or ahead of time with ``tune``. Under ``torch.compile`` the module
reads the decisions and emits only the chosen path (no measurement, host sync or data-dependent branch); a
signature traced before any decision runs the hardware's defaults and is listed in
``get_statistics()["untuned"]`` with each policy that had not decided. With ``need_weights`` attention runs
as matmul, softmax, matmul, as MHA's does.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaattn.attention.args import check_heads, check_policy
from adaattn.attention.backends import BACKENDS, Signature, attention_probs, bucket, sdpa_path, traced_name
from adaattn.attention.hardware import HardwareCapabilities
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.masks import merge_masks
from adaattn.attention.precision import FP8, PrecisionPolicy, traced_dtype
from adaattn.attention.rank import (LOW_RANK_METHODS, LowRank, choose_rank, low_rank_attention, low_rank_speed,
                                    skip_reason)
from adaattn.attention.flexible import _expand_kv

ENV_CACHE = "ADAATTN_KERNEL_CACHE"  # JSON file of the shared manager's rankings (``adaattn tune`` fills it)
MASKED = "masked or causal: the low-rank path has no mask"  # why a call of rank_mode auto or int went exact
# what the rank policy's choices and the plans were made under: setting one drops them
POLICY_ATTRS = frozenset({"rank_mode", "low_rank_method", "rank_sample_rows", "min_low_rank_len", "max_rank_error",
                          "enable_gpu_optimization"})
_shared: AttentionKernelManager | None = None
_compiling = torch.compiler.is_compiling


def shared_kernel_manager() -> AttentionKernelManager:
    """One manager for every AdaAttention that is not given its own: layers share measurements."""
    global _shared
    if _shared is None:
        _shared = AttentionKernelManager(cache_path=os.environ.get(ENV_CACHE) or None)
    return _shared


def plan_key(q: Tensor, k: Tensor, mask_kind: str, grad: bool) -> tuple:
    """What a plan is filed under: the signature's fields (lengths bucketed; whether they are equal), eager and
    compiled alike."""
    (B, H, L, D), (Hkv, S) = q.shape, k.shape[1:3]
    square = True if L == S else False  # a branch: a guard and a constant (bool() of a dynamic size's test is not)
    return q.device, q.dtype, B, H, bucket(L), D, B, Hkv, bucket(S), D, mask_kind, grad, square


def _fp8_run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    """The exact path where the precision policy chose FP8 (bf16 in and out; never with a mask)."""
    from adaattn.kernels.fp8_attention import fp8_attention

    return fp8_attention(q, k, v, causal, scale)


def _run(backend: str | None):
    """A plan's exact path: None for SDPA's own call (a function in a plan costs a compiled call guards on its code
    and defaults), the FP8 attention ("fp8"), else the backend's run."""
    if backend == "fp8":
        return _fp8_run
    return None if backend in (None, "sdpa") else BACKENDS[backend].run


class AdaAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 kdim: int | None = None, vdim: int | None = None, batch_first: bool = False,
                 num_kv_heads: int | None = None, enable_gpu_optimization: bool = True,
                 precision_mode: str = "auto", rank_mode: str | int = "auto", low_rank_method: str = "auto",
                 rank_sample_rows: int = 64, min_low_rank_len: int = 1024, max_rank_error: float = 0.05,
                 kernel_manager: AttentionKernelManager | None = None, device=None, dtype=None,
                 fp8_max_rel_l2: float = 0.03):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_heads(embed_dim, num_heads, num_kv_heads)
        check_policy(precision_mode, rank_mode, low_rank_method, dropout)
        if not max_rank_error > 0:
            raise ValueError(f"max_rank_error must be > 0; got {max_rank_error}")
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
        self.precision = PrecisionPolicy(precision_mode, fp8_max_rel_l2=fp8_max_rel_l2)
        self.rank_mode, self.low_rank_method = rank_mode, low_rank_method  # "auto": every path, cheaper first
        self.rank_sample_rows, self.min_low_rank_len, self.max_rank_error = rank_sample_rows, min_low_rank_len, \
            max_rank_error
        self.kernel_manager = kernel_manager
        self._rank_choice: dict[str, LowRank | None] = {}  # signature -> low-rank path (None: exact)
        self._ranks: Counter[str] = Counter()  # eager calls per path
        self._precisions: Counter[torch.dtype] = Counter()  # eager calls per compute dtype
        self._low_rank_skipped: Counter[str] = Counter()
        self._untuned: set[str] = set()  # signatures traced without a precision or rank decision
        # signature -> (compute dtype, low-rank path or None, the manager's signature or None): eager decisions
        self._decided: dict[str, tuple] = {}
        # (device, dtype, q shape, k shape, mask kind, grad) -> (compute dtype, low-rank path or None, the exact path's
        # run, None for SDPA's own): all a compiled call reads (a key of constants: no function call to guard)
        self._plans: dict[tuple, tuple] = {}
        self._reset_parameters()

    def _reset_parameters(self) -> None:  # as nn.MultiheadAttention
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def __setattr__(self, name: str, value) -> None:
        if name in POLICY_ATTRS and "_rank_choice" in self.__dict__:
            self.__dict__["_rank_choice"] = {}  # made under the old value (a compiled call retraces)
            self.__dict__["_plans"], self.__dict__["_decided"] = {}, {}
        super().__setattr__(name, value)

    @property
    def manager(self) -> AttentionKernelManager:
        return self.kernel_manager or shared_kernel_manager()

    # ------------------------------------------------------------------ forward

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        unbatched = query.dim() == 2
        if unbatched:  # (L, E): a batch of one, as nn.MultiheadAttention
            if key.dim() != 2 or value.dim() != 2:
                raise ValueError(f"unbatched query (L, E) needs unbatched key and value (S, E); got {key.dim()}-D, "
                                 f"{value.dim()}-D")
            b = 0 if self.batch_first else 1
            query, key, value = query.unsqueeze(b), key.unsqueeze(b), value.unsqueeze(b)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0).flatten(0, 1)  # (heads, L, S) = (1 * heads, L, S)
        elif query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(f"query, key and value must be 3-D (batched) or 2-D (unbatched); got {query.dim()}, "
                             f"{key.dim()}, {value.dim()} dims")
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, E = query.shape
        S = key.shape[1]
        # packed weights: kdim == vdim == embed_dim (one attribute read fewer each: dynamo guards every read)
        kdim, vdim = (self.embed_dim,) * 2 if self._packed else (self.kdim, self.vdim)
        # size by size: dynamo (torch 2.11) traces a tuple comparison through polyfills it guards on every call
        if E != self.embed_dim or key.shape[2] != kdim or value.shape[2] != vdim or key.shape[0] != B \
                or value.shape[0] != B or value.shape[1] != S:
            raise ValueError(f"expected query (B, L, {self.embed_dim}), key (B, S, {kdim}), value (B, S, {vdim}); "
                             f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        try:
            q, k, v = self._project(query, key, value)
        except RuntimeError as err:  # told apart here, not checked before: a call that projects pays nothing
            dtype = self.out_proj.weight.dtype
            if {query.dtype, key.dtype, value.dtype} != {dtype}:
                raise ValueError(f"query, key and value must have the module's dtype {dtype} (outside autocast); got "
                                 f"{query.dtype}, {key.dtype}, {value.dtype}: cast them, or the module with "
                                 f".to(dtype)") from err
            raise
        mask, causal = (None, is_causal) if attn_mask is None and key_padding_mask is None else \
            merge_masks(attn_mask, key_padding_mask, is_causal, B, self.num_heads, L, S, q.device)
        scale = self.head_dim ** -0.5
        weights = None
        if need_weights:
            out, weights = self._with_weights(q, k, v, mask, causal, scale, average_attn_weights)
        else:
            out = self._attend(q, k, v, mask, causal, scale)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, E))  # (B, heads, L, D) -> (B, L, E)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(0 if self.batch_first else 1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, heads, L, D) q and (B, kv heads, S, D) k, v; self-attention with packed weights is one GEMM."""
        B, L = query.shape[:2]
        if self._packed and query is key and key is value:
            qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias).view(B, L, 3, self.num_heads, self.head_dim)
            return qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, heads, L, D)
        E, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:E + kv], b[E + kv:])
        if self._packed:
            w = self.in_proj_weight
            wq, wk, wv = w[:E], w[E:E + kv], w[E + kv:]
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        S = key.shape[1]
        q = F.linear(query, wq, bq).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = F.linear(key, wk, bk).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = F.linear(value, wv, bv).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
        """Attention of (B, heads, L, D) q over (B, kv heads, S, D) k, v through the policies' choices, returned in
        the projections' dtype. Eager, the policies decide and file the signature's plan; compiled, the plan is
        read (one dict lookup: dynamo guards each attribute a trace reads, and guards cost host time per call),
        else the defaults (``_default_plan``)."""
        in_dtype, mask_kind = q.dtype, "causal" if causal else "none" if mask is None else "mask"
        if _compiling():
            key = plan_key(q, k, mask_kind, q.requires_grad or k.requires_grad)  # False under no_grad
            plan = self._plans.get(key)
            if plan is None:
                name, low, backend = self._default_plan(key)
                plan = getattr(torch, name), low and LowRank(*low), _run(backend)
            dtype, rank, run = plan
            if q.dtype != dtype:
                q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            if rank is not None:
                out = low_rank_attention(q, k, v, rank, scale=scale)
            elif run is not None and not (self.dropout and self.training):  # the manager's backends take no dropout
                out = run(q, k, v, mask, causal, scale)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                     dropout_p=self.dropout if self.dropout and self.training else 0.0,
                                                     enable_gqa=q.shape[1] != k.shape[1])  # sdpa_path, inline
            return out if out.dtype == in_dtype else out.to(in_dtype)
        key = plan_key(q, k, mask_kind, q.requires_grad or k.requires_grad)
        signature = Signature.of(q, k, mask_kind)
        sig = signature.key()
        dtype = q.dtype  # without the optimisation, the inputs'; else the precision policy's (its guards read them)
        if self.enable_gpu_optimization or self.precision.mode != "auto":
            self._untuned.discard(f"{sig}: precision")
            dtype = self.precision.choose(q, k, v, scale, HardwareCapabilities.detect(q.device), sig, mask_kind,
                                          bool(self.dropout and self.training))
        chosen, dtype = dtype, torch.bfloat16 if dtype == FP8 else dtype  # FP8: bf16 in and out
        if q.dtype != dtype:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            signature = Signature.of(q, k, mask_kind)  # the manager's: in the compute dtype
        rank = self._rank(sig, q, k, v, mask_kind, scale)
        self._precisions[chosen if rank is None else dtype] += 1
        self._ranks["full" if rank is None else f"low-rank {rank}"] += 1
        run = exact = None
        if rank is not None:
            out = low_rank_attention(q, k, v, rank, scale=scale)
        elif chosen == FP8:
            run = _run("fp8")
            out = run(q, k, v, mask, causal, scale)
        elif self._through_manager():
            exact = signature.key()
            out, name = self.manager(q, k, v, mask, causal, scale, sig=signature)
            traced = name if BACKENDS[name].traceable else self.manager.traced_backend(signature)
            run = _run(traced_name(traced, q, k, mask, causal, scale))
        else:
            out = sdpa_path(q, k, v, mask, causal, scale, self.dropout if self.training else 0.0)
        self._plans[key], self._decided[sig] = (dtype, rank, run), (chosen if rank is None else dtype, rank, exact)
        return out if out.dtype == in_dtype else out.to(in_dtype)  # the output projection's dtype

    @torch.compiler.assume_constant_result  # made while tracing, a constant of the graph: no guard on the state read
    def _default_plan(self, key: tuple) -> tuple[str, tuple | None, str | None]:
        """A compiled call's plan for a ``_plans`` key no eager call decided, by name: the last decisions the policies
        made for its signature, else the hardware's defaults; each policy without a decision is listed in
        ``_untuned``."""
        device, dtype, q_shape, k_shape, mask_kind, grad, square = key[0], key[1], key[2:6], key[6:10], *key[10:]
        sig = Signature.make(device.type, device.index, dtype, q_shape, k_shape, mask_kind, grad, square).key()
        decided = self.precision.decided(sig)
        if decided == FP8:  # the guard accepted FP8 for this signature
            _, rank = self._rank_without_data(sig, mask_kind)
            return "bfloat16", rank and tuple(rank), None if rank else "fp8"
        if decided is not None:
            dtype = decided
        elif self.enable_gpu_optimization or self.precision.mode != "auto":
            dtype = traced_dtype(self.precision.mode, device.type, device.index)
            if (self.precision.mode == "auto" and dtype != torch.float32 and self.enable_gpu_optimization) \
                    or self.precision.mode == "fp8":
                self._untuned.add(f"{sig}: precision")  # a reduced dtype its guards never checked (fp8: bf16)
        decided, rank = self._rank_without_data(sig, mask_kind)
        if not decided:
            self._untuned.add(f"{sig}: rank")
        if not self.enable_gpu_optimization:
            return str(dtype).removeprefix("torch."), rank and tuple(rank), None
        backend = self.manager.traced_backend(Signature.make(device.type, device.index, dtype, q_shape, k_shape,
                                                             mask_kind, grad, square))
        if mask_kind != "mask":  # SDPA's choice, asked on empty inputs in the projections' layout (a mask: no shape)
            q, k = (torch.empty(b, n, h, d, dtype=dtype, device=device).transpose(1, 2)
                    for b, h, n, d in (q_shape, k_shape))
            backend = traced_name(backend, q, k, None, mask_kind == "causal", q_shape[3] ** -0.5)
        return str(dtype).removeprefix("torch."), rank and tuple(rank), backend

    def _with_weights(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
                      average: bool) -> tuple[Tensor, Tensor]:
        """Attention and its probabilities (B, L, S) averaged over heads, or (B, heads, L, S), in q's dtype:
        matmul, softmax in fp32 (dropout on the probabilities in training), matmul."""
        p = attention_probs(q, k, mask, causal, scale)  # (B, heads, L, S)
        drop = F.dropout(p, self.dropout) if self.training and self.dropout else p
        out = drop.to(v.dtype) @ _expand_kv(v, self.num_heads // self.num_kv_heads)
        p = p.to(q.dtype)
        return out, (p.mean(1) if average else p)

    def _through_manager(self) -> bool:
        return self.enable_gpu_optimization and not (self.dropout and self.training)  # its backends take no dropout

    def _rank_without_data(self, sig: str, mask_kind: str) -> tuple[bool, LowRank | None]:
        """(decided, the path: None for exact) where no data is needed: rank full, a mask, a fixed rank, or the
        signature's earlier choice."""
        if self.rank_mode == "full" or mask_kind != "none":
            return True, None
        if isinstance(self.rank_mode, int):
            return True, LowRank("nystrom" if self.low_rank_method == "auto" else self.low_rank_method, self.rank_mode)
        return sig in self._rank_choice, self._rank_choice.get(sig)

    def _rank(self, sig: str, q: Tensor, k: Tensor, v: Tensor, mask_kind: str, scale: float) -> LowRank | None:
        """The low-rank path and its landmarks for this call, or None for the exact path: the policy's check on
        sampled rows, once per signature."""
        if self.rank_mode != "full" and mask_kind != "none":
            self._low_rank_skipped[MASKED] += 1
        decided, r = self._rank_without_data(sig, mask_kind)
        if decided:
            return r
        self._untuned.discard(f"{sig}: rank")
        methods = LOW_RANK_METHODS if self.low_rank_method == "auto" else (self.low_rank_method,)
        r, seen = choose_rank(q, k, v, sample=self.rank_sample_rows, min_len=self.min_low_rank_len,
                              max_rel_error=self.max_rank_error, methods=methods, scale=scale,
                              speed=lambda choice: low_rank_speed(self.manager, self._through_manager(), q, k, v,
                                                                  scale, choice))
        if seen["estimate"] is not None:
            self._ranks[f"estimated {seen['estimate']}"] += 1
        why = skip_reason(r, seen, self.max_rank_error)
        if why:
            self._low_rank_skipped[why] += 1
        self._rank_choice[sig] = r
        return r

    # ------------------------------------------------------------------ tuning and statistics

    def tune(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
             key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
             grad: bool | None = None) -> dict:
        """Decide every policy for the signature of this call, ahead of a compiled run: an eager call without
        weights on these inputs (``key`` and ``value`` default to ``query``: self-attention), under
        ``torch.no_grad`` (inference, ``grad=False``), with gradients (training, ``grad=True``) or both
        (None). Returns ``decisions()``."""
        if not isinstance(query, Tensor) or not all(t is None or isinstance(t, Tensor) for t in (key, value)):
            raise TypeError("tune takes tensors: query, and optionally key and value (self-attention without them)")
        if grad not in (None, True, False):
            raise ValueError(f"grad must be True, False or None (both); got {grad!r}")
        if _compiling():
            raise RuntimeError("tune runs eagerly, before torch.compile traces the module")
        key = query if key is None else key
        value = key if value is None else value
        for g in ((False, True) if grad is None else (grad,)):
            with torch.enable_grad() if g else torch.no_grad():
                self(query, key, value, key_padding_mask=key_padding_mask, need_weights=False, attn_mask=attn_mask,
                     is_causal=is_causal)
        return self.decisions()

    def decisions(self) -> dict[str, dict]:
        """Per signature an eager call decided: the compute dtype (``float8_e4m3fn``: the FP8 attention), the path
        (exact or low-rank), where the manager ranked the exact path its backends fastest first, and in precision
        mode "fp8" the FP8 guard's check (``fp8_guard``: accepted, estimate, bound, reason)."""
        out: dict[str, dict] = {}
        for sig, (dtype, rank, exact) in self._decided.items():
            out[sig] = {"dtype": str(dtype).removeprefix("torch."), "path": "exact" if rank is None else str(rank)}
            if exact is not None and exact in self.manager.rankings:
                out[sig]["backends"] = self.manager.rankings[exact]
            if sig in self.precision.fp8_checks:
                out[sig]["fp8_guard"] = self.precision.fp8_checks[sig]
        return out

    def get_statistics(self) -> dict:
        """The manager's (calls per backend, rankings' cost, stale and untuned signatures) and this module's:
        eager calls per compute dtype and path, escalations, why a low-rank path was skipped, and what ran a
        traced default (``untuned``: signatures and the policy without a decision)."""
        stats = self.manager.get_statistics()
        stats.update(precisions={str(d).removeprefix("torch."): n for d, n in self._precisions.items()},
                     escalations=list(self.precision.escalations), ranks=dict(self._ranks),
                     low_rank_skipped=dict(self._low_rank_skipped), fp8_guard=dict(self.precision.fp8_checks),
                     untuned=sorted({*self._untuned, *(f"{s}: backend" for s in stats["untuned"])}))
        return stats


# The guide's other names (AdaptiveFlashAttention with FlashAttentionConfig, fused_scaled_dot_product_attention,
# memory_efficient_attention, CUDAManager): ``flash_attention.py``.
