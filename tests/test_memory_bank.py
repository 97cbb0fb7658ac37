"""The memory-bank study (G3-T4) on the CPU at toy size: memory by context for the standard and LTM models, the
three presets trained alike and evaluated (loss by context, passkey recall by distance), the report's table and
verdicts; the passkey task's layout; bad configs named before any work."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import torch

from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
pytestmark = pytest.mark.usefixtures("pytorch_kernels")  # RoPE and norms by PyTorch: no interpreted Triton
# PyTorch's MLP and norm: the zoo's kernels run interpreted under the tests' TRITON_INTERPRET
SMALL = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 64, "mlp": "gelu", "norm": "layernorm"}
TOY = {"models": {"standard": "ltm_small_dense", "window": "ltm_small_window", "ltm": "ltm_small"}, "batch": 1,
       "contexts": [64, 256], "dtype": "fp32",
       "train": {"batch": 2, "seq_len": 64, "steps": 4, "lr": 0.002, "warmup": 1, "log_every": 2, "eval_every": 4,
                 "eval_batches": 1, "dtype": "fp32"},
       "eval_contexts": [32, 128], "recall_distances": [32, 96], "recall_trials": 2}


TRIO = {"standard": "ltm_small_dense", "window": "ltm_small_window", "ltm": "ltm_small"}


def _raw(update=None, presets=None):
    raw = copy.deepcopy(load_raw(PARAMS))
    raw["models"]["ltm_small"].update({**SMALL, "segment_len": 16, "memory_slots": 8, "memory_compression": 4})
    raw["models"]["ltm_small_dense"].update({**SMALL, "max_seq_len": 256})
    raw["models"]["ltm_small_window"].update({**SMALL, "max_seq_len": 256, "attention_window": 16})
    for name, change in (presets or {}).items():
        raw["models"][name].update(change)
    raw["G3-T4"]["cpu"] = {**TOY, **(update or {})}
    return raw


def test_a_passkey_sits_its_distance_before_the_query():
    from adaattn_experiments.memory_bank.study import DIGITS, KEY, passkey_sequence

    val = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 20), dtype=torch.uint8)
    for distance in (32, 33, 100):
        seq, at = passkey_sequence(val, distance, torch.Generator().manual_seed(distance))
        first = len(KEY)
        assert at - first == distance and seq.numel() == at + DIGITS
        assert bytes(seq[:first].tolist()) == KEY and bytes(seq[at - len(KEY):at].tolist()) == KEY
        assert torch.equal(seq[first:first + DIGITS], seq[at:])  # the same digits
        assert all(chr(c).isdigit() for c in seq[at:].tolist())
    with pytest.raises(ValueError, match="distance=10 is under a passkey line's"):
        passkey_sequence(val, 10, torch.Generator())


def test_the_training_text_carries_passkey_pairs_and_nothing_else_changes():
    """``passkey_mix``: pairs of the same passkey line spliced into the text, the second within ``max_distance``
    bytes of the first, fresh digits a pair; taking the lines out gives the text back."""
    import re

    from adaattn_experiments.memory_bank.study import mix_passkeys

    text = torch.tensor(list(b"import os\nx = 1\n" * 400), dtype=torch.uint8)
    mixed = mix_passkeys(text, 256, 192, torch.Generator().manual_seed(0))
    raw = bytes(mixed.tolist())
    pairs = [m.start() for m in re.finditer(rb'passkey = "\d{5}"\n', raw)]
    assert len(pairs) >= 2 * (text.numel() // (256 * 3 // 2 + 192) - 1) and len(pairs) % 2 == 0
    lines = [raw[i:i + 18] for i in pairs]  # the key, five digits, the quote and newline
    for (a, b), (la, lb) in zip(zip(pairs[::2], pairs[1::2]), zip(lines[::2], lines[1::2])):
        assert la == lb and 18 + 16 <= b - a <= 18 + 192
    assert len({la for la in lines[::2]}) > len(lines) // 4  # fresh digits
    assert re.sub(rb'passkey = "\d{5}"\n', b"", raw) == bytes(text.tolist())
    assert mixed.dtype == text.dtype


@pytest.mark.parametrize("update, presets, message", [
    ({"models": {"standard": "ltm_small_dense", "ltm": "ltm_small"}}, None, "one preset for each role"),
    ({"models": {"standard": "ltm_small", "window": "ltm_small_window", "ltm": "ltm_small"}}, None,
     "models.standard: 'ltm_small' needs no memory_slots and no attention_window"),
    ({"models": {"standard": "ltm_small_dense", "window": "ltm_small_dense", "ltm": "ltm_small"}}, None,
     "models.window: 'ltm_small_dense' needs an attention_window"),
    (None, {"ltm_small_window": {"n_layers": 3}}, "differs from the standard preset 'ltm_small_dense' in n_layers"),
    ({"contexts": [64, 64]}, None, "contexts must not repeat a value"),
    ({"recall_distances": [8]}, None, "recall_distances"),
    ({"contexts": [512]}, None, "G3-T4.cpu.seq_len=512 is over models.ltm_small_dense.max_seq_len"),
    ({"models": {"standard": "nope", "window": "ltm_small_window", "ltm": "ltm_small"}}, None,
     "'nope' is not a preset of models"),
    ({"quality_models": {"standard": "ltm_small_dense", "ltm": "ltm_small"}}, None,
     "quality_models needs one preset for each role"),
    ({"quality_models": {"standard": "ltm_small_dense", "window": "ltm_small_dense", "ltm": "ltm_small"}}, None,
     "quality_models.window: 'ltm_small_dense' needs an attention_window"),
    # the trained trio reads the training, evaluation and recall sequences; the memory trio only its contexts
    ({"quality_models": TRIO, "recall_distances": [300]}, None, "is over models.ltm_small_dense.max_seq_len"),
])
def test_bad_configs_are_named(update, presets, message):
    with pytest.raises(ConfigError, match=message):
        validate(_raw(update, presets))


def test_a_quality_trio_of_its_own_is_the_one_trained():
    """``quality_models``: the memory rows come from ``models``, the trained rows from the quality trio (smaller
    models learn the task within a GPU call); both trios are the stage's presets."""
    from adaattn_experiments.memory_bank.study import STUDY

    small = {**SMALL, "dim": 16, "n_heads": 2}
    quality = {"standard": "q_dense", "window": "q_window", "ltm": "q_ltm"}
    raw = _raw({"contexts": [64], "quality_models": quality, "eval_contexts": [32], "recall_distances": [32]})
    raw["models"].update({"q_dense": {**small, "max_seq_len": 128},
                          "q_window": {**small, "max_seq_len": 128, "attention_window": 16},
                          "q_ltm": {**small, "segment_len": 16, "memory_slots": 8, "memory_compression": 4}})
    params = validate(raw)
    assert STUDY.presets(raw, "G3-T4", "cpu") == [*TRIO.values(), *quality.values()]
    df = pd.DataFrame(STUDY.bind("cpu").extra_rows(params, params.targets["cpu"]))
    memory = df[df["metric"].isin(["peak_mb", "state_mb"])]
    assert set(memory["model"]) == {"ltm_small_dense", "ltm_small"}
    trained = df[df["metric"].isin(["train_loss", "val_loss", "recall_accuracy"])]
    assert set(zip(trained["role"], trained["model"])) == set(quality.items())
    assert (trained["status"] == "ok").all()


