"""The code a measurement runs, found by following imports (grimp's graph of the three packages): a study's
measuring modules and every first-party module they reach, directly or not, with the packages' ``__init__``
files Python runs on the way. The stage generator lists these files as a stage's deps; the runner hashes them
into each result (``code_hash``), and the report compares that hash with today's: a result whose code changed
is stale.

Paths are relative to the repository root, from ``pyproject.toml``'s ``package-dir`` (one source for where
each package lives), and the bytes hashed are the files in the working directory: a copy of the repository
hashes its own files.
"""

from __future__ import annotations

import functools
import hashlib
import tomllib
from collections.abc import Iterable
from pathlib import Path

PACKAGES = ("adaattn", "adaattn_pipeline", "adaattn_experiments")
RUNNER = "adaattn_pipeline.bench.runner"  # what `adaattn run` executes around a study


@functools.cache
def graph():
    """Imports between first-party modules, those inside functions included (they run when called), those
    under ``if TYPE_CHECKING:`` left out (they never run)."""
    import grimp

    return grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=True,
                             cache_dir=None)


def package_dirs(root: Path = Path(".")) -> dict[str, str]:
    """Top-level package -> its folder, relative to the repository root (pyproject.toml's package-dir)."""
    with open(root / "pyproject.toml", "rb") as fh:
        dirs = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
    return {pkg: dirs[pkg] for pkg in PACKAGES}


def module_path(module: str, dirs: dict[str, str], root: Path = Path(".")) -> str:
    """A module's file, relative to the repository root: ``a.b`` -> ``<a's folder>/b.py`` or ``.../b/__init__.py``."""
    top, *rest = module.split(".")
    base = Path(dirs[top], *rest)
    return str(base / "__init__.py") if (root / base / "__init__.py").is_file() else str(base) + ".py"


def reached(roots: Iterable[str]) -> set[str]:
    """``roots`` and every first-party module they import, directly or not, with each one's parent packages
    (importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py``, and what those import)."""
    g = graph()
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += [i for i in g.find_modules_directly_imported_by(m) if i not in seen]
        parent = m.rpartition(".")[0]
        if parent:
            todo.append(parent)
    return seen


def study_roots(study: str) -> list[str]:
    """What runs when a study measures: the modules of its folder but its report, and the runner around it."""
    from adaattn_pipeline import registry

    own = [m for m in registry.modules(study) if m.rsplit(".", 1)[1] != "report"]
    return [*own, RUNNER]


def files(modules: Iterable[str], root: Path = Path(".")) -> list[str]:
    dirs = package_dirs(root)
    return sorted(module_path(m, dirs, root) for m in modules)


def study_files(study: str, root: Path = Path(".")) -> list[str]:
    """The files of the code a study's measurements run, sorted."""
    return files(reached(study_roots(study)), root)


def files_hash(paths: Iterable[str], root: Path = Path(".")) -> str:
    """sha256 over each file's path and bytes, in path order: identifies the code (and data) a result ran."""
    digest = hashlib.sha256()
    for rel in sorted(paths):
        path = root / rel
        digest.update(rel.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"<missing>") + b"\0")
    return digest.hexdigest()[:16]


def study_code_hash(study: str, data_deps: Iterable[str] = (), root: Path = Path(".")) -> str:
    """The hash a study's results record as ``code_hash``: its code's files and the data files it reads."""
    return files_hash([*study_files(study, root), *data_deps], root)
