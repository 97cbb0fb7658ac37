"""The G2 studies (precision G2-T3, rank G2-C1, scaling G2-B, cpu_baseline G2-T1) on the CPU at toy
sizes: their params are validated, every provider runs, the results mean what their names say,
and each report renders from its own results."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest

from adaattn_pipeline.bench.harness import Harness
from adaattn_pipeline.bench.roofline import Ceilings
from adaattn.timing.timers import CpuTimer
from adaattn_pipeline.config import ConfigError, load_params, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"


def _params(**overrides):
    """params.yaml with ``{"G2-B.cpu.seq_lens": [64], ...}`` applied; the rank study's real inputs
    (a model run, ``test_minilm.py``) and the precision study's 8-bit rows off unless an override sets them."""
    raw = copy.deepcopy(load_raw(PARAMS))
    overrides = {"G2-C1.cpu.real_layers": [], "G2-C1.cpu.real_seq_lens": [], "G2-T3.cpu.fp8": None, **overrides}
    for dotted, value in overrides.items():
        node = raw
        *path, last = dotted.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return validate(raw), raw


def _run(study, params):
    study = study.bind("cpu")
    cases = study.cases(params, params.targets["cpu"])
    h = Harness("cpu", CpuTimer(1, 2), Ceilings(10.0, 1.0, "fp32", 64),
                **study.harness_options(params, params.targets["cpu"]))
    rows = h.run(study, cases)
    extra = study.extra_rows(params, params.targets["cpu"])
    prov = {"target": "cpu", "hardware": "test cpu"}
    return pd.DataFrame([{**r, **prov} for r in rows + extra])


@pytest.mark.parametrize("key, value, message", [
    ("G2-B.cpu.providers", ["mha", "direct:nope"], "allowed: mha, standard"),
    ("G2-B.cpu.manager_backends", ["sdpa", "cuda_magic"], "allowed: flash_attn"),
    ("G2-B.cpu.compiled_backends", ["sdpa", "warp"], "allowed: flash_attn"),
    ("G2-B.cpu.compile_mode", "fast", "reduce-overhead"),
    ("G2-B.cpu.stack", {"layers": 0}, "layers"),
    ("G2-T3.cpu.precisions", ["fp16", "bf16"], "must include fp32"),
    ("G2-T3.cpu.heads", 3, "must divide embed_dim"),
    ("G2-C1.cpu.cluster_layouts", ["diagonal"], "spread"),
    ("G2-C1.cpu.exact_providers", ["nystrom"], "allowed: flash_attn"),
    ("G2-C1.cpu.real_layers", [6], "less than or equal to 5"),
    ("G2-C1.cpu.real_seq_lens", [1024], "less than or equal to 512"),
])
def test_bad_g2_params_are_rejected_naming_key_and_allowed_values(key, value, message):
    with pytest.raises(ConfigError) as err:
        _params(**{key: value})
    assert message in str(err.value) and key.split(".")[0] in str(err.value)


def test_scaling_needs_a_direct_provider_for_every_manager_backend():
    """The 3% goal's oracle is every backend the manager may pick, called directly: a missing one is an
    error naming the key and the missing providers, raised when the cases are built (before any work)."""
    providers = ["mha", "standard", "adaattn", "direct:sdpa", "direct:sdpa_math", "direct:chunked", "direct:math"]
    from adaattn_experiments.scaling.study import STUDY as SCALING

    params, _ = _params(**{"G2-B.cpu.providers": providers})
    with pytest.raises(ValueError, match=r"G2-B\.cpu\.providers must hold .*missing: direct:sdpa_flash$"):
        SCALING.bind("cpu").cases(params, params.targets["cpu"])