def test_memory_by_context_and_the_trained_models_quality(tmp_path):
    from adaattn_experiments.memory_bank.study import STUDY
    from adaattn_experiments.memory_bank.report import memory_table, render

    params = validate(_raw())
    rows = STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    df = pd.DataFrame([{"target": "cpu", "hardware": "test cpu", "cuda": None, **r} for r in rows])
    assert (df["status"] == "ok").all(), df[df["status"] != "ok"][["case_id", "metric", "reason"]]
    mem = memory_table(df).set_index("context")
    assert list(mem.index) == [64, 256]
    # the standard model's cache grows with the context; the LTM decoder's state is allocated at the bank's
    # capacity (8 slots) from the start: per layer a segment's k and v (1 kv head of 16) and inputs (16 x 32), the
    # bank (8 x 32) and its k and v, fp32; the 8 + 16 int64 column numbers of its masks and the slots in use
    assert mem.loc[256, "kv_cache"] == pytest.approx(4 * mem.loc[64, "kv_cache"])
    per_layer = (2 * 16 * 16 + 16 * 32 + 8 * 32 + 2 * 8 * 16) * 4 + (8 + 16) * 8 + 8
    assert mem.loc[64, "segment_cache"] == mem.loc[256, "segment_cache"] == pytest.approx(2 * per_layer / 2**20)
    # the math backend keeps the scores: above the fused backend at the longer context
    assert mem.loc[256, "math"] > mem.loc[256, "fused"]
    for role in ("standard", "window", "ltm"):
        one = df[df["role"] == role]
        assert sorted(one.loc[one.metric == "val_loss", "context"].dropna()) == [32, 128]
        recall = one[one.metric == "recall_accuracy"]
        assert sorted(recall["distance"]) == [32, 96] and recall["value"].between(0, 1).all()
        assert (one.metric == "train_loss").sum() == 2 and (one.metric == "tokens_per_s").sum() == 1
    int8 = df[df.metric == "val_loss_int8"]
    assert set(int8.role) == {"standard"} and sorted(int8.context) == [32, 128]
    plain = df[(df.metric == "val_loss") & (df.role == "standard")].set_index("context")["value"]
    # the same windows, weights rounded to int8 steps: close to the trained model's loss, not equal
    for r in int8.itertuples():
        assert r.value != plain[r.context] and abs(r.value - plain[r.context]) < 0.05
    assert "weights_mb" not in set(df.metric)  # another study's training keeps no weights
    section, components = render(df, tmp_path)
    assert "| cpu " in section.markdown and "recall @96" in section.markdown
    # each target's own schedule in its rows (targets train for different numbers of steps)
    lines = section.markdown.splitlines()
    head = next(i for i, line in enumerate(lines) if "last train loss" in line)
    cells = [[c.strip() for c in line.split("|")] for line in (lines[head], lines[head + 2])]
    assert dict(zip(*cells))["steps"] == "4"
    # G3-C1: every component the guide lists; data and tensor parallelism built, pipeline parallelism not
    verdicts = {v.claim: v.verdict for v in components.verdicts}
    assert verdicts["pipeline parallelism"] == "not measured yet" and len(verdicts) == 11
    assert verdicts["data and tensor parallelism (DDP, FSDP2, TP)"] == "by construction"
    for claim, verdict in verdicts.items():
        if claim != "pipeline parallelism":
            assert verdict == "by construction", claim
    from adaattn_experiments.memory_bank.report import COMPONENTS
    root = Path(__file__).parents[1]
    for _, _, tests, _ in COMPONENTS:  # the tests named exist
        for test in tests.split(", "):
            assert (root / test).is_file(), test
    (goal,) = [v for v in section.verdicts if "32K" in v.claim]
    assert goal.verdict == "not measurable here" and "this run's longest is 256" in goal.reason
    assert (tmp_path / "g3_t4_memory.png").exists() and (tmp_path / "g3_t4_recall.png").exists()


