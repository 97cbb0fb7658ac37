"""The inference study (G3-T3) on the CPU at toy size: prefill and decode side by side per batch in each config,
the bytes a decode step reads, the report's goals and the guide's ratios; bad sweeps name their key."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import torch

from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
pytestmark = pytest.mark.usefixtures("pytorch_kernels")  # RoPE and norms by PyTorch: no interpreted Triton
TOY = {"model": "dense_small", "batches": [1, 2], "prompt_len": 8, "new_tokens": 4, "dtype": "fp32",
       "configs": ["base", "flash", "int8", "compiled", "compiled_plain", "compiled_int8", "compiled_int4", "no_cache"],
       "int4_group_size": 32,
       "side_by_side": {"budget_ms": 1, "min_rounds": 3, "max_rounds": 3}}


def _params(update=None):
    raw = copy.deepcopy(load_raw(PARAMS))
    # PyTorch's MLP and norm: the zoo's kernels run interpreted under the tests' TRITON_INTERPRET
    raw["models"]["dense_small"].update({"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64, "mlp": "gelu",
                                         "norm": "layernorm"})
    raw["G3-T3"]["cpu"] = {**TOY, **(update or {})}
    return validate(raw)


def test_the_bytes_a_decode_step_reads():
    from adaattn.models.transformer import build_model
    from adaattn.models.generate import setup_kv_cache
    from adaattn.models.quant import Int4WeightOnlyLinear, quantize_int8_weight_only, quantize_weight_only
    from adaattn_experiments.inference.study import cache_bytes, weight_bytes

    params = _params()
    for tie in (True, False):
        cfg = params.models["dense_small"].model_copy(update={"tie_embeddings": tie})
        model = build_model(cfg)
        table = cfg.vocab_size * cfg.dim * 4
        every = sum(p.numel() * 4 for p in model.parameters())  # a tied table counts once
        # the lookup's table is not read whole by a step; a tied head is
        assert weight_bytes(model) == (every if tie else every - table)
        setup_kv_cache(model, 3, 16)
        assert cache_bytes(model) == cfg.n_layers * 2 * 3 * cfg.kv_heads * 16 * cfg.head_dim * 4
        assert weight_bytes(model) == (every if tie else every - table)  # the caches are not weights
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "head"]
    weights, rows = sum(m.weight.numel() for m in linears), sum(m.out_features for m in linears)
    before = weight_bytes(model)
    quantize_int8_weight_only(model)
    assert weight_bytes(model) == before - 3 * weights + 4 * rows  # 4 bytes a weight become 1, and a scale a row
    int4 = quantize_weight_only(build_model(cfg.model_copy(update={"dim": 128})).to(torch.bfloat16), 4, 32)
    before = weight_bytes(int4)
    packed = [m.pack_tinygemm() for m in int4.modules() if isinstance(m, Int4WeightOnlyLinear) and m.tinygemm_fits()]
    assert packed and weight_bytes(int4) == before  # as on a GPU: the same weight again, read instead of ours


def test_each_batch_times_prefill_and_decode_side_by_side(monkeypatch, tmp_path):
    from adaattn_experiments.inference.study import STUDY
    from adaattn_experiments.inference.report import render

    compile_ = torch.compile
    modes, graphs = [], []

    def count(gm, example_inputs):  # the eager backend, each graph dynamo builds counted
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **k: modes.append(mode) or compile_(fn, backend=count))
    params = _params()
    rows = STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    df = pd.DataFrame(rows)
    # one graph a compiled decoder: the timed steps and generate's loop call it with tokens of the same layout
    assert len(graphs) == len(modes)
    kernels = df[df.metric.isin(["kernels_per_step", "kernel_gap_us"])]
    assert (df.drop(kernels.index).status == "ok").all(), df[df.status != "ok"]
    assert (kernels.status == "unavailable").all() and kernels.reason.str.contains("a CPU launches no").all()
    # the timed decode steps with CUDA graphs (reduce-overhead); generate's steps compiled without them (GraphedStep
    # captures its own graph on a GPU)
    assert modes and set(modes) == {"reduce-overhead", "default"}
    for B in (1, 2):
        at = df[df.batch == B]
        steps = at[at.metric == "side_by_side_ms"]
        assert set(steps[steps.phase == "prefill"].provider) == set(TOY["configs"]) - {"no_cache"}
        assert set(steps[steps.phase == "decode"].provider) == set(TOY["configs"])
        # the compiled decode is the pair's baseline: every other config's time ratio to it
        assert set(at[at.metric == "paired_ratio"].provider) == set(TOY["configs"]) - {"compiled"}
        read = at[at.metric == "decode_bytes"].set_index("provider")["value"]
        assert read["int8"] < read["flash"] and read["no_cache"] < read["flash"]
        # what a step must read: the cache's filled positions (prompt and the new token) of its 12
        need = at[at.metric == "decode_bytes_needed"].set_index("provider")["value"]
        cache = read["flash"] - read["no_cache"]
        assert need["flash"] == read["no_cache"] + cache * 9 // 12 and need["no_cache"] == read["no_cache"]
        assert (at[at.metric == "peak_mem_mb"].value > 0).all()
        assert need["compiled_int4"] < need["compiled_int8"] < need["compiled"] == need["compiled_plain"]
        # the README's loop a token, for every compiled config
        loop = at[at.metric == "generate_ms_per_token"]
        assert set(loop.provider) == {"compiled", "compiled_plain", "compiled_int8", "compiled_int4"}
        assert (loop.value > 0).all() and (loop.phase == "generate").all()
    gpu = pd.concat([df.assign(target="h100", hardware="test gpu", cuda="13.0"),
                     pd.DataFrame([{"target": "h100", "hardware": "test gpu", "cuda": "13.0", "case_id": "machine",
                                    "provider": "machine", "metric": "copy_gbps", "value": 1.0, "status": "ok"}])])
    (section,) = render(gpu, tmp_path)
    claims = [v.claim for v in section.verdicts]
    assert claims[:3] == ["+FlashAttention: 28.3 ms after 42.5 (1.50x)", "+INT8: 18.7 ms after 28.3 (1.51x)",
                          "+TensorParallel: 12.4 ms"]
    assert claims[3:5] == ["batch-1 decode at least 80% of the bandwidth roofline",
                           "INT8 weight-only decode at batch 1 at least 1.7x bf16's"]
    assert claims[5:] == ["compiled bf16 decode at batch 1 at least 85% of the copy bandwidth (issue 66)",
                          "compiled bf16 decode at batch 2 at least 80% of the copy bandwidth (issue 66)",
                          "at most 120 kernels in a compiled batch-1 decode step (issue 66)",
                          "INT4 weight-only decode at batch 1 at least 2.5x bf16's (issue 66)",
                          "the README's generate at batch 1 at most 5% slower a token than the step (issue 66)"]
    by = {v.claim: v for v in section.verdicts}
    one_step = df[(df.batch == 1) & (df.phase == "decode") & (df.provider == "compiled")].set_index("metric")["value"]
    fraction = one_step["decode_bytes_needed"] / (one_step["side_by_side_ms"] / 1e3) / 1e9  # copy: 1 GB/s
    assert by[claims[5]].measured == f"{fraction:.1%}"
    assert by[claims[8]].measured != "-" and "compiled_int4" in by[claims[8]].reason
    loop = df[(df.batch == 1) & (df.metric == "generate_ms_per_token")].set_index("provider")["value"]["compiled"]
    assert by[claims[9]].measured == f"{loop / one_step['side_by_side_ms'] - 1:+.1%}"
    assert by[claims[7]].verdict == "not measured yet" and "a CPU launches no" in by[claims[7]].reason
    assert section.verdicts[2].verdict == "not measured yet"
    # the roofline verdict names the config of the highest bytes per second, not the fastest step
    one = df[(df.batch == 1) & (df.phase == "decode")]
    steps = one[one.metric == "side_by_side_ms"].set_index("provider")["value"]
    gbps = (one[one.metric == "decode_bytes"].set_index("provider")["value"] / steps / 1e6).dropna()
    assert section.verdicts[3].measured == f"{gbps.max():.1%} ({gbps.idxmax()})"
    assert "| compiled_int8" in section.markdown


def test_kernels_are_counted_from_a_traces_device_events_and_judged_against_the_filed_bound():
    """The count leaves out host events, copies and memsets; the report holds a step to ``max_kernels_b1``."""
    from types import SimpleNamespace

    from adaattn_experiments.inference.report import decode_goal_verdicts
    from adaattn_experiments.inference.study import count_kernels

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(device_type=cuda, name=n) for n in ("gemv", "Memcpy HtoD", "Memset", "rms_norm")]
    assert count_kernels(events + [SimpleNamespace(device_type=cpu, name="aten::mm")]) == 2

    def verdict(kernels):
        base = {"hardware": "test gpu", "phase": "decode", "batch": 1, "provider": "compiled", "status": "ok"}
        ok = pd.DataFrame([{**base, "metric": "kernels_per_step", "value": kernels}])
        return next(v for v in decode_goal_verdicts(ok, ok, None, False, pd.DataFrame(columns=["batch", "vs"]))
                    if "kernels" in v.claim)

    assert (verdict(120.0).verdict, verdict(121.0).verdict) == ("holds", "worse than claimed")


def test_the_median_gap_between_a_traces_kernels():
    """Each kernel's start less the previous one's end, in start order, copies and host events left out."""
    from types import SimpleNamespace

    from adaattn_experiments.inference.study import median_kernel_gap_us

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, device=cuda):
        return SimpleNamespace(device_type=device, name=name, time_range=SimpleNamespace(start=start, end=end))

    # gaps 0.5 (a -> b), 2.0 (b -> c), -1.0 (c overlaps d); the copy and the host event in between are not kernels
    trace = [ev("d", 4.0, 6.0), ev("a", 0.0, 1.0), ev("Memcpy DtoD", 1.0, 3.0), ev("c", 3.5, 5.0), ev("b", 1.5, 1.5),
             ev("aten::mm", 0.0, 9.0, cpu)]
    assert median_kernel_gap_us(trace) == 0.5
    assert median_kernel_gap_us(trace[:1]) is None


def test_a_batch_records_every_cuda_graph_before_its_first_timed_round(monkeypatch):
    """generate's GraphedStep captured and the rounds' compiled decoders called before the prefill rounds: a
    graph's replay slowed once other graphs of its kernels were captured (notebook, 2026-12-01)."""
    from adaattn_experiments.inference import study as inference

    events = []
    generate_ = inference.Inference._generate
    rounds_ = inference.side_by_side_rows

    def generate(self, config, *args):
        events.append(("capture", config))
        return generate_(self, config, *args)

    def rounds(cases, *args, **kwargs):
        events.append(("rounds", cases[0][0]["phase"]))
        return rounds_(cases, *args, **kwargs)

    monkeypatch.setattr(inference.Inference, "_generate", generate)
    monkeypatch.setattr(inference, "side_by_side_rows", rounds)
    params = _params({"batches": [1], "configs": ["flash", "compiled", "compiled_int8"]})
    inference.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    first = events.index(("rounds", "prefill"))
    assert sorted(events[:first]) == [("capture", "compiled"), ("capture", "compiled_int8")], events
    assert events[first + 1] == ("rounds", "decode")