def test_precision_study_low_precision_is_less_accurate_and_tf32_is_a_cuda_row():
    from adaattn_experiments.precision.study import STUDY

    params, _ = _params(**{"G2-T3.cpu.seq_len": 32, "G2-T3.cpu.embed_dim": 64, "G2-T3.cpu.batch": 1,
                           "G2-T3.cpu.modes": ["fwd"]})
    df = _run(STUDY, params)
    t = df[df.metric == "time_ms"]
    assert set(t[t.provider == "tf32"].status) == {"unavailable"}
    assert (t[t.provider != "tf32"].status == "ok").all(), t[["provider", "status", "reason"]]
    mse = df[df.metric == "mse"].pivot_table(index="case_id", columns="provider", values="value")
    assert len(mse) == 4  # attention and block, normal and outliers
    assert (mse["fp32"] < 1e-10).all() and (mse["bf16"] > 100 * mse["fp32"]).all() and (mse["fp16"] < mse["bf16"]).all()


def test_outlier_inputs_have_the_configured_outliers():
    import torch

    from adaattn_experiments.precision.study import STUDY

    params, _ = _params(**{"G2-T3.cpu.outlier_prob": 0.01, "G2-T3.cpu.outlier_std": 50.0})
    study = STUDY.bind("cpu")
    cases = {c.case_id: c for c in study.cases(params, params.targets["cpu"])}
    x = study.inputs(next(c for i, c in cases.items() if "block-outliers" in i))
    frac = (x.abs() > 6).float().mean().item()
    assert 0.004 < frac < 0.02 and torch.isfinite(x).all()
    x = study.inputs(next(c for i, c in cases.items() if "block-normal" in i))
    assert (x.abs() > 6).sum() == 0


def test_module_providers_share_weights_and_match_the_float64_module(tmp_path):
    from adaattn_experiments.scaling.study import STUDY as SCALING

    params, _ = _params(**{"G2-B.cpu.seq_lens": [64], "G2-B.cpu.batches": [2], "G2-B.cpu.batch_sweep_seq_len": 32,
                           "G2-B.cpu.embed_dim": 64, "G2-B.cpu.causal": [False, True]})
    df = _run(SCALING, params)
    t = df[df.metric == "time_ms"]
    assert (t.status == "ok").all(), t[t.status != "ok"][["provider", "status", "reason"]]
    err = df[(df.metric == "rel_l2")]
    assert set(err.provider) == set(params.g2_b.cpu.providers) and (err.value < 1e-5).all(), err[["provider", "value"]]
    ranking = df[df.metric == "manager_ranking"]
    assert len(ranking) and ranking.kernel.str.contains(" > ").all() and (ranking.value > 0).all()
    # the first call of each new signature: adaattn's (it ranks the backends), then the chosen backend's direct
    first = df[df.metric == "first_call_s"]
    assert len(first.groupby(["case_id", "mode"])) == 2 * 2 * 2 and (first.value > 0).all()
    for (case, mode), g in first.groupby(["case_id", "mode"]):
        (direct,) = [p for p in g.provider if p != "adaattn"]
        sig = ranking[ranking.kernel.str.startswith(direct.removeprefix("direct:") + " ")]
        assert "adaattn" in set(g.provider) and direct.startswith("direct:") and len(sig), (case, mode, direct)
    assert (df[df.metric == "first_call_measure_s"].value > 0).all()
    # the 3% goal's time per call, side by side: adaattn and the direct backends of every shape and mode
    side = df[df.metric == "side_by_side_ms"]
    groups = side.groupby(["case_id", "mode"])["provider"].apply(set)
    assert len(groups) == 2 * 2 * 2  # (batch point, seq point) x causal x (fwd, fwd_bwd)
    direct = {p for p in params.g2_b.cpu.providers if p.startswith("direct:")}
    assert all(g == {"adaattn"} | direct for g in groups), groups
    ok = side[side.status == "ok"]
    assert "adaattn" in set(ok.provider) and (ok.value > 0).all()
    # adaattn's per-round ratio to every direct backend timed beside it
    paired = df[df.metric == "paired_ratio"]
    inrounds = side[side.status.isin(["ok", "outpaced"])]  # outpaced: timed in the first rounds only
    timed = inrounds[inrounds.provider != "adaattn"].groupby(["case_id", "mode"])["provider"].apply(set)
    assert paired.groupby(["case_id", "mode"])["provider"].apply(set).equals(timed)
    assert ((paired.p20 <= paired.value) & (paired.value <= paired.p80) & (paired.value > 0)).all()
    # and its median's 95% confidence bounds, one of each per paired row, around it
    keys = ["case_id", "mode", "provider"]
    bounds = paired[[*keys, "value"]]
    for side in ("low", "high"):
        b = df[df.metric == f"paired_ratio_ci_{side}"][[*keys, "value"]].rename(columns={"value": side})
        assert len(b) == len(paired)
        bounds = bounds.merge(b, on=keys)
    assert ((bounds.low <= bounds.value) & (bounds.value <= bounds.high)).all(), bounds
    from adaattn_experiments.scaling.report import render

    g2_b = render(df, tmp_path)[0]
    claims = [v.claim for v in g2_b.verdicts]
    assert any("time per call, eager" in c for c in claims) and any("first call" in c for c in claims), claims
    assert "### First call of a new signature" in g2_b.markdown and "| eager " in g2_b.markdown


