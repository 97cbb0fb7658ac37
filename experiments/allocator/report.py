"""The allocator report (G0-C1's allocator lines), from the results table only (``allocator.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from adaattn_pipeline.report.common import Section, Verdict, cpu_targets, fmt, judge, md_table, prose

GB = 2**20 / 1e9  # MiB -> GB
CLAIMS = {"split_512": "optimized memory allocation (512 MB chunks)",
          "fraction_95": "95% GPU memory utilization allowed"}


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[df["case_id"] != "machine"]
    cpus = cpu_targets(df)
    table, verdicts = [], []
    for target, frame in runs.groupby("target", sort=False):
        hw = frame["hardware"].iloc[0]
        ok = frame[frame["status"] == "ok"].set_index(["provider", "metric"])["value"]
        for setting in dict.fromkeys(frame["provider"]):
            bad = frame[(frame["provider"] == setting) & (frame["status"] != "ok")]
            allocated, reserved = ok.get((setting, "peak_allocated_mb")), ok.get((setting, "peak_reserved_mb"))
            table.append({"target": target, "model": frame["model"].iloc[0], "setting": setting,
                          "step ms": fmt(ok.get((setting, "step_ms"))),
                          "peak allocated GB": fmt(allocated * GB if allocated else None),
                          "peak reserved GB": fmt(reserved * GB if reserved else None),
                          "reserved / allocated": fmt(reserved / allocated if allocated and reserved else None),
                          "cudaMalloc retries": fmt(ok.get((setting, "alloc_retries"))),
                          "largest batch": fmt(ok.get((setting, "max_batch"))),
                          "note": "" if bad.empty else f"{bad['status'].iloc[0]}: {bad['reason'].iloc[0]}"[:160]})
        probe = frame[frame["metric"] == "max_batch"]
        limit = probe[probe["reason"].str.startswith("reached", na=False)]
        for setting, claim in CLAIMS.items():
            mine, base = ok.get((setting, "max_batch")), ok.get(("default", "max_batch"))
            if target in cpus:
                verdicts.append(Verdict("G0-C1", claim, "an optimisation", "-", hw, "not measurable here",
                                        "the settings are CUDA's caching allocator's"))
            elif mine is not None and base is not None:
                capped = not limit.empty
                ratio = mine / base if base else float("nan")
                verdicts.append(Verdict(
                    "G0-C1", claim, "an optimisation: at least the default's largest batch",
                    f"largest batch {mine:g} vs the default's {base:g}", hw,
                    "inconclusive" if capped else judge((ratio, ratio), (1.0, None), higher_is_better=True),
                    ("the probe reached its limit: raise allocator.probe_limit; " if capped else "")
                    + f"{setting} against the default allocator, one process each"
                    + ("; the default already allows the whole GPU: the fraction caps a process at 95%"
                       if setting == "fraction_95" else "")))
    md = prose(__file__, "g0_c1", table=md_table(pd.DataFrame(table)) if table else "no results")
    return [Section("G0-C1", "Allocator settings (512 MB chunks, 95% memory fraction, expandable segments)", md,
                    verdicts)]
