"""The scaling study (G2-B, G2-T2): the module providers (``modules.py``) over a batch sweep and a sequence
sweep, and the 3% goal.

The goal, besides the sweep: eager, adaattn and the direct backends side by side (time per call) and in
one kernel trace (kernel time); compiled (``compile_mode``, CUDA graphs by default), ``compiled:adaattn``
beside ``compiled:direct:<backend>`` for each of ``compiled_backends``; the first call of each new
signature (``first_call_s``: adaattn's, the kernel manager ranking its backends, then the direct call of
the backend it chose); and the stack check, a stack of transformer blocks with AdaAttention vs the same
with SDPA, both compiled block by block, a training step side by side.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaattn.attention.ada import AdaAttention
from adaattn.attention.backends import BACKENDS, Signature
from adaattn.attention.kernel_manager import IN_THE_RUNNING, AttentionKernelManager
from adaattn.attention.providers import DTYPES
from adaattn.errors import classify_error
from adaattn_pipeline.bench.harness import Case, Workload
from adaattn_pipeline.bench.side_by_side import call_of, paired_ratio_rows, side_by_side_rows
from adaattn.timing.timers import UncutTrace, kernel_times_ms, quantiles
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.common.modules import ModuleStudy, backend_unavailable


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


class Scaling(ModuleStudy):
    name = "scaling"
    section_id = "G2-B"
    table_ids = ("G2-B", "G2-T2")
    sections = ("G2-B",)
    extra_params = ("verdicts.goal_overhead",)  # the rounds take one more block where a ratio's interval spans it

    def __init__(self, device: str = "cpu"):
        super().__init__(device)
        self._first_calls: list[dict] = []  # ``first_call_s`` rows (``_first_call_rows``)
        self._seen: set[str] = set()  # cases whose first calls were made

    def section(self, params: Params, target: Target):
        return getattr(params.g2_b, target.profile)

    def shapes(self, sec) -> list[tuple[str, int, int, bool]]:
        return ([("batch", b, sec.batch_sweep_seq_len, c) for c in sec.causal for b in sec.batches]
                + [("seq", sec.seq_sweep_batch, s, c) for c in sec.causal for s in sec.seq_lens])

    def cases(self, params: Params, target: Target) -> list[Case]:
        sec = self.section(params, target)
        may_run = sec.manager_backends or IN_THE_RUNNING[target.device]
        missing = [b for b in may_run if f"direct:{b}" not in sec.providers]
        if missing:  # the goal's oracle is every backend the manager may pick, called directly
            raise ValueError(f"G2-B.{target.profile}.providers must hold direct:<backend> for every backend the "
                             f"kernel manager may pick (manager_backends, or the hardware's: {', '.join(may_run)}); "
                             f"missing: {', '.join('direct:' + b for b in missing)}")
        return super().cases(params, target)

    def harness_options(self, params: Params, target: Target) -> dict[str, Any]:
        sec = self.section(params, target)
        return {**super().harness_options(params, target), "utilization_s": sec.utilization_s,
                "utilization_providers": tuple(sec.utilization_providers)}

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
        if case.case_id not in self._seen:  # before any other call of this shape
            self._seen.add(case.case_id)
            self._first_calls += self._first_call_rows(case)
        return super().setup(case, provider, requires_grad)

    def side_by_side_names(self, case: Case) -> list[str]:
        return ["adaattn"] + self.direct(case)  # the 3% goal's time per call

    def settle(self, params: Params) -> float | None:
        return params.verdicts.goal_overhead

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        """The goal's providers side by side (eager, then compiled), the kernel-time goal, the stack check, the
        first calls, and the kernel manager's rankings as it measured them."""
        sec = self.section(params, target)
        rows = self._side_by_side(params, target) + self._kernel_goal_rows(params, target, sec)
        rows += self._compiled_rows(params, target, sec) + self._stack_rows(sec) + self._first_calls
        return rows + self.manager_rows()

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
                                    "unit": "s", "status": "ok",
                                    "reason": ""})
            rows.append(base | {"provider": "adaattn", "mode": mode, "metric": "first_call_measure_s",
                                "value": manager.measure_s.get(key), "unit": "s",
                                "status": "ok", "reason": ""})
        return rows

    def _warm_process(self, case: Case) -> None:
        """The process's one-time costs (CUDA context, kernel loading, runtime-compiled kernels), paid before the
        first ``first_call_s`` row: a module with its own manager tunes the case's lengths at one batch more (another
        signature: the case's own per-shape costs stay in its row). A small shape leaves some of them to the first
        larger one (docs/notebook.md, 2026-11-26)."""
        c = case.config
        x = torch.randn(c["batch"] + 1, c["seq_len"], c["embed_dim"], device=self.device, dtype=DTYPES[c["dtype"]])
        warm = AdaAttention(c["embed_dim"], c["heads"], batch_first=True, precision_mode=c["dtype"], rank_mode="full",
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
        rows = side_by_side_rows(groups, self.device, keep=["compiled:adaattn"], rounds=sec.side_by_side,
                                 seed=sec.seed, paired="compiled:adaattn", settle=params.verdicts.goal_overhead,
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
            torch.manual_seed(sec.seed)
            attn = (lambda: AdaAttention(st.embed_dim, st.heads, batch_first=True, precision_mode=st.dtype,
                                         rank_mode="full",
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
        rows = side_by_side_rows([(base, "fwd_bwd", {f"stack:{k}": functools.partial(build, k)
                                                     for k in ("adaattn", "sdpa")})],
                                 self.device, keep=["stack:adaattn", "stack:sdpa"], rounds=st.side_by_side,
                                 seed=sec.seed, paired="stack:adaattn", prefix="stack_")
        torch._dynamo.reset()
        return rows

    def _kernel_goal_rows(self, params: Params, target: Target, sec) -> list[dict]:
        """``goal_kernel_ms`` per case and mode: the kernel time per call of adaattn and of every available direct
        backend, their calls round robin in one profiler session (``kernel_times_ms``, the section's
        ``goal_kernel_calls`` each, after two calls each), and adaattn's over each backend's, round by round
        (``goal_kernel_paired_ratio``). The adaattn row's ``kernel`` names the backend its manager put first."""
        if not sec.goal_kernel_calls:  # the CPU profile: no kernel time there
            return []
        rows = []
        for case in self.cases(params, target):
            base = {"table_id": self.section_id, "case_id": case.case_id, **case.config}
            for mode in case.modes:
                names = ["adaattn"] + [p for p in self.direct(case) if mode == "fwd" or self.has_backward(p)]
                trace, status, reason = None, "error", ""
                try:
                    with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                        calls = [call_of(self.setup(case, p, mode != "fwd"), mode) for p in names]
                        for call in calls:
                            call()
                            call()
                        trace = kernel_times_ms(calls, sec.goal_kernel_calls)
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
                        "p20": q.p20 if q else None, "p80": q.p80 if q else None, "status": status, "unit": "ms",
                        "samples": len(trace.samples[i]) if trace else None,
                        "reason": reason or (f"the calls of {len(names)} providers interleaved in one trace"
                                             f"{trace.note() if trace else ''}"),
                        "kernel": chosen if p == "adaattn" else ""})
                if trace:
                    rows += paired_ratio_rows(base | {"mode": mode}, "goal_kernel_paired_ratio", names[0],
                                              trace.samples[0], dict(zip(names[1:], trace.samples[1:], strict=True)))
        return rows



STUDY = Scaling()