def test_the_torchao_peer_that_cannot_run_is_a_row_that_says_why(monkeypatch):
    from adaattn_experiments.inference import study as inference

    monkeypatch.setattr(inference, "torchao_missing", lambda: "torchao.quantization not importable: test")
    params = _params({"batches": [1], "configs": ["flash", "compiled_torchao_int8"]})
    df = pd.DataFrame(inference.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"]))
    peer = df[df.provider == "compiled_torchao_int8"]
    assert sorted(peer.phase) == ["decode", "prefill"] and (peer.status == "unavailable").all()
    assert peer.reason.str.contains("not importable: test").all()
    flash = df[(df.provider == "flash") & ~df.metric.isin(["kernels_per_step", "kernel_gap_us"])]  # a GPU trace's
    assert len(flash) and (flash.status == "ok").all()  # the others run


def test_a_wrapper_subclass_counts_its_inner_tensors():
    from adaattn_experiments.inference.study import nbytes

    class Packed(torch.Tensor):  # int8 data and a scale a row, shown as the bf16 matrix they stand for
        @staticmethod
        def __new__(cls, data, scale):
            return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.bfloat16)

        def __init__(self, data, scale):
            self.data_, self.scale = data, scale

        def __tensor_flatten__(self):
            return ["data_", "scale"], None

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    packed = Packed(torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16))
    assert nbytes(packed) == 8 * 16 + 8 * 2 and nbytes(torch.zeros(8, 16, dtype=torch.bfloat16)) == 8 * 16 * 2


