"""The inference study (G3-T3, issues 48 and 66's decode goals): a dense decoder's prefill and decode step in each
config, side by side per batch size, every config from the same weights (``schema.InferenceSweep``: base, flash,
int8, compiled, compiled_plain, compiled_int8, compiled_int4, the torchao peers, no_cache).

Per batch: the prompt's prefill (``models.generate.prefill``) side by side across the configs with a cache; one
decode step (``decode_one`` at the position after the prompt, the cache as long as prompt and new tokens) side by
side across every config, ``no_cache`` running the whole prefix and the new token instead; each config's peak
memory over a prefill and ``new_tokens`` decode steps; and the bytes a decode step must read (weights, and the
whole static cache, which the masked attention reads), from which the report gives the achieved bandwidth as a
fraction of the copy bandwidth measured at the start of the same run (the decode roofline); the kernels one step
launches and the median gap between them (a CUDA trace); and for the compiled configs the README's ``generate``
loop's time a token. A batch records every CUDA graph it uses before its first timed round.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaattn_pipeline.bench.harness import Workload
from adaattn.timing.memory import peak_row
from adaattn.timing.trace import profiler_session
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.bench.side_by_side import side_by_side_rows
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.common.fit import fit, val_loss
from adaattn_experiments.inference.schema import FieldDecode, InferenceSweep, LTMDecode, QualityRun, floor_config
from adaattn.models.config import ModelConfig
from adaattn.models.transformer import build_model
from adaattn.models import decode_step
from adaattn.models.decode_graph import GraphedStep
from adaattn.models.generate import clear_kv_cache, decode_one, generate, prefill, reset_kv_cache, setup_kv_cache
from adaattn.models.quant import quantize_weight_only
from adaattn.models.data import batch as windows
from adaattn.models.data import load_corpus
from adaattn.models.train import DTYPES

INT8 = {"int8", "compiled_int8"}
TORCHAO = {"compiled_torchao_int8", "compiled_torchao_int4"}
COMPILED = {"compiled", "compiled_plain", "compiled_int8", "compiled_int4", *TORCHAO}
FUSED = {"compiled", "compiled_int8", "compiled_int4"}  # the fused decode step (models.decode_step); the rest: the
# model's own layers, so the eager configs measure the guide's ladder and compiled_plain the gpt-fast pattern
GENERATE_REPEATS = 3  # README generate loops timed a config and length (the fastest kept: no host noise in it)


def torchao_missing() -> str | None:
    """Why torchao's weight-only configs cannot run here (None: they can)."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure is the row's reason
        return f"torchao.quantization not importable: {type(err).__name__}: {err}"[:300]
    return None


def nbytes(t: Tensor) -> int:
    """A tensor's bytes; a wrapper subclass's (torchao's quantized weights) are its inner tensors'."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """What a decode step reads of the model: every parameter and buffer but the KV caches, the generation state,
    the rotary table and the embedding lookup's table (a step reads B of its rows; a head tied to it is read whole, once, as the head).
    An INT4 layer's tinygemm copy is the same weight in another layout, read instead of ours: counted once."""
    lookup = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tied = getattr(model, "head", None) is not None and id(model.head.weight) in lookup
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or ".cache." in f".{name}" or name.startswith(("rope.", "decode_state.")) or \
                name.rsplit(".", 1)[-1] in ("tiny_weight", "tiny_sz"):
            continue
        seen.add(id(t))
        if id(t) in lookup and not (tied and t is model.head.weight):
            continue
        total += nbytes(t)
    return total


def cache_bytes(model: nn.Module) -> int:
    """The KV caches' bytes: a decode step's masked attention reads each layer's whole static cache."""
    return sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("cache.k", "cache.v")))


