"""End to end: `dvc repro` on a CPU-only copy of the repository with small CPU params.

Asserts: only the CPU target is measured; the committed GPU results stay byte-identical; results,
MLflow runs (through the MLflow client) and figures exist; a second `dvc repro` does nothing.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

SMALL_CPU = {
    "G1-T2": {"batch": 1, "seq_len": 64, "d_model": 128, "heads": 4, "dtypes": ["fp32"], "modes": ["fwd", "fwd_bwd"],
              "providers": ["sdpa", "sdpa_math", "standard", "sdpa_cudnn"]},
    "G1-T1": {"tokens": 256, "seq_lens": [64, 128], "d_model": 128, "head_dims": [32], "causal": [False, True],
              "dtypes": ["fp32"], "modes": ["fwd", "fwd_bwd"], "providers": ["sdpa", "standard"]},
    "G4-T2": {"batch": 2, "seq_len": 32, "dim": 128, "head_dim": 64, "gqa": 1, "kernels": ["rms_norm", "rope"],
              "dtypes": ["fp32"], "modes": ["fwd"], "providers": ["eager", "ours"]},
    "G4-T1": {"tokens": [64], "hidden": {"rms_norm": [64], "swiglu": [64], "rope": [128], "qk_norm_rope": [128]},
              "head_dim": 64, "gqa": 2, "dtypes": ["fp32"], "modes": ["fwd", "fwd_bwd"], "providers": ["eager", "ours"],
              "rope_cache": {"layers": 24, "head_dim": 64, "max_seq_len": 256}},
}


# merged into the G2 sections' CPU profiles: bench.cpu changes, so every CPU stage runs again (suite time)
SMALL_G2_CPU = {
    "G2-T1": {"points": [[1, 32]], "embed_dim": 64, "heads": 4,
              "side_by_side": {"budget_ms": 200, "min_rounds": 6, "max_rounds": 20}},
    "G2-T3": {"seq_len": 32, "embed_dim": 64, "inputs": ["normal"], "modes": ["fwd"]},
    "G2-B": {"embed_dim": 64, "batch_sweep_seq_len": 32, "batches": [1], "seq_lens": [32], "modes": ["fwd"],
             "side_by_side": {"budget_ms": 200, "min_rounds": 6, "max_rounds": 20}},
    "G2-C1": {"seq_lens": [128], "ranks": [8, 16], "true_ranks": [8], "exact_providers": ["sdpa"],
              "cluster_layouts": ["contiguous"], "random_inputs": False},
}


def _tree_files(repo: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=repo,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f and (repo / f).is_file()]


def _copy_repo(repo: Path, dest: Path) -> None:
    for rel in _tree_files(repo):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, dest / rel)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dest, check=True)


def _dvc(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # the pipeline runs as a user runs it: without the tests' interpreter setting (TRITON_INTERPRET
    # would run the rank study's fused Nystrom kernels interpreted, minutes of CI time)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "TRITON_INTERPRET")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # a guard against a hang, not a speed goal: every CPU stage runs, ~15 min on a 2-core EPYC on a slow day
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1800)


def test_dvc_repro_on_cpu(repo, tmp_path):
    work = tmp_path / "repo"
    _copy_repo(repo, work)
    params = yaml.safe_load((work / "params.yaml").read_text())
    gpu_targets = [name for name in params["study_targets"]["attention_backends"]
                   if params["targets"][name]["device"] == "cuda"]
    committed = {t: (work / f"results/attention_backends/{t}.csv").read_bytes() for t in gpu_targets}
    kernels_gpu = {t: (work / f"results/kernels/{t}.csv").read_bytes() for t in params["study_targets"]["kernels"]
                   if t in gpu_targets}
    assert kernels_gpu, "the repository commits kernels results for at least one GPU target"
    assert committed, "the repository commits results for at least one GPU target"
    for section, small in SMALL_CPU.items():
        params[section]["cpu"] = small
    for section, small in SMALL_G2_CPU.items():
        params[section]["cpu"].update(small)
    params["bench"]["cpu"] = {"warmup": 1, "repeats": 2}
    params["G0-T1"]["cpu"].update({"model": "g0_small", "batch": 1, "seq_len": 32, "rungs": ["fp32", "sdpa"],
                                   "compile_modes": [],
                                   "side_by_side": {"budget_ms": 100, "min_rounds": 6, "max_rounds": 10}})
    params["G4-T3"]["cpu"].update({"batch": 1, "seq_len": 64,
                                   "side_by_side": {"budget_ms": 100, "min_rounds": 3, "max_rounds": 3}})
    params["train"]["cpu"].update({"batch": 2, "seq_len": 32, "steps": 4, "warmup": 1, "log_every": 2,
                                   "eval_every": 4, "eval_batches": 1})
    params["mfu"]["cpu"]["side_by_side"] = {"budget_ms": 100, "min_rounds": 3, "max_rounds": 3}
    params["G3-T3"]["cpu"].update({"batches": [1], "prompt_len": 16, "new_tokens": 4,
                                   "side_by_side": {"budget_ms": 100, "min_rounds": 3, "max_rounds": 3}})
    params["G3-T2"]["cpu"].update({"layouts": ["ddp"], "steps": 1, "warmup": 0, "seq_len": 32,
                                   "allreduce_mib": [0.25]})
    params["G3-T1"]["cpu"].update({"seq_len": 128, "sweeps": {"batch": [1, 2], "memory_slots": [16, 32]}})
    params["G3-T4"]["cpu"].update({"contexts": [64, 256], "eval_contexts": [64], "recall_distances": [48],
                                   "recall_trials": 2, "train": {**params["G3-T4"]["cpu"]["train"], "batch": 2,
                                                                 "seq_len": 128, "steps": 4, "warmup": 1,
                                                                 "log_every": 2, "eval_every": 4, "eval_batches": 1}})
    # the presets stay (the GPU targets' training results depend on them); one card is built again
    (work / "models/g0_small.json").unlink()
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    first = _dvc(["repro"], work)
    assert first.returncode == 0, first.stdout + first.stderr
    log = first.stdout + first.stderr
    assert "Running stage 'attention_backends@cpu'" in log
    for t in gpu_targets:
        assert f"Running stage 'attention_backends@{t}'" not in log
        assert (work / f"results/attention_backends/{t}.csv").read_bytes() == committed[t], f"{t} results changed"
    assert "Running stage 'kernels@cpu'" in log
    for t, blob in kernels_gpu.items():
        assert f"Running stage 'kernels@{t}'" not in log
        assert (work / f"results/kernels/{t}.csv").read_bytes() == blob, f"kernels {t} results changed"

    import json

    import pandas as pd

    assert "Running stage 'models@g0_small'" in log and "Running stage 'training@h100'" not in log
    assert "Running stage 'train@h100'" not in log and "Running stage 'mfu@cpu'" in log
    assert "Running stage 'memory_bank@cpu'" in log and "Running stage 'distributed@cpu'" in log
    assert "Running stage 'distributed@h100x2'" not in log
    assert "Running stage 'checkpointing@h100'" not in log and (work / "models/weights/cpu/dense_small.pt").is_file()
    for name in params["models"]:  # one card per preset (the committed ones, and the one built again)
        card = json.loads((work / f"models/{name}.json").read_text())
        assert card["params"]["total"] > 0 and abs(card["flops_per_token"]["counted_over_formula"] - 1) < 0.02

    cpu = pd.read_csv(work / "results/attention_backends/cpu.csv")
    assert set(cpu["seq_len"].dropna().astype(int)) == {64, 128}
    assert (cpu[cpu["provider"] == "sdpa_cudnn"]["status"] == "unavailable").all()
    assert (cpu[(cpu["provider"] == "sdpa") & (cpu["metric"] == "time_ms")]["status"] == "ok").all()
    assert (work / "reports/attention_backends/G1-T1_cpu_fp32.png").stat().st_size > 10_000
    assert "G1-T2" in (work / "reports/README.md").read_text()

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.get_experiment_by_name("attention_backends")
    runs = client.search_runs([exp.experiment_id], max_results=5000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(r.data.tags["target"] for r in parents) == sorted(["cpu", *gpu_targets])
    cpu_parent = next(r for r in parents if r.data.tags["target"] == "cpu")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == cpu_parent.info.run_id]
    assert len(children) == 1 * 4 + 4 * 2  # G1-T2: 1 shape x 4 providers; G1-T1: 4 shapes x 2 providers
    child = next(c for c in children if c.data.params["provider"] == "sdpa")
    assert child.data.metrics["fwd.time_ms"] > 0 and child.data.tags["table_id"] in {"G1-T1", "G1-T2"}
    assert child.data.tags["hardware"] == cpu_parent.data.tags["hardware"]
    artifacts = [a.path for a in client.list_artifacts(cpu_parent.info.run_id, "figures")]
    assert "figures/G1-T1_cpu_fp32.png" in artifacts

    second = _dvc(["repro"], work)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Running stage" not in second.stdout + second.stderr
    again = client.search_runs([exp.experiment_id], max_results=5000)
    assert len(again) == len(runs)  # re-running never duplicates runs

    # a timing is never restored from DVC's run cache: a deleted result is measured again
    (work / "results/attention_backends/cpu.csv").unlink()
    third = _dvc(["repro", "attention_backends@cpu"], work)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "Running stage 'attention_backends@cpu'" in third.stdout
    assert "run-cache" not in third.stdout + third.stderr
