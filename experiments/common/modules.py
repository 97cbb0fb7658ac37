"""Whole attention modules side by side: what the cpu_baseline (G2-T1) and scaling (G2-B, G2-T2) studies share.

Every provider is one self-attention module with the same weights (an ``nn.MultiheadAttention``
initialised from the section's seed; AdaAttention loads its ``state_dict``), called on the same
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

Accuracy is against a float64 module with the same weights on the first batch element.
FLOPs (forward): projections 2*B*S*E*4E, attention 4*B*H*S^2*D (halved if causal).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaattn.attention.ada import AdaAttention
from adaattn.attention.backends import BACKENDS
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.providers import DTYPES, PROVIDERS
from adaattn.attention.reference import attention_ref
from adaattn_pipeline.bench.harness import Case, Workload
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.bench.side_by_side import side_by_side_rows
from adaattn_pipeline.config import Params, Target


def seeded_mha(embed_dim: int, heads: int, device: str, dtype: torch.dtype, seed: int) -> nn.MultiheadAttention:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
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
                     "unit": "s",  # kernel: the backends fastest first (median GPU-time turn, ms)
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



class ModuleStudy(StudyDef):
    """The module providers of one section (``section_id``) at its shapes (``shapes``), time per call side by
    side (``side_by_side``), and the kernel manager's rankings as it measured them."""

    section_id = ""
    config_columns = ["sweep", "batch", "seq_len", "embed_dim", "heads", "head_dim", "causal", "dtype"]

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._managers: dict[tuple[str, ...] | None, AttentionKernelManager] = {}
        self._inputs: tuple[str, Tensor] | None = None
        self._mha: dict[tuple, nn.MultiheadAttention] = {}
        self._backends: tuple[str, ...] | None = None  # set by cases() from the section (None: the hardware's)
        self._seed = 0  # set by cases() from the section

    def bind(self, device: str) -> ModuleStudy:
        return type(self)(device)

    def section(self, params: Params, target: Target):
        raise NotImplementedError

    def shapes(self, sec) -> list[tuple[str, int, int, bool]]:
        """(sweep, batch, seq_len, causal) of the section's points."""
        raise NotImplementedError

    def harness_options(self, params: Params, target: Target) -> dict[str, Any]:
        sec = self.section(params, target)
        return {"host_calls": sec.host_calls, "kernel_calls": sec.kernel_calls}

    # ------------------------------------------------------------------ cases

    def cases(self, params: Params, target: Target) -> list[Case]:
        sec = self.section(params, target)
        self._backends = None if sec.manager_backends is None else tuple(sec.manager_backends)
        self._seed = sec.seed
        out, seen = [], set()
        for sweep, b, s, causal in self.shapes(sec):
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
            self._mha[key] = seeded_mha(c["embed_dim"], c["heads"], self.device, DTYPES[c["dtype"]], self._seed)
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
        ada = AdaAttention(c["embed_dim"], c["heads"], batch_first=True, kernel_manager=self._manager(),
                           device=self.device,
                           dtype=DTYPES[c["dtype"]], **kwargs)
        ada.load_state_dict(mha.state_dict())
        return _Direct(ada, provider.removeprefix("direct:")) if provider.startswith("direct:") else ada

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
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
        """The providers side by side and the kernel manager's rankings as it measured them."""
        return self._side_by_side(params, target) + self.manager_rows()

    def manager_rows(self) -> list[dict]:
        return [r for manager in self._managers.values() for r in manager_rows(manager, self.section_id, "adaattn")]

    def direct(self, case: Case) -> list[str]:
        return [p for p in case.providers if p.startswith("direct:") and self.unavailable(p, self.device) is None]

    def side_by_side_names(self, case: Case) -> list[str]:
        """The providers of ``case`` timed side by side (adaattn among them, its ratio to each of the others
        read round by round); the ones under test are ``side_by_side_keep``'s."""
        raise NotImplementedError

    def side_by_side_keep(self, case: Case) -> list[str]:
        return ["adaattn"]

    def settle(self, params: Params) -> float | None:
        """A goal's bound on adaattn's ratio: its rounds take one more block where the interval still spans it."""
        return None

    def _side_by_side(self, params: Params, target: Target) -> list[dict]:
        """``side_by_side_ms`` per case and mode, the calls interleaved, and adaattn's ``paired_ratio`` to
        each other provider (``side_by_side_names``)."""
        groups, keep = [], {"adaattn"}
        for case in self.cases(params, target):
            names = self.side_by_side_names(case)
            if "adaattn" not in names:
                continue
            keep |= set(self.side_by_side_keep(case))
            base = {"table_id": self.section_id, "case_id": case.case_id, "kernel": "", **case.config}
            for mode in case.modes:
                timed = [p for p in names if mode == "fwd" or self.has_backward(p)]
                groups.append((base, mode, {p: functools.partial(self.setup, case, p, mode != "fwd") for p in timed}))
        if not groups:
            return []
        sec = self.section(params, target)
        return side_by_side_rows(groups, self.device, keep=sorted(keep), rounds=sec.side_by_side, seed=sec.seed,
                                 paired="adaattn", settle=self.settle(params))
