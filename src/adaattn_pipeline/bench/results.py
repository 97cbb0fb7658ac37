"""Results: one tidy long table per (study, hardware target), written atomically.

One row per (case, provider, mode, metric). Distribution metrics (times) carry p20/p50/p80 with
``value`` = p50, the mean and standard deviation of the samples and their count (``samples``); scalar
metrics carry ``value`` only. ``unit`` is a unit (how a metric is measured: ``docs/methods.md``, by metric
name). A case that did not run is one row with ``status`` (``STATUSES``) and the ``reason``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pandas as pd

from adaattn_pipeline.bench.provenance import PROVENANCE_COLUMNS

ROW_COLUMNS = (
    "study", "table_id", "case_id", "provider", "mode", "metric", "value", "p20", "p80", "mean", "std", "samples",
    "unit", "status", "reason", "kernel",
)
# ok: measured; outpaced: measured in the first rounds only, then another rival was faster with confidence
# (``side_by_side``); pruned: not timed (its warm-up far slower than the fastest rival's); the rest: did not run
STATUSES = ("ok", "outpaced", "pruned", "unavailable", "unsupported", "oom", "error")
UNIT_CHARS = 40  # a unit, not a method: the method is docs/methods.md's, by metric


def results_path(root: Path, study: str, target: str) -> Path:
    return root / study / f"{target}.csv"


def write_results(path: Path, rows: list[dict], config_columns: list[str]) -> None:
    """Write rows as CSV via a temp file in the same folder + rename: readers never see a partial file."""
    columns = [*ROW_COLUMNS, *config_columns, *PROVENANCE_COLUMNS]
    unknown = sorted({k for r in rows for k in r} - set(columns))
    if unknown:
        raise ValueError(f"result rows carry unknown columns {unknown}")
    bad = sorted({str(r.get("status")) for r in rows} - set(STATUSES))
    if bad:
        raise ValueError(f"result rows carry status {bad}; allowed: {', '.join(STATUSES)}")
    long = sorted({u for r in rows if len(u := str(r.get("unit") or "")) > UNIT_CHARS})
    if long:
        raise ValueError(f"result units over {UNIT_CHARS} characters (a unit, not a method): {long[:3]}")
    frame = pd.DataFrame(rows, columns=columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as fh:
            frame.to_csv(fh, index=False, float_format="%.6g")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_results(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, keep_default_na=True)


def read_study(root: Path, study: str) -> pd.DataFrame:
    """All targets' results of one study, concatenated (empty frame if none)."""
    frames = [read_results(p) for p in sorted((root / study).glob("*.csv"))]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=ROW_COLUMNS)
