"""The MFU report (the model-level goals on G0-T1's training step), from the results table only (``mfu.py``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from adaattn_pipeline.report.common import (Section, Verdict, cpu_targets, filed, fmt, judge, knobs, md_table,
                                            prose)
from adaattn_experiments.common.paired import paired_frame, ratio_text
from adaattn_experiments.mfu.schema import FP8_CONFIGS, NOT_ZOO, PEERS, MfuGoals, judged

GB = 2**20 / 1e9  # MiB -> GB


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[df["case_id"] != "machine"]
    machine = df[(df["case_id"] == "machine") & (df["status"] == "ok") & df["value"].notna()]
    rates = {name: machine[machine["metric"] == metric].set_index("target")["value"]
             for name, metric in (("bf16", "gemm_tflops"), ("fp8", "fp8_gemm_tflops"))}
    ratios, cpus = paired_frame(runs), cpu_targets(df)
    table, verdicts = [], []
    for (target, case_id), frame in runs.groupby(["target", "case_id"], sort=False):
        hw, model = frame["hardware"].iloc[0], frame["model"].iloc[0]
        tokens = int(frame["batch"].iloc[0] * frame["seq_len"].iloc[0])
        at = frame[frame["status"] == "ok"].set_index(["metric", "provider"])["value"]
        flops = at.get(("model_flops", "model"))
        step = frame[frame["metric"] == "side_by_side_ms"]
        fastest, bf16_best, bf16_fastest = None, None, None  # the zoo's (config, ms), (config, MFU), (config, ms)
        for _, row in step.iterrows():
            config, ms = row["provider"], row["value"] if row["status"] == "ok" else None
            # like with like: each config against the GEMM rate of its own precision, measured in this run
            basis = "fp8" if config in FP8_CONFIGS else "bf16"
            rate = rates[basis].get(target)
            mfu = flops / (ms / 1e3) / (rate * 1e12) if ms and flops and rate else None
            r = ratios[(ratios["target"] == target) & (ratios["case_id"] == case_id) & (ratios["vs"] == config)]
            r = r.iloc[0].to_dict() if len(r) else None
            zoo = config not in NOT_ZOO  # a peer, or a peer's loss in our step: compared with, never one of, ours
            if zoo and ms and (fastest is None or ms < fastest[1]):
                fastest = config, ms
            if zoo and ms and basis == "bf16" and (bf16_fastest is None or ms < bf16_fastest[1]):
                bf16_fastest = config, ms
            if zoo and mfu is not None and basis == "bf16" and (bf16_best is None or mfu > bf16_best[1]):
                bf16_best = config, mfu
            table.append({"target": target, "model": model, "B x S": f"{int(frame['batch'].iloc[0])} x "
                          f"{int(frame['seq_len'].iloc[0])}", "config": config, "step ms": fmt(ms),
                          "tokens/s": fmt(tokens / ms * 1e3 if ms else None), "MFU": fmt(mfu),
                          "GEMM rate (TFLOP/s)": f"{basis} {fmt(rate)}" if rate else f"{basis} not measured",
                          "speedup over plain": ratio_text(r) if r else "-",
                          "first step s": fmt(at.get(("first_step_s", config))),
                          "graphs compiled": fmt(at.get(("graphs_compiled", config))),
                          "step peak GB": fmt(at.get(("step_peak_mem_mb", config), float("nan")) * GB),
                          "note": "" if ms else f"{row['status']}: {row['reason']}"})
        if not judged(peer_goals(), model, int(frame["batch"].iloc[0])):
            continue  # a preset's goals are read at the batch filed for them (mfu.goals.batch); this case is shown
        case = _goals(target, case_id, model, hw, fastest and fastest[0], bf16_best, rates["bf16"].get(target),
                      ratios, target in cpus)
        case += _issue67_goals(target, case_id, model, hw, frame, bf16_fastest and bf16_fastest[0], bf16_best,
                               rates["bf16"].get(target), ratios, target in cpus)
        shape = f"at B x S = {int(frame['batch'].iloc[0])} x {int(frame['seq_len'].iloc[0])}"
        verdicts += [replace(v, reason=f"{v.reason}; {shape}" if v.reason else shape) for v in case]
    md = prose(__file__, "g0_t1", table=md_table(pd.DataFrame(table)) if table else "no results")
    return [Section("G0-T1", "MFU goals (training step, compiled, by config)", md, verdicts), _g0_c2(runs)]


def _g0_c2(runs: pd.DataFrame) -> Section:
    """G0-C2, the guide's API: each target's timed steps ran through it (``create_optimized_training_setup``'s
    model, optimizer and trainer; ``Trainer.train_step``; the compile modes and scopes ``optimize_model`` takes)."""
    verdicts = []
    steps = runs[(runs["metric"] == "side_by_side_ms") & (runs["status"] == "ok")]
    for target, frame in steps.groupby("target", sort=False):
        ran = ", ".join(f"{m} ({', '.join(dict.fromkeys(f['provider']))})"
                        for m, f in frame.groupby("model", sort=False))
        verdicts.append(Verdict(
            "G0-C2", "create_optimized_training_setup(model, ...) -> (model, optimizer, trainer); "
            "trainer.train_step(batch, criterion)", "an API", f"every step timed here ran through it: {ran}",
            frame["hardware"].iloc[0], "by construction",
            "optimize_model's compile modes (default, reduce-overhead, max-autotune, None) and scopes; the "
            "trainer's bf16 autocast, TF32, fused AdamW, clipping (docs/models.md)"))
    md = ("The guide's API (`adaattn.models.train`, docs/models.md): the MFU study builds every config through "
          "`create_optimized_training_setup` and times `Trainer.train_step`.\n")
    return Section("G0-C2", "The API (optimize_model, create_optimized_training_setup, train_step)", md, verdicts)


def _mfu_goal(goal: float | None, source: str, model: str, hw: str, bf16: tuple[str, float] | None,
              rate: float | None, cpu: bool) -> list[Verdict]:
    """A preset's MFU goal, a bf16 goal: its best bf16 config against the bf16 GEMM rate of the same run."""
    if goal is None:
        return []
    claim = f"{model}: at least {goal:.0%} MFU against the measured bf16 GEMM rate (bf16 configs){source}"
    if cpu:
        return [Verdict("G0-T1", claim, f">= {goal:.0%}", "-", hw, "not measurable here",
                        "a GPU goal (bf16 tensor cores)")]
    if bf16 is None:
        return []
    return [Verdict("G0-T1", claim, f">= {goal:.0%}", f"{bf16[1]:.1%} ({bf16[0]})", hw,
                    judge((bf16[1], bf16[1]), (goal, None), higher_is_better=True),
                    f"the best bf16 config, {bf16[0]}, of one run; GEMM rate {rate:.0f} TFLOP/s")]


