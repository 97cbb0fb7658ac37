"""Whole attention modules, side by side: the cpu_baseline (G2-T1) and scaling (G2-B, G2-T2) studies.

Every provider is one self-attention module with the same weights (an ``nn.MultiheadAttention``
initialised from a fixed seed; AdaAttention loads its ``state_dict``), called on the same
(B, S, E) input:

- ``mha``: ``nn.MultiheadAttention`` (``need_weights=False``: its fused SDPA path);
- ``standard``: the projections, then matmul, softmax, matmul in the input dtype: the textbook
  module a model without fused attention runs (the guides' "standard attention");
- ``adaattn``: AdaAttention, precision fixed to the case dtype, ``rank_mode="full"``: the kernel
  manager picks the backend (candidates: ``manager_backends`` in params.yaml);
- ``adaattn_auto``: AdaAttention with everything adaptive (``precision_mode="auto"``,
  ``rank_mode="auto"``): what ``enable_gpu_optimization=True`` gives a user;
- ``adaattn_noopt``: AdaAttention with ``enable_gpu_optimization=False`` (PyTorch's SDPA);
- ``direct:<backend>``: AdaAttention's projections and output projection around one backend of the
  manager, called directly (no manager, no precision policy): the oracle for the 3% goal.

The 3% goal's kernel time is also taken for a manager that ranks by GPU time (scaling, GPU, after the
sweep): ``adaattn_gpu``, AdaAttention as ``adaattn`` with a kernel manager made with
``objective="gpu"``, its calls and every direct backend's interleaved in one kernel trace per shape
and mode (``goal_kernel_ms`` rows; its ranking per signature is among the ``manager_ranking`` rows).
``adaattn``'s manager ranks by time per call, and where a call is host-bound it may choose a backend
with a longer kernel and a leaner host: its kernel time then reads above the fastest backend's by that
choice. Not a params provider: it is part of the goal, as the direct backends are its oracle.

The 3% goal is also timed under host load (scaling, GPU): every provider's call preceded by a fixed
spell of other host work (a spin of ``host_loads_us``), as a model's other layers issue theirs
between two attention calls. Where the host has more to do the GPU waits for it, and the fastest
backend can change: at B=16 S=1024 forward in the H100 scaling run at code 550382b8 the module,
through SDPA's own dispatch (cuDNN), took 1.09x forced flash's time per call side by side, though
the manager had measured that dispatch at 0.148 ms per call and flash at 0.193. A scratch run (same
machine kind and code; spins of 0-250 us before each call) found SDPA's cuDNN path fastest up to
60 us, and from 100 us forced flash or efficient attention, 4-5% ahead of forced cuDNN. A choice
per signature made without the load (the manager's looks time its own calls) holds the goal at every
host load only where one backend is within 3% of the fastest at each load; the report says where one is.

Accuracy is against a float64 module with the same weights on the first batch element.
FLOPs (forward): projections 2*B*S*E*4E, attention 4*B*H*S^2*D (halved if causal).
"""

from __future__ import annotations

import dataclasses
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
from adaattn.attention.backends import BACKENDS
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.providers import DTYPES, PROVIDERS
from adaattn.attention.reference import attention_ref
from adaattn.attention.timing import Timing
from adaattn.bench.harness import Case, Workload, classify_error
from adaattn.bench.runner import target_sections
from adaattn.bench.timing import KernelTrace, UncutTrace, kernel_times_ms, quantiles
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


def _timed_name(backend: str, t: Timing | None) -> str:
    """``backend (time per call / host / GPU ms)``, as the manager timed it; ``*`` after a time per call that is
    the fastest burst (the backend took no paired rounds), not the typical turn."""
    if t is None:
        return backend
    gpu = "-" if t.gpu_ms is None else f"{t.gpu_ms:.3g}"
    return f"{backend} ({t.call_ms:.3g}{'' if t.rounds else '*'} / {t.host_ms:.3g} / {gpu})"


HOST_PROBE_LOOP, HOST_PROBE_EVERY_S = 50_000, 5.0  # the host probe: loop length; at most one probe this often