def test_rank_study_policy_estimators_and_oracle(monkeypatch):
    """The policy's paths by error, then by speed against the exact path. The speed check's timings are
    replaced (each call run once): under TRITON_INTERPRET the pooled path runs interpreted Triton on the CPU,
    hundreds of times slower than SDPA, and the policy would rightly keep the exact path."""
    from adaattn.attention.kernel_manager import AttentionKernelManager
    from adaattn.attention.rank import Speed
    from adaattn_experiments.rank.study import STUDY

    timed = []

    def time_ops(self, calls, device):
        timed.append([n for n, c in calls.items() if c() is not None])
        return {n: 1.0 if n == "low-rank" else 2.0 for n in calls}

    monkeypatch.setattr(AttentionKernelManager, "time_ops", time_ops)
    params, _ = _params(**{"G2-C1.cpu.seq_lens": [256], "G2-C1.cpu.true_ranks": [8], "G2-C1.cpu.ranks": [8, 16, 32],
                           "G2-C1.cpu.exact_providers": ["sdpa"]})
    df = _run(STUDY, params)
    pol = df[df.metric == "policy_rank"].set_index("inputs")
    # 2 x the estimate, accepted on its sampled error and faster than the exact path, timed side by side
    assert pol.loc["contiguous-r8", "value"] == 16, pol.loc["contiguous-r8", "reason"]
    assert pol.loc["contiguous-r8", "kernel"] in ("pooled", "nystrom") and pol.loc["random", "kernel"] == "sdpa"
    speed = df[df.metric.isin(["policy_low_rank_ms", "policy_exact_ms"])].set_index("metric")
    assert set(speed.inputs) == {"contiguous-r8"} and speed.loc["policy_exact_ms", "kernel"] == "sdpa"
    assert (speed.loc["policy_low_rank_ms", "value"], speed.loc["policy_exact_ms", "value"]) == (1.0, 2.0)
    assert timed == [["low-rank", "sdpa"]]  # the one case whose path passed its error check
    # a path that is not faster: the exact path, and why, with both times
    seen = {"estimate": 8, "tried": 16, "sample_rel_error": {"pooled": 0.0496}, "speed": Speed(0.413, 0.2, "sdpa")}
    assert STUDY._why_exact(seen) == ("16 landmarks (pooled): 0.413 ms per call, not faster than the exact path's "
                                      "sdpa (0.2 ms)")
    assert pol.loc["spread-r8", "value"] == 0 and "relative error (pooled" in pol.loc["spread-r8", "reason"]
    assert "nystrom" in pol.loc["spread-r8", "reason"]  # both paths tried, both too far off
    assert pol.loc["random", "value"] == 0 and "not clearly low" in pol.loc["random", "reason"]
    err = df[df.metric == "rel_l2"].pivot_table(index="inputs", columns="provider", values="value")
    assert err.loc["contiguous-r8", "nystrom-8"] < 0.05 and err.loc["spread-r8", "nystrom-32"] > 0.3
    assert err.loc["contiguous-r8", "pooled-8"] < 0.1 and err.loc["spread-r8", "pooled-32"] > 0.3
    assert err.loc["contiguous-r8", "policy"] < 0.05 and err.loc["spread-r8", "policy"] < 1e-5
    est = df[df.provider == "estimator"].pivot_table(index=["inputs", "head"], columns="metric", values="value")
    assert len(est) == 3 * params.g2_c1.cpu.heads
    assert (est.loc["contiguous-r8", "spectrum_rank_full"] <= 8).all()
    assert (est.loc["random", "spectrum_rank_full"] > 100).all()


