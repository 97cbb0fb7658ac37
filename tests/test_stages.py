"""The pipeline's bookkeeping cannot drift: ``dvc.yaml`` is what ``adaattn stages`` writes from the registry, each
stage's deps are the files its study's imports reach, the committed pipeline is up to date, and touching a library
module makes exactly the stages that reach it stale in ``dvc status``."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from adaattn.params import load_raw
from adaattn_pipeline import codegraph, registry, stages

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_the_committed_dvc_yaml_is_what_the_command_writes(in_repo):
    assert (REPO / "dvc.yaml").read_text() == stages.render(load_raw(REPO / "params.yaml")), \
        "run `adaattn stages` and commit dvc.yaml"


def test_every_study_has_its_stage_and_its_deps_are_what_its_imports_reach(in_repo):
    raw = load_raw(REPO / "params.yaml")
    pipeline = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name in registry.study_names():
        if not raw["study_targets"].get(name):
            continue
        stage = pipeline[name]["do"]
        assert stage["cmd"] == f"adaattn run {name} --target ${{key}}"
        assert stage["deps"] == [*codegraph.study_files(name), *registry.studies()[name].data_deps]
        assert f"experiments/{name}/study.py" in stage["deps"] and f"experiments/{name}/report.py" not in stage["deps"]
    # a study's measurements never run the report or MLflow's code: rewording a report re-measures nothing
    for name in registry.study_names():
        assert not [f for f in codegraph.study_files(name) if "/report/" in f or "/tracking/" in f or "cli.py" in f]


def test_a_module_started_in_another_process_is_a_dep():
    """The distributed study's torchrun jobs run library modules by name in their own processes."""
    files = codegraph.study_files("distributed")
    for job in ("train", "decode", "allreduce"):
        assert f"src/adaattn/distributed/{job}.py" in files


def _tree_files(repo: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=repo,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f and (repo / f).is_file()]


def _status(cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    status = json.loads(out.stdout or "{}")
    # a clone has no MLflow store: its first `dvc repro` builds one (an untracked file), by design
    if status.get("mlflow") == [{"changed outs": {"mlflow_sync.json": "deleted"}}]:
        del status["mlflow"]
    return status


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("pipeline") / "repo"
    for rel in _tree_files(REPO):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dest, check=True)
    return dest


def test_the_committed_pipeline_is_up_to_date(copy):
    """What a fresh clone's `dvc repro` then has nothing to measure (a stale GPU result stays, marked stale)."""
    assert _status(copy) == {}, "run `dvc repro` (and `dvc commit` the GPU stages measured on their machine)"


def test_every_cpu_result_was_measured_by_todays_code_and_params(in_repo):
    """`dvc status` trusts dvc.lock, and `dvc commit` rewrites dvc.lock without measuring: a CPU result committed
    that way after a code change would look fresh to DVC while its report marks it stale. A CPU target can always
    be measured again here (`dvc repro -f <study>@cpu`), so none may be stale by the report's own rule."""
    from adaattn_pipeline.config import validate
    from adaattn_pipeline.report.render import stale_results

    raw = load_raw(REPO / "params.yaml")
    params = validate(raw)
    stale = {stage: why for stage, why in stale_results(registry.studies(), params, raw, REPO / "results").items()
             if (t := stage.split("@")[1]) in params.targets and params.targets[t].device == "cpu"}
    assert stale == {}, "measure them again: dvc repro -f " + " ".join(stale)


# quant: two studies reach it; pinv: almost every study, and the model cards
@pytest.mark.parametrize("module", ["src/adaattn/models/quant.py", "src/adaattn/kernels/pinv.py"])
def test_touching_a_library_module_stales_exactly_the_stages_that_reach_it(copy, module):
    raw = load_raw(copy / "params.yaml")
    path = copy / module
    before = path.read_bytes()
    try:
        path.write_bytes(before + b"\n# touched\n")
        changed = set(_status(copy))
    finally:
        path.write_bytes(before)
    reach = [s for s in registry.study_names() if module in codegraph.study_files(s, copy)]
    expected = {f"{s}@{t}" for s in reach for t in raw["study_targets"].get(s, {})} | {"report"}
    if module in codegraph.files(codegraph.reached([stages.CARD]), copy):
        expected |= {f"models@{m}" for m in raw["models"]}
    for s in registry.study_names():
        for name, spec in registry.studies()[s].extra_stages(raw).items():
            if module in codegraph.files(codegraph.reached(spec["modules"]), copy):
                expected.add(name)
    assert reach and changed == expected
    assert len(reach) < len(registry.study_names())  # not every stage: the deps are the imports'