def test_the_goal_is_judged_at_32k_on_a_gpu(tmp_path):
    """The report alone, on rows as a GPU run writes them: the guide's contexts judged, the goal at 32K."""
    from adaattn_experiments.memory_bank.report import render

    def row(context, provider, metric, value, status="ok"):
        return {"target": "h100", "hardware": "test gpu", "cuda": "13.0", "case_id": f"G3-T4/memory-{context}",
                "context": context, "provider": provider, "metric": metric, "value": value, "status": status,
                "role": "ltm" if provider in ("ltm", "segment_cache") else "standard", "model": "m"}

    rows = []
    for context, math_mb, fused_mb, cache_mb, ltm_mb in ((2048, 900, 300, 100, 200), (32768, None, 2000, 1600, 300)):
        rows += [row(context, "math", "peak_mb", math_mb, "ok" if math_mb else "oom"),
                 row(context, "fused", "peak_mb", fused_mb), row(context, "kv_cache", "state_mb", cache_mb),
                 row(context, "ltm", "peak_mb", ltm_mb), row(context, "segment_cache", "state_mb", 10)]
    section, _ = render(pd.DataFrame(rows), tmp_path)
    verdicts = {v.claim: v for v in section.verdicts}
    at_2k = verdicts["at 2K context the LTM model needs 2x less memory than standard attention"]
    assert at_2k.measured == "4.8x" and at_2k.verdict == "better than claimed"  # (900 + 100) / (200 + 10)
    goal = verdicts["the LTM model's memory at 32K context at most 1/8 of the standard model's"]
    assert goal.measured == "11.6x at 32768 tokens" and goal.verdict == "holds"  # (2000 + 1600) / (300 + 10)
    # the math backend's 32K: a status in its cell and in the guide's claim, never "nan"
    at_32k = verdicts["at 32K context the LTM model needs 128x less memory than standard attention"]
    assert at_32k.measured == "standard: oom" and at_32k.verdict == "not measurable here"
    row_32k = [[c.strip() for c in line.split("|")] for line in section.markdown.splitlines()
               if line.startswith("| h100") and "32768" in line]
    assert len(row_32k) == 1 and "oom" in row_32k[0]
    assert "nan" not in section.markdown.lower() and not any("nan" in v.measured for v in section.verdicts)