def test_reports_render_from_results(tmp_path):
    """Each G2 report renders with its verdicts from the rows its study writes."""
    from adaattn_experiments.cpu_baseline.study import STUDY as CPU_BASELINE
    from adaattn_experiments.cpu_baseline.report import render as render_modules
    from adaattn_experiments.precision.study import STUDY as PRECISION
    from adaattn_experiments.precision.report import render as render_precision
    from adaattn_experiments.rank.study import STUDY as RANK
    from adaattn_experiments.rank.report import render as render_rank

    params, _ = _params(**{"G2-T1.cpu.points": [[1, 32], [2, 16]], "G2-T3.cpu.seq_len": 32, "G2-T3.cpu.embed_dim": 64,
                           "G2-T3.cpu.modes": ["fwd"], "G2-C1.cpu.seq_lens": [128], "G2-C1.cpu.ranks": [8, 16],
                           "G2-C1.cpu.true_ranks": [8], "G2-C1.cpu.exact_providers": ["sdpa"]})
    pdf = _run(PRECISION, params)
    sections = render_precision(pdf, tmp_path)
    assert sections[0].table_id == "G2-T3" and {v.table_id for v in sections[0].verdicts} == {"G2-T3", "G2-T2"}
    # the block's attention backend beside each block row: its kernel manager's first, per precision
    ranks = pdf[pdf.metric == "manager_ranking"]
    assert set(ranks.provider) == {"block"} and len(ranks) == 3  # fp32, fp16, bf16 forward signatures
    first = dict(zip(ranks.case_id.str.split("|").str[2], ranks.kernel.str.split(" ").str[0], strict=True))
    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in sections[0].markdown.splitlines()
             if line.startswith("| cpu ")]
    blocks = [c for c in cells if c[2] == "block"]
    assert len(blocks) == 6 and all(c[6] == first[dtype[c[5]]] for c in blocks), blocks
    assert all(c[6] == "SDPA's own" for c in cells if c[2] == "attention")
    (section,) = render_rank(_run(RANK, params), tmp_path)
    assert "oracle path" in section.markdown and (tmp_path / "g2_c1_error_cpu.png").exists()
    df = _run(CPU_BASELINE, params)
    # G2-T1's providers side by side, none left out, and adaattn's per-round ratio to each of the others
    side = df[df.metric == "side_by_side_ms"]
    assert (side.status == "ok").all() and set(side.provider) == set(params.g2_t1.cpu.providers)
    paired = df[df.metric == "paired_ratio"]
    assert set(paired.provider) == set(params.g2_t1.cpu.providers) - {"adaattn"}
    (section,) = render_modules(df, tmp_path)
    assert " ± " in section.markdown and section.table_id == "G2-T1"
    assert "adaattn / mha, per round" in section.markdown
    mha = paired[paired.provider == "mha"].set_index("case_id")
    for v in section.verdicts:  # the verdict is on the median per-round ratio (B1_S32 and B2_S16 are not guide points)
        assert f"{mha.value.iloc[0]:.3f}" in v.measured or f"{mha.value.iloc[-1]:.3f}" in v.measured


def test_g2_t1_is_a_cpu_table():
    from adaattn_experiments.cpu_baseline.study import STUDY as CPU_BASELINE

    params, _ = load_params(PARAMS)
    with pytest.raises(ValueError, match="CPU table"):
        CPU_BASELINE.bind("cuda").cases(params, params.targets["h100"])