def _goals(target: str, case_id: str, model: str, hw: str, fastest: str | None, bf16: tuple[str, float] | None,
           rate: float | None, ratios: pd.DataFrame, cpu: bool) -> list[Verdict]:
    """The preset's MFU goal, a bf16 goal, on its best bf16 config against the bf16 GEMM rate (an FP8 config is
    not counted against the bf16 rate); its speedup goal on the fastest config's ratio to plain."""
    out = _mfu_goal(knobs().mfu_goals.get(model), "", model, hw, bf16, rate, cpu)
    speedup = knobs().mfu_speedup.get(model)
    if speedup is not None:
        claim = f"{model}: the zoo's best config at least {speedup:g}x plain compiled PyTorch's tokens/s"
        r = ratios[(ratios["target"] == target) & (ratios["case_id"] == case_id) & (ratios["vs"] == fastest)]
        if cpu:
            out.append(Verdict("G0-T1", claim, f">= {speedup:g}x", "-", hw, "not measurable here",
                               "a GPU goal (our kernels and FP8 GEMMs run on the GPU)"))
        elif fastest == "plain" or len(r) == 0:
            out.append(Verdict("G0-T1", claim, f">= {speedup:g}x", "1x (plain is the fastest)", hw,
                               "worse than claimed", "no config beat plain compiled PyTorch in the rounds"))
        else:
            r = r.iloc[0].to_dict()
            out.append(Verdict("G0-T1", claim, f">= {speedup:g}x", f"{ratio_text(r)} ({fastest})", hw,
                               judge((r["ci_low"], r["ci_high"]), (speedup, None), higher_is_better=True),
                               f"plain's step time over {fastest}'s (the fastest config), round by round"))
    return out


