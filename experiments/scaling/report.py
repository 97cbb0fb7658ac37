"""The scaling report (G2-B, G2-T2, and the 3% goal), from the results table only (the providers:
``modules.py``, the goal's readings: ``scaling.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn.timing.rounds import CI_LEVEL
from adaattn_pipeline.report.common import (Section, Verdict, fmt, guide_figures, interval_text, judge, knobs, md_table,
                                            median_interval, one_point_table, prose, save_figure)
from adaattn_experiments.common.paired import MAIN, metric_table, paired_frame, ratio_text, ratio_verdict

FIGURE_METRICS = ["time_ms", "kernel_ms", "peak_mem_mb"]  # the scaling figures' rows (kernel_ms: CUDA only)
FIGURE_LABELS = {"time_ms": "ms per call", "kernel_ms": "kernel ms per call", "peak_mem_mb": "peak MiB"}
def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[~df["case_id"].isin(["machine"]) & ~df["case_id"].str.startswith("manager/")].copy()
    return _scaling(runs, df, out_dir)


# the goal's readings: (results metric of the per-round ratio, what the ratio is of, which shapes it covers)
READINGS = {"eager": ("paired_ratio", "time per call, eager, side by side (shuffled rounds)", "GPU-bound"),
            "kernel": ("goal_kernel_paired_ratio", "kernel time, eager (the calls interleaved in one profiler trace)",
                       "every"),
            "compiled": ("compiled_paired_ratio", "time per call, compiled whole (mode in the table), side by side",
                         "every")}


def _scaling(runs: pd.DataFrame, df: pd.DataFrame, out_dir: Path) -> list[Section]:
    t = metric_table(runs, "time_ms")
    mem = metric_table(runs, "peak_mem_mb")
    util = metric_table(runs, "gpu_util_pct")
    bound = gpu_bound(runs)
    goal, verdicts = _goal_table(runs, bound)
    first, first_verdicts = _first_calls(runs)
    stack, stack_verdicts = _stack(runs)
    parts = []
    ok = runs[(runs["status"] == "ok") & runs["provider"].isin(MAIN) & runs["metric"].isin(FIGURE_METRICS)].copy()
    for target, frame in ok.groupby("target"):
        for sweep, x in (("seq", "seq_len"), ("batch", "batch")):
            f = in_sweep(frame, sweep)
            if f.empty:
                continue
            title = f"G2-B {sweep} sweep on {f['hardware'].iloc[0]} ({target})"
            if (table := one_point_table(f, x, ["metric", "mode", "provider"], title)) is not None:
                parts.append(table)
                continue
            rows = [m for m in FIGURE_METRICS if m in set(f["metric"])]
            grid = sns.relplot(data=f, x=x, y="value", hue="provider",
                               hue_order=[p for p in MAIN if p in set(f["provider"])], row="metric", col="mode",
                               row_order=rows, kind="line", marker="o", height=2.6, aspect=1.4,
                               facet_kws={"sharey": False}, errorbar=None)
            grid.set(xscale="log", yscale="log")
            grid.set_titles("{col_name}")
            for metric, axes in zip(rows, grid.axes, strict=True):
                axes[0].set_ylabel(FIGURE_LABELS[metric])
            grid.set_xlabels({"seq_len": "sequence length", "batch": "batch"}[x])
            grid.figure.suptitle(title, y=1.01)
            name = f"g2_b_{sweep}_{target}.png"
            save_figure(grid.figure, out_dir / name)
            parts.append(f"![{sweep} sweep, {target}]({out_dir.name}/{name})\n")
    rows = []
    mem_by_key = mem.set_index(["target", "case_id", "mode"])
    for _, r in t.iterrows():
        direct = [c for c in t.columns if isinstance(c, str) and c.startswith("direct:") and pd.notna(r[c])]
        best = min(direct, key=lambda c: r[c]) if direct else None
        key = (r["target"], r["case_id"], r["mode"])
        m = mem_by_key.loc[key] if key in mem_by_key.index else None
        row = {"target": r["target"], "B": int(r["batch"]), "S": int(r["seq_len"]), "mode": r["mode"]}
        for p in MAIN:
            row[f"{p} ms"] = fmt(r.get(p))
        row["fastest direct"] = f"{best.removeprefix('direct:')} {fmt(r[best])}" if best else "-"
        if m is not None:
            row["standard MiB"], row["adaattn MiB"] = fmt(m.get("standard")), fmt(m.get("adaattn"))
        row["adaattn tokens/s"] = fmt(r["batch"] * r["seq_len"] / r["adaattn"] * 1e3) if pd.notna(r.get("adaattn")) \
            else "-"
        rows.append(row)
    keys = ["target", "case_id"]
    ranks = df[df["metric"] == "manager_ranking"][[*keys, "value", "kernel"]].rename(
        columns={"case_id": "signature", "value": "s", "kernel": "ranking (median GPU-time turn, ms)"})
    ranks["signature"] = ranks["signature"].str.removeprefix("manager/")
    util_tab = util[[c for c in util.columns if c in ("target", "batch", "seq_len", "mode", *MAIN)]] \
        if not util.empty else util
    md = prose(__file__, "g2_b", overhead=f"{knobs().goal_overhead - 1:.0%}", ci_level=f"{CI_LEVEL:.0%}",
               goal_overhead=knobs().goal_overhead, gpu_bound=f"{knobs().gpu_bound:g}",
               goal_table=md_table(goal) if len(goal) else "no goal timings in these results",
               first_table=md_table(first) if len(first) else "not measured",
               stack_table=md_table(stack) if len(stack) else "not measured on these targets",
               sweep="\n".join(parts), rows_table=md_table(pd.DataFrame(rows)),
               util_table=md_table(util_tab) if len(util_tab) else "not measured on these targets (CUDA only)",
               ranks_table=md_table(ranks) if len(ranks) else "none")
    return [Section("G2-B", "GPU Benchmarking Suite (batch and sequence scaling)", md,
                    verdicts + first_verdicts + stack_verdicts),
            _g2_t2(t, mem, metric_table(runs, "kernel_ms"))]


def gpu_bound(runs: pd.DataFrame) -> dict[tuple, float]:
    """(target, case_id, mode) -> the fastest direct call's kernel time over its host time (CUDA targets only):
    the fastest by the sweep's time per call."""
    t, k, h = (metric_table(runs, m) for m in ("time_ms", "kernel_ms", "host_ms"))
    if k.empty or h.empty:
        return {}
    idx = ["target", "case_id", "mode"]
    k, h = k.set_index(idx), h.set_index(idx)
    out = {}
    for _, r in t.iterrows():
        key = (r["target"], r["case_id"], r["mode"])
        direct = [c for c in t.columns if isinstance(c, str) and c.startswith("direct:") and pd.notna(r[c])]
        if not direct or key not in k.index or key not in h.index:
            continue
        best = min(direct, key=lambda c: r[c])
        if pd.notna(k.loc[key].get(best)) and pd.notna(h.loc[key].get(best)):
            out[key] = k.loc[key][best] / h.loc[key][best]
    return out