def test_rank_goal_reads_both_timings_and_names_the_path(tmp_path):
    """The low-rank goal table at S >= 8192: speedup by time per call and by kernel time, and which
    implementation of each low-rank path ran (from the recorded kernel names)."""
    from adaattn_experiments.rank.study import STUDY as RANK
    from adaattn_experiments.rank.report import render as render_rank

    params, _ = _params(**{"G2-C1.cpu.seq_lens": [256], "G2-C1.cpu.ranks": [8, 16], "G2-C1.cpu.true_ranks": [8],
                           "G2-C1.cpu.exact_providers": ["sdpa"], "G2-C1.cpu.random_inputs": False,
                           "G2-C1.cpu.cluster_layouts": ["contiguous"]})
    df = _run(RANK, params)
    df.loc[df["seq_len"] == 256, "seq_len"] = 8192  # as if measured at S = 8192 (landmarks <= S/16)
    times = df[(df["metric"] == "time_ms") & (df["case_id"] != "machine")]
    fused = times["provider"] == "nystrom-8"
    df.loc[times.index[fused], "kernel"] = "_landmark_solve | _nystrom_out | _bv_partial"
    df.loc[times.index[times["provider"] == "nystrom-16"], "kernel"] = "sgemm | softmax"
    df.loc[times.index[times["provider"] == "pooled-8"], "kernel"] = "_nystrom_out | _pooled_means"
    kernel = times.assign(metric="kernel_ms", value=times["value"].where(~fused, times["value"] / 1e3))
    (section,) = render_rank(pd.concat([df, kernel], ignore_index=True), tmp_path)
    goal = section.markdown.split("### Goal")[1]
    cells = {c.strip() for line in goal.splitlines() for c in line.split("|")}
    assert {"fused Triton", "PyTorch", "fused Triton (means, output)", "PyTorch (SDPA over segment means)",
            "speedup by kernel time"} <= cells
    bases = {v.claim.rsplit("by ", 1)[1] for v in section.verdicts}
    assert bases == {"time per call", "kernel time"}
    # one verdict per low-rank path and basis, the pooled path first (as the policy tries them)
    assert [v.claim.split("(")[1].split(",")[0] for v in section.verdicts] == ["pooled"] * 2 + ["nystrom"] * 2


