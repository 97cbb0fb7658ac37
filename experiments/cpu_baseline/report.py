"""The cpu_baseline report (G2-T1), from the results table only."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from adaattn.timing.rounds import CI_LEVEL
from adaattn_pipeline.report.common import Section, Verdict, guide_figures, knobs, md_table, prose
from adaattn_experiments.common.paired import MAIN, metric_table, paired, ratio_text, ratio_verdict


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    return [_g2_t1(df[~df["case_id"].isin(["machine"]) & ~df["case_id"].str.startswith("manager/")])]


def _g2_t1(runs: pd.DataFrame) -> Section:
    """From the side-by-side rows: each provider's mean ± std over the rounds, and the verdict on
    adaattn's time over nn.MultiheadAttention's, round by round (``paired_ratio``)."""
    guide = guide_figures()["G2-T1"]["figures"]["forward_ms"]
    if not ((runs["metric"] == "side_by_side_ms") & (runs["status"] == "ok")).any():
        return Section("G2-T1", "CPU Baseline (Reference)", "No side-by-side timings in these results: rerun "
                       "`adaattn run cpu_baseline`.\n", [])
    mean, std = metric_table(runs, "side_by_side_ms", "mean"), metric_table(runs, "side_by_side_ms", "std")
    by = paired(runs)
    rows, verdicts = [], []
    for (_, m), (_, s) in zip(mean.iterrows(), std.iterrows(), strict=True):
        point = f"B{int(m['batch'])}_S{int(m['seq_len'])}"
        row = {"target": m["target"], "point": point, "mode": m["mode"]}
        for p in MAIN:
            if p in m and pd.notna(m[p]):
                row[f"{p} ms"] = f"{m[p]:.3g} ± {s[p]:.2g}"
        ratio = by.get((m["target"], m["case_id"], m["mode"], "mha"))
        row["adaattn / mha, per round"] = "-" if ratio is None else ratio_text(ratio)
        noopt = by.get((m["target"], m["case_id"], m["mode"], "adaattn_noopt"))
        row["adaattn / adaattn_noopt (the guide's standard)"] = "-" if noopt is None else ratio_text(noopt)
        row["guide Standard ms"] = guide["standard"].get(point, "-")
        row["guide GPU Optimized ms"] = guide["gpu_optimized"].get(point, "-")
        rows.append(row)
        # the guide's "standard" is AdaAttention without its optimisation (adaattn_noopt); MHA beside it
        if m["mode"] == "fwd" and point in guide["standard"] and noopt is not None:
            verdicts.append(Verdict(
                "G2-T1", f"{point}: GPU-optimized AdaAttn takes the same time as standard on a CPU",
                f"{guide['gpu_optimized'][point]} vs {guide['standard'][point]} ms (CPU not named)",
                f"adaattn / adaattn_noopt per round {ratio_text(noopt)}"
                + ("" if ratio is None else f"; adaattn / nn.MultiheadAttention {ratio['value']:.3f}"), m["hardware"],
                ratio_verdict(noopt, 1 - knobs().same_time_tolerance, 1 + knobs().same_time_tolerance),
                prose(__file__, "g2_t1.reason", same_time_tolerance=f"{knobs().same_time_tolerance:.0%}",
                      ci_level=f"{CI_LEVEL:.0%}")))
    shape = "; ".join(sorted({f"embed {int(r['embed_dim'])}, {int(r['heads'])} heads, {r['dtype']}"
                              for _, r in runs.dropna(subset=["embed_dim"]).iterrows()}))
    md = prose(__file__, "g2_t1", shape=shape, ci_level=f"{CI_LEVEL:.0%}", rows_table=md_table(pd.DataFrame(rows)))
    return Section("G2-T1", "CPU Baseline (Reference)", md, verdicts)
