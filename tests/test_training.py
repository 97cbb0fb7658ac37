"""The training study (G0-T1, G0-C1, G1-C1) on the CPU at toy size: every rung runs from the same weights, the
steps are timed side by side, the step's memory and model FLOPs are rows, G1-C1's pairs are timed side by side,
and the report renders."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import torch

from adaattn_pipeline.bench.harness import Harness
from adaattn_pipeline.bench.roofline import Ceilings
from adaattn.timing.timers import CpuTimer
from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
SMALL = {"batch": 1, "seq_len": 16, "rungs": ["fp32", "tf32", "sdpa", "ada", "checkpointing"],
         "compile_modes": [],
         "side_by_side": {"budget_ms": 1, "min_rounds": 6, "max_rounds": 6}}


def _params(profile_update=None, raw_update=None):
    raw = copy.deepcopy(load_raw(PARAMS))
    raw["models"]["g0_small"].update({"dim": 64, "n_layers": 2, "vocab_size": 128, "max_seq_len": 32})
    raw["G0-T1"]["cpu"].update({**SMALL, **(profile_update or {})})
    raw["G1-C1"]["cpu"].update({"gemm_n": 64, "batch": 1, "seq_len": 16, "dim": 32, "heads": 2,
                                "side_by_side": {"budget_ms": 1, "min_rounds": 6, "max_rounds": 6}})
    for key, value in (raw_update or {}).items():
        raw[key] = value
    return validate(raw)


def test_the_ladder_runs_every_rung_from_the_same_weights(tmp_path):
    from adaattn_experiments.training.study import STUDY
    from adaattn_experiments.training.report import render

    params = _params()
    study = STUDY.bind("cpu")
    cases = study.cases(params, params.targets["cpu"])
    h = Harness("cpu", CpuTimer(1, 2), Ceilings(10.0, 1.0, "fp32", 64), **study.harness_options(
        params, params.targets["cpu"]))
    # the same first loss on every rung that keeps fp32 numerics (naive vs SDPA vs AdaAttention attention)
    batch = study._inputs()
    losses = dict.fromkeys(("fp32", "sdpa", "ada"))
    with torch.no_grad():
        for r in losses:
            logits = study.trainer(r).forward(batch[0])
            losses[r] = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten()).item()
    assert losses["sdpa"] == pytest.approx(losses["fp32"], rel=1e-5)
    assert losses["ada"] == pytest.approx(losses["fp32"], rel=1e-5)
    rows = h.run(study, cases) + study.extra_rows(params, params.targets["cpu"])
    df = pd.DataFrame([{**r, "target": "cpu", "hardware": "test cpu"} for r in rows])
    t = df[df.metric == "time_ms"].set_index("provider")
    assert t.loc["tf32", "status"] == "unavailable" and (t.drop("tf32").status == "ok").all()
    steps = df[df.metric == "step_side_by_side_ms"]
    assert set(steps.provider) == {"fp32", "sdpa", "ada", "checkpointing"} and (steps.samples == 6).all()
    assert (df[df.metric == "step_peak_mem_mb"].value > 0).all() and (df[df.metric == "model_flops"].value > 0).all()
    t1, c1, g1 = render(df, tmp_path)
    assert "+checkpointing" in t1.markdown and {v.verdict for v in t1.verdicts} == {"not measurable here"}
    assert c1.verdicts == []  # no compile rung here; SDPA's op claim is attention_backends' (test_verdict_rules.py)
    # G1-C1: TF32 is a GPU's (a row that says so); nn.MultiheadAttention against SDPA, forward and training call
    pairs = df[(df.table_id == "G1-C1") & (df.metric == "side_by_side_ms")]
    assert pairs[pairs.provider == "tf32"].status.tolist() == ["unavailable"]
    assert sorted(pairs[pairs.status == "ok"].provider) == ["fp32", "mha", "mha", "sdpa", "sdpa"]
    assert sorted(df[(df.table_id == "G1-C1") & (df.metric == "paired_ratio")]["mode"]) == ["fwd", "fwd_bwd"]
    assert [v.claim for v in g1.verdicts] == ["TF32 makes fp32 GEMMs ~4x faster",
                                              "the default nn.MultiheadAttention is already optimised (fwd)",
                                              "the default nn.MultiheadAttention is already optimised (fwd_bwd)"]
    assert {v.verdict for v in g1.verdicts} == {"not measurable here"}


@pytest.mark.parametrize("update, message", [
    ({"rungs": ["sdpa", "fp32"]}, "rungs climb in this order"),
    ({"rungs": ["warp"]}, "rungs"),
    ({"model": "gpt5"}, "G0-T1.cpu.model 'gpt5' is not a preset of models"),
    ({"seq_len": 4096}, "is over models.g0_small.max_seq_len"),
])
def test_bad_ladders_name_the_key(update, message):
    with pytest.raises(ConfigError) as err:
        _params(update)
    assert message in str(err.value)


def test_each_compile_mode_is_timed_against_the_eager_rung(monkeypatch, tmp_path):
    """G0-C1's "each mode": the compile rung in each mode, side by side with the rung before it; the default mode is
    the ladder's own compile rung; the report judges each mode's gain (on a GPU)."""
    from adaattn_experiments.training.study import STUDY
    from adaattn_experiments.training.report import render

    from torch._dynamo.utils import counters

    from adaattn_experiments.training import study as training

    compile_ = torch.compile
    modes = []

    def compile_eager(model, mode=None, **kwargs):
        # dynamo's own eager backend: the plumbing without inductor's CPU compile time; each call counted as a graph
        # inductor took from its cache
        modes.append(mode)
        compiled = compile_(model, backend="eager")
        compiled.register_forward_pre_hook(lambda *a: counters["inductor"].update(fxgraph_cache_hit=1))
        return compiled

    monkeypatch.setattr(torch, "compile", compile_eager)
    ticks = iter(range(1 << 20))
    monkeypatch.setattr(training, "_clock", lambda: float(next(ticks)))
    params = _params({"rungs": ["sdpa", "compile"], "compile_modes": ["default", "reduce-overhead"]},
                     {"G1-C1": None})
    study = STUDY.bind("cpu")
    (case,) = study.cases(params, params.targets["cpu"])
    rows = study.extra_rows(params, params.targets["cpu"])
    assert sorted(m for m in modes if m) == ["default", "reduce-overhead"]  # the default: the compile rung's
    df = pd.DataFrame([{**r, "target": "h100", "hardware": "test gpu", "cuda": "13.0"} for r in rows])
    group = df[df.table_id == "G0-C1"]
    assert set(group[group.metric == "side_by_side_ms"].provider) == {"eager", "compile:default",
                                                                      "compile:reduce-overhead"}
    assert sorted(group[group.metric == "paired_ratio"].provider) == ["compile:default", "compile:reduce-overhead"]
    assert set(group[group.metric == "cudagraph_skips"].provider) == {"compile:default", "compile:reduce-overhead"}
    # each mode's first step (the clock reads once before it and once after) and the FX graph cache's count of it
    at = group[group.status == "ok"].set_index(["metric", "provider"])["value"]
    for mode in ("compile:default", "compile:reduce-overhead"):
        assert at["first_step_s", mode] == 1.0
        assert (at["fxgraph_cache_hits", mode], at["fxgraph_cache_misses", mode]) == (1, 0)
    assert "first_step_s" not in set(group[group.provider == "eager"].metric)
    assert next(ticks) == 2 * 3  # the first step of each rung built (sdpa, compile, compile:reduce-overhead) alone
    sections = render(df, tmp_path)
    c1 = next(s for s in sections if s.table_id == "G0-C1")
    claims = [v.claim for v in c1.verdicts if "mode" in v.claim]
    assert claims == [f"torch.compile 10-30% more (whole training step, mode {m})" for m in ("default",
                                                                                            "reduce-overhead")]
    assert "| reduce-overhead" in c1.markdown
    assert "| 1 (1 of 1 graphs cached)" in c1.markdown
    # a guide mode the target did not run is a row that says so, never a silent gap
    row = next(line for line in c1.markdown.splitlines() if "| max-autotune " in line)
    assert "not measured: not in this target's compile_modes" in row


def test_compile_modes_need_the_compile_rung_and_one_before_it():
    for rungs in (["fp32", "sdpa"], ["compile", "ada"]):
        with pytest.raises(ConfigError, match="compile_modes needs the 'compile' rung and a rung before it"):
            _params({"rungs": rungs, "compile_modes": ["default"]})
    with pytest.raises(ConfigError, match="compile_modes must not repeat a mode"):
        _params({"rungs": ["sdpa", "compile"], "compile_modes": ["default", "default"]})