def _kernels(events) -> list:
    """GPU kernels among a profiler trace's events: device-side events but copies and memsets."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset", "memcpy", "memset"))]


def count_kernels(events) -> int:
    return len(_kernels(events))


def median_kernel_gap_us(events) -> float | None:
    """The median idle time between consecutive kernels of a trace (us; a negative gap is an overlap), or None
    with fewer than two."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in _kernels(events))
    gaps = sorted(b[0] - a[1] for a, b in zip(spans, spans[1:]))
    return gaps[len(gaps) // 2] if gaps else None


class Inference(StudyDef):
    name = "inference"
    table_ids = ("G3-T3",)
    config_columns = ["model", "batch", "seq_len", "phase", "step"]  # step: the quality run's training rows
    sections = ("G3-T3",)

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        """The sweep's model and those of its quality, LTM and field runs: each one's config is a param it reads."""
        sweep = raw[section][profile]
        return [sweep["model"], *(sweep[k]["model"] for k in ("quality", "ltm", "field") if sweep.get(k))]

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> Inference:
        return Inference(device)

    def cases(self, params: Params, target: Target) -> list:
        return []  # prefill and decode side by side: extra_rows

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        start = time.monotonic()
        sweep: InferenceSweep = getattr(params.g3_t3, target.profile)
        cfg = params.models[sweep.model]
        torch.manual_seed(sweep.seed)
        initial = build_model(cfg).state_dict()
        missing = {c: why for c in sweep.configs if c in TORCHAO and (why := torchao_missing())}
        models = {}
        for c in sweep.configs:
            if c in missing:
                continue
            try:
                models[c] = self._model(cfg, c, initial, sweep)
            except Exception as err:  # noqa: BLE001 - a peer that cannot quantize this model: its row says why
                if c not in TORCHAO:
                    raise
                missing[c] = f"torchao could not quantize the model: {type(err).__name__}: {err}"[:300]
        del initial
        rows: list[dict] = []
        for batch in sweep.batches:
            self.note(f"batch {batch}: prefill and decode side by side, {', '.join(models)}")
            rows += self._batch_rows(cfg, models, batch, sweep)
            for c, why in missing.items():  # the peer that cannot run here: a row that says why
                rows += [{"table_id": "G3-T3", "case_id": f"G3-T3/{sweep.model}-b{batch}-p{sweep.prompt_len}/{phase}",
                          "kernel": "", "model": sweep.model, "batch": batch, "seq_len": sweep.prompt_len,
                          "phase": phase, "provider": c, "mode": "fwd", "metric": "side_by_side_ms", "value": None,
                          "unit": "ms", "status": "unavailable", "reason": why} for phase in ("prefill", "decode")]
            torch._dynamo.reset()  # a fresh cache per batch: the compiled decode's graphs are per shape
        del models
        took = [0.0]  # the seconds of each run after the sweep: the longest guesses the next
        if sweep.quality is not None:  # a goal's run (INT8 and INT4's price): first, and not left out
            t0 = time.monotonic()
            rows += self._quality_rows(params, sweep)
            took.append(time.monotonic() - t0)
        # the issue-66 runs, each on models of its own, while the budget lasts: the field's model and the floor
        # first (the decode goals' evidence), the LTM preset's decode (a table, no verdict) last
        runs = [(self._field_rows, sweep.field and (sweep.field.model, sweep.field.prompt_len, "field", "compiled",
                                                    "generate_ms_per_token")),
                (self._floor_rows, sweep.floor and (sweep.model, sweep.prompt_len, "floor", "compiled",
                                                    "generate_ms_per_token")),
                (self._ltm_rows, sweep.ltm and (sweep.ltm.model, sweep.ltm.prompt_len, "ltm", "ltm_compiled",
                                                "generate_ms_per_token"))]
        for rows_of, where in runs:
            if not where:
                continue
            elapsed = time.monotonic() - start
            if sweep.budget_s is not None and elapsed + max(took) > sweep.budget_s:
                why = (f"the {where[2]} run not run: " + (f"its {max(took):.0f} s (the longest run so far) "
                                                          if max(took) else "")
                       + f"past G3-T3.{target.profile}.budget_s={sweep.budget_s:g} at {elapsed:.0f} s")
                rows.append(self._row_of(*where, status="unavailable", why=why))
                continue
            t0 = time.monotonic()
            rows += self._guarded(rows_of, params, sweep, *where)
            took.append(time.monotonic() - t0)
        return rows

    @staticmethod
    def _row_of(model: str, P: int, phase: str, provider: str, metric: str, status: str, why: str) -> dict:
        """A run's one row where it did not run: ``status`` and ``why``."""
        return {"table_id": "G3-T3", "case_id": f"G3-T3/{model}-b1-p{P}/{phase}", "kernel": "", "model": model,
                "batch": 1, "seq_len": P, "phase": phase, "mode": "fwd", "provider": provider, "metric": metric,
                "value": None, "unit": "ms", "status": status, "reason": why}

    @staticmethod
    def _guarded(rows_of, params: Params, sweep: InferenceSweep, model: str, P: int, phase: str, provider: str,
                 metric: str) -> list[dict]:
        """``rows_of(params, sweep)``, or where it fails (on a GPU: memory, a compile) one row that says why: the
        rows measured before it are kept."""
        try:
            return rows_of(params, sweep)
        except Exception as err:  # noqa: BLE001 - the failure's class and message are the row's reason
            from adaattn.errors import classify_error

            status, why = classify_error(err)
            torch._dynamo.reset()
            return [Inference._row_of(model, P, phase, provider, metric, status, why)]

    def _field_rows(self, params: Params, sweep: InferenceSweep) -> list[dict]:
        """Issue 66 like for like: the field's model (random weights) at batch 1, as the field times its steps (the
        cache growing from the prompt): ``_readme_rows``."""
        run: FieldDecode = sweep.field
        self.note(f"field: {run.model} generating {run.new_tokens} tokens after {run.prompt_len}, the compiled step")
        return self._readme_rows(params.models[run.model], run.model, run.prompt_len, run.new_tokens, "field", sweep)

    def _floor_rows(self, params: Params, sweep: InferenceSweep) -> list[dict]:
        """Issue 66: the step's floor, the sweep's model at the floor's widths (its layers and kernels, weights in
        L2), as the sweep's batch-1 ``generate`` row runs: ``_readme_rows``."""
        cfg = floor_config(params, "G3-T3.floor", sweep)
        self.note(f"floor: {sweep.model} at dim {cfg.dim} generating {sweep.new_tokens} tokens, the compiled step")
        return self._readme_rows(cfg, sweep.model, sweep.prompt_len, sweep.new_tokens, "floor", sweep)

    def _readme_rows(self, cfg: ModelConfig, name: str, P: int, N: int, phase: str, sweep: InferenceSweep,
                     ) -> list[dict]:
        """A model (random weights) at batch 1: the README's ``generate`` with the compiled config's step
        (``GraphedStep``), a token; the bytes a step reads on average over the new tokens; a CUDA trace of one
        step. The fused step must run it: where it does not, the rows say why instead."""
        torch._dynamo.reset()
        torch.manual_seed(sweep.seed)
        model = build_model(cfg, device=self.device).to(DTYPES[sweep.dtype]).eval().requires_grad_(False)
        g = torch.Generator().manual_seed(sweep.seed)
        prompt = torch.randint(0, cfg.vocab_size, (1, P), generator=g).to(self.device)
        setup_kv_cache(model, 1, P + N, dtype=DTYPES[sweep.dtype])
        why = decode_step.why_not(model, prompt[:, -1:])
        if why is not None and self.device == "cuda":  # a CPU runs the fused step only in Triton's interpreter
            raise ValueError(f"{phase}: the fused step does not run {name} here: {why}")
        base = {"table_id": "G3-T3", "case_id": f"G3-T3/{name}-b1-p{P}/{phase}", "kernel": "", "model": name,
                "batch": 1, "seq_len": P, "phase": phase, "mode": "fwd", "provider": "compiled"}
        step = GraphedStep()
        with torch.no_grad():
            rows = [{**base, **self._generate_ms(model, None, prompt, N, step=step)}]
            # the steps' mean: the cache holds P + 1 .. P + N - 1 positions over them
            need = weight_bytes(model) + cache_bytes(model) * (P + N / 2) / (P + N)
            rows.append({**base, "metric": "decode_bytes_needed", "value": need, "unit": "bytes", "status": "ok",
                         "reason": "weights, and the KV cache's filled positions, their mean over the steps"})
            reset_kv_cache(model)
            generate(model, prompt, 2, step=step)  # the prompt in the cache; the trace's steps follow it
            rows += [{**base, **row} for row in self._trace_rows(lambda: step(model))]
        clear_kv_cache(model)
        torch._dynamo.reset()
        return rows

    def _ltm_rows(self, params: Params, sweep: InferenceSweep) -> list[dict]:
        """Issue 66's LTM decode: the README's ``generate`` a token at batch 1 over a segment's end, the step eager
        and compiled with CUDA graphs, the same weights; the compiled step's dynamo graphs, and how many of its
        greedy tokens are the eager step's."""
        run: LTMDecode = sweep.ltm
        cfg, P, N = params.models[run.model], run.prompt_len, run.new_tokens
        self.note(f"ltm: {run.model} generating {N} tokens after {P}, over a segment end, eager and compiled")
        torch.manual_seed(sweep.seed)
        model = build_model(cfg, device=self.device).to(DTYPES[sweep.dtype]).eval().requires_grad_(False)
        g = torch.Generator().manual_seed(sweep.seed)
        prompt = torch.randint(0, cfg.vocab_size, (1, P), generator=g).to(self.device)
        setup_kv_cache(model, 1, dtype=DTYPES[sweep.dtype])
        base = {"table_id": "G3-T3", "case_id": f"G3-T3/{run.model}-b1-p{P}/ltm", "kernel": "", "model": run.model,
                "batch": 1, "seq_len": P, "phase": "ltm", "mode": "fwd"}
        rows, tokens = [], {}
        for config in ("ltm_eager", "ltm_compiled"):
            torch._dynamo.reset()
            # not fullgraph: the host's part of a step (the order check, the bank's write) runs between graphs
            decode = torch.compile(decode_one, mode="reduce-overhead") if config == "ltm_compiled" else decode_one
            kept, before = {}, torch._dynamo.utils.counters["stats"]["unique_graphs"]
            with torch.no_grad():
                ms = self._generate_ms(model, decode, prompt, N, kept)
            tokens[config] = kept["tokens"][:, P:]
            rows.append({**base, "provider": config, **ms, "reason": ms["reason"] + ", a segment's end among them"})
            if config == "ltm_compiled":
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
                rows.append({**base, "provider": config, "metric": "graphs", "value": graphs, "unit": "graphs",
                             "status": "ok", "reason": "dynamo's graphs over the loops, every position and bank "
                             "size met"})
        same = (tokens["ltm_compiled"] == tokens["ltm_eager"]).float().mean().item()
        rows.append({**base, "provider": "ltm_compiled", "metric": "tokens_agree", "value": same, "unit": "fraction",
                     "status": "ok", "reason": f"the compiled step's greedy tokens equal to the eager step's, of {N} "
                     f"(in {sweep.dtype}, a near tie can turn one, and the rest follow)"})
        clear_kv_cache(model)
        torch._dynamo.reset()
        return rows

    def _quality_rows(self, params: Params, sweep: InferenceSweep) -> list[dict]:
        """The quality model trained on real text (``common.fit``: its loss rows), then its validation loss with
        the weights in the sweep's dtype, INT8 and INT4, over the same held-out windows."""
        q: QualityRun = sweep.quality
        self.note(f"quality: {q.model} trained {q.steps} steps, then its validation loss in full precision, INT8, "
                  f"INT4 (groups of {sweep.int4_group_size})")
        corpus = load_corpus(q.val_percent)
        held = torch.Generator().manual_seed(q.seed + 1)  # fit's own held-out windows
        val = [windows(corpus.val, q.batch, q.seq_len, held) for _ in range(q.eval_batches)]
        base = {"table_id": "G3-T3", "case_id": f"G3-T3/{q.model}-quality", "kernel": "", "model": q.model,
                "batch": q.batch, "seq_len": q.seq_len, "phase": "quality", "mode": "fwd", "metric": "val_loss",
                "unit": "nats"}

        def price(trainer) -> list[dict]:
            trained = trainer.model.state_dict()
            out = []
            for variant, bits in (("full", None), ("int8", 8), ("int4", 4)):
                model = build_model(trainer.model.cfg, device=self.device)
                model.load_state_dict(trained)
                model = model.to(DTYPES[sweep.dtype]).eval().requires_grad_(False)
                if bits is not None:
                    quantize_weight_only(model, bits, sweep.int4_group_size)
                out.append({**base, "provider": variant, "value": val_loss(model, val, self.device), "status": "ok",
                            "reason": f"mean over {len(val)} held-out windows, weights in {sweep.dtype}" +
                                      ("" if bits is None else f", INT{bits} weight-only" +
                                       (f" in groups of {sweep.int4_group_size}" if bits == 4 else ""))})
            return out

        rows = fit(q.model, params.models[q.model], q, corpus, None, self.device, table_id="G3-T3", after=price)
        return [{**r, "phase": "quality"} for r in rows]

    def _model(self, cfg: ModelConfig, config: str, initial: dict[str, Tensor], sweep: InferenceSweep) -> nn.Module:
        model = build_model(cfg, device=self.device)  # its own init on the device: minutes less for a 1B on a GPU
        model.load_state_dict(initial)
        model = model.to(dtype=DTYPES[sweep.dtype]).eval().requires_grad_(False)
        model.fused_decode = config in FUSED
        if config in TORCHAO:
            from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

            # the linears ours quantizes: every one but the LM head (tied to the embedding's table)
            recipe = Int8WeightOnlyConfig() if config.endswith("int8") else \
                Int4WeightOnlyConfig(group_size=sweep.int4_group_size)
            quantize_(model, recipe, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "head")
            return model
        if config == "compiled_int4":
            return quantize_weight_only(model, 4, sweep.int4_group_size)
        return quantize_weight_only(model, 8) if config in INT8 else model

    def _batch_rows(self, cfg: ModelConfig, models: dict[str, nn.Module], B: int, sweep: InferenceSweep) -> list[dict]:
        P, N = sweep.prompt_len, sweep.new_tokens
        g = torch.Generator().manual_seed(sweep.seed + B)
        tokens = torch.randint(0, cfg.vocab_size, (B, P + N), generator=g).to(self.device)
        prompt = tokens[:, :P]
        common = {"table_id": "G3-T3", "kernel": "", "model": sweep.model, "batch": B, "seq_len": P}
        case = f"G3-T3/{sweep.model}-b{B}-p{P}"
        configs = list(models)  # the sweep's, less any that cannot run here
        cached = [c for c in configs if c != "no_cache"]
        for c in cached:
            setup_kv_cache(models[c], B, P + N, dtype=DTYPES[sweep.dtype])
        # laid out as generate's sampled tokens are, strides (1, 1) (`contiguous()` keeps a one-row view's):
        # torch.compile's guards read strides, so a view would have the generate rows compile each step twice
        token = tokens[:, P:P + 1].clone(memory_format=torch.contiguous_format)
        pos = torch.tensor([P], device=self.device)
        decoders = {c: self._decoder(c) for c in cached}
        # the README's generate: decode_next (the token picked and written on the device) compiled and captured into
        # one CUDA graph of its own, replayed a token
        steps = {c: GraphedStep() for c in cached if c in COMPILED}

        def prefill_work(c: str) -> Workload:
            return Workload(fwd=functools.partial(self._call, c, prefill, models[c], prompt), inputs=[])

        def decode_work(c: str) -> Workload:
            if c == "no_cache":  # the prefix and the new token, all of it again
                return Workload(fwd=functools.partial(self._call, c, models[c], tokens[:, :P + 1]), inputs=[])
            return Workload(fwd=functools.partial(self._call, c, decoders[c], models[c], token, pos), inputs=[])

        with torch.no_grad():
            # every CUDA graph the batch will use, recorded before anything is timed: on an H200 a decode step's
            # graph replayed slower (the same kernels, wider gaps between them) once the step's calls had been
            # captured into other graphs, and stayed so (notebook, 2026-12-01); the rounds and the generate loop
            # are then read in one state, the one a program that captured its generate step is in
            for c in steps:
                self._generate(c, models[c], None, steps[c], tokens[:, :P + 2], P)
            for c in (c for c in cached if c in COMPILED):  # the rounds' decoder: CUDA-graph trees record it
                self._call(c, prefill, models[c], prompt)
                for _ in range(3):
                    decode_work(c).fwd()
            for c in cached:  # the caches hold the prompt before any decode step is timed
                self._call(c, prefill, models[c], prompt)
            pre = {**common, "case_id": f"{case}/prefill", "phase": "prefill"}
            self.note(f"batch {B}: prefill rounds")
            rows = side_by_side_rows([(pre, "fwd", {c: functools.partial(prefill_work, c) for c in cached})],
                                     self.device, keep=cached, rounds=sweep.side_by_side, seed=sweep.seed)
            dec = {**common, "case_id": f"{case}/decode", "phase": "decode"}
            paired = "compiled" if "compiled" in configs else None
            self.note(f"batch {B}: decode rounds (first calls compile the compiled configs' decode step)")
            rows += side_by_side_rows([(dec, "fwd", {c: functools.partial(decode_work, c) for c in configs})],
                                      self.device, keep=configs, rounds=sweep.side_by_side,
                                      seed=sweep.seed, paired=paired)
            gen = {**common, "case_id": f"{case}/generate", "phase": "generate"}
            self.note(f"batch {B}: peak memory of a prefill and {N} decode steps, each config")
            for c in configs:
                if c in steps:  # compiled and its graph recorded before the peak is read, as the decode step's were
                    self._generate(c, models[c], None, steps[c], tokens[:, :P + 2], P)
                rows.append(peak_row({**gen, "provider": c, "mode": "fwd", "metric": "peak_mem_mb"},
                                     functools.partial(self._generate, c, models[c], decoders.get(c), steps.get(c),
                                                       tokens, P),
                                     self.device, 0, f"a prefill and {N} decode steps, over the weights and caches "
                                     "held before" if c != "no_cache" else f"the last of {N} tokens: the whole "
                                     f"{P + N} again"))
                model = models[c]
                read = weight_bytes(model) + (cache_bytes(model) if c != "no_cache" else 0)
                rows.append({**dec, "provider": c, "mode": "fwd", "metric": "decode_bytes", "value": read,
                             "unit": "bytes", "status": "ok", "reason": "weights, and the whole static KV cache"
                             if c != "no_cache" else "weights (the prefix's activations are recomputed, not read)"})
                # what the step must read: the cache's positions filled at it (issue 66's roofline), not its length
                need = weight_bytes(model) + (cache_bytes(model) * (P + 1) // (P + N) if c != "no_cache" else 0)
                rows.append({**dec, "provider": c, "mode": "fwd", "metric": "decode_bytes_needed", "value": need,
                             "unit": "bytes", "status": "ok", "reason": "weights, and the KV cache's filled positions"})
                rows += [{**dec, **row, "provider": c, "mode": "fwd"} for row in self._trace_rows(decode_work(c).fwd)]
                if c in COMPILED:
                    rows.append({**gen, "provider": c, "mode": "fwd", **self._generate_ms(models[c], None, prompt,
                                                                                          N, step=steps[c])})
        for c in cached:
            clear_kv_cache(models[c])
        return rows

    def _trace_rows(self, step) -> list[dict]:
        """From a CUDA trace of one decode step (warm: after the timed rounds), the kernels it launches and the
        median gap between one kernel's end and the next one's start (the graph's launch pace: which state the
        rounds ran in)."""
        rows = [{"metric": "kernels_per_step", "unit": "kernels"}, {"metric": "kernel_gap_us", "unit": "us"}]
        if self.device != "cuda":
            return [{**row, "value": None, "status": "unavailable",
                     "reason": "read from a CUDA trace: a CPU launches no kernels"} for row in rows]
        from torch.profiler import ProfilerActivity

        step()
        torch.cuda.synchronize()
        # CUPTI detached when it ends: the next batch's timed rounds pay no profiler callbacks
        with profiler_session([ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = prof.events()
        return [{**rows[0], "value": count_kernels(events), "status": "ok",
                 "reason": "device-side events of one step's trace, copies and memsets left out"},
                {**rows[1], "value": median_kernel_gap_us(events), "status": "ok",
                 "reason": "one step's trace: the median of each kernel's start less the previous one's end"}]

    def _generate_ms(self, model: nn.Module, decode, prompt: Tensor, N: int, keep: dict | None = None,
                     step=None) -> dict:
        """The README's loop (``generate`` with the compiled step) a token: its time for N new tokens less its
        time for one (the prefill and the first token), over N - 1, each the fastest of ``GENERATE_REPEATS``.
        The caches start over before each loop (an LTM model's must: its decoding goes in order); ``keep``
        gets the last N-token loop's tokens (``keep["tokens"]``)."""
        def run(n: int) -> float:
            best = float("inf")
            for _ in range(GENERATE_REPEATS):
                reset_kv_cache(model)
                self._sync()
                start = time.perf_counter()
                out = generate(model, prompt, n, decode=decode or decode_one, step=step)
                self._sync()
                best = min(best, time.perf_counter() - start)
                if keep is not None and n == N:
                    keep["tokens"] = out
            return best * 1e3

        if N < 2:
            return {"metric": "generate_ms_per_token", "value": None, "unit": "ms", "status": "unavailable",
                    "reason": "one new token: no decode step in the loop to time"}
        run(N)  # warm: the loop's own first calls (sampling, the output's writes)
        ms = (run(N) - run(1)) / (N - 1)
        return {"metric": "generate_ms_per_token", "value": ms, "unit": "ms", "status": "ok",
                "reason": f"generate(prompt, {N}) less generate(prompt, 1), over {N - 1} tokens"}

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _decoder(self, config: str):
        # gpt-fast's decode: one graph for every position, replayed as a CUDA graph (reduce-overhead)
        return torch.compile(decode_one, mode="reduce-overhead", fullgraph=True) if config in COMPILED else decode_one

    def _generate(self, config: str, model: nn.Module, decode, step, tokens: Tensor, P: int) -> None:
        """A prefill of ``tokens[:, :P]`` and a decode step for each token after it; without a cache, the step of
        the last token (the whole sequence again: the largest)."""
        with torch.no_grad():
            if config == "no_cache":
                self._call(config, model, tokens)
                return
            self._call(config, generate, model, tokens[:, :P], tokens.shape[1] - P, 0.0, decode, None, None, step)

    @staticmethod
    def _call(config: str, fn, *args):
        """``fn(*args)`` with SDPA's math backend for ``base`` (the scores materialised), its own dispatch else."""
        if config in COMPILED:
            # each call a new step of CUDA-graph trees: without it, compiled decoders called in shuffled order
            # record a new graph for every order of calls they meet
            torch.compiler.cudagraph_mark_step_begin()
        with sdpa_kernel([SDPBackend.MATH]) if config == "base" else contextlib.nullcontext():
            return fn(*args)



STUDY = Inference()