def peer_goals() -> MfuGoals:
    """Issue 67's peer goal as filed in params.yaml (``mfu.goals``; its defaults outside a render)."""
    return filed("mfu", "goals", MfuGoals())


def _issue67_goals(target: str, case_id: str, model: str, hw: str, frame: pd.DataFrame, best: str | None,
                   bf16: tuple[str, float] | None, rate: float | None, ratios: pd.DataFrame,
                   cpu: bool) -> list[Verdict]:
    """Issue 67's goals as ``mfu.goals`` reads them: the best bf16 config's MFU; the zoo's fastest bf16 config
    (``best``) against plain and against each peer timed in the case; ``fp8_rowwise`` against that config."""
    goals = peer_goals()
    out = _mfu_goal(goals.mfu.get(model), " (issue 67)", model, hw, bf16, rate, cpu)
    steps = frame[frame["metric"] == "side_by_side_ms"]
    if model in goals.plain_speedup:
        out.append(_speedup(f"{model}: the zoo's fastest bf16 config at least {goals.plain_speedup[model]:g}x plain "
                            "compiled PyTorch's tokens/s (issue 67)", goals.plain_speedup[model], best, "plain",
                            target, case_id, hw, steps, ratios, cpu))
    for peer in [p for p in PEERS if p in set(steps["provider"])] if model in goals.peer_speedup else []:
        out.append(_speedup(f"{model}: the zoo's fastest bf16 config at least {goals.peer_speedup[model]:g}x "
                            f"{peer}'s tokens/s (issue 67)", goals.peer_speedup[model], best, peer, target,
                            case_id, hw, steps, ratios, cpu))
    if model in goals.fp8_speedup and "fp8_rowwise" in set(steps["provider"]):
        out.append(_speedup(f"{model}: FP8 training (rowwise) at least {goals.fp8_speedup[model]:g}x the zoo's "
                            "fastest bf16 config's tokens/s (issue 67)", goals.fp8_speedup[model], "fp8_rowwise",
                            best, target, case_id, hw, steps, ratios, cpu))
    return out


def _speedup(claim: str, goal: float, fast: str | None, slow: str | None, target: str, case_id: str, hw: str,
             steps: pd.DataFrame, ratios: pd.DataFrame, cpu: bool) -> Verdict:
    """``fast``'s tokens/s over ``slow``'s (``slow``'s step time over ``fast``'s), each through its paired ratio
    to plain in the same rounds; the interval the quotient of the two intervals at their far ends."""
    pick = ratios[(ratios["target"] == target) & (ratios["case_id"] == case_id)].set_index("vs")
    status = steps.set_index("provider")[["status", "reason"]]
    broken = [c for c in (fast, slow) if c in status.index and status.loc[c, "status"] != "ok"]
    if cpu or broken or fast is None or slow is None or any(c != "plain" and c not in pick.index for c in (fast, slow)):
        why = "a GPU goal" if cpu else "; ".join(f"{c}: {status.loc[c, 'status']}: {status.loc[c, 'reason']}"
                                                for c in broken) or "no paired ratio of both to plain in this run"
        return Verdict("G0-T1", claim, f">= {goal:g}x", "-", hw, "not measurable here" if cpu else "not measured yet",
                       why)
    one = {"value": 1.0, "ci_low": 1.0, "ci_high": 1.0}  # plain against itself
    a, b = (one if fast == "plain" else pick.loc[fast]), (one if slow == "plain" else pick.loc[slow])
    value, low, high = a["value"] / b["value"], a["ci_low"] / b["ci_high"], a["ci_high"] / b["ci_low"]
    return Verdict("G0-T1", claim, f">= {goal:g}x", f"{value:.3f} (interval {low:.3f}-{high:.3f}; {fast} over {slow})",
                   hw, judge((low, high), (goal, None), higher_is_better=True),
                   f"{slow}'s step time over {fast}'s, each through its ratio to plain in the same rounds")
