"""The MFU study (the model-level goals on G0-T1's training step): a preset's whole training step
(``Trainer.train_step``: forward, loss, backward, clipping, fused AdamW) at the goal's shape, in each config,
side by side in shuffled rounds, every config from the same initial weights. Each config adds its setting to
every config listed before it:

- ``plain``: compiled PyTorch, SDPA attention, bf16 autocast over fp32 weights, TF32, fused AdamW, PyTorch's
  own norm, activation and rotary ops (our Triton kernels off), which inductor fuses with their neighbours, and
  the loss eager (``torch.compile(model)``, as a user writes it);
- ``kernels``: our Triton kernels (RMSNorm, SwiGLU, rotary) as custom ops in the compiled graph;
- ``loss``: the loss compiled too (the fp32 cast and cross-entropy fused over the logits);
- ``fused_loss``: the LM head and the loss fused by chunks of tokens, no logits in memory (``models.loss``);
- ``liger_loss``: the same with Liger-Kernel's fused linear cross-entropy, the peer users would pick (never the
  zoo's best or fastest config). These two are branches: the configs after them do not take them;
- ``fp8``: torchao's float8 training (tensorwise scales) on the blocks' linears; the LM head stays bf16;
- ``fp8_rowwise``: the same with torchao's rowwise recipe (a scale a row: issue 67's FP8, the one the train study
  prices in validation loss), compiled with its ``compile_options`` (casts rounded as eager rounds them);
- ``torchtitan``: the peer, torchtitan's llama3 step at the same shape (``titan.py``), adding nothing to ours.

The blocks are compiled one at a time (``compile_scope``: every layer shares the one graph) and dynamo is told
to fail rather than fall back to eager past its recompile limit, so a config is compiled or is an error row; each
config's first step counts the graphs it compiled (our kernels' switch is a guard: a config with them on
compiles its own). MFU: the card's model FLOPs per step over the step time, against the GEMM rate of the config's
precision measured in the same run (bf16 at its start; FP8, tensorwise, before the first case, for the fp8 configs); each
config's first step (its compile) in seconds; each step's peak memory.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

from adaattn_pipeline.bench.harness import Workload
from adaattn_pipeline.bench.roofline import fp8_gemm_tflops
from adaattn.timing.memory import peak_row
from adaattn.timing.timers import make_timer
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.bench.side_by_side import side_by_side_rows
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.common.float8 import compile_options, float8_unavailable, to_float8
from adaattn_experiments.mfu import titan
from adaattn_experiments.mfu.schema import BRANCHES, FP8_CONFIGS, PEERS, MfuCase, MfuSweep
from adaattn.kernels import set_use_triton_kernels
from adaattn.kernels import runtime
from adaattn.kernels.runtime import get_kernel_status
from adaattn.models.config import ModelConfig
from adaattn.models.transformer import build_model
from adaattn.models.card import flops_per_token, param_counts
from adaattn.models.loss import linear_cross_entropy
from adaattn.models.train import Trainer, create_optimized_training_setup


@contextlib.contextmanager
def triton_kernels(on: bool) -> Iterator[None]:
    """Our kernels on or off inside, restored after. Compiled blocks read the switch while tracing, and dynamo
    guards on it: a config's step finds its own graph, whichever ran before it."""
    before = runtime._use_triton
    set_use_triton_kernels(on)
    try:
        yield
    finally:
        set_use_triton_kernels(before)


def covered(cfg: ModelConfig) -> bool:
    """Whether the preset runs an op our kernels cover (RMSNorm, SwiGLU, rotary)."""
    return cfg.norm == "rmsnorm" or cfg.mlp == "swiglu" or cfg.positions != "learned"


