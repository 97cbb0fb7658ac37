"""``dvc.yaml``, written from the registry (``adaattn stages``): nothing in it is typed by hand.

One measuring stage per study and hardware target (DVC's ``foreach`` over ``study_targets.<study>``: stages
``<study>@<target>``). Its deps are the files of the code its study's measurements run, found by following
imports (``codegraph``: its folder but the report, the library and pipeline modules they reach), and the data
files it reads; its params are the dotted keys its results' params hash covers (``StudyDef.param_keys``, the
target's own profile as ``${item}``). Its output is the results file, tracked in git (``cache: false``: a
timing is never restored from DVC's run cache) and replaced only when a run finishes (``persist``). Then the
model cards, the report (every results file, all of params.yaml, and all the code: a result's staleness is read
against today's code) and the MLflow sync.

``tests/test_stages.py`` fails when the committed ``dvc.yaml`` differs from what this writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from adaattn_pipeline import codegraph, registry

HEADER = """\
# Written by `adaattn stages` from the studies in experiments/ and params.yaml: do not edit by hand.
# One measuring stage per (study, hardware target): results/<study>/<target>.csv is tracked in git
# (cache: false: a stale timing is never restored from DVC's run cache; persist: the committed file
# stays until a run finishes and replaces it). Each stage's deps are the files its study's code
# reaches through imports, so a change to any of them makes exactly the stages that run it stale.
"""
CARD = "adaattn_pipeline.cards"  # what `adaattn card` runs
LOG = "adaattn_pipeline.tracking.mlflow_log"


def _item_keys(study: Any, raw: dict, targets: Mapping[str, str]) -> list[str]:
    """The study's params keys over its targets, the target as ``${key}`` and its own profile as ``${item}``."""
    keys: list[str] = []
    for target, profile in targets.items():
        for key in study.param_keys(raw, target):
            if key == f"targets.{target}":
                key = "targets.${key}"
            elif key.endswith(f".{profile}") and not key.startswith("models."):
                key = key[: -len(profile)] + "${item}"
            keys.append(key)
    return list(dict.fromkeys(keys))


def _out(path: str) -> dict:
    return {path: {"cache": False, "persist": True}}


def study_stage(name: str, study: Any, raw: dict) -> dict:
    targets = raw.get("study_targets", {}).get(name, {})
    return {"foreach": f"${{study_targets.{name}}}",
            "do": {"cmd": f"adaattn run {name} --target ${{key}}",
                   "deps": [*codegraph.study_files(name), *study.data_deps],
                   "params": _item_keys(study, raw, targets),
                   "outs": [_out(f"results/{name}/${{key}}.csv")]}}


def pipeline(raw: dict) -> dict:
    """The whole ``dvc.yaml`` as a mapping."""
    studies = registry.studies()
    stages: dict[str, Any] = {}
    for name in studies:
        study = studies[name]
        for extra, spec in study.extra_stages(raw).items():
            stages[extra] = {"cmd": spec["cmd"], "deps": codegraph.files(codegraph.reached(spec["modules"])),
                             "params": list(spec["params"]), "outs": [_out(o) for o in spec["outs"]]}
        if raw.get("study_targets", {}).get(name):
            stages[name] = study_stage(name, study, raw)
    stages["models"] = {"foreach": "${models}",
                        "do": {"cmd": "adaattn card ${key}", "deps": codegraph.files(codegraph.reached([CARD])),
                               "params": ["models.${key}"], "outs": [_out("models/${key}.json")]}}
    stages["report"] = {
        "cmd": "adaattn report",
        "deps": ["results", "src", "experiments"],
        "params": [{"params.yaml": None}],
        "outs": [{"reports": {"cache": False, "persist": True}}, {"metrics/verdicts.json": {"cache": False}}],
        # `dvc metrics show` / `dvc metrics diff`: claims per verdict (one narrow row); per table id in verdicts.json
        "metrics": [{"metrics/verdict_totals.json": {"cache": False}}],
    }
    stages["mlflow"] = {
        "cmd": "adaattn log",
        "deps": ["results", "reports", *codegraph.files(codegraph.reached([LOG]))],
        # untracked: a fresh clone has none, so `dvc repro` rebuilds the MLflow store
        "outs": [{"mlflow_sync.json": {"cache": False}}],
    }
    figures = sorted({p.parent.as_posix() for p in Path("reports").glob("*/*.png")})
    return {"stages": stages, "plots": figures}  # `dvc plots show`: every report figure


def render(raw: dict) -> str:
    """``dvc.yaml``'s text: the header, then the pipeline in YAML (block style, keys in the order built)."""
    body = yaml.safe_dump(pipeline(raw), sort_keys=False, width=120, default_flow_style=False)
    return HEADER + body.replace("params.yaml: null", "params.yaml:")


def write(raw: dict, path: Path = Path("dvc.yaml")) -> bool:
    """Write ``dvc.yaml``; whether it changed."""
    text = render(raw)
    if path.is_file() and path.read_text() == text:
        return False
    path.write_text(text)
    return True