def test_rank_goal_reads_side_by_side_times_and_the_solve_floor(tmp_path, monkeypatch):
    """On a GPU the goal's time per call comes from the side-by-side rows, and a landmark count whose
    batched r x r solve alone (pinv products at bf16's rate and an LU solve) exceeds the 2x budget
    is named as out of reach in the verdict; a fused solve's landmark count is not judged on them."""
    import adaattn_experiments.rank.report as rank_report
    from adaattn_experiments.rank.study import STUDY as RANK
    from adaattn_experiments.rank.report import render as render_rank

    monkeypatch.setattr(rank_report, "fused_solve", lambda r, d: r <= 8)  # 16 landmarks: the batched solve

    params, _ = _params(**{"G2-C1.cpu.seq_lens": [256], "G2-C1.cpu.ranks": [8, 16], "G2-C1.cpu.true_ranks": [8],
                           "G2-C1.cpu.exact_providers": ["sdpa"], "G2-C1.cpu.random_inputs": False,
                           "G2-C1.cpu.cluster_layouts": ["contiguous"]})
    df = _run(RANK, params)
    df.loc[df["seq_len"] == 256, "seq_len"] = 8192  # as if measured at S = 8192 (landmarks <= S/16)
    low_rank_err = (df["metric"] == "rel_l2") & df["provider"].str.contains("-")
    df.loc[low_rank_err, "value"] = 0.01  # within the policy's budget
    times = df[(df["metric"] == "time_ms") & (df["case_id"] != "machine") & (df["provider"] != "policy")]
    # side by side: sdpa 1 ms, nystrom-8 0.25 ms (4x), nystrom-16 0.8 ms (1.25x), pooled-8 0.1 ms (10x),
    # pooled-16 0.2 ms (5x); the sweep's own times differ
    side = times.assign(metric="side_by_side_ms", value=times["provider"].map(
        {"sdpa": 1.0, "nystrom-8": 0.25, "nystrom-16": 0.8, "pooled-8": 0.1, "pooled-16": 0.2}))
    c = times.iloc[0]
    floor = [{**c.to_dict(), "case_id": f"G2-C1/solve-floor-r{r}", "provider": f"solve-{r}", "metric": m,
              "value": v, "inputs": None, "true_rank": None, "seq_len": None}
             for r, vals in ((8, (5.0, 5.0, 5.0)), (16, (2.0, 0.9, 0.7)))
             for m, v in zip(("pinv_fp32_ms", "pinv_bf16_ms", "lu_solve_ms"), vals)]
    (section,) = render_rank(pd.concat([df, side, pd.DataFrame(floor)], ignore_index=True), tmp_path)
    per_call = {v.claim.split("(")[1].split(",")[0]: v for v in section.verdicts if v.claim.endswith("side by side")}
    assert per_call["nystrom"].measured.startswith("1.25-4.00x over 2 points; 1 not met (0 over the error budget)")
    assert per_call["nystrom"].verdict == "worse than claimed"
    assert "at 1 of 2 points (16-16 landmarks, solved by batched products) the r x r solve alone" in \
        per_call["nystrom"].reason
    # the pooled path solves nothing: no solve floor in its reason
    assert per_call["pooled"].measured.startswith("5.00-10.00x over 2 points; 0 not met")
    assert per_call["pooled"].verdict == "holds" and "solve" not in per_call["pooled"].reason
    # a point over the policy's error budget does not meet the goal at any speed
    over = df.assign(value=df["value"].where(~((df["metric"] == "rel_l2") & (df["provider"] == "pooled-16")), 0.9))
    (section,) = render_rank(pd.concat([over, side, pd.DataFrame(floor)], ignore_index=True), tmp_path)
    pooled = next(v for v in section.verdicts if v.claim.endswith("side by side") and "(pooled," in v.claim)
    assert pooled.verdict == "worse than claimed" and "1 not met (1 over the error budget)" in pooled.measured
    goal = section.markdown.split("### Goal")[1]
    assert "pinv products ms (cuBLAS bf16)" in goal and "2x budget ms" in goal


FP8_TOY = {"batch": 1, "heads": 2, "head_dim": 64, "seq_lens": [64], "causal": [False, True], "inputs": ["normal"],
           "providers": ["sdpa_bf16", "sdpa_cudnn_bf16", "fp8", "fp8_pv_bf16", "fp8_e4m3_qk", "sage"],
           "real_seq_len": 128, "real_layers": [0]}