def test_a_study_reads_the_sections_its_schema_defines():
    """What a study's stage lists under params (``StudyDef.sections``) is what its schema validates (``SECTIONS``)."""
    for name in registry.study_names():
        assert set(registry.studies()[name].sections) == set(registry.schema(name).SECTIONS), name


def test_params_yaml_is_in_the_form_dvc_writes_back(tmp_path):
    """`dvc exp run -S` rewrites params.yaml through Hydra (block lists; comments after a list dropped): the
    committed file is that form already, so an experiment changes only the lines it sets, every comment kept
    (`python scripts/params_form.py` puts a file in that form)."""
    from dvc.utils.hydra import apply_overrides

    copy = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", copy)
    apply_overrides(str(copy), ["verdicts.ccgqa_mode=default"])  # a value set to itself
    assert copy.read_text() == (REPO / "params.yaml").read_text()
    apply_overrides(str(copy), ["verdicts.goal_overhead=1.05"])
    changed = [(a, b) for a, b in zip((REPO / "params.yaml").read_text().splitlines(), copy.read_text().splitlines())
               if a != b]
    assert changed == [("  goal_overhead: 1.03           # G2-B: AdaAttention at most 3% slower than the fastest "
                        "backend called directly", "  goal_overhead: 1.05           # G2-B: AdaAttention at most 3% "
                        "slower than the fastest backend called directly")]


def test_stale_lists_each_result_that_casts_no_verdict_and_how_to_measure_it(in_repo, tmp_path):
    import pandas as pd
    from typer.testing import CliRunner

    from adaattn_pipeline.cli import build_app
    from adaattn_pipeline.config import param_values, params_hash

    raw = load_raw(REPO / "params.yaml")
    study = registry.studies()["cpu_baseline"]
    fresh = {"target": "cpu", "hardware": "CPU", "code_hash": codegraph.study_code_hash(study.name, study.data_deps),
             "params_hash": params_hash(param_values(raw, study.param_keys(raw, "cpu")))}
    (tmp_path / "cpu_baseline").mkdir()
    path = tmp_path / "cpu_baseline" / "cpu.csv"
    pd.DataFrame([fresh]).to_csv(path, index=False)
    run = CliRunner().invoke(build_app({"cpu_baseline": study}), ["stale", "--results", str(tmp_path), "--check"])
    assert run.exit_code == 0 and "no stale results" in run.output
    pd.DataFrame([{**fresh, "code_hash": "0" * 16}]).to_csv(path, index=False)  # measured by other code
    run = CliRunner().invoke(build_app({"cpu_baseline": study}), ["stale", "--results", str(tmp_path), "--check"])
    assert run.exit_code == 1, run.output
    assert "cpu_baseline@cpu" in run.output and "other code" in run.output
    assert "dvc repro -f cpu_baseline@cpu" in run.output


def test_a_hash_that_reads_as_a_number_is_compared_as_text(tmp_path, monkeypatch):
    """A params hash of digits around one "e" is a float (inf) to pandas: read as such, a fresh result was stale
    (distributed@h200x2, 2026-12-01)."""
    import pandas as pd

    from adaattn_pipeline.report.read import read_results
    from adaattn_pipeline.report import render

    raw = load_raw(REPO / "params.yaml")
    study = registry.studies()["cpu_baseline"]
    monkeypatch.setattr(render, "params_hash", lambda values: "721e50482777")
    (tmp_path / "cpu_baseline").mkdir()
    path = tmp_path / "cpu_baseline" / "cpu.csv"
    pd.DataFrame([{"target": "cpu", "hardware": "CPU", "params_hash": "721e50482777", "git_commit": "1e10",
                   "code_hash": codegraph.study_code_hash(study.name, study.data_deps)}]).to_csv(path, index=False)
    assert read_results(path).loc[0, ["params_hash", "git_commit"]].tolist() == ["721e50482777", "1e10"]
    from adaattn_pipeline.config import validate

    assert render.stale_results({"cpu_baseline": study}, validate(raw), raw, tmp_path) == {}