@pytest.mark.parametrize("update, message", [
    ({"model": "hydra_small"}, "G3-T3.cpu.model 'hydra_small': attention='ccgqa': KV-cache decoding supports"),
    ({"model": "llama_9b"}, "G3-T3.cpu.models: 'llama_9b' is not a preset of models"),
    ({"prompt_len": 500, "new_tokens": 100}, "G3-T3.cpu.seq_len=600 is over models.dense_small.max_seq_len"),
    ({"batches": [1, 1]}, "configs and batches must not repeat one"),
    ({"configs": ["base", "fp4"]}, "configs"),
])
def test_bad_sweeps_name_the_key(update, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _params(update)


def test_each_compiled_call_starts_a_cuda_graph_step(monkeypatch):
    # several compiled decoders called in shuffled rounds: without a step mark per call, CUDA-graph trees
    # record a new graph for each order of calls they meet (minutes on the H100)
    from adaattn_experiments.inference import study as inference

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    for config, expected in (("flash", 0), ("int8", 0), ("compiled", 1), ("compiled_int8", 1)):
        marks.clear()
        assert inference.Inference._call(config, lambda x: x + 1, 1) == 2
        assert len(marks) == expected, config


def test_the_quality_run_prices_int8_and_int4_on_a_trained_model(tmp_path):
    from adaattn_experiments.inference import study as inference
    from adaattn_experiments.inference.report import quality_table

    quality = {"model": "dense_small", "batch": 2, "seq_len": 16, "steps": 3, "lr": 0.002, "log_every": 1,
               "eval_every": 3, "eval_batches": 2, "dtype": "fp32"}
    params = _params({"batches": [1], "configs": ["flash"], "quality": quality})
    df = pd.DataFrame(inference.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"]))
    q = df[df.phase == "quality"]
    assert {"train_loss", "val_loss"} <= set(q.metric)  # the training run's own rows, then the prices
    price = q[(q.metric == "val_loss") & q.provider.isin(["full", "int8", "int4"])].set_index("provider")
    assert list(price.index) == ["full", "int8", "int4"] and (price.value > 0).all()
    assert "groups of 32" in price.reason["int4"]
    # the trained model's own last validation loss is the full-precision price (fp32 weights, the same windows)
    trained = q[(q.metric == "val_loss") & (q.provider == "dense_small")].value.iloc[-1]
    assert price.value["full"] == pytest.approx(trained, rel=1e-5)
    table = quality_table(df.assign(target="cpu"))
    assert "| int4" in table and "%" in table
    from adaattn_pipeline.bench.results import write_results

    write_results(tmp_path / "cpu.csv", df.to_dict("records"), inference.STUDY.config_columns)  # columns it knows


@pytest.mark.parametrize("update, message", [
    ({"quality": {"model": "llama_9b", "batch": 2, "seq_len": 16, "steps": 3, "lr": 0.002}},
     "G3-T3.cpu.quality.models: 'llama_9b' is not a preset of models"),
    ({"int4_group_size": 48}, "int4_group_size"),
])
def test_bad_quality_and_int4_keys_are_named(update, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _params(update)


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

    compile_, modes = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **k: modes.append((mode, k)) or
                        compile_(fn, backend="eager"))
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

    compile_, modes = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **k: modes.append((mode, k)) or
                        compile_(fn, backend="eager"))
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
