"""Render reports/ from results/ only: per-study markdown with figures, and reports/README.md,
the index of every guide table id with the guide's figure, the measured one, the hardware and
a verdict."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from adaattn_pipeline.codegraph import study_code_hash
from adaattn_pipeline.config import Params, param_values, params_hash
from adaattn_pipeline.report.common import (STALE, Section, Verdict, figures_off, guide_figures, is_stale, md_table,
                                           provenance_table, use_knobs, use_params)
from adaattn_pipeline.report.read import read_results, read_study


def report_of(study: Any) -> Callable[[pd.DataFrame, Path], list[Section]]:
    """A study's ``render(df, out_dir)``: ``report.py`` in its folder."""
    package = type(study).__module__.rpartition(".")[0]
    return importlib.import_module(f"{package}.report").render


def staleness(study: Any, params: Params, raw: dict, df: pd.DataFrame) -> dict[str, str]:
    """The targets whose results are stale, each with why: measured under other params than params.yaml's now
    (``--set`` overrides, or params changed since), or by other code than the working tree's (any file its
    study's measurements reach, ``codegraph``), or for a target that is no longer the study's. A stale target
    casts no verdict."""
    code = study_code_hash(study.name, study.data_deps)
    own = params.study_targets.get(study.name, {})
    out = {}
    for _, row in df.drop_duplicates("target").iterrows():
        target = row["target"]
        if target not in params.targets or target not in own:
            out[target] = (f"re-measure on {row['hardware']}: {target} is no longer a target of "
                           f"study_targets.{study.name}")
            continue
        changed = [what for what, now, then in (
            ("params", params_hash(param_values(raw, study.param_keys(raw, target))), row["params_hash"]),
            ("code", code, row["code_hash"])) if now != then]
        if changed:  # a hash differs: what it covers changed since, or the result predates how it is hashed now
            out[target] = (f"re-measure on {params.targets[target].hardware()}: measured under other "
                           f"{' and '.join(changed)} than today's")
    return out


VERDICT_COLUMNS = ["table_id", "claim", "guide", "measured", "hardware", "verdict", "reason"]


def stale_results(studies: Mapping[str, Any], params: Params, raw: dict, results_root: Path) -> dict[str, str]:
    """Every committed result that casts no verdict, ``<study>@<target>`` -> why (``staleness`` over each file)."""
    keep = {"target", "hardware", "params_hash", "code_hash"}
    out = {}
    for name, study in studies.items():
        for path in sorted((results_root / name).glob("*.csv")):
            df = read_results(path, keep)
            out.update({f"{name}@{t}": why for t, why in staleness(study, params, raw, df).items()})
    return out


def verdicts_path(reports_root: Path, study: str) -> Path:
    """A study's verdicts as data, ``reports/verdicts/<study>.csv`` (apart from its figures: DVC's plots)."""
    return reports_root / "verdicts" / f"{study}.csv"


def _stale_verdict(v: Verdict, stale: dict[str, str], hardware: dict[str, str]) -> Verdict:
    """``v`` as a stale target's row: no verdict, and where to re-measure (the stale targets on its hardware)."""
    mine = [t for t in stale if hardware.get(t, "?") in v.hardware] or list(stale)
    where = sorted({stale[t].split(":", 1)[0].removeprefix("re-measure on ") for t in mine})
    return Verdict(v.table_id, v.claim, v.guide, v.measured, v.hardware, STALE + " or ".join(where),
                   "; ".join(f"{t}: {stale[t]}" for t in mine))


def _current_verdicts(study: Any, sections: list[Section], df: pd.DataFrame, stale: dict[str, str],
                      out_dir: Path) -> list[Section]:
    """``sections`` with only current results voting: each verdict the study gives again from the current
    targets' rows alone stands; the rest are stale rows; a verdict read anew without the stale rows is added."""
    if not stale:
        return sections
    current = df[~df["target"].isin(stale)]
    with figures_off():
        fresh = {(s.table_id, s.title): s.verdicts for s in report_of(study)(current, out_dir)} if len(current) else {}
    hardware = dict(zip(df["target"], df["hardware"].astype(str), strict=False))
    out = []
    for s in sections:
        again = fresh.get((s.table_id, s.title), [])
        verdicts = [v if v in again else _stale_verdict(v, stale, hardware) for v in s.verdicts]
        verdicts += [v for v in again if v not in s.verdicts]
        out.append(Section(s.table_id, s.title, s.markdown, verdicts))
    return out


