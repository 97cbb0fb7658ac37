"""The memory-analysis report (G3-T1), from the results table only (``memory_analysis.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from adaattn_pipeline.report.common import Section, Verdict, figure_link, fmt, judge, knobs, md_table, prose
from adaattn_experiments.memory_analysis.study import EXPONENTS, OPTIMISATION

FORMULAS = {"attention": "O(batch x seq_len^2)", "memory_bank": "O(memory_slots x dim)",
            "activations": "O(batch x seq_len x dim)", "parameters": "O(num_layers x dim^2)"}


def exponent(frame: pd.DataFrame) -> float:
    """The slope of log(memory) on log(x), least squares (nan under two distinct points)."""
    if frame["x"].nunique() < 2:
        return math.nan
    return float(np.polyfit(np.log(frame["x"].astype(float)), np.log(frame["value"].astype(float)), 1)[0])


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    ok = df[(df["case_id"] != "machine") & (df["status"] == "ok") & (df["metric"] == "memory_mb")]
    tol = knobs().exponent_tolerance
    table, verdicts = [], []
    for (target, component, variable), frame in ok.groupby(["target", "provider", "variable"], sort=False):
        plain = frame[frame["mode"] == "plain"].sort_values("x")
        other = frame[frame["mode"] != "plain"].set_index("x")["value"]
        slope, claimed = exponent(plain), EXPONENTS[component][variable]
        # the optimisation's effect at each point: optimised over plain (the bank: the preset over the whole context)
        effect = [(p / other[x] if component == "memory_bank" else other[x] / p)
                  for x, p in zip(plain["x"], plain["value"]) if x in other and p]
        table.append({"target": target, "component": component, "guide": FORMULAS[component], "variable": variable,
                      "x": ", ".join(f"{int(x)}" for x in plain["x"]),
                      "MiB": ", ".join(fmt(v) for v in plain["value"]), "fitted exponent": fmt(slope),
                      "guide's exponent": claimed, "optimised / plain": fmt(min(effect)) + (
                          f"-{fmt(max(effect))}" if len(effect) > 1 else "") if effect else "-",
                      "optimisation": OPTIMISATION[component]})
        if math.isnan(slope):
            continue
        hw = frame["hardware"].iloc[0]
        verdicts.append(Verdict(
            "G3-T1", f"{component}: {FORMULAS[component]}, in {variable}", f"exponent {claimed}",
            f"exponent {slope:.2f} over {len(plain)} points", hw,
            judge((slope, slope), (claimed, claimed), higher_is_better=False, tolerance=tol),
            f"log-log least squares over {variable} = {', '.join(str(int(x)) for x in plain['x'])}; the O() is the "
            "leading term: lower-order ones (embeddings, projections) pull a small sweep's exponent under it"))
    md = prose(__file__, "g3_t1", table=md_table(pd.DataFrame(table)) if table else "no results")
    return [Section("G3-T1", "Memory Usage Analysis (components, fitted exponents, optimisations)",
                    md + _figure(ok, out_dir), verdicts)]


def _figure(ok: pd.DataFrame, out_dir: Path) -> str:
    parts = []
    for target, frame in ok.groupby("target", sort=False):
        grid = sns.relplot(data=frame, x="x", y="value", hue="provider", style="mode", col="variable", kind="line",
                           marker="o", height=3.0, aspect=1.0, facet_kws={"sharex": False, "sharey": False})
        grid.set(xscale="log", yscale="log")
        grid.set_axis_labels("value of the variable", "MiB")
        grid.figure.suptitle(f"G3-T1 memory by component on {frame['hardware'].iloc[0]} ({target})", y=1.03)
        parts.append(figure_link(grid.figure, out_dir, f"g3_t1_memory_{target}.png", f"memory by component, {target}"))
    return "\n" + "\n".join(parts)
