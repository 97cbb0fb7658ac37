"""The train study: each model of ``train.<profile>.models`` (HYDRA and a dense model of equal parameters)
trained from fresh weights on the same real text, the same batches in the same order, for the same steps.

Text: Python's standard-library sources as bytes (``models.data``), a held-out share of the files for
validation. Each model: ``create_optimized_training_setup`` (AdamW, fused on a GPU; autocast to the run's
dtype; eager), a linear warm-up then a cosine to a tenth of ``lr`` (``common.fit``). Rows per model: the
training loss every ``log_every`` steps (its mean over them) and the time per step over them (``step`` column:
the curve, which MLflow logs as each metric's history); the validation loss every ``eval_every`` steps and at
the end, in eval mode (HYDRA routes causally there: a token by its router's score, not by a top-k over the
sequence); tokens/s over the steps after the first interval; the model's FLOPs per step. The weights are saved
on the machine that trained them, ``models/weights/<target>/<model>.pt`` (``models.train.load_model``; outside
git and DVC: the results are what the pipeline keeps, and a fresh clone has no weights to miss).
"""

from __future__ import annotations

from pathlib import Path

import torch

from adaattn.models.data import load_corpus
from adaattn_experiments.common.fit import fit
from adaattn_experiments.train.schema import TrainRun
from adaattn_pipeline.bench.harness import Case
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.config import Params, Target

WEIGHTS = Path("models/weights")


class Train(StudyDef):
    name = "train"
    table_ids = ("train",)
    config_columns = ["model", "batch", "seq_len", "step"]
    sections = ("train",)

    def __init__(self, device: str = "cpu", weights_root: Path = WEIGHTS):
        self.device, self.weights_root = device, weights_root

    def bind(self, device: str) -> Train:
        return Train(device, self.weights_root)

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        return list(raw[section][profile]["models"])

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
            rows += fit(model, params.models[model], run, corpus, self.weights_root / name, self.device)
            if self.device == "cuda":
                torch.cuda.empty_cache()
        return rows


STUDY = Train()