def test_the_8_bit_rows_run_ours_beside_sdpa_and_name_what_cannot_run(tmp_path):
    """The precision study's FP8 rows (issue 68) on the CPU: SDPA in bf16 and ours (interpreted) on the same bf16
    inputs, N(0, 1) and MiniLM's captured q, k, v, each read against float64; the cuDNN and SageAttention rows
    say why they cannot run here; the report's table and its goals' verdicts from those rows."""
    from adaattn_experiments.precision.report import render
    from adaattn_experiments.precision.study import STUDY
    from adaattn_pipeline.report.common import use_params

    params, _ = _params(**{"G2-T3.cpu.ops": ["attention"], "G2-T3.cpu.seq_len": 32, "G2-T3.cpu.embed_dim": 64,
                           "G2-T3.cpu.modes": ["fwd"], "G2-T3.cpu.inputs": ["normal"],
                           "G2-T3.cpu.precisions": ["fp32"], "G2-T3.cpu.fp8": FP8_TOY})
    df = _run(STUDY, params)
    eight = df[df.op == "fp8_attention"]
    t = eight[eight.metric == "time_ms"]
    assert set(t.case_id) == {"G2-T3/fp8-normal-full-b1-h2-s64-d64", "G2-T3/fp8-normal-causal-b1-h2-s64-d64",
                              "G2-T3/fp8-real-l0-s128"}
    assert set(t[t.status == "unavailable"].provider) == {"sdpa_cudnn_bf16", "sage"}
    assert (t[~t.provider.isin(["sdpa_cudnn_bf16", "sage"])].status == "ok").all(), t[["provider", "status", "reason"]]
    err = eight[eight.metric == "rel_l2"].pivot_table(index="case_id", columns="provider", values="value")
    assert (err["sdpa_bf16"] < 0.01).all()  # bf16 inputs' attention in bf16 against float64 over the same inputs
    assert (err["fp8_pv_bf16"] < 0.08).all() and (err["fp8"] < 0.08).all() and (err["fp8_e4m3_qk"] < 0.08).all()
    real = eight[(eight.inputs == "real") & (eight.metric == "tflops")]
    assert set(real.head_dim) == {32} and set(real.heads) == {12}
    with use_params(params):
        (section,) = render(df, tmp_path)
    verdicts = {v.claim: v for v in section.verdicts}
    real_claims = [c for c in verdicts if c.startswith("fp8 on real inputs (layer 0)")]
    assert len(real_claims) == 1 and verdicts[real_claims[0]].verdict in ("holds", "worse than claimed")
    # the guard ran on every case's inputs (interpreted here), each decision scored against fp8's measured error
    guard = eight[eight.provider == "fp8_guard"].pivot_table(index="case_id", columns="metric", values="value")
    assert set(guard.index) == set(t.case_id) and (guard["fp8_guard_bound"] == 0.03).all()
    measured = err["fp8"].reindex(guard.index)
    assert ((guard["fp8_guard_accepted"] == 1) == (guard["fp8_guard_estimate"] <= 0.03)).all()
    false = int(((guard["fp8_guard_accepted"] == 1) & (measured > 0.03)).sum())
    scored = verdicts["AdaAttention's guard never accepts FP8 where the measured error exceeds the bound"]
    assert scored.measured.startswith(f"{false} of {int(guard['fp8_guard_accepted'].sum())} accepted (3 cases)")
    assert scored.verdict == ("holds" if false == 0 else "worse than claimed")
    assert [c for c in verdicts if c.startswith("AdaAttention's guard accepts FP8 on real inputs (layer 0)")]
    assert "| sdpa_cudnn_bf16" in section.markdown or "sdpa_cudnn_bf16 |" in section.markdown
    assert "estimate" in section.markdown  # the guard's column


def test_the_8_bit_speed_goals_are_read_side_by_side_in_one_case(tmp_path):
    """The report alone, on rows as a GPU run writes them: FP8 over cuDNN's and SageAttention's TFLOP/s in the same
    case, judged against ``G2-T3.fp8_goals``; below ``min_seq_len`` no speed verdict; a peer that did not run is
    no reading."""
    from adaattn_experiments.precision.report import fp8_section

    def rows(seq_len, tflops):
        base = {"target": "h200", "hardware": "H200", "op": "fp8_attention", "inputs": "normal", "causal": False,
                "seq_len": seq_len, "head_dim": 128, "layer": None}
        out = []
        for provider, value in tflops.items():
            if value is None:
                out.append({**base, "provider": provider, "metric": "time_ms", "value": None,
                            "status": "unavailable", "reason": "not importable"})
                continue
            out += [{**base, "provider": provider, "metric": m, "value": v, "status": "ok", "reason": ""}
                    for m, v in (("tflops", value), ("cosine", 0.9999), ("rel_l2", 0.01))]
        return out

    df = pd.DataFrame(rows(8192, {"fp8": 900.0, "sdpa_cudnn_bf16": 600.0, "sage": 700.0})
                      + rows(2048, {"fp8": 100.0, "sdpa_cudnn_bf16": 600.0, "sage": 700.0})
                      + rows(16384, {"fp8": 900.0, "sdpa_cudnn_bf16": 600.0, "sage": None}))
    _, verdicts = fp8_section(df, set())
    by = {v.claim: v for v in verdicts}
    cudnn = by["FP8 attention at least 1.3x sdpa_cudnn_bf16's TFLOP/s (S=8192, D=128, full)"]
    sage = by["FP8 attention at least 1.5x sage's TFLOP/s (S=8192, D=128, full)"]
    assert (cudnn.measured, cudnn.verdict) == ("1.50x", "holds")  # a lower bound met
    assert sage.measured == "1.29x" and sage.verdict == "worse than claimed"
    assert not any("S=2048" in c for c in by)
    missing = by["FP8 attention at least 1.5x sage's TFLOP/s (S=16384, D=128, full)"]
    assert missing.verdict == "not measurable here" and "not importable" in missing.reason


