"""The CCGQA study (G4-C1's attention): HYDRA's CCGQA attention layer (``models.hydra.CCGQAttention``: the
down-projection, the convolutions, the attention in the latent, the up-projection) against the SDPA GQA layer of
the same width, query and kv heads (``models.transformer.Attention``, attention ``sdpa``), a training call
(forward and backward, the weights' gradients included) per preset and length, eager and in each compile mode,
each pair side by side in shuffled rounds; and each call's peak memory. Autocast to the sweep's dtype over fp32
weights, as the model trains. The goal (``verdicts.ccgqa_bound``) is read on the last compile mode's pair (the
eager pair's without one): CCGQA's time over SDPA GQA's, round by round.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from adaattn_pipeline.bench.harness import Case, Workload
from adaattn.timing.memory import peak_row
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.bench.side_by_side import call_of, side_by_side_rows
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.ccgqa.schema import CcgqaSweep
from adaattn.layers import RotaryEmbedding
from adaattn.models.config import ModelConfig
from adaattn.models.hydra import CCGQAttention
from adaattn.models.train import DTYPES
from adaattn.models.transformer import Attention

LAYERS = ("ccgqa", "sdpa_gqa")


def sdpa_twin(cfg: ModelConfig) -> ModelConfig:
    """The dense attention of a CCGQA preset's width, query and kv heads (head dim = width / heads)."""
    return ModelConfig(**{**cfg.model_dump(), "attention": "sdpa", "compression": 1, "recursions": 1,
                          "mod_capacity": None})


class Ccgqa(StudyDef):
    name = "ccgqa"
    table_ids = ("G4-C1",)
    config_columns = ["model", "batch", "seq_len", "dim", "heads", "kv_heads", "latent_head_dim"]
    sections = ("G4-C1",)

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        return list(raw[section][profile]["models"])

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> Ccgqa:
        return Ccgqa(device)

    def cases(self, params: Params, target: Target) -> list[Case]:
        return []  # a layer's training call, timed side by side: extra_rows measures it

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        sweep = getattr(params.g4_c1, target.profile)
        rows: list[dict] = []
        for name in sweep.models:
            cfg = params.models[name]
            torch.manual_seed(sweep.seed)
            rope = {k: RotaryEmbedding(c.head_dim, max(sweep.seq_lens), device=self.device)
                    for k, c in (("ccgqa", cfg), ("sdpa_gqa", sdpa_twin(cfg)))}
            layers = {"ccgqa": CCGQAttention(cfg, rope["ccgqa"]).to(self.device),
                      "sdpa_gqa": Attention(sdpa_twin(cfg), rope["sdpa_gqa"]).to(self.device)}
            for S in sweep.seq_lens:
                B = sweep.tokens // S
                base = {"table_id": "G4-C1", "case_id": f"G4-C1/{name}-b{B}-s{S}", "kernel": "", "model": name,
                        "batch": B, "seq_len": S, "dim": cfg.dim, "heads": cfg.n_heads, "kv_heads": cfg.kv_heads,
                        "latent_head_dim": cfg.head_dim}
                # the eager pair, then each compile mode's pair, each side by side in its own rounds
                pairs = [("", None)] + [(f":{m}", m) for m in sweep.compile_modes]
                for suffix, mode in pairs:
                    builders = {kind + suffix: functools.partial(self._workload, layers[kind], mode, B, S, cfg.dim,
                                                                 sweep) for kind in LAYERS}
                    rows += self._memory_rows(base, builders)
                    rows += side_by_side_rows([(base, "fwd_bwd", builders)], self.device, keep=list(builders),
                                              rounds=sweep.side_by_side, seed=sweep.seed, paired="ccgqa" + suffix,
                                              settle=params.verdicts.ccgqa_bound)
                # a fresh cache per length: past its recompile limit dynamo would run the layer eager, silently
                torch._dynamo.reset()
            del layers
        return rows

    def _workload(self, layer: torch.nn.Module, mode: str | None, B: int, S: int, dim: int,
                  sweep: CcgqaSweep) -> Workload:
        # static shapes, one graph per length: dynamic=None would turn a second length into a dynamic graph
        fn = layer if mode is None else torch.compile(layer, mode=mode, dynamic=False)
        x = torch.randn(B, S, dim, device=self.device, requires_grad=True)  # the fp32 residual stream
        dtype = DTYPES[sweep.dtype]

        def fwd() -> torch.Tensor:
            with (torch.autocast(torch.device(self.device).type, dtype=dtype) if dtype != torch.float32
                  else contextlib.nullcontext()):
                return fn(x)

        return Workload(fwd=fwd, inputs=[x, *layer.parameters()])  # the grads cleared before every call

    def _memory_rows(self, base: dict, builders: dict) -> list[dict]:
        """Each provider's training call's peak over what was held before it (its first call, a compile's
        included, made before: ``call_of`` runs one)."""
        rows = []
        for name, build in builders.items():
            row = {**base, "provider": name, "mode": "fwd_bwd", "metric": "peak_mem_mb"}
            try:
                call = call_of(build(), "fwd_bwd")
            except Exception as err:  # noqa: BLE001 - side_by_side_rows gives this provider's error row
                rows.append({**row, "value": None, "unit": "MiB", "status": "error",
                             "reason": f"{type(err).__name__}: {err}"[:300]})
                continue
            rows.append(peak_row(row, call, self.device, 0,
                                 "the training call's peak over what was held before it (weights, inputs)"))
        return rows



STUDY = Ccgqa()
