"""A new study is one new folder of experiments/ plus its params.yaml section: on a copy of the repository, a toy
study's folder and section alone give it a stage in the dvc.yaml that `adaattn stages` writes, a run, and a report."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

SCHEMA = '''"""The toy study's section."""

from pydantic import PositiveInt

from adaattn_pipeline.config import ByProfile, Section


class ToyRun(Section):
    calls: PositiveInt


class ToySection(ByProfile):
    cpu: ToyRun
    gpu: ToyRun


SECTIONS = {"toy": ToySection}
'''

STUDY = '''"""The toy study: one row a call."""

from adaattn_experiments.toy.schema import ToyRun
from adaattn_pipeline.bench.study import StudyDef


class Toy(StudyDef):
    name = "toy"
    table_ids = ("toy",)
    sections = ("toy",)

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> "Toy":
        return Toy(device)

    def cases(self, params, target):
        return []

    def extra_rows(self, params, target):
        run: ToyRun = getattr(params.toy, target.profile)
        return [{"table_id": "toy", "case_id": f"toy/{i}", "provider": "toy", "mode": "", "metric": "calls",
                 "value": i, "unit": "calls", "status": "ok", "reason": "", "kernel": ""} for i in range(run.calls)]


STUDY = Toy()
'''

REPORT = '''"""The toy study's report."""

from adaattn_pipeline.report.common import Section, Verdict, prose


def render(df, out_dir):
    calls = int(df[df["metric"] == "calls"]["value"].count())
    return [Section("toy", "Toy", prose(__file__, "toy", calls=calls),
                    [Verdict("toy", "a toy counts its calls", "-", str(calls), "cpu", "by construction")])]
'''

PROSE = """<!-- toy -->
The toy study made {{ calls }} calls.
"""


def _run(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "adaattn_pipeline.cli", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_a_new_study_is_a_folder_and_its_params_section(tmp_path, repo):
    work = tmp_path / "repo"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, text=True, check=True).stdout
    for rel in (f for f in tracked.split("\0") if f and not f.startswith(("results/", "reports/"))):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, work / rel)
    folder = work / "experiments" / "toy"
    folder.mkdir()
    for name, text in {"__init__.py": "", "schema.py": SCHEMA, "study.py": STUDY, "report.py": REPORT,
                       "report.md": PROSE}.items():
        (folder / name).write_text(text)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["toy"] = {"cpu": {"calls": 3}, "gpu": {"calls": 3}}
    params["study_targets"]["toy"] = {"cpu": "cpu"}
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # the copy's experiments/ in place of the installed checkout's (PYTHONPATH comes before the editable install)
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "adaattn_experiments").symlink_to(work / "experiments")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "path"), "ADAATTN_DISABLE_TRITON": "1"}

    _run(["stages"], work, env)
    stage = yaml.safe_load((work / "dvc.yaml").read_text())["stages"]["toy"]
    assert stage["foreach"] == "${study_targets.toy}" and stage["do"]["params"] == [
        "targets.${key}", "bench.${item}", "toy.${item}"]
    assert "experiments/toy/study.py" in stage["do"]["deps"] and "experiments/toy/report.py" not in stage["do"]["deps"]

    _run(["run", "toy", "--target", "cpu"], work, env)
    _run(["report"], work, env)
    report = (work / "reports" / "toy.md").read_text()
    assert "The toy study made 3 calls." in report and "a toy counts its calls" in report
