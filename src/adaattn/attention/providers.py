"""Attention providers compared by the attention-backends study (G1-T1, G1-T2, G0-C1).

Each provider is one entry of ``PROVIDERS``: a name, the devices it can run on, the memory
layout it wants its inputs in, an import check that says *why* it is unavailable, and a
``build(case)`` that returns the attention function for that case. Everything a provider needs
that is not the attention itself (block masks, causal masks, compilation) happens in ``build``,
outside any timed region.

A forced SDPA backend really is the one that runs: under ``sdpa_kernel([backend])`` SDPA raises
instead of falling back, and the harness records the kernels that ran.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from adaattn.errors import Unsupported
from adaattn.names import ATTENTION_PROVIDERS, check_registry

AttnFn = Callable[[Tensor, Tensor, Tensor], Tensor]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class AttentionCase:
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str  # key of DTYPES
    device: str  # "cpu" | "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def flops_fwd(self) -> float:
        """4*B*H*S^2*D (two GEMMs of 2*S^2*D each per head), halved if causal."""
        flops = 4.0 * self.batch * self.heads * self.seq_len**2 * self.head_dim
        return flops / 2 if self.causal else flops


@dataclass(frozen=True)
class Provider:
    name: str
    devices: frozenset[str]
    build: Callable[[AttentionCase], AttnFn]
    layout: str = "bhsd"  # "bhsd" (SDPA) or "bshd" (xFormers, flash-attn)
    check: Callable[[], str | None] = lambda: None  # reason the provider cannot load, or None
    backward_devices: frozenset[str] = frozenset({"cpu", "cuda"})  # where it has a backward
    compiled: bool = False  # torch.compile'd: one compile per (dtype, head dim, mask, grad mode)
    host_plans: bool = False  # its first call at a new shape builds a plan on the host (cuDNN graphs)
    description: str = ""

    def unavailable(self, device: str) -> str | None:
        if device not in self.devices:
            return f"{self.name} has no {device} implementation"
        return self.check()


# --------------------------------------------------------------------------- PyTorch SDPA


def _sdpa(case: AttentionCase) -> AttnFn:
    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    return fn


def _sdpa_forced(backend_name: str) -> Callable[[AttentionCase], AttnFn]:
    def build(case: AttentionCase) -> AttnFn:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            # A single allowed backend: SDPA raises "No available kernel" rather than falling back.
            with sdpa_kernel([backend]):
                try:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
                except RuntimeError as err:
                    # SDPA says why only through warnings: call again to collect them (error path only,
                    # so the timed call carries no warnings machinery)
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
                        except RuntimeError:
                            pass
                    why = "; ".join(str(w.message).splitlines()[0] for w in caught)
                    raise Unsupported(f"SDPA {backend_name} rejected the inputs: {why or err}") from err

        return fn

    return build


# --------------------------------------------------------------------------- standard attention


def _standard(case: AttentionCase) -> AttnFn:
    """matmul, softmax, matmul in the input dtype: what a model without SDPA does."""
    scale = 1.0 / math.sqrt(case.head_dim)
    mask = None
    if case.causal:
        mask = torch.ones(case.seq_len, case.seq_len, dtype=torch.bool, device=case.device).triu_(1)

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, S, S)
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    return fn


# --------------------------------------------------------------------------- FlexAttention


@functools.cache
def _flex_compiled() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    # Every sweep point is a new static shape; past the recompile limit dynamo would silently run
    # flex_attention eagerly (materialising S x S scores), which changes what is measured.
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, 512)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    # dynamic=True: one compile per (dtype, head dim, mask, grad) group with symbolic B and S.
    return torch.compile(flex_attention, dynamic=True, fullgraph=True)


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _full_mask(b, h, q_idx, kv_idx):
    return q_idx >= 0


def _flex(case: AttentionCase) -> AttnFn:
    from torch.nn.attention.flex_attention import create_block_mask

    # Built here, outside the timed call (with block_mask=None flex_attention builds a full mask
    # inside every call). The mask functions live at module level: dynamo guards on them, and a
    # new closure per case recompiled every sweep point.
    block_mask = create_block_mask(_causal_mask if case.causal else _full_mask, None, None, case.seq_len,
                                   case.seq_len, device=case.device)
    flex = _flex_compiled()

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flex(q, k, v, block_mask=block_mask)

    return fn


def _check_flex() -> str | None:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure is the reason
        return f"FlexAttention not in this torch: {type(err).__name__}: {err}"
    return None


# --------------------------------------------------------------------------- xFormers


def _import_error(module: str) -> str | None:
    try:
        __import__(module)
    except Exception as err:  # noqa: BLE001 - the reason is whatever the import raised
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{module} not importable: {type(err).__name__}: {first}"[:300]
    return None


def _xformers_op(op_path: str):
    from xformers.ops import fmha

    mod_name, _, attr = op_path.rpartition(".")
    return getattr(getattr(fmha, mod_name), attr)


def _why_not(err: BaseException) -> str:
    """xformers' 'not supported because: ...' explanation, squeezed to one line."""
    text = " ".join(str(err).split())
    return text.split("because:", 1)[1].strip()[:300] if "because:" in text else text[:300]


