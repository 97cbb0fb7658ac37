"""The kernels study's workloads on the CPU: every provider that runs here, in every mode."""

import pandas as pd
import pytest

from adaattn_pipeline.bench.harness import Harness
from adaattn_pipeline.bench.roofline import Ceilings
from adaattn.timing.timers import CpuTimer
from adaattn_experiments.kernels.study import STUDY, Kernels


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


@pytest.mark.parametrize("kernel", ["rms_norm", "swiglu", "rope", "qk_norm_rope"])
def test_reference_covers_the_first_tokens(kernel, monkeypatch):
    """Past REF_TOKENS tokens the float64 reference is of the first ones only, and the output
    is cut to match (the largest sweep points ran out of memory in a full float64 copy)."""
    import torch

    from adaattn_experiments.kernels import study as K

    study = STUDY.bind("cpu")
    case = Kernels._case("G4-T1", kernel, 1, 48, 128, "fp32", _Section(("eager",), ("fwd",)))
    full = study.reference(case)
    monkeypatch.setattr(K, "REF_TOKENS", 20)
    part = study.reference(case)
    out = study.setup(case, "eager", requires_grad=False)
    sliced = out.to_reference_layout(out.fwd())
    for p, f, o in zip(*(t if isinstance(t, tuple) else (t,) for t in (part, full, sliced)), strict=True):
        assert p.shape[1] == 20 and o.shape == p.shape
        torch.testing.assert_close(p, f[:, :20])
        torch.testing.assert_close(o.double(), p, rtol=1e-5, atol=1e-5)


def test_compile_groups_are_segments_of_one_hidden_size():
    from pathlib import Path

    from adaattn_pipeline.config import load_params

    params, _ = load_params(Path(__file__).parents[1] / "params.yaml")
    study = Kernels("cuda")
    cases = study.cases(params, params.targets["h100"])
    groups = study.compile_groups(cases)
    assert [i for g in groups for i in g] == [(c, "compile", m) for c in cases for m in c.modes]
    keys = [{(c.config["op"], c.config["dtype"], c.config["hidden"]) for c, _, _ in g} for g in groups]
    assert all(len(k) == 1 for k in keys) and all(a != b for a, b in zip(keys, keys[1:]))
    assert {m for g in groups for _, _, m in g} == {"fwd", "bwd", "fwd_bwd"}  # every mode, in one segment


def test_ours_inplace_is_rope_forward_only_and_rotates_its_inputs():
    """ours_inplace is listed for RoPE only; on the study's leaf inputs its backward modes are an
    Unsupported row that says why; its forward rotates the workload's own q and k."""
    import torch

    from adaattn.errors import Unsupported
    from adaattn.kernels import get_kernel_status

    sec = _Section(("eager", "liger", "ours", "ours_inplace"), ("fwd", "fwd_bwd"))
    for kernel in ("rms_norm", "swiglu", "qk_norm_rope"):
        assert "ours_inplace" not in Kernels._case("G4-T1", kernel, 1, 48, 128, "fp32", sec).providers
    case = Kernels._case("G4-T1", "rope", 1, 48, 128, "fp32", sec)
    assert "ours_inplace" in case.providers
    assert "CUDA" in STUDY.bind("cpu").unavailable("ours_inplace", "cpu")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    study = STUDY.bind(device)
    with pytest.raises(Unsupported, match="leaves"):
        study.setup(case, "ours_inplace", requires_grad=True)
    if not get_kernel_status()["use_triton_kernels"] or device == "cpu" and not get_kernel_status()["interpreter"]:
        pytest.skip("the Triton kernels do not run here (set TRITON_INTERPRET=1 on a CPU)")
    w = study.setup(case, "ours_inplace", requires_grad=False)
    q, k = w.fwd()
    ref = study.reference(case)
    for got, want in zip(w.to_reference_layout((q, k)), ref, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert q.data_ptr() == w.fwd()[0].data_ptr()  # the same storage, rotated again


def test_goal_rows_for_each_of_our_providers():
    """The speed goal gets one row per provider of ours that ran: ours everywhere, ours_inplace on RoPE."""
    from adaattn_pipeline.report.common import knobs
    from adaattn_experiments.kernels.report import _goal_row

    GOAL_RATIO = knobs().kernel_peer_ratio

    frame = pd.DataFrame({"tokens": [2048, 8192], "hidden": [512, 512], "eager": [9.0, 30.0], "compile": [5.0, 12.0],
                          "liger": [4.0, 10.0], "ours": [4.4, 10.0], "ours_inplace": [4.0, 9.0]})
    row = _goal_row(frame, ["eager", "compile", "liger"], "ours", "kernel time (GPU)", "h100", "rope", "fwd")
    assert row["ours"] == "ours" and row[f"sizes below {GOAL_RATIO}"] == "1 of 2" and row["at (tokens, hidden)"] == "2048, 512"
    row = _goal_row(frame, ["eager", "compile", "liger"], "ours_inplace", "kernel time (GPU)", "h100", "rope", "fwd")
    assert row[f"sizes below {GOAL_RATIO}"] == "0 of 2"
