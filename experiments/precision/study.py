"""Precision study: regenerates G2-T3 ("Precision Mode Accuracy") and G2-T2's precision line
("1.5-2x speedup with FP16/BF16").

Providers are precisions: fp32, tf32 (fp32 tensors, ``torch.set_float32_matmul_precision("high")``
around each call: TF32 tensor cores for fp32 matmuls; CUDA only), fp16, bf16. Two ops:

- ``attention``: ``F.scaled_dot_product_attention`` (PyTorch's own backend choice) on (B, H, S, D);
- ``block``: a pre-norm transformer block, LayerNorm -> AdaAttention (precision fixed to the
  provider's, ``rank_mode="full"``) -> residual -> LayerNorm -> MLP (4E, GELU) -> residual, its
  parameters and input in the provider's dtype. Its attention backend is the kernel manager's choice
  per signature (``manager_ranking`` rows; the report names it beside each row): the block's memory
  is that backend's.

Inputs: N(0, 1), and with outliers: N(0, 1) + N(0, outlier_std^2) x Bernoulli(outlier_prob)
(params.yaml). Every provider starts from the same fp32 draw, cast. Accuracy (MSE, relative L1
and L2, cosine similarity) is against float64 on the first batch element; fp32's own error is
the floor the others are read against.

- ``fp8_attention`` (``G2-T3.<profile>.fp8``, issue 68): 8-bit attention beside bf16, forward only, every
  provider on the same bf16 inputs and read against float64 attention over them: SDPA (its own choice and its
  cuDNN backend), ours (``kernels/fp8_attention.py``: int8 Q·K and FP8 P·V as AdaAttention runs it; P·V in bf16;
  Q·K in e4m3), SageAttention 1.0.6; on N(0, 1) and outlier inputs at each length, causal or not, and on the rank
  study's captured MiniLM q, k, v; AdaAttention's FP8 guard on each case's inputs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaattn.attention.ada import AdaAttention
from adaattn.attention.hardware import HardwareCapabilities
from adaattn.attention.kernel_manager import AttentionKernelManager
from adaattn.attention.precision import PrecisionPolicy
from adaattn.attention.reference import attention_ref
from adaattn.kernels.fp8_attention import fp8_attention
from adaattn.kernels.runtime import interpreter
from adaattn_pipeline.bench.harness import Case, Workload
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.common.modules import manager_rows, module_reference
from adaattn_experiments.common import real_inputs

DTYPE_OF = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@contextlib.contextmanager
def matmul_precision(precision: str):
    """TF32 for fp32 matmuls inside (``tf32``); the default ("highest") otherwise."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class Block(nn.Module):
    """Pre-norm transformer block around AdaAttention; ``reference`` runs it in float64."""

    def __init__(self, embed_dim: int, heads: int, precision: str, manager: AttentionKernelManager, device: str):
        super().__init__()
        mode = "fp32" if precision == "tf32" else precision
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim, device=device), nn.LayerNorm(embed_dim, device=device)
        self.attn = AdaAttention(embed_dim, heads, batch_first=True, precision_mode=mode, rank_mode="full",
                                 kernel_manager=manager,
                                 device=device)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim, device=device), nn.GELU(),
                                 nn.Linear(4 * embed_dim, embed_dim, device=device))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))

    def reference(self, x: Tensor) -> Tensor:
        """The same block in float64 (attention through the chunked float64 reference)."""
        def ln(m: nn.LayerNorm, t: Tensor) -> Tensor:
            return F.layer_norm(t, m.normalized_shape, m.weight.double(), m.bias.double(), m.eps)

        def lin(m: nn.Linear, t: Tensor) -> Tensor:
            return F.linear(t, m.weight.double(), m.bias.double())

        x = x.double()
        h = ln(self.norm1, x)
        mha = nn.MultiheadAttention(self.attn.embed_dim, self.attn.num_heads, batch_first=True, device=x.device)
        mha.load_state_dict(self.attn.state_dict())
        x = x + module_reference(mha, h, causal=False)
        return x + lin(self.mlp[2], F.gelu(lin(self.mlp[0], ln(self.norm2, x))))


