"""Shared pieces of every study's report: guide figures, verdicts, provenance, fixed styling."""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Iterable
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

# The one verdict rule (``judge``; each verdict defined in docs/methods.md, "Verdicts")
VERDICTS = ("holds", "better than claimed", "worse than claimed", "inconclusive", "not measurable here",
            "by construction", "not measured yet")
# What the report writes in place of a verdict whose results are stale (their params or code changed since they
# were measured): "stale: re-measure on H100". It is no verdict: nothing counts it (``is_stale``).
STALE = "stale: re-measure on "


def is_stale(verdict: str) -> bool:
    return verdict.startswith(STALE)

# What names one measurement's rows: a value of another metric of the same measurement matches on all of it
ROW_KEY = ("target", "case_id", "provider", "mode")

# Fixed provider order and colours across every figure.
PROVIDER_ORDER = list(PROVIDERS)
PROVIDER_COLORS = dict(zip(PROVIDER_ORDER, sns.color_palette("tab10", len(PROVIDER_ORDER)), strict=True))


_PART = re.compile(r"^<!-- ([a-z0-9_.]+) -->\n", re.M)


@functools.cache
def _prose_parts(path: Path) -> dict[str, Any]:
    """A report's prose, ``report.md`` beside it: each part after a line ``<!-- name -->``, a Jinja2 template."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    chunks = _PART.split(path.read_text())
    # a part ends where the next begins; the one newline before that line is the file's, not the part's
    return {name: env.from_string(body[:-1] if body.endswith("\n") else body)
            for name, body in zip(chunks[1::2], chunks[2::2], strict=True)}


def prose(report_file: str, part: str, **values: Any) -> str:
    """Part ``part`` of the prose beside a study's report (its ``__file__``), with ``values`` filled in: every name
    the part uses must be given."""
    parts = _prose_parts(Path(report_file).with_name("report.md"))
    if part not in parts:
        raise KeyError(f"no part {part!r} in {Path(report_file).with_name('report.md')}; parts: {', '.join(parts)}")
    return parts[part].render(**values)


@functools.cache
def guide_figures() -> dict[str, Any]:
    text = resources.files("adaattn_pipeline.report").joinpath("guide_figures.yaml").read_text()
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
        if self.verdict not in VERDICTS and not is_stale(self.verdict):
            raise ValueError(f"verdict {self.verdict!r}; allowed: {VERDICTS}")


_knobs: list = []  # the verdicts section the reports are rendered under (render_all sets it)


def knobs():
    """The ``verdicts`` section of the params the reports are rendered under (its defaults outside ``use_knobs``)."""
    from adaattn_pipeline.config import Verdicts

    return _knobs[-1] if _knobs else Verdicts()


TOLERANCES = {"ratio": "guide_ratio_tolerance", "memory": "guide_memory_tolerance", "precision": "precision_tolerance",
              "same_time": "same_time_tolerance"}


def tolerance_for(kind: str) -> float:
    """The tolerance for what a claim is read on: ``ratio`` for a ratio of two readings (whatever they measure: a
    memory ratio is a ratio), ``memory`` for a memory figure itself from other hardware, ``precision``,
    ``same_time`` (docs/methods.md, Verdicts)."""
    if kind not in TOLERANCES:
        raise ValueError(f"tolerance kind {kind!r}; allowed: {', '.join(TOLERANCES)}")
    return getattr(knobs(), TOLERANCES[kind])


@contextlib.contextmanager
def use_knobs(verdicts):
    _knobs.append(verdicts)
    try:
        yield
    finally:
        _knobs.pop()


_params: list = []  # the whole params the reports are rendered under (render_all sets it)


def rendered_params():
    """The validated params the reports are rendered under (None outside ``use_params``): for a study's goals filed
    in its own section outside the results' hash (G3-T4's ``quality``)."""
    return _params[-1] if _params else None


def filed(section: str, field: str, default):
    """A study's goals as filed in params.yaml (``section``'s ``field``, outside the results' hash), or ``default``
    outside a render or where the section is absent."""
    params = rendered_params()
    found = getattr(params, section, None) if params is not None else None
    return getattr(found, field) if found is not None else default


@contextlib.contextmanager
def use_params(params):
    _params.append(params)
    try:
        yield
    finally:
        _params.pop()


def cpu_targets(df: pd.DataFrame) -> set[str]:
    """The targets whose results were measured without CUDA (their rows have no CUDA version)."""
    cuda = df["cuda"] if "cuda" in df else pd.Series(float("nan"), index=df.index)
    return set(df.loc[cuda.isna(), "target"]) - set(df.loc[cuda.notna(), "target"])


def judge(measured: tuple[float, float], band: tuple[float | None, float | None], higher_is_better: bool = True,
          tolerance: float = 0.0) -> str:
    """The one verdict rule: the measured interval (a median's confidence interval; one reading is an interval of
    one point) against the claim's band widened by ``tolerance`` (a fraction each way; None: that side open, so a
    bound is a band open on one side). Inside: holds; wholly on the better side: better than claimed; wholly on the
    worse side: worse than claimed; across an edge: inconclusive."""
    lo, hi = measured
    if math.isnan(lo) or math.isnan(hi):
        return "not measured yet"
    c_lo = -math.inf if band[0] is None else band[0] * (1 - tolerance)
    c_hi = math.inf if band[1] is None else band[1] * (1 + tolerance)
    if c_lo <= lo and hi <= c_hi:
        return "holds"
    if lo > c_hi or hi < c_lo:
        return "better than claimed" if (lo > c_hi) == higher_is_better else "worse than claimed"
    return "inconclusive"


def median_interval(values: Iterable[float]) -> tuple[float, float, float]:
    """(median, low, high) of a claim's readings over its cases, what ``judge`` reads where a claim spans a sweep:
    the median's distribution-free 95% confidence interval, or the readings' range where they are too few for one
    (5 or fewer; one reading is an interval of one point)."""
    from adaattn.timing.rounds import median_ci

    v = sorted(x for x in values if not math.isnan(x))
    if not v:
        return math.nan, math.nan, math.nan
    lo, hi = median_ci(v)
    if math.isinf(lo) or math.isinf(hi):
        lo, hi = v[0], v[-1]
    return float(pd.Series(v).median()), lo, hi


def interval_text(values: Iterable[float], unit: str = "x", digits: int = 3) -> str:
    """The readings' median with what bounds it (``median_interval``), named for what it is: past five readings
    the median's 95% confidence interval ("CI"), two to five their range ("range"), one the reading alone."""
    from adaattn.timing.rounds import median_ci

    v = [x for x in values if not math.isnan(x)]
    med, lo, hi = median_interval(v)
    if len(v) <= 1:
        return f"{med:.{digits}g}{unit}"
    kind = "CI" if math.isfinite(median_ci(sorted(v))[0]) else "range"  # median_interval fell back to the range
    return f"median {med:.{digits}g}{unit} ({kind} {lo:.{digits}g}-{hi:.{digits}g})"


