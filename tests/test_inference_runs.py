"""The inference study's runs beside its sweep (G3-T3.<profile>.ltm, .field, .floor) on the CPU at toy size:
the LTM preset's decode, the field's model through the README's path, the step's floor, a failed run as a row
that says why, the budget they start under; bad keys name themselves."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import torch

from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
pytestmark = pytest.mark.usefixtures("pytorch_kernels")  # RoPE and norms by PyTorch: no interpreted Triton
TOY = {"model": "dense_small", "batches": [1], "prompt_len": 8, "new_tokens": 4, "dtype": "fp32", "configs": ["flash"],
       "int4_group_size": 32, "side_by_side": {"budget_ms": 1, "min_rounds": 3, "max_rounds": 3}}


def _eager_compile(monkeypatch) -> list:
    """torch.compile on the eager backend; the list of (mode, keywords) of its calls."""
    compile_, modes = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **k: modes.append((mode, k)) or
                        compile_(fn, backend="eager"))
    return modes


LTM = {"model": "ltm_tiny", "prompt_len": 10, "new_tokens": 12}  # decode positions 10..20: a segment ends at 16


def _ltm_params():
    raw = copy.deepcopy(load_raw(PARAMS))
    raw["models"]["ltm_tiny"] = {**raw["models"]["ltm_small"], "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1,
                                 "vocab_size": 64, "mlp": "gelu", "norm": "layernorm", "segment_len": 8,
                                 "memory_slots": 4, "memory_compression": 4}
    raw["models"]["dense_small"].update({"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64, "mlp": "gelu",
                                         "norm": "layernorm"})
    raw["G3-T3"]["cpu"] = {**TOY, "batches": [1], "configs": ["flash"], "ltm": LTM}
    return validate(raw)


def test_the_ltm_preset_decodes_eager_and_compiled_over_a_segment_end(monkeypatch, tmp_path):
    """Issue 66's LTM rows: generate's time a token with the step eager and compiled (CUDA graphs' mode), the same
    greedy tokens, and the compiled step's graphs few whatever the position and the bank's size."""
    from adaattn_experiments.inference.report import ltm_table
    from adaattn_experiments.inference.study import STUDY

    modes = _eager_compile(monkeypatch)
    params = _ltm_params()
    df = pd.DataFrame(STUDY.bind("cpu").extra_rows(params, params.targets["cpu"]))
    ltm = df[df.phase == "ltm"]
    assert (ltm.status == "ok").all(), ltm[ltm.status != "ok"]
    at = ltm.set_index(["metric", "provider"])["value"]
    assert at["generate_ms_per_token", "ltm_eager"] > 0 and at["generate_ms_per_token", "ltm_compiled"] > 0
    assert at["tokens_agree", "ltm_compiled"] == 1.0  # fp32, the same ops: the same greedy tokens
    # the step, and what follows the host's part of it: a bounded few, not one a position or bank size
    assert 1 <= at["graphs", "ltm_compiled"] <= 3
    assert ("reduce-overhead", {}) in modes  # CUDA graphs' mode, not fullgraph (the bank's write breaks it)
    assert "| ltm_tiny" in ltm_table(df.assign(target="cpu"))


@pytest.mark.parametrize("update, message", [
    ({"model": "dense_small"}, "G3-T3.cpu.ltm.model 'dense_small' is not an LTM preset (no memory_slots)"),
    ({"prompt_len": 18, "new_tokens": 4}, "G3-T3.cpu.ltm: no segment ends among the decode steps"),
])
def test_bad_ltm_keys_are_named(update, message):
    raw = copy.deepcopy(load_raw(PARAMS))
    raw["models"]["ltm_tiny"] = {**raw["models"]["ltm_small"], "segment_len": 16, "memory_slots": 8}
    raw["G3-T3"]["cpu"] = {**TOY, "ltm": {**LTM, **update}}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(raw)


def test_ltm_rows_that_fail_are_a_row_that_says_why_and_keep_the_rest(monkeypatch):
    from adaattn_experiments.inference import study as inference

    def fail(self, params, sweep):
        raise RuntimeError("cudagraphs went wrong")

    monkeypatch.setattr(inference.Inference, "_ltm_rows", fail)
    params = _ltm_params()
    df = pd.DataFrame(inference.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"]))
    ltm = df[df.phase == "ltm"]
    assert len(ltm) == 1 and ltm.status.iloc[0] == "error" and "cudagraphs went wrong" in ltm.reason.iloc[0]
    assert (df[(df.phase == "decode") & (df.metric == "side_by_side_ms")].status == "ok").all()


FIELD = {"model": "field_tiny", "prompt_len": 6, "new_tokens": 5}


def _field_params(update=None, published=None, sweep=None):
    raw = copy.deepcopy(load_raw(PARAMS))
    raw["models"]["field_tiny"] = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 64,
                                   "mlp": "gelu", "norm": "layernorm", "tie_embeddings": True, "max_seq_len": 64}
    raw["models"]["dense_small"].update({"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64, "mlp": "gelu",
                                         "norm": "layernorm"})
    raw["G3-T3"]["cpu"] = {**TOY, "batches": [1], "configs": ["flash"], "field": {**FIELD, **(update or {})},
                           **(sweep or {})}
    if published is not None:
        raw["G3-T3"]["field_published"] = published
    return validate(raw)


def test_the_field_model_decodes_through_the_readme_path(monkeypatch):
    """Issue 66 like for like: the field's model at batch 1, generate's time a token with the compiled config's
    step (GraphedStep: fullgraph, no CUDA graphs of inductor's), the bytes a step reads on average, a trace row
    that says why not on a CPU; beside the published figures of a GPU of the same name, quoted."""
    from adaattn.models.generate import setup_kv_cache
    from adaattn.models.transformer import build_model
    from adaattn_experiments.inference.report import field_table
    from adaattn_experiments.inference.schema import FieldPublished
    from adaattn_experiments.inference.study import STUDY, cache_bytes, weight_bytes

    modes = _eager_compile(monkeypatch)
    params = _field_params()
    df = pd.DataFrame(STUDY.bind("cpu").extra_rows(params, params.targets["cpu"]))
    field = df[df.phase == "field"]
    assert set(field.provider) == {"compiled"} and set(field.model) == {"field_tiny"}
    at = field.set_index("metric")
    assert at.loc["generate_ms_per_token", "status"] == "ok" and at.loc["generate_ms_per_token", "value"] > 0
    assert ("default", {"fullgraph": True}) in modes  # the README's step, GraphedStep's compile
    model = build_model(params.models["field_tiny"])
    P, N = FIELD["prompt_len"], FIELD["new_tokens"]
    setup_kv_cache(model, 1, P + N)
    # the tied head read once, and the cache's filled positions over the steps, P + 1 .. P + N - 1: their mean
    assert at.loc["decode_bytes_needed", "value"] == pytest.approx(
        weight_bytes(model) + cache_bytes(model) * (P + N / 2) / (P + N))
    assert at.loc["kernels_per_step", "status"] == "unavailable"
    published = FieldPublished(source="a RESULTS.md", model="field_tiny",
                               step_us={"H200": {"cuda_graphs_pdl": 800.0}})
    ms = at.loc["generate_ms_per_token", "value"]
    cpu = field_table(df.assign(target="cpu", hardware="AMD EPYC"), pd.Series({"cpu": 40.0}), published)
    assert "| field_tiny" in cpu and "none published for" in cpu and "Published: a RESULTS.md" in cpu
    gpu = field_table(df.assign(target="h200", hardware="NVIDIA H200"), pd.Series({"h200": 4000.0}), published)
    assert f"cuda_graphs_pdl 800 ({800 / (ms * 1e3):.3f})" in gpu
    other = FieldPublished(source="s", model="another_model", step_us={"H200": {"x": 1.0}})
    assert "none published for NVIDIA H200" in field_table(df.assign(target="h200", hardware="NVIDIA H200"),
                                                            pd.Series({"h200": 4000.0}), other)


def test_the_results_hash_covers_every_model_the_sweep_runs():
    from adaattn_experiments.inference.study import STUDY

    raw = copy.deepcopy(load_raw(PARAMS))
    raw["G3-T3"]["cpu"] = {**TOY, "quality": {**raw["G3-T3"]["cpu"]["quality"], "model": "dense_100m"},
                           "field": {**FIELD, "model": "llama_1b"}}
    keys = STUDY.param_keys(raw, "cpu")
    assert {"models.dense_small", "models.dense_100m", "models.llama_1b"} <= set(keys)


@pytest.mark.parametrize("update, published, message", [
    ({"model": "nope"}, None, "G3-T3.cpu.field.models: 'nope' is not a preset of models"),
    ({"prompt_len": 60, "new_tokens": 8}, None, "G3-T3.cpu.field.seq_len=68 is over models.field_tiny.max_seq_len"),
    ({"new_tokens": 3}, None, "G3-T3.cpu.field.new_tokens"),
    (None, {"source": "s", "model": "nope", "step_us": {}}, "G3-T3.field_published.model 'nope' is not a preset"),
])
def test_bad_field_keys_are_named(update, published, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _field_params(update, published)


@pytest.mark.parametrize("phase", ["field", "floor"])
def test_field_and_floor_rows_that_fail_are_a_row_that_says_why_and_keep_the_rest(phase, monkeypatch):
    from adaattn_experiments.inference import study as inference

    def fail(self, params, sweep):
        raise RuntimeError(f"out of memory on the {phase}'s model")

    monkeypatch.setattr(inference.Inference, f"_{phase}_rows", fail)
    params = _field_params(sweep={"floor": FLOOR})
    df = pd.DataFrame(inference.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"]))
    rows = df[df.phase == phase]
    assert len(rows) == 1 and rows.status.iloc[0] != "ok" and "out of memory" in rows.reason.iloc[0]
    assert (df[(df.phase == "decode") & (df.metric == "side_by_side_ms")].status == "ok").all()


FLOOR = {"dim": 32, "n_heads": 1, "n_kv_heads": 1, "mlp_hidden": 32, "vocab_size": 32}


def test_the_runs_after_the_sweep_start_only_while_the_budget_lasts(monkeypatch):
    """budget_s: the LTM, field and floor runs each guessed at the longest run after the sweep so far; one that
    would end past the budget is a row that says why, and the rest of the file is kept (a device call's kill would
    keep nothing)."""
    from adaattn_experiments.inference import study as inference

    clock, ran = [0.0], []

    def run_of(phase, seconds):
        def rows(self, params, sweep):
            ran.append(phase)
            clock[0] += seconds
            return [{"phase": phase, "metric": "generate_ms_per_token", "value": 1.0, "status": "ok"}]
        return rows

    monkeypatch.setattr(inference.Inference, "_batch_rows", lambda self, *a: [])
    monkeypatch.setattr(inference.Inference, "_field_rows", run_of("field", 10))
    monkeypatch.setattr(inference.Inference, "_floor_rows", run_of("floor", 30))
    monkeypatch.setattr(inference.Inference, "_ltm_rows", run_of("ltm", 10))
    monkeypatch.setattr(inference.time, "monotonic", lambda: clock[0])
    raw = copy.deepcopy(load_raw(PARAMS))
    raw["models"]["ltm_tiny"] = {**raw["models"]["ltm_small"], "segment_len": 8}  # never built: its run is faked
    raw["models"]["field_tiny"] = raw["models"]["dense_small"]
    raw["G3-T3"]["cpu"] = {**TOY, "batches": [1], "configs": ["flash"], "ltm": LTM, "field": FIELD, "floor": FLOOR,
                           "budget_s": 55}
    params = validate(raw)
    rows = inference.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    # the field (no guess) ends at 10, the floor (guessed 10) at 40; the LTM run, guessed at the floor's 30, would
    # end at 70
    assert ran == ["field", "floor"]
    (ltm,) = [r for r in rows if r["phase"] == "ltm"]
    assert ltm["status"] == "unavailable" and ltm["provider"] == "ltm_compiled" and ltm["reason"] == (
        "the ltm run not run: its 30 s (the longest run so far) past G3-T3.cpu.budget_s=55 at 40 s")
    del raw["G3-T3"]["cpu"]["budget_s"]
    params = validate(raw)
    ran.clear()
    inference.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    assert ran == ["field", "floor", "ltm"]  # no budget: every run


def test_the_floor_is_the_sweeps_model_narrow_against_its_own_generate(monkeypatch):
    """Issue 66's floor: the sweep's model at the floor's widths (its layers), generate's time a token with the
    compiled step, against the sweep's own batch-1 generate row; the bytes past the floor over the time past it."""
    from adaattn.models.config import ModelConfig
    from adaattn.models.generate import setup_kv_cache
    from adaattn.models.transformer import build_model
    from adaattn_experiments.inference.report import floor_table
    from adaattn_experiments.inference.study import STUDY, cache_bytes, weight_bytes

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **k: compile_(fn, backend="eager"))
    params = _field_params(sweep={"configs": ["compiled"], "floor": FLOOR, "field": None})
    df = pd.DataFrame(STUDY.bind("cpu").extra_rows(params, params.targets["cpu"]))
    floor = df[df.phase == "floor"].set_index("metric")
    assert set(df[df.phase == "floor"].model) == {"dense_small"} and floor.loc["generate_ms_per_token", "value"] > 0
    cfg = ModelConfig(**{**params.models["dense_small"].model_dump(), **FLOOR})
    assert cfg.n_layers == params.models["dense_small"].n_layers  # the same layers, so the same kernels
    model = build_model(cfg)
    P, N = TOY["prompt_len"], TOY["new_tokens"]
    setup_kv_cache(model, 1, P + N)
    assert floor.loc["decode_bytes_needed", "value"] == pytest.approx(
        weight_bytes(model) + cache_bytes(model) * (P + N / 2) / (P + N))
    table = floor_table(df.assign(target="cpu", hardware="AMD EPYC"), pd.Series({"cpu": 40.0}))
    at = df.set_index(["batch", "phase", "metric", "provider"])["value"]
    share = at[1, "floor", "generate_ms_per_token", "compiled"] / at[1, "generate", "generate_ms_per_token",
                                                                     "compiled"]
    assert "| dense_small" in table and f"{share:.3g}" in table
    assert floor_table(df[df.phase != "floor"].assign(target="cpu"), pd.Series({"cpu": 40.0})) == \
        "no floor run (G3-T3.<profile>.floor)"


@pytest.mark.parametrize("floor, message", [
    ({"dim": 48}, "G3-T3.cpu.floor: dim / n_heads = 48: the fused step takes a power of two head dim"),
    ({"n_heads": 3}, "G3-T3.cpu.floor: models.dense_small at these widths is no model"),
])
def test_bad_floor_widths_are_named(floor, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _field_params(sweep={"floor": {**FLOOR, **floor}})
