import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (correctness only, never speed). It is
# read when a kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist each worker takes one core: two workers of two torch threads each on CI's two cores
# spend their time switching. Child processes (dvc stages, torchrun) inherit the setting.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 4 (each holds a torch process and its compiled graphs); none on a
    GPU machine, whose GPU tests tune kernels by timing them and must not share the GPU with another worker."""
    if torch.cuda.is_available():
        return 0
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.fixture
def repo() -> Path:
    return REPO


class Clock:
    """The host's clock as the timing code reads it (``time.perf_counter``), simulated: ``sleep`` moves it and
    each read moves it 1 ns (a real clock never reads the same twice around a call), so a test's calls take
    the time they say, whatever the machine's load (on CI's two cores real sleeps stretched enough to fail
    the tests that timed them)."""

    def __init__(self):
        self.s = 0.0

    def perf_counter(self) -> float:
        self.s += 1e-9
        return self.s

    def sleep(self, s: float) -> None:
        self.s += s


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """A ``Clock`` that the side-by-side rounds (``adaattn.timing.rounds``, which the kernel manager and the
    studies share) read instead of the host's."""
    import adaattn.timing.rounds as rounds

    c = Clock()
    monkeypatch.setattr(rounds, "time", c)
    return c


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def pytorch_kernels(monkeypatch):
    """The PyTorch references in place of the Triton kernels, in this process and the processes it starts: a study
    test at toy size then runs its model's RoPE and norms without Triton's interpreter (minutes of CI time a test;
    the kernels have tests of their own)."""
    from adaattn.kernels import runtime

    monkeypatch.setenv(runtime.ENV_DISABLE, "1")
    monkeypatch.setattr(runtime, "_use_triton", False)
