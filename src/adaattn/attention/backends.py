"""The attention backends the kernel manager (``kernel_manager.py``) ranks, and the signature it ranks them for.

Backends (q (B, Hq, L, D), k and v (B, Hkv, S, D); GQA without copies where the backend allows):
flash-attn (if installed), each SDPA backend forced (flash, efficient, cuDNN, math), SDPA's own
choice, FlexAttention (CUDA only: each new shape compiles), xFormers, chunked, and math
(matmul-softmax-matmul). Mask kinds: "none", "causal", "mask" (a bool or additive mask, e.g.
padding); a backend that cannot express a mask kind is not a candidate for it (``Backend.why_not``).
A new backend is a ``run`` function and one entry in ``BACKENDS``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from adaattn.attention.chunked import chunked_attention
from adaattn.attention.hardware import HardwareCapabilities
from adaattn.attention.providers import PROVIDERS
from adaattn.attention.flexible import _expand_kv
from adaattn.names import BACKENDS as BACKEND_NAMES
from adaattn.names import check_registry

MASK_KINDS = ("none", "causal", "mask")


@dataclass(frozen=True)
class Signature:
    device: str  # "cpu" | "cuda"
    hardware: str  # the device's name: a persisted ranking applies to the machine that measured it
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    q_len: int  # rounded up to a power of two (the bucket)
    k_len: int
    mask: str  # one of MASK_KINDS
    grad: bool
    square: bool  # the exact query and key lengths are equal (causal alignment differs between libraries otherwise)

    def key(self) -> str:
        return "|".join(str(v) for v in (self.device, self.hardware, self.dtype, self.batch, self.heads, self.kv_heads, self.head_dim,
                                          self.q_len, self.k_len, self.mask, int(self.grad), int(self.square)))

    @staticmethod
    def from_key(key: str) -> Signature:
        """The signature ``key()`` wrote (results and caches keep keys)."""
        f = key.split("|")
        if len(f) != 12:
            raise ValueError(f"not a signature key (12 fields joined by '|'): {key!r}")
        return Signature(f[0], f[1], f[2], *map(int, f[3:9]), f[9], f[10] == "1", f[11] == "1")

    @staticmethod
    def of(q: Tensor, k: Tensor, mask: str) -> Signature:
        """The signature of a call on q (B, Hq, L, D) and k (B, Hkv, S, D)."""
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        return Signature.make(q.device.type, q.device.index, q.dtype, tuple(q.shape), tuple(k.shape), mask, grad)

    @staticmethod
    def make(device_type: str, index: int | None, dtype: torch.dtype, q_shape: Sequence[int],
             k_shape: Sequence[int], mask: str, grad: bool, square: bool | None = None) -> Signature:
        """``square``: whether the exact lengths are equal, where the shapes are buckets (a compiled plan's key);
        None: the shapes' own lengths are compared."""
        if mask not in MASK_KINDS:
            raise ValueError(f"mask kind {mask!r} is not one of: {', '.join(MASK_KINDS)}")
        (B, H, L, D), (Hkv, S) = (int(n) for n in q_shape), (int(k_shape[1]), int(k_shape[2]))
        return Signature(device_type, device_name(device_type, index), str(dtype).removeprefix("torch."), B, H, Hkv, D,
                         bucket(L), bucket(S), mask, grad, L == S if square is None else bool(square))


@torch.compiler.assume_constant_result  # a constant of the compiled graph: read once, never traced
def device_name(device_type: str, index: int | None) -> str:
    """The name of the device a signature's ranking was measured on."""
    return HardwareCapabilities.detect(device_type if index is None else f"{device_type}:{index}").name


def bucket(n) -> int:
    """``n`` rounded up to a power of two, by comparisons: under ``torch.compile`` a dynamic size is guarded to its
    bucket's range, not to its value (one graph serves every length of a bucket; a plan is per bucket, as the
    policies' signatures are)."""
    b = 1
    while n > b:
        b *= 2
    return b


# A backend: run(q, k, v, attn_mask, is_causal, scale) and why_not(signature) -> reason or None.
Run = Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, float | None], Tensor]


