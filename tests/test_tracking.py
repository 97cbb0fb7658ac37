"""MLflow logging: idempotent, a re-measured target replaces its runs, provenance and table ids as tags."""

import shutil

import pandas as pd
import pytest

from adaattn.tracking.mlflow_log import KEY_TAG, log_results_file

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
