"""The memory-analysis study (G3-T1) on the CPU at toy size: each component over the variables it depends on,
with and without its optimisation; exponents fitted and judged; a swept width keeps the head dim; bad sweeps name
their key."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pandas as pd
import pytest

from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
pytestmark = pytest.mark.usefixtures("pytorch_kernels")  # RoPE and norms by PyTorch: no interpreted Triton
TOY = {"model": "ltm_small", "batch": 1, "seq_len": 32, "dtype": "fp32",
       "sweeps": {"batch": [1, 2], "seq_len": [32, 64], "memory_slots": [8, 16], "dim": [32, 64], "n_layers": [1, 2]}}


def _params(update=None):
    raw = copy.deepcopy(load_raw(PARAMS))
    # PyTorch's MLP and norm: the zoo's kernels run interpreted under the tests' TRITON_INTERPRET
    small = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 64, "mlp": "gelu",
             "norm": "layernorm"}
    raw["models"]["ltm_small"].update({**small, "segment_len": 16, "memory_slots": 8, "memory_compression": 4})
    for twin in ("ltm_small_dense", "ltm_small_window"):  # G3-T4's: the same model without its bank
        raw["models"][twin].update(small)
    raw["G3-T1"]["cpu"] = {**TOY, **(update or {})}
    return validate(raw)


def test_a_swept_width_keeps_the_head_dim_and_the_group():
    from adaattn_experiments.memory_analysis.study import variant

    cfg = _params().models["ltm_small"]
    wide = variant(cfg, "dim", 64)
    assert (wide.dim, wide.head_dim, wide.n_heads // wide.kv_heads) == (64, cfg.head_dim, cfg.n_heads // cfg.kv_heads)
    assert variant(cfg, "batch", 8) is cfg and variant(cfg, "n_layers", 5).n_layers == 5


def test_each_component_is_measured_over_its_variables_and_judged(tmp_path):
    from adaattn_experiments.memory_analysis.study import EXPONENTS, STUDY
    from adaattn_experiments.memory_analysis.report import exponent, render

    params = _params()
    rows = STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    df = pd.DataFrame([{**r, "target": "cpu", "hardware": "test cpu"} for r in rows])
    assert (df.status == "ok").all(), df[df.status != "ok"]
    for component, depends in EXPONENTS.items():
        mine = df[df.provider == component]
        assert set(mine.variable) == set(depends), component
        assert set(mine["mode"]) == ({"plain", "unoptimised"} if component == "memory_bank" else {"plain", "optimised"})
    bank = df[(df.provider == "memory_bank") & (df["mode"] == "plain") & (df.variable == "memory_slots")]
    # a full bank: slots x dim x layers x batch, in fp32
    assert list(bank.value * 2**20) == [8 * 32 * 2 * 1 * 4, 16 * 32 * 2 * 1 * 4]
    params_rows = df[(df.provider == "parameters") & (df.variable == "n_layers")].set_index(["x", "mode"])["value"]
    assert all(params_rows[(x, "optimised")] < params_rows[(x, "plain")] for x in (1, 2))
    attention = df[(df.provider == "attention") & (df.variable == "seq_len")].set_index(["mode", "x"])["value"]
    assert attention[("plain", 64)] / attention[("plain", 32)] > 2  # the math backend holds S x S scores
    (section,) = render(df, tmp_path)
    claims = {v.claim: v for v in section.verdicts}
    assert claims["memory_bank: O(memory_slots x dim), in memory_slots"].verdict == "holds"
    assert len(claims) == sum(len(d) for d in EXPONENTS.values())
    assert (tmp_path / "g3_t1_memory_cpu.png").exists() and "fitted exponent" in section.markdown
    assert exponent(pd.DataFrame({"x": [1, 2, 4], "value": [3.0, 12.0, 48.0]})) == pytest.approx(2.0)
    assert math.isnan(exponent(pd.DataFrame({"x": [2, 2], "value": [1.0, 1.0]})))


@pytest.mark.parametrize("update, message", [
    ({"model": "dense_small"}, "G3-T1.cpu.model 'dense_small' has no memory bank"),
    ({"model": "ltm_9b"}, "G3-T1.cpu.models: 'ltm_9b' is not a preset of models"),
    ({"sweeps": {"batch": [2, 2]}}, "sweeps.batch needs two distinct values or more"),
    ({"sweeps": {"heads": [1, 2]}}, "sweeps"),
    ({"sweeps": {"seq_len": [32, 4096]}}, "G3-T1.cpu.seq_len=4096 is over models.ltm_small.max_seq_len"),
])
def test_bad_sweeps_name_the_key(update, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _params(update)
