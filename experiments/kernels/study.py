"""Kernels study: regenerates G4-T2 and checks G4-T1's claims ("Triton kernels 1.5-2x faster",
"shared RoPE cache 24x memory reduction").

Providers side by side in one run: eager PyTorch (the references in
``adaattn.kernels.reference``), the same code under ``torch.compile``, Liger-Kernel (a peer; no
fused QK-norm + RoPE there) and ours. RoPE also has ``ours_inplace``: our kernel rotating q and k
where they lie, as Liger's RoPE does (the other providers write new tensors); forward only, since
the study's inputs are leaves that require grad, where autograd refuses an in-place op.
Memory-bound work, so every result is also GB/s from a written byte count (below) and a fraction
of the copy bandwidth measured in the same run.

Three times per call, reported separately: ``time_ms`` (CUDA events around each call, what a
caller waits for; at small sizes it includes host time the device could not hide), ``kernel_ms``
(the GPU time of the call's kernels, summed from a profiler trace: the kernels' own speed; the
providers' calls interleaved in one trace per case and mode, see ``bench.harness``) and ``host_ms``
(host time per call, 20 calls back to back).

Byte counts (per token; N hidden, e element size; rope kernels: Hq + Hkv heads of D):
  rms_norm  fwd read x + write y = 2Ne;          bwd read x, dy + write dx = 3Ne
  swiglu    fwd read a, b + write c = 3Ne;       bwd read a, b, dc + write da, db = 5Ne
  rope      fwd/bwd read q, k + write = 2(Hq+Hkv)De, + cos, sin rows (2 x D/2 fp32)
  qk_norm_rope fwd as rope + rstd 4(Hq+Hkv);     bwd read dq, dk, q, k + write = 3(Hq+Hkv)De + cos/sin + rstd
Weights ((N,) or (D,)) and their fp32 partial sums are below 1% at every size and not counted.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from adaattn.attention.providers import DTYPES
from adaattn_pipeline.bench.compile_cache import FreshCompiles, WarmItem, segments
from adaattn_pipeline.bench.harness import Case, Workload
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.config import Params, Target
from adaattn.errors import Unsupported
from adaattn.kernels import reference as R

SECTION_IDS = ("G4-T2", "G4-T1")
EPS = 1e-6
# The float64 reference covers the first REF_TOKENS tokens: every kernel treats each token alone,
# through the same code path, and a float64 copy of the largest sweep point (65536 x 28672) alone
# would take 14 GiB per tensor.
REF_TOKENS = 4096


def _liger_check() -> str | None:
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
        import liger_kernel.ops.rope  # noqa: F401
        import liger_kernel.ops.swiglu  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the import error is the reason
        return f"liger_kernel not importable: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


@functools.cache
def _compiled(kernel: str):
    cfg = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):  # one compile per hidden size and grad mode
        if hasattr(cfg, knob):
            setattr(cfg, knob, 512)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    # The bwd mode runs backward repeatedly through one retained graph; with donated buffers the
    # compiled backward frees its saved tensors and refuses retain_graph=True. Off: the backward
    # keeps them (the same kernels; only the fwd_bwd peak memory can differ).
    torch._functorch.config.donated_buffer = False
    return torch.compile(REFS[kernel], fullgraph=True)


def _first_tokens(out: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """The part of a (B, S, ...) output (or of each output) that the reference covers."""
    return tuple(t[:, :REF_TOKENS] for t in out) if isinstance(out, tuple) else out[:, :REF_TOKENS]


REFS = {"rms_norm": R.rms_norm_ref, "swiglu": R.swiglu_ref, "rope": R.rope_ref, "qk_norm_rope": R.qk_norm_rope_ref}


class Kernels(StudyDef):
    name = "kernels"
    table_ids = ("G4-T2", "G4-T1")
    config_columns = ["op", "batch", "seq_len", "tokens", "hidden", "heads", "kv_heads", "head_dim", "dtype"]
    sections = ("G4-T2", "G4-T1")

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._inputs: tuple[str, dict[str, Tensor]] | None = None
        self._compiles = FreshCompiles()

    def bind(self, device: str) -> Kernels:
        return Kernels(device)

    def harness_options(self, params: Params, target: Target) -> dict[str, Any]:
        sec = getattr(params.g4_t1, target.profile)
        return {"host_calls": sec.host_calls, "kernel_calls": sec.kernel_calls}

    def cases(self, params: Params, target: Target) -> list[Case]:
        t2 = getattr(params.g4_t2, target.profile)
        t1 = getattr(params.g4_t1, target.profile)
        out = [self._case("G4-T2", k, t2.batch, t2.seq_len, t2.dim, dtype, t2) for k in t2.kernels for dtype in t2.dtypes]
        for kernel, sizes in t1.hidden.items():
            for hidden in sizes:
                for tokens in t1.tokens:
                    for dtype in t1.dtypes:
                        out.append(self._case("G4-T1", kernel, 1, tokens, hidden, dtype, t1))
        return out

    @staticmethod
    def _case(table_id: str, kernel: str, batch: int, seq_len: int, hidden: int, dtype: str, section) -> Case:
        rope = kernel in ("rope", "qk_norm_rope")
        if rope and hidden % section.head_dim:
            raise ValueError(f"{table_id}: hidden {hidden} is not a multiple of head_dim {section.head_dim}")
        heads = hidden // section.head_dim if rope else 0
        kv_heads = max(1, heads // section.gqa) if rope else 0
        config = {"op": kernel, "batch": batch, "seq_len": seq_len, "tokens": batch * seq_len, "hidden": hidden,
                  "heads": heads, "kv_heads": kv_heads, "head_dim": section.head_dim if rope else 0, "dtype": dtype}
        return Case(case_id=f"{table_id}/{kernel}-t{batch * seq_len}-n{hidden}-{dtype}", table_id=table_id, config=config,
                    providers=tuple(p for p in section.providers if not (p == "liger" and kernel == "qk_norm_rope")
                                    and not (p == "ours_inplace" and kernel != "rope")),
                    modes=tuple(section.modes))

    # ------------------------------------------------------------------ inputs and workloads

    def inputs(self, case: Case) -> dict[str, Tensor]:
        if self._inputs is None or self._inputs[0] != case.case_id:
            self._inputs = None
            c = case.config
            dt, dev = DTYPES[c["dtype"]], self.device
            B, S, N = c["batch"], c["seq_len"], c["hidden"]
            if c["op"] == "rms_norm":
                x = {"x": torch.randn(B, S, N, device=dev, dtype=dt),
                     "w": (1 + 0.1 * torch.randn(N, device=dev)).to(dt)}
            elif c["op"] == "swiglu":
                x = {"a": torch.randn(B, S, N, device=dev, dtype=dt), "b": torch.randn(B, S, N, device=dev, dtype=dt)}
            else:
                D = c["head_dim"]
                x = {"q": torch.randn(B, S, c["heads"], D, device=dev, dtype=dt),
                     "k": torch.randn(B, S, c["kv_heads"], D, device=dev, dtype=dt)}
                x["cos"], x["sin"] = R.rope_cache(S, D, device=dev)
                if c["op"] == "qk_norm_rope":
                    x["wq"] = (1 + 0.1 * torch.randn(D, device=dev)).to(dt)
                    x["wk"] = (1 + 0.1 * torch.randn(D, device=dev)).to(dt)
            self._inputs = (case.case_id, x)
        return self._inputs[1]

    @staticmethod
    def bytes_by_mode(case: Case) -> dict[str, float]:
        c = case.config
        e = torch.finfo(DTYPES[c["dtype"]]).bits // 8
        T, N = c["tokens"], c["hidden"]
        if c["op"] == "rms_norm":
            return {"fwd": 2 * T * N * e, "bwd": 3 * T * N * e}
        if c["op"] == "swiglu":
            return {"fwd": 3 * T * N * e, "bwd": 5 * T * N * e}
        heads, D = c["heads"] + c["kv_heads"], c["head_dim"]
        table = T * D * 4  # cos and sin rows: 2 x D/2 fp32
        if c["op"] == "rope":
            return {"fwd": 2 * T * heads * D * e + table, "bwd": 2 * T * heads * D * e + table}
        return {"fwd": 2 * T * heads * D * e + table + 4 * T * heads, "bwd": 3 * T * heads * D * e + table + 4 * T * heads}

    def _args(self, case: Case, requires_grad: bool) -> dict[str, Tensor]:
        """A private copy per workload (Liger's RoPE and ours_inplace rewrite theirs); leaves require grad."""
        grad_keys = {"x", "w", "a", "b", "q", "k", "wq", "wk"}
        return {k: v.detach().clone().requires_grad_(requires_grad and k in grad_keys)
                for k, v in self.inputs(case).items()}

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
        kernel = case.config["op"]
        if provider == "ours_inplace" and requires_grad:
            raise Unsupported("in-place rotation needs inputs that are not leaves requiring grad (autograd refuses "
                              "it on those, and the study's inputs are); in a model q and k are projection outputs")
        x = self._args(case, requires_grad)
        fn = self._fn(kernel, provider, x)
        if provider == "compile":  # one compile per (hidden size, grad mode); the token count stays symbolic
            # a fresh dynamo per hidden size: compiled as a model of that width would be (without
            # it, dynamo's automatic dynamic shapes make the hidden size symbolic from the second
            # size on), and traced as the workers traced it (bench.compile_cache)
            self._compiles.enter(self.compile_key(case))
            for name, t in x.items():
                if t.dim() >= 3:
                    torch._dynamo.mark_dynamic(t, 1)  # (B, S, ...)
                elif name in ("cos", "sin"):
                    torch._dynamo.mark_dynamic(t, 0)  # (S, D/2)
        leaves = [t for t in x.values() if t.requires_grad]
        return Workload(fwd=fn, inputs=leaves, bytes_by_mode=self.bytes_by_mode(case),
                        to_reference_layout=_first_tokens)

    def _fn(self, kernel: str, provider: str, x: dict[str, Tensor]):
        if provider in ("eager", "compile"):
            f = REFS[kernel] if provider == "eager" else _compiled(kernel)
        elif provider == "ours_inplace":
            from adaattn.kernels.rope import rope_triton

            return lambda: rope_triton(x["q"], x["k"], x["cos"], x["sin"], inplace=True)
        elif provider == "ours":
            from adaattn.kernels.rms_norm import rms_norm_triton
            from adaattn.kernels.rope import qk_norm_rope_triton, rope_triton
            from adaattn.kernels.swiglu import swiglu_triton

            f = {"rms_norm": rms_norm_triton, "swiglu": swiglu_triton, "rope": rope_triton,
                 "qk_norm_rope": qk_norm_rope_triton}[kernel]
        else:
            return self._liger(kernel, x)
        if kernel == "rms_norm":
            return lambda: f(x["x"], x["w"], EPS)
        if kernel == "swiglu":
            return lambda: f(x["a"], x["b"])
        if kernel == "rope":
            return lambda: f(x["q"], x["k"], x["cos"], x["sin"])
        return lambda: f(x["q"], x["k"], x["wq"], x["wk"], x["cos"], x["sin"], EPS)

    @staticmethod
    def _liger(kernel: str, x: dict[str, Tensor]):
        if kernel == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            # casting "llama" (fp32 statistics, as our reference); in_place=False keeps dy intact
            return lambda: LigerRMSNormFunction.apply(x["x"], x["w"], EPS, 0.0, "llama", False)
        if kernel == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return lambda: LigerSiLUMulFunction.apply(x["a"], x["b"])
        from liger_kernel.ops.rope import LigerRopeFunction

        # Liger takes (B, H, S, D) views of (B, S, H, D) storage and a full-width (1, S, D) table,
        # built here, outside the timed call; it rotates q and k in place
        cos = torch.cat([x["cos"], x["cos"]], -1)[None]
        sin = torch.cat([x["sin"], x["sin"]], -1)[None]

        def fn():
            q, k = LigerRopeFunction.apply(x["q"].transpose(1, 2), x["k"].transpose(1, 2), cos, sin)
            return q.transpose(1, 2), k.transpose(1, 2)

        return fn

    def reference(self, case: Case) -> Any:
        # (B, S, ...) activations and (S, D/2) rope tables: the first REF_TOKENS positions
        x = {k: (v[:, :REF_TOKENS] if v.dim() >= 3 else v[:REF_TOKENS] if k in ("cos", "sin") else v).double()
             for k, v in self.inputs(case).items()}
        kernel = case.config["op"]
        if kernel == "rms_norm":
            return R.rms_norm_ref(x["x"], x["w"], EPS)
        if kernel == "swiglu":
            return R.swiglu_ref(x["a"], x["b"])
        if kernel == "rope":
            return R.rope_ref(x["q"], x["k"], x["cos"], x["sin"])
        return R.qk_norm_rope_ref(x["q"], x["k"], x["wq"], x["wk"], x["cos"], x["sin"], EPS)

    def unavailable(self, provider: str, device: str) -> str | None:
        if provider in ("ours", "ours_inplace") and device != "cuda":
            return "our Triton kernels run on CUDA; on a CPU only in Triton's interpreter, which checks correctness, never speed"
        if provider == "liger":
            if device != "cuda":
                return "Liger-Kernel runs on CUDA only"
            return _liger_check()
        return None

    def has_backward(self, provider: str) -> bool:
        return True

    @staticmethod
    def compile_key(case: Case) -> tuple:
        c = case.config
        return c["op"], c["dtype"], c["hidden"]

    def compile_groups(self, cases: list[Case]) -> list[list[WarmItem]]:
        """First calls of the torch.compile provider, cut into segments of one (kernel, dtype, hidden
        size), every mode, in the harness's order (see ``bench.compile_cache``)."""
        items = [(case, "compile", mode) for case in cases if "compile" in case.providers for mode in case.modes]
        return segments(items, lambda item: self.compile_key(item[0]))

    # ------------------------------------------------------------------ G4-T1: shared RoPE cache

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        """Bytes of rotary caches for the guide's layers: one RotaryEmbedding per layer vs one shared."""
        from torch import nn

        from adaattn.layers import RotaryEmbedding

        rc = getattr(params.g4_t1, target.profile).rope_cache

        def unique_bytes(model: nn.Module) -> int:
            seen = {}
            for buf in model.buffers():
                seen[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
            return sum(seen.values())

        per_layer = nn.ModuleList(RotaryEmbedding(rc.head_dim, rc.max_seq_len, device=self.device)
                                  for _ in range(rc.layers))
        shared_one = RotaryEmbedding(rc.head_dim, rc.max_seq_len, device=self.device)
        shared = nn.ModuleList(nn.ModuleDict({"rope": shared_one}) for _ in range(rc.layers))
        base = {"table_id": "G4-T1", "case_id": f"G4-T1/rope_cache-l{rc.layers}-d{rc.head_dim}-s{rc.max_seq_len}",
                "mode": "", "unit": "bytes", "status": "ok", "reason": "", "kernel": "", "p20": None,
                "p80": None, "op": "rope_cache", "head_dim": rc.head_dim, "seq_len": rc.max_seq_len, "heads": rc.layers}
        return [{**base, "provider": "per_layer", "metric": "cache_bytes", "value": unique_bytes(per_layer)},
                {**base, "provider": "shared", "metric": "cache_bytes", "value": unique_bytes(shared)}]

    # ------------------------------------------------------------------ report



STUDY = Kernels()
