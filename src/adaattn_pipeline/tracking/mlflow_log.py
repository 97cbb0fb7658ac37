"""Log results files to MLflow: one experiment per study, a parent run per (study, target), a child
run per measured case (case config x provider) with its metrics, provenance tags and table id.

Idempotent: each parent run carries the sha256 of the results file it was logged from. Logging
an unchanged file does nothing; a changed file replaces that target's runs (the old ones are
deleted), so re-running never duplicates runs. Without ``MLFLOW_TRACKING_URI`` the store is
SQLite ``mlflow.db`` at the repository root (``mlflow ui``'s default there); with it, the same runs
go to that tracking server.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

from adaattn_pipeline.bench.provenance import PROVENANCE_COLUMNS
from adaattn_pipeline.report.read import read_results

KEY_TAG = "adaattn.key"  # "<study>/<target>" on parent runs
SHA_TAG = "adaattn.results_sha256"
FORMAT_TAG = "adaattn.log_format"
LOG_FORMAT = "8"  # what a run holds: a file logged in another format is logged again
CHILD_PROVENANCE = ("target", "hardware")  # a child run's provenance tags; the parent carries all of it
STEP = "step"  # a results column of training steps: its rows are one run's metric histories, not runs apart


def tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _clean(value) -> str:
    """A cell as MLflow text: empty for a missing value, an integer without ".0" (a filter on
    ``params.seq_len = '16384'`` finds it; the CSV reads integer columns with gaps back as floats)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _key(mode: str, name: str) -> str:
    """``<mode>.<name>``, or ``name`` for a row without a mode (no "nan." keys)."""
    return f"{mode}.{name}" if mode else name


def _tag(name: str, mode: str) -> str:
    """``<name>.<mode>`` (``status.fwd``), or ``name`` for a row without a mode."""
    return f"{name}.{mode}" if mode else name


def _epoch_ms(measured_at: str) -> int:
    """The run's measurement time as MLflow's metric timestamp (0 where the file has none)."""
    stamp = pd.Timestamp(measured_at) if measured_at else None
    if stamp is None or pd.isna(stamp):
        return 0
    return int((stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp).timestamp() * 1000)


def _child_runs(df: pd.DataFrame, config_columns: list[str]):
    """(run name, params, metrics, tags) per (case, provider). A config column that varies within one (a per-head
    estimate, say) names its value in the metric's key (``fwd.entropy_rank.head_3``): each distinct row is its own
    metric, none overwrites another, and the server is sent one run where there would be one a head."""
    runs = df[df["case_id"] != "machine"]
    for (case_id, provider), grp in runs.groupby(["case_id", "provider"], sort=False):
        cols = [c for c in config_columns if c in grp and c != STEP]
        varying = [c for c in cols if grp[c].nunique(dropna=False) > 1]
        first = grp.iloc[0]
        params = {c: _clean(first[c]) for c in cols if c not in varying}
        params.update(provider=provider, table_id=_clean(first["table_id"]))
        metrics: dict[str, list[tuple[float, int]]] = {}  # key -> (value, step): a curve is a history
        tags = {"table_id": _clean(first["table_id"]), "case_id": case_id}
        for _, r in grp.iterrows():
            mode = _clean(r["mode"])
            key = _key(mode, r["metric"]) + "".join(f".{c}_{_clean(r[c])}" for c in varying)
            step = int(r[STEP]) if STEP in r and not pd.isna(r[STEP]) else 0
            if r["status"] == "ok" and not pd.isna(r["value"]):
                metrics.setdefault(key, []).append((float(r["value"]), step))
                if not pd.isna(r["p20"]):
                    metrics.setdefault(f"{key}_p20", []).append((float(r["p20"]), step))
                    metrics.setdefault(f"{key}_p80", []).append((float(r["p80"]), step))
            tags[_tag("status", mode)] = r["status"]
            if _clean(r["reason"]):
                tags[_tag("reason", mode)] = _clean(r["reason"])[:5000]
            if _clean(r["kernel"]):
                tags[_tag("kernel", mode)] = _clean(r["kernel"])
        yield f"{provider} · {case_id}", params, metrics, tags


