"""The inference report (G3-T3 and issue 48's decode goals), from the results table only (``inference.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from adaattn_pipeline.report.common import (Section, Verdict, cpu_targets, fmt, guide_figures, interval_text, judge,
                                            knobs, md_table, median_interval, prose)
from adaattn_experiments.common.paired import paired_frame, ratio_text

GB = 2**20 / 1e9  # MiB -> GB
# the guide's rows and the config that measures each; its latencies' ratios are what another machine can check
GUIDE_ROWS = (("Base", "base"), ("+FlashAttention", "flash"), ("+INT8", "int8"))


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[df["case_id"] != "machine"]
    copy = df[(df["case_id"] == "machine") & (df["metric"] == "copy_gbps")].set_index("target")["value"]
    ok = runs[runs["status"] == "ok"]
    ratios, cpus = paired_frame(runs), cpu_targets(df)
    table, verdicts = [], []
    for (target, batch), frame in runs.groupby(["target", "batch"], sort=False):
        at = ok[(ok["target"] == target) & (ok["batch"] == batch)].set_index(["phase", "metric", "provider"])["value"]
        for config in dict.fromkeys(frame[frame["phase"] == "decode"]["provider"]):
            ms, read = at.get(("decode", "side_by_side_ms", config)), at.get(("decode", "decode_bytes", config))
            gbps = read / (ms / 1e3) / 1e9 if ms and read else None
            r = ratios[(ratios["target"] == target) & (ratios["batch"] == batch) & (ratios["vs"] == config)]
            bad = frame[(frame["provider"] == config) & (frame["status"] != "ok")]
            table.append({"target": target, "batch": int(batch), "config": config,
                          "prefill ms": fmt(at.get(("prefill", "side_by_side_ms", config))),
                          "decode ms / step": fmt(ms), "decode tokens/s": fmt(batch / ms * 1e3 if ms else None),
                          "GB read / step": fmt(read / 1e9 if read else None), "GB/s": fmt(gbps),
                          "of copy bandwidth": fmt(gbps / copy[target] if gbps and target in copy else None),
                          "compiled / this": ratio_text(r.iloc[0].to_dict()) if len(r) else "-",
                          "peak GB": fmt(at.get(("generate", "peak_mem_mb", config), float("nan")) * GB),
                          "note": "" if bad.empty else f"{bad['status'].iloc[0]}: {bad['reason'].iloc[0]}"[:120]})
    for target, frame in ok.groupby("target", sort=False):
        verdicts += _verdicts(target, frame, copy.get(target), ratios, target in cpus)
    md = prose(__file__, "g3_t3", table=md_table(pd.DataFrame(table)) if table else "no results")
    return [Section("G3-T3", "Inference Performance (prefill, decode, KV cache, INT8, CUDA graphs)", md, verdicts)]


def _verdicts(target: str, ok: pd.DataFrame, copy: float | None, ratios: pd.DataFrame, cpu: bool) -> list[Verdict]:
    hw, out = ok["hardware"].iloc[0], []
    decode = ok[(ok["phase"] == "decode") & (ok["metric"] == "side_by_side_ms")]
    guide, tol = guide_figures()["G3-T3"]["figures"], knobs().guide_ratio_tolerance
    for (row, config), (prev_row, prev) in zip(GUIDE_ROWS[1:], GUIDE_ROWS[:-1]):
        claimed = guide[prev_row]["latency_ms"] / guide[row]["latency_ms"]
        gains = []
        for _, frame in decode.groupby("batch"):
            ms = frame.set_index("provider")["value"]
            if config in ms and prev in ms:
                gains.append(ms[prev] / ms[config])
        if not gains:
            continue
        _, lo, hi = median_interval(gains)
        out.append(Verdict("G3-T3", f"{row}: {guide[row]['latency_ms']:g} ms after {guide[prev_row]['latency_ms']:g} "
                           f"({claimed:.2f}x)", f"{claimed:.2f}x", interval_text(gains) + f" over {len(gains)} "
                           "batch sizes", hw, "not measurable here" if cpu else judge((lo, hi), (claimed, claimed),
                                                                                        True, tol),
                           f"a decode step, {prev} over {config}; the guide names no model, batch or hardware, so "
                           "its ratios are read, not its milliseconds"))
    out.append(Verdict("G3-T3", "+TensorParallel: 12.4 ms", f"{guide['+TensorParallel']['latency_ms']:g} ms", "-", hw,
                       "not measured yet", "two GPUs: the distributed study's (reports/distributed.md, G3-T3)"))
    one = decode[decode["batch"] == 1]
    read = ok[(ok["phase"] == "decode") & (ok["metric"] == "decode_bytes") & (ok["batch"] == 1)]
    if not one.empty and copy:
        # the config nearest the roofline, not the fastest: INT8 reads half the bytes, so the fastest step
        # can be the one further from it
        fractions = (read.set_index("provider")["value"] / (one.set_index("provider")["value"] / 1e3) / 1e9
                     / copy).dropna()
        best, fraction = fractions.idxmax(), fractions.max()
        goal = knobs().decode_roofline
        out.append(Verdict("G3-T3", f"batch-1 decode at least {goal:.0%} of the bandwidth roofline", f">= {goal:.0%}",
                           f"{fraction:.1%} ({best})", hw, "not measurable here" if cpu else
                           judge((fraction, fraction), (goal, None), True),
                           f"the config nearest it: bytes read per step over the step's time, against the {copy:.0f} "
                           "GB/s copy measured in the same run"))
    r = ratios[(ratios["target"] == target) & (ratios["batch"] == 1) & (ratios["vs"] == "compiled_int8")]
    if len(r):
        r, goal = r.iloc[0].to_dict(), knobs().int8_decode_speedup
        out.append(Verdict("G3-T3", f"INT8 weight-only decode at batch 1 at least {goal:g}x bf16's", f">= {goal:g}x",
                           ratio_text(r), hw, "not measurable here" if cpu else
                           judge((r["ci_low"], r["ci_high"]), (goal, None), True),
                           prose(__file__, "g3_t3.int8_reason")))
    return out
