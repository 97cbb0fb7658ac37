"""The rendered reports: a study's report opens with its verdicts, and the index marks results measured under
other params than ``params.yaml`` (a ``--set`` run, or params changed since)."""

import copy
import shutil
from pathlib import Path

from adaattn.config import load_params, validate
from adaattn.report.render import render_all
from adaattn_experiments import STUDIES

REPO = Path(__file__).resolve().parents[1]


def _render(tmp_path: Path, raw: dict) -> tuple[str, str]:
    results = tmp_path / "results"
    shutil.copytree(REPO / "results" / "cpu_baseline", results / "cpu_baseline")
    reports = tmp_path / "reports"
    render_all({"cpu_baseline": STUDIES["cpu_baseline"]}, validate(raw), raw, results, reports)
    return (reports / "cpu_baseline.md").read_text(), (reports / "README.md").read_text()


def test_a_report_opens_with_its_verdicts_and_the_index_marks_stale_results(tmp_path):
    _, raw = load_params(REPO / "params.yaml")
    report, index = _render(tmp_path / "now", raw)
    headings = [line for line in report.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Verdicts" and headings[-1] == "## Where the numbers come from", headings
    (row,) = [line for line in index.splitlines() if line.startswith("| G2-T1 ")]
    assert row.endswith("| - |"), row
    changed = copy.deepcopy(raw)
    changed["G2-T1"]["cpu"]["embed_dim"] += 64  # the committed results were measured at another width
    _, index = _render(tmp_path / "changed", changed)
    (row,) = [line for line in index.splitlines() if line.startswith("| G2-T1 ")]
    assert "STALE: cpu" in row, row