def _goal_table(runs: pd.DataFrame, bound: dict[tuple, float]) -> tuple[pd.DataFrame, list[Verdict]]:
    """Per target, shape and mode: each reading's ratio (``READINGS``), and a verdict per target and reading."""
    frames = {name: _paired_goal(runs, metric).set_index(["target", "case_id", "mode"])
              for name, (metric, _, _) in READINGS.items()}
    keys = sorted({k for f in frames.values() for k in f.index}, key=str)
    cases = runs.drop_duplicates("case_id").set_index("case_id")
    # the case's shape is its id's on every target; the compile mode that ran is read per target
    compiled = runs[runs["metric"] == "compiled_paired_ratio"].drop_duplicates(["target", "case_id"])
    compiled = compiled.set_index(["target", "case_id"])
    modes = compiled["kernel"] if "kernel" in compiled else pd.Series(dtype=str)  # the compile mode
    rows, judged = [], {}
    for key in keys:
        target, case_id, mode = key
        c = cases.loc[case_id]
        ratio = bound.get(key)
        row = {"target": target, "B": int(c["batch"]), "S": int(c["seq_len"]), "mode": mode,
               "kernel / host": fmt(ratio, 3) if ratio is not None else "-"}
        for name, f in frames.items():
            if key not in f.index:
                row[name] = "-"
                continue
            r = f.loc[key].to_dict()
            vs = r["vs"].removeprefix("compiled:").removeprefix("direct:")
            row[name] = f"{r['value']:.3f} ({r['ci_low']:.3f}-{r['ci_high']:.3f}) vs {vs}"
            counts = name != "eager" or ratio is None or ratio >= knobs().gpu_bound  # a CPU target: every shape
            if counts:
                judged.setdefault((target, name), []).append((row, r))
            elif name == "eager":
                row[name] += " (host-bound: no goal)"
        if (target, case_id) in modes.index:
            row["compiled"] += f" [{modes[(target, case_id)]}]" if row.get("compiled", "-") != "-" else ""
        rows.append(row)
    hw = dict(zip(runs["target"], runs["hardware"], strict=False))
    verdicts = []
    for (target, name), points in sorted(judged.items()):
        _, label, shapes = READINGS[name]
        sides = [ratio_verdict(r, None, knobs().goal_overhead) for _, r in points]
        above, open_ = sides.count("worse than claimed"), sides.count("inconclusive")
        worst_row, worst = max(points, key=lambda p: p[1]["value"])
        verdicts.append(Verdict(
            "G2-B", f"goal: AdaAttention (rank full) within {knobs().goal_overhead - 1:.0%} of the fastest backend "
            f"called directly, {label}",
            "(issue goal)", f"{above} of {len(points)} shapes x modes above {knobs().goal_overhead}"
            + (f", {open_} undecided" if open_ else "") + f"; worst {ratio_text(worst)} at B={worst_row['B']} "
            f"S={worst_row['S']} {worst_row['mode']}", hw.get(target, target),
            "worse than claimed" if above else "inconclusive" if open_ else "holds",
            ("judged at every shape" if shapes == "every" or not any(k[0] == target for k in bound) else
             f"judged at GPU-bound shapes only (kernel / host >= {knobs().gpu_bound:g})")
            + "; by the confidence interval of the median per-round ratio"))
    return pd.DataFrame(rows), verdicts


