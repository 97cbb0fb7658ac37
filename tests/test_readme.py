"""Every Python block of the README runs as written (on this CPU: each picks its CPU branch), each in a fresh
process in the repository root, as a reader would paste it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_the_readme_has_its_snippets():
    assert len(BLOCKS) >= 3  # AdaAttention and the kernels, a training step, generation


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_a_readme_block_runs_as_written(i):
    done = subprocess.run([sys.executable, "-c", BLOCKS[i]], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"README block {i}:\n{BLOCKS[i]}\n{done.stderr[-3000:]}"
