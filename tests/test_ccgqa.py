"""The CCGQA study (G4-C1's attention) on the CPU at toy size: each length's CCGQA and SDPA GQA training calls
are timed side by side with their peak memory and the paired ratio; the report's goal is a GPU's; bad sweeps
name their key."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest

from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
pytestmark = pytest.mark.usefixtures("pytorch_kernels")  # RoPE and norms by PyTorch: no interpreted Triton
TOY = {"models": ["hydra_small"], "seq_lens": [16, 32], "tokens": 64, "compile_modes": [], "dtype": "fp32",
       "side_by_side": {"budget_ms": 1, "min_rounds": 3, "max_rounds": 3}}


def _params(update=None):
    raw = copy.deepcopy(load_raw(PARAMS))
    raw["models"]["hydra_small"].update({"dim": 64, "n_heads": 2, "n_kv_heads": 1, "compression": 2})
    raw["G4-C1"]["cpu"].update({**TOY, **(update or {})})
    return validate(raw)


def test_each_length_is_timed_side_by_side_and_judged_on_a_gpu_only(tmp_path):
    from adaattn_experiments.ccgqa.study import STUDY, sdpa_twin
    from adaattn_experiments.ccgqa.report import render

    params = _params()
    cfg = params.models["hydra_small"]
    twin = sdpa_twin(cfg)
    assert (twin.attention, twin.n_heads, twin.kv_heads, twin.dim) == ("sdpa", cfg.n_heads, cfg.kv_heads, cfg.dim)
    study = STUDY.bind("cpu")
    rows = study.extra_rows(params, params.targets["cpu"])
    df = pd.DataFrame([{**r, "target": "cpu", "hardware": "test cpu"} for r in rows])
    assert (df.status == "ok").all(), df[df.status != "ok"]
    for S, B in ((16, 4), (32, 2)):
        at = df[df.seq_len == S]
        assert set(at.batch) == {B}
        assert sorted(at[at.metric == "side_by_side_ms"].provider) == ["ccgqa", "sdpa_gqa"]
        assert sorted(at[at.metric == "peak_mem_mb"].provider) == ["ccgqa", "sdpa_gqa"]
        (ratio,) = at[at.metric == "paired_ratio"].itertuples()
        assert ratio.provider == "sdpa_gqa" and ratio.value > 0
    (section,) = render(df, tmp_path)
    assert {v.verdict for v in section.verdicts} == {"not measurable here"} and len(section.verdicts) == 2
    assert "CCGQA / SDPA GQA" in section.markdown and (tmp_path / "g4_c1_ccgqa_cpu.png").exists()
    # on a GPU target the compiled pair is judged against the bound
    gpu = df.assign(target="h100", hardware="test gpu", cuda="13.0")
    (section,) = render(gpu, tmp_path)
    # three rounds give no 95% interval of the median: the goal cannot be decided
    assert [v.verdict for v in section.verdicts] == ["inconclusive"] * 2


@pytest.mark.parametrize("update, message", [
    ({"tokens": 48}, "tokens=48 must be a multiple of every seq_lens entry; got 32"),
    ({"compile_modes": ["default", "default"]}, "compile_modes must not repeat a mode"),
    ({"compile_modes": ["fast"]}, "compile_modes"),
    ({"models": ["hydra_2b"]}, "G4-C1.cpu.models: 'hydra_2b' is not a preset of models"),
    ({"models": ["dense_small"]}, "'dense_small' has attention 'sdpa'; the study compares 'ccgqa' presets"),
])
def test_bad_sweeps_name_the_key(update, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _params(update)


def test_each_compile_mode_is_a_pair_of_its_own_with_its_own_verdict(monkeypatch, tmp_path):
    import torch

    from adaattn_experiments.ccgqa.study import STUDY
    from adaattn_experiments.ccgqa.report import render

    compile_ = torch.compile
    modes = []
    # dynamo's own eager backend: the pairs' plumbing without inductor's minutes of CPU compilation
    monkeypatch.setattr(torch, "compile", lambda m, mode, dynamic: modes.append(mode) or
                        compile_(m, backend="eager", dynamic=dynamic))
    params = _params({"seq_lens": [32], "compile_modes": ["default", "reduce-overhead"]})
    rows = STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    df = pd.DataFrame([{**r, "target": "h100", "hardware": "test gpu", "cuda": "13.0"} for r in rows])
    assert sorted(set(modes)) == ["default", "reduce-overhead"]
    timed = df[df.metric == "side_by_side_ms"]
    assert list(timed.provider) == ["ccgqa", "sdpa_gqa", "ccgqa:default", "sdpa_gqa:default",
                                    "ccgqa:reduce-overhead", "sdpa_gqa:reduce-overhead"]
    assert sorted(df[df.metric == "paired_ratio"].provider) == ["sdpa_gqa", "sdpa_gqa:default",
                                                                "sdpa_gqa:reduce-overhead"]
    (section,) = render(df, tmp_path)
    assert "| reduce-overhead" in section.markdown and "| default" in section.markdown
    eager, default, reduce = section.verdicts
    assert default.reason.startswith("the goal's pair (verdicts.ccgqa_mode): ccgqa:default / sdpa_gqa:default")
    assert eager.reason.startswith("a pair beside the goal's: ccgqa / sdpa_gqa")
    assert reduce.claim.endswith(", reduce-overhead)")
