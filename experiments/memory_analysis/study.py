"""The memory-analysis study (G3-T1): where an LTM transformer's memory goes, each component measured over sweeps
of one variable at a time, with and without the optimisation guide 003 names for it.

- ``parameters``: the model's parameter bytes (``n_layers``, ``dim``); optimised: INT8 weight-only linears.
- ``memory_bank``: the banks' bytes after a sequence long enough to fill them (``memory_slots``, ``dim``);
  optimised: the preset's compression against none, at the same context with room for every slot.
- ``attention``: one attention layer's training call (forward and backward), its peak over what was held before
  (``batch``, ``seq_len``): SDPA's math backend (the scores materialised); optimised: SDPA's fused backends.
- ``activations``: the model's forward with autograd recording, its peak over the weights (what the backward will
  read, ``batch``, ``seq_len``, ``dim``); optimised: full activation checkpointing.

Rows: ``memory_mb`` per component, ``mode`` plain or optimised, the swept ``variable`` and its value ``x``. The
report fits each component's exponent in each variable (log-log least squares) against the guide's O() formula.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaattn.timing.memory import peak_row
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.memory_analysis.schema import MemorySweep
from adaattn.models.config import ModelConfig
from adaattn.models.transformer import build_model
from adaattn.models.train import DTYPES
from adaattn.models.transformer import Attention

# which component depends on which variable (guide 003's O() formulas: the report's claimed exponents)
EXPONENTS = {"attention": {"batch": 1, "seq_len": 2}, "memory_bank": {"memory_slots": 1, "dim": 1},
             "activations": {"batch": 1, "seq_len": 1, "dim": 1}, "parameters": {"n_layers": 1, "dim": 2}}
OPTIMISATION = {"attention": "FlashAttention (SDPA's fused backends)", "memory_bank": "compression",
                "activations": "checkpointing (full)", "parameters": "quantization (INT8 weight-only)"}
MIB = 2**20


def variant(cfg: ModelConfig, variable: str, x: int) -> ModelConfig:
    """The preset with one model variable changed; a new width keeps the head dim and the GQA group."""
    if variable == "dim":
        group = cfg.n_heads // cfg.kv_heads
        heads = max(group, x // cfg.head_dim // group * group)
        return changed(cfg, dim=x, n_heads=heads, n_kv_heads=heads // group)
    if variable in ("memory_slots", "n_layers"):
        return changed(cfg, **{variable: x})
    return cfg


def changed(cfg: ModelConfig, **update: Any) -> ModelConfig:
    """The config with ``update``, validated (a swept value the model cannot take is named)."""
    return ModelConfig(**{**cfg.model_dump(), **update})


class MemoryAnalysis(StudyDef):
    name = "memory_analysis"
    table_ids = ("G3-T1",)
    config_columns = ["model", "batch", "seq_len", "variable", "x"]
    sections = ("G3-T1",)

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        return [raw[section][profile]["model"]]

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> MemoryAnalysis:
        return MemoryAnalysis(device)

    def cases(self, params: Params, target: Target) -> list:
        return []  # memory per component: extra_rows

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        sweep: MemorySweep = getattr(params.g3_t1, target.profile)
        preset = params.models[sweep.model]
        rows: list[dict] = []
        for variable, values in sweep.sweeps.items():
            for x in values:
                B = x if variable == "batch" else sweep.batch
                S = x if variable == "seq_len" else sweep.seq_len
                cfg = variant(changed(preset, checkpointing="none"), variable, x)
                base = {"table_id": "G3-T1", "case_id": f"G3-T1/{variable}-{x}", "kernel": "", "model": sweep.model,
                        "batch": B, "seq_len": S, "variable": variable, "x": x}
                for component, depends in EXPONENTS.items():
                    if variable in depends:
                        torch.manual_seed(sweep.seed)
                        rows += getattr(self, f"_{component}")(base, cfg, B, S, sweep)
                if self.device == "cuda":
                    torch.cuda.empty_cache()
        return rows

    def _row(self, base: dict, component: str, mode: str, nbytes: float, reason: str) -> dict:
        return {**base, "provider": component, "mode": mode, "metric": "memory_mb", "value": nbytes / MIB,
                "unit": "MiB", "status": "ok", "reason": reason}

    def _model(self, cfg: ModelConfig, sweep: MemorySweep) -> nn.Module:
        return build_model(cfg, device=self.device).to(DTYPES[sweep.dtype])

    def _parameters(self, base: dict, cfg: ModelConfig, B: int, S: int, sweep: MemorySweep) -> list[dict]:
        model = self._model(cfg, sweep)
        size = DTYPES[sweep.dtype].itemsize
        params = {id(t): t for t in model.parameters()}
        held = sum(t.numel() * t.element_size() for t in params.values())
        tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        # INT8 weight-only (models.quant's scheme, counted: an LTM layer reads its k and v weights directly, so the
        # module itself is not quantised): each linear weight one byte an entry and one scale a row; a head tied to
        # the embedding, the norms and the embeddings as they were
        saved = sum(m.weight.numel() * (size - 1) - m.out_features * size for m in model.modules()
                    if isinstance(m, nn.Linear) and id(m.weight) not in tied)
        return [self._row(base, "parameters", "plain", held, f"the parameters in {sweep.dtype}"),
                self._row(base, "parameters", "optimised", held - saved, "counted: INT8 weights and a scale a row "
                          "for every linear but a tied head")]

    def _memory_bank(self, base: dict, cfg: ModelConfig, B: int, S: int, sweep: MemorySweep) -> list[dict]:
        per_segment = cfg.segment_len // cfg.memory_compression
        context = cfg.segment_len * (-(-cfg.memory_slots // per_segment) + 1)  # enough segments to fill the bank
        tokens = torch.randint(0, cfg.vocab_size, (B, context), device=self.device)
        rows = []
        # plain: the preset, its bank filled; unoptimised: the same context kept whole, a slot a token (no
        # compression, room for every token): what compression and a bounded bank save
        whole = changed(cfg, memory_compression=1, memory_slots=context)
        for mode, c in (("plain", cfg), ("unoptimised", whole)):
            model = self._model(c, sweep).eval()
            with torch.no_grad():
                model(tokens)
            stats = model.get_memory_stats()
            rows.append(self._row(base, "memory_bank", mode, stats["bytes"],
                                  f"the banks after {context} tokens: {sum(stats['filled'])} slots in "
                                  f"{len(stats['filled'])} layers, compression {c.memory_compression}"))
            del model
        return rows

    def _attention(self, base: dict, cfg: ModelConfig, B: int, S: int, sweep: MemorySweep) -> list[dict]:
        dense = changed(cfg, memory_slots=None, positions="learned", max_seq_len=max(S, cfg.max_seq_len))
        layer = Attention(dense, None).to(self.device)
        x = torch.randn(B, S, cfg.dim, device=self.device, requires_grad=True)
        dtype = DTYPES[sweep.dtype]

        def call(math: bool) -> None:
            with (sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext()), \
                    torch.autocast(torch.device(self.device).type, dtype=dtype, enabled=dtype != torch.float32):
                y = layer(x)
            y.float().sum().backward()
            x.grad = None
            layer.zero_grad(set_to_none=True)

        return [peak_row({**base, "provider": "attention", "mode": mode, "metric": "memory_mb"},
                         functools.partial(call, math), self.device, 0,
                         "one layer's forward and backward, its peak over the input and weights")
                for mode, math in (("plain", True), ("optimised", False))]

    def _activations(self, base: dict, cfg: ModelConfig, B: int, S: int, sweep: MemorySweep) -> list[dict]:
        # a byte vocabulary: the logits (B x S x vocab) would otherwise outweigh the O(B x S x dim) states
        cfg = changed(cfg, vocab_size=256)
        tokens = torch.randint(0, cfg.vocab_size, (B, S), device=self.device)
        model = build_model(cfg, device=self.device).train()  # fp32 weights, autocast: as the model trains
        dtype = DTYPES[sweep.dtype]
        rows = []
        for mode, granularity in (("plain", "none"), ("optimised", "full")):
            model.set_checkpointing(granularity)

            def forward() -> torch.Tensor:
                with torch.autocast(torch.device(self.device).type, dtype=dtype, enabled=dtype != torch.float32):
                    return model(tokens)  # the graph the backward reads is held until the logits are dropped

            rows.append(peak_row({**base, "provider": "activations", "mode": mode, "metric": "memory_mb"}, forward,
                                 self.device, 0, f"the forward with autograd recording (checkpointing {granularity}), "
                                 "its peak over the weights"))
        return rows



STUDY = MemoryAnalysis()