def host_probe_ms(n: int = HOST_PROBE_LOOP, repeats: int = 3) -> float:
    """The host's speed now: a pure-Python loop of ``n`` multiply-adds, the fastest of ``repeats`` (ms). It
    touches neither torch nor the GPU, so it moves with the host alone (its clock, other tenants), not
    with the process's state. Why: on a lent H100's host (scratch run at code 9cc0577d: the scaling study,
    this loop timed 59 times over its 500 s, between its steps and before each of the manager's looks) it
    took 2.17-5.55 ms with no trend, and 4.85-5.29 ms in a fresh process started after the study; the host
    time to issue the projections and forced flash attention at B=1 S=2048 E=512 bf16, timed beside it,
    took 87-244 us, and the faster of that call with forced flash and with forced efficient attention
    (median of 40 of the study's turns each) changed from probe to probe: flash at 21 of the 59, efficient
    attention at 38. The probe's own time does not predict which (it is a probe of the host, not a model
    of the call); it shows how far the host moved under a run's host-bound verdicts."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        acc = 0
        for i in range(n):
            acc += i * i
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


GOAL_OVERHEAD = 1.03  # the 3% goal: adaattn at most 3% slower than the fastest backend called directly
_TIMED = {"call": "module's call", "op": "attention op alone"}  # what a manager's ranking timed
MANAGED = {"call": "adaattn", "gpu": "adaattn_gpu"}  # the module provider whose manager ranks by each objective


def manager_rows(manager: AttentionKernelManager, table_id: str, provider: str) -> list[dict]:
    """A kernel manager's rankings per signature (fastest first), its looks and its fallbacks, as it
    measured them in this run: ``manager_ranking``, ``manager_looks`` and ``manager_fallbacks`` rows."""
    rows = []
    for key, ranking in manager.rankings.items():
        times = manager.timings.get(key, {})
        paired = max((t.rounds for t in times.values()), default=0)
        rows.append({"table_id": table_id, "case_id": f"manager/{key}", "provider": provider,
                     "mode": "", "metric": "manager_ranking", "value": len(ranking),
                     "unit": f"backends ranked by {manager.objective} (ms: time per call / host / GPU, of the "
                             f"{_TIMED[manager.timed.get(key, 'op')]}, as the manager timed them; time per "
                             f"call the typical turn of {paired} paired rounds, * the fastest burst)",
                     "status": "ok", "reason": "", "kernel": " > ".join(_timed_name(b, times.get(b)) for b in ranking)})
    for key, looks in manager.looks.items():
        rows.append({"table_id": table_id, "case_id": f"manager/{key}", "provider": provider, "mode": "",
                     "metric": "manager_looks", "value": len(looks), "unit": "looks of paired rounds (s after the "
                     "first: typical time per call, ms, fastest first)", "status": "ok", "reason": "",
                     "kernel": "; ".join(f"{look.at_s:.0f} s: " + " > ".join(
                         f"{b} ({ms:.3g})" for b, ms in sorted(look.ms.items(), key=lambda x: x[1])) for look in looks)})
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
        a = self._modules["ada"]  # as AdaAttention reads its own submodules (not nn.Module.__getattr__)
        B, S, E = x.shape
        q, k, v = a._project(x, x, x)
        return a._out_proj(self.run(q, k, v, None, causal, 1 / math.sqrt(a.head_dim)), B, S, E)


def spin(us: float) -> None:
    """Keep the host busy for ``us`` microseconds (a busy wait: other host work, not a sleep)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def loaded(w: Workload, us: float) -> Workload:
    """``w`` with ``us`` microseconds of other host work before every forward call (``spin``)."""
    fwd = w.fwd

    def call():
        spin(us)
        return fwd()

    return dataclasses.replace(w, fwd=call)


