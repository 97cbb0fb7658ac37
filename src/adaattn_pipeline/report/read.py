"""Results files read back for the report and MLflow: their identifiers as text.

A hex hash of digits around one "e" (a params hash ``721e50482777``) is a float to pandas (inf), and the stale
check, comparing it with today's hash, called a fresh result stale (distributed@h200x2, 2026-12-01). The reader
lives here, not beside the writer in ``bench/results.py``: every study's code hash covers that file.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from adaattn_pipeline.bench.results import ROW_COLUMNS

ID_COLUMNS = ("git_commit", "code_hash", "params_hash")


def read_results(path: Path, columns: set[str] | None = None) -> pd.DataFrame:
    """A results file (only ``columns``, if given), its identifiers (``ID_COLUMNS``) as text."""
    usecols = None if columns is None else (lambda c: c in columns)
    return pd.read_csv(path, keep_default_na=True, usecols=usecols, dtype={c: str for c in ID_COLUMNS})


def read_study(root: Path, study: str) -> pd.DataFrame:
    """All targets' results of one study, concatenated (empty frame if none)."""
    frames = [read_results(p) for p in sorted((root / study).glob("*.csv"))]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=ROW_COLUMNS)