def test_a_guard_that_accepts_fp8_over_its_bound_is_a_false_accept():
    """The report alone: a case whose guard accepted FP8 while fp8's measured error is over the bound fails the
    claim; a refusal over the bound, or an acceptance under it, does not."""
    from adaattn_experiments.precision.report import fp8_section

    def case(seq_len, accepted, estimate, measured):
        base = {"target": "h200", "hardware": "H200", "op": "fp8_attention", "inputs": "outliers", "causal": False,
                "seq_len": seq_len, "head_dim": 128, "layer": None, "status": "ok", "reason": ""}
        return [{**base, "provider": "fp8", "metric": "rel_l2", "value": measured},
                {**base, "provider": "fp8", "metric": "tflops", "value": 500.0},
                {**base, "provider": "fp8", "metric": "cosine", "value": 0.999},
                {**base, "provider": "fp8_guard", "metric": "fp8_guard_estimate", "value": estimate},
                {**base, "provider": "fp8_guard", "metric": "fp8_guard_accepted", "value": float(accepted)},
                {**base, "provider": "fp8_guard", "metric": "fp8_guard_bound", "value": 0.03}]

    claim = "AdaAttention's guard never accepts FP8 where the measured error exceeds the bound"
    fine = case(4096, True, 0.02, 0.025) + case(8192, False, 0.05, 0.06)
    _, verdicts = fp8_section(pd.DataFrame(fine), set())
    v = next(v for v in verdicts if v.claim == claim)
    assert (v.measured, v.verdict) == ("0 of 1 accepted (2 cases)", "holds")
    _, verdicts = fp8_section(pd.DataFrame(fine + case(16384, True, 0.029, 0.031)), set())
    v = next(v for v in verdicts if v.claim == claim)
    assert (v.measured, v.verdict) == ("1 of 2 accepted (3 cases)", "worse than claimed")


def test_the_common_reader_of_real_inputs_reads_what_the_rank_study_writes(tmp_path):
    """experiments/common/real_inputs.py reads the rank study's capture file (so that no study imports another):
    the same path, the same tensors as the writer's own reader, one-line errors for what the file lacks."""
    import torch

    from adaattn_experiments.common import real_inputs
    from adaattn_experiments.rank import minilm

    assert real_inputs.CAPTURE == minilm.CAPTURE and real_inputs.FORMAT == minilm.FORMAT
    assert (real_inputs.HEADS, real_inputs.HEAD_DIM) == (minilm.HEADS, minilm.HEAD_DIM)
    path = Path(__file__).parents[1] / minilm.CAPTURE
    mine, theirs = real_inputs.captured_qkv(128, 0, path), minilm.captured(128, path)[0][0]
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert mine[0].shape == (1, minilm.HEADS, 128, minilm.HEAD_DIM)
    with pytest.raises(RuntimeError, match=r"holds windows of \[128, 512\] and layers \[0, 2, 5\], not 256 and 0"):
        real_inputs.captured_qkv(256, 0, path)
    with pytest.raises(RuntimeError, match="is missing"):
        real_inputs.captured_qkv(128, 0, tmp_path / "none.pt")
