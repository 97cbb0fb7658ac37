"""A real `mlflow ui` on a loopback port, opened in headless Chromium (Debian's, via Playwright)."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlflow_ui_lists_study_runs(repo, tmp_path):
    assert Path(CHROMIUM).exists(), "Debian's chromium is needed: bash scripts/install.sh --browser"
    from mlflow import MlflowClient
    from playwright.sync_api import sync_playwright

    from adaattn_pipeline.registry import studies
    from adaattn_pipeline.tracking.mlflow_log import sync

    STUDIES = studies()

    store = tmp_path / "mlflow.db"
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{store}", "--host", "127.0.0.1",
         "--port", str(port)], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, "mlflow ui did not come up"
                time.sleep(1)
        # the runs reach the server the way a remote tracking server gets them: MLFLOW_TRACKING_URI
        uri = f"http://127.0.0.1:{port}"
        os.environ["MLFLOW_TRACKING_URI"] = uri
        results = tmp_path / "results" / "attention_backends"
        results.mkdir(parents=True)  # the CPU target only: every run goes over HTTP
        shutil.copy(repo / "results/attention_backends/cpu.csv", results)
        try:
            sync(STUDIES, tmp_path / "results", repo / "reports", tmp_path, tmp_path / "sync.json")
        finally:
            del os.environ["MLFLOW_TRACKING_URI"]
        assert not (tmp_path / "mlruns").exists()  # nothing went to a local store
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("attention_backends")
        runs = client.search_runs([exp.experiment_id], max_results=5000)
        newest_parent = max((r for r in runs if "mlflow.parentRunId" not in r.data.tags),
                            key=lambda r: r.info.start_time)
        assert client.list_artifacts(newest_parent.info.run_id, "figures")
        # what the server holds, read back over HTTP: the report, the verdicts (as data and counted in the parent's
        # tags) and the guide's figures; integer params that filter as integers; no "nan." key; measurement times
        names = {a.path for a in client.list_artifacts(newest_parent.info.run_id)}
        assert {"attention_backends.md", "verdicts", "guide_figures.json", "figures"} <= names, names
        assert [a.path for a in client.list_artifacts(newest_parent.info.run_id, "verdicts")] == [
            "verdicts/attention_backends.csv"]
        assert any(k.startswith("verdicts.") for k in newest_parent.data.tags), newest_parent.data.tags
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == newest_parent.info.run_id]
        seq = children[0].data.params["seq_len"]
        assert seq.isdigit() and client.search_runs([exp.experiment_id], filter_string=f"params.seq_len = '{seq}'")
        keys = {k for c in children for k in c.data.metrics}
        assert keys and not any(k.startswith("nan.") or ".nan" in k for k in keys)
        # an unavailable backend's run has a status and no metrics: read a measured one
        measured = next(c for c in children if c.data.metrics)
        key = next(iter(measured.data.metrics))
        assert client.get_metric_history(measured.info.run_id, key)[0].timestamp > 0
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/#/experiments/{exp.experiment_id}/runs", timeout=60_000)
            # parent runs are listed newest first, each with its child runs folded under it
            page.get_by_text(newest_parent.info.run_name, exact=False).first.wait_for(timeout=60_000)
            page.get_by_text("matching runs").first.wait_for(timeout=30_000)
            shots = repo / "test-artifacts"
            shots.mkdir(exist_ok=True)
            page.screenshot(path=str(shots / "mlflow_ui_attention_backends.png"), full_page=True)
            body = page.inner_text("body")
            browser.close()
        assert "attention_backends" in body and newest_parent.info.run_name in body
    finally:
        server.terminate()
        server.wait(timeout=30)
