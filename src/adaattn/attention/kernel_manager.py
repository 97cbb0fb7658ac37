"""AttentionKernelManager: the fastest attention backend that is correct for the inputs, by measurement.

For each signature (hardware, dtype, batch, heads, kv heads, head dim, query and key lengths
rounded up to a power of two, mask kind, grad mode) the manager times the forward of every
backend that can run those inputs, once, on the inputs of the first call, and keeps the ranking
(in memory and, with a ``cache_path``, in a JSON file written atomically, so the next process
does not measure again; a file written under another torch version is ignored). Training
signatures are ranked apart from inference ones but, like them, by forward time: a backend
with a slow backward can win a training signature (a limitation, to be measured by the scaling
study).
Calls then go to the fastest. A backend that fails on a call falls back to the next one of the
ranking; the reason is logged once per (backend, reason) and counted in ``get_statistics()``.

Backends (q (B, Hq, L, D), k and v (B, Hkv, S, D); GQA without copies where the backend allows):
flash-attn (if installed), each SDPA backend forced (flash, efficient, cuDNN, math), SDPA's own
choice, FlexAttention (CUDA only: each new shape compiles), xFormers, chunked, and math
(matmul-softmax-matmul). Mask kinds: "none", "causal", "mask" (a bool or additive mask, e.g.
padding); a backend that cannot express a mask kind is not a candidate for it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from adaattn.attention.chunked import chunked_attention
from adaattn.attention.hardware import HardwareCapabilities
from adaattn.attention.providers import PROVIDERS
from adaattn.layers.attention import _expand_kv

log = logging.getLogger(__name__)

MASK_KINDS = ("none", "causal", "mask")
HALF = (torch.float16, torch.bfloat16)


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
        return self._key

    @functools.cached_property
    def _key(self) -> str:  # once per signature: Signature.of returns cached instances
        return "|".join(str(v) for v in (self.device, self.hardware, self.dtype, self.batch, self.heads, self.kv_heads, self.head_dim,
                                          self.q_len, self.k_len, self.mask, int(self.grad), int(self.square)))

    @staticmethod
    def of(q: Tensor, k: Tensor, mask: str) -> Signature:
        if mask not in MASK_KINDS:
            raise ValueError(f"mask kind {mask!r} is not one of: {', '.join(MASK_KINDS)}")
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        return _signature(q.device, q.dtype, tuple(q.shape), tuple(k.shape), mask, grad)


@functools.lru_cache(maxsize=1024)
def _signature(device: torch.device, dtype: torch.dtype, q_shape: tuple[int, ...], k_shape: tuple[int, ...], mask: str,
               grad: bool) -> Signature:
    """Built once per distinct call (a hot path: every AdaAttention call needs one)."""
    return Signature(device.type, HardwareCapabilities.detect(device).name, str(dtype).removeprefix("torch."),
                     q_shape[0], q_shape[1], k_shape[1], q_shape[3], _bucket(q_shape[2]), _bucket(k_shape[2]), mask,
                     grad, q_shape[2] == k_shape[2])


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# A backend: run(q, k, v, attn_mask, is_causal, scale) and why_not(signature) -> reason or None.
Run = Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, float | None], Tensor]


@dataclass(frozen=True)
class Backend:
    name: str
    run: Run
    why_not: Callable[[Signature], str | None]


def _sdpa(q, k, v, attn_mask, is_causal, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _sdpa_forced(backend: str) -> Run:
    def run(q, k, v, attn_mask, is_causal, scale):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return _sdpa(q, k, v, attn_mask, is_causal, scale)

    return run


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
    Backend("sdpa_flash", _sdpa_forced("FLASH_ATTENTION"), _needs(masks=("none", "causal"), max_head_dim=256,
                                                                  half_on_cuda=True)),
    Backend("sdpa_cudnn", _sdpa_forced("CUDNN_ATTENTION"), _needs(cuda=True, half=True, masks=("none", "causal"),
                                                                  max_head_dim=128)),
    Backend("sdpa_efficient", _sdpa_forced("EFFICIENT_ATTENTION"), _needs(cuda=True)),
    Backend("sdpa", _sdpa, _needs()),
    Backend("sdpa_math", _sdpa_forced("MATH"), _needs()),
    Backend("flex", _flex, _needs(cuda=True, masks=("none", "causal"), provider="flex")),
    Backend("xformers", _xformers, _needs(cuda=True, masks=("none", "causal"), provider="xformers_cutlass")),
    Backend("chunked", _chunked, _needs()),
    Backend("math", _math, _needs()),
]}
FLASH_LIKE = frozenset({"flash_attn", "sdpa_flash", "sdpa_cudnn", "flex", "xformers", "sdpa_efficient"})


def _reason(err: BaseException) -> str:
    first = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {first}"


class AttentionKernelManager:
    """Picks, per signature, the fastest backend measured on this machine; falls back down its ranking."""

    def __init__(self, backends: list[str] | None = None, cache_path: str | os.PathLike | None = None,
                 warmup: int = 1, repeats: int = 3):
        names = list(BACKENDS) if backends is None else list(backends)
        unknown = [n for n in names if n not in BACKENDS]
        if unknown or not names:
            raise ValueError(f"unknown attention backend(s) {unknown or names}; allowed: {', '.join(BACKENDS)}")
        if warmup < 0 or repeats < 1:
            raise ValueError(f"warmup >= 0 and repeats >= 1 required; got {warmup}, {repeats}")
        self.backends = names
        self.warmup, self.repeats = warmup, repeats
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.rankings: dict[str, list[str]] = self._load()
        self.calls: Counter[str] = Counter()
        self.fallbacks: Counter[tuple[str, str]] = Counter()  # (backend, reason)
        self.disabled: set[str] = set()  # backends made unavailable for this manager (tests, user choice)

    # ------------------------------------------------------------------ persistence

    def _load(self) -> dict[str, list[str]]:
        if self.cache_path is None or not self.cache_path.exists():
            return {}
        try:
            data = json.loads(self.cache_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            log.warning("ignoring unreadable kernel choice cache %s: %s", self.cache_path, err)
            return {}
        if data.get("torch") != torch.__version__:
            log.warning("ignoring kernel choice cache %s: measured under torch %s, this is %s", self.cache_path,
                        data.get("torch"), torch.__version__)
            return {}
        return {k: v for k, v in data.get("rankings", {}).items() if all(b in BACKENDS for b in v)}

    def _save(self) -> None:
        if self.cache_path is None:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"torch": torch.__version__, "rankings": self.rankings}
        fd, tmp = tempfile.mkstemp(dir=self.cache_path.parent, prefix=self.cache_path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
        os.replace(tmp, self.cache_path)  # atomic: an interrupted write never leaves half a file

    # ------------------------------------------------------------------ choice

    def candidates(self, sig: Signature) -> list[tuple[str, str | None]]:
        """(backend, reason it cannot run or None) for every configured backend."""
        out = []
        for name in self.backends:
            why = "disabled" if name in self.disabled else BACKENDS[name].why_not(sig)
            out.append((name, why))
        return out

    def ranking(self, sig: Signature, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                scale: float | None) -> list[str]:
        key = sig.key()
        ranked = self.rankings.get(key)
        if ranked is None:
            ranked = self._measure(sig, q, k, v, attn_mask, is_causal, scale)
            self.rankings[key] = ranked
            self._save()
        return [b for b in ranked if b not in self.disabled] if self.disabled else ranked

    def _measure(self, sig, q, k, v, attn_mask, is_causal, scale) -> list[str]:
        times: dict[str, float] = {}
        sync = torch.cuda.synchronize if q.device.type == "cuda" else (lambda: None)
        with torch.no_grad():
            for name, why in self.candidates(sig):
                if why is not None:
                    continue
                run = BACKENDS[name].run
                try:
                    for _ in range(self.warmup):
                        run(q, k, v, attn_mask, is_causal, scale)
                    samples = []
                    for _ in range(self.repeats):
                        sync()
                        t0 = time.perf_counter()
                        run(q, k, v, attn_mask, is_causal, scale)
                        sync()
                        samples.append(time.perf_counter() - t0)
                except Exception as err:  # noqa: BLE001 - a backend that fails is not a candidate
                    self._note_fallback(name, f"rejected while measuring: {_reason(err)}")
                    continue
                times[name] = sorted(samples)[len(samples) // 2]
        if not times:
            raise RuntimeError(f"no attention backend can run {sig}: " + "; ".join(
                f"{n}: {w}" for n, w in self.candidates(sig) if w))
        return sorted(times, key=times.get)

    def _note_fallback(self, name: str, reason: str) -> None:
        if (name, reason) not in self.fallbacks:
            log.warning("attention backend %s unavailable: %s", name, reason)
        self.fallbacks[(name, reason)] += 1

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
                 scale: float | None = None, sig: Signature | None = None) -> tuple[Tensor, str]:
        """Attention through the fastest backend that runs; returns (output, backend name). ``sig``: the
        caller's ``Signature.of(q, k, mask kind)``, when it has it."""
        if sig is None:
            sig = Signature.of(q, k, "causal" if is_causal else "none" if attn_mask is None else "mask")
        for name in self.ranking(sig, q, k, v, attn_mask, is_causal, scale):
            try:
                out = BACKENDS[name].run(q, k, v, attn_mask, is_causal, scale)
            except Exception as err:  # noqa: BLE001 - fall back down the ranking, reason logged once
                self._note_fallback(name, _reason(err))
                continue
            self.calls[name] += 1
            return out, name
        raise RuntimeError(f"every attention backend failed for {sig}; fallbacks: {dict(self.fallbacks)}")

    def get_statistics(self) -> dict:
        total = sum(self.calls.values())
        return {"calls": dict(self.calls), "total_calls": total,
                "flash_ratio": sum(n for b, n in self.calls.items() if b in FLASH_LIKE) / total if total else 0.0,
                "fallbacks": [{"backend": b, "reason": r, "count": n} for (b, r), n in self.fallbacks.items()],
                "signatures": len(self.rankings)}
