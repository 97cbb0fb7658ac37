"""The train study: each model of ``train.<profile>.models`` (HYDRA and a dense model of equal parameters)
trained from fresh weights on the same real text, the same batches in the same order, for the same steps.

Text: Python's standard-library sources as bytes (``models.data``), a held-out share of the files for validation.
Each model: ``create_optimized_training_setup`` (AdamW, fused on a GPU; autocast to the run's dtype), compiled as
the schedule's ``compile_mode`` and ``compile_scope`` say (eager by default), a linear warm-up then a cosine to a
tenth of ``lr`` (``common.fit``). Rows per model: the training loss every ``log_every`` steps (its mean over them)
and the time per step over them (``step`` column: the curve, which MLflow logs as each metric's history); the
validation loss every ``eval_every`` steps and at the end, in eval mode (HYDRA routes causally there: a token by its
router's score, not by a top-k over the sequence); tokens/s over the steps after the first interval; the model's
FLOPs per step. ``float8`` (issue 67): its presets trained twice more on its own schedule, in bf16 and under
torchao's float8 training (compiled with the recipe's ``compile_options``), from the same weights on the same
batches, so that FP8's price is a validation loss read
beside its twin's (a row that says why where FP8 GEMMs cannot run); a ``precision`` column names each run's. The
weights are saved on the machine that trained them, ``models/weights/<target>/<model>.pt``
(``models.train.load_model``; outside git and DVC: the results are what the pipeline keeps, and a fresh clone has no
weights to miss).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from adaattn.models.data import Corpus, load_corpus
from adaattn.models.train import optimize_model
from adaattn_experiments.common.fit import fit
from adaattn_experiments.common.float8 import compile_options, float8_unavailable, to_float8
from adaattn_experiments.train.schema import CompiledSchedule, Float8Price, TrainRun
from adaattn_pipeline.bench.harness import Case
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.config import Params, Target

WEIGHTS = Path("models/weights")


class Train(StudyDef):
    name = "train"
    table_ids = ("train",)
    config_columns = ["model", "precision", "batch", "seq_len", "step"]
    sections = ("train",)

    def __init__(self, device: str = "cpu", weights_root: Path = WEIGHTS):
        self.device, self.weights_root = device, weights_root

    def bind(self, device: str) -> Train:
        return Train(device, self.weights_root)

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        run = raw[section][profile]
        return list(dict.fromkeys([*run["models"], *((run.get("float8") or {}).get("models") or [])]))

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
        for model in run.models:
            rows += fit(model, params.models[model], run, corpus, self.weights_root / name, self.device,
                        convert=_compiler(run), precision=run.dtype)
            self._release()
        if run.float8 is not None:
            rows += self._float8_rows(params, run.float8, corpus)
        return rows

    def _float8_rows(self, params: Params, price: Float8Price, corpus: Corpus) -> list[dict]:
        """Each preset's bf16 and FP8 runs on ``price``'s schedule (weights not kept: the price is the result)."""
        fp8, rows = f"fp8_{price.recipe}", []
        why = float8_unavailable(self.device)
        for model in price.models:
            if why is not None:
                B, S = price.batch, price.seq_len
                rows.append({"table_id": "train", "case_id": f"train/{model}-{fp8}-b{B}-s{S}", "kernel": "",
                             "model": model, "precision": fp8, "batch": B, "seq_len": S,
                             "provider": f"{model}-{fp8}", "mode": "eval", "metric": "val_loss", "value": None,
                             "unit": "nats", "status": "unavailable", "reason": why})
                continue
            compile_, compile_fp8 = _compiler(price), _compiler(price, compile_options(price.recipe))
            for precision, convert in ((price.dtype, compile_),
                                       (fp8, lambda m: compile_fp8(to_float8(m, recipe=price.recipe)))):
                rows += fit(model, params.models[model], price, corpus, None, self.device, convert=convert,
                            precision=precision, label=f"{model}-{precision}")
                self._release()
        return rows

    def _release(self) -> None:
        # each run compiles afresh, as in a process of its own: the blocks of every preset and twin share one
        # forward's code, and their graphs would otherwise pile up on it to dynamo's recompile limit
        torch._dynamo.reset()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def _compiler(run: CompiledSchedule, options: dict | None = None) -> Callable[[nn.Module], nn.Module]:
    """The fresh model compiled as ``run`` says (with inductor ``options``), before its optimizer is built (the
    trainer then casts and moves it: compilation wraps the module, it does not copy the parameters)."""
    return lambda model: optimize_model(model, compile_mode=run.compile_mode, tf32=False,
                                        compile_scope=run.compile_scope, compile_options=options)[0]


STUDY = Train()