def render_study(study: Any, params: Params, raw: dict, results_root: Path,
                 reports_root: Path) -> tuple[list[Section], dict[str, str]]:
    """Write ``reports/<study>.md``; returns its sections and its stale targets (with why)."""
    df = read_study(results_root, study.name)
    if df.empty:
        return [], {}
    out_dir = reports_root / study.name
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = staleness(study, params, raw, df)
    sections = _current_verdicts(study, report_of(study)(df, out_dir), df, stale, out_dir)
    ceilings = df[df["case_id"] == "machine"][["target", "hardware", "metric", "value", "unit", "kernel"]]
    ceilings = ceilings.rename(columns={"kernel": "what"}).fillna("")
    judged = [s for s in sections if s.verdicts]
    lines = [
        f"# Study `{study.name}` ({', '.join(dict.fromkeys(s.table_id for s in sections))})\n",  # what it renders
        "Rendered by `adaattn report` from `results/" + study.name + "/*.csv` only. Regenerate with `dvc repro`. "
        "The verdicts first; the tables and figures behind them follow, then where the numbers come from.\n",
    ]
    if stale:  # said first: these rows' numbers are shown, but they vote on nothing
        lines.append("**Stale results** (shown in the tables, no verdict): " + "; ".join(
            f"`{t}`: {why}" for t, why in sorted(stale.items())) + ".\n")
    if judged:  # the answer first
        lines.append("## Verdicts\n")
        for s in judged:
            lines.append(f"### {s.table_id}: {s.title}\n\n" + _verdict_table(s.verdicts) + "\n")
    for s in sections:
        lines.append(f"## {s.table_id}: {s.title}\n\n{s.markdown}")
    lines += [
        "## Where the numbers come from\n",
        provenance_table(df, stale) + "\n",
        "How each metric was measured: [docs/methods.md](../docs/methods.md), \"Metrics\", by the results' `metric`\n"
        "name; a row's `samples` is how many samples its distribution holds. The commands that measured each target:\n",
        md_table(df[["target", "command"]].drop_duplicates("target")) + "\n",
        "Machine ceilings measured at the start of each run:\n",
        md_table(ceilings) + "\n",
    ]
    (reports_root / f"{study.name}.md").write_text("\n".join(lines))
    # the verdicts as data (MLflow logs them beside the study's runs)
    verdicts_path(reports_root, study.name).parent.mkdir(exist_ok=True)
    pd.DataFrame([{"table_id": v.table_id, "claim": v.claim, "guide": v.guide, "measured": v.measured,
                   "hardware": v.hardware, "verdict": v.verdict, "reason": v.reason}
                  for s in judged for v in s.verdicts],
                 columns=VERDICT_COLUMNS).to_csv(verdicts_path(reports_root, study.name), index=False)
    return sections, stale


def stale_path(reports_root: Path) -> Path:
    """Study -> stale target -> why, ``reports/stale.json``."""
    return reports_root / "stale.json"


CELL_CHARS = 120  # a longer claim or measurement is written whole in its note, shortened in the table


def _short(text: str, note: int) -> str:
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS - 20].rsplit(" ", 1)[0] + f" ... (note {note})"


def _verdict_table(verdicts: list[Verdict]) -> str:
    """The verdicts as a table, each reason a numbered note under it, with any claim or measurement too long
    for a cell (the cells stay short enough to read)."""
    rows, notes = [], []
    for i, v in enumerate(verdicts, 1):
        whole = [f"{k}: {t}." for k, t in (("claim", v.claim), ("measured", v.measured)) if len(t) > CELL_CHARS]
        if v.reason or whole:
            notes.append(f"{i}. " + " ".join([*whole, v.reason]).strip())
        rows.append({"claim": _short(v.claim, i), "guide": v.guide, "measured": _short(v.measured, i),
                     "hardware": v.hardware, "verdict": v.verdict, "note": i if v.reason or whole else ""})
    return md_table(pd.DataFrame(rows)) + ("\n\n" + "\n".join(notes) if notes else "")


def counted(by_id: Mapping[str, list[tuple[str, Section]]]) -> dict[str, list[tuple[str, Verdict]]]:
    """Every verdict under the table id it is about (``Verdict.table_id``), whichever section shows it (the
    precision study's G2-T3 section shows G2-T2 claims too), with the study that gives it; a stale row is no
    verdict and is left out."""
    out: dict[str, list[tuple[str, Verdict]]] = {}
    for entries in by_id.values():
        for study, section in entries:
            for v in section.verdicts:
                if not is_stale(v.verdict):
                    out.setdefault(v.table_id, []).append((study, v))
    return out


def totals_path(metrics_path: Path) -> Path:
    """Where the totals go: beside the counts per table id."""
    return metrics_path.with_name("verdict_totals.json")


