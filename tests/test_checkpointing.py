"""The checkpointing study (G4-T3, G4-T1's checkpointing line) on the CPU at toy size: every granularity's
step memory, forward memory, estimate and side-by-side step time are rows; full checkpointing keeps less of
the forward; the report's verdicts read the guide's rows by model size."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest

from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
TOY = {"models": ["hydra_small"], "batch": 2, "seq_len": 32,
       "side_by_side": {"budget_ms": 1, "min_rounds": 3, "max_rounds": 3}}


def _params(update=None):
    raw = copy.deepcopy(load_raw(PARAMS))
    # PyTorch's MLP and norm: the zoo's kernels run interpreted under the tests' TRITON_INTERPRET
    raw["models"]["hydra_small"].update({"dim": 128, "n_layers": 4, "vocab_size": 128, "mlp": "gelu",
                                         "norm": "layernorm"})
    raw["G4-T3"]["cpu"].update({**TOY, **(update or {})})
    return validate(raw)


def test_every_granularity_is_measured_and_the_report_judges_by_size(tmp_path):
    from adaattn_experiments.checkpointing.study import STUDY
    from adaattn_experiments.checkpointing.report import render

    params = _params()
    study = STUDY.bind("cpu")
    assert study.cases(params, params.targets["cpu"]) == []
    rows = study.extra_rows(params, params.targets["cpu"])
    df = pd.DataFrame([{**r, "target": "cpu", "hardware": "test cpu"} for r in rows])
    assert (df.status == "ok").all(), df[df.status != "ok"]
    grans = ["none", "full", "selective", "every_k"]
    for metric in ("step_peak_mem_mb", "fwd_peak_mem_mb", "estimated_mem_mb", "step_side_by_side_ms"):
        assert list(df[df.metric == metric].provider) == grans, metric
    fwd = df[df.metric == "fwd_peak_mem_mb"].set_index("provider").value
    assert fwd["full"] < fwd["none"] and fwd["every_k"] < fwd["none"]
    t3, t1 = render(df, tmp_path)
    assert "every_k" in t3.markdown and (tmp_path / "g4_t3_memory_cpu.png").exists()
    assert {v.verdict for v in t3.verdicts} == {"not measurable here"}  # the estimate's goal is a GPU's
    assert len(t3.verdicts) == 4 and len(t1.verdicts) == 1  # no guide row near a toy model's size
    # a model of about 100M parameters on a GPU target is judged against the guide's 100M row
    gpu = df.assign(target="h100", hardware="test gpu")
    gpu.loc[gpu.metric == "params_m", "value"] = 104.0
    t3, _ = render(gpu, tmp_path)
    (row,) = [v for v in t3.verdicts if v.claim.startswith("100M")]
    assert "4.2 GB without, 2.5 GB with" in row.guide
    assert row.verdict in {"holds", "better than claimed", "worse than claimed"}


@pytest.mark.parametrize("update, message", [
    ({"granularities": ["full", "none"]}, "granularities start with 'none'"),
    ({"models": ["hydra_2b"]}, "G4-T3.cpu.models: 'hydra_2b' is not a preset of models"),
    ({"seq_len": 4096}, "G4-T3.cpu.seq_len=4096 is over models.hydra_small.max_seq_len"),
])
def test_bad_sweeps_name_the_key(update, message):
    with pytest.raises(ConfigError) as err:
        _params(update)
    assert message in str(err.value)
