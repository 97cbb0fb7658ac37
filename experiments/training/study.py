"""The training study (G0-T1, G0-C1, G1-C1): a preset of the model zoo climbing a ladder of optimisations.

Each rung adds its own setting to every rung listed before it (``config.RUNGS``): ``fp32`` (eager, fp32,
naive attention, AdamW's foreach step), ``tf32``, ``bf16`` (autocast), ``sdpa``, ``fused_adamw``,
``compile`` (default mode), ``ada`` (AdaAttention), ``checkpointing`` (full). Every rung starts from the
same weights. The harness measures each rung's forward (time, peak memory: G0-T1's forward figures); the
rungs' training steps (``Trainer.train_step``: forward, loss, backward, clipping, optimizer step) are timed
side by side in shuffled rounds (``step_side_by_side_ms``). The model's FLOPs per token come from its card
(``models.card``), so the report's MFU is model FLOPs over step time against the run's measured GEMM rate.

G1-C1's GEMM and module claims (``g1_c1_rows``): an fp32 GEMM with TF32 off and on, and ``nn.MultiheadAttention``
against the zoo's SDPA layer of the same width and heads, each pair side by side.
"""

from __future__ import annotations

import copy
import functools
import time
from typing import Any

import torch
from torch import Tensor
from torch._dynamo.utils import counters

from adaattn_pipeline.bench.harness import Case, Workload
from adaattn.timing.memory import peak_row
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.bench.side_by_side import side_by_side_rows
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.training.schema import G1C1Sweep
from adaattn.models.config import ModelConfig
from adaattn.models.card import flops_per_token, param_counts
from adaattn.models.train import DTYPES, Trainer, create_optimized_training_setup
from adaattn.models.transformer import Attention


_clock = time.perf_counter  # a rung's first step's timer (a module name: a test gives it a clock of its own)
ADA_NAMES = {"attn.qkv.weight": "attn.attn.in_proj_weight", "attn.qkv.bias": "attn.attn.in_proj_bias",
             "attn.out.weight": "attn.attn.out_proj.weight", "attn.out.bias": "attn.attn.out_proj.bias"}