def verdict_metrics(by_id: Mapping[str, list[tuple[str, Section]]]) -> dict[str, dict[str, int]]:
    """Per table id, how many of its claims got each verdict (over every study that judges it; keys with
    underscores for DVC's command line): ``metrics/verdicts.json``, tracked in git (``git diff`` says which table's
    verdicts moved)."""
    out = {}
    for table_id, verdicts in sorted(counted(by_id).items()):
        counts = pd.Series([v.verdict for _, v in verdicts], dtype=object).value_counts()
        out[table_id] = {k.replace(" ", "_"): int(n) for k, n in counts.items()}
    return out


def verdict_totals(per_table: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Claims per verdict over every table: DVC's metrics file, one narrow row in ``dvc metrics show`` (the counts
    per table id are ``metrics/verdicts.json``, a row of some 50 columns there)."""
    totals: dict[str, int] = {}
    for counts in per_table.values():
        for verdict, n in counts.items():
            totals[verdict] = totals.get(verdict, 0) + n
    return dict(sorted(totals.items()))


def render_all(studies: Mapping[str, Any], params: Params, raw: dict, results_root: Path,
               reports_root: Path, metrics_path: Path | None = None) -> Path:
    reports_root.mkdir(parents=True, exist_ok=True)
    # a table id may be judged by more than one study (G4-T1: the kernels' lines and checkpointing's)
    by_id: dict[str, list[tuple[str, Section]]] = {}
    stale: dict[str, dict[str, str]] = {}
    for name, study in studies.items():
        with use_knobs(params.verdicts), use_params(params):
            sections, stale[name] = render_study(study, params, raw, results_root, reports_root)
        for section in sections:
            by_id.setdefault(section.table_id, []).append((name, section))
    by_verdict = counted(by_id)
    lines = [
        "# Reports: every guide table and claim, regenerated\n",
        "Each row is a table or claim id of the performance guides, as the project's index lists them "
        "(`src/adaattn_pipeline/report/guide_figures.yaml`: the guide file, what it holds and the guide's own "
        "figures); *verdicts* count what `dvc repro` measured on the hardware each study names. Rendered from `results/` "
        "only.\n",
        "| id | guide table | what it holds | guide hardware | study | verdicts | stale results |",
        "|---|---|---|---|---|---|---|",
    ]
    details = []
    for table_id, guide in guide_figures().items():
        entries = by_id.get(table_id, [])
        mine = by_verdict.get(table_id, [])
        if entries or mine:
            counts = pd.Series([v.verdict for _, v in mine], dtype=object).value_counts()
            summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "table only"
            # one study's section: it; else each study that judges the id (a cell stays short)
            judges = list(dict.fromkeys([study for study, _ in entries] + [study for study, _ in mine]))
            link = f"[{entries[0][0]}]({entries[0][0]}.md#{_anchor(entries[0][1])})" \
                if len(entries) == 1 and judges == [entries[0][0]] else ", ".join(f"[{j}]({j}.md)" for j in judges)
            for study, section in entries:
                details.append(f"## {table_id}: {section.title}\n\nSee [{study}]({study}.md#{_anchor(section)}).\n\n"
                               + (_verdict_table(section.verdicts) if section.verdicts else "") + "\n")
        else:
            summary, link, judges = "not measured yet", "-", []
        old = sorted(f"{study}@{t}" for study in judges for t in stale.get(study, {}))
        flag = "STALE, no verdict: " + ", ".join(old) + " (why: each study's report)" if old else "-"
        lines.append(f"| {table_id} | {guide['title']} | {guide['holds']} | {guide['hardware']} | {link} | {summary} "
                     f"| {flag} |")
    beyond = [(name, s) for table_id, entries in by_id.items() if table_id not in guide_figures()
              for name, s in entries]
    if beyond:  # the project's own studies, beside the guides' tables
        lines += ["", "Beyond the guides: " + ", ".join(f"[{name}: {s.title}]({name}.md#{_anchor(s)})"
                                                      for name, s in beyond) + "."]
    (reports_root / "README.md").write_text("\n".join(lines) + "\n\n" + "\n".join(details))
    # which results vote on nothing, as data (MLflow tags their runs)
    stale_path(reports_root).write_text(json.dumps({k: v for k, v in stale.items() if v}, indent=1, sort_keys=True)
                                        + "\n")
    if metrics_path is not None:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        per_table = verdict_metrics(by_id)
        metrics_path.write_text(json.dumps(per_table, indent=1, sort_keys=True) + "\n")
        totals_path(metrics_path).write_text(json.dumps(verdict_totals(per_table), indent=1) + "\n")
    return reports_root / "README.md"


def _anchor(section: Section) -> str:
    text = f"{section.table_id}: {section.title}".lower()
    return "".join(ch for ch in text.replace(" ", "-") if ch.isalnum() or ch in "-_")

