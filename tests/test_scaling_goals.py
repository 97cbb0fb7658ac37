"""The scaling study's goals (G2-B): AdaAttention's time per call against the direct backends, read round by round
with the medians' confidence intervals, at GPU-bound shapes; first calls, the stack check, G2-T2's speed line."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from test_g2_studies import _params, _run

from adaattn.timing.timers import KernelTrace


def test_scaling_goal_per_call_is_the_highest_per_round_ratio():
    """The 3% goal by time per call: adaattn's per-round ratio to each direct backend; the goal's
    ratio at a shape is the highest of them (the fastest backend's), judged against 1.03."""
    from adaattn_experiments.scaling.report import _paired_goal

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
    from adaattn_experiments.scaling.report import _goal_table, _paired_goal

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
    from adaattn_experiments.scaling.report import _goal_table, gpu_bound

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
    from adaattn_experiments.scaling.report import _first_calls, _stack

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
    from adaattn_experiments.scaling.study import STUDY as SCALING
    from adaattn_experiments.scaling.report import render

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
    import adaattn_experiments.scaling.study as mod
    from adaattn_experiments.scaling.study import STUDY as SCALING
    from adaattn_experiments.scaling.report import render

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
    from adaattn_experiments.scaling.report import _goal_table, _paired_goal

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
    from adaattn_experiments.scaling.report import _g2_t2

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
        "median 2.75x (range 2.5-3) by time per call (2.50-3.00x; standard / adaattn, forward, S = 2048, 4096); "
        "median 2.4x (range 1.8-3) by kernel time (1.80-3.00x; standard / adaattn, forward, S = 2048, 4096)")
    assert speed["H200"].verdict == "better than claimed" and speed["H200"].reason == ""
    assert speed["EPYC"].verdict == "holds" and speed["EPYC"].measured == (
        "3.5x by time per call (3.50-3.50x; standard / adaattn, forward, S = 2048)")


def test_a_point_both_sweeps_share_is_in_both():
    """Measured once (tagged with the batch sweep), B=1 S=1024 belongs to the sequence sweep at B=1 too."""
    from adaattn_experiments.scaling.report import in_sweep

    rows = [("batch", 1, 1024), ("batch", 4, 1024), ("seq", 1, 512), ("seq", 1, 2048)]
    frame = pd.DataFrame([{"target": "h100", "sweep": w, "batch": b, "seq_len": s} for w, b, s in rows])
    assert sorted(in_sweep(frame, "seq")["seq_len"]) == [512, 1024, 2048]
    assert sorted(in_sweep(frame, "batch")["batch"]) == [1, 4]
