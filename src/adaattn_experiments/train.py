"""The train stage: each model of ``train.<profile>.models`` (HYDRA and a dense model of equal parameters)
trained from fresh weights on the same real text, the same batches in the same order, for the same steps.

Text: Python's standard-library sources as bytes (``models.data``), a held-out share of the files for
validation. Each model: ``create_optimized_training_setup`` (AdamW, fused on a GPU; autocast to the run's
dtype; eager), a linear warm-up then a cosine to a tenth of ``lr``. Rows per model: the training loss every
``log_every`` steps (its mean over them) and the time per step over them (``step`` column: the curve, which
MLflow logs as each metric's history); the validation loss every ``eval_every`` steps and at the end, in
eval mode (HYDRA routes causally there: a token by its router's score, not by a top-k over the sequence);
tokens/s over the steps after the first interval; the model's FLOPs per step; and, on a ``train.keep_weights``
target, the weights, saved to ``models/weights/<target>/<model>.pt`` (the stage's DVC output, outside git;
``models.train.load_model``); a ``train.results_only`` target's stage keeps its results only.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from adaattn.bench.harness import Case, classify_error
from adaattn.bench.runner import StudyDef, target_sections
from adaattn.config import Params, Target, TrainRun, TrainSchedule
from adaattn.models import ModelConfig
from adaattn.models.card import flops_per_token, param_counts
from adaattn.models.data import VOCAB, Corpus, batch, load_corpus
from adaattn.models.train import Trainer, create_optimized_training_setup, save_checkpoint
from adaattn.report.common import Section

WEIGHTS = Path("models/weights")


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """The learning rate's multiplier at ``step`` (0-based): linear warm-up, then a cosine to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Train(StudyDef):
    name = "train"
    table_ids = ("train",)
    config_columns = ["model", "batch", "seq_len", "step"]

    def __init__(self, device: str = "cpu", weights_root: Path = WEIGHTS):
        self.device, self.weights_root = device, weights_root

    def bind(self, device: str) -> Train:
        return Train(device, self.weights_root)

    def param_sections(self, raw: dict, target: Target, target_name: str) -> dict[str, Any]:
        sections = target_sections(raw, target_name, ("train",))
        return {**sections, **{f"models.{m}": raw["models"][m] for m in sections["train"]["models"]}}

    def cases(self, params: Params, target: Target) -> list[Case]:
        return []  # the unit is a training run: extra_rows runs it

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        run: TrainRun = getattr(params.train, target.profile)
        name = next(n for n, t in params.targets.items() if t is target)
        corpus = load_corpus(run.val_percent)
        info = ", ".join(f"{k} {v}" for k, v in corpus.info.items())
        rows = [{"table_id": "train", "case_id": "train/corpus", "provider": "corpus", "mode": "", "metric":
                 "corpus_bytes", "value": corpus.info["train_bytes"] + corpus.info["val_bytes"], "unit": "bytes",
                 "status": "ok", "reason": info, "kernel": ""}]
        keep = name in params.train.keep_weights
        for model in run.models:
            rows += self.train_model(model, params.models[model], run, corpus,
                                     self.weights_root / name if keep else None)
            if not keep:  # a train.results_only target: say where the weights went
                rows.append({"table_id": "train", "case_id": f"train/{model}-b{run.batch}-s{run.seq_len}",
                             "kernel": "", "model": model, "batch": run.batch, "seq_len": run.seq_len,
                             "provider": model, "mode": "step", "step": run.steps, "metric": "weights_mb",
                             "value": None, "unit": "MiB", "status": "unavailable",
                             "reason": "not kept: a train.results_only target's stage keeps its results only"})
            if self.device == "cuda":
                torch.cuda.empty_cache()
        return rows

    def train_model(self, name: str, preset: ModelConfig, run: TrainSchedule, corpus: Corpus, out: Path | None,
               table_id: str = "train", after: Callable[[Trainer], list[dict]] | None = None) -> list[dict]:
        """One model's run: its rows; ``after`` (the trained model's trainer -> more rows) runs before the model is
        let go (the memory-bank study evaluates its models there)."""
        B, S = run.batch, run.seq_len
        base = {"table_id": table_id, "case_id": f"{table_id}/{name}-b{B}-s{S}", "kernel": "", "model": name,
                "batch": B, "seq_len": S}
        cfg = ModelConfig(**{**preset.model_dump(), "vocab_size": VOCAB})
        try:
            torch.manual_seed(run.seed)
            model, optimizer, trainer = create_optimized_training_setup(cfg, lr=run.lr, compile_mode=None,
                                                                        dtype=run.dtype, device=self.device)
        except Exception as err:  # noqa: BLE001 - a model that cannot be built is a status row; the next one runs
            status, reason = classify_error(err)
            return [{**base, "provider": name, "mode": "step", "metric": "train_loss", "value": None, "unit": "nats",
                     "status": status, "reason": reason}]
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, run.warmup, run.steps))
        data = torch.Generator().manual_seed(run.seed)  # every model sees the same batches in the same order
        held = torch.Generator().manual_seed(run.seed + 1)
        val = [batch(corpus.val, B, S, held) for _ in range(run.eval_batches)]
        counts = param_counts(model)
        flops = flops_per_token(cfg, counts, S)["train"] * B * S
        row = {**base, "provider": name, "status": "ok"}
        rows = [{**row, "mode": "step", "metric": "params_m", "value": counts["total"] / 1e6, "unit": "M parameters",
                 "reason": f"at the byte vocabulary ({VOCAB})"},
                {**row, "mode": "step", "metric": "model_flops", "value": flops, "unit": "FLOP",
                 "reason": "the card's training FLOPs per token x the batch's tokens"}]
        losses, timed_ms, timed_steps = [], 0.0, 0
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        console = Console(stderr=True)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[status]}"), console=console, transient=False) as bar:
            task = bar.add_task(f"train {name}", total=run.steps, status="")
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
            path = out / f"{name}.pt"
            save_checkpoint(path, model, step=run.steps, vocab=VOCAB)
            rows.append({**row, "mode": "step", "step": run.steps, "metric": "weights_mb",
                         "value": path.stat().st_size / 2**20, "unit": "MiB", "reason": f"{path.as_posix()}"})
        del model, optimizer, trainer
        return rows

    def render(self, df: pd.DataFrame, out_dir: Path) -> list[Section]:
        from adaattn_experiments.train_report import render

        return render(df, out_dir)


@torch.no_grad()
def evaluate(trainer: Trainer, batches: list[torch.Tensor]) -> float:
    """Mean next-byte cross-entropy (nats) over ``batches``, the model in eval mode (left in it: a training step
    puts it back in training mode)."""
    trainer.model.eval()
    total = 0.0
    for tokens in batches:
        tokens = tokens.to(trainer.device)
        logits = trainer.forward(tokens[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()))
    return total / len(batches)


STUDY = Train()