def _as_ada(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The zoo attention's weights under AdaAttention's names (nn.MultiheadAttention's: q, k, v packed in the
    same order): the ``ada`` rung starts from the same weights as the others."""
    out = {}
    for key, value in state.items():
        name = next((key.replace(a, b) for a, b in ADA_NAMES.items() if key.endswith(a)), key)
        out[name] = value
    return out


def rung_settings(rungs: list[str], rung: str) -> dict[str, Any]:
    """What a rung runs with: its own setting and every earlier listed rung's."""
    on = set(rungs[: rungs.index(rung) + 1])
    attention = "ada" if "ada" in on else "sdpa" if "sdpa" in on else "naive"
    return {"tf32": "tf32" in on, "dtype": "bf16" if "bf16" in on else "fp32", "attention": attention,
            "fused": "fused_adamw" in on, "compile_mode": "default" if "compile" in on else None,
            "checkpointing": "full" if "checkpointing" in on else "none"}


class Training(StudyDef):
    name = "training"
    table_ids = ("G0-T1", "G0-C1", "G1-C1")
    config_columns = ["model", "batch", "seq_len"]
    sections = ("G0-T1", "G1-C1")

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        return [raw[section][profile]["model"]] if section == "G0-T1" else []

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._sec = None
        self._cfg: ModelConfig | None = None
        self._base: dict[str, Tensor] | None = None  # the weights every rung starts from
        self._trainers: dict[str, Trainer] = {}
        self._batch: tuple[Tensor, Tensor] | None = None
        self._first: dict[str, tuple[float, int, int]] = {}  # a rung's first step: seconds, FX graph cache hits, misses

    def bind(self, device: str) -> Training:
        return Training(device)

    def cases(self, params: Params, target: Target) -> list[Case]:
        sec = getattr(params.g0_t1, target.profile)
        self._sec, self._cfg = sec, params.models[sec.model]
        case_id = f"G0-T1/{sec.model}-b{sec.batch}-s{sec.seq_len}"
        return [Case(case_id=case_id, table_id="G0-T1", providers=tuple(sec.rungs), modes=("fwd",),
                     config={"model": sec.model, "batch": sec.batch, "seq_len": sec.seq_len})]

    def unavailable(self, provider: str, device: str) -> str | None:
        if provider == "tf32" and device != "cuda":
            return "TF32 is a mode of NVIDIA tensor cores; on a CPU this rung is the one before it"
        return None

    def has_backward(self, provider: str) -> bool:
        return True

    def reference(self, case: Case) -> Tensor | None:
        return None  # the rungs are compared on time and memory; a model's numerics: tests/test_models.py

    def _inputs(self) -> tuple[Tensor, Tensor]:
        if self._batch is None:
            g = torch.Generator().manual_seed(self._sec.seed)
            t = torch.randint(0, self._cfg.vocab_size, (self._sec.batch, self._sec.seq_len + 1), generator=g)
            t = t.to(self.device)
            self._batch = (t[:, :-1], t[:, 1:])
        return self._batch

    def trainer(self, rung: str) -> Trainer:
        """The rung's model, optimizer and trainer (built once; every rung from the same initial weights); a
        ``compile:<mode>`` rung is the compile rung in that torch.compile mode."""
        if rung not in self._trainers:
            name, _, mode = rung.partition(":")
            s = rung_settings(list(self._sec.rungs), name)
            s["compile_mode"] = mode or s["compile_mode"]
            cfg = ModelConfig(**{**self._cfg.model_dump(), "attention": s["attention"]})
            if self._base is None:  # built with the zoo's attention (its weights' names), whatever the preset's
                torch.manual_seed(self._sec.seed)
                zoo = ModelConfig(**{**self._cfg.model_dump(), "attention": "sdpa"})
                base, _, _ = create_optimized_training_setup(zoo, compile_mode=None, device=self.device)
                self._base = copy.deepcopy(base.state_dict())
                del base
            model, _, trainer = create_optimized_training_setup(
                cfg, compile_mode=s["compile_mode"], dtype=s["dtype"], checkpointing=s["checkpointing"],
                device=self.device, fused=s["fused"], tf32=s["tf32"])
            state = _as_ada(self._base) if s["attention"] == "ada" else self._base
            getattr(model, "_orig_mod", model).load_state_dict(state)
            self._trainers[rung] = trainer
        return self._trainers[rung]

    def flops(self) -> float:
        """Model FLOPs of one forward of the batch (the card's formula: a third of a training step's)."""
        from adaattn.models.transformer import Transformer

        with torch.device("meta"):
            meta = Transformer(self._cfg)
        per_token = flops_per_token(self._cfg, param_counts(meta), self._sec.seq_len)
        return per_token["forward"] * self._sec.batch * self._sec.seq_len

    def setup(self, case: Case, provider: str, requires_grad: bool) -> Workload:
        trainer = self.trainer(provider)
        x, _ = self._inputs()
        trainer.model.train()
        return Workload(fwd=lambda: trainer.forward(x), inputs=[], flops_fwd=self.flops())

    def _step(self, rung: str) -> Workload:
        trainer, batch = self.trainer(rung), self._inputs()

        def step():
            if rung in self._first:
                return trainer.train_step(batch)
            # the rung's first step: a compiled rung's compile (from inductor's cache where it has the graphs: the
            # hits and misses say which), then the step itself
            hits, misses = (counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss"))
            start = _clock()
            out = trainer.train_step(batch)
            if self.device == "cuda":
                torch.cuda.synchronize()
            self._first[rung] = (_clock() - start, counters["inductor"]["fxgraph_cache_hit"] - hits,
                                 counters["inductor"]["fxgraph_cache_miss"] - misses)
            return out

        return Workload(fwd=step, inputs=[])

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        """The rungs' training steps side by side, and the model FLOPs a step does (for MFU)."""
        (case,) = self.cases(params, target)
        base = {"table_id": "G0-T1", "case_id": case.case_id, "kernel": "", **case.config}
        rungs = [r for r in case.providers if self.unavailable(r, self.device) is None]
        rows = side_by_side_rows([(base, "step", {r: functools.partial(self._step, r) for r in rungs})],
                                 self.device, keep=rungs, rounds=self._sec.side_by_side, seed=self._sec.seed,
                                 prefix="step_")
        rows.append({**base, "provider": "model", "mode": "step", "metric": "model_flops", "value": 3 * self.flops(),
                     "unit": "FLOP", "status": "ok", "reason": "6N + 12 L H D S per token (the model's card)"})
        weights = sum(p.numel() * p.element_size() for p in self.trainer(rungs[0]).model.parameters())
        rows.append({**base, "provider": "model", "mode": "fwd", "metric": "weights_mb", "value": weights / 2**20,
                     "unit": "MiB", "status": "ok", "reason": "the parameters, fp32 (autocast computes in bf16)"})
        for rung in rungs:  # a step's memory: the rung's weights, gradients and optimizer state, and its peak
            trainer = self.trainer(rung)
            rows.append(peak_row({**base, "provider": rung, "mode": "step", "metric": "step_peak_mem_mb"},
                                 lambda: trainer.train_step(self._inputs()), self.device, trainer.held_bytes(),
                                 "weights and optimizer state held, and one step's peak over them"))
        if self._sec.compile_modes:
            rows += self._mode_rows(case)
        if params.g1_c1 is not None:
            rows += g1_c1_rows(getattr(params.g1_c1, target.profile), self.device)
        return rows

    def _mode_rows(self, case: Case) -> list[dict]:
        """G0-C1's compile modes: the compile rung's step in each mode, side by side with the rung before it
        (``eager``; ``paired_ratio``: eager over the mode, the mode's gain), and the CUDA-graph skips each mode's
        first steps logged (a skipped graph runs without CUDA graphs: reduce-overhead is then default)."""
        rungs = list(self._sec.rungs)
        eager = rungs[rungs.index("compile") - 1]
        base = {"table_id": "G0-C1", "case_id": case.case_id.replace("G0-T1/", "G0-C1/compile-modes-"), "kernel": "",
                **case.config}
        # the default mode is the ladder's compile rung itself (one model fewer to compile and hold)
        names = {"eager": eager, **{f"compile:{m}": "compile" if m == "default" else f"compile:{m}"
                                    for m in self._sec.compile_modes}}
        skips: dict[str, int] = {}

        def build(name: str) -> Workload:
            before = counters["inductor"]["cudagraph_skips"]
            work = self._step(names[name])
            work.fwd()  # the first step compiles (and records any CUDA-graph skip)
            skips[name] = counters["inductor"]["cudagraph_skips"] - before
            return work

        rows = side_by_side_rows([(base, "step", {n: functools.partial(build, n) for n in names})], self.device,
                                 keep=list(names), rounds=self._sec.side_by_side, seed=self._sec.seed,
                                 paired="eager")
        for name, n in skips.items():
            if name != "eager":
                rows.append({**base, "provider": name, "mode": "step", "metric": "cudagraph_skips", "value": n,
                             "unit": "graphs", "status": "ok", "reason": "inductor's CUDA-graph skips at its first step"})
        for name, rung in names.items():  # the default mode's first step is the ladder's compile rung's
            if name == "eager" or rung not in self._first:
                continue
            seconds, hits, misses = self._first[rung]
            first = {**base, "provider": name, "mode": "step", "status": "ok"}
            rows += [{**first, "metric": "first_step_s", "value": seconds, "unit": "s",
                      "reason": "the first training step: its compile, then the step itself (the no-grad forward "
                                "timed in G0-T1's rows compiled a graph of its own before it)"},
                     {**first, "metric": "fxgraph_cache_hits", "value": hits, "unit": "graphs",
                      "reason": "graphs the first step's compile took from inductor's FX graph cache"},
                     {**first, "metric": "fxgraph_cache_misses", "value": misses, "unit": "graphs",
                      "reason": "graphs the first step compiled itself"}]
        return rows



def g1_c1_rows(sweep: G1C1Sweep, device: str) -> list[dict]:
    """G1-C1: the fp32 GEMM with TF32 off (``fp32``) and on (``tf32``, a GPU's) side by side (``paired_ratio``: tf32
    over fp32); ``nn.MultiheadAttention`` (``mha``, need_weights=False) against the zoo's SDPA attention layer
    (``sdpa``), forward and training call, side by side (``paired_ratio``: mha over sdpa)."""
    torch.manual_seed(sweep.seed)
    n = sweep.gemm_n
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    was = torch.backends.cuda.matmul.allow_tf32

    def gemm(tf32: bool) -> Workload:
        def call() -> Tensor:
            torch.backends.cuda.matmul.allow_tf32 = tf32  # per call: the two run interleaved
            return a @ b

        return Workload(fwd=call, inputs=[], flops_fwd=2.0 * n**3)

    base = {"table_id": "G1-C1", "case_id": f"G1-C1/gemm-n{n}", "kernel": "", "model": f"gemm {n}^3 fp32"}
    builders = {"fp32": functools.partial(gemm, False)}
    if device == "cuda":  # TF32 is a mode of NVIDIA tensor cores
        builders["tf32"] = functools.partial(gemm, True)
    try:
        rows = side_by_side_rows([(base, "fwd", builders)], device, keep=list(builders), rounds=sweep.side_by_side,
                                 seed=sweep.seed, paired="tf32" if "tf32" in builders else None)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    del a, b
    if device != "cuda":
        rows.append({**base, "provider": "tf32", "mode": "fwd", "metric": "side_by_side_ms", "value": None,
                     "unit": "ms", "status": "unavailable", "reason": "TF32 is a mode of NVIDIA tensor cores"})
    B, S, E, H = sweep.batch, sweep.seq_len, sweep.dim, sweep.heads
    cfg = ModelConfig(vocab_size=2, dim=E, n_layers=1, n_heads=H, attention="sdpa", positions="learned", bias=True,
                      kind="encoder", max_seq_len=S)
    layers = {"mha": torch.nn.MultiheadAttention(E, H, batch_first=True, device=device),
              "sdpa": Attention(cfg, None).to(device)}
    x = torch.randn(B, S, E, device=device, requires_grad=True)
    dtype = DTYPES[sweep.dtype]

    def attend(name: str) -> Workload:
        layer = layers[name]

        def call() -> Tensor:
            with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32):
                return layer(x, x, x, need_weights=False)[0] if name == "mha" else layer(x)

        return Workload(fwd=call, inputs=[x, *layer.parameters()])

    base = {"table_id": "G1-C1", "case_id": f"G1-C1/mha-b{B}-s{S}-d{E}-h{H}", "kernel": "", "model": "attention layer",
            "batch": B, "seq_len": S}
    groups = [(base, mode, {p: functools.partial(attend, p) for p in layers}) for mode in ("fwd", "fwd_bwd")]
    return rows + side_by_side_rows(groups, device, keep=list(layers), rounds=sweep.side_by_side, seed=sweep.seed,
                                    paired="mha")


STUDY = Training()
