"""The rendered reports: a study's report opens with its verdicts, and a result measured under other params or
other code than today's (a ``--set`` run, params or code changed since) is stale: shown, marked, and voting on
nothing."""

import copy
import json
import shutil
from pathlib import Path

import pandas as pd

from adaattn_pipeline.codegraph import study_code_hash
from adaattn_pipeline.config import load_params, param_values, params_hash, validate
from adaattn_pipeline.registry import studies
from adaattn_pipeline.report.render import render_all

STUDIES = studies()

REPO = Path(__file__).resolve().parents[1]


def _copy_current(name: str, results: Path, raw: dict, stale: tuple[str, ...] = ()) -> None:
    """The committed results of a study, their hashes set to what today's code and ``raw`` give (but for the
    ``stale`` targets, whose code hash is made other): the rendering under test, whatever the repository's state."""
    shutil.copytree(REPO / "results" / name, results / name)
    study = STUDIES[name]
    code = study_code_hash(name, study.data_deps)
    for path in (results / name).glob("*.csv"):
        df = pd.read_csv(path)
        target = path.stem
        df["params_hash"] = params_hash(param_values(raw, study.param_keys(raw, target)))
        df["code_hash"] = "0" * 16 if target in stale else code
        df.to_csv(path, index=False)


def _render(tmp_path: Path, raw: dict, current: dict | None = None) -> tuple[str, str]:
    results = tmp_path / "results"
    _copy_current("cpu_baseline", results, current or raw)
    reports = tmp_path / "reports"
    render_all({"cpu_baseline": STUDIES["cpu_baseline"]}, validate(raw), raw, results, reports,
               tmp_path / "metrics.json")
    return (reports / "cpu_baseline.md").read_text(), (reports / "README.md").read_text()