class Mfu(StudyDef):
    name = "mfu"
    table_ids = ("G0-T1", "G0-C2")
    config_columns = ["model", "batch", "seq_len"]
    sections = ("mfu",)

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        return [c["model"] for c in raw[section][profile]["cases"]]

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> Mfu:
        return Mfu(device)

    def cases(self, params: Params, target: Target) -> list:
        return []  # whole training steps, side by side: extra_rows measures them

    def unavailable(self, config: str, cfg: ModelConfig, seq_len: int) -> str | None:
        if config == "torchtitan":
            return titan.why_not(self.device, cfg, seq_len)
        if config == "liger_loss":
            return liger_unavailable(self.device)
        if config in FP8_CONFIGS and float8_unavailable(self.device):
            return float8_unavailable(self.device)
        if config in ("kernels", *FP8_CONFIGS) and not get_kernel_status()["use_triton_kernels"]:
            return f"our Triton kernels do not run here: {get_kernel_status()['reason']}"
        if config == "kernels" and not covered(cfg):
            return "the preset runs no op our kernels cover (its norm, MLP and positions are PyTorch's)"
        return None

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        sweep: MfuSweep = getattr(params.mfu, target.profile)
        rows: list[dict] = []
        fp8 = any(set(FP8_CONFIGS) & set(case.configs) for case in sweep.cases)
        if fp8 and float8_unavailable(self.device) is None:
            # an fp8 config's MFU is counted against the FP8 GEMM rate of this run, not the bf16 one
            row = {"table_id": "", "case_id": "machine", "provider": "machine", "mode": "", "metric": "fp8_gemm_tflops",
                   "unit": "TFLOP/s", "kernel": "fp8 e4m3 GEMM 8192^3 (torch._scaled_mm, tensorwise scales, bf16 out)"}
            try:
                rows.append({**row, "value": fp8_gemm_tflops(make_timer(self.device, params.bench)), "status": "ok",
                             "reason": ""})
            except Exception as err:  # noqa: BLE001 - no rate is a row that says why; fp8's MFU then reads "-"
                from adaattn.errors import classify_error

                status, why = classify_error(err)
                rows.append({**row, "value": None, "status": status, "reason": why})
        # past its recompile limit dynamo would run a block eager, silently: an error row instead
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for case in sweep.cases:
                rows += self._case_rows(params.models[case.model], case, sweep)
                torch._dynamo.reset()  # the next preset's blocks trace afresh
        return rows

    def _case_rows(self, cfg: ModelConfig, case: MfuCase, sweep: MfuSweep) -> list[dict]:
        B, S = case.batch, case.seq_len
        base = {"table_id": "G0-T1", "case_id": f"mfu/{case.model}-b{B}-s{S}", "kernel": "", "model": case.model,
                "batch": B, "seq_len": S}
        rows, live = [], []
        for config in case.configs:
            why = self.unavailable(config, cfg, S)
            if why is None:
                live.append(config)
            else:
                rows.append({**base, "provider": config, "mode": "step", "metric": "side_by_side_ms", "value": None,
                             "unit": "ms", "status": "unavailable", "reason": why})
        g = torch.Generator().manual_seed(sweep.seed)
        tokens = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g).to(self.device)
        batch = (tokens[:, :-1], tokens[:, 1:])
        torch.manual_seed(sweep.seed)
        initial = copy.deepcopy(build_model(cfg).state_dict())  # every config from the same weights
        trainers: dict[str, Trainer | titan.TitanStep] = {}
        criteria: dict[str, Callable[[Tensor, Tensor], Tensor] | None] = {}
        compile_s: dict[str, tuple[float, int]] = {}

        ours = [c for c in live if c not in PEERS]  # an unavailable config adds nothing, nor does a peer
        # a branch's setting stays its own: the configs after it take only the other settings before them
        settings = {c: {c} if c in PEERS else {*(b for b in ours[: ours.index(c)] if b not in BRANCHES), c}
                    for c in live}

        def run(config: str) -> Callable[[], object]:
            return functools.partial(self._step, trainers[config], settings[config], batch, criteria[config])

        def step(config: str) -> Workload:
            if config not in trainers:
                trainers[config], criteria[config] = self._trainer(cfg, settings[config], initial, sweep, S)
                graphs, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
                run(config)()  # the first step compiles
                if self.device == "cuda":
                    torch.cuda.synchronize()
                compile_s[config] = time.perf_counter() - t0, counters["stats"]["unique_graphs"] - graphs
            return Workload(fwd=run(config), inputs=[])

        rows += side_by_side_rows([(base, "step", {c: functools.partial(step, c) for c in live})], self.device,
                                  keep=live, rounds=sweep.side_by_side, seed=sweep.seed,
                                  paired="plain" if "plain" in live and len(live) > 1 else None)
        for config, (seconds, graphs) in compile_s.items():
            how = "torchtitan's own compile (each block fullgraph, its loss; default mode)" if config in PEERS else \
                f"{sweep.compile_scope}-scope torch.compile ({sweep.compile_mode})"
            rows.append({**base, "provider": config, "mode": "step", "metric": "first_step_s", "value": seconds,
                         "unit": "s", "status": "ok", "reason": f"the first step: {how} and the step itself"})
            # a config that compiled no graph of its own ran another's (kernels on or off): the test of the switch
            rows.append({**base, "provider": config, "mode": "step", "metric": "graphs_compiled", "value": graphs,
                         "unit": "graphs", "status": "ok", "reason": "dynamo graphs its first step compiled"})
        for config, trainer in trainers.items():
            rows.append(peak_row({**base, "provider": config, "mode": "step", "metric": "step_peak_mem_mb"},
                                 run(config), self.device,
                                 trainer.held_bytes(), "weights and optimizer state held, and one step's peak over "
                                 "them"))
        with torch.device("meta"):
            meta = build_model(cfg)
        per_token = flops_per_token(cfg, param_counts(meta), S)["train"]
        rows.append({**base, "provider": "model", "mode": "step", "metric": "model_flops", "value": per_token * B * S,
                     "unit": "FLOP", "status": "ok", "reason": "6N + 12 L H D S per token (the model's card)"})
        trainers.clear()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        return rows

    def _trainer(self, cfg: ModelConfig, on: set[str], initial: dict[str, Tensor], sweep: MfuSweep,
                 seq_len: int) -> tuple[Trainer | titan.TitanStep, Callable[[Tensor, Tensor], Tensor] | None]:
        """The config's step and the criterion it trains with (None: the trainer's own loss over the logits)."""
        if "torchtitan" in on:
            return titan.TitanStep(cfg, seq_len, self.device, sweep.dtype), None
        model = build_model(cfg, device=self.device)
        model.load_state_dict(initial)
        criterion = None
        if on & {"fused_loss", "liger_loss"}:
            criterion = head_loss(model, "liger" if "liger_loss" in on else "ours", sweep.dtype)
        # the rowwise recipe in place of the tensorwise one listed before it
        recipe = "rowwise" if "fp8_rowwise" in on else "tensorwise" if "fp8" in on else None
        if recipe is not None:
            model = to_float8(model, recipe)
        _, _, trainer = create_optimized_training_setup(
            model, compile_mode=sweep.compile_mode, compile_scope=sweep.compile_scope, dtype=sweep.dtype,
            device=self.device, tf32=True, compile_loss="loss" in on,
            compile_options=None if recipe is None else compile_options(recipe))
        return trainer, criterion

    @staticmethod
    def _step(trainer: Trainer | titan.TitanStep, on: set[str], batch: tuple[Tensor, Tensor],
              criterion: Callable[[Tensor, Tensor], Tensor] | None = None):
        with triton_kernels("kernels" in on):
            return trainer.train_step(batch) if criterion is None else trainer.train_step(batch, criterion)


