"""The train stage's report (HYDRA against a dense model of equal parameters), from the results table only."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn_pipeline.report.common import (Section, Verdict, cpu_targets, figure_link, filed, fmt, judge, md_table,
                                            prose)
from adaattn_experiments.train.schema import TrainGoals


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[(df["case_id"] != "machine") & (df["provider"] != "corpus")]
    if "precision" not in runs:  # results written before the column
        runs = runs.assign(precision=None)
    ok = runs[runs["status"] == "ok"]
    gemm = df[(df["case_id"] == "machine") & (df["metric"] == "gemm_tflops")].set_index("target")["value"]
    corpus = df[df["metric"] == "corpus_bytes"].drop_duplicates("target").set_index("target")["reason"]
    table, finals = [], {}  # finals: (target, run) -> (final validation loss, its step)
    for (target, run), frame in runs.groupby(["target", "provider"], sort=False):
        model = frame["model"].iloc[0]
        mine = ok[(ok["target"] == target) & (ok["provider"] == run)]
        if mine.empty:
            bad = frame.iloc[0]
            table.append({"target": target, "run": run, "model": model,
                          "status": f"{bad['status']}: {bad['reason']}"[:100]})
            continue

        def last(metric: str) -> float | None:
            rows = mine[mine["metric"] == metric].sort_values("step")
            return None if rows.empty else float(rows["value"].iloc[-1])

        tokens_s, flops = last("tokens_per_s"), last("model_flops")
        tokens = float(mine["batch"].iloc[0] * mine["seq_len"].iloc[0])
        mfu = flops / (tokens / tokens_s) / (gemm[target] * 1e12) if tokens_s and flops and target in gemm else None
        val = last("val_loss")
        if val is not None:
            finals[target, run] = val, int(mine[mine["metric"] == "val_loss"]["step"].max())
        table.append({"target": target, "run": run, "model": model, "precision": frame["precision"].iloc[0],
                      "params (M)": fmt(last("params_m")),
                      "steps": int(mine["step"].max()), "train loss (last rows)": fmt(last("train_loss")),
                      "validation loss": fmt(val), "bits / byte": fmt(val / math.log(2) if val else None),
                      "tokens/s": fmt(tokens_s), "MFU (measured GEMM)": fmt(mfu),
                      "weights MiB": fmt(last("weights_mb")), "status": "ok"})
    text = prose(__file__, "train",
                 corpus="; ".join(f"{t}: {c}" for t, c in corpus.items()),
                 table=md_table(pd.DataFrame(table)) if table else "no results",
                 equal=md_table(pd.DataFrame(_equal_quality(ok))) if len(ok) else "no results")
    return [Section("train", "HYDRA against a dense model of equal parameters (trained on real text)",
                    text + _curves(ok, out_dir)), _float8(runs, finals, cpu_targets(df)),
            _hydra(runs, ok, cpu_targets(df))]


def _wall_clock(ok: pd.DataFrame) -> dict[str, dict[str, dict]]:
    """Per target, the wall-clock each main run (the bf16 and fp32 runs of ``models``, not FP8's twins) takes to
    reach the validation loss every one of them reaches (the worst final one): its steps there, read off its
    validation curve by linear interpolation between evaluations, times its steady step time (the tokens/s row;
    evaluation and the first interval's compile and warm-up not counted)."""
    out = {}
    main = ok[ok["provider"] == ok["model"]]
    for target, frame in main.groupby("target", sort=False):
        curves, step_s = {}, {}
        for run, mine in frame.groupby("provider", sort=False):
            val = mine[mine["metric"] == "val_loss"].sort_values("step")
            rate = mine[mine["metric"] == "tokens_per_s"]["value"]
            if len(val) and len(rate):
                curves[run] = list(zip(val["step"].astype(int), val["value"]))
                step_s[run] = float(mine["batch"].iloc[0] * mine["seq_len"].iloc[0]) / float(rate.iloc[0])
        if len(curves) < 2:
            continue
        goal = max(c[-1][1] for c in curves.values())
        out[target] = {run: {"loss": goal, "steps": _first_step_at(curve, goal), "step_s": step_s[run]}
                       for run, curve in curves.items()}
        for r in out[target].values():
            r["seconds"] = r["steps"] * r["step_s"]
    return out


def _equal_quality(ok: pd.DataFrame) -> list[dict]:
    out = []
    for target, runs in _wall_clock(ok).items():
        fastest = min(r["seconds"] for r in runs.values())
        out += [{"target": target, "run": run, "validation loss reached": fmt(r["loss"]),
                 "steps to reach it": fmt(r["steps"]), "steady step ms": fmt(r["step_s"] * 1e3),
                 "wall-clock s": fmt(r["seconds"]), "x the fastest": f"{r['seconds'] / fastest:.2f}"}
                for run, r in runs.items()]
    return out


def _hydra(runs: pd.DataFrame, ok: pd.DataFrame, cpus: set[str]) -> Section:
    """Issue 67's HYDRA goals, per target and ``train.goals.hydra_pairs`` pair trained in that run: HYDRA's
    steady tokens/s over its dense peer's (at least ``hydra_tokens_ratio``) and its wall-clock to the loss both
    reach over the peer's (at most ``hydra_time_ratio``; ``_wall_clock``). One run each: a point, no interval."""
    g, verdicts, table = goals(), [], []
    clock = _wall_clock(ok)
    for target, frame in runs.groupby("target", sort=False):
        hw = frame["hardware"].iloc[0]
        rate = ok[(ok["target"] == target) & (ok["metric"] == "tokens_per_s") & (ok["provider"] == ok["model"])]
        rate = rate.set_index("provider")["value"]
        for hydra, dense in g.hydra_pairs.items():
            claims = (f"{hydra}: at least {g.hydra_tokens_ratio:g}x {dense}'s tokens/s (issue 67)",
                      f"{hydra}: at most {g.hydra_time_ratio:g}x {dense}'s wall-clock to the validation loss both "
                      "reach (issue 67)")
            bands = (f">= {g.hydra_tokens_ratio:g}x", f"<= {g.hydra_time_ratio:g}x")
            if hydra not in rate or dense not in rate:
                missing = ", ".join(m for m in (hydra, dense) if m not in rate)
                verdict = "not measurable here" if target in cpus else "not measured yet"
                why = ("a GPU goal; " if target in cpus else "") + f"no run of {missing} in this target's results"
                verdicts += [Verdict("G4-C1", c, b, "-", hw, verdict, why) for c, b in zip(claims, bands)]
                continue
            speed = float(rate[hydra]) / float(rate[dense])
            verdicts.append(Verdict("G4-C1", claims[0], bands[0], f"{speed:.3f}x", hw,
                                    judge((speed, speed), (g.hydra_tokens_ratio, None)),
                                    "one run each, the same batches: tokens/s after the first logged interval"))
            pair = {run: clock.get(target, {}).get(run) for run in (hydra, dense)}
            time = pair[hydra]["seconds"] / pair[dense]["seconds"] if all(pair.values()) else math.nan
            verdicts.append(Verdict("G4-C1", claims[1], bands[1], "-" if math.isnan(time) else f"{time:.2f}x", hw,
                                    judge((time, time), (None, g.hydra_time_ratio), higher_is_better=False),
                                    "one run each, the same batches: steps to the loss x the steady step time"))
            table.append({"target": target, "HYDRA": hydra, "dense": dense, "tokens/s ratio": f"{speed:.3f}",
                          "wall-clock ratio": "-" if math.isnan(time) else f"{time:.2f}"})
    md = prose(__file__, "hydra", table=md_table(pd.DataFrame(table)) if table else "no pair trained in one run")
    return Section("G4-C1", "HYDRA's speed and wall-clock against its dense peer (issue 67)", md, verdicts)


def _first_step_at(curve: list[tuple[int, float]], loss: float) -> float:
    """The first step where the validation curve (step, loss) reaches ``loss``, linear between evaluations (at
    the first evaluation if it is already there: an upper bound)."""
    if curve[0][1] <= loss:
        return float(curve[0][0])
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if v1 <= loss:
            return s0 + (s1 - s0) * (v0 - loss) / (v0 - v1)
    return float(curve[-1][0])  # unreachable: the goal is the worst final loss, which every curve reaches


def goals() -> TrainGoals:
    """The train study's goals as filed in params.yaml (``train.goals``; its defaults outside a render)."""
    return filed("train", "goals", TrainGoals())


def _float8(runs: pd.DataFrame, finals: dict, cpus: set[str]) -> Section:
    """Issue 67's FP8 price: each FP8 run's final validation loss over its twin's (the same preset, weights,
    batches and steps in the schedule's dtype, named ``<preset>-<dtype>``), against ``train.goals.fp8_val_loss``
    either way."""
    tol, table, verdicts = goals().fp8_val_loss, [], []
    is_fp8 = runs["precision"].fillna("").astype(str).str.startswith("fp8")
    fp8, twins = runs[is_fp8], runs[~is_fp8 & (runs["provider"] != runs["model"])]
    for (target, run), frame in fp8.groupby(["target", "provider"], sort=False):
        model, precision, hw = frame["model"].iloc[0], frame["precision"].iloc[0], frame["hardware"].iloc[0]
        mine = twins[(twins["target"] == target) & (twins["model"] == model)].drop_duplicates("provider")
        twin, dtype = (mine["provider"].iloc[0], mine["precision"].iloc[0]) if len(mine) else (None, "bf16")
        claim = (f"{model}: FP8 training ({precision.removeprefix('fp8_')}) ends within {tol:.0%} of {dtype}'s "
                 "validation loss after the same tokens (issue 67)")
        band = f"{1 - tol:.2f}-{1 + tol:.2f}x"
        ours, theirs = finals.get((target, run)), finals.get((target, twin))
        if ours is None or theirs is None or ours[1] != theirs[1]:
            bad = frame[frame["status"] != "ok"]
            why = f"{bad['status'].iloc[0]}: {bad['reason'].iloc[0]}" if len(bad) else \
                "no final validation loss of both runs at the same step"
            verdicts.append(Verdict("G0-T1", claim, band, "-", hw,
                                    "not measurable here" if target in cpus else "not measured yet", why))
            table.append({"target": target, "model": model, "FP8 run": run, "note": why[:100]})
            continue
        ratio = ours[0] / theirs[0]
        verdicts.append(Verdict("G0-T1", claim, band, f"{ratio:.4f} ({ours[0]:.4f} / {theirs[0]:.4f} nats)", hw,
                                judge((ratio, ratio), (1 - tol, 1 + tol), higher_is_better=False),
                                f"one run each, step {ours[1]}, the held-out windows of the run"))
        table.append({"target": target, "model": model, "FP8 run": run, "twin": twin, "steps": ours[1],
                      "twin's validation loss": fmt(theirs[0]), "FP8 validation loss": fmt(ours[0]),
                      "FP8 / bf16": f"{ratio:.4f}", "note": ""})
    md = prose(__file__, "float8", table=md_table(pd.DataFrame(table)) if table else "no FP8 runs")
    return Section("G0-T1", "FP8 training's price in validation loss (issue 67)", md, verdicts)


def _curves(ok: pd.DataFrame, out_dir: Path) -> str:
    curves = ok[ok["metric"].isin(["train_loss", "val_loss"])].dropna(subset=["step"])
    parts = []
    for target, frame in curves.groupby("target", sort=False):
        grid = sns.relplot(data=frame, x="step", y="value", hue="provider", style="metric", kind="line", markers=True,
                           height=3.5, aspect=1.6)
        grid.set_axis_labels("step", "loss (nats per byte)")
        grid.figure.suptitle(f"train: loss curves on {frame['hardware'].iloc[0]} ({target})", y=1.03)
        parts.append(figure_link(grid.figure, out_dir, f"train_loss_{target}.png", f"loss curves, {target}"))
    return "\n" + "\n".join(parts) if parts else ""