@dataclass(frozen=True)
class Backend:
    name: str
    run: Run
    why_not: Callable[[Signature], str | None]
    traceable: bool = True  # torch.compile traces it without a graph break


def sdpa_path(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float,
              dropout_p: float = 0.0) -> Tensor:
    """SDPA's own dispatch (the ``sdpa`` backend), and with dropout the path without the manager (whose backends
    take none); GQA by ``enable_gqa``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          dropout_p=dropout_p, enable_gqa=q.shape[1] != k.shape[1])


# SDPA's backend flags, as ``sdpa_kernel`` names them (torch._C._get_<name>_sdp_enabled, _set_sdp_use_<name>)
SDP_FLAGS = tuple(n for n in ("flash", "mem_efficient", "cudnn", "math", "overrideable")
                  if hasattr(torch._C, f"_get_{n}_sdp_enabled") and hasattr(torch._C, f"_set_sdp_use_{n}"))
_FLAG_OF = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "mem_efficient", "CUDNN_ATTENTION": "cudnn",
            "MATH": "math"}
FORCED = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
          "sdpa_math": "MATH"}  # the forced SDPA backends and the SDPBackend each forces


def _sdpa_forced(backend: str) -> Run:
    """SDPA with only ``backend`` enabled, as under ``sdpa_kernel([backend])`` (SDPA raises rather than fall
    back to another backend). Eager, the call sets the SDPA flags that differ and restores them after:
    ``sdpa_kernel`` costs tens of us of host time per call (docs/notebook.md). Like ``sdpa_kernel`` the
    flags are global. Under torch.compile the call enters ``sdpa_kernel``, which dynamo traces."""
    flags = tuple((getattr(torch._C, f"_get_{n}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{n}"),
                   n == _FLAG_OF[backend]) for n in SDP_FLAGS)

    def run(q, k, v, attn_mask, is_causal, scale):
        if _compiling():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, backend)]):
                return sdpa_path(q, k, v, attn_mask, is_causal, scale)
        changed = [(put, on) for get, put, on in flags if get() is not on]
        for put, on in changed:
            put(on)
        try:
            return sdpa_path(q, k, v, attn_mask, is_causal, scale)
        finally:
            for put, on in changed:
                put(not on)

    return run


_compiling = torch.compiler.is_compiling


def traced_name(name: str, q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool,
                scale: float | None) -> str:
    """The backend a compiled call emits for ``name`` on inputs like these: ``sdpa`` for a forced SDPA backend whose
    kernel SDPA's own dispatch picks anyway (the same kernel without ``sdpa_kernel``, which dynamo keeps as flags and
    guards around the graph: host time on every compiled call, docs/notebook.md), else ``name``."""
    forced = FORCED.get(name)
    if forced is not None:
        from torch.nn.attention import SDPBackend

        picked = torch._fused_sdp_choice(q, k, k, attn_mask, 0.0, is_causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
        if picked == int(getattr(SDPBackend, forced)):
            return "sdpa"
    return name


def attention_probs(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool,
                    scale: float | None) -> Tensor:
    """softmax(q k^T * scale + mask) in fp32, (B, Hq, L, S); SDPA's mask conventions, GQA by
    expanding kv heads; a row with no allowed key is zeros."""
    k = _expand_kv(k, q.shape[1] // k.shape[1])
    scores = (q @ k.transpose(-2, -1)).float() * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril_()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.float()
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)


def _math(q, k, v, attn_mask, is_causal, scale):
    """matmul, softmax (fp32), matmul: any device, dtype and mask."""
    return attention_probs(q, k, attn_mask, is_causal, scale).to(v.dtype) @ _expand_kv(v, q.shape[1] // v.shape[1])


def _chunked(q, k, v, attn_mask, is_causal, scale):
    return chunked_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _flash_attn(q, k, v, attn_mask, is_causal, scale):
    from flash_attn import flash_attn_func

    return flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=is_causal, softmax_scale=scale).transpose(1, 2)


def _xformers(q, k, v, attn_mask, is_causal, scale):
    import xformers.ops as xops

    g = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, g), _expand_kv(v, g)
    bias = xops.LowerTriangularMask() if is_causal else None
    return xops.memory_efficient_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_bias=bias,
                                           scale=scale).transpose(1, 2)


@functools.lru_cache(maxsize=64)
def _flex_block(q_len: int, k_len: int, causal: bool, device: str):
    """Built once per shape (with block_mask=None flex_attention builds a full mask inside every call)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from adaattn.attention.providers import _causal_mask, _full_mask

    return create_block_mask(_causal_mask if causal else _full_mask, None, None, q_len, k_len, device=device)


