"""The kernels study's workloads on the CPU: every provider that runs here, in every mode."""

import pandas as pd
import pytest

from adaattn.bench.harness import Harness
from adaattn.bench.roofline import Ceilings
from adaattn.bench.timing import CpuTimer
from adaattn_experiments.kernels import STUDY, Kernels


class _Section:  # the fields of a G4-T1 section that Kernels._case reads
    head_dim, gqa = 64, 2

    def __init__(self, providers, modes):
        self.providers, self.modes = providers, modes


@pytest.mark.parametrize("kernel", ["rms_norm", "swiglu", "rope", "qk_norm_rope"])
def test_compile_provider_runs_every_mode(kernel):
    """Including ``bwd``: backward repeated through one retained graph (donated buffers off)."""
    case = Kernels._case("G4-T1", kernel, 1, 48, 128, "fp32", _Section(("eager", "compile"), ("fwd", "bwd", "fwd_bwd")))
    h = Harness("cpu", CpuTimer(1, 2), Ceilings(10.0, 1.0, "fp32", 64))
    rows = pd.DataFrame(h.run(STUDY.bind("cpu"), [case]))
    t = rows[rows.metric == "time_ms"].set_index(["provider", "mode"])
    assert (t["status"] == "ok").all(), t[t.status != "ok"][["status", "reason"]].to_string()
    assert len(t) == 6
    fwd = rows[(rows["mode"] == "fwd") & (rows.metric == "rel_l2")].set_index("provider")["value"]
    assert fwd["compile"] < 1e-5 and fwd["eager"] < 1e-5
    gbps = rows[rows.metric == "gbps"]
    assert len(gbps) == 6 and (gbps.value > 0).all()
