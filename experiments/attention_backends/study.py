"""Attention backends study: regenerates G1-T1, G1-T2 and G0-C1 ("SDPA 10-15x faster than naive").

G1-T2 is the guide's single point (B=32, S=1024, d_model=1024, H=16 -> head dim 64, forward).
G1-T1's relative-speed claims are checked there and across a sweep that a reader of the guide
would need before believing them: sequence length 512 ... 16384 at a fixed token count (so the
work per point grows with S while the batch shrinks), head dim 64 and 128 (the two sizes every
fused kernel specialises for), causal and not, bf16 and fp16, forward and forward+backward.
"""

from __future__ import annotations


import torch
from torch import Tensor

from adaattn.attention.providers import PROVIDERS, AttentionCase
from adaattn.attention.reference import attention_ref
from adaattn_pipeline.bench.compile_cache import FreshCompiles, WarmItem, segments
from adaattn_pipeline.bench.harness import Case, Workload
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.config import Params, Target

SECTION_IDS = ("G1-T2", "G1-T1")


class AttentionBackends(StudyDef):
    name = "attention_backends"
    table_ids = ("G1-T1", "G1-T2", "G0-C1")
    config_columns = ["batch", "seq_len", "heads", "head_dim", "causal", "dtype"]
    sections = ("G1-T2", "G1-T1")

    # ------------------------------------------------------------------ cases

    def cases(self, params: Params, target: Target) -> list[Case]:
        t2 = getattr(params.g1_t2, target.profile)
        t1 = getattr(params.g1_t1, target.profile)
        out = [
            self._case("G1-T2", t2.batch, t2.seq_len, t2.heads, t2.d_model // t2.heads, False, dtype, t2)
            for dtype in t2.dtypes
        ]
        for head_dim in t1.head_dims:
            for causal in t1.causal:
                for dtype in t1.dtypes:
                    for seq_len in t1.seq_lens:
                        out.append(self._case("G1-T1", t1.tokens // seq_len, seq_len, t1.d_model // head_dim,
                                              head_dim, causal, dtype, t1))
        return out

    @staticmethod
    def _case(table_id: str, batch: int, seq_len: int, heads: int, head_dim: int, causal: bool, dtype: str,
              section) -> Case:
        mask = "causal" if causal else "full"
        return Case(
            case_id=f"{table_id}/b{batch}-s{seq_len}-h{heads}-d{head_dim}-{mask}-{dtype}",
            table_id=table_id,
            config={"batch": batch, "seq_len": seq_len, "heads": heads, "head_dim": head_dim, "causal": causal,
                    "dtype": dtype},
            providers=tuple(section.providers),
            modes=tuple(section.modes),
        )

    # ------------------------------------------------------------------ harness hooks

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._inputs: tuple[str, tuple[Tensor, Tensor, Tensor]] | None = None
        self._compiles = FreshCompiles()

    def bind(self, device: str) -> AttentionBackends:
        """A fresh instance for one run on ``device``."""
        return AttentionBackends(device)

    def _attn_case(self, case: Case) -> AttentionCase:
        return AttentionCase(device=self.device, **case.config)

    def inputs(self, case: Case) -> tuple[Tensor, Tensor, Tensor]:
        """(B, H, S, D) q, k, v: N(0, 1), fresh per case, shared by every provider of the case."""
        if self._inputs is None or self._inputs[0] != case.case_id:
            self._inputs = None
            c = self._attn_case(case)
            shape = (c.batch, c.heads, c.seq_len, c.head_dim)
            self._inputs = (case.case_id, tuple(
                torch.randn(shape, device=self.device, dtype=c.torch_dtype) for _ in range(3)))
        return self._inputs[1]

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
        p = PROVIDERS[provider]
        c = self._attn_case(case)
        q, k, v = self.inputs(case)
        if p.layout == "bshd":
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, S, H, D)
        q, k, v = (t.detach().clone().requires_grad_(requires_grad) for t in (q, k, v))
        if p.compiled:
            self._compiles.enter(self.compile_key(case, provider))
        fn = p.build(c)
        # the reference covers the first batch element
        to_ref = (lambda t: t.transpose(1, 2)[:1]) if p.layout == "bshd" else (lambda t: t[:1])
        return Workload(fwd=lambda: fn(q, k, v), inputs=[q, k, v], flops_fwd=c.flops_fwd(),
                        to_reference_layout=to_ref)

    @staticmethod
    def compile_key(case: Case, provider: str) -> tuple:
        """What a compile of ``provider`` depends on: dtype, head dim and mask (B and S are symbolic),
        and whether B is 1 (dynamo specialises a size of 1: its own graph)."""
        c = case.config
        return provider, c["dtype"], c["head_dim"], c["causal"], c["batch"] == 1

    def compile_groups(self, cases: list[Case]) -> list[list[WarmItem]]:
        """First calls of the compiled providers, cut into segments (see ``bench.compile_cache``):
        runs of one compile key in the order the harness makes them, both modes included."""
        items = [(case, provider, mode) for case in cases for provider in case.providers
                 if PROVIDERS[provider].compiled and not PROVIDERS[provider].unavailable(self.device)
                 for mode in case.modes if mode == "fwd" or self.has_backward(provider)]
        return segments(items, lambda item: self.compile_key(item[0], item[1]))

    def host_warm_items(self, cases: list[Case]) -> list[WarmItem]:
        """First calls whose cost is on the host (cuDNN builds a graph per new shape and mode), for
        the measuring process to make while the workers compile."""
        return [(case, provider, mode) for case in cases for provider in case.providers
                if PROVIDERS[provider].host_plans and not PROVIDERS[provider].unavailable(self.device)
                for mode in case.modes if mode == "fwd" or self.has_backward(provider)]

    def reference(self, case: Case) -> Tensor:
        # First batch element only: the float64 reference costs S^2 memory per head, and every
        # batch element runs the same kernel path.
        q, k, v = (t[:1] for t in self.inputs(case))
        return attention_ref(q, k, v, causal=case.config["causal"])

    def unavailable(self, provider: str, device: str) -> str | None:
        return PROVIDERS[provider].unavailable(device)

    def has_backward(self, provider: str) -> bool:
        return self.device in PROVIDERS[provider].backward_devices

    # ------------------------------------------------------------------ report



STUDY = AttentionBackends()
