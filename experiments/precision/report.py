"""Report of the precision study: G2-T3 (speed, memory and error of each precision vs fp32) and
G2-T2's precision line, rendered from the results table only (see ``precision.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn.attention.backends import Signature
from adaattn_pipeline.report.common import (Section, Verdict, cpu_targets, fmt, guide_figures, judge, knobs, md_table,
                                            prose, save_figure)
from adaattn_experiments.precision.study import DTYPE_OF

PRECISIONS = ["fp32", "tf32", "fp16", "bf16"]
GPU_CLAIM = "a GPU claim (tensor cores); this target is a CPU"
KEY = ["target", "hardware", "op", "inputs", "mode"]


def block_backends(df: pd.DataFrame) -> dict[tuple[str, str, str], str]:
    """(target, dtype as torch names it, mode) -> the backend the block's kernel manager chose (its ranking's
    first), from the ``manager_ranking`` rows: the signature key's dtype and grad fields."""
    out = {}
    for _, r in df[df["metric"] == "manager_ranking"].iterrows():
        sig = Signature.from_key(str(r["case_id"]).removeprefix("manager/"))
        out[(r["target"], sig.dtype, "fwd_bwd" if sig.grad else "fwd")] = str(r["kernel"]).split(" ")[0]
    return out


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    chosen = block_backends(df)
    runs = df[(df["case_id"] != "machine") & (df["status"] == "ok") & ~df["case_id"].astype(str).str.startswith("manager/")]
    wide = runs.pivot_table(index=[*KEY, "provider"], columns="metric", values="value").reset_index()
    base = wide[wide["provider"] == "fp32"].set_index(KEY)
    rows = []
    for _, r in wide.iterrows():
        b = base.loc[tuple(r[k] for k in KEY)] if tuple(r[k] for k in KEY) in base.index else None
        dtype = str(DTYPE_OF[r["provider"]]).removeprefix("torch.")
        backend = "SDPA's own" if r["op"] == "attention" else chosen.get((r["target"], dtype, r["mode"]), "-")
        rows.append({**{k: r[k] for k in KEY}, "precision": r["provider"], "attention backend": backend,
                     "ms": r.get("time_ms"), "speed vs fp32": b["time_ms"] / r["time_ms"] if b is not None else None,
                     "memory vs fp32": r["peak_mem_mb"] / b["peak_mem_mb"] if b is not None else None,
                     "MSE vs float64": r.get("mse"), "rel L1": r.get("rel_l1"), "cosine": r.get("cosine")})
    t = pd.DataFrame(rows)
    t["precision"] = pd.Categorical(t["precision"], PRECISIONS)
    t = t.sort_values([*KEY, "precision"])
    guide = guide_figures()["G2-T3"]["figures"]
    verdicts = _verdicts(t, guide, guide_figures()["G2-T2"]["figures"], cpu_targets(df))
    parts = []
    for target, f in t[t["mode"] == "fwd"].groupby("target"):
        f = f.dropna(subset=["MSE vs float64"])
        if f.empty:
            continue
        grid = sns.catplot(data=f, x="precision", y="MSE vs float64", hue="inputs", col="op", kind="bar",
                           height=2.8, aspect=1.2, order=[p for p in PRECISIONS if p in set(f["precision"])])
        grid.set(yscale="log")
        name = f"g2_t3_mse_{target}.png"
        save_figure(grid.figure, out_dir / name)
        parts.append(f"![MSE, {target}]({out_dir.name}/{name})\n")
    shown = t.copy()
    for col in ("ms", "speed vs fp32", "memory vs fp32", "MSE vs float64", "rel L1", "cosine"):
        shown[col] = shown[col].map(lambda v: fmt(v, 4 if v is not None and pd.notna(v) and v > 0.99 else 3))
    gtab = pd.DataFrame([{"precision": p, "guide speed vs FP32": f"~{guide['speed_vs_fp32'][p]}x",
                          "guide memory vs FP32": f"~{guide['memory_vs_fp32'][p]}x",
                          "guide MSE vs FP32": f"< {guide['mse_vs_fp32_below'][p]:g}" if guide["mse_vs_fp32_below"][p]
                          else "0.0"} for p in guide["speed_vs_fp32"]])
    md = prose(__file__, "g2_t3", figures="\n".join(parts), guide_table=md_table(gtab),
               shown_table=md_table(shown))
    return [Section("G2-T3", "Precision Mode Accuracy", md, verdicts)]


def _verdicts(t: pd.DataFrame, guide: dict, g2_t2: dict, cpu_targets: set[str]) -> list[Verdict]:
    out, tol = [], knobs().precision_tolerance
    sel = t[(t["mode"] == "fwd") & (t["inputs"] == "normal")]
    for (target, hw, op), f in sel.groupby(["target", "hardware", "op"]):
        by = f.set_index("precision")
        for p in ("fp16", "bf16"):
            if p not in by.index or pd.isna(by.loc[p, "ms"]):
                continue
            r = by.loc[p]
            g_speed, g_mem, g_mse = guide["speed_vs_fp32"][p], guide["memory_vs_fp32"][p], guide["mse_vs_fp32_below"][p]
            speed, mem, mse = r["speed vs fp32"], r["memory vs fp32"], r["MSE vs float64"]
            # the speed claims are GPU claims (tensor cores); memory and rounding error hold on any device
            on_gpu = target not in cpu_targets
            out.append(Verdict("G2-T3", f"{p.upper()} ~{g_speed}x faster than FP32 ({op}, forward)", f"~{g_speed}x",
                               f"{speed:.2f}x", hw,
                               judge((speed, speed), (g_speed, g_speed), tolerance=tol) if on_gpu
                               else "not measurable here",
                               f"within {tol:.0%} of the guide's figure" if on_gpu else GPU_CLAIM))
            out.append(Verdict("G2-T3", f"{p.upper()} ~{g_mem}x the memory of FP32 ({op}, forward)", f"~{g_mem}x",
                               f"{mem:.2f}x", hw, judge((mem, mem), (g_mem, g_mem), False, tolerance=tol),
                               f"peak memory of one call, within {tol:.0%}"))
            out.append(Verdict("G2-T3", f"{p.upper()} MSE < {g_mse:g} ({op}, forward)", f"< {g_mse:g} (vs FP32)",
                               f"{mse:.3g} (vs float64)", hw, judge((mse, mse), (None, g_mse), False),
                               "N(0,1) inputs; the MSE scales with the output's magnitude, which the guide does not give"))
            lo, hi = g2_t2["low_precision_speedup"]
            out.append(Verdict("G2-T2", f"{lo}-{hi}x speedup with {p.upper()} ({op}, forward)", f"{lo}-{hi}x",
                               f"{speed:.2f}x", hw,
                               judge((speed, speed), (lo, hi)) if on_gpu else "not measurable here",
                               "" if on_gpu else GPU_CLAIM))
    return out
