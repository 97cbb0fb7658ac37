"""The CCGQA report (G4-C1's attention), from the results table only (the sweep: ``ccgqa.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn_pipeline.report.common import Section, Verdict, cpu_targets, figure_link, fmt, knobs, md_table, prose
from adaattn_experiments.common.paired import paired_frame, ratio_text, ratio_verdict

GB = 2**20 / 1e9  # MiB -> GB
KEYS = ["target", "model", "seq_len"]


def _mode(provider: str) -> str:
    """The pair a provider belongs to: ``eager`` or its compile mode (``ccgqa:reduce-overhead``)."""
    return provider.partition(":")[2] or "eager"


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[df["case_id"] != "machine"].assign(pair=lambda f: f["provider"].map(_mode))
    ok = runs[runs["status"] == "ok"]
    ratios = paired_frame(runs)
    bound, cpus = knobs().ccgqa_bound, cpu_targets(df)
    table, verdicts = [], []
    for (target, model, S), frame in runs.groupby(KEYS, sort=False):
        first, hw = frame.iloc[0], frame["hardware"].iloc[0]
        for pair in dict.fromkeys(frame["pair"]):  # eager, then the compile modes in the sweep's order
            mine, rival = ("ccgqa", "sdpa_gqa") if pair == "eager" else (f"ccgqa:{pair}", f"sdpa_gqa:{pair}")
            at = ok[(ok["target"] == target) & (ok["case_id"] == first["case_id"])].set_index(["metric", "provider"])
            r = ratios[(ratios["target"] == target) & (ratios["case_id"] == first["case_id"]) & (ratios["vs"] == rival)]
            r = r.iloc[0].to_dict() if len(r) else None
            table.append({
                "target": target, "model": model, "B x S": f"{int(first['batch'])} x {int(S)}",
                "heads (q / kv)": f"{int(first['heads'])} / {int(first['kv_heads'])}",
                "head dim (CCGQA / SDPA)": f"{int(first['latent_head_dim'])} / {int(first['dim'] // first['heads'])}",
                "compile": pair,
                "CCGQA ms": fmt(at["value"].get(("side_by_side_ms", mine))),
                "SDPA GQA ms": fmt(at["value"].get(("side_by_side_ms", rival))),
                "CCGQA / SDPA GQA": ratio_text(r) if r else "not measured",
                "CCGQA peak GB": fmt(at["value"].get(("peak_mem_mb", mine), float("nan")) * GB),
                "SDPA GQA peak GB": fmt(at["value"].get(("peak_mem_mb", rival), float("nan")) * GB)})
            # every pair its own verdict; the goal means the pair filed in params.yaml before the run
            filed = pair == knobs().ccgqa_mode
            claim = f"CCGQA at most {bound:g}x SDPA GQA's time ({model}, S={int(S)}, {pair})"
            reading = "the goal's pair (verdicts.ccgqa_mode)" if filed else "a pair beside the goal's"
            measured = ratio_text(r) if r else "not measured"
            if target in cpus:
                verdicts.append(Verdict("G4-C1", claim, f"<= {bound:g}x", measured, hw, "not measurable here",
                                        f"a GPU goal (fused attention kernels, compiled); {reading}"))
            elif r:
                verdicts.append(Verdict("G4-C1", claim, f"<= {bound:g}x", measured, hw, ratio_verdict(r, None, bound),
                                        f"{reading}: {mine} / {rival}, a training call (forward and backward), "
                                        "round by round"))
    md = prose(__file__, "g4_c1", mode=knobs().ccgqa_mode, table=md_table(pd.DataFrame(table)) if table else "no results")
    return [Section("G4-C1", "HYDRA components (CCGQA attention against SDPA GQA)",
                    md + _figure(ok, out_dir), verdicts)]


def _figure(ok: pd.DataFrame, out_dir: Path) -> str:
    times = ok[ok["metric"] == "side_by_side_ms"]
    parts = []
    for target, sub in times.groupby("target", sort=False):
        grid = sns.relplot(data=sub, x="seq_len", y="value", hue="provider", col="model", kind="line", marker="o",
                           height=3.2, aspect=1.1, facet_kws={"sharey": False})
        grid.set(xscale="log", yscale="log")
        grid.set_axis_labels("sequence length (tokens per call fixed)", "training call (ms)")
        grid.figure.suptitle(f"G4-C1 CCGQA vs SDPA GQA on {sub['hardware'].iloc[0]} ({target})", y=1.03)
        parts.append(figure_link(grid.figure, out_dir, f"g4_c1_ccgqa_{target}.png", f"CCGQA vs SDPA GQA, {target}"))
    return "\n" + "\n".join(parts)
