"""The G2 studies (precision G2-T3, rank G2-C1, scaling G2-B, cpu_baseline G2-T1) on the CPU at toy
sizes: their params are validated, every provider runs, the results mean what their names say,
and each report renders from its own results."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pandas as pd
import pytest

from adaattn.bench.harness import Harness
from adaattn.bench.roofline import Ceilings
from adaattn.bench.timing import CpuTimer, KernelTrace
from adaattn.config import ConfigError, load_params, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"


def _params(**overrides):
    """params.yaml with ``{"G2-B.cpu.seq_lens": [64], ...}`` applied; the rank study's real inputs
    (a model run, ``test_minilm.py``) off unless an override sets them."""
    raw = copy.deepcopy(load_raw(PARAMS))
    overrides = {"G2-C1.cpu.real_layers": [], "G2-C1.cpu.real_seq_lens": [], **overrides}
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
    from adaattn_experiments.scaling import STUDY as SCALING

    params, _ = _params(**{"G2-B.cpu.providers": providers})
    with pytest.raises(ValueError, match=r"G2-B\.cpu\.providers must hold .*missing: direct:sdpa_flash$"):
        SCALING.bind("cpu").cases(params, params.targets["cpu"])


def test_precision_study_low_precision_is_less_accurate_and_tf32_is_a_cuda_row():
    from adaattn_experiments.precision import STUDY

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

    from adaattn_experiments.precision import STUDY

    params, _ = _params(**{"G2-T3.cpu.outlier_prob": 0.01, "G2-T3.cpu.outlier_std": 50.0})
    study = STUDY.bind("cpu")
    cases = {c.case_id: c for c in study.cases(params, params.targets["cpu"])}
    x = study.inputs(next(c for i, c in cases.items() if "block-outliers" in i))
    frac = (x.abs() > 6).float().mean().item()
    assert 0.004 < frac < 0.02 and torch.isfinite(x).all()
    x = study.inputs(next(c for i, c in cases.items() if "block-normal" in i))
    assert (x.abs() > 6).sum() == 0


def test_module_providers_share_weights_and_match_the_float64_module(tmp_path):
    from adaattn_experiments.scaling import STUDY as SCALING

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
    from adaattn_experiments.scaling_report import render

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
    from adaattn_experiments.rank import STUDY

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
    from adaattn_experiments.cpu_baseline import STUDY as CPU_BASELINE
    from adaattn_experiments.cpu_baseline_report import render as render_modules
    from adaattn_experiments.precision import STUDY as PRECISION
    from adaattn_experiments.precision_report import render as render_precision
    from adaattn_experiments.rank import STUDY as RANK
    from adaattn_experiments.rank_report import render as render_rank

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
    from adaattn_experiments.cpu_baseline import STUDY as CPU_BASELINE

    params, _ = load_params(PARAMS)
    with pytest.raises(ValueError, match="CPU table"):
        CPU_BASELINE.bind("cuda").cases(params, params.targets["h100"])


def test_rank_goal_reads_both_timings_and_names_the_path(tmp_path):
    """The low-rank goal table at S >= 8192: speedup by time per call and by kernel time, and which
    implementation of each low-rank path ran (from the recorded kernel names)."""
    from adaattn_experiments.rank import STUDY as RANK
    from adaattn_experiments.rank_report import render as render_rank

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
    import adaattn_experiments.rank_report as rank_report
    from adaattn_experiments.rank import STUDY as RANK
    from adaattn_experiments.rank_report import render as render_rank

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


def test_scaling_goal_per_call_is_the_highest_per_round_ratio():
    """The 3% goal by time per call: adaattn's per-round ratio to each direct backend; the goal's
    ratio at a shape is the highest of them (the fastest backend's), judged against 1.03."""
    from adaattn_experiments.scaling_report import _paired_goal

    def row(case, provider, value):
        return {"target": "h100", "case_id": case, "mode": "fwd", "batch": 1, "seq_len": 512, "metric": "paired_ratio",
                "status": "ok", "provider": provider, "value": value, "p20": value - 0.01, "p80": value + 0.01}

    runs = pd.DataFrame([row("a", "direct:sdpa", 1.05), row("a", "direct:math", 0.5),
                         row("b", "direct:sdpa", 1.01), row("b", "direct:sdpa_cudnn", 1.02),
                         row("b", "mha", 1.5)])  # not a direct backend: not the goal's
    goal = _paired_goal(runs).set_index("case_id")
    assert goal.loc["a", "vs"] == "direct:sdpa" and goal.loc["a", "value"] == 1.05
    assert goal.loc["b", "vs"] == "direct:sdpa_cudnn" and goal.loc["b", "value"] == 1.02
    assert (goal["ci_low"] == -math.inf).all() and (goal["ci_high"] == math.inf).all()  # no bounds: unbounded


def _ratio_rows(case, provider, value, lo, hi, metric="paired_ratio", target="h100", reason=""):
    base = {"target": target, "hardware": target.upper(), "case_id": case, "mode": "fwd", "batch": 1, "seq_len": 512,
            "status": "ok", "provider": provider, "p20": value - 0.01, "p80": value + 0.01, "reason": reason}
    return [base | {"metric": metric, "value": value}, base | {"metric": f"{metric}_ci_low", "value": lo},
            base | {"metric": f"{metric}_ci_high", "value": hi}]


def test_scaling_goal_is_decided_by_the_medians_confidence_intervals():
    """A shape is above 1.03 where the interval of its median lies above, within where it lies below (against
    every direct backend: the highest bounds), undecided where it spans 1.03; one shape above: the goal
    worse than claimed; none above and one undecided: inconclusive; all within: holds."""
    from adaattn_experiments.scaling_report import _goal_table, _paired_goal

    above = _ratio_rows("a", "direct:sdpa", 1.06, 1.04, 1.08) + _ratio_rows("a", "direct:math", 0.5, 0.4, 0.6)
    # b's median is highest against sdpa, but the widest bounds are cudnn's: it spans 1.03
    open_ = _ratio_rows("b", "direct:sdpa", 1.02, 1.01, 1.025) + _ratio_rows("b", "direct:sdpa_cudnn", 1.01, 0.98, 1.04)
    within = _ratio_rows("c", "direct:sdpa", 1.0, 0.99, 1.01)
    goal = _paired_goal(pd.DataFrame(above + open_ + within)).set_index("case_id")
    assert goal.loc["b", "vs"] == "direct:sdpa" and (goal.loc["b", "ci_low"], goal.loc["b", "ci_high"]) == (1.01, 1.04)

    def verdict(rows):
        _, (v,) = _goal_table(pd.DataFrame(rows), {})  # no kernel / host: every shape counts (as on a CPU)
        return v

    v = verdict(above + open_ + within)
    assert v.verdict == "worse than claimed" and v.measured.startswith("1 of 3 shapes x modes above 1.03, 1 undecided")
    assert verdict(open_ + within).verdict == "inconclusive"
    assert verdict(within).verdict == "holds"


def test_eager_time_per_call_is_judged_at_gpu_bound_shapes_kernel_and_compiled_time_at_every_shape():
    """On a GPU, the eager time-per-call goal counts a shape only where the fastest direct call's kernel time is
    at least 3x its host time (from the sweep's rows); a host-bound shape above the bound is reported, without a
    goal. Kernel time and compiled time per call count every shape."""
    from adaattn_experiments.scaling_report import _goal_table, gpu_bound

    def sweep(case, kernel, host):
        base = {"target": "h100", "hardware": "H100", "case_id": case, "mode": "fwd", "batch": 1, "seq_len": 512,
                "sweep": "seq", "causal": False, "status": "ok"}
        return [base | {"provider": "direct:sdpa", "metric": m, "value": v}
                for m, v in (("time_ms", max(kernel, host)), ("kernel_ms", kernel), ("host_ms", host))]

    rows = (sweep("gpu", 3.0, 0.5) + sweep("host", 0.02, 0.1)
            + _ratio_rows("gpu", "direct:sdpa", 1.0, 0.99, 1.01) + _ratio_rows("host", "direct:sdpa", 1.2, 1.1, 1.3)
            + _ratio_rows("host", "direct:sdpa", 1.2, 1.1, 1.3, metric="goal_kernel_paired_ratio")
            + _ratio_rows("host", "compiled:direct:sdpa", 1.0, 0.99, 1.01, metric="compiled_paired_ratio"))
    runs = pd.DataFrame(rows)
    bound = gpu_bound(runs)
    assert bound == pytest.approx({("h100", "gpu", "fwd"): 6.0, ("h100", "host", "fwd"): 0.2})
    table, verdicts = _goal_table(runs, bound)
    by = {v.claim.split(", ", 1)[1]: v for v in verdicts}
    eager = by["time per call, eager, side by side (shuffled rounds)"]
    assert eager.verdict == "holds" and eager.measured.startswith("0 of 1 shapes") and "GPU-bound" in eager.reason
    assert "(host-bound: no goal)" in table.set_index("kernel / host").loc["0.2", "eager"]
    assert by["kernel time, eager (the calls interleaved in one profiler trace)"].verdict == "worse than claimed"
    compiled = by["time per call, compiled whole (mode in the table), side by side"]
    assert compiled.verdict == "holds" and "vs sdpa" in table.set_index("kernel / host").loc["0.2", "compiled"]


def test_first_calls_and_the_stack_check_are_judged_on_their_bounds():
    from adaattn_experiments.scaling_report import _first_calls, _stack

    base = {"target": "h100", "hardware": "H100", "mode": "fwd", "batch": 1, "seq_len": 512, "status": "ok"}
    rows = [base | {"case_id": c, "provider": p, "metric": m, "value": v}
            for c, p, m, v in (("a", "adaattn", "first_call_s", 0.4), ("a", "direct:sdpa_cudnn", "first_call_s", 0.1),
                               ("a", "adaattn", "first_call_measure_s", 0.25),
                               ("b", "adaattn", "first_call_s", 0.9), ("b", "direct:sdpa", "first_call_s", 0.3))]
    table, (v,) = _first_calls(pd.DataFrame(rows))
    assert v.verdict == "worse than claimed" and v.measured.startswith("1 of 2 shapes x modes over; worst 0.600 s")
    assert list(table["difference s"]) == ["0.3", "0.6"]
    _, (v,) = _first_calls(pd.DataFrame(rows[:3]))
    assert v.verdict == "holds"
    stack = [base | {"case_id": "G2-B/stack-12x", "mode": "fwd_bwd", "provider": p, "metric": "stack_side_by_side_ms",
                     "value": ms} for p, ms in (("stack:adaattn", 20.0), ("stack:sdpa", 20.1))]
    for lo, hi, expect in ((0.99, 1.01, "holds"), (1.01, 1.03, "inconclusive"), (1.03, 1.05, "worse than claimed")):
        ratio = _ratio_rows("G2-B/stack-12x", "stack:sdpa", (lo + hi) / 2, lo, hi, metric="stack_paired_ratio")
        _, (v,) = _stack(pd.DataFrame(stack + [r | {"mode": "fwd_bwd"} for r in ratio]))
        assert v.verdict == expect, (lo, hi, v)


def test_scaling_compiles_the_goal_and_the_stack_where_set(tmp_path, monkeypatch):
    """With compiled_backends and a stack set (here on the CPU, inductor's default mode), the compiled goal's
    providers and the stack's take side-by-side rounds of their own, and the report judges both."""
    from adaattn_experiments.scaling import STUDY as SCALING
    from adaattn_experiments.scaling_report import render

    params, _ = _params(**{"G2-B.cpu.side_by_side": {"budget_ms": 1, "min_rounds": 3, "max_rounds": 4},"G2-B.cpu.seq_lens": [32], "G2-B.cpu.batches": [1], "G2-B.cpu.batch_sweep_seq_len": 32,
                           "G2-B.cpu.embed_dim": 32, "G2-B.cpu.modes": ["fwd_bwd"],
                           "G2-B.cpu.providers": ["adaattn", "direct:sdpa", "direct:sdpa_flash", "direct:sdpa_math",
                                                  "direct:math"],
                           "G2-B.cpu.compiled_backends": ["sdpa", "xformers"], "G2-B.cpu.compile_mode": "default",
                           "G2-B.cpu.stack": {"layers": 2, "embed_dim": 32, "heads": 4, "mlp_ratio": 2, "batch": 1,
                                              "seq_len": 16, "dtype": "fp32",
                                              "side_by_side": {"budget_ms": 1, "min_rounds": 3, "max_rounds": 4}}})
    df = _run(SCALING, params)
    comp = df[df.metric == "compiled_side_by_side_ms"]
    assert set(comp.provider) == {"compiled:adaattn", "compiled:direct:sdpa"}  # xformers: not here, not traced
    assert (comp.status == "ok").all() and (comp.kernel == "default").all()
    assert set(df[df.metric == "compiled_paired_ratio"].provider) == {"compiled:direct:sdpa"}
    stack = df[df.metric == "stack_side_by_side_ms"]
    assert set(stack.provider) == {"stack:adaattn", "stack:sdpa"} and (stack.status == "ok").all()
    g2_b = render(df, tmp_path)[0]
    claims = [v.claim for v in g2_b.verdicts]
    assert any("compiled whole" in c for c in claims) and any(c.startswith("stack check") for c in claims), claims


def test_scaling_takes_the_kernel_time_goal(tmp_path, monkeypatch):
    """Where the check is set (the GPU; here the CPU, with the kernel trace replaced: it needs CUDA), adaattn and
    every direct backend get one trace per shape and mode: a goal_kernel_ms row each, adaattn's naming the backend
    its manager ranked first, and adaattn's over each backend's round by round with its median's interval."""
    import adaattn_experiments.scaling as mod
    from adaattn_experiments.scaling import STUDY as SCALING
    from adaattn_experiments.scaling_report import render

    traced = []

    def fake_trace(fns, calls):  # each call made for real; the "kernel time" of function i is 1 + i ms
        for f in fns:
            f()
        traced.append(len(fns))
        return KernelTrace([[1.0 + i] * calls for i in range(len(fns))])

    monkeypatch.setattr(mod, "kernel_times_ms", fake_trace)
    params, _ = _params(**{"G2-B.cpu.goal_kernel_calls": 8,
                           "G2-B.cpu.side_by_side": {"budget_ms": 1, "min_rounds": 3, "max_rounds": 4},
                           "G2-B.cpu.seq_lens": [64], "G2-B.cpu.batches": [2], "G2-B.cpu.batch_sweep_seq_len": 32,
                           "G2-B.cpu.embed_dim": 64})
    df = _run(SCALING, params)
    goal = df[df.metric == "goal_kernel_ms"]
    direct = sorted(p for p in params.g2_b.cpu.providers if p.startswith("direct:"))
    for (case, mode), g in goal.groupby(["case_id", "mode"]):
        assert sorted(g.provider) == sorted(["adaattn", *direct]), (case, mode)
        assert (g.status == "ok").all()
        assert g[g.provider == "adaattn"].value.item() == 1.0  # listed first in its trace
        assert g[g.provider == "adaattn"].kernel.item() in {p.removeprefix("direct:") for p in direct}
    assert len(traced) == goal.groupby(["case_id", "mode"]).ngroups == 4  # two shapes x fwd, fwd_bwd
    paired = df[df.metric.str.startswith("goal_kernel_paired_ratio")]
    for (case, mode), g in paired.groupby(["case_id", "mode"]):
        order = goal[(goal.case_id == case) & (goal["mode"] == mode)].provider.tolist()  # the trace's order
        for i, p in enumerate(order[1:], start=1):
            r = g[g.provider == p].set_index("metric").value
            assert r["goal_kernel_paired_ratio"] == pytest.approx(1 / (1 + i))
            assert r["goal_kernel_paired_ratio_ci_low"] == r["goal_kernel_paired_ratio_ci_high"] == pytest.approx(1 / (1 + i))
    g2_b = render(df, tmp_path)[0]
    (kernel,) = [v for v in g2_b.verdicts if "kernel time" in v.claim]
    assert kernel.verdict == "holds" and kernel.measured.startswith("0 of 4 shapes x modes above 1.03")


def test_goal_is_decided_against_the_backends_still_in_the_rounds():
    """A direct backend that left the side-by-side rounds (another faster than it with confidence) is not the
    fastest: its wide interval from those few rounds does not decide the goal. Here adaattn over the one that
    left spans 1.03 (40 rounds), over the one still in lies below it: the shape holds; with the status ``ok``
    instead of ``outpaced``, the same rows leave it undecided."""
    from adaattn_experiments.scaling_report import _goal_table, _paired_goal

    base = {"target": "h100", "case_id": "c", "mode": "fwd_bwd", "batch": 4, "seq_len": 1024, "p20": 0.9, "p80": 1.1}
    rows = []
    for provider, (v, lo, hi), status in (("direct:sdpa", (1.021, 0.900, 1.050), "outpaced"),
                                          ("direct:sdpa_efficient", (1.012, 1.006, 1.018), "ok")):
        rows += [base | {"metric": "paired_ratio", "provider": provider, "value": v, "status": status},
                 base | {"metric": "paired_ratio_ci_low", "provider": provider, "value": lo, "status": status},
                 base | {"metric": "paired_ratio_ci_high", "provider": provider, "value": hi, "status": status}]
    runs = pd.DataFrame(rows)
    (goal,) = _paired_goal(runs).to_dict("records")
    assert goal["vs"] == "direct:sdpa_efficient" and (goal["ci_low"], goal["ci_high"]) == (1.006, 1.018)
    _, (v,) = _goal_table(runs.assign(hardware="H100"), {})
    assert v.verdict == "holds"
    _, (v,) = _goal_table(runs.assign(hardware="H100", status="ok"), {})  # both counted: 1.050 spans 1.03
    assert v.verdict == "inconclusive"


def test_g2_t2_speed_is_read_on_time_per_call_and_kernel_time():
    """G2-T2's speed line (standard over adaattn, 2-4x above 1024 tokens): one verdict per basis; where the
    sweep's time per call and the kernel time read different verdicts the claim is inconclusive, and a target
    without kernel times (a CPU) is read on time per call alone."""
    from adaattn_experiments.scaling_report import _g2_t2

    def pivot(target, hw, speeds):  # seq_len -> standard / adaattn
        return pd.DataFrame([{"target": target, "hardware": hw, "case_id": f"s{s}", "sweep": "seq", "batch": 1,
                              "seq_len": s, "causal": False, "mode": "fwd", "standard": x, "adaattn": 1.0}
                             for s, x in speeds.items()])

    t = pd.concat([pivot("h100", "H100", {2048: 2.5, 4096: 3.0}), pivot("h200", "H200", {2048: 4.5, 8192: 5.0}),
                   pivot("cpu", "EPYC", {512: 1.2, 2048: 3.5})])
    kern = pd.concat([pivot("h100", "H100", {2048: 1.8, 4096: 3.0}), pivot("h200", "H200", {2048: 5.2, 8192: 6.0})])
    mem = t.assign(standard=2.0, adaattn=1.0)
    speed = {v.hardware: v for v in _g2_t2(t, mem, kern).verdicts if v.claim.startswith("speed")}
    # the median over the sweep's shapes, its interval the range of so few: the kernel time's spans 2x
    assert speed["H100"].verdict == "inconclusive"
    assert speed["H100"].reason == "the two times read different verdicts: time per call holds, kernel time inconclusive"
    assert speed["H100"].measured == (
        "median 2.75x (CI 2.5-3) by time per call (2.50-3.00x; standard / adaattn, forward, S = 2048, 4096); "
        "median 2.4x (CI 1.8-3) by kernel time (1.80-3.00x; standard / adaattn, forward, S = 2048, 4096)")
    assert speed["H200"].verdict == "better than claimed" and speed["H200"].reason == ""
    assert speed["EPYC"].verdict == "holds" and speed["EPYC"].measured == (
        "median 3.5x by time per call (3.50-3.50x; standard / adaattn, forward, S = 2048)")


def test_a_point_both_sweeps_share_is_in_both():
    """Measured once (tagged with the batch sweep), B=1 S=1024 belongs to the sequence sweep at B=1 too."""
    from adaattn_experiments.scaling_report import in_sweep

    rows = [("batch", 1, 1024), ("batch", 4, 1024), ("seq", 1, 512), ("seq", 1, 2048)]
    frame = pd.DataFrame([{"target": "h100", "sweep": w, "batch": b, "seq_len": s} for w, b, s in rows])
    assert sorted(in_sweep(frame, "seq")["seq_len"]) == [512, 1024, 2048]
    assert sorted(in_sweep(frame, "batch")["batch"]) == [1, 4]
