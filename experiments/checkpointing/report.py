"""The checkpointing report (G4-T3, G4-T1's checkpointing line), from the results table only (the sweep:
``checkpointing.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn_pipeline.report.common import (Section, Verdict, cpu_targets, figure_link, fmt, guide_figures, judge,
                                            knobs, md_table, prose, tolerance_for)

GB = 2**20 / 1e9  # MiB -> GB (the guide's unit)


def _metric(runs: pd.DataFrame, metric: str) -> pd.Series:
    ok = runs[(runs["metric"] == metric) & (runs["status"] == "ok")]
    return ok.set_index(["target", "model", "provider"])["value"]


def _guide_row(params_m: float) -> str | None:
    """The guide's size row ("100M", "500M", "1B") within 1.5x of a model's parameters, if any."""
    sizes = {k: float(k[:-1]) * (1e3 if k.endswith("B") else 1) for k in guide_figures()["G4-T3"]["figures"]}
    name, size = min(sizes.items(), key=lambda kv: abs(math.log(params_m / kv[1])))
    return name if abs(math.log(params_m / size)) <= math.log(1.5) else None


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[df["case_id"] != "machine"]
    peak, fwd, est = (_metric(runs, m) for m in ("step_peak_mem_mb", "fwd_peak_mem_mb", "estimated_mem_mb"))
    step = _metric(runs, "step_side_by_side_ms")
    params = runs[runs["metric"] == "params_m"].set_index(["target", "model"])["value"]
    flops = runs[runs["metric"] == "model_flops"].set_index(["target", "model"])["value"]
    gemm = df[(df["case_id"] == "machine") & (df["metric"] == "gemm_tflops")].set_index("target")["value"]
    table, t3, t1, goal = [], [], [], []
    tol, cpus = knobs().memory_estimate, cpu_targets(df)
    for (target, model), frame in runs[runs["provider"] != "model"].groupby(["target", "model"], sort=False):
        hw = frame["hardware"].iloc[0]
        tokens = int(frame["batch"].iloc[0] * frame["seq_len"].iloc[0])
        order = list(dict.fromkeys(frame["provider"]))
        none = (target, model, "none")
        for gran in order:
            key = (target, model, gran)
            ms, measured, guess = step.get(key), peak.get(key), est.get(key)
            mfu = flops[(target, model)] / (ms / 1e3) / (gemm[target] * 1e12) if ms and target in gemm else None
            table.append({
                "target": target, "model": model, "params (M)": fmt(params.get((target, model))),
                "checkpointing": gran, "step peak GB": fmt(measured * GB if measured else None),
                "forward peak GB": fmt(fwd.get(key, math.nan) * GB),
                "estimate GB": fmt(guess * GB if guess else None),
                "estimate / peak": fmt(guess / measured if guess and measured else None),
                "forward memory vs none": fmt(fwd.get(key, math.nan) / fwd.get(none, math.nan)),
                "step ms": fmt(ms), "tokens/s": fmt(tokens / ms * 1e3 if ms else None),
                "step time vs none": fmt(ms / step[none] if ms and none in step else None),
                "MFU (measured GEMM)": fmt(mfu)})
            if guess and measured:
                ratio = guess / measured
                cpu = target in cpus
                verdict = "not measurable here" if cpu else "holds" if abs(ratio - 1) <= tol else "worse than claimed"
                goal.append(Verdict("G4-T3", f"estimate within {tol:.0%} of the measured peak ({model}, {gran})",
                                    f"within {tol:.0%}", f"{ratio:.3g}x the peak", hw, verdict,
                                    "the estimate is of the GPU path: on a CPU the kernels' PyTorch references and "
                                    "SDPA's math path keep fp32 copies" if cpu else
                                    "models.card.estimate_memory against the step's measured peak"))
        t3 += _g4_t3(target, model, hw, peak, params.get((target, model)))
        t1 += _g4_t1(target, model, hw, fwd)
    md = prose(__file__, "g4_t3", table=md_table(pd.DataFrame(table)) if table else "no results")
    figures = _figure(runs, peak, est, out_dir)
    return [Section("G4-T3", "Memory Comparison (gradient checkpointing)", md + figures, t3 + goal),
            Section("G4-T1", "Summary of Changes (checkpointing's activation memory)",
                    "From the G4-T3 table: the forward's peak with full checkpointing over the peak without.\n", t1)]


def _g4_t3(target: str, model: str, hw: str, peak: pd.Series, params_m: float | None) -> list[Verdict]:
    without, with_ = peak.get((target, model, "none")), peak.get((target, model, "full"))
    row = _guide_row(params_m) if params_m else None
    if row is None or without is None or with_ is None:
        return []
    g = guide_figures()["G4-T3"]["figures"][row]
    ratio, claimed = with_ / without, g["with_gb"] / g["without_gb"]
    # read on the ratio with / without (the guide's GB are not comparable to ours): a ratio's tolerance
    verdict = judge((ratio, ratio), (claimed, claimed), higher_is_better=False, tolerance=tolerance_for("ratio"))
    return [Verdict("G4-T3", f"{row}: {g['without_gb']:g} GB without, {g['with_gb']:g} GB with checkpointing",
                    f"{g['without_gb']:g} GB without, {g['with_gb']:g} GB with: {claimed:.2f}x",
                    f"{without * GB:.3g} GB without, {with_ * GB:.3g} GB with: {ratio:.2f}x", hw, verdict,
                    f"{model} ({params_m:.0f}M), full checkpointing; judged on the ratio: the guide names no batch "
                    f"or length, so its GB are not comparable to ours")]


def _g4_t1(target: str, model: str, hw: str, fwd: pd.Series) -> list[Verdict]:
    without, with_ = fwd.get((target, model, "none")), fwd.get((target, model, "full"))
    if without is None or with_ is None:
        return []
    claimed = guide_figures()["G4-T1"]["figures"]["checkpointing_activation_reduction"]
    cut = 1 - with_ / without
    verdict = judge((cut, cut), (claimed, claimed), higher_is_better=True, tolerance=knobs().guide_ratio_tolerance)
    return [Verdict("G4-T1", "checkpointing: ~40% less activation memory", f"{claimed:.0%} less",
                    f"{cut:.0%} less ({model})", hw, verdict,
                    "the forward's peak, full checkpointing against none")]


def _figure(runs: pd.DataFrame, peak: pd.Series, est: pd.Series, out_dir: Path) -> str:
    frame = pd.concat([peak.rename("measured"), est.rename("estimate")], axis=1).reset_index()
    frame = frame.dropna(subset=["measured"])
    if frame.empty:
        return ""
    parts = []
    for target, sub in frame.groupby("target", sort=False):
        long = sub.melt(id_vars=["model", "provider"], value_vars=["measured", "estimate"], var_name="source",
                        value_name="MiB")
        long["GB"] = long["MiB"] * GB
        grid = sns.catplot(data=long, x="provider", y="GB", hue="source", col="model", kind="bar", sharey=False,
                           height=3.2, aspect=1.0)
        grid.set_axis_labels("checkpointing", "training step peak (GB)")
        hw = runs[runs["target"] == target]["hardware"].iloc[0]
        grid.figure.suptitle(f"G4-T3 step memory on {hw} ({target}): measured peak and the card's estimate", y=1.03)
        parts.append(figure_link(grid.figure, out_dir, f"g4_t3_memory_{target}.png", f"step memory, {target}"))
    return "\n" + "\n".join(parts)
