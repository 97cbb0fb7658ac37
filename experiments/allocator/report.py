"""The allocator report (G0-C1's allocator lines), from the results table only (``allocator.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from adaattn_pipeline.report.common import Section, Verdict, cpu_targets, fmt, judge, md_table

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
    md = ("A preset's eager training step (bf16 autocast, fused AdamW) under each allocator setting, each in a fresh "
          "process (PyTorch's caching allocator reads `PYTORCH_CUDA_ALLOC_CONF` once): `default`; `split_512` "
          "(`max_split_size_mb:512`, the guide's 512 MB chunks: blocks over it are never split); `expandable` "
          "(`expandable_segments:True`: segments grow in place rather than new ones being taken); `fraction_95` "
          "(`torch.cuda.set_per_process_memory_fraction(0.95)`). The same steps on the same batches, their length "
          "cycling at a fixed token count (differently shaped tensors, what fragments a caching allocator): the "
          "median step after the first cycle; the allocator's peaks (allocated: tensors; reserved: taken from the "
          "driver); cudaMalloc retries (each frees cached blocks and tries again: fragmentation's cost); the "
          "largest batch a step then fits (doubling, then bisecting). One process after another: times compare "
          "across processes, not side by side.\n\n" + (md_table(pd.DataFrame(table)) if table else "no results")
          + "\n")
    return [Section("G0-C1", "Allocator settings (512 MB chunks, 95% memory fraction, expandable segments)", md,
                    verdicts)]
