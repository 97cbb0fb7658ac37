import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (correctness only, never speed). It is
# read when a kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


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
    """A ``Clock`` that the side-by-side rounds (``adaattn.bench.rounds``, which the kernel manager and the
    studies share) read instead of the host's."""
    import adaattn.bench.rounds as rounds

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