def _xformers(fw: str, bw: str | None) -> Callable[[AttentionCase], AttnFn]:
    def build(case: AttentionCase) -> AttnFn:
        import xformers.ops as xops

        fw_op = _xformers_op(fw)
        bias = xops.LowerTriangularMask() if case.causal else None
        if bw is None:  # forward-only operator

            def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                return xops.memory_efficient_attention_forward(q, k, v, attn_bias=bias, op=fw_op)
        else:
            op = (fw_op, _xformers_op(bw))

            def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                return xops.memory_efficient_attention(q, k, v, attn_bias=bias, op=op)

        def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (B, S, H, D)
            try:
                return call(q, k, v)
            except (ValueError, NotImplementedError) as err:
                raise Unsupported(f"xformers {fw}: {_why_not(err)}") from err

        return fn

    return build


def _check_xformers(fw: str, bw: str | None) -> Callable[[], str | None]:
    @functools.cache
    def check() -> str | None:
        if reason := _import_error("xformers.ops"):
            return reason
        try:
            fw_op = _xformers_op(fw)
            if bw:
                _xformers_op(bw)
        except Exception as err:  # noqa: BLE001
            return f"xformers has no operator {fw}/{bw}: {type(err).__name__}: {err}"
        if not torch.cuda.is_available():
            return None
        # The CUDA operators live in a compiled extension built for one torch; when it does not
        # load, the operator refuses every input. One tiny call tells.
        import xformers.ops as xops

        x = torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.float16)
        try:
            xops.memory_efficient_attention_forward(x, x, x, op=fw_op)
        except (ValueError, NotImplementedError, RuntimeError) as err:
            return f"xformers {fw} cannot run here: {_why_not(err)}"
        return None

    return check


# --------------------------------------------------------------------------- flash-attn package


def _flash_attn(case: AttentionCase) -> AttnFn:
    from flash_attn import flash_attn_func

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (B, S, H, D)
        return flash_attn_func(q, k, v, causal=case.causal)

    return fn


CPU_CUDA = frozenset({"cpu", "cuda"})
CUDA = frozenset({"cuda"})

# Registry: a new provider is one entry here. Order is the order of tables and figure legends.
PROVIDERS: dict[str, Provider] = {
    # SDPA's own choice on Hopper is cuDNN (the kernel names in the results say which ran)
    "sdpa": Provider("sdpa", CPU_CUDA, _sdpa, host_plans=True,
                     description="F.scaled_dot_product_attention, backend chosen by PyTorch"),
    "sdpa_flash": Provider("sdpa_flash", CPU_CUDA, _sdpa_forced("FLASH_ATTENTION"), description="SDPA forced: flash"),
    "sdpa_efficient": Provider("sdpa_efficient", CUDA, _sdpa_forced("EFFICIENT_ATTENTION"), description="SDPA forced: memory-efficient"),
    "sdpa_cudnn": Provider("sdpa_cudnn", CUDA, _sdpa_forced("CUDNN_ATTENTION"), host_plans=True,
                           description="SDPA forced: cuDNN"),
    "sdpa_math": Provider("sdpa_math", CPU_CUDA, _sdpa_forced("MATH"), description="SDPA forced: math"),
    "standard": Provider("standard", CPU_CUDA, _standard, description="matmul, softmax, matmul"),
    # FlexAttention raises "does not support backward on CPU" (torch 2.11 - 2.13)
    "flex": Provider("flex", CPU_CUDA, _flex, check=_check_flex, backward_devices=CUDA, compiled=True,
                     description="FlexAttention, torch.compile'd"),
    "xformers_cutlass": Provider(
        "xformers_cutlass", CUDA, _xformers("cutlass.FwOp", "cutlass.BwOp"), layout="bshd",
        check=_check_xformers("cutlass.FwOp", "cutlass.BwOp"), description="xformers memory_efficient_attention, op=cutlass",
    ),
    "xformers_splitk": Provider(
        "xformers_splitk", CUDA, _xformers("triton_splitk.FwOp", None), layout="bshd",
        check=_check_xformers("triton_splitk.FwOp", None), backward_devices=frozenset(),
        description="xformers memory_efficient_attention, op=triton_splitk (forward only)",
    ),
    "flash_attn": Provider(
        "flash_attn", CUDA, _flash_attn, layout="bshd", check=lambda: _import_error("flash_attn"),
        description="flash-attn package, flash_attn_func",
    ),
}

check_registry(PROVIDERS, ATTENTION_PROVIDERS, "attention provider")  # params.yaml's names (adaattn.names)
BASELINE = "sdpa"
