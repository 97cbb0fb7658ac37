"""The CCGQA report (G4-C1's attention), from the results table only (the sweep: ``ccgqa.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn.report.common import Section, Verdict, cpu_targets, figure_link, fmt, knobs, md_table
from adaattn_experiments.modules_report import paired_frame, ratio_text, ratio_verdict

GB = 2**20 / 1e9  # MiB -> GB
KEYS = ["target", "model", "seq_len"]


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[df["case_id"] != "machine"]
    ok = runs[runs["status"] == "ok"]
    ms = ok[ok["metric"] == "side_by_side_ms"].pivot_table(index=KEYS, columns="provider", values="value")
    mem = ok[ok["metric"] == "peak_mem_mb"].pivot_table(index=KEYS, columns="provider", values="value")
    ratios = paired_frame(runs)
    bound, cpus = knobs().ccgqa_bound, cpu_targets(df)
    table, verdicts = [], []
    for (target, model, S), frame in runs.groupby(KEYS, sort=False):
        first = frame.iloc[0]
        compiled = "ccgqa:compiled" in set(frame["provider"])
        mine, rival = ("ccgqa:compiled", "sdpa_gqa:compiled") if compiled else ("ccgqa", "sdpa_gqa")
        pair = ratios[(ratios["target"] == target) & (ratios["case_id"] == first["case_id"]) & (ratios["vs"] == rival)]
        times = ms.loc[(target, model, S)] if (target, model, S) in ms.index else pd.Series(dtype=float)
        peaks = mem.loc[(target, model, S)] if (target, model, S) in mem.index else pd.Series(dtype=float)
        row = {"target": target, "model": model, "B x S": f"{int(first['batch'])} x {int(S)}",
               "heads (q / kv)": f"{int(first['heads'])} / {int(first['kv_heads'])}",
               "head dim (CCGQA / SDPA)": f"{int(first['latent_head_dim'])} / {int(first['dim'] // first['heads'])}"}
        for p in ("ccgqa", "sdpa_gqa", "ccgqa:compiled", "sdpa_gqa:compiled"):
            if p in times or p in peaks:
                row[f"{p} ms"] = fmt(times.get(p))
        row["eager ratio"] = fmt(times["ccgqa"] / times["sdpa_gqa"]) if {"ccgqa", "sdpa_gqa"} <= set(times.index) \
            else "-"
        r = pair.iloc[0].to_dict() if len(pair) else None
        row[f"{mine} / {rival}"] = ratio_text(r) if r else "not measured"
        for p in (mine, rival):
            row[f"{p} peak GB"] = fmt(peaks.get(p, float("nan")) * GB)
        table.append(row)
        hw = first["hardware"]
        claim = f"CCGQA at most {bound:g}x SDPA GQA's time ({model}, S={int(S)})"
        if target in cpus:
            verdicts.append(Verdict("G4-C1", claim, f"<= {bound:g}x", ratio_text(r) if r else "not measured", hw,
                                    "not measurable here", "a GPU goal (fused attention kernels, compiled)"))
        elif r:
            verdicts.append(Verdict("G4-C1", claim, f"<= {bound:g}x", ratio_text(r), hw,
                                    ratio_verdict(r, None, bound),
                                    f"{mine} / {rival}, a training call (forward and backward), round by round"))
    md = ("HYDRA's CCGQA attention layer (down-projection, causal convolutions, attention in the latent with "
          "SDPA, up-projection) against the SDPA GQA layer of the same width, query and kv heads (its head dim: "
          "width / heads). One training call (forward and backward, the weights' gradients included), autocast "
          "over fp32 weights, eager and compiled (`torch.compile`, static shapes), side by side in shuffled "
          "rounds: median ms; the ratio round by round with its median's 95% interval (docs/methods.md). "
          "Peak GB: the call's peak over what was held before it.\n\n"
          + (md_table(pd.DataFrame(table)) if table else "no results") + "\n")
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
