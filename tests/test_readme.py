"""Every Python block of the README runs as written (on this CPU: each picks its CPU branch), each in a fresh
process in the repository root, as a reader would paste it."""

import os
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
    # as a reader runs it: without the tests' Triton interpreter (on a CPU the kernels' PyTorch references run)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", BLOCKS[i]], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, f"README block {i}:\n{BLOCKS[i]}\n{done.stderr[-3000:]}"
