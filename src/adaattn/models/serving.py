"""Guide 003's serving helpers: ``find_optimal_batch_size`` (the largest batch a call runs at, found on the
device with out-of-memory recovery, cached), a ``ThroughputTracker`` with a live progress line (rich) and a
``BatchProcessor`` that serves many prompts in batches (its ``stats``: time, tokens/s and, on a GPU, each batch's
peak allocation). A call's peak memory on any device: ``adaattn.timing.memory.peak_memory_bytes``.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from adaattn.errors import classify_error
from adaattn.models.generate import clear_kv_cache, decode_one, generate, setup_kv_cache


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def find_optimal_batch_size(run: Callable[[int], object], max_batch: int, start: int = 1, device: str = "cuda",
                            cache: Path | None = None, key: str | None = None) -> int:
    """The largest batch in [start, max_batch] at which ``run(batch)`` completes: doubling from ``start`` until a
    call runs out of memory, then a binary search between the last batch that ran and the first that did not
    (memory freed after each failure; any other error is raised). With ``cache`` and ``key`` (say the model, the
    length and the GPU), a search already made returns its answer without running anything. Raises
    ``RuntimeError`` if even ``start`` runs out of memory."""
    if not 1 <= start <= max_batch:
        raise ValueError(f"start={start} and max_batch={max_batch}: need 1 <= start <= max_batch")
    if (cache is None) != (key is None):
        raise ValueError("cache and key go together: the cache is keyed by what the batch size depends on")
    answers = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    if key in answers:
        return int(answers[key])

    def fits(batch: int) -> bool:
        try:
            run(batch)
            return True
        except Exception as err:
            if classify_error(err)[0] != "oom":
                raise
            return False
        finally:
            _free(device)

    good, bad = 0, max_batch + 1  # the largest batch that ran; the smallest known not to (or past the range)
    batch = start
    while good < max_batch:
        if not fits(batch):
            bad = batch
            break
        good, batch = batch, min(2 * batch, max_batch)
    if good == 0:
        raise RuntimeError(f"batch {start} runs out of memory: nothing smaller to try")
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    if cache is not None:
        answers[key] = good
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
    return good


class ThroughputTracker:
    """Tokens per second over the calls ``update``d, with a live progress line: ``with ThroughputTracker(total)
    as t: ...; t.update(tokens)``; ``t.tokens_per_s`` after. ``sync`` (torch.cuda.synchronize on a GPU) runs
    before each reading, so a rate is of work done, not of work queued."""

    def __init__(self, total_steps: int, description: str = "tokens", sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, show: bool = True):
        self.total, self.sync, self.clock = total_steps, sync or (lambda: None), clock
        self.tokens, self.seconds = 0, 0.0
        self._progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  TextColumn("{task.fields[rate]}"), disable=not show)

    def __enter__(self) -> ThroughputTracker:
        self._progress.start()
        self._task = self._progress.add_task("", total=self.total, rate="")
        self.sync()
        self._start = self.clock()
        return self

    def update(self, tokens: int) -> None:
        self.sync()
        self.tokens += tokens
        self.seconds = self.clock() - self._start
        self._progress.update(self._task, advance=1, rate=f"{self.tokens_per_s:,.0f} tokens/s")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __exit__(self, *exc) -> None:
        self._progress.stop()


class BatchProcessor:
    """Serve many prompts with a static-cache decoder: prompts of one length go together in batches of up to
    ``max_batch`` (a static KV cache holds sequences of one length: no padding, no masks to get wrong; pick
    ``max_batch`` with ``find_optimal_batch_size``); each batch is a prefill and ``new_tokens`` decode steps
    (``generate``), its caches made for it. ``run`` returns the sequences in the order given; ``stats`` has a
    row per batch (size, prompt length, seconds, tokens/s, and on a GPU the batch's peak allocation: the memory
    monitor), and the progress line shows the rate as it goes. ``step``: a compiled ``decode_next``, generate's
    fast path (``decode``: a compiled ``decode_one``, its loop over logits)."""

    def __init__(self, model: torch.nn.Module, max_batch: int, new_tokens: int, temperature: float = 0.0,
                 decode: Callable | None = None, show: bool = True, step: Callable | None = None):
        if max_batch < 1 or new_tokens < 1:
            raise ValueError(f"max_batch={max_batch} and new_tokens={new_tokens} must be at least 1")
        self.model, self.max_batch, self.new_tokens, self.temperature = model, max_batch, new_tokens, temperature
        self.decode, self.show, self.step = decode, show, step
        self.stats: list[dict] = []

    def batches(self, prompts: list[torch.Tensor]) -> list[list[int]]:
        """Indices into ``prompts`` (1-D token tensors), grouped by length, longest first, ``max_batch`` at most."""
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            if p.dim() != 1 or p.numel() == 0:
                raise ValueError(f"prompt {i}: a non-empty 1-D tensor of token ids expected; got shape "
                                 f"{tuple(p.shape)}")
            by_len.setdefault(p.numel(), []).append(i)
        return [group[j:j + self.max_batch] for _, group in sorted(by_len.items(), reverse=True)
                for j in range(0, len(group), self.max_batch)]

    @torch.no_grad()
    def run(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        device = next(self.model.parameters()).device
        cuda = device.type == "cuda"
        groups, out = self.batches(prompts), [None] * len(prompts)
        sync = torch.cuda.synchronize if cuda else None
        with ThroughputTracker(len(groups), "batches", sync=sync, show=self.show) as tracker:
            for group in groups:
                tokens = torch.stack([prompts[i] for i in group]).to(device)
                B, P = tokens.shape
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                start = tracker.seconds
                setup_kv_cache(self.model, B, P + self.new_tokens)
                seqs = generate(self.model, tokens, self.new_tokens, self.temperature, decode=self.decode or decode_one,
                                step=self.step)
                tracker.update(B * self.new_tokens)
                clear_kv_cache(self.model)
                seconds = tracker.seconds - start
                self.stats.append({"batch": B, "prompt_len": P, "new_tokens": self.new_tokens, "seconds": seconds,
                                   "tokens_per_s": B * self.new_tokens / seconds if seconds > 0 else 0.0,
                                   "peak_mb": (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None})
                for row, i in enumerate(group):
                    out[i] = seqs[row].cpu()
        return out