def _first_calls(runs: pd.DataFrame) -> tuple[pd.DataFrame, list[Verdict]]:
    """Per target, shape and mode: adaattn's first call, the chosen backend's direct first call after it, their
    difference and the ranking's own seconds; a verdict per target on the goal's bound."""
    f = runs[runs["metric"].isin(["first_call_s", "first_call_measure_s"]) & (runs["status"] == "ok")]
    rows, by_target = [], {}
    for (target, case_id, mode), g in f.groupby(["target", "case_id", "mode"]):
        first = g[g["metric"] == "first_call_s"].set_index("provider")["value"]
        direct = [p for p in first.index if p.startswith("direct:")]
        if "adaattn" not in first or not direct:
            continue
        extra = first["adaattn"] - first[direct[0]]
        measure = g[g["metric"] == "first_call_measure_s"]["value"]
        rows.append({"target": target, "B": int(g["batch"].iloc[0]), "S": int(g["seq_len"].iloc[0]), "mode": mode,
                     "adaattn s": fmt(first["adaattn"]), "ranking s": fmt(measure.iloc[0]) if len(measure) else "-",
                     "direct": direct[0].removeprefix("direct:"), "direct s": fmt(first[direct[0]]),
                     "difference s": fmt(extra)})
        by_target.setdefault(target, []).append((extra, rows[-1]))
    hw = dict(zip(runs["target"], runs["hardware"], strict=False))
    verdicts = []
    for target, points in by_target.items():
        worst, row = max(points, key=lambda p: p[0])
        over = sum(e > knobs().first_call_budget_s for e, _ in points)
        verdicts.append(Verdict(
            "G2-B", f"goal: a new signature's first call at most {knobs().first_call_budget_s:g} s more than the "
            "direct "
            "backend's", "(issue goal)", f"{over} of {len(points)} shapes x modes over; worst {worst:.3f} s at "
            f"B={row['B']} S={row['S']} {row['mode']}", hw.get(target, target),
            judge((worst, worst), (None, knobs().first_call_budget_s), higher_is_better=False),
            "the direct call comes after adaattn's, its per-shape setup done: an upper bound of the difference"))
    return pd.DataFrame(rows), verdicts