class ModuleStudy:
    """One class, two studies: ``cpu_baseline`` (section G2-T1) and ``scaling`` (section G2-B)."""

    config_columns = ["sweep", "batch", "seq_len", "embed_dim", "heads", "head_dim", "causal", "dtype",
                      "host_load_us"]
    # CUDA: besides time per call (events: at small shapes the host's time shows), the GPU time of a
    # call's kernels (10 profiled calls) and host time per call (20 back to back): the backend choice
    # is judged on the first, the module's Python overhead on the second
    kernel_calls = 10
    host_calls = 20
    # the 3% goal's kernel-time trace (``_gpu_objective_rows``): rounds of one call of each provider, the
    # goal decided on the per-round ratios' median and its confidence interval, as time per call. Why: in
    # the H100 scaling run at code 2e4e0814 (ratio of 10-call medians) adaattn_gpu, running the same SDPA
    # kernel as direct:sdpa, read 0.62 us (3.4%) above it at B=1 S=512 forward, over the bound; in scratch
    # traces on an H100 (B=1-16, S=512-1024, forward; 10 and 40 rounds, four orders of the providers) two
    # instances of direct:sdpa in one trace differed by up to 0.39 us, and adaattn_gpu read -0.01 to 0.37 us
    # above direct:sdpa at B=1 S=512: a kernel time of 18 us is read to a few tenths of a microsecond
    goal_kernel_calls = 30
    # time per call side by side (``side_by_side.py``), about this many ms of calls per shape and mode,
    # within these rounds: scaling's 3% goal (adaattn and the direct backends) and G2-T1 (the module
    # providers, CPU only: a point's calls take 10-80 ms there, so it gets more time). The goal's
    # question is whether a median ratio is above 1.03; at 1 s per shape (20-200 rounds, H100 scaling
    # run at code 4622cc24) the rounds' p20-p80 spanned up to 0.98-1.35 at host-bound shapes and the
    # medians' confidence intervals could not answer it, so the goal's shapes get 5 s. On the CPU
    # (calls of 1.6-40 ms) the goal's shapes took 26-200 rounds in 6 s, and the intervals of two of the
    # six spanned the bound (CPU scaling run at code a94a5817): 12 s, up to 1000 rounds
    side_by_side_ms = {("G2-B", "cuda"): 5000.0, ("G2-B", "cpu"): 12000.0, ("G2-T1", "cpu"): 15000.0}
    side_by_side_rounds = {("G2-B", "cuda"): (40, 1000), ("G2-B", "cpu"): (20, 1000), ("G2-T1", "cpu"): (20, 200)}
    # the 3% goal's providers side by side once more under each host load (us of host work before every
    # call: ``loaded``), about host_load_ms of calls each, within host_load_rounds. 0-250 us in the scratch
    # run the module docstring cites moved the fastest backend at B=16 S=1024 forward from 60 to 100 us. Not
    # on the CPU: there a call is host time already (1.6-40 ms), and a spin adds the same to every provider
    host_loads_us: dict[tuple[str, str], tuple[float, ...]] = {("G2-B", "cuda"): (50.0, 100.0, 200.0)}
    host_load_ms = 1200.0
    host_load_rounds = (20, 300)
    # the kernel-time goal under objective "gpu" (``_gpu_objective_rows``): where it is taken. Not on the
    # CPU: there both objectives rank by time per call
    gpu_objective = frozenset({("G2-B", "cuda")})

    def __init__(self, name: str, section_id: str, table_ids: tuple[str, ...], device: str = "cpu"):
        self.name, self.section_id, self.table_ids, self.device = name, section_id, table_ids, device
        self._managers: dict[tuple[str, tuple[str, ...]], AttentionKernelManager] = {}
        self._inputs: tuple[str, Tensor] | None = None
        self._mha: dict[tuple, nn.MultiheadAttention] = {}
        self._backends: tuple[str, ...] = tuple(BACKENDS)  # set by cases() from the section
        self._probes: list[tuple[float, float, str]] = []  # (s after the first, ms, before what): ``_probe``

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
        self._backends = tuple(sec.manager_backends)
        missing = [b for b in sec.manager_backends if self.section_id == "G2-B" and f"direct:{b}" not in sec.providers]
        if missing:  # the goal's oracle is every backend the manager may pick, called directly
            raise ValueError(f"{self.section_id}.{target.profile}.providers must hold direct:<backend> for every "
                             f"manager_backends entry; missing: {', '.join('direct:' + b for b in missing)}")
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

    def _manager(self, backends: tuple[str, ...], objective: str = "call") -> AttentionKernelManager:
        """One manager per study run and objective (as one per process): it measures each signature once."""
        if (objective, backends) not in self._managers:
            manager = AttentionKernelManager(backends=list(backends), objective=objective)
            manager.hold_looks = True  # a look runs only in a side-by-side warm-up call (``_warm_setup``)
            self._managers[(objective, backends)] = manager
        return self._managers[(objective, backends)]

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
        if provider == "mha":
            return mha
        if provider == "standard":
            return mha  # called through _standard_forward
        precision = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[c["dtype"]]
        kwargs: dict[str, Any] = dict(precision_mode=precision, rank_mode="full")
        if provider == "adaattn_auto":
            kwargs = dict(precision_mode="auto", rank_mode="auto")
        elif provider == "adaattn_noopt":
            kwargs["enable_gpu_optimization"] = False
        objective = "gpu" if provider == "adaattn_gpu" else "call"
        ada = AdaAttention(c["embed_dim"], c["heads"], kernel_manager=self._manager(self._backends, objective),
                           device=self.device, dtype=DTYPES[c["dtype"]], **kwargs)
        ada.load_state_dict(mha.state_dict())
        return _Direct(ada, provider.removeprefix("direct:")) if provider.startswith("direct:") else ada

    def _probe(self, before: str) -> None:
        """The host's speed (``host_probe_ms``) between two steps of the study, at most every
        ``HOST_PROBE_EVERY_S``: ``host_probe_ms`` rows, for the report's account of the host."""
        now = time.monotonic()
        if self._probes and now - self._t0 - self._probes[-1][0] < HOST_PROBE_EVERY_S:
            return
        if not self._probes:
            self._t0 = now
        self._probes.append((now - self._t0, host_probe_ms(), before))

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
        self._probe(f"{case.case_id} {provider}")
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
            fn = lambda: module(x, x, x, is_causal=causal)[0]  # noqa: E731
        params = [p for p in module.parameters() if p.requires_grad] if requires_grad else []
        for p in params:
            p.grad = None
        return Workload(fwd=fn, inputs=[x, *params], flops_fwd=self.flops(case), to_reference_layout=lambda o: o[:1])

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
        """Providers side by side (scaling: the 3% goal's; cpu_baseline: G2-T1's). Both studies: the
        kernel manager's ranking per signature (fastest first), as it measured it in this run."""
        rows = self._side_by_side(params, target) + self._gpu_objective_rows(params, target)
        for manager in self._managers.values():
            rows += manager_rows(manager, self.section_id, MANAGED[manager.objective])
        unit = f"ms: a pure-Python loop of {HOST_PROBE_LOOP} multiply-adds, the fastest of 3"
        rows += [{"table_id": self.section_id, "case_id": "host/probe", "provider": "host", "mode": "",
                  "metric": "host_probe_ms", "value": ms, "unit": unit, "status": "ok",
                  "reason": f"{at:.0f} s after the first probe, before {before}", "kernel": ""}
                 for at, ms, before in self._probes]
        return rows

    def _side_by_side(self, params: Params, target: Target) -> list[dict]:
        """``side_by_side_ms`` per case and mode, the calls interleaved, and adaattn's ``paired_ratio`` to
        each other provider. Scaling (the 3% goal's time per call): adaattn and every available
        ``direct:<backend>``. G2-T1: every module provider of the case, none left out."""
        groups, keep = [], ["adaattn"]
        loads = self.host_loads_us.get((self.section_id, self.device), ())
        under_load = []  # the goal's groups once per host load
        for case in self.cases(params, target):
            if self.section_id == "G2-T1":
                names = [p for p in case.providers if self.unavailable(p, self.device) is None]
                keep = names
            else:
                names = ["adaattn"] + [p for p in case.providers if p.startswith("direct:")
                                       and self.unavailable(p, self.device) is None]
            if "adaattn" not in names:
                continue
            base = {"table_id": self.section_id, "case_id": case.case_id, "kernel": "", **case.config}
            if loads:
                base["host_load_us"] = 0.0
            for mode in case.modes:
                timed = [p for p in names if mode == "fwd" or self.has_backward(p)]
                groups.append((base, mode, {p: functools.partial(self._warm_setup, case, p, mode != "fwd") for p in timed}))
                under_load += [(base | {"host_load_us": us}, mode,
                                {p: functools.partial(self._loaded_setup, case, p, mode != "fwd", us) for p in timed})
                               for us in loads]
        if not groups:
            return []
        budget = (self.section_id, self.device)
        lo, hi = self.side_by_side_rounds[budget]
        settle = GOAL_OVERHEAD if self.section_id == "G2-B" else None  # the goal's: one more block where open
        rows = side_by_side_rows(groups, self.device, keep=keep, budget_ms=self.side_by_side_ms[budget],
                                 min_rounds=lo, max_rounds=hi, paired="adaattn", settle=settle)
        if under_load:
            rows += side_by_side_rows(under_load, self.device, keep=keep, budget_ms=self.host_load_ms,
                                      min_rounds=self.host_load_rounds[0], max_rounds=self.host_load_rounds[1],
                                      paired="adaattn", settle=settle)
        return rows

    def _loaded_setup(self, case: Case, provider: str, requires_grad: bool, us: float) -> Workload:
        return loaded(self._warm_setup(case, provider, requires_grad), us)

    def _warm_setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
        """``setup`` and one call, in the grad mode of the calls to come, with the managers' looks let run: a look
        of the manager that came due (``AttentionKernelManager.looks_s``) runs here, before the side-by-side
        warm-up, not in a timed turn or the sweep's timed, profiled and traced calls (held there: ``_manager``)."""
        w = self.setup(case, provider, requires_grad)
        held = [m for m in self._managers.values() if m.hold_looks]
        for m in held:
            m.hold_looks = False
        try:
            with torch.enable_grad() if requires_grad else torch.no_grad():
                w.fwd()
        finally:
            for m in held:
                m.hold_looks = True
        return w

    def _gpu_objective_rows(self, params: Params, target: Target) -> list[dict]:
        """``goal_kernel_ms`` per case and mode: the kernel time per call of ``adaattn_gpu`` (its manager ranks
        by GPU time) and of every available direct backend, their calls round robin in one profiler
        session (``kernel_times_ms``, ``kernel_calls`` each, after two calls each: the first ranks the
        signature). The adaattn_gpu row's ``kernel`` names the backend its manager put first."""
        if (self.section_id, self.device) not in self.gpu_objective:
            return []
        rows = []
        for case in self.cases(params, target):
            direct = [p for p in case.providers if p.startswith("direct:") and self.unavailable(p, self.device) is None]
            base = {"table_id": self.section_id, "case_id": case.case_id, **case.config}
            for mode in case.modes:
                names = ["adaattn_gpu"] + [p for p in direct if mode == "fwd" or self.has_backward(p)]
                trace, status, reason, chosen = None, "error", "", ""
                try:
                    trace, chosen = self._kernel_trace(case, names, mode)
                    status = "ok"
                except UncutTrace as err:
                    reason = str(err)
                except Exception as err:  # noqa: BLE001 - a failed trace becomes status rows; the study goes on
                    status, reason = classify_error(err)
                torch.cuda.empty_cache()
                for i, p in enumerate(names):
                    q = quantiles(trace.samples[i]) if trace else None
                    rows.append(base | {
                        "provider": p, "mode": mode, "metric": "goal_kernel_ms", "value": q.p50 if q else None,
                        "p20": q.p20 if q else None, "p80": q.p80 if q else None, "status": status, "reason": reason,
                        "unit": f"ms of GPU kernel time per call (sum over its kernels; the calls of {len(names)} "
                                f"providers interleaved in one trace, {self.goal_kernel_calls} rounds"
                                f"{trace.note() if trace else ''})",
                        "kernel": chosen if p == "adaattn_gpu" else ""})
                if trace:  # adaattn_gpu's kernel time over each direct backend's, round by round
                    rows += paired_ratio_rows(base | {"mode": mode}, "goal_kernel_paired_ratio", names[0],
                                              trace.samples[0], dict(zip(names[1:], trace.samples[1:], strict=True)),
                                              "kernel time, summed over the call's kernels, in one profiler trace")
        return rows

    def _kernel_trace(self, case: Case, names: list[str], mode: str) -> tuple[KernelTrace, str]:
        """(``kernel_times_ms``'s trace of ``names``' calls in ``mode``, the backend adaattn_gpu's manager put
        first for the case's signature)."""
        grad = torch.no_grad if mode == "fwd" else torch.enable_grad
        manager = self._manager(self._backends, "gpu")
        seen = set(manager.rankings)
        with grad():
            calls = [call_of(self.setup(case, p, mode != "fwd"), mode) for p in names]
            for call in calls:  # the first call ranks adaattn_gpu's signature; the second runs the choice
                call()
                call()
            trace = kernel_times_ms(calls, self.goal_kernel_calls)
        new = [k for k in manager.rankings if k not in seen]
        return trace, (manager.rankings[new[0]][0] if len(new) == 1 else "")

    # ------------------------------------------------------------------ report

    def render(self, df: pd.DataFrame, out_dir: Path) -> list[Section]:
        from adaattn_experiments.ada_modules_report import render

        return render(self.name, df, out_dir)


CPU_BASELINE = ModuleStudy("cpu_baseline", "G2-T1", ("G2-T1",))
SCALING = ModuleStudy("scaling", "G2-B", ("G2-B", "G2-T2"))