def _flex(q, k, v, attn_mask, is_causal, scale):
    from adaattn.attention.providers import _flex_compiled

    block = _flex_block(q.shape[2], k.shape[2], is_causal, str(q.device))
    return _flex_compiled()(q, k, v, block_mask=block, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _needs(*, cuda: bool = False, half: bool = False, half_on_cuda: bool = False, masks: tuple[str, ...] = MASK_KINDS, max_head_dim: int = 0,
           provider: str | None = None, equal_lengths: bool = False) -> Callable[[Signature], str | None]:
    def why_not(sig: Signature) -> str | None:
        if cuda and sig.device != "cuda":
            return "needs CUDA tensors"
        if (half or (half_on_cuda and sig.device == "cuda")) and sig.dtype not in ("float16", "bfloat16"):
            return f"needs fp16 or bf16, got {sig.dtype}"
        if sig.mask not in masks:
            return f"cannot take mask kind {sig.mask!r} (takes {', '.join(masks)})"
        if max_head_dim and sig.head_dim > max_head_dim:
            return f"head dim {sig.head_dim} > {max_head_dim}"
        if equal_lengths and sig.mask == "causal" and not sig.square:
            return "causal with different query and key lengths aligns differently from SDPA"
        if provider is not None:
            return PROVIDERS[provider].unavailable("cuda")
        return None

    return why_not


BACKENDS: dict[str, Backend] = {b.name: b for b in [
    Backend("flash_attn", _flash_attn, _needs(cuda=True, half=True, masks=("none", "causal"), max_head_dim=256,
                                              provider="flash_attn", equal_lengths=True)),
    Backend("sdpa_flash", _sdpa_forced(FORCED["sdpa_flash"]), _needs(masks=("none", "causal"), max_head_dim=256,
                                                                  half_on_cuda=True)),
    Backend("sdpa_cudnn", _sdpa_forced(FORCED["sdpa_cudnn"]), _needs(cuda=True, half=True, masks=("none", "causal"),
                                                                  max_head_dim=128)),
    Backend("sdpa_efficient", _sdpa_forced(FORCED["sdpa_efficient"]), _needs(cuda=True)),
    Backend("sdpa", sdpa_path, _needs()),
    Backend("sdpa_math", _sdpa_forced(FORCED["sdpa_math"]), _needs()),
    # flex builds its block mask and compiles per shape outside a graph; xFormers is an opaque extension call
    Backend("flex", _flex, _needs(cuda=True, masks=("none", "causal"), provider="flex"), traceable=False),
    Backend("xformers", _xformers, _needs(cuda=True, masks=("none", "causal"), provider="xformers_cutlass"),
            traceable=False),
    Backend("chunked", _chunked, _needs()),
    Backend("math", _math, _needs()),
]}
check_registry(BACKENDS, BACKEND_NAMES, "kernel manager backend")  # params.yaml's names (adaattn.names)
FLASH_LIKE = frozenset({"flash_attn", "sdpa_flash", "sdpa_cudnn", "flex", "xformers", "sdpa_efficient"})


def workload(run: Run, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
             scale: float | None, grad: bool) -> Callable[[], object]:
    """One call of ``run`` as the signature makes it: the forward, or for a training signature forward and
    backward (gradients of the inputs that need them, of a fixed output gradient; nothing accumulates)."""
    if not grad:
        def forward():
            with torch.no_grad():
                return run(q, k, v, attn_mask, is_causal, scale)

        return forward
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
    wrt = [t for t in leaves if t.requires_grad]
    grad_out: list[Tensor] = []

    def forward_backward():
        with torch.enable_grad():
            out = run(*leaves, attn_mask, is_causal, scale)
            if not grad_out:
                grad_out.append(torch.randn_like(out))
            return torch.autograd.grad(out, wrt, grad_out[0])

    return forward_backward
