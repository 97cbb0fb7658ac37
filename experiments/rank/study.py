"""Rank study (G2-C1, "adaptive rank + precision kernel"): what the low-rank path costs in error and
gains in speed, and how well the adaptive policy picks a rank.

Inputs, (B, H, S, D), per sequence length:
- ``spread-r<r>``: queries and keys drawn around r cluster centres per head (N(0, I) centres,
  tokens assigned uniformly at random over the sequence, noise ``cluster_noise``): rows (and
  columns) of one cluster are nearly equal, so every attention matrix has rank about r;
- ``contiguous-r<r>``: the same, with each cluster one contiguous run of S/r tokens (locality,
  the structure segment-mean landmarks summarise);
- ``random``: N(0, 1) queries and keys, no low-rank structure;
- ``minilm-l<i>``: real inputs, the queries, keys and values of layer i of all-MiniLM-L6-v2
  over real text (``minilm.py``; 12 heads of 32 dims, windows of at most 512 word pieces,
  ``real_layers`` and ``real_seq_lens``), cast to the study's dtype: read from the capture the
  ``real_inputs`` stage writes (``minilm.CAPTURE``), so that every target sees the same q, k, v
  (a ``real_inputs_source`` row names where they came from).
Values of the synthetic inputs are N(0, 1).

Providers, forward: each exact backend of ``exact_providers`` (the kernel manager's, called
directly), ``nystrom-<r>`` and ``pooled-<r>`` (the two low-rank paths, ``rank.LOW_RANK_METHODS``)
for each rank of ``ranks`` up to S/2, and ``policy``: the path that ``rank_mode="auto"``'s policy
(``rank.choose_rank``, both paths) picks for these inputs (its one-time estimate is not timed; the
study lifts AdaAttention's minimum length, so the policy is seen at every S). As in AdaAttention,
a path within the error budget is taken only where it is faster than the exact path, timed side by
side by a kernel manager (``AttentionKernelManager.time_ops``: GPU-time turns, as it ranks backends);
the exact path, there and where the policy stays exact, is that manager's first of the
study's ``exact_providers`` (``_exact``). Error: against
float64 on the first batch element. ``pooled-<r>`` runs what ``rank.pooled_attention`` runs for a
forward without autograd: two fused Triton launches on a GPU where S is a multiple of r (the
segment means, then attention over them with P V~ in the input dtype, as flash attention), else
one SDPA call over the r segment means; ``nystrom-<r>`` runs what
``rank.nystrom_attention`` runs for a forward without autograd: the Triton kernels on a GPU up
to their rank limit (the r x r solve fused up to 128 landmarks, batched matmuls beyond), the
PyTorch path beyond it and on the CPU (the recorded kernel names say which; the report's goal
table names the path).

Extra rows per case and head: the sampled spectrum rank and entropy rank (the estimators), the
effective rank of the full attention matrix (99% of the squared singular values; S up to
``full_spectrum_max_len``), and the policy's estimate, landmarks and sampled error.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import torch
from torch import Tensor

from adaattn.attention.backends import BACKENDS, Signature
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.providers import DTYPES
from adaattn.attention.rank import (
    LOW_RANK_METHODS,
    PINV_ITERS,
    PINV_MATMULS_PER_ITER,
    LowRank,
    Speed,
    choose_rank,
    estimate_rank,
    low_rank_attention,
    skip_reason,
)
from adaattn.attention.reference import attention_ref
from adaattn_pipeline.bench.harness import Case, Workload
from adaattn_pipeline.bench.study import StudyDef
from adaattn.timing.timers import make_timer
from adaattn_pipeline.config import ConfigError, Params, Target
from adaattn_experiments.rank import minilm
from adaattn_experiments.common.modules import backend_unavailable
from adaattn_pipeline.bench.side_by_side import side_by_side_rows



def low_rank_of(provider: str) -> LowRank | None:
    """``nystrom-<r>`` / ``pooled-<r>`` -> that low-rank path; any other provider -> None."""
    method, _, r = provider.rpartition("-")
    return LowRank(method, int(r)) if method in LOW_RANK_METHODS and r.isdigit() else None


class RankStudy(StudyDef):
    name = "rank"
    table_ids = ("G2-C1",)
    config_columns = ["inputs", "true_rank", "batch", "heads", "seq_len", "head_dim", "dtype", "head"]
    sections = ("G2-C1",)
    extra_params = ("verdicts.low_rank_min_len", "verdicts.low_rank_landmarks_div")  # the goal's cases are timed side by side

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._inputs: tuple[str, tuple[Tensor, Tensor, Tensor]] | None = None
        self._sec = None
        self._policy: dict[str, tuple[int | None, dict]] = {}
        self._policy_manager: AttentionKernelManager | None = None  # the policy's exact path (``_exact``)
        self._cases: list[Case] = []
        self._real_source: dict[str, str] | None = None  # minilm.source() of the capture the real inputs came from

    def bind(self, device: str) -> RankStudy:
        return RankStudy(device)

    @property
    def data_deps(self) -> tuple[str, ...]:
        return (minilm.CAPTURE.as_posix(),)  # real inputs: q, k, v captured on the CPU (the real_inputs stage)

    def extra_stages(self, raw: dict) -> dict[str, dict]:
        # the capture runs on the CPU (the `real` extra) and is tracked in git like results: a capture on
        # another CPU need not give the same bits, and a new file would make every target's results stale
        keys = [f"G2-C1.{p}.{k}" for p in ("cpu", "gpu") for k in ("real_layers", "real_seq_lens")]
        return {"real_inputs": {"cmd": "python -m adaattn_experiments.rank.capture",
                                "modules": ["adaattn_experiments.rank.capture"], "params": keys,
                                "outs": [minilm.CAPTURE.as_posix()]}}

    def harness_options(self, params: Params, target: Target) -> dict[str, Any]:
        # kernel time too: the low-rank goal is read on both (the fused Nyström path is a few launches whose
        # host time can exceed their kernel time)
        return {"kernel_calls": getattr(params.g2_c1, target.profile).kernel_calls}

    def cases(self, params: Params, target: Target) -> list[Case]:
        sec = getattr(params.g2_c1, target.profile)
        self._sec = sec
        kinds = [(f"{layout}-r{r}", r) for layout in sec.cluster_layouts for r in sec.true_ranks]
        kinds += [("random", 0)] if sec.random_inputs else []
        shapes = [(kind, true_rank, sec.batch, sec.heads, S, sec.head_dim) for kind, true_rank in kinds
                  for S in sec.seq_lens]
        if sec.real_layers:
            why = minilm.captured_unavailable(sec.real_seq_lens, sec.real_layers, minilm.CAPTURE)
            if why:
                raise ConfigError(f"G2-C1.{target.profile}.real_layers: real attention inputs: {why}; or set "
                                  "real_layers and real_seq_lens to []")
            heads, head_dim = minilm.HEADS, minilm.HEAD_DIM
            shapes += [(f"minilm-l{i}", 0, 1, heads, S, head_dim) for i in sec.real_layers for S in sec.real_seq_lens]
        out = []
        for kind, true_rank, B, H, S, D in shapes:
            providers = (*sec.exact_providers, *(f"{m}-{r}" for m in LOW_RANK_METHODS for r in sec.ranks
                                                  if r <= S // 2), "policy")
            out.append(Case(
                case_id=f"G2-C1/{kind}-b{B}-h{H}-s{S}-d{D}-{sec.dtype}", table_id="G2-C1", providers=providers,
                modes=("fwd",), config={"inputs": kind, "true_rank": true_rank, "batch": B, "heads": H, "seq_len": S,
                                        "head_dim": D, "dtype": sec.dtype}))
        self._cases = out
        return out

    # ------------------------------------------------------------------ inputs

    def inputs(self, case: Case) -> tuple[Tensor, Tensor, Tensor]:
        """Deterministic per case (seeded by its id): the extra rows see the inputs the timings saw."""
        if self._inputs is None or self._inputs[0] != case.case_id:
            self._inputs = None
            c = case.config
            dt = DTYPES[c["dtype"]]
            if c["inputs"].startswith("minilm-l"):
                layer = int(c["inputs"].removeprefix("minilm-l"))
                qkv, self._real_source = minilm.captured(c["seq_len"], minilm.CAPTURE)
                self._inputs = (case.case_id, tuple(t.to(self.device, dt) for t in qkv[layer]))
                return self._inputs[1]
            g = torch.Generator(device=self.device).manual_seed(zlib.crc32(case.case_id.encode()))
            B, H, S, D = c["batch"], c["heads"], c["seq_len"], c["head_dim"]

            def randn(*shape: int) -> Tensor:
                return torch.randn(shape, generator=g, device=self.device)

            if c["true_rank"]:
                r = c["true_rank"]
                centres = randn(1, H, r, D)

                def clustered() -> Tensor:
                    if c["inputs"].startswith("contiguous"):
                        which = (torch.arange(S, device=self.device) * r // S).expand(B, H, S)
                    else:
                        which = torch.randint(0, r, (B, H, S), generator=g, device=self.device)
                    picked = torch.gather(centres.expand(B, H, r, D), 2, which[..., None].expand(B, H, S, D))
                    return picked + self._sec.cluster_noise * randn(B, H, S, D)

                q, k = clustered(), clustered()
            else:
                q, k = randn(B, H, S, D), randn(B, H, S, D)
            self._inputs = (case.case_id, (q.to(dt), k.to(dt), randn(B, H, S, D).to(dt)))
        return self._inputs[1]

    def policy(self, case: Case) -> tuple[int | None, dict]:
        if case.case_id not in self._policy:
            q, k, v = self.inputs(case)
            self._policy[case.case_id] = choose_rank(q, k, v, sample=self._sec.sample_rows, min_len=1,
                                                     max_rel_error=self._sec.error_tolerance,
                                                     speed=functools.partial(self._speed, case))
        return self._policy[case.case_id]

    def _exact(self, case: Case) -> str:
        """The policy's exact path for the case: the first backend of a kernel manager over the study's exact
        providers that can run here, as AdaAttention's manager ranks its backends; measured once per signature."""
        if self._policy_manager is None:
            names = [p for p in self._sec.exact_providers if self.unavailable(p, self.device) is None]
            self._policy_manager = AttentionKernelManager(backends=names)
        q, k, v = self.inputs(case)
        with torch.no_grad():
            sig = Signature.of(q, k, "none")
            manager = self._policy_manager
            return (manager.ranking(sig) or manager.measure(sig, q, k, v, None, False, None))[0]

    def _speed(self, case: Case, choice: LowRank) -> Speed:
        """``choose_rank``'s ``speed``: the low-rank path against the exact path (``_exact``), side by side."""
        exact = self._exact(case)
        q, k, v = self.inputs(case)
        run = BACKENDS[exact].run
        with torch.no_grad():
            t = self._policy_manager.time_ops({"low-rank": lambda: low_rank_attention(q, k, v, choice),
                                                 exact: lambda: run(q, k, v, None, False, None)}, q.device)
        return Speed(t.get("low-rank", float("inf")), t.get(exact, float("inf")), exact)

    # ------------------------------------------------------------------ harness hooks

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
        q, k, v = (t.detach().requires_grad_(requires_grad) for t in self.inputs(case))
        if provider == "policy":
            choice, _ = self.policy(case)
            provider = f"{choice.method}-{choice.rank}" if choice is not None else self._exact(case)
        low = low_rank_of(provider)
        if low is not None:
            fn = lambda: low_rank_attention(q, k, v, low)  # noqa: E731
        else:
            run = BACKENDS[provider].run
            fn = lambda: run(q, k, v, None, False, None)  # noqa: E731
        c = case.config
        flops = 4 * c["batch"] * c["heads"] * c["seq_len"] ** 2 * c["head_dim"]  # of exact attention
        return Workload(fwd=fn, inputs=[q, k, v], flops_fwd=flops, to_reference_layout=lambda o: o[:1])

    def reference(self, case: Case) -> Tensor:
        return attention_ref(*(t[:1] for t in self.inputs(case)))

    def unavailable(self, provider: str, device: str) -> str | None:
        if provider in BACKENDS:
            return backend_unavailable(provider, device)
        return None

    def has_backward(self, provider: str) -> bool:
        return True

    # ------------------------------------------------------------------ estimators (outside the harness)

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        rows = self._estimator_rows()
        if self._real_source is not None:
            rows.append({"table_id": "G2-C1", "case_id": "G2-C1/real-inputs", "provider": "minilm", "mode": "",
                         "metric": "real_inputs_source", "value": len(self._sec.real_seq_lens),
                         "unit": "windows", "status": "ok", "reason": f"read from {minilm.CAPTURE}",
                         "kernel": "; ".join(f"{k}: {v}" for k, v in self._real_source.items())})
        if self.device == "cuda":
            rows += self._side_by_side(params) + self._solve_floor(params)
        return rows

    def _goal_cases(self, params: Params) -> list[tuple[Case, list[str]]]:
        """The cases the low-rank goal covers (S >= verdicts.low_rank_min_len) and their low-rank providers of at
        most S / verdicts.low_rank_landmarks_div landmarks."""
        out, v = [], params.verdicts
        for case in self._cases:
            S = case.config["seq_len"]
            low = [p for p in case.providers if (c := low_rank_of(p)) and c.rank <= S // v.low_rank_landmarks_div]
            if S >= v.low_rank_min_len and low:
                out.append((case, low))
        return out

    def _side_by_side(self, params: Params) -> list[dict]:
        """``side_by_side_ms`` of the goal's cases: the exact backends and the low-rank paths, interleaved."""
        if self._sec.side_by_side is None:
            return []
        groups = []
        for case, low in self._goal_cases(params):
            exact = [p for p in self._sec.exact_providers if self.unavailable(p, self.device) is None]
            names = exact + low
            base = {"table_id": "G2-C1", "case_id": case.case_id, "kernel": "", **case.config}
            groups.append((base, "fwd", {p: functools.partial(self.setup, case, p, False) for p in names}))
        # every low-rank path is kept: the goal reads each one's speedup, however slow
        return side_by_side_rows(groups, self.device, keep=[n for _, _, b in groups for n in b if low_rank_of(n)],
                                 rounds=self._sec.side_by_side)

    def _solve_floor(self, params: Params) -> list[dict]:
        """What the r x r solve of the goal's landmark counts costs at least on this GPU: one batched
        r x r x r product (B * heads of them) in fp32 and in bf16, times the pseudo-inverse's count of
        them (``PINV_ITERS`` x ``PINV_MATMULS_PER_ITER``), and a direct LU solve of the same system
        with head_dim right-hand sides (``torch.linalg.solve``, fp32). Random well-conditioned
        matrices: the times do not depend on the values."""
        dev = self.device
        timer = make_timer(dev, params.bench)
        rows, seen = [], set()
        gen = torch.Generator(device=dev).manual_seed(0)
        for case, low in self._goal_cases(params):
            c = case.config
            n = c["batch"] * c["heads"]
            for r in sorted({x.rank for x in map(low_rank_of, low) if x.method == "nystrom"}):  # pooled: no solve
                if (n, r, c["head_dim"]) in seen:
                    continue
                seen.add((n, r, c["head_dim"]))
                a = torch.randn(n, r, r, device=dev, generator=gen) / r**0.5 + torch.eye(r, device=dev)
                b = torch.randn(n, r, c["head_dim"], device=dev, generator=gen)
                a16 = a.to(torch.bfloat16)
                tf32 = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products, as the solve runs them
                try:
                    times = {"pinv_fp32_ms": timer(lambda: torch.bmm(a, a)),
                             "pinv_bf16_ms": timer(lambda: torch.bmm(a16, a16)),
                             "lu_solve_ms": timer(lambda: torch.linalg.solve(a, b))}
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = tf32
                n_mm = PINV_ITERS * PINV_MATMULS_PER_ITER
                what = {"pinv_fp32_ms": f"{n_mm} x one batched fp32 r x r x r product (the pseudo-inverse's count)",
                        "pinv_bf16_ms": f"{n_mm} x one batched bf16 r x r x r product (the same count at bf16's rate)",
                        "lu_solve_ms": "torch.linalg.solve, fp32, head_dim right-hand sides"}
                for metric, q in times.items():
                    k = n_mm if metric.startswith("pinv") else 1
                    rows.append({"table_id": "G2-C1", "case_id": f"G2-C1/solve-floor-n{n}-r{r}-d{c['head_dim']}",
                                 "provider": f"solve-{r}", "mode": "fwd", "metric": metric, "value": k * q.p50,
                                 "p20": k * q.p20, "p80": k * q.p80, "unit": "ms", "status": "ok",
                                 "reason": what[metric], "kernel": "", "batch": c["batch"], "heads": c["heads"],
                                 "head_dim": c["head_dim"], "dtype": "fp32" if metric != "pinv_bf16_ms" else "bf16"})
        return rows

    def _estimator_rows(self) -> list[dict]:
        rows = []
        for case in self._cases:
            q, k, v = self.inputs(case)
            c = case.config
            base = {"table_id": "G2-C1", "case_id": case.case_id, "mode": "fwd", "status": "ok", "reason": "",
                    "kernel": "", **c}
            est = estimate_rank(q, k, sample_rows=self._sec.sample_rows, energy=self._sec.energy)
            full = self._full_rank(q, k) if c["seq_len"] <= self._sec.full_spectrum_max_len else None
            for h in range(c["heads"]):
                head = {**base, "head": h, "provider": "estimator"}
                rows.append({**head, "metric": "spectrum_rank_sampled", "value": est["spectrum"][h].item(),
                             "unit": "singular values"})
                rows.append({**head, "metric": "entropy_rank", "value": est["entropy"][h].item(),
                             "unit": "exp(mean row entropy)"})
                if full is not None:
                    rows.append({**head, "metric": "spectrum_rank_full", "value": full[h].item(),
                                 "unit": "singular values"})
            choice, seen = self.policy(case)
            pol = {**base, "provider": "policy"}
            # kernel: the low-rank path the policy took, or the exact path's backend
            rows.append({**pol, "metric": "policy_rank", "value": choice.rank if choice is not None else 0,
                         "unit": "landmarks",  # 0: the exact path
                         "kernel": choice.method if choice is not None else self._exact(case),
                         "reason": "" if choice is not None else self._why_exact(seen)})
            if seen["speed"] is not None:
                sp, method = seen["speed"], list(seen["sample_rel_error"])[-1]
                why = (f"{seen['tried']} landmarks ({method}) and the exact path ({sp.exact}), timed side by side by "
                       "the policy")
                rows.append({**pol, "metric": "policy_low_rank_ms", "value": sp.low_rank_ms, "unit": "ms",
                             "kernel": method, "reason": why})
                rows.append({**pol, "metric": "policy_exact_ms", "value": sp.exact_ms, "unit": "ms",
                             "kernel": sp.exact, "reason": why})
            rows.append({**pol, "metric": "policy_tolerance", "value": self._sec.error_tolerance,
                         "unit": "rel L2"})  # the policy accepts on its sampled rows
            if seen["estimate"] is not None:
                rows.append({**pol, "metric": "policy_estimate", "value": seen["estimate"], "unit": "rank"})
            for method, err in seen["sample_rel_error"].items():
                rows.append({**pol, "metric": f"policy_sample_rel_l2_{method}", "value": err,
                             "unit": "rel L2", "reason": f"{seen['tried']} landmarks ({method}) on the sampled rows"})
        return rows

    def _why_exact(self, seen: dict) -> str:
        if seen["tried"] is None:
            return f"estimate {seen['estimate']} is not clearly low (> sample/2 or > S/16)"
        tolerance = None if seen["speed"] is not None else self._sec.error_tolerance  # only an error names it
        return skip_reason(None, seen, tolerance)  # AdaAttention's words for its statistics

    def _full_rank(self, q: Tensor, k: Tensor) -> Tensor:
        """(H,) effective rank of each head's full softmax matrix (batch element 0), float64."""
        p = torch.softmax((q[0].double() @ k[0].double().transpose(-2, -1)) / q.shape[-1] ** 0.5, dim=-1)
        s2 = torch.linalg.eigvalsh(p @ p.transpose(-2, -1)).flip(-1).clamp_min(0)  # squared singular values
        frac = s2.cumsum(-1) / s2.sum(-1, keepdim=True)
        return (frac < self._sec.energy).sum(-1) + 1



STUDY = RankStudy()