def _stack(runs: pd.DataFrame) -> tuple[pd.DataFrame, list[Verdict]]:
    s = runs[(runs["metric"] == "stack_side_by_side_ms") & (runs["status"] == "ok")]
    ratio = paired_frame(runs, "stack_paired_ratio")
    if s.empty or ratio.empty:
        return pd.DataFrame(), []
    rows, verdicts = [], []
    hw = dict(zip(runs["target"], runs["hardware"], strict=False))
    for target, g in s.groupby("target"):
        ms = g.set_index("provider")["value"]
        r = ratio[ratio["target"] == target].iloc[0].to_dict()
        c = g.iloc[0]
        rows.append({"target": target, "case": c["case_id"].split("/")[-1], "adaattn step ms": fmt(ms.get("stack:adaattn")),
                     "sdpa step ms": fmt(ms.get("stack:sdpa")), "adaattn / sdpa, per round": ratio_text(r)})
        verdicts.append(Verdict(
            "G2-B", f"stack check: AdaAttention's stack at most {knobs().stack_bound}x SDPA's, compiled, training step",
            "(issue goal)", f"{ratio_text(r)} ({c['case_id'].split('/')[-1]})", hw.get(target, target),
            ratio_verdict(r, None, knobs().stack_bound), "by the confidence interval of the median per-round ratio"))
    return pd.DataFrame(rows), verdicts


def _paired_goal(runs: pd.DataFrame, metric: str = "paired_ratio") -> pd.DataFrame:
    """Per target, case and mode: adaattn's per-round ratio to the fastest direct backend (the highest of its
    ratios to the direct backends), with that backend in ``vs``; its confidence bounds the highest of the
    backends' (the goal holds against every backend or against none). A backend that left the rounds early,
    another faster than it with confidence, is not the fastest and is not among them: its interval, from those
    few rounds, is wide. ``metric``: as ``_paired_frame``."""
    cols = ["target", "case_id", "mode", "batch", "seq_len", "value", "p20", "p80", "vs", "ci_low", "ci_high"]
    ok = paired_frame(runs, metric)
    ok = ok[ok["vs"].astype(str).str.contains("direct:")]  # an outpaced backend's rows are not "ok"
    if ok.empty:
        return pd.DataFrame(columns=cols)
    group = ok.groupby(["target", "case_id", "mode"])
    top = ok.loc[group["value"].idxmax()].set_index(["target", "case_id", "mode"])
    top[["ci_low", "ci_high"]] = group[["ci_low", "ci_high"]].max()
    return top.reset_index()[cols]


def in_sweep(frame: pd.DataFrame, sweep: str) -> pd.DataFrame:
    """The rows of one sweep ("seq" or "batch") with the point both sweeps share, which is measured once and
    tagged with the batch sweep: the other sweep's rows at this sweep's fixed batch or length."""
    fixed = {"seq": "batch", "batch": "seq_len"}[sweep]
    own = frame[frame["sweep"] == sweep]
    at = frame["target"].map(own.groupby("target")[fixed].first())
    return pd.concat([own, frame[(frame["sweep"] != sweep) & (frame[fixed] == at)]])


def _speedups(times: pd.DataFrame, target: str) -> pd.DataFrame:
    """standard / adaattn per sequence length above 1024 of ``target``'s seq sweep, forward (``times``: a
    ``_metric`` pivot); empty where the results have not both."""
    f = in_sweep(times, "seq") if len(times) else times
    f = f[(f["mode"] == "fwd") & (f["target"] == target)] if len(f) else f
    if f.empty or "standard" not in f or "adaattn" not in f:
        return pd.DataFrame(columns=["seq_len", "speedup"])
    f = f[f["seq_len"] > 1024].dropna(subset=["standard", "adaattn"]).sort_values("seq_len")
    return pd.DataFrame({"seq_len": f["seq_len"], "speedup": f["standard"] / f["adaattn"]})