def test_a_report_opens_with_its_verdicts_and_the_index_marks_stale_results(tmp_path):
    _, raw = load_params(REPO / "params.yaml")
    report, index = _render(tmp_path / "now", raw)
    cells = [c.strip() for text in (report, index) for line in text.splitlines() if line.startswith("| ")
             for c in line.split("|")[1:-1]]
    assert cells and max(map(len, cells)) <= 120  # a longer claim or measurement is written whole in its note
    headings = [line for line in report.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Verdicts" and headings[-1] == "## Where the numbers come from", headings
    (row,) = [line for line in index.splitlines() if line.startswith("| G2-T1 ")]
    assert row.endswith("| - |"), row
    # DVC's metrics: claims per verdict per table id, as the report counts them
    counts = json.loads((tmp_path / "now" / "metrics.json").read_text())
    assert list(counts) == ["G2-T1"] and sum(counts["G2-T1"].values()) == report.count("GPU-optimized AdaAttn")
    changed = copy.deepcopy(raw)
    changed["G2-T1"]["cpu"]["embed_dim"] += 64  # the results were measured at another width
    report, index = _render(tmp_path / "changed", changed, current=raw)
    (row,) = [line for line in index.splitlines() if line.startswith("| G2-T1 ")]
    assert "STALE, no verdict: cpu_baseline@cpu" in row, row
    assert "| table only |" in row  # its verdicts are not counted
    assert json.loads((tmp_path / "changed" / "metrics.json").read_text()) == {}
    assert "stale: re-measure on the CPU" in report and "**Stale results**" in report
    assert "`cpu`: re-measure on the CPU: measured under other params than today's" in report


def test_a_verdict_too_long_for_a_cell_is_written_whole_in_its_note():
    from adaattn_pipeline.report.common import Verdict
    from adaattn_pipeline.report.render import _verdict_table

    long = "median 8.56x by time per call " + "x" * 150
    table = _verdict_table([Verdict("G2-T2", "speed", "2-4x", long, "H100", "holds", "why")])
    row, note = table.splitlines()[2], table.splitlines()[-1]
    assert "... (note 1)" in row and len(max(row.split("|"), key=len).strip()) <= 120
    assert note == f"1. measured: {long}. why"


def test_one_verdict_rule_for_bands_points_and_bounds():
    """``judge``: the measured interval against the claim's band (docs/methods.md, Verdicts)."""
    from adaattn_pipeline.report.common import judge, median_interval

    assert judge((2.5, 3.5), (2, 4)) == "holds"
    assert judge((5.0, 6.0), (2, 4)) == "better than claimed"  # faster than the guide claims
    assert judge((5.0, 6.0), (2, 4), higher_is_better=False) == "worse than claimed"  # e.g. ms, memory
    assert judge((1.0, 1.5), (2, 4)) == "worse than claimed"
    assert judge((3.5, 4.5), (2, 4)) == "inconclusive"
    assert judge((1.9, 1.9), (1.8, 1.8), tolerance=0.1) == "holds"  # a point claim, widened
    assert judge((0.99, 1.02), (None, 1.03), higher_is_better=False) == "holds"  # a bound: no better side
    assert judge((1.04, 1.05), (None, 1.03), higher_is_better=False) == "worse than claimed"
    assert judge((1.01, 1.05), (None, 1.03), higher_is_better=False) == "inconclusive"
    assert judge((float("nan"),) * 2, (1, 2)) == "not measured yet"
    # a sweep's median: its confidence interval, or the range where the readings are 5 or fewer
    assert median_interval([1.0, 3.0, 2.0]) == (2.0, 1.0, 3.0)
    med, lo, hi = median_interval([float(i) for i in range(1, 21)])
    assert med == 10.5 and 1 < lo < med < hi < 20


def test_a_table_id_judged_by_two_studies_keeps_both_in_the_index(tmp_path):
    """G4-T1: the kernels study judges its kernel lines, the checkpointing study its memory line."""
    _, raw = load_params(REPO / "params.yaml")
    results, reports = tmp_path / "results", tmp_path / "reports"
    for name in ("kernels", "checkpointing"):
        _copy_current(name, results, raw)
    render_all({n: STUDIES[n] for n in ("kernels", "checkpointing")}, validate(raw), raw, results, reports,
               tmp_path / "metrics.json")
    (row,) = [line for line in (reports / "README.md").read_text().splitlines() if line.startswith("| G4-T1 ")]
    assert "[kernels](kernels.md)" in row and "[checkpointing](checkpointing.md)" in row, row
    kernels = (reports / "verdicts" / "kernels.csv").read_text().count("\nG4-T1,")
    checkpointing = (reports / "verdicts" / "checkpointing.csv").read_text().count("\nG4-T1,")
    counts = json.loads((tmp_path / "metrics.json").read_text())
    assert kernels and checkpointing and sum(counts["G4-T1"].values()) == kernels + checkpointing


def test_g1_c1_reads_a_fused_forwards_hbm_traffic_against_the_runs_copy_bandwidth(tmp_path):
    """q, k, v read and the output written once, over the forward's time, over the same run's copy GB/s."""
    import pandas as pd

    from adaattn_pipeline.report.common import fmt
    from adaattn_experiments.attention_backends.report import render

    df = pd.concat([pd.read_csv(p) for p in sorted((REPO / "results/attention_backends").glob("*.csv"))])
    (g1_c1,) = [s for s in render(df, tmp_path) if s.table_id == "G1-C1"]
    by_target = {v.hardware: v.verdict for v in g1_c1.verdicts}
    cpu_hw = df[df.target == "cpu"].hardware.iloc[0]
    assert by_target.pop(cpu_hw) == "not measurable here" and by_target
    rows = df[(df.target == "cpu") & (df.provider == "sdpa") & (df["mode"] == "fwd") & (df.metric == "time_ms")
              & (df.status == "ok")]
    copy = df[(df.target == "cpu") & (df.metric == "copy_gbps")].value.iloc[0]
    size = rows.dtype.map({"fp32": 4, "bf16": 2, "fp16": 2})
    gbps = 4 * rows.batch * rows.seq_len * rows.heads * rows.head_dim * size / (rows.value / 1e3) / 1e9
    (line,) = [ln for ln in g1_c1.markdown.splitlines() if ln.startswith("| cpu") and "| sdpa " in ln]
    assert f" {fmt((gbps / copy).median())} " in line, line


def test_a_stale_target_casts_no_verdict_and_the_current_ones_stand(tmp_path):
    """attention_backends measured on three targets, one of them (h200) by other code: its verdicts are rows that
    say where to re-measure, counted nowhere; the other targets' verdicts are what they are without it."""
    _, raw = load_params(REPO / "params.yaml")
    verdicts = {}
    for case, stale in (("all", ()), ("h200", ("h200",))):
        results, reports = tmp_path / case / "results", tmp_path / case / "reports"
        _copy_current("attention_backends", results, raw, stale)
        render_all({"attention_backends": STUDIES["attention_backends"]}, validate(raw), raw, results, reports,
                   tmp_path / case / "metrics.json")
        verdicts[case] = pd.read_csv(reports / "verdicts" / "attention_backends.csv")
        verdicts[case + "/metrics"] = json.loads((tmp_path / case / "metrics.json").read_text())
        verdicts[case + "/stale"] = json.loads((reports / "stale.json").read_text())
    h200 = pd.read_csv(REPO / "results/attention_backends/h200.csv").hardware.iloc[0]
    both, one = verdicts["all"], verdicts["h200"]
    mine = one.hardware.str.contains(h200, regex=False)
    assert mine.any() and one[mine].verdict.str.startswith("stale: re-measure on H200").all()
    assert "measured under other code than today's" in one[mine].reason.iloc[0]
    others = both[~both.hardware.str.contains(h200, regex=False)]
    assert len(others) and set(map(tuple, others.values)) <= set(map(tuple, one[~mine].values))
    counted = sum(n for c in verdicts["h200/metrics"].values() for n in c.values())
    assert counted == (~one.verdict.str.startswith("stale")).sum() < len(one)
    assert verdicts["h200/stale"] == {"attention_backends": {"h200": "re-measure on H200: measured under other code "
                                                                     "than today's"}}
    assert verdicts["all/stale"] == {}


def test_every_prose_part_is_used_and_every_used_part_exists():
    """A study's long prose lives in report.md beside its report.py, a part per ``prose(__file__, "<part>", ...)``."""
    import re

    from adaattn_pipeline.report.common import _prose_parts

    for name in STUDIES:
        folder = REPO / "experiments" / name
        used = set(re.findall(r'prose\(__file__, "([a-z0-9_.]+)"', (folder / "report.py").read_text()))
        if not used:
            continue
        assert set(_prose_parts(folder / "report.md")) == used, name
