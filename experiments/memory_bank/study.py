"""The memory-bank study (G3-T4): what an LTM memory bank saves against standard attention at long contexts, and
what it costs in quality, which the guide never measured.

Three presets of one model (``G3-T4.<profile>.models``): ``standard`` (causal attention over the whole
context), ``window`` (sliding-window attention) and ``ltm`` (segments that read a bank of compressed past
segments, ``models/ltm.py``).

- Memory, at each context of ``contexts`` tokens, fresh weights in ``dtype``, no gradients: ``peak_mb``, a
  forward's peak over the weights: the standard model with SDPA's math backend (``math``: the scores in memory,
  the guide's "standard") and with its fused backends (``fused``); the LTM model segment by segment. ``state_mb``,
  what its decoder keeps for the next token (``generate.setup_kv_cache``): the standard model's KV cache for the
  context, the LTM model's segment caches and banks after prefilling the context. A model's memory at the
  context is its peak plus its state.
- Quality: each preset of ``quality_models`` (``models`` where it is null: a smaller trio can learn the task
  within a GPU call) trained from fresh weights on the same text, batches and steps (the train stage's run,
  ``train.py``), the recall task's lines mixed into that text where ``passkey_mix`` says (``mix_passkeys``);
  then its validation loss over windows of each of ``eval_contexts`` bytes (held-out files; the
  standard model's also with INT8 weight-only linears, the quality side of G3-T3's INT8 decode goal), and
  a passkey's recall at each of ``recall_distances``: a line ``passkey = "NNNNN"`` in held-out code, the same
  line's start ``distance`` bytes later, and the five digits read teacher-forced: the share of digits the
  model's argmax gets right (chance: a tenth, for a model that knows a digit comes).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from adaattn.timing.memory import peak_row
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.memory_bank.schema import RECALL_SPAN, MemoryBankRun
from adaattn.models.config import ModelConfig
from adaattn.models.transformer import build_model
from adaattn.models.data import VOCAB, batch, load_corpus
from adaattn.models.quant import quantize_int8_weight_only
from adaattn.models.train import DTYPES, Trainer
from adaattn_experiments.common.fit import evaluate, fit

MIB = 2**20
KEY, QUERY = b'passkey = "', b'"\n'  # the key's line: KEY, five digits, QUERY's quote and newline
DIGITS = 5


class MemoryBank(StudyDef):
    name = "memory_bank"
    table_ids = ("G3-T4", "G3-C1")
    config_columns = ["model", "role", "batch", "seq_len", "context", "distance", "step"]
    sections = ("G3-T4",)

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        run = raw[section][profile]
        return list(dict.fromkeys([*run["models"].values(), *(run.get("quality_models") or {}).values()]))

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> MemoryBank:
        return MemoryBank(device)

    def cases(self, params: Params, target: Target) -> list:
        return []  # memory by context and trained models: extra_rows

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        run: MemoryBankRun = getattr(params.g3_t4, target.profile)
        rows: list[dict] = []
        for context in run.contexts:
            for role in ("standard", "ltm"):
                self.note(f"memory at {context} tokens: {role}")
                torch.manual_seed(run.seed)
                rows += self._memory(run, role, params.models[run.models[role]], context)
                if self.device == "cuda":
                    torch.cuda.empty_cache()
        corpus = load_corpus(run.train.val_percent)
        if run.passkey_mix is not None:  # the held-out text stays as it is: loss and recall are read there
            mixed = mix_passkeys(corpus.train, run.passkey_mix.every, run.passkey_mix.max_distance,
                                 torch.Generator().manual_seed(run.seed + 4))
            corpus = dataclasses.replace(corpus, train=mixed)
        for role, name in run.trained.items():
            cfg = ModelConfig(**{**params.models[name].model_dump(), "vocab_size": VOCAB})
            self.note(f"training {role} ({name}) for {run.train.steps} steps, then its loss and recall")
            quality = functools.partial(self._quality, run, role, name, corpus.val)
            trained = fit(name, cfg, run.train, corpus, None, self.device, table_id="G3-T4", after=quality)
            rows += [{"role": role, **r} for r in trained]
            if self.device == "cuda":
                torch.cuda.empty_cache()
        return rows

    # memory -------------------------------------------------------------------------------------------------

    def _memory(self, run: MemoryBankRun, role: str, cfg: ModelConfig, context: int) -> list[dict]:
        B, dtype = run.batch, DTYPES[run.dtype]
        base = {"table_id": "G3-T4", "case_id": f"G3-T4/memory-{context}", "kernel": "", "model": run.models[role],
                "role": role, "batch": B, "context": context}
        # a byte vocabulary, as the trained models': the logits (B x context x vocabulary) would otherwise
        # outweigh the attention state this compares
        cfg = ModelConfig(**{**cfg.model_dump(), "vocab_size": VOCAB})
        try:
            model = build_model(cfg, device=self.device).to(dtype).eval()
        except Exception as err:  # noqa: BLE001 - a model that cannot be built is a status row
            from adaattn.errors import classify_error

            status, reason = classify_error(err)
            return [{**base, "provider": role, "mode": "peak", "metric": "peak_mb", "value": None, "unit": "MiB",
                     "status": status, "reason": reason}]
        tokens = torch.randint(0, cfg.vocab_size, (B, context), device=self.device)

        @torch.no_grad()
        def forward(backends: list[SDPBackend] | None) -> None:
            model.last_memory = None  # an LTM model's banks from the call before: not this call's
            if backends is None:
                model(tokens)
            else:
                with sdpa_kernel(backends):
                    model(tokens)

        rows = []
        if role == "standard":
            fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
            for provider, backends in (("math", [SDPBackend.MATH]), ("fused", fused)):
                rows.append(peak_row({**base, "provider": provider, "mode": "peak", "metric": "peak_mb"},
                                     functools.partial(forward, backends), self.device, 0,
                                     f"a forward over {context} tokens, no gradients, its peak over the weights "
                                     f"(SDPA's {provider} backend{'s' if provider == 'fused' else ''})"))
            rows.append(self._state(base, "kv_cache", model, tokens, prefill_first=False,
                                    reason="the KV cache a decoder keeps for the context: k and v, every layer "
                                    "(generate.KVCache's buffers, allocated)"))
        else:
            rows.append(peak_row({**base, "provider": "ltm", "mode": "peak", "metric": "peak_mb"},
                                 functools.partial(forward, None), self.device, 0,
                                 f"a forward over {context} tokens in segments of {cfg.segment_len}, no gradients, "
                                 "its peak over the weights (the banks included)"))
            rows.append(self._state(base, "segment_cache", model, tokens, prefill_first=True,
                                    reason="the LTM decoder's state after prefilling the context: each layer's "
                                    "segment cache (keys, values, inputs) and bank with its keys and values, "
                                    "allocated at the bank's capacity (ltm.SegmentCache's buffers)"))
        del model
        return rows

    def _state(self, base: dict, provider: str, model, tokens: torch.Tensor, prefill_first: bool,
               reason: str) -> dict:
        """The bytes a decoder keeps between tokens: its caches as ``setup_kv_cache`` makes them for the context
        (a standard model's hold every position from the start; an LTM model's, a segment and the bank's
        capacity), after a prefill of the context where ``prefill_first``."""
        from adaattn.errors import classify_error
        from adaattn.models.generate import clear_kv_cache, prefill, setup_kv_cache

        row = {**base, "provider": provider, "mode": "state", "metric": "state_mb", "unit": "MiB"}
        try:
            setup_kv_cache(model, tokens.shape[0], max_seq_len=tokens.shape[1])
            if prefill_first:
                with torch.no_grad():
                    prefill(model, tokens)
            held = sum(block.attn.cache.state_bytes() for block in model.blocks)
        except Exception as err:  # noqa: BLE001 - out of memory, say: a status row
            status, why = classify_error(err)
            return {**row, "value": None, "status": status, "reason": why}
        finally:
            clear_kv_cache(model)
        return {**row, "value": held / MIB, "status": "ok", "reason": reason}

    # quality ------------------------------------------------------------------------------------------------

    def _quality(self, run: MemoryBankRun, role: str, name: str, val: torch.Tensor, trainer: Trainer) -> list[dict]:
        """The trained model's validation loss by context length and its passkey recall by distance."""
        base = {"table_id": "G3-T4", "kernel": "", "model": name, "role": role, "provider": role, "status": "ok",
                "step": run.train.steps}
        trainer.model.eval()
        rows = []
        held = torch.Generator().manual_seed(run.seed + 2)  # every model reads the same windows
        # the standard model is the dense decoder G3-T3 serves: its INT8 weight-only copy's loss on the same windows
        # is the quality side of the INT8 decode goal
        int8 = quantize_int8_weight_only(copy.deepcopy(trainer.model)) if role == "standard" else None
        for context in run.eval_contexts:
            batches = max(1, run.train.eval_batches * run.train.seq_len // context)  # about the same bytes each
            windows = [batch(val, 1, context, held) for _ in range(batches)]
            for metric, model in (("val_loss", trainer.model), ("val_loss_int8", int8)):
                if model is None:
                    continue
                with serving(trainer, model):
                    loss = evaluate(trainer, windows)
                rows.append({**base, "case_id": f"G3-T4/val-{context}", "context": context, "mode": "eval",
                             "metric": metric, "value": loss, "unit": "nats",
                             "samples": batches, "reason": f"mean next-byte loss over {batches} held-out windows of "
                             f"{context} bytes"
                             + (", INT8 weight-only linears (models.quant)" if model is int8 else "")})
        recall = torch.Generator().manual_seed(run.seed + 3)
        for distance in run.recall_distances:
            hits = [self._recall(trainer, val, distance, recall) for _ in range(run.recall_trials)]
            rows.append({**base, "case_id": f"G3-T4/recall-{distance}", "distance": distance, "mode": "eval",
                         "metric": "recall_accuracy", "value": sum(hits) / len(hits), "unit": "share of digits",
                         "samples": len(hits), "reason": f"a passkey's {DIGITS} digits read {distance} bytes after "
                         "it, teacher-forced; chance 0.1"})
        return rows

    @torch.no_grad()
    def _recall(self, trainer: Trainer, val: torch.Tensor, distance: int, gen: torch.Generator) -> float:
        """One trial: the share of the passkey's digits the model's argmax reads right at the key's second line."""
        seq, at = passkey_sequence(val, distance, gen)
        tokens = seq.to(trainer.device)[None]
        logits = trainer.forward(tokens[:, :-1])[0]  # (S - 1, V): logits[i] predicts tokens[i + 1]
        guess = logits[at - 1: at - 1 + DIGITS].argmax(-1)
        return float((guess == tokens[0, at: at + DIGITS]).float().mean())



def mix_passkeys(text: torch.Tensor, every: int, max_distance: int, gen: torch.Generator) -> torch.Tensor:
    """``text`` (bytes) with the recall task's lines spliced in: about every ``every`` bytes a line ``passkey =
    "NNNNN"`` and, 16 to ``max_distance`` bytes of text later, the same line again (fresh digits each pair)."""
    n, at, pieces = text.numel(), 0, []
    starts = torch.randint(every // 2, every + every // 2 + 1, (n // every + 1,), generator=gen).tolist()
    gaps = torch.randint(16, max_distance + 1, (len(starts),), generator=gen).tolist()
    digits = (torch.randint(0, 10, (len(starts), DIGITS), generator=gen) + ord("0")).to(text.dtype)
    key, query = (torch.tensor(list(b), dtype=text.dtype) for b in (KEY, QUERY))
    for start, gap, d in zip(starts, gaps, digits):
        if at + start + gap > n:
            break
        line = torch.cat([key, d, query])
        pieces += [text[at:at + start], line, text[at + start:at + start + gap], line]
        at += start + gap
    pieces.append(text[at:])
    return torch.cat(pieces)


def passkey_sequence(val: torch.Tensor, distance: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Held-out code with a passkey's line, then ``distance`` bytes after its digits the same line again: the bytes
    (int64, at most ``distance + RECALL_SPAN`` of them) and where the second line's digits start."""
    digits = bytes(int(d) + ord("0") for d in torch.randint(0, 10, (DIGITS,), generator=gen))
    tail = digits + QUERY  # the first line's digits on, counted in the distance, then the second line's start
    filler = distance - len(tail) - len(KEY)
    if filler < 0:
        raise ValueError(f"distance={distance} is under a passkey line's {len(tail) + len(KEY)} bytes")
    text = batch(val, 1, filler, gen)[0, :filler]
    seq = torch.tensor(list(KEY + tail), dtype=torch.long)
    seq = torch.cat([seq, text, torch.tensor(list(KEY + digits), dtype=torch.long)])
    at = seq.numel() - DIGITS
    assert at - len(KEY) == distance and seq.numel() <= distance + RECALL_SPAN
    return seq, at


@contextlib.contextmanager
def serving(trainer: Trainer, model: torch.nn.Module) -> Iterator[None]:
    """``trainer.forward`` (its autocast and TF32 settings) on ``model`` for a while."""
    kept, trainer.model = trainer.model, model.eval()
    try:
        yield
    finally:
        trainer.model = kept


STUDY = MemoryBank()
