"""The layout as contracts: the library imports nothing of the pipeline, every import goes down a layer
(``pyproject.toml`` ``[tool.importlinter]``), no module imports itself through others, studies never import each
other, no source file is over 500 lines, and the library runs without the pipeline's dependencies."""

import subprocess
import sys
from pathlib import Path

import pytest

from adaattn_pipeline import codegraph, registry

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def test_the_import_contracts_hold():
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(REPO / "pyproject.toml")) == 0, "run `lint-imports` to see what broke"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    g = codegraph.graph()
    edges = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
    assert _cycles(edges) == []
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the check finds one


def test_studies_never_import_each_other():
    g = codegraph.graph()
    names = registry.study_names()
    assert len(names) >= 10 and "common" not in names
    crossing = []
    for study in names:
        for m in registry.modules(study):
            crossing += [(m, i) for i in g.find_modules_directly_imported_by(m) if i.startswith(registry.PACKAGE + ".")
                         and i.split(".")[1] in names and i.split(".")[1] != study]
    assert crossing == [], "share code through the library or experiments/common"


@pytest.mark.parametrize("folder", ["src", "experiments", "tests"])
def test_no_source_file_over_500_lines(folder):
    long = {str(p.relative_to(REPO)): n for p in sorted((REPO / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_configs_generic_part_is_short():
    assert len((REPO / "src/adaattn_pipeline/config.py").read_text().splitlines()) < 300


def test_the_library_runs_without_the_pipelines_dependencies():
    """AdaAttention, the kernels, the models, generation and the distributed entry points import and run with none
    of dvc, mlflow, pandas, seaborn or matplotlib loaded (the pipeline extra)."""
    code = """
import sys, torch
from adaattn.attention.ada import AdaAttention
from adaattn.kernels import rms_norm
from adaattn.models.config import ModelConfig
from adaattn.models.transformer import build_model
from adaattn.models.generate import generate, setup_kv_cache
import adaattn.distributed.train, adaattn.distributed.decode, adaattn.models.serving
attn = AdaAttention(32, 4, batch_first=True)
attn(torch.randn(1, 8, 32), torch.randn(1, 8, 32), torch.randn(1, 8, 32))
rms_norm(torch.randn(2, 16), torch.ones(16))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in
                ("dvc", "mlflow", "pandas", "seaborn", "matplotlib", "adaattn_pipeline", "adaattn_experiments"))
print(loaded)
"""
    env = {"ADAATTN_DISABLE_TRITON": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
