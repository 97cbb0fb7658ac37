"""MLflow logging: idempotent, a re-measured target replaces its runs, provenance and table ids as tags."""

import shutil

import pandas as pd
import pytest

from adaattn_pipeline.tracking.mlflow_log import KEY_TAG, log_results_file

CONFIG = ["batch", "seq_len", "heads", "head_dim", "causal", "dtype"]


@pytest.fixture
def client(tmp_path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")


def _runs(client):
    exp = client.get_experiment_by_name("attention_backends")
    return client.search_runs([exp.experiment_id], max_results=5000)


def test_logging_is_idempotent_and_replaces_remeasured_targets(repo, tmp_path, client):
    path = tmp_path / "cpu.csv"
    shutil.copy(repo / "results/attention_backends/cpu.csv", path)
    assert log_results_file(client, "attention_backends", path, CONFIG, []) == "logged"
    first = _runs(client)
    df = pd.read_csv(path)
    cases = df[df["case_id"] != "machine"].groupby(["case_id", "provider"]).ngroups
    assert len(first) == cases + 1  # one child per (case, provider) and the parent
    assert log_results_file(client, "attention_backends", path, CONFIG, []) == "unchanged"
    assert len(_runs(client)) == len(first)

    df.loc[df["metric"] == "time_ms", "value"] *= 2  # a re-measurement of the same target
    df.to_csv(path, index=False)
    assert log_results_file(client, "attention_backends", path, CONFIG, []) == "logged"
    after = _runs(client)
    assert len(after) == len(first)
    parent = next(r for r in after if KEY_TAG in r.data.tags)
    assert parent.data.tags[KEY_TAG] == "attention_backends/cpu"
    assert parent.data.tags["hardware"] == str(df["hardware"].iloc[0])
    assert parent.data.metrics["machine.copy_gbps"] > 0
    child = next(r for r in after if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                 and r.data.params.get("provider") == "sdpa_cudnn")
    assert child.data.tags["status.fwd"] == "unavailable" and "no cpu implementation" in child.data.tags["reason.fwd"]
    # a second target's parent: the first page of the runs table (newest first) holds every parent
    shutil.copy(repo / "results/attention_backends/h100.csv", tmp_path / "h100.csv")
    log_results_file(client, "attention_backends", tmp_path / "h100.csv", CONFIG, [])
    exp = client.get_experiment_by_name("attention_backends")
    top = client.search_runs([exp.experiment_id], max_results=2, order_by=["attributes.start_time DESC"])
    assert {r.data.tags.get(KEY_TAG) for r in top} == {"attention_backends/cpu", "attention_backends/h100"}


def test_runs_hold_integer_params_mode_keys_measurement_time_figures_and_the_report(repo, tmp_path, client):
    """Integers filter as integers, a row without a mode makes no "nan." key, metrics carry the measurement's
    time, and every figure of the target (whatever its name's order) and the study's report are artifacts."""
    from adaattn_pipeline.tracking.mlflow_log import _child_runs, _clean, _key

    assert (_clean(16384.0), _clean(0.5), _clean(float("nan")), _key("", "manager_ranking")) == \
        ("16384", "0.5", "", "manager_ranking")
    df = pd.read_csv(repo / "results/scaling/h100.csv")
    keys = {k for _, _, metrics, tags in _child_runs(df, ["batch", "seq_len"]) for k in (*metrics, *tags)}
    assert keys and not any(k.startswith("nan") or k.endswith(".") or ".nan" in k for k in keys)
    # per-head rows (the rank study's estimates): one run per (case, provider), each head's value its own metric key,
    # no value overwrites another
    rank = pd.read_csv(repo / "results/rank/cpu.csv")
    rank = rank[(rank.case_id != "machine") & (rank.status == "ok")]
    runs = list(_child_runs(rank, ["inputs", "true_rank", "batch", "heads", "seq_len", "head_dim", "dtype", "head"]))
    assert len({name for name, *_ in runs}) == len(runs) == rank.groupby(["case_id", "provider"]).ngroups
    assert sum(len(m) for _, _, m, _ in runs) == len(rank) + rank.p20.notna().sum() * 2
    assert any(".head_1" in k for _, _, m, _ in runs for k in m)
    path = tmp_path / "h100.csv"
    shutil.copy(repo / "results/attention_backends/h100.csv", path)
    figures = [tmp_path / "G1-T1_h100_bf16.png", tmp_path / "g2_b_seq_h100.png"]
    for f in figures:
        f.write_bytes(b"png")
    report = tmp_path / "attention_backends.md"
    report.write_text("# report")
    verdicts = tmp_path / "verdicts.csv"
    hw = pd.read_csv(path)["hardware"].iloc[0]
    pd.DataFrame([{"table_id": "G1-T2", "claim": "c", "verdict": v, "hardware": h} for v, h in
                  (("holds", f"{hw} (h100), bf16"), ("holds", f"{hw} (h100), fp16"),
                   ("better than claimed", hw), ("holds", "NVIDIA H200 (h200), bf16"))]).to_csv(verdicts, index=False)
    log_results_file(client, "attention_backends", path, CONFIG, figures, report, verdicts)
    parent = next(r for r in _runs(client) if KEY_TAG in r.data.tags)
    names = sorted(a.path for a in client.list_artifacts(parent.info.run_id)) + sorted(
        a.path for a in client.list_artifacts(parent.info.run_id, "figures"))
    names += [a.path for a in client.list_artifacts(parent.info.run_id, "verdicts")]
    assert names == ["attention_backends.md", "figures", "guide_figures.json", "verdicts",
                     "figures/G1-T1_h100_bf16.png", "figures/g2_b_seq_h100.png", "verdicts/verdicts.csv"]
    # the verdicts on this target's hardware, counted in the parent's tags; the guide's figures of its table ids
    tags = parent.data.tags
    assert (tags["verdicts.holds"], tags["verdicts.better_than_claimed"]) == ("2", "1"), tags
    guide = client.download_artifacts(parent.info.run_id, "guide_figures.json", str(tmp_path))
    assert set(pd.read_json(guide, typ="series").index) == set(tags["table_ids"].split(","))
    measured = pd.Timestamp(pd.read_csv(path)["measured_at"].iloc[0]).timestamp() * 1000
    (copy,) = client.get_metric_history(parent.info.run_id, "machine.copy_gbps")
    assert copy.timestamp == int(measured)
    child = next(r for r in _runs(client) if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
    assert "." not in child.data.params["seq_len"], child.data.params
    # a changed verdict logs the target again (its results unchanged)
    pd.read_csv(verdicts).assign(verdict="inconclusive").to_csv(verdicts, index=False)
    assert log_results_file(client, "attention_backends", path, CONFIG, figures, report, verdicts) == "logged"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    """A real `mlflow server` on loopback (its own SQLite store and artifact folder), stopped after the test."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                             "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not answer in 60 s")
        yield uri
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_sync_to_a_tracking_server_is_idempotent_and_carries_every_figure(repo, tmp_path, server, monkeypatch):
    """`MLFLOW_TRACKING_URI=<server> adaattn log --manifest <elsewhere>`: the docs' command, on a copy of two
    studies' results and reports; a second sync sends nothing, and a figure that names no target (memory_bank's)
    is on every target's run."""
    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from adaattn_pipeline.cli import build_app

    for study in ("memory_bank", "precision"):
        shutil.copytree(repo / "results" / study, tmp_path / "results" / study)
        shutil.copytree(repo / "reports" / study, tmp_path / "reports" / study)
        shutil.copy(repo / "reports" / f"{study}.md", tmp_path / "reports" / f"{study}.md")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    args = ["log", "--manifest", str(tmp_path / "server.json"), "--workers", "4"]
    first = CliRunner().invoke(build_app(), args)
    assert first.exit_code == 0, first.output
    assert "memory_bank/h100: logged" in first.output and not (tmp_path / "mlflow.db").exists()
    again = CliRunner().invoke(build_app(), args)
    assert again.exit_code == 0 and "logged" not in again.output and "unchanged" in again.output
    client = MlflowClient(server)
    exp = client.get_experiment_by_name("memory_bank")
    parents = [r for r in client.search_runs([exp.experiment_id]) if KEY_TAG in r.data.tags]
    assert {r.data.tags[KEY_TAG] for r in parents} == {f"memory_bank/{p.stem}" for p in
                                                       (tmp_path / "results" / "memory_bank").glob("*.csv")}
    assert len(parents) >= 2
    for run in parents:
        figures = {f.path for f in client.list_artifacts(run.info.run_id, "figures")}
        assert {"figures/g3_t4_memory.png", "figures/g3_t4_recall.png"} <= figures