def same_row(frame: pd.DataFrame, row: pd.Series | dict, metric: str, keys: tuple[str, ...] = ROW_KEY) -> pd.Series:
    """``frame``'s ``metric`` values of the row ``row`` is (every key column equal: target, case, provider, mode),
    never of another target's or provider's row that shares part of the key."""
    match = frame["metric"] == metric
    for k in keys:
        match &= frame[k] == row[k]
    return frame.loc[match, "value"]


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


def provenance_table(df: pd.DataFrame, stale: dict[str, str]) -> str:
    """One line per target: hardware, software, commit, code and params hashes, and whether it is stale (why)."""
    cols = ["target", "hardware", "hardware_count", "host", "driver", "cuda", "cudnn", "torch", "triton", "python",
            "peers", "git_commit", "git_dirty", "code_hash", "params_hash", "measured_at"]
    prov = df.reindex(columns=cols).drop_duplicates("target").copy().astype(object)  # host, peers: since 11-28
    prov = prov.where(prov.notna(), "-")
    for col in ("cuda", "cudnn", "hardware_count"):  # read back as floats (CPU rows are empty)
        prov[col] = prov[col].map(lambda v: v if isinstance(v, str) else f"{v:g}")
    prov["git_commit"] = prov["git_commit"].map(
        lambda c: c[:10] if c != "unknown" else "unknown (no git history on that machine; see code_hash)")

    prov["status"] = prov["target"].map(lambda t: f"STALE: {stale[t]}" if t in stale else "current")
    return md_table(prov)


def one_point_table(frame: pd.DataFrame, x: str, by: list[str], title: str) -> str | None:
    """A sweep whose ``x`` holds one value is a table, not a figure of lone points: its markdown (``by`` columns
    beside ``x`` and the value), or None where the sweep has two values or more."""
    if frame[x].nunique() > 1:
        return None
    cols = [c for c in (x, *by) if c in frame]
    table = frame[[*cols, "value"]].sort_values(cols).assign(value=frame["value"].map(fmt))
    return f"{title} (one point: a table, not a figure)\n\n{md_table(table)}\n"


_drawing = [True]


@contextlib.contextmanager
def figures_off():
    """Render without saving figures (the report's second pass over only current results reads its verdicts)."""
    _drawing.append(False)
    try:
        yield
    finally:
        _drawing.pop()


def save_figure(fig: plt.Figure, path: Path) -> None:
    if not _drawing[-1]:
        plt.close(fig)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # no Software/date metadata: identical inputs give byte-identical PNGs
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def figure_link(fig: plt.Figure, out_dir: Path, name: str, alt: str) -> str:
    """Save ``fig`` as ``out_dir/name`` (``save_figure``) and return the report's markdown line for it."""
    save_figure(fig, out_dir / name)
    plt.close("all")  # a seaborn grid's other figures too
    return f"![{alt}]({out_dir.name}/{name})\n"