def _g2_t2(t: pd.DataFrame, mem: pd.DataFrame, kern: pd.DataFrame) -> Section:
    """G2-T2's memory and speed lines. Speed by the sweep's time per call and, on a GPU, by kernel time too:
    the sweep times each provider alone, and at a host-bound shape its time is the host's at that turn; where
    the two read different verdicts the claim is inconclusive."""
    guide = guide_figures()["G2-T2"]["figures"]
    verdicts, rows = [], []
    seq_t, seq_m = (in_sweep(x, "seq") for x in (t, mem))
    seq_t, seq_m = seq_t[seq_t["mode"] == "fwd"], seq_m[seq_m["mode"] == "fwd"]
    for target, f in seq_m.sort_values("seq_len").groupby("target"):
        hw = f["hardware"].iloc[0]
        above = f[f["seq_len"] > 512].dropna(subset=["standard", "adaattn"]) if "standard" in f else f.iloc[0:0]
        lo, hi = guide["memory_reduction_above_512"]
        if above.empty:
            verdicts.append(Verdict("G2-T2", f"memory reduction {lo:.0%}-{hi:.0%} for sequences > 512", f"{lo:.0%}-{hi:.0%}",
                                    "-", hw, "not measurable here", "no sequence above 512 in this target's sweep"))
        else:
            red = 1 - above["adaattn"] / above["standard"]
            med, c_lo, c_hi = median_interval(red)
            verdicts.append(Verdict(
                "G2-T2", f"memory reduction {lo:.0%}-{hi:.0%} for sequences > 512", f"{lo:.0%}-{hi:.0%}",
                f"median {med:.0%} ({red.min():.0%}-{red.max():.0%}; adaattn vs standard peak memory, forward, S = "
                f"{', '.join(str(int(s)) for s in above['seq_len'])})", hw, judge((c_lo, c_hi), (lo, hi)),
                "the standard module holds the S x S scores; a fused kernel does not, so the saving grows with S"))
        for _, r in f.iterrows():
            rows.append({"target": target, "S": int(r["seq_len"]), "standard MiB": fmt(r.get("standard")),
                         "adaattn MiB": fmt(r.get("adaattn")),
                         "reduction": fmt(1 - r["adaattn"] / r["standard"]) if pd.notna(r.get("standard")) else "-"})
    lo, hi = guide["speedup_above_1024"]
    for target, f in seq_t.groupby("target"):
        hw = f["hardware"].iloc[0]
        by = {basis: _speedups(times, target) for basis, times in (("time per call", t), ("kernel time", kern))}
        by = {basis: s for basis, s in by.items() if len(s)}
        if not by:
            verdicts.append(Verdict("G2-T2", f"speed {lo}-{hi}x for sequences > 1024", f"{lo}-{hi}x", "-", hw,
                                    "not measurable here", "no sequence above 1024 in this target's sweep"))
            continue
        reads = {basis: judge(median_interval(s["speedup"])[1:], (lo, hi)) for basis, s in by.items()}
        measured = "; ".join(
            f"{interval_text(s['speedup'])} by {basis} ({s['speedup'].min():.2f}-"
            f"{s['speedup'].max():.2f}x; standard / adaattn, forward, S = "
            f"{', '.join(str(int(v)) for v in s['seq_len'])})" for basis, s in by.items())
        agree = len(set(reads.values())) == 1
        verdicts.append(Verdict(
            "G2-T2", f"speed {lo}-{hi}x for sequences > 1024", f"{lo}-{hi}x", measured, hw,
            next(iter(reads.values())) if agree else "inconclusive",
            "" if agree else "the two times read different verdicts: " + ", ".join(
                f"{basis} {v}" for basis, v in reads.items())))
    md = prose(__file__, "g2_t2", rows_table=md_table(pd.DataFrame(rows)) if rows else "no results")
    return Section("G2-T2", "Expected GPU Performance Gains (memory and speed lines)", md, verdicts)
