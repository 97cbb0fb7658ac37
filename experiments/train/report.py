"""The train stage's report (HYDRA against a dense model of equal parameters), from the results table only."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn_pipeline.report.common import Section, figure_link, fmt, md_table, prose


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[(df["case_id"] != "machine") & (df["provider"] != "corpus")]
    ok = runs[runs["status"] == "ok"]
    gemm = df[(df["case_id"] == "machine") & (df["metric"] == "gemm_tflops")].set_index("target")["value"]
    corpus = df[df["metric"] == "corpus_bytes"].drop_duplicates("target").set_index("target")["reason"]
    table = []
    for (target, model), frame in runs.groupby(["target", "model"], sort=False):
        mine = ok[(ok["target"] == target) & (ok["model"] == model)]
        if mine.empty:
            bad = frame.iloc[0]
            table.append({"target": target, "model": model, "status": f"{bad['status']}: {bad['reason']}"[:100]})
            continue

        def last(metric: str) -> float | None:
            rows = mine[mine["metric"] == metric].sort_values("step")
            return None if rows.empty else float(rows["value"].iloc[-1])

        tokens_s, flops = last("tokens_per_s"), last("model_flops")
        tokens = float(mine["batch"].iloc[0] * mine["seq_len"].iloc[0])
        mfu = flops / (tokens / tokens_s) / (gemm[target] * 1e12) if tokens_s and flops and target in gemm else None
        val = last("val_loss")
        table.append({"target": target, "model": model, "params (M)": fmt(last("params_m")),
                      "steps": int(mine["step"].max()), "train loss (last rows)": fmt(last("train_loss")),
                      "validation loss": fmt(val), "bits / byte": fmt(val / math.log(2) if val else None),
                      "tokens/s": fmt(tokens_s), "MFU (measured GEMM)": fmt(mfu),
                      "weights MiB": fmt(last("weights_mb")), "status": "ok"})
    text = prose(__file__, "train",
                 corpus="; ".join(f"{t}: {c}" for t, c in corpus.items()),
                 table=md_table(pd.DataFrame(table)) if table else "no results")
    return [Section("train", "HYDRA against a dense model of equal parameters (trained on real text)",
                    text + _curves(ok, out_dir))]


def _curves(ok: pd.DataFrame, out_dir: Path) -> str:
    curves = ok[ok["metric"].isin(["train_loss", "val_loss"])].dropna(subset=["step"])
    parts = []
    for target, frame in curves.groupby("target", sort=False):
        grid = sns.relplot(data=frame, x="step", y="value", hue="model", style="metric", kind="line", markers=True,
                           height=3.5, aspect=1.6)
        grid.set_axis_labels("step", "loss (nats per byte)")
        grid.figure.suptitle(f"train: loss curves on {frame['hardware'].iloc[0]} ({target})", y=1.03)
        parts.append(figure_link(grid.figure, out_dir, f"train_loss_{target}.png", f"loss curves, {target}"))
    return "\n" + "\n".join(parts) if parts else ""
