"""Whole attention modules, side by side: the cpu_baseline (G2-T1) and scaling (G2-B, G2-T2) studies.

Every provider is one self-attention module with the same weights (an ``nn.MultiheadAttention``
initialised from a fixed seed; AdaAttention loads its ``state_dict``), called on the same
(B, S, E) input:

- ``mha``: ``nn.MultiheadAttention`` (``need_weights=False``: its fused SDPA path);
- ``standard``: the projections, then matmul, softmax, matmul in the input dtype: the textbook
  module a model without fused attention runs (the guides' "standard attention");
- ``adaattn``: AdaAttention, precision fixed to the case dtype, ``rank_mode="full"``: the kernel
  manager picks the backend (its candidates: ``manager_backends``, by default the hardware's);
- ``adaattn_auto``: AdaAttention with everything adaptive (``precision_mode="auto"``,
  ``rank_mode="auto"``): what ``enable_gpu_optimization=True`` gives a user;
- ``adaattn_noopt``: AdaAttention with ``enable_gpu_optimization=False`` (PyTorch's SDPA);
- ``direct:<backend>``: AdaAttention's projections and output projection around one backend of the
  manager, called directly (no manager, no precision policy): the oracle for the 3% goal.

Scaling's goal, besides the sweep (``extra_rows``): eager, adaattn and the direct backends side by
side (time per call) and in one kernel trace (kernel time); compiled (``compile_mode``, CUDA graphs by
default), ``compiled:adaattn`` beside ``compiled:direct:<backend>`` for each of ``compiled_backends``;
the first call of each new signature (``first_call_s``: adaattn's, the kernel manager ranking its
backends, then the direct call of the backend it chose); and the stack check, a stack of transformer
blocks with AdaAttention vs the same with SDPA, both compiled block by block, a training step side by side.

Accuracy is against a float64 module with the same weights on the first batch element.
FLOPs (forward): projections 2*B*S*E*4E, attention 4*B*H*S^2*D (halved if causal).
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaattn.attention.ada import AdaAttention
from adaattn.attention.backends import BACKENDS, Signature
from adaattn.attention.kernel_manager import IN_THE_RUNNING, AttentionKernelManager
from adaattn.attention.providers import DTYPES, PROVIDERS
from adaattn.attention.reference import attention_ref
from adaattn.bench.harness import Case, Workload, classify_error
from adaattn.bench.runner import target_sections
from adaattn.bench.timing import UncutTrace, kernel_times_ms, quantiles
from adaattn.config import Params, Target
from adaattn.report.common import Section
from adaattn_experiments.side_by_side import call_of, paired_ratio_rows, side_by_side_rows

SEED = 0


def _seeded_mha(embed_dim: int, heads: int, device: str, dtype: torch.dtype) -> nn.MultiheadAttention:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(SEED)
    try:
        mha = nn.MultiheadAttention(embed_dim, heads, batch_first=True)
    finally:
        torch.random.set_rng_state(gen_state)
    return mha.to(device=device, dtype=dtype)


def _standard_forward(mha: nn.MultiheadAttention, x: Tensor, causal: bool) -> Tensor:
    """Textbook attention module in the input dtype, with ``mha``'s weights."""
    B, S, E = x.shape
    H = mha.num_heads
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).view(B, S, 3, H, E // H).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-2, -1) / math.sqrt(E // H)
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=x.device).triu_(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return mha.out_proj(out.transpose(1, 2).reshape(B, S, E))


def module_reference(mha: nn.MultiheadAttention, x: Tensor, causal: bool) -> Tensor:
    """The module in float64 (chunked attention: no S x S matrix), for the inputs given."""
    B, S, E = x.shape
    H = mha.num_heads
    w, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
    q, k, v = F.linear(x.double(), w, b).view(B, S, 3, H, E // H).permute(2, 0, 3, 1, 4)
    out = attention_ref(q, k, v, causal=causal)
    return F.linear(out.transpose(1, 2).reshape(B, S, E), mha.out_proj.weight.double(), mha.out_proj.bias.double())


def backend_unavailable(backend: str, device: str) -> str | None:
    """Why a kernel-manager backend whose library is optional cannot run here (None: it can)."""
    provider = {"flash_attn": "flash_attn", "xformers": "xformers_cutlass", "flex": "flex"}.get(backend)
    return PROVIDERS[provider].unavailable(device) if provider else None




def manager_rows(manager: AttentionKernelManager, table_id: str, provider: str) -> list[dict]:
    """A kernel manager's rankings per signature (fastest first, with the median GPU-time turn of each, ms) and
    the seconds each took, and its fallbacks, as it measured them in this run."""
    rows = []
    for key, ranking in manager.rankings.items():
        ms = manager.times_ms.get(key, {})
        rows.append({"table_id": table_id, "case_id": f"manager/{key}", "provider": provider, "mode": "",
                     "metric": "manager_ranking", "value": manager.measure_s.get(key), "status": "ok", "reason": "",
                     "unit": "s the ranking took; kernel: backends fastest first (median GPU-time turn, ms)",
                     "kernel": " > ".join(f"{b} ({ms[b]:.3g})" if b in ms else b for b in ranking)})
    for (backend, reason), n in manager.fallbacks.items():
        rows.append({"table_id": table_id, "case_id": f"manager/fallback/{backend}", "provider": provider, "mode": "",
                     "metric": "manager_fallbacks", "value": n, "unit": "calls", "status": "ok",
                     "reason": reason[:300], "kernel": backend})
    return rows


class _Direct(nn.Module):
    """AdaAttention's projections around one backend, called directly."""

    def __init__(self, ada: AdaAttention, backend: str):
        super().__init__()
        self.ada, self.run = ada, BACKENDS[backend].run

    def forward(self, x: Tensor, causal: bool) -> Tensor:
        B, S, E = x.shape
        q, k, v = self.ada._project(x, x, x)
        out = self.run(q, k, v, None, causal, 1 / math.sqrt(self.ada.head_dim))  # (B, heads, S, D)
        return self.ada.out_proj(out.transpose(1, 2).reshape(B, S, E))


class SdpaSelfAttention(nn.Module):
    """The stack check's baseline: the projections around ``F.scaled_dot_product_attention``."""

    def __init__(self, embed_dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        B, S, E = x.shape
        q, k, v = self.in_proj(x).view(B, S, 3, self.heads, E // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, S, D)
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, E))


class Block(nn.Module):
    """A pre-norm transformer block: LayerNorm, self-attention, residual, LayerNorm, MLP (GELU), residual."""

    def __init__(self, attn: nn.Module, embed_dim: int, mlp_ratio: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.attn = attn
        self.mlp = nn.Sequential(nn.Linear(embed_dim, mlp_ratio * embed_dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * embed_dim, embed_dim))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        a = self.attn(h, h, h, need_weights=False)[0] if isinstance(self.attn, AdaAttention) else self.attn(h)
        x = x + a
        return x + self.mlp(self.norm2(x))


class ModuleStudy:
    """One class, two studies: ``cpu_baseline`` (section G2-T1) and ``scaling`` (section G2-B)."""

    config_columns = ["sweep", "batch", "seq_len", "embed_dim", "heads", "head_dim", "causal", "dtype"]
    # CUDA: besides time per call (events: at small shapes the host's time shows), the GPU time of a
    # call's kernels (10 profiled calls) and host time per call (20 back to back): the report reads a shape
    # as GPU-bound where the fastest direct call's kernel time is at least GPU_BOUND x its host time
    kernel_calls = 10
    host_calls = 20
    # the kernel-time goal's trace (``_kernel_goal_rows``): rounds of one call of each provider, the goal
    # decided on the per-round ratios' median and its confidence interval (the small kernels' resolution:
    # docs/notebook.md)
    goal_kernel_calls = 30
    # time per call side by side (``side_by_side.py``), about this many ms of calls per shape and mode, within
    # these rounds: scaling's goal (adaattn and the direct backends, eager and compiled) and G2-T1 (the module
    # providers, CPU only: its points' calls are long, so it gets more time)
    side_by_side_ms = {("G2-B", "cuda"): 3000.0, ("G2-B", "cpu"): 12000.0, ("G2-T1", "cpu"): 15000.0}
    side_by_side_rounds = {("G2-B", "cuda"): (40, 1000), ("G2-B", "cpu"): (20, 1000), ("G2-T1", "cpu"): (20, 200)}
    stack_ms, stack_rounds = 3000.0, (20, 200)  # the stack check's side-by-side rounds
    # where the kernel-time goal is taken (not on a CPU: no kernel time there)
    kernel_goal = frozenset({("G2-B", "cuda")})

    def __init__(self, name: str, section_id: str, table_ids: tuple[str, ...], device: str = "cpu"):
        self.name, self.section_id, self.table_ids, self.device = name, section_id, table_ids, device
        self._managers: dict[tuple[str, ...] | None, AttentionKernelManager] = {}
        self._inputs: tuple[str, Tensor] | None = None
        self._mha: dict[tuple, nn.MultiheadAttention] = {}
        self._backends: tuple[str, ...] | None = None  # set by cases() from the section (None: the hardware's)
        self._first_calls: list[dict] = []  # ``first_call_s`` rows (``_first_call_rows``)
        self._seen: set[str] = set()  # cases whose first calls were made

    def bind(self, device: str) -> ModuleStudy:
        return ModuleStudy(self.name, self.section_id, self.table_ids, device)

    def param_sections(self, raw: dict, target: Target, target_name: str) -> dict[str, Any]:
        return target_sections(raw, target_name, (self.section_id,))

    def _section(self, params: Params, target: Target):
        attr = {"G2-T1": "g2_t1", "G2-B": "g2_b"}[self.section_id]
        sec = getattr(getattr(params, attr), target.profile, None)
        if sec is None:
            raise ValueError(f"{self.section_id} has no {target.profile!r} profile (it is a CPU table)")
        return sec

    # ------------------------------------------------------------------ cases

    def cases(self, params: Params, target: Target) -> list[Case]:
        sec = self._section(params, target)
        self._backends = None if sec.manager_backends is None else tuple(sec.manager_backends)
        may_run = sec.manager_backends or IN_THE_RUNNING[target.device]
        missing = [b for b in may_run if self.section_id == "G2-B" and f"direct:{b}" not in sec.providers]
        if missing:  # the goal's oracle is every backend the manager may pick, called directly
            raise ValueError(f"{self.section_id}.{target.profile}.providers must hold direct:<backend> for every "
                             f"backend the kernel manager may pick (manager_backends, or the hardware's: "
                             f"{', '.join(may_run)}); missing: {', '.join('direct:' + b for b in missing)}")
        if self.section_id == "G2-T1":
            shapes = [("point", b, s, False) for b, s in sec.points]
        else:
            shapes = [("batch", b, sec.batch_sweep_seq_len, c) for c in sec.causal for b in sec.batches]
            shapes += [("seq", sec.seq_sweep_batch, s, c) for c in sec.causal for s in sec.seq_lens]
        out, seen = [], set()
        for sweep, b, s, causal in shapes:
            mask = "causal" if causal else "full"
            case_id = f"{self.section_id}/b{b}-s{s}-e{sec.embed_dim}-h{sec.heads}-{mask}-{sec.dtype}"
            if case_id in seen:  # the point both sweeps share is measured once
                continue
            seen.add(case_id)
            out.append(Case(case_id=case_id, table_id=self.section_id, config={
                "sweep": sweep, "batch": b, "seq_len": s, "embed_dim": sec.embed_dim, "heads": sec.heads,
                "head_dim": sec.embed_dim // sec.heads, "causal": causal, "dtype": sec.dtype},
                providers=tuple(sec.providers), modes=tuple(sec.modes)))
        return out

    def utilization(self, params: Params, target: Target) -> dict:
        sec = self._section(params, target)
        if self.section_id != "G2-B":
            return {}
        return {"utilization_s": sec.utilization_s, "utilization_providers": tuple(sec.utilization_providers)}

    # ------------------------------------------------------------------ workloads

    def _manager(self) -> AttentionKernelManager:
        """One manager per study run (as one per process): it measures each signature once."""
        if self._backends not in self._managers:
            self._managers[self._backends] = AttentionKernelManager(
                backends=None if self._backends is None else list(self._backends))
        return self._managers[self._backends]

    def mha(self, case: Case) -> nn.MultiheadAttention:
        c = case.config
        key = (c["embed_dim"], c["heads"], c["dtype"])
        if key not in self._mha:
            self._mha[key] = _seeded_mha(c["embed_dim"], c["heads"], self.device, DTYPES[c["dtype"]])
        return self._mha[key]

    def inputs(self, case: Case) -> Tensor:
        if self._inputs is None or self._inputs[0] != case.case_id:
            self._inputs = None
            c = case.config
            x = torch.randn(c["batch"], c["seq_len"], c["embed_dim"], device=self.device, dtype=DTYPES[c["dtype"]])
            self._inputs = (case.case_id, x)
        return self._inputs[1]

    def build(self, case: Case, provider: str) -> nn.Module:
        c = case.config
        mha = self.mha(case)
        if provider in ("mha", "standard"):
            return mha  # standard: called through _standard_forward
        kwargs: dict[str, Any] = dict(precision_mode=c["dtype"], rank_mode="full")
        if provider == "adaattn_auto":
            kwargs = dict(precision_mode="auto", rank_mode="auto")
        elif provider == "adaattn_noopt":
            kwargs["enable_gpu_optimization"] = False
        ada = AdaAttention(c["embed_dim"], c["heads"], kernel_manager=self._manager(), device=self.device,
                           dtype=DTYPES[c["dtype"]], **kwargs)
        ada.load_state_dict(mha.state_dict())
        return _Direct(ada, provider.removeprefix("direct:")) if provider.startswith("direct:") else ada

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
        if self.section_id == "G2-B" and case.case_id not in self._seen:  # before any other call of this shape
            self._seen.add(case.case_id)
            self._first_calls += self._first_call_rows(case)
        c = case.config
        causal = c["causal"]
        module = self.build(case, provider)
        x = self.inputs(case).detach().clone().requires_grad_(requires_grad)
        S = c["seq_len"]
        if provider == "mha":
            mask = torch.ones(S, S, dtype=torch.bool, device=self.device).triu_(1) if causal else None
            fn = lambda: module(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)[0]  # noqa: E731
        elif provider == "standard":
            fn = lambda: _standard_forward(module, x, causal)  # noqa: E731
        elif provider.startswith("direct:"):
            fn = lambda: module(x, causal)  # noqa: E731
        else:
            fn = lambda: module(x, x, x, need_weights=False, is_causal=causal)[0]  # noqa: E731
        params = [p for p in module.parameters() if p.requires_grad] if requires_grad else []
        for p in params:
            p.grad = None
        return Workload(fwd=fn, inputs=[x, *params], flops_fwd=self.flops(case), to_reference_layout=lambda o: o[:1])

    def _compiled_setup(self, case: Case, provider: str, requires_grad: bool, mode: str, fresh: bool) -> Workload:
        """``setup`` of ``provider`` (after ``compiled:``), its module compiled whole in ``mode``. ``fresh``: the
        group's first: dynamo starts afresh (each new module and shape is another entry in dynamo's cache of the
        same code, and past its limit dynamo would run the call eagerly: a silent change of what is timed)."""
        if fresh:
            torch._dynamo.reset()
        w = self.setup(case, provider, requires_grad)
        if provider == "adaattn":  # its signature decided by an eager call first, as a user tunes before compiling
            with torch.enable_grad() if requires_grad else torch.no_grad():
                w.fwd()
        torch._dynamo.mark_static_address(w.inputs[0])  # the input stays put: no copy into the CUDA graph per call
        compiled = torch.compile(w.fwd, fullgraph=True, mode=mode)

        def fwd():
            torch.compiler.cudagraph_mark_step_begin()  # each call a new step: no output is kept across calls
            return compiled()

        return Workload(fwd=fwd, inputs=w.inputs, flops_fwd=w.flops_fwd)

    def _first_call_rows(self, case: Case) -> list[dict]:
        """Per mode: the seconds of adaattn's first call of the case's signature (synchronised; the kernel manager
        ranks the signature's backends in it), then of the direct call of the backend it put first, made after it
        (that backend's per-shape setup already done: the difference bounds the new signature's cost from above),
        and the seconds the ranking itself took (``first_call_measure_s``)."""
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        if not self._first_calls:
            self._warm_process(case)
        manager = self._manager()
        base = {"table_id": self.section_id, "case_id": case.case_id, "kernel": "", **case.config}
        rows = []
        for mode in case.modes:
            grad = mode != "fwd"
            key = self._signature(case, grad).key()
            if key in manager.rankings:  # ranked already (another case with the same signature)
                continue
            seconds = {}
            for provider in ("adaattn", None):
                if provider is None:  # the direct call of the backend the manager put first
                    provider = f"direct:{manager.rankings[key][0]}"
                w = self.setup(case, provider, grad)
                sync()
                t0 = time.perf_counter()
                with torch.enable_grad() if grad else torch.no_grad():
                    out = w.fwd()
                    if grad:  # a training step's first call: forward and backward
                        out.backward(torch.ones_like(out))
                sync()
                seconds[provider] = time.perf_counter() - t0
                del out, w
            for provider, s in seconds.items():
                rows.append(base | {"provider": provider, "mode": mode, "metric": "first_call_s", "value": s,
                                    "unit": "s of the first call of a new signature (synchronised): adaattn's ranks "
                                            "the backends; the direct call's comes after it", "status": "ok",
                                    "reason": ""})
            rows.append(base | {"provider": "adaattn", "mode": mode, "metric": "first_call_measure_s",
                                "value": manager.measure_s.get(key), "unit": "s the kernel manager's ranking took",
                                "status": "ok", "reason": ""})
        return rows

    def _warm_process(self, case: Case) -> None:
        """The process's one-time costs (CUDA context, kernel loading, runtime-compiled kernels), paid before the
        first ``first_call_s`` row: a module with its own manager tunes the case's lengths at one batch more (another
        signature: the case's own per-shape costs stay in its row). A small shape leaves some of them to the first
        larger one (docs/notebook.md, 2026-11-26)."""
        c = case.config
        x = torch.randn(c["batch"] + 1, c["seq_len"], c["embed_dim"], device=self.device, dtype=DTYPES[c["dtype"]])
        warm = AdaAttention(c["embed_dim"], c["heads"], precision_mode=c["dtype"], rank_mode="full",
                            kernel_manager=AttentionKernelManager(self._backends and list(self._backends)),
                            device=self.device, dtype=DTYPES[c["dtype"]])
        warm.tune(x, grad=None)

    def _signature(self, case: Case, grad: bool) -> Signature:
        """The kernel manager's signature of the case's calls (grad: a training call's)."""
        c = case.config
        q = torch.empty(c["batch"], c["heads"], c["seq_len"], c["head_dim"], device=self.device,
                        dtype=DTYPES[c["dtype"]], requires_grad=grad)
        with torch.enable_grad() if grad else torch.no_grad():
            return Signature.of(q, q, "causal" if c["causal"] else "none")

    @staticmethod
    def flops(case: Case) -> float:
        c = case.config
        B, S, E = c["batch"], c["seq_len"], c["embed_dim"]
        attn = 4 * B * c["heads"] * S * S * c["head_dim"] * (0.5 if c["causal"] else 1.0)
        return 2 * B * S * E * 4 * E + attn

    def reference(self, case: Case) -> Tensor:
        return module_reference(self.mha(case), self.inputs(case)[:1], case.config["causal"])

    def unavailable(self, provider: str, device: str) -> str | None:
        return backend_unavailable(provider.removeprefix("direct:"), device) if provider.startswith("direct:") else None

    def has_backward(self, provider: str) -> bool:
        if provider == "direct:flex":
            return self.device in PROVIDERS["flex"].backward_devices
        return True

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        """Providers side by side (scaling: the goal's, eager and compiled, and the stack check; cpu_baseline:
        G2-T1's), the kernel-time goal, the first calls, and the kernel manager's rankings as it measured them."""
        rows = self._side_by_side(params, target) + self._kernel_goal_rows(params, target)
        if self.section_id == "G2-B":
            sec = self._section(params, target)
            rows += self._compiled_rows(params, target, sec) + self._stack_rows(sec)
        rows += self._first_calls
        for manager in self._managers.values():
            rows += manager_rows(manager, self.section_id, "adaattn")
        return rows

    def _direct(self, case: Case) -> list[str]:
        return [p for p in case.providers if p.startswith("direct:") and self.unavailable(p, self.device) is None]

    def _side_by_side(self, params: Params, target: Target) -> list[dict]:
        """``side_by_side_ms`` per case and mode, the calls interleaved, and adaattn's ``paired_ratio`` to
        each other provider. Scaling (the 3% goal's time per call): adaattn and every available
        ``direct:<backend>``. G2-T1: every module provider of the case, none left out."""
        groups, keep = [], ["adaattn"]
        for case in self.cases(params, target):
            if self.section_id == "G2-T1":
                names = [p for p in case.providers if self.unavailable(p, self.device) is None]
                keep = names
            else:
                names = ["adaattn"] + self._direct(case)
            if "adaattn" not in names:
                continue
            base = {"table_id": self.section_id, "case_id": case.case_id, "kernel": "", **case.config}
            for mode in case.modes:
                timed = [p for p in names if mode == "fwd" or self.has_backward(p)]
                groups.append((base, mode, {p: functools.partial(self.setup, case, p, mode != "fwd") for p in timed}))
        if not groups:
            return []
        budget = (self.section_id, self.device)
        lo, hi = self.side_by_side_rounds[budget]
        # the goal's bound (params.yaml verdicts.goal_overhead): one more block of rounds where it is still open
        settle = params.verdicts.goal_overhead if self.section_id == "G2-B" else None
        return side_by_side_rows(groups, self.device, keep=keep, budget_ms=self.side_by_side_ms[budget],
                                 min_rounds=lo, max_rounds=hi, paired="adaattn", settle=settle)

    def _compiled_rows(self, params: Params, target: Target, sec) -> list[dict]:
        """The compiled goal: per case and mode, ``compiled:adaattn`` and ``compiled:direct:<backend>`` for each of
        ``compiled_backends`` that runs here, each compiled whole in ``compile_mode``, side by side
        (``compiled_side_by_side_ms``, ``compiled_paired_ratio`` rows)."""
        if not sec.compiled_backends:
            return []
        groups = []
        for case in self.cases(params, target):
            rivals = [f"direct:{b}" for b in sec.compiled_backends
                      if backend_unavailable(b, self.device) is None and BACKENDS[b].traceable]
            base = {"table_id": self.section_id, "case_id": case.case_id, "kernel": sec.compile_mode, **case.config}
            for mode in case.modes:
                names = ["adaattn", *rivals]
                groups.append((base, mode, {f"compiled:{p}": functools.partial(
                    self._compiled_setup, case, p, mode != "fwd", sec.compile_mode, p == "adaattn") for p in names}))
        budget = (self.section_id, self.device)
        lo, hi = self.side_by_side_rounds[budget]
        rows = side_by_side_rows(groups, self.device, keep=["compiled:adaattn"], budget_ms=self.side_by_side_ms[budget],
                                 min_rounds=lo, max_rounds=hi, paired="compiled:adaattn",
                                 settle=params.verdicts.goal_overhead,
                                 prefix="compiled_")
        torch._dynamo.reset()
        return rows

    def _stack_rows(self, sec) -> list[dict]:
        """The stack check: ``sec.stack`` blocks with AdaAttention (its signature tuned first, as a user would
        before compiling) vs with SDPA, each block compiled (default mode: regional compilation, one graph for
        every block), a training step (forward and backward) side by side: ``stack_side_by_side_ms`` and
        ``stack_paired_ratio`` rows."""
        st = sec.stack
        if st is None:
            return []
        dtype = DTYPES[st.dtype]

        def build(kind: str) -> Workload:
            torch.manual_seed(SEED)
            attn = (lambda: AdaAttention(st.embed_dim, st.heads, precision_mode=st.dtype, rank_mode="full",
                                         kernel_manager=self._manager())) if kind == "adaattn" else \
                (lambda: SdpaSelfAttention(st.embed_dim, st.heads))
            stack = nn.Sequential(*(Block(attn(), st.embed_dim, st.mlp_ratio) for _ in range(st.layers)))
            stack = stack.to(self.device, dtype)
            x = torch.randn(st.batch, st.seq_len, st.embed_dim, device=self.device, dtype=dtype, requires_grad=True)
            for block in stack:  # each block's signature decided first, as a user tunes before compiling
                if kind == "adaattn":
                    block.attn.tune(x.detach(), grad=True)  # one signature for every block: one ranking, shared
                block.compile()
            return Workload(fwd=lambda: stack(x), inputs=[x, *stack.parameters()])

        torch._dynamo.reset()
        base = {"table_id": self.section_id, "case_id": f"{self.section_id}/stack-{st.layers}x-b{st.batch}-s{st.seq_len}"
                f"-e{st.embed_dim}-h{st.heads}-{st.dtype}", "kernel": "", "batch": st.batch, "seq_len": st.seq_len,
                "embed_dim": st.embed_dim, "heads": st.heads, "head_dim": st.embed_dim // st.heads, "causal": False,
                "dtype": st.dtype, "sweep": "stack"}
        lo, hi = self.stack_rounds
        rows = side_by_side_rows([(base, "fwd_bwd", {f"stack:{k}": functools.partial(build, k)
                                                     for k in ("adaattn", "sdpa")})],
                                 self.device, keep=["stack:adaattn", "stack:sdpa"], budget_ms=self.stack_ms,
                                 min_rounds=lo, max_rounds=hi, paired="stack:adaattn", prefix="stack_")
        torch._dynamo.reset()
        return rows

    def _kernel_goal_rows(self, params: Params, target: Target) -> list[dict]:
        """``goal_kernel_ms`` per case and mode: the kernel time per call of adaattn and of every available direct
        backend, their calls round robin in one profiler session (``kernel_times_ms``, ``goal_kernel_calls``
        each, after two calls each), and adaattn's over each backend's, round by round
        (``goal_kernel_paired_ratio``). The adaattn row's ``kernel`` names the backend its manager put first."""
        if (self.section_id, self.device) not in self.kernel_goal:
            return []
        rows = []
        for case in self.cases(params, target):
            base = {"table_id": self.section_id, "case_id": case.case_id, **case.config}
            for mode in case.modes:
                names = ["adaattn"] + [p for p in self._direct(case) if mode == "fwd" or self.has_backward(p)]
                trace, status, reason = None, "error", ""
                try:
                    with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                        calls = [call_of(self.setup(case, p, mode != "fwd"), mode) for p in names]
                        for call in calls:
                            call()
                            call()
                        trace = kernel_times_ms(calls, self.goal_kernel_calls)
                    status = "ok"
                except UncutTrace as err:
                    reason = str(err)
                except Exception as err:  # noqa: BLE001 - a failed trace becomes status rows; the study goes on
                    status, reason = classify_error(err)
                torch.cuda.empty_cache()
                chosen = (self._manager().ranking(self._signature(case, mode != "fwd")) or [""])[0]
                for i, p in enumerate(names):
                    q = quantiles(trace.samples[i]) if trace else None
                    rows.append(base | {
                        "provider": p, "mode": mode, "metric": "goal_kernel_ms", "value": q.p50 if q else None,
                        "p20": q.p20 if q else None, "p80": q.p80 if q else None, "status": status, "reason": reason,
                        "unit": f"ms of GPU kernel time per call (sum over its kernels; the calls of {len(names)} "
                                f"providers interleaved in one trace, {self.goal_kernel_calls} rounds"
                                f"{trace.note() if trace else ''})",
                        "kernel": chosen if p == "adaattn" else ""})
                if trace:
                    rows += paired_ratio_rows(base | {"mode": mode}, "goal_kernel_paired_ratio", names[0],
                                              trace.samples[0], dict(zip(names[1:], trace.samples[1:], strict=True)),
                                              "kernel time, summed over the call's kernels, in one profiler trace")
        return rows

    # ------------------------------------------------------------------ report

    def render(self, df: pd.DataFrame, out_dir: Path) -> list[Section]:
        from adaattn_experiments.ada_modules_report import render

        return render(self.name, df, out_dir)


CPU_BASELINE = ModuleStudy("cpu_baseline", "G2-T1", ("G2-T1",))
SCALING = ModuleStudy("scaling", "G2-B", ("G2-B", "G2-T2"))