def log_results_file(client, study: str, path: Path, config_columns: list[str], artifacts: list[Path],
                     report: Path | None = None, verdicts: Path | None = None, stale: str | None = None,
                     workers: int = 1) -> str:
    """Log one results file (its figures in ``artifacts``, the study's ``report`` beside them, its ``verdicts``
    table and the guide's figures for its table ids; the verdicts on this target's hardware counted in tags, none
    where the target is ``stale`` (why, a tag instead)); returns 'unchanged' or 'logged'. ``workers``: child runs
    logged at once (a tracking server's; the local SQLite store takes one writer)."""
    from mlflow.entities import Metric, Param

    from adaattn_pipeline.report.common import guide_figures, is_stale

    target = path.stem
    has_verdicts = verdicts is not None and verdicts.is_file()
    # a new verdict, or a target turning stale or current, re-logs the target
    sha = _sha(path) + (f"+{_sha(verdicts)}" if has_verdicts else "") + ("+stale" if stale else "")
    exp = client.get_experiment_by_name(study)
    # experimentKind: MLflow 3's UI opens a "custom model development" experiment on its runs table
    exp_id = exp.experiment_id if exp else client.create_experiment(
        study, tags={"mlflow.experimentKind": "custom_model_development", "adaattn.study": study})
    existing = client.search_runs([exp_id], filter_string=f"tags.`{KEY_TAG}` = '{study}/{target}'")
    if any(r.data.tags.get(SHA_TAG) == sha and r.data.tags.get(FORMAT_TAG) == LOG_FORMAT for r in existing):
        return "unchanged"
    for old in existing:  # a re-measured target replaces its runs, never duplicates them
        for child in client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{old.info.run_id}'"):
            client.delete_run(child.info.run_id)
        client.delete_run(old.info.run_id)

    df = read_results(path)
    prov = {c: _clean(df[c].iloc[0]) for c in PROVENANCE_COLUMNS if c in df}
    machine = df[df["case_id"] == "machine"]
    parent = client.create_run(exp_id, run_name=f"{target} · {prov.get('hardware', '')}", tags={
        KEY_TAG: f"{study}/{target}", SHA_TAG: sha, FORMAT_TAG: LOG_FORMAT, "study": study,
        "table_ids": ",".join(sorted(df["table_id"].dropna().astype(str).unique())), **prov,
    })
    pid = parent.info.run_id
    ts = _epoch_ms(prov.get("measured_at", ""))
    client.log_batch(pid, metrics=[Metric(f"machine.{r['metric']}", float(r["value"]), ts, 0)
                                   for _, r in machine.iterrows()],
                     params=[Param("target", target), Param("results_file", str(path))])

    def log_child(name: str, params: dict, metrics: dict, tags: dict) -> None:
        # started at the measurement's time, before every parent (started now): the runs table, newest first,
        # opens on the parents, their children folded under them, however many children there are
        # provenance whole on the parent (one per results file); a child keeps what a filter over the runs table
        # needs (its target and hardware)
        child = client.create_run(exp_id, run_name=name, start_time=ts, tags={
            "mlflow.parentRunId": pid, "study": study, **{k: prov[k] for k in CHILD_PROVENANCE if k in prov},
            **tags})
        points = [Metric(k, v, ts, step) for k, vs in metrics.items() for v, step in vs]
        client.log_batch(child.info.run_id, metrics=points[:1000], params=[Param(k, v) for k, v in params.items()])
        for i in range(1000, len(points), 1000):  # MLflow takes at most 1000 metrics a batch (a long curve)
            client.log_batch(child.info.run_id, metrics=points[i:i + 1000])
        client.set_terminated(child.info.run_id, end_time=ts)

    children = list(_child_runs(df, config_columns))
    if workers > 1:  # a server: its round trips overlap (three a child run, thousands of runs)
        with ThreadPoolExecutor(workers) as pool:
            for done in [pool.submit(log_child, *c) for c in children]:
                done.result()
    else:
        for c in children:
            log_child(*c)
    for art in artifacts:
        client.log_artifact(pid, str(art), artifact_path="figures")
    if report is not None and report.is_file():
        client.log_artifact(pid, str(report))
    ids = sorted(df["table_id"].dropna().astype(str).unique())
    client.log_dict(pid, {i: guide_figures()[i] for i in ids if i in guide_figures()}, "guide_figures.json")
    if has_verdicts:
        client.log_artifact(pid, str(verdicts), artifact_path="verdicts")
        table = pd.read_csv(verdicts)
        mine = table[table["hardware"].astype(str).str.contains(prov.get("hardware", "?"), regex=False)
                     & ~table["verdict"].astype(str).map(is_stale)]
        for verdict, n in (mine["verdict"].value_counts().items() if not stale else ()):
            client.set_tag(pid, f"verdicts.{verdict.replace(' ', '_')}", str(int(n)))
    if stale:
        client.set_tag(pid, "stale", stale)
    client.set_terminated(pid)
    return "logged"


def sync(studies: dict, results_root: Path, reports_root: Path, root: Path, manifest: Path, workers: int = 16) -> dict:
    """Log every results file of every study; write a deterministic manifest (the DVC output). ``workers``: child
    runs logged at once where the store is a tracking server (HTTP); one at a time into the local SQLite file."""
    import mlflow
    from mlflow import MlflowClient

    from adaattn_pipeline.report.render import stale_path, verdicts_path

    uri = tracking_uri(root)
    remote = uri.startswith(("http://", "https://"))
    if remote:  # MLflow's HTTP pool keeps 10 connections: each worker its own, none opened again
        os.environ.setdefault("MLFLOW_HTTP_POOL_MAXSIZE", str(workers))
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    summary: dict[str, dict[str, str]] = {}
    actions: dict[str, str] = {}
    stale = json.loads(stale_path(reports_root).read_text()) if stale_path(reports_root).is_file() else {}
    for name, study in studies.items():
        for path in sorted((results_root / name).glob("*.csv")):
            # a figure names its target as one of its name's "_"-separated parts (g2_b_seq_h100, G1-T1_h100_bf16);
            # one that names none of the study's targets shows them all (g3_t4_memory): every target's run has it
            pngs = sorted((reports_root / name).glob("*.png"))
            targets = {p.stem for p in (results_root / name).glob("*.csv")}
            figures = [f for f in pngs if path.stem in f.stem.split("_") or not targets & set(f.stem.split("_"))]
            actions[f"{name}/{path.stem}"] = log_results_file(client, name, path, study.config_columns, figures,
                                                              reports_root / f"{name}.md",
                                                              verdicts_path(reports_root, name),
                                                              stale.get(name, {}).get(path.stem),
                                                              workers if remote else 1)
            summary.setdefault(name, {})[path.stem] = _sha(path)
    store = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "mlflow.db"
    tmp = manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps({"store": store, "results_sha256": summary}, indent=2, sort_keys=True) + "\n")
    tmp.replace(manifest)
    return actions
