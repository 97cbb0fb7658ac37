"""A training run on the byte corpus, as the train study and the memory_bank study run it: a linear warm-up then
a cosine learning rate, the training loss and step time every ``log_every`` steps, the validation loss every
``eval_every`` steps and at the end."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from adaattn.errors import classify_error
from adaattn.models.config import ModelConfig
from adaattn.models.card import flops_per_token, param_counts
from adaattn.models.data import VOCAB, Corpus, batch
from adaattn.models.train import Trainer, create_optimized_training_setup, save_checkpoint
from adaattn.models.transformer import build_model
from adaattn_experiments.common.schedule import TrainSchedule


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """The learning rate's multiplier at ``step`` (0-based): linear warm-up, then a cosine to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def fit(name: str, preset: ModelConfig, run: TrainSchedule, corpus: Corpus, out: Path | None, device: str,
        table_id: str = "train", after: Callable[[Trainer], list[dict]] | None = None,
        convert: Callable[[nn.Module], nn.Module] | None = None, precision: str | None = None,
        label: str | None = None) -> list[dict]:
    """One model trained from fresh weights on ``run``'s schedule: its rows (losses, step times, tokens/s; the
    weights saved under ``out`` unless it is None). ``after`` (the trained model's trainer -> more rows) runs
    before the model is let go (the memory-bank study evaluates its models there). ``convert`` rewrites the fresh
    model before its optimizer is built (torchao's float8 training); ``precision`` fills a ``precision`` column
    where given; ``label`` (the preset's name by default) names the run in its rows and its weights' file."""
    B, S = run.batch, run.seq_len
    label = label or name
    base = {"table_id": table_id, "case_id": f"{table_id}/{label}-b{B}-s{S}", "kernel": "", "model": name,
            "batch": B, "seq_len": S, **({} if precision is None else {"precision": precision})}
    cfg = ModelConfig(**{**preset.model_dump(), "vocab_size": VOCAB})
    try:
        torch.manual_seed(run.seed)  # the same fresh weights for every run of a preset, converted or not
        model = build_model(cfg, device=device)
        model, optimizer, trainer = create_optimized_training_setup(model if convert is None else convert(model),
                                                                    lr=run.lr, compile_mode=None, dtype=run.dtype,
                                                                    device=device)
    except Exception as err:  # noqa: BLE001 - a model that cannot be built is a status row; the next one runs
        status, reason = classify_error(err)
        return [{**base, "provider": label, "mode": "step", "metric": "train_loss", "value": None, "unit": "nats",
                 "status": status, "reason": reason}]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, run.warmup, run.steps))
    data = torch.Generator().manual_seed(run.seed)  # every model sees the same batches in the same order
    held = torch.Generator().manual_seed(run.seed + 1)
    val = [batch(corpus.val, B, S, held) for _ in range(run.eval_batches)]
    counts = param_counts(model)
    flops = flops_per_token(cfg, counts, S)["train"] * B * S
    row = {**base, "provider": label, "status": "ok"}
    rows = [{**row, "mode": "step", "metric": "params_m", "value": counts["total"] / 1e6, "unit": "M parameters",
             "reason": f"at the byte vocabulary ({VOCAB})"},
            {**row, "mode": "step", "metric": "model_flops", "value": flops, "unit": "FLOP",
             "reason": "the card's training FLOPs per token x the batch's tokens"}]
    losses, timed_ms, timed_steps = [], 0.0, 0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=console, transient=False) as bar:
        task = bar.add_task(f"train {label}", total=run.steps, status="")
        sync()
        start, elapsed, first = time.perf_counter(), 0.0, True
        for step in range(1, run.steps + 1):
            losses.append(trainer.train_step(batch(corpus.train, B, S, data))["loss"])
            schedule.step()
            bar.advance(task)
            log = step % run.log_every == 0 or step == run.steps
            check = step % run.eval_every == 0 or step == run.steps
            if not (log or check):
                continue
            sync()
            elapsed += time.perf_counter() - start  # training steps only: evaluation is not timed
            if log:
                ms = elapsed * 1e3 / len(losses)
                loss = float(torch.stack(losses).mean())
                rows += [{**row, "mode": "step", "step": step, "metric": "train_loss", "value": loss,
                          "unit": "nats", "samples": len(losses),
                          "reason": "mean over the steps since the last row"},
                         {**row, "mode": "step", "step": step, "metric": "step_ms", "value": ms, "unit": "ms",
                          "samples": len(losses), "reason": "wall time per step since the last row, synchronized"}]
                if not first:  # the first interval holds the allocator's and the kernels' first calls
                    timed_ms, timed_steps = timed_ms + ms * len(losses), timed_steps + len(losses)
                first, losses, elapsed = False, [], 0.0
                bar.update(task, status=f"loss {loss:.3f}")
            if check:
                v = evaluate(trainer, val)
                rows.append({**row, "mode": "eval", "step": step, "metric": "val_loss", "value": v,
                             "unit": "nats", "samples": len(val), "reason": "held-out files, eval mode"})
                bar.update(task, status=f"val {v:.3f}")
            sync()
            start = time.perf_counter()
    if timed_steps:
        rows.append({**row, "mode": "step", "metric": "tokens_per_s", "value": B * S * timed_steps / timed_ms * 1e3,
                     "unit": "tokens/s", "samples": timed_steps, "reason": "over the steps after the first row"})
    if after is not None:
        rows += after(trainer)
    if out is not None:
        path = out / f"{label}.pt"
        save_checkpoint(path, model, step=run.steps, vocab=VOCAB)
        rows.append({**row, "mode": "step", "step": run.steps, "metric": "weights_mb",
                     "value": path.stat().st_size / 2**20, "unit": "MiB", "reason": f"{path.as_posix()}"})
    del model, optimizer, trainer
    return rows


@torch.no_grad()
def evaluate(trainer: Trainer, batches: list[torch.Tensor]) -> float:
    """Mean next-byte cross-entropy (nats) over ``batches``, the model in eval mode (left in it: a training step
    puts it back in training mode)."""
    trainer.model.eval()
    return val_loss(trainer.forward, batches, trainer.device)


@torch.no_grad()
def val_loss(forward: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor], device) -> float:
    """Mean next-byte cross-entropy (nats) of ``forward``'s logits over ``batches``."""
    total = 0.0
    for tokens in batches:
        tokens = tokens.to(device)
        logits = forward(tokens[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()))
    return total / len(batches)