def test_quality_is_judged_as_filed_and_only_where_the_task_was_learned():
    """G3-T4's quality goals (`G3-T4.quality`, outside the results' params hash): the standard model must read the
    passkey back at the shortest distance; then the window and LTM models' recall and loss against it."""
    from adaattn_experiments.memory_bank.report import quality_verdicts
    from adaattn_experiments.memory_bank.study import STUDY
    from adaattn_pipeline.report.common import use_params

    def frame(standard: float) -> pd.DataFrame:
        base = {"target": "h100", "hardware": "H100", "status": "ok", "cuda": "13.0", "case_id": "c"}
        rows = [{**base, "metric": "recall_accuracy", "role": role, "distance": 64, "value": v}
                for role, v in (("standard", standard), ("window", 0.5), ("ltm", 0.9))]
        rows += [{**base, "metric": "val_loss", "role": role, "context": 512, "value": v}
                 for role, v in (("standard", 1.80), ("window", 1.90), ("ltm", 1.82))]
        return pd.DataFrame(rows)

    params = validate(_raw())
    with use_params(params):
        learned, window_recall, window_loss, ltm_recall, ltm_loss = quality_verdicts(frame(0.95))
    assert learned.verdict == "holds" and learned.measured == "0.95"
    assert (window_recall.verdict, ltm_recall.verdict) == ("worse than claimed", "holds")
    assert (window_loss.verdict, ltm_loss.verdict) == ("worse than claimed", "holds")
    learned, window_recall, *_ = quality_verdicts(frame(0.03))
    assert learned.verdict == "worse than claimed" and window_recall.verdict == "not measured yet"
    assert "did not learn the task (recall 0.03" in window_recall.reason
    raw = _raw()
    assert not any(k.startswith("G3-T4.quality") for k in STUDY.param_keys(raw, "cpu"))
    raw["G3-T4"]["quality"] = {"recall_floor": 0.5}
    with use_params(validate(raw)):
        assert quality_verdicts(frame(0.6))[0].verdict == "holds"


def test_a_recall_gap_is_read_only_where_the_standard_model_reads_the_passkey():
    """Beyond its training windows the standard model can read at chance: a window or LTM model at chance there is
    within any gap of it, which says nothing. Such a distance is `not measured yet`, the others judged."""
    from adaattn_experiments.memory_bank.report import quality_verdicts
    from adaattn_pipeline.report.common import use_params

    base = {"target": "h200", "hardware": "H200", "status": "ok", "cuda": "13.0", "case_id": "c"}
    rows = [{**base, "metric": "recall_accuracy", "role": role, "distance": d, "value": v}
            for role, by in (("standard", {64: 1.0, 4096: 0.03}), ("window", {64: 0.98, 4096: 0.07}),
                             ("ltm", {64: 0.5, 4096: 0.1}))
            for d, v in by.items()]
    rows += [{**base, "metric": "val_loss", "role": role, "context": 512, "value": 1.8} for role in ("standard", "ltm")]
    with use_params(validate(_raw())):
        verdicts = {v.claim: v for v in quality_verdicts(pd.DataFrame(rows))}
    assert verdicts["window recall at distance 64 at most 0.1 below the standard model's"].verdict == "holds"
    assert verdicts["ltm recall at distance 64 at most 0.1 below the standard model's"].verdict == "worse than claimed"
    for role in ("window", "ltm"):
        far = verdicts[f"{role} recall at distance 4096 at most 0.1 below the standard model's"]
        assert far.verdict == "not measured yet" and "reads 0.03 at this distance" in far.reason