def liger_unavailable(device: str) -> str | None:
    """Why Liger-Kernel's fused linear cross-entropy cannot run here (None: it can)."""
    if device != "cuda":
        return "Liger-Kernel's fused linear cross-entropy is Triton GPU kernels: a CUDA GPU only"
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
    except ImportError as err:
        return f"liger-kernel is not installed ({err})"
    return None


def head_loss(model: nn.Module, which: str, dtype: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The model's LM head taken out of its forward (an identity in its place: the forward returns the final norm's
    output) and kept as a module of the model (its weight still trained, decayed and clipped: the same
    parameters), and the criterion that applies it fused with the cross-entropy: ours (``models.loss``) or
    Liger-Kernel's. The trainer hands a criterion fp32 hidden states outside its autocast; both run the head's
    GEMMs in the step's dtype, as the autocast runs the plain head."""
    head = model.head
    model.head, model.loss_head = nn.Identity(), head
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    if which == "ours":
        return lambda hidden, targets: linear_cross_entropy(hidden, head.weight, targets, dtype=compute)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def liger(hidden: Tensor, targets: Tensor) -> Tensor:
        return liger_fused_linear_cross_entropy(hidden.flatten(0, 1).to(compute), head.weight.to(compute),
                                                targets.flatten())
    return liger



STUDY = Mfu()
