"""What the module studies' reports share: their results pivoted by provider and adaattn's per-round ratios
(rendered from the results table only; the providers: ``modules.py``)."""

from __future__ import annotations

import math

import pandas as pd

from adaattn_pipeline.report.common import judge

MAIN = ["mha", "standard", "adaattn", "adaattn_auto", "adaattn_noopt"]  # the module providers (not direct:)


def metric_table(runs: pd.DataFrame, metric: str, value: str = "value") -> pd.DataFrame:
    ok = runs[(runs["metric"] == metric) & (runs["status"] == "ok")]
    return ok.pivot_table(index=["target", "hardware", "case_id", "sweep", "batch", "seq_len", "causal", "mode"],
                          columns="provider", values=value).reset_index()


def paired(runs: pd.DataFrame) -> dict[tuple, dict]:
    """(target, case_id, mode, other provider) -> adaattn's per-round ratio to it: value (p50), p20, p80,
    and the p50's confidence bounds ci_low, ci_high (unbounded where the results have none)."""
    return {(r["target"], r["case_id"], r["mode"], r["vs"]): r.to_dict() for _, r in paired_frame(runs).iterrows()}


def paired_frame(runs: pd.DataFrame, metric: str = "paired_ratio") -> pd.DataFrame:
    """The ``metric`` rows (``paired_ratio``: time per call; ``goal_kernel_paired_ratio``: kernel time), the
    other provider in ``vs``, with ``ci_low`` and ``ci_high`` from their ``<metric>_ci_*`` rows."""
    keys = ["target", "case_id", "mode", "provider"]
    ok = runs[runs["status"] == "ok"]
    out = ok[ok["metric"] == metric]
    for side, fill in (("low", -math.inf), ("high", math.inf)):
        b = ok[ok["metric"] == f"{metric}_ci_{side}"][[*keys, "value"]].rename(columns={"value": f"ci_{side}"})
        out = out.merge(b, on=keys, how="left")
        out[f"ci_{side}"] = out[f"ci_{side}"].fillna(fill)
    return out.rename(columns={"provider": "vs"})


def ratio_text(r: dict) -> str:
    return f"{r['value']:.3f} (CI {r['ci_low']:.3f}-{r['ci_high']:.3f}; p20-p80 {r['p20']:.3f}-{r['p80']:.3f})"


def ratio_verdict(r: dict, low: float | None, high: float | None) -> str:
    """A time ratio's median (lower is better) claimed within [low, high]: its confidence interval, by ``judge``."""
    return judge((r["ci_low"], r["ci_high"]), (low, high), higher_is_better=False)
