"""The G2 studies (precision G2-T3, rank G2-C1, scaling G2-B, cpu_baseline G2-T1) on the CPU at toy
sizes: their params are validated, every provider runs, the results mean what their names say,
and each report renders from its own results."""

from __future__ import annotations

import copy
import math
import re
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
                **(study.utilization(params, params.targets["cpu"]) if hasattr(study, "utilization") else {}))
    rows = h.run(study, cases)
    extra = study.extra_rows(params, params.targets["cpu"]) if hasattr(study, "extra_rows") else []
    prov = {"target": "cpu", "hardware": "test cpu"}
    return pd.DataFrame([{**r, **prov} for r in rows + extra])


@pytest.mark.parametrize("key, value, message", [
    ("G2-B.cpu.providers", ["mha", "direct:nope"], "allowed: mha, standard"),
    ("G2-B.cpu.manager_backends", ["sdpa", "cuda_magic"], "allowed: flash_attn"),
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
    from adaattn_experiments.ada_modules import SCALING

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
    from adaattn_experiments.ada_modules import SCALING

    params, _ = _params(**{"G2-B.cpu.seq_lens": [64], "G2-B.cpu.batches": [2], "G2-B.cpu.batch_sweep_seq_len": 32,
                           "G2-B.cpu.embed_dim": 64, "G2-B.cpu.causal": [False, True]})
    df = _run(SCALING, params)
    t = df[df.metric == "time_ms"]
    assert (t.status == "ok").all(), t[t.status != "ok"][["provider", "status", "reason"]]
    err = df[(df.metric == "rel_l2")]
    assert set(err.provider) == set(params.g2_b.cpu.providers) and (err.value < 1e-5).all(), err[["provider", "value"]]
    ranking = df[df.metric == "manager_ranking"]
    assert len(ranking) and ranking.kernel.str.contains(" > ").all()
    looks = df[df.metric == "manager_looks"]  # the paired rounds' first look at least, of signatures ranked
    assert len(looks) and set(looks.case_id) <= set(ranking.case_id) and looks.kernel.str.startswith("0 s: ").all()
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
    timed = ok[ok.provider != "adaattn"].groupby(["case_id", "mode"])["provider"].apply(set)
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
    from adaattn_experiments.ada_modules_report import render

    g2_b = render("scaling", df, tmp_path)[0]
    bases = [v.measured.split(":")[0] for v in g2_b.verdicts if v.claim.startswith("goal:")]
    assert any("time per call, side by side" in b for b in bases), bases
    assert "adaattn / fastest direct, per round" in g2_b.markdown
    # the host's speed through the run: probes before the study's steps, in the report and the per-call verdict
    probes = df[df.metric == "host_probe_ms"]
    assert len(probes) and (probes.value > 0).all() and probes.reason.iloc[0].startswith("0 s after the first probe, before G2-B/")
    assert "### The host's speed through the run" in g2_b.markdown
    per_call = [v for v in g2_b.verdicts if v.claim.startswith("goal:") and "side by side" in v.measured]
    assert per_call and all("the host probe's slowest was" in v.reason for v in per_call)


def test_host_probe_is_taken_at_most_every_few_seconds_and_summed_up_per_target():
    from adaattn_experiments import ada_modules as am
    from adaattn_experiments.ada_modules_report import host_probes

    study = am.SCALING.bind("cpu")
    study._probe("a")
    study._probe("b")
    assert [p[2] for p in study._probes] == ["a"]
    study._t0 -= am.HOST_PROBE_EVERY_S  # as if that long had passed since the first
    study._probe("c")
    assert [p[2] for p in study._probes] == ["a", "c"] and all(p[1] > 0 for p in study._probes)
    rows = pd.DataFrame({"target": ["h100"] * 3 + ["cpu"], "metric": "host_probe_ms", "value": [2.0, 5.0, 3.0, 1.0],
                         "reason": ["0 s after", "7 s after", "12 s after", "0 s after"]})
    t = host_probes(rows).set_index("target")
    assert t.loc["h100", "probes"] == 3 and float(t.loc["h100", "slowest / fastest"]) == 2.5
    assert float(t.loc["h100", "over s"]) == 12 and float(t.loc["h100", "median ms"]) == 3.0
    assert t.loc["cpu", "probes"] == 1 and float(t.loc["cpu", "slowest / fastest"]) == 1.0


def test_rank_study_policy_estimators_and_oracle(monkeypatch):
    """The policy's paths by error, then by speed against the exact path. The speed check's timings are
    replaced (each call run once): under TRITON_INTERPRET the pooled path runs interpreted Triton on the CPU,
    hundreds of times slower than SDPA, and the policy would rightly keep the exact path."""
    from adaattn.attention.kernel_manager import AttentionKernelManager
    from adaattn.attention.rank import Speed
    from adaattn_experiments.rank import STUDY

    timed = []

    def time_calls(self, calls, device):
        timed.append([n for n, c in calls.items() if c() is not None])
        return {n: 1.0 if n == "low-rank" else 2.0 for n in calls}

    monkeypatch.setattr(AttentionKernelManager, "time_calls", time_calls)
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
    assert STUDY._why_exact(seen) == ("16 landmarks (pooled, sampled rel L2 0.0496): 0.413 ms per call, not faster "
                                      "than sdpa's 0.2 ms")
    assert pol.loc["spread-r8", "value"] == 0 and "rel L2 pooled" in pol.loc["spread-r8", "reason"]
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
    from adaattn_experiments.ada_modules import CPU_BASELINE
    from adaattn_experiments.ada_modules_report import render as render_modules
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
    (section,) = render_modules("cpu_baseline", df, tmp_path)
    assert " ± " in section.markdown and section.table_id == "G2-T1"
    assert "adaattn / mha, per round" in section.markdown
    mha = paired[paired.provider == "mha"].set_index("case_id")
    for v in section.verdicts:  # the verdict is on the median per-round ratio (B1_S32 and B2_S16 are not guide points)
        assert f"{mha.value.iloc[0]:.3f}" in v.measured or f"{mha.value.iloc[-1]:.3f}" in v.measured


def test_g2_t1_is_a_cpu_table():
    from adaattn_experiments.ada_modules import CPU_BASELINE

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
    assert per_call["nystrom"].measured.startswith("1.25-4.00x over 2 points; 1 below")
    assert per_call["nystrom"].verdict == "does not hold"
    assert "at 1 of 2 points (16-16 landmarks, solved by batched products) the r x r solve alone" in \
        per_call["nystrom"].reason
    # the pooled path solves nothing: no solve floor in its reason
    assert per_call["pooled"].measured.startswith("5.00-10.00x over 2 points; 0 below")
    assert per_call["pooled"].verdict == "holds" and "solve" not in per_call["pooled"].reason
    goal = section.markdown.split("### Goal")[1]
    assert "pinv products ms (cuBLAS bf16)" in goal and "2x budget ms" in goal


def test_scaling_goal_per_call_is_the_highest_per_round_ratio():
    """The 3% goal by time per call: adaattn's per-round ratio to each direct backend; the goal's
    ratio at a shape is the highest of them (the fastest backend's), judged against 1.03."""
    from adaattn_experiments.ada_modules_report import _paired_goal

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


def test_scaling_goal_per_call_is_decided_by_the_medians_confidence_intervals():
    """A shape is above 1.03 where the interval of its median lies above, within where it lies below (against
    every direct backend: the highest bounds), undecided where it spans 1.03; one shape above: the goal
    does not hold; none above and one undecided: inconclusive; all within: holds."""
    from adaattn_experiments.ada_modules_report import GOAL_TIMES, _goal_verdicts, _paired_goal, _scaling_goal_rows

    def rows(case, provider, value, lo, hi):
        base = {"target": "h100", "case_id": case, "mode": "fwd", "batch": 1, "seq_len": 512, "status": "ok",
                "provider": provider, "p20": value - 0.01, "p80": value + 0.01}
        return [base | {"metric": "paired_ratio", "value": value},
                base | {"metric": "paired_ratio_ci_low", "value": lo},
                base | {"metric": "paired_ratio_ci_high", "value": hi}]

    above = rows("a", "direct:sdpa", 1.06, 1.04, 1.08) + rows("a", "direct:math", 0.5, 0.4, 0.6)
    # b's median is highest against sdpa, but the widest bounds are cudnn's: it spans 1.03
    open_ = rows("b", "direct:sdpa", 1.02, 1.01, 1.025) + rows("b", "direct:sdpa_cudnn", 1.01, 0.98, 1.04)
    within = rows("c", "direct:sdpa", 1.0, 0.99, 1.01)
    goal = _paired_goal(pd.DataFrame(above + open_ + within)).set_index("case_id")
    assert goal.loc["b", "vs"] == "direct:sdpa" and (goal.loc["b", "ci_low"], goal.loc["b", "ci_high"]) == (1.01, 1.04)

    def verdict(frame_rows):
        t = pd.DataFrame({"target": ["h100"], "hardware": ["H100"]})
        (g,) = _scaling_goal_rows(pd.DataFrame(frame_rows))
        assert g["time"] == GOAL_TIMES["paired_ratio"]
        (v,) = _goal_verdicts([g], t)
        return g, v

    g, v = verdict(above + open_ + within)
    assert (g["above 1.03"], g["undecided"], v.verdict) == (1, 1, "does not hold")
    g, v = verdict(open_ + within)
    assert (g["above 1.03"], g["undecided"], v.verdict) == (0, 1, "inconclusive") and "undecided" in v.measured
    g, v = verdict(within)
    assert (g["above 1.03"], g["undecided"], v.verdict) == (0, 0, "holds")


def test_scaling_times_the_goal_again_under_host_load(tmp_path, monkeypatch):
    """Where host loads are set, the goal's providers take side-by-side rounds once more per load, every call
    preceded by that much host work (so no call of a loaded round is shorter than the load); the goal's own
    rounds are load 0, and the report keeps them apart."""
    from adaattn_experiments.ada_modules import SCALING, ModuleStudy
    from adaattn_experiments.ada_modules_report import render

    monkeypatch.setattr(ModuleStudy, "host_loads_us", {("G2-B", "cpu"): (2000.0,)})
    monkeypatch.setattr(ModuleStudy, "host_load_rounds", (3, 4))
    monkeypatch.setattr(ModuleStudy, "side_by_side_rounds", {("G2-B", "cpu"): (3, 4)})
    params, _ = _params(**{"G2-B.cpu.seq_lens": [64], "G2-B.cpu.batches": [2], "G2-B.cpu.batch_sweep_seq_len": 32,
                           "G2-B.cpu.embed_dim": 64, "G2-B.cpu.modes": ["fwd"]})
    df = _run(SCALING, params)
    rounds = df[df.metric == "side_by_side_ms"]  # a provider pruned (too slow in warm-up) at one load has a row too
    assert set(rounds.host_load_us) == {0.0, 2000.0}
    by_load = rounds.groupby("host_load_us")
    assert by_load["case_id"].apply(set)[0.0] == by_load["case_id"].apply(set)[2000.0]  # every goal shape, both
    assert by_load["provider"].apply(set)[0.0] == by_load["provider"].apply(set)[2000.0]
    side = rounds[rounds.status == "ok"]
    assert (side[side.host_load_us == 2000.0].value >= 2.0).all()  # ms: the load is in every call
    assert df[df.metric == "time_ms"].host_load_us.isna().all()  # the sweep's own rows carry no load
    assert set(df[df.metric == "paired_ratio"].host_load_us) == {0.0, 2000.0}
    g2_b = render("scaling", df, tmp_path)[0]
    under_md = g2_b.markdown.split("### Goal under host load")[1].split("###")[0]
    assert re.search(r"\|\s+0 us\s+\|\s+2000 us\s+\|", under_md), under_md
    under = [v for v in g2_b.verdicts if "under host load (2000 us" in v.claim]
    assert len(under) == 1 and "(shape, mode, load) points" in under[0].measured
    # the goal's own verdict counts load 0 only: one ratio per shape and mode
    per_call = [v for v in g2_b.verdicts if v.claim.endswith("called directly") and "side by side" in v.measured]
    assert len(per_call) == 1 and " of 2 above" in per_call[0].measured


def test_module_study_lets_its_managers_look_again_only_in_side_by_side_warm_ups(monkeypatch):
    """A manager's later look (paired rounds again) would count as a call's time and memory: the module studies
    hold the looks through the sweep's measured calls and the side-by-side rounds, and let them run only in the
    one call ``_warm_setup`` makes before a provider's side-by-side warm-up."""
    import adaattn_experiments.ada_modules as am
    from adaattn.attention.kernel_manager import AttentionKernelManager

    asked, inside = [], {"warm": False}
    ranking, warm_setup = AttentionKernelManager.ranking, am.ModuleStudy._warm_setup

    def spy_ranking(self, *a, **k):
        asked.append((self.hold_looks, inside["warm"]))
        return ranking(self, *a, **k)

    def spy_warm_setup(self, *a, **k):
        inside["warm"] = True
        try:
            return warm_setup(self, *a, **k)
        finally:
            inside["warm"] = False

    monkeypatch.setattr(AttentionKernelManager, "ranking", spy_ranking)
    monkeypatch.setattr(am.ModuleStudy, "_warm_setup", spy_warm_setup)
    params, _ = _params(**{"G2-B.cpu.seq_lens": [64], "G2-B.cpu.batches": [2], "G2-B.cpu.batch_sweep_seq_len": 64,
                           "G2-B.cpu.embed_dim": 64, "G2-B.cpu.causal": [False]})
    study = am.SCALING.bind("cpu")
    Harness("cpu", CpuTimer(1, 2), Ceilings(10.0, 1.0, "fp32", 64)).run(study, study.cases(params, params.targets["cpu"]))
    study.extra_rows(params, params.targets["cpu"])
    assert any(not held for held, _ in asked) and all(held or warm for held, warm in asked)
    assert study._managers and all(m.hold_looks for m in study._managers.values())


def test_scaling_takes_the_kernel_time_goal_for_a_manager_ranking_by_gpu_time(tmp_path, monkeypatch):
    """Where the check is set (the GPU; here the CPU, with the kernel trace replaced: it needs CUDA), adaattn_gpu
    (a manager made with objective "gpu") and every direct backend get one trace per shape and mode: a
    goal_kernel_ms row each, adaattn_gpu's naming the backend its manager ranked first, that manager's rankings
    among the manager rows, and a kernel-time verdict of its own."""
    import adaattn_experiments.ada_modules as mod
    from adaattn_experiments.ada_modules import SCALING, ModuleStudy
    from adaattn_experiments.ada_modules_report import GOAL_TIMES, render

    traced = []

    def fake_trace(fns, calls):  # each call made for real; the "kernel time" of function i is 1 + i ms
        for f in fns:
            f()
        traced.append(len(fns))
        return KernelTrace([[1.0 + i] * calls for i in range(len(fns))])

    monkeypatch.setattr(mod, "kernel_times_ms", fake_trace)
    monkeypatch.setattr(ModuleStudy, "gpu_objective", frozenset({("G2-B", "cpu")}))
    monkeypatch.setattr(ModuleStudy, "side_by_side_rounds", {("G2-B", "cpu"): (3, 4)})
    params, _ = _params(**{"G2-B.cpu.seq_lens": [64], "G2-B.cpu.batches": [2], "G2-B.cpu.batch_sweep_seq_len": 32,
                           "G2-B.cpu.embed_dim": 64})
    df = _run(SCALING, params)
    goal = df[df.metric == "goal_kernel_ms"]
    direct = sorted(p for p in params.g2_b.cpu.providers if p.startswith("direct:"))
    for (case, mode), g in goal.groupby(["case_id", "mode"]):
        assert sorted(g.provider) == sorted(["adaattn_gpu", *direct]), (case, mode)
        assert (g.status == "ok").all()
        assert g[g.provider == "adaattn_gpu"].value.item() == 1.0  # listed first in its trace
        assert g[g.provider == "adaattn_gpu"].kernel.item() in params.g2_b.cpu.manager_backends
    assert len(traced) == goal.groupby(["case_id", "mode"]).ngroups == 4  # two shapes x fwd, fwd_bwd
    # adaattn_gpu's kernel time over each direct backend's, round by round, with its median's interval
    paired = df[df.metric.str.startswith("goal_kernel_paired_ratio")]
    for (case, mode), g in paired.groupby(["case_id", "mode"]):
        order = goal[(goal.case_id == case) & (goal["mode"] == mode)].provider.tolist()  # the trace's order
        for i, p in enumerate(order[1:], start=1):
            r = g[g.provider == p].set_index("metric").value
            assert r["goal_kernel_paired_ratio"] == pytest.approx(1 / (1 + i))
            assert r["goal_kernel_paired_ratio_ci_low"] == r["goal_kernel_paired_ratio_ci_high"] == pytest.approx(1 / (1 + i))
    ranked = df[df.metric == "manager_ranking"]
    assert set(ranked.provider) == {"adaattn", "adaattn_gpu"}
    assert ranked[ranked.provider == "adaattn_gpu"].unit.str.contains("ranked by gpu").all()
    g2_b = render("scaling", df, tmp_path)[0]
    gpu = [v for v in g2_b.verdicts if "objective gpu" in v.claim]
    assert len(gpu) == 1 and gpu[0].measured.startswith(GOAL_TIMES["goal_kernel_ms"])
    assert gpu[0].verdict == "holds" and " 0 of 4 above" in gpu[0].measured  # 1 ms against the directs' 2 ms and up
    assert gpu[0].reason.startswith("a shape is above where the 95% confidence interval of the median over the rounds")
    assert "| adaattn_gpu " in g2_b.markdown  # its rankings, in the manager table


def test_kernel_time_goal_is_decided_on_the_rounds_interval(tmp_path, monkeypatch):
    """adaattn_gpu's kernel time over the fastest direct backend's, 1.06 in 16 of 30 rounds and 1.00 in 14: its
    median (1.06) is above the bound, but the interval of the median of the per-round ratios spans it, so the
    shapes are undecided and the verdict inconclusive, not "does not hold"."""
    import adaattn_experiments.ada_modules as mod
    from adaattn_experiments.ada_modules import SCALING, ModuleStudy
    from adaattn_experiments.ada_modules_report import render

    def fake_trace(fns, calls):
        assert calls == ModuleStudy.goal_kernel_calls == 30
        for f in fns:
            f()
        mine = [1.06 if j % 15 < 8 else 1.0 for j in range(calls)]  # 16 x 1.06, 14 x 1.00
        return KernelTrace([mine] + [[1.0 + i] * calls for i in range(len(fns) - 1)])

    monkeypatch.setattr(mod, "kernel_times_ms", fake_trace)
    monkeypatch.setattr(ModuleStudy, "gpu_objective", frozenset({("G2-B", "cpu")}))
    monkeypatch.setattr(ModuleStudy, "side_by_side_rounds", {("G2-B", "cpu"): (3, 4)})
    params, _ = _params(**{"G2-B.cpu.seq_lens": [64], "G2-B.cpu.batches": [2], "G2-B.cpu.batch_sweep_seq_len": 64,
                           "G2-B.cpu.embed_dim": 64, "G2-B.cpu.modes": ["fwd"]})
    df = _run(SCALING, params)
    goal = df[df.metric == "goal_kernel_ms"]
    assert (goal[goal.provider == "adaattn_gpu"].value / goal[goal.provider != "adaattn_gpu"].groupby(
        goal.case_id).value.min().values > 1.03).all()  # by the medians alone: above
    gpu = [v for v in render("scaling", df, tmp_path)[0].verdicts if "objective gpu" in v.claim]
    assert len(gpu) == 1 and gpu[0].verdict == "inconclusive", gpu
    n = goal.case_id.nunique()
    assert f" 0 of {n} above 1.03, {n} undecided" in gpu[0].measured


def test_goal_under_host_load_finds_whether_one_backend_holds_at_every_load():
    """Per shape: adaattn's ratio to the fastest direct backend at each load, and the backend whose worst
    ratio to the fastest over the loads is lowest, from the paired ratios (not the backends' median times: a
    backend that left the rounds early has its median from other rounds than the rest); where even that one
    is above 1.03, the goal's verdict says no backend holds the bound at every load at that shape."""
    from adaattn_experiments.ada_modules_report import GOAL_TIMES, _goal_verdicts, _load_rows, _load_verdicts
    from adaattn_experiments.ada_modules_report import _scaling_goal_rows

    def group(case, load, ms, ratio):  # ms: direct backend -> median; ratio: adaattn over each (p50, ci_lo, ci_hi)
        base = {"target": "h100", "case_id": case, "mode": "fwd", "batch": 16, "seq_len": 1024, "status": "ok",
                "host_load_us": load, "p20": 0.0, "p80": 9.0}
        out = [base | {"metric": "side_by_side_ms", "provider": p, "value": v} for p, v in ms.items()]
        for p, (v, lo, hi) in ratio.items():
            out += [base | {"metric": "paired_ratio", "provider": p, "value": v},
                    base | {"metric": "paired_ratio_ci_low", "provider": p, "value": lo},
                    base | {"metric": "paired_ratio_ci_high", "provider": p, "value": hi}]
        return out

    # "flip": cuDNN fastest without load, flash 5% ahead of it at 200 us: no backend within 3% at both
    flip = (group("flip", 0.0, {"direct:sdpa_cudnn": 0.148, "direct:sdpa_flash": 0.193},
                  {"direct:sdpa_cudnn": (1.06, 1.05, 1.07), "direct:sdpa_flash": (0.81, 0.8, 0.82)})
            + group("flip", 200.0, {"direct:sdpa_cudnn": 0.42, "direct:sdpa_flash": 0.40},
                    {"direct:sdpa_cudnn": (1.0, 0.99, 1.01), "direct:sdpa_flash": (1.05, 1.04, 1.06)}))
    # "steady": efficient within 2% of the fastest at both loads
    steady = (group("steady", 0.0, {"direct:sdpa_efficient": 0.102, "direct:sdpa_flash": 0.100},
                    {"direct:sdpa_efficient": (1.0, 0.99, 1.01), "direct:sdpa_flash": (1.01, 1.0, 1.02)})
              + group("steady", 200.0, {"direct:sdpa_efficient": 0.30, "direct:sdpa_flash": 0.31},
                      {"direct:sdpa_efficient": (1.0, 0.99, 1.01), "direct:sdpa_flash": (0.97, 0.96, 0.98)}))
    runs = pd.DataFrame(flip + steady)
    main, loaded = runs[runs.host_load_us == 0], runs[runs.host_load_us > 0]
    rows = {r["per_load"][0.0]["case_id"]: r for r in _load_rows(main, loaded)}
    assert rows["flip"]["per_load"][0.0]["vs"] == "direct:sdpa_cudnn"
    assert rows["flip"]["per_load"][200.0]["vs"] == "direct:sdpa_flash"
    assert rows["flip"]["single"] == "direct:sdpa_cudnn" and rows["flip"]["single_worst"] == pytest.approx(1.05)
    assert rows["steady"]["single"] == "direct:sdpa_efficient" and rows["steady"]["single_worst"] == pytest.approx(1.01)
    # "drift": flash left the rounds early, in a fast spell: its median time is the lower, though efficient
    # outpaced it round by round; the paired ratios put efficient fastest at both loads
    drift = pd.DataFrame(group("drift", 0.0, {"direct:sdpa_efficient": 0.164, "direct:sdpa_flash": 0.116},
                               {"direct:sdpa_efficient": (1.02, 1.0, 1.03), "direct:sdpa_flash": (0.97, 0.96, 0.98)})
                         + group("drift", 200.0, {"direct:sdpa_efficient": 0.30, "direct:sdpa_flash": 0.31},
                                 {"direct:sdpa_efficient": (1.0, 0.99, 1.01), "direct:sdpa_flash": (0.97, 0.96, 0.98)}))
    (d,) = _load_rows(drift[drift.host_load_us == 0], drift[drift.host_load_us > 0])
    assert d["single"] == "direct:sdpa_efficient" and d["single_worst"] == pytest.approx(1.0)
    t = pd.DataFrame({"target": ["h100"], "hardware": ["H100"]})
    load_rows = _load_rows(main, loaded)
    (under,) = _load_verdicts(load_rows, t)
    assert under.verdict == "does not hold" and "1 of 2 (shape, mode, load) points above" in under.measured
    assert "At 1 of 2 shapes x modes one direct backend" in under.measured
    (g,) = _scaling_goal_rows(main)
    assert g["time"] == GOAL_TIMES["paired_ratio"] and g["above 1.03"] == 1
    (v,) = _goal_verdicts([g], t, load_rows)
    assert "at 1 of the 1 shapes above no direct backend is within the bound at every load" in v.reason


def test_goal_is_decided_against_the_backends_still_in_the_rounds():
    """A direct backend that left the side-by-side rounds (another faster than it with confidence) is not the
    fastest: its wide interval from those few rounds does not decide the goal. Here adaattn over the one that
    left spans 1.03 (40 rounds), over the one still in lies below it: the shape holds; with the reason gone,
    the same rows leave it undecided."""
    from adaattn_experiments.ada_modules_report import _paired_goal, _scaling_goal_rows
    from adaattn_experiments.side_by_side import why_left

    base = {"target": "h100", "case_id": "c", "mode": "fwd_bwd", "batch": 4, "seq_len": 1024, "status": "ok",
            "p20": 0.9, "p80": 1.1, "reason": ""}
    left = why_left(40, "direct:sdpa_efficient")
    rows = []
    for provider, (v, lo, hi), reason in (("direct:sdpa", (1.021, 0.900, 1.050), left),
                                          ("direct:sdpa_efficient", (1.012, 1.006, 1.018), "")):
        rows += [base | {"metric": "paired_ratio", "provider": provider, "value": v, "reason": reason},
                 base | {"metric": "paired_ratio_ci_low", "provider": provider, "value": lo, "reason": reason},
                 base | {"metric": "paired_ratio_ci_high", "provider": provider, "value": hi, "reason": reason}]
    runs = pd.DataFrame(rows)
    (goal,) = _paired_goal(runs).to_dict("records")
    assert goal["vs"] == "direct:sdpa_efficient" and (goal["ci_low"], goal["ci_high"]) == (1.006, 1.018)
    (g,) = _scaling_goal_rows(runs)
    assert g["above 1.03"] == 0 and g["undecided"] == 0
    (g,) = _scaling_goal_rows(runs.assign(reason=""))  # both counted: the highest bounds, 1.050 spans 1.03
    assert g["above 1.03"] == 0 and g["undecided"] == 1


def test_same_kernel_spread_reads_the_sweeps_drift_between_sdpa_and_its_backend_forced():
    """SDPA's own dispatch and a backend it dispatches to, forced, that ran the same kernels do the same work:
    the furthest apart of their sweep times (slowest over fastest) is the host's drift at that shape. Another
    kernel, a failed row, a module provider, another backend than SDPA's or a shape without SDPA's own dispatch
    do not count."""
    from adaattn_experiments.ada_modules_report import same_kernel_spread

    def row(case, provider, ms, kernel, status="ok", target="h100"):
        return [{"target": target, "case_id": case, "mode": "fwd", "provider": provider, "status": status,
                 "metric": "time_ms", "value": ms, "kernel": kernel}]

    cudnn, flash = "cudnn_fprop | nvjet_a | nvjet_b", "flash_fwd | nvjet_a | nvjet_b"
    runs = pd.DataFrame(
        row("small", "direct:sdpa", 0.16, cudnn) + row("small", "direct:sdpa_cudnn", 0.04, cudnn)
        + row("small", "direct:sdpa_flash", 0.02, flash) + row("small", "adaattn_noopt", 0.50, cudnn)
        + row("small", "direct:sdpa_efficient", 0.01, cudnn, status="error")
        + row("other", "direct:sdpa", 0.2, cudnn) + row("other", "direct:chunked", 0.1, cudnn)
        + row("none", "direct:sdpa_cudnn", 0.2, cudnn) + row("none", "direct:sdpa_flash", 0.1, cudnn)
        + row("cpu", "direct:sdpa", 10.7, "aten::flash_cpu", target="cpu")
        + row("cpu", "direct:sdpa_flash", 10.0, "aten::flash_cpu", target="cpu")
        + row("cpu", "direct:math", 5.0, "aten::bmm", target="cpu"))
    spread = same_kernel_spread(runs)
    assert spread == {("h100", "small", "fwd"): "4.00x (sdpa_cudnn 0.04, sdpa 0.16)",
                      ("cpu", "cpu", "fwd"): "1.07x (sdpa_flash 10, sdpa 10.7)"}


def test_g2_t2_speed_is_read_on_time_per_call_and_kernel_time():
    """G2-T2's speed line (standard over adaattn, 2-4x above 1024 tokens): one verdict per basis; where the
    sweep's time per call and the kernel time read different verdicts the claim is inconclusive, and a target
    without kernel times (a CPU) is read on time per call alone."""
    from adaattn_experiments.ada_modules_report import _g2_t2

    def pivot(target, hw, speeds):  # seq_len -> standard / adaattn
        return pd.DataFrame([{"target": target, "hardware": hw, "case_id": f"s{s}", "sweep": "seq", "batch": 1,
                              "seq_len": s, "causal": False, "mode": "fwd", "standard": x, "adaattn": 1.0}
                             for s, x in speeds.items()])

    t = pd.concat([pivot("h100", "H100", {2048: 2.5, 4096: 3.0}), pivot("h200", "H200", {2048: 2.5, 8192: 5.0}),
                   pivot("cpu", "EPYC", {512: 1.2, 2048: 3.5})])
    kern = pd.concat([pivot("h100", "H100", {2048: 1.8, 4096: 3.0}), pivot("h200", "H200", {2048: 2.2, 8192: 6.0})])
    mem = t.assign(standard=2.0, adaattn=1.0)
    speed = {v.hardware: v for v in _g2_t2(t, mem, kern).verdicts if v.claim.startswith("speed")}
    assert speed["H100"].verdict == "inconclusive"
    assert speed["H100"].reason == "the two times read different verdicts: time per call holds, kernel time does not hold"
    assert speed["H100"].measured == ("2.50-3.00x by time per call (standard / adaattn, forward, S = 2048, 4096); "
                                      "1.80-3.00x by kernel time (standard / adaattn, forward, S = 2048, 4096)")
    assert speed["H200"].verdict == "does not hold" and speed["H200"].reason == ""
    assert speed["EPYC"].verdict == "holds" and speed["EPYC"].measured == (
        "3.50-3.50x by time per call (standard / adaattn, forward, S = 2048)")
