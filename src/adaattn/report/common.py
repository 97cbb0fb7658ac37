"""Shared pieces of every study's report: guide figures, verdicts, provenance, fixed styling."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
import yaml  # noqa: E402

from adaattn.attention.providers import PROVIDERS  # noqa: E402

# "inconclusive": measured, but the measurement's confidence interval leaves the claim on both sides
VERDICTS = ("holds", "does not hold", "inconclusive", "not measurable here", "not measured yet")

# Fixed provider order and colours across every figure.
PROVIDER_ORDER = list(PROVIDERS)
PROVIDER_COLORS = dict(zip(PROVIDER_ORDER, sns.color_palette("tab10", len(PROVIDER_ORDER)), strict=True))


@functools.cache
def guide_figures() -> dict[str, Any]:
    text = resources.files("adaattn.report").joinpath("guide_figures.yaml").read_text()
    return yaml.safe_load(text)


@dataclass(frozen=True)
class Verdict:
    table_id: str
    claim: str
    guide: str  # the guide's figure, as text
    measured: str  # what we measured, as text
    hardware: str
    verdict: str  # one of VERDICTS
    reason: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r}; allowed: {VERDICTS}")


@dataclass
class Section:
    """What a study renders for one table id: markdown (with figure links) and verdicts."""

    table_id: str
    title: str
    markdown: str
    verdicts: list[Verdict] = field(default_factory=list)


def md_table(frame: pd.DataFrame) -> str:
    return frame.to_markdown(index=False, floatfmt=".4g")


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or pd.isna(x):
        return "-"
    return f"{x:.{digits}g}"


def provenance_table(df: pd.DataFrame, current_hashes: dict[str, str | None]) -> str:
    """One line per target: hardware, software, commit, params hash, and whether it is stale."""
    cols = ["target", "hardware", "hardware_count", "driver", "cuda", "cudnn", "torch", "triton", "python",
            "git_commit", "git_dirty", "code_hash", "params_hash", "measured_at"]
    prov = df[cols].drop_duplicates("target").copy().astype(object)
    prov = prov.where(prov.notna(), "-")
    for col in ("cuda", "cudnn", "hardware_count"):  # read back as floats (CPU rows are empty)
        prov[col] = prov[col].map(lambda v: v if isinstance(v, str) else f"{v:g}")
    prov["git_commit"] = prov["git_commit"].map(
        lambda c: c[:10] if c != "unknown" else "unknown (no git history on that machine; see code_hash)")

    def status(row: pd.Series) -> str:
        cur = current_hashes.get(row["target"])
        if cur is None:
            return "stale: target no longer in params.yaml"
        return "current" if cur == row["params_hash"] else f"STALE: params.yaml now hashes to {cur}"

    prov["params"] = prov.apply(status, axis=1)
    return md_table(prov)


def save_figure(fig: plt.Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # no Software/date metadata: identical inputs give byte-identical PNGs
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