class PrecisionStudy(StudyDef):
    name = "precision"
    table_ids = ("G2-T3",)  # and G2-T2's precision line, in the G2-T3 section
    config_columns = ["op", "inputs", "batch", "seq_len", "embed_dim", "heads", "head_dim", "dtype", "causal",
                      "layer"]
    sections = ("G2-T3",)

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._inputs: tuple[str, Tensor | tuple[Tensor, ...]] | None = None
        self._blocks: dict[str, Block] = {}
        # one manager for the study: the block's backend is chosen at its first call per precision and mode, and
        # a block's peak memory is its backend's (``manager_ranking`` rows; the report names it)
        self._manager = AttentionKernelManager()
        self._section = None
        self._guard: dict[str, tuple[Case, dict]] = {}  # case id -> (case, the FP8 guard's check on its inputs)

    def bind(self, device: str) -> PrecisionStudy:
        return PrecisionStudy(device)

    @property
    def data_deps(self) -> tuple[str, ...]:
        return (real_inputs.CAPTURE.as_posix(),)  # the 8-bit rows' real inputs (the real_inputs stage)

    def cases(self, params: Params, target: Target) -> list[Case]:
        sec = getattr(params.g2_t3, target.profile)
        self._section = sec
        out = []
        for op in sec.ops:
            for inputs in sec.inputs:
                cfg = {"op": op, "inputs": inputs, "batch": sec.batch, "seq_len": sec.seq_len,
                       "embed_dim": sec.embed_dim, "heads": sec.heads, "head_dim": sec.embed_dim // sec.heads,
                       "dtype": "fp32", "causal": False, "layer": None}  # the inputs' master dtype; each casts
                out.append(Case(case_id=f"G2-T3/{op}-{inputs}-b{sec.batch}-s{sec.seq_len}-e{sec.embed_dim}",
                                table_id="G2-T3", config=cfg, providers=tuple(sec.precisions), modes=tuple(sec.modes)))
        return out + self._fp8_cases(sec.fp8)

    def _fp8_cases(self, fp8) -> list[Case]:
        if fp8 is None:
            return []
        out = []
        B, H, D = fp8.batch, fp8.heads, fp8.head_dim
        for S in fp8.seq_lens:
            for causal in fp8.causal:
                for inputs in fp8.inputs:
                    cfg = {"op": "fp8_attention", "inputs": inputs, "batch": B, "seq_len": S, "embed_dim": H * D,
                           "heads": H, "head_dim": D, "dtype": "bf16", "causal": causal, "layer": None}
                    out.append(Case(case_id=f"G2-T3/fp8-{inputs}-{'causal' if causal else 'full'}-b{B}-h{H}-s{S}-d{D}",
                                    table_id="G2-T3", config=cfg, providers=tuple(fp8.providers), modes=("fwd",)))
        for layer in fp8.real_layers:
            cfg = {"op": "fp8_attention", "inputs": "real", "batch": 1, "seq_len": fp8.real_seq_len,
                   "embed_dim": real_inputs.HEADS * real_inputs.HEAD_DIM, "heads": real_inputs.HEADS,
                   "head_dim": real_inputs.HEAD_DIM,
                   "dtype": "bf16", "causal": False, "layer": layer}
            out.append(Case(case_id=f"G2-T3/fp8-real-l{layer}-s{fp8.real_seq_len}", table_id="G2-T3", config=cfg,
                            providers=tuple(fp8.providers), modes=("fwd",)))
        return out

    def _draw(self, shape: tuple[int, ...], outliers: bool) -> Tensor:
        x = torch.randn(shape, device=self.device)
        if outliers:
            sec = self._section
            hit = torch.rand(shape, device=self.device) < sec.outlier_prob
            x = x + hit * torch.randn(shape, device=self.device) * sec.outlier_std
        return x

    def inputs(self, case: Case) -> Tensor | tuple[Tensor, ...]:
        if self._inputs is None or self._inputs[0] != case.case_id:
            self._inputs = None
            c = case.config
            outliers = c["inputs"] == "outliers"
            if c["inputs"] == "real":  # MiniLM's q, k, v at a layer, bf16 as the providers take them
                x: Any = tuple(t.to(self.device, torch.bfloat16)
                               for t in real_inputs.captured_qkv(c["seq_len"], c["layer"]))
            elif c["op"] == "fp8_attention":
                shape = (c["batch"], c["heads"], c["seq_len"], c["head_dim"])
                x = tuple(self._draw(shape, outliers).bfloat16() for _ in range(3))
            elif c["op"] == "attention":
                shape = (c["batch"], c["heads"], c["seq_len"], c["head_dim"])
                x = tuple(self._draw(shape, outliers) for _ in range(3))
            else:
                x = self._draw((c["batch"], c["seq_len"], c["embed_dim"]), outliers)
            self._inputs = (case.case_id, x)
        return self._inputs[1]

    def _block(self, case: Case) -> Block:
        c = case.config
        if case.case_id not in self._blocks:
            self._blocks = {}  # one case's block at a time
            torch.manual_seed(0)
            self._blocks[case.case_id] = Block(c["embed_dim"], c["heads"], "fp32", self._manager, self.device)
        return self._blocks[case.case_id]

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
        c = case.config
        if c["op"] == "fp8_attention":
            return self._fp8_setup(case, provider)
        dtype = DTYPE_OF[provider]
        if c["op"] == "attention":
            q, k, v = (t.to(dtype, copy=True).requires_grad_(requires_grad) for t in self.inputs(case))

            def fn() -> Tensor:
                with matmul_precision(provider):
                    return F.scaled_dot_product_attention(q, k, v)

            leaves = [q, k, v]
            flops = 4 * c["batch"] * c["heads"] * c["seq_len"] ** 2 * c["head_dim"]
        else:
            master = self._block(case)
            block = Block(c["embed_dim"], c["heads"], provider, self._manager, self.device)
            block.load_state_dict(master.state_dict())
            block.to(dtype)
            x = self.inputs(case).to(dtype, copy=True).requires_grad_(requires_grad)

            def fn() -> Tensor:
                with matmul_precision(provider):
                    return block(x)

            leaves = [x, *block.parameters()] if requires_grad else [x]
            B, S, E = c["batch"], c["seq_len"], c["embed_dim"]
            flops = 2 * B * S * E * 4 * E + 4 * B * S * S * E + 2 * B * S * E * 8 * E
        return Workload(fwd=fn, inputs=leaves, flops_fwd=flops, to_reference_layout=lambda o: o[:1])

    def _fp8_setup(self, case: Case, provider: str) -> Workload:
        """One 8-bit or bf16 attention forward on the case's bf16 inputs (no gradient: forward rows only)."""
        c = case.config
        q, k, v = self.inputs(case)
        causal = c["causal"]
        if provider == "sdpa_cudnn_bf16":
            def fn() -> Tensor:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        elif provider == "sdpa_bf16":
            def fn() -> Tensor:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        elif provider == "sage":
            from sageattention import sageattn

            def fn() -> Tensor:
                return sageattn(q, k, v, tensor_layout="HND", is_causal=causal)
        else:
            if provider == "fp8" and case.case_id not in self._guard:
                self._guard[case.case_id] = (case, self._guard_check(case, q, k, v))

            pv_fp8, qk_int8 = provider != "fp8_pv_bf16", provider != "fp8_e4m3_qk"

            def fn() -> Tensor:
                with torch.no_grad():
                    return fp8_attention(q, k, v, causal, pv_fp8=pv_fp8, qk_int8=qk_int8)
        flops = 4 * c["batch"] * c["heads"] * c["seq_len"] ** 2 * c["head_dim"] // (2 if causal else 1)
        return Workload(fwd=fn, inputs=[q, k, v], flops_fwd=flops, to_reference_layout=lambda o: o[:1])

    def _guard_check(self, case: Case, q: Tensor, k: Tensor, v: Tensor) -> dict:
        """AdaAttention's FP8 guard on the case's inputs, as the module runs it (``precision_mode="fp8"``)."""
        policy = PrecisionPolicy("fp8", fp8_max_rel_l2=self._section.fp8.fp8_max_rel_l2)
        mask_kind = "causal" if case.config["causal"] else "none"
        policy.choose(q, k, v, q.shape[-1] ** -0.5, HardwareCapabilities.detect(q.device), case.case_id, mask_kind)
        return policy.fp8_checks[case.case_id]

    def reference(self, case: Case) -> Tensor:
        c = case.config
        if c["op"] == "fp8_attention":  # over the bf16 inputs every provider reads: the attention's error alone
            return attention_ref(*(t[:1] for t in self.inputs(case)), causal=c["causal"])
        if c["op"] == "attention":
            return attention_ref(*(t[:1] for t in self.inputs(case)))
        return self._block(case).reference(self.inputs(case)[:1])

    def unavailable(self, provider: str, device: str) -> str | None:
        why = fp8_unavailable(provider, device)
        if why or provider not in DTYPE_OF:
            return why
        if provider == "tf32" and device != "cuda":
            return "TF32 is a tensor-core mode of NVIDIA GPUs (Ampere and newer); a CPU has none"
        if provider == "tf32" and torch.cuda.get_device_capability() < (8, 0):
            return "TF32 needs compute capability 8.0 or newer"
        return None

    def has_backward(self, provider: str) -> bool:
        return True

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        """The block's kernel manager: its ranking per signature (precision, grad mode), fastest first; the FP8
        guard's check on each 8-bit case's inputs (its estimate, whether it accepted FP8, its bound)."""
        rows = []
        for case_id, (case, check) in self._guard.items():
            for metric, value in (("fp8_guard_estimate", check["estimate"]), ("fp8_guard_accepted",
                                  float(check["accepted"])), ("fp8_guard_bound", check["bound"])):
                rows.append({**case.config, "table_id": "G2-T3", "case_id": case_id, "provider": "fp8_guard",
                             "mode": "fwd", "metric": metric, "value": value, "unit": "", "status": "ok",
                             "reason": check["reason"] or ""})
        return manager_rows(self._manager, "G2-T3", "block") + rows


def fp8_unavailable(provider: str, device: str) -> str | None:
    """Why an 8-bit row's provider cannot run on ``device`` (None: it can)."""
    if provider == "sdpa_cudnn_bf16" and device != "cuda":
        return "cuDNN attention is NVIDIA's; this device is a CPU"
    if provider in ("fp8", "fp8_pv_bf16", "fp8_e4m3_qk"):
        if device != "cuda" and not interpreter():
            return "our FP8 attention is Triton kernels for a CUDA GPU (TRITON_INTERPRET=1 runs them for tests)"
        if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
            return "FP8 tensor cores need compute capability 8.9 or newer"
    if provider == "sage":
        if device != "cuda":
            return "SageAttention is Triton kernels for a CUDA GPU"
        try:
            import sageattention  # noqa: F401
        except ImportError as err:
            return f"sageattention is not importable here ({err}); its wheel is carried in .whl"
    return None


STUDY = PrecisionStudy()
