"""The studies: every folder of ``experiments/`` that holds a ``study.py``, found when asked for (a new study is
a new folder and its params.yaml section; nothing else names it).

A study folder holds ``study.py`` (``STUDY``: what it measures), ``schema.py`` (``SECTIONS``: its params.yaml
sections, and an optional ``check(params)`` across sections), ``report.py`` (``render``) and ``report.md`` (its
prose). ``experiments/common/`` is what several studies share; it is not a study.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = "adaattn_experiments"  # experiments/, as pyproject.toml's package-dir maps it


def folder() -> Path:
    """experiments/: found, not imported (the pipeline sits below the studies and never imports them by name)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"no package {PACKAGE!r}: install the repository with `pip install -e .` (scripts/install.sh)")
    return Path(spec.submodule_search_locations[0])


@functools.cache
def study_names() -> tuple[str, ...]:
    """Every study's name (its folder's), sorted: the order stages, reports and MLflow list them in."""
    return tuple(sorted(p.name for p in folder().iterdir() if (p / "study.py").is_file()))


def module_name(study: str, part: str) -> str:
    """The import name of one of a study's modules: ``module_name("kernels", "report")``."""
    return f"{PACKAGE}.{study}.{part}"


def modules(study: str) -> list[str]:
    """The import names of every module in a study's folder."""
    return sorted(module_name(study, p.stem) for p in (folder() / study).glob("*.py") if p.stem != "__init__")


@functools.cache
def schema(study: str) -> ModuleType:
    return importlib.import_module(module_name(study, "schema"))


@functools.cache
def sections() -> dict[str, tuple[str, type]]:
    """params.yaml section id -> (the study that defines it, its schema). A section has one owner."""
    out: dict[str, tuple[str, type]] = {}
    for study in study_names():
        for sid, model in getattr(schema(study), "SECTIONS", {}).items():
            if sid in out:
                raise RuntimeError(f"section {sid!r} is defined by both {out[sid][0]!r} and {study!r}: a section "
                                   "has one study (experiments/<study>/schema.py SECTIONS)")
            out[sid] = (study, model)
    return out


def checks() -> list[Callable[[Any], None]]:
    """The studies' checks across sections (a preset a study names exists and fits, ...)."""
    return [c for study in study_names() if (c := getattr(schema(study), "check", None)) is not None]


class Studies(Mapping[str, Any]):
    """Name -> the study's ``STUDY``, each imported on first use (a command that runs one study imports one)."""

    def __init__(self, names: tuple[str, ...] | None = None):
        self._names = study_names() if names is None else names

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return _load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@functools.cache
def _load(name: str) -> Any:
    study = importlib.import_module(module_name(name, "study")).STUDY
    if study.name != name:
        raise RuntimeError(f"experiments/{name}/study.py defines a study named {study.name!r}: a study is named "
                           "after its folder")
    return study


def studies(names: tuple[str, ...] | None = None) -> Studies:
    return Studies(names)
