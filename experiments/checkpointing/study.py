"""The checkpointing study (G4-T3, and G4-T1's "~40% activation memory"): each preset of ``G4-T3`` trained a
step at a time (``Trainer.train_step``: eager, autocast, fused AdamW on a GPU) at every checkpointing
granularity of ``GradientCheckpointMixin``, one model and one optimizer per preset, the granularity switched
between steps.

Per granularity: the step's peak memory (the weights and optimizer state held, and one step's peak over them),
the forward's peak over what was held before it (the activations the backward keeps, and the forward's
transients: what checkpointing cuts), the card's estimate of the step (``models.card.estimate_memory``) beside
the measurement, and the steps side by side in shuffled rounds (time overhead, tokens/s). Nothing here runs
through the harness: a step is the unit.
"""

from __future__ import annotations

import functools
import gc

import torch
from torch import Tensor

from adaattn.errors import classify_error
from adaattn_pipeline.bench.harness import Case, Workload
from adaattn.timing.memory import peak_row
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.bench.side_by_side import side_by_side_rows
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.checkpointing.schema import CheckpointingSweep
from adaattn.models.config import ModelConfig
from adaattn.models.card import estimate_memory, flops_per_token, param_counts
from adaattn.models.train import Trainer, create_optimized_training_setup

MIB = 2**20


class Checkpointing(StudyDef):
    name = "checkpointing"
    table_ids = ("G4-T3", "G4-T1")
    config_columns = ["model", "batch", "seq_len"]
    sections = ("G4-T3",)

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        return list(raw[section][profile]["models"])

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> Checkpointing:
        return Checkpointing(device)

    def cases(self, params: Params, target: Target) -> list[Case]:
        return []  # the unit is a training step: extra_rows measures it

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        sweep = getattr(params.g4_t3, target.profile)
        rows: list[dict] = []
        for name in sweep.models:
            rows += self._preset_rows(name, params.models[name], sweep)
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()  # the next preset starts from an empty allocator
        return rows

    def _preset_rows(self, name: str, cfg: ModelConfig, sweep: CheckpointingSweep) -> list[dict]:
        B, S = sweep.batch, sweep.seq_len
        base = {"table_id": "G4-T3", "case_id": f"G4-T3/{name}-b{B}-s{S}", "kernel": "", "model": name,
                "batch": B, "seq_len": S}
        try:
            torch.manual_seed(sweep.seed)
            model, optimizer, trainer = create_optimized_training_setup(
                cfg, compile_mode=None, dtype=sweep.dtype, device=self.device, tf32=True)
            gen = torch.Generator().manual_seed(sweep.seed)
            batch = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=gen).to(self.device)
            with torch.enable_grad():
                trainer.train_step(batch)  # AdamW's state exists from here on: what a step holds
        except Exception as err:  # noqa: BLE001 - a preset that cannot be built or stepped is a status row
            status, reason = classify_error(err)
            return [{**base, "provider": g, "mode": "step", "metric": "step_peak_mem_mb", "value": None,
                     "unit": "MiB", "status": status, "reason": reason} for g in sweep.granularities]
        counts = param_counts(model)
        flops = flops_per_token(cfg, counts, S)["train"] * B * S
        rows = [{**base, "provider": "model", "mode": "step", "metric": "model_flops", "value": flops, "unit": "FLOP",
                 "status": "ok", "reason": "the card's training FLOPs per token x the batch's tokens"},
                {**base, "provider": "model", "mode": "step", "metric": "params_m", "value": counts["total"] / 1e6,
                 "unit": "M parameters", "status": "ok", "reason": "every tensor once (a tied head is the embedding)"}]
        held = trainer.held_bytes()
        for gran in sweep.granularities:
            model.set_checkpointing(gran, sweep.every)
            rows += self._memory_rows(base, gran, trainer, batch, held)
            est = estimate_memory(cfg, counts, B, S, sweep.dtype, gran)
            rows.append({**base, "provider": gran, "mode": "step", "metric": "estimated_mem_mb",
                         "value": est["total"] / MIB, "unit": "MiB", "status": "ok",
                         "reason": "the card's estimate: weights, gradients, AdamW, activations"})
        steps = {gran: functools.partial(_step, trainer, model, gran, sweep.every, batch)
                 for gran in sweep.granularities}
        rows += side_by_side_rows([(base, "step", steps)], self.device, keep=list(sweep.granularities),
                                  rounds=sweep.side_by_side, seed=sweep.seed, prefix="step_")
        model.set_checkpointing("none")
        del model, optimizer, trainer
        return rows

    def _memory_rows(self, base: dict, gran: str, trainer: Trainer, batch: Tensor, held: int) -> list[dict]:
        row = {**base, "provider": gran, "mode": "step"}
        # the forward: the loss and the graph the backward would walk (freed when it returns)
        return [peak_row({**row, "metric": "step_peak_mem_mb"}, lambda: trainer.train_step(batch), self.device, held,
                         "weights and optimizer state held, and one step's peak over them"),
                peak_row({**row, "metric": "fwd_peak_mem_mb"}, lambda: trainer.loss(batch[:, :-1], batch[:, 1:])[1],
                         self.device, 0, "the forward's peak over what was held before it (training mode)")]



def _step(trainer: Trainer, model: torch.nn.Module, granularity: str, every: int, batch: Tensor) -> Workload:
    def step():
        model.set_checkpointing(granularity, every)
        return trainer.train_step(batch)

    return Workload(fwd=step, inputs=[])


STUDY = Checkpointing()
