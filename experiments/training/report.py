"""The training report (G0-T1, G0-C1, G1-C1's GEMM and module claims), from the results table only (the ladder
and the pairs: ``training.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from adaattn_pipeline.report.common import (Section, Verdict, cpu_targets, fmt, guide_figures, judge, knobs, md_table,
                                            prose)
from adaattn_experiments.common.paired import paired_frame, ratio_text, ratio_verdict

GPU_CLAIM = "a claim about an H200; this target is a CPU"


def _value(runs: pd.DataFrame, metric: str, mode: str) -> pd.DataFrame:
    ok = runs[(runs["metric"] == metric) & (runs["mode"] == mode) & (runs["status"] == "ok")]
    return ok.set_index(["target", "provider"])


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[(df["case_id"] != "machine") & ~df["table_id"].isin(["G1-C1", "G0-C1"])]
    gemm = df[(df["case_id"] == "machine") & (df["metric"] == "gemm_tflops")].set_index("target")["value"]
    fwd, mem = _value(runs, "time_ms", "fwd"), _value(runs, "peak_mem_mb", "fwd")
    step, step_mem = _value(runs, "step_side_by_side_ms", "step"), _value(runs, "step_peak_mem_mb", "step")
    flops = runs[runs["metric"] == "model_flops"].set_index("target")["value"]
    weights = runs[runs["metric"] == "weights_mb"].set_index("target")["value"]
    cpus = cpu_targets(df)
    rows, t1, c1 = [], [], []
    for (target, case_id), frame in runs[runs["metric"] == "time_ms"].groupby(["target", "case_id"], sort=False):
        hw, tokens = frame["hardware"].iloc[0], int(frame["batch"].iloc[0] * frame["seq_len"].iloc[0])
        order = list(dict.fromkeys(frame["provider"]))
        prev = None
        for rung in order:
            key = (target, rung)
            f_ms = fwd["value"].get(key)
            s_ms = step["value"].get(key)
            mfu = flops.get(target) / (s_ms / 1e3) / (gemm.get(target) * 1e12) if s_ms and target in gemm else None
            gain = prev / s_ms if prev and s_ms else None
            rows.append({"target": target, "rung": f"+{rung}" if prev is not None or rung != order[0] else rung,
                         "forward ms": fmt(f_ms), "forward tokens/s": fmt(tokens / f_ms * 1e3 if f_ms else None),
                         "forward peak MiB": fmt(mem["value"].get(key)), "step ms": fmt(s_ms),
                         "step tokens/s": fmt(tokens / s_ms * 1e3 if s_ms else None),
                         "step peak MiB": fmt(step_mem["value"].get(key)), "MFU (measured GEMM)": fmt(mfu),
                         "step gain over the rung before": fmt(gain)})
            if s_ms:
                prev = s_ms
        t1 += _g0_t1(target, hw, fwd, mem, weights, flops, tokens, gemm, target in cpus, case_id)
        c1 += _g0_c1(target, hw, step, order, target in cpus)
    md = prose(__file__, "g0_t1", rows_table=md_table(pd.DataFrame(rows)) if rows else "no results")
    modes_md, modes = _compile_modes(df)
    return [Section("G0-T1", "Performance Metrics (training ladder)", md, t1),
            Section("G0-C1", "Core optimizations, rung by rung", "The gains are in the G0-T1 table's last column "
                    "(median step time of the rung before over this rung's, in one run).\n" + modes_md, c1 + modes),
            *_g1_c1(df)]


GUIDE_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # G0-C2's list


def _compile_modes(df: pd.DataFrame) -> tuple[str, list[Verdict]]:
    """G0-C1's "torch.compile 10-30% more" in each mode: the compile rung's step in the mode over the eager rung
    before it, side by side in their own rounds."""
    runs = df[df["case_id"].str.startswith("G0-C1/compile-modes", na=False)]
    if runs.empty:
        return "", []
    ratios, cpus = paired_frame(runs), cpu_targets(df)
    band, tol = guide_figures()["G0-C1"]["figures"]["compile_extra_speedup"], knobs().guide_ratio_tolerance
    table, verdicts = [], []
    for target, frame in runs.groupby("target", sort=False):
        ok = frame[frame["status"] == "ok"].set_index(["metric", "provider"])["value"]
        hw = frame["hardware"].iloc[0]
        for mode in [p for p in dict.fromkeys(frame["provider"]) if p.startswith("compile:")]:
            r = ratios[(ratios["target"] == target) & (ratios["vs"] == mode)]
            r = r.iloc[0].to_dict() if len(r) else None
            skips = ok.get(("cudagraph_skips", mode))
            first, hits, misses = (ok.get((m, mode)) for m in ("first_step_s", "fxgraph_cache_hits",
                                                                "fxgraph_cache_misses"))
            table.append({"target": target, "mode": mode.partition(":")[2],
                          "eager step ms": fmt(ok.get(("side_by_side_ms", "eager"))),
                          "compiled step ms": fmt(ok.get(("side_by_side_ms", mode))),
                          "gain (eager / compiled)": ratio_text(r) if r else "-",
                          "CUDA-graph skips": fmt(skips),
                          "first step s": "-" if first is None else f"{fmt(first)} ({hits:g} of {hits + misses:g} "
                                                                    "graphs cached)"})
            if r is None:
                continue
            claim = f"torch.compile 10-30% more (whole training step, mode {mode.partition(':')[2]})"
            verdicts.append(Verdict(
                "G0-C1", claim, f"{band[0]:g}-{band[1]:g}x", ratio_text(r), hw,
                "not measurable here" if target in cpus else judge((r["ci_low"], r["ci_high"]), tuple(band), True, tol),
                GPU_CLAIM if target in cpus else "the eager rung's step over the compiled one's, round by round"
                + (f"; {skips:g} CUDA graphs skipped" if skips else "")))
        for mode in [m for m in GUIDE_COMPILE_MODES if f"compile:{m}" not in set(frame["provider"])]:
            table.append({"target": target, "mode": mode, "eager step ms": "-", "compiled step ms": "-",
                          "gain (eager / compiled)": "not measured: not in this target's compile_modes (params.yaml "
                          "G0-T1 says why)", "CUDA-graph skips": "-", "first step s": "-"})
    md = prose(__file__, "compile_modes", table=md_table(pd.DataFrame(table)))
    return md, verdicts


def _g0_t1(target: str, hw: str, fwd: pd.DataFrame, mem: pd.DataFrame, weights: pd.Series, flops: pd.Series,
           tokens: int, gemm: pd.Series, cpu: bool, case_id: str) -> list[Verdict]:
    guide = guide_figures()["G0-T1"]["figures"]
    mine = fwd.loc[target] if target in fwd.index.get_level_values(0) else pd.DataFrame()
    if mine.empty:
        return []
    best = mine["value"].idxmin()
    ms = mine.loc[best, "value"]
    mib = mem["value"].get((target, best), float("nan")) + weights.get(target, float("nan"))  # a forward's memory
    rate = tokens / ms * 1e3
    need = guide["tokens_per_s"] * flops.get(target, float("nan")) / 3 / tokens  # forward FLOP/s for 125M tokens/s
    shape = case_id.split("/")[-1]
    out = []
    for claim, g, value, higher, tol, unit in (
            ("forward pass ~4.2 ms", guide["forward_ms"], ms, False, knobs().guide_ratio_tolerance, "ms"),
            ("memory ~2.1 GB", guide["memory_gb"], mib * 2**20 / 1e9, False,
             knobs().guide_memory_tolerance, "GB"),
            ("throughput ~125M tokens/s", guide["tokens_per_s"], rate, True, knobs().guide_ratio_tolerance,
             "tokens/s")):
        verdict = "not measurable here" if cpu else judge((value, value), (g, g), higher, tol)
        reason = GPU_CLAIM if cpu else (f"the fastest rung's forward ({best}) at {shape}, the guide naming no batch"
                                        + ("; memory: the weights and the forward's peak over them" if unit == "GB"
                                           else ""))
        if unit == "ms" and not cpu:  # the guide's two figures together say how many tokens a forward holds
            reason += (f"; with its {guide['tokens_per_s']:.3g} tokens/s, the guide's {g:g} ms is "
                       f"{guide['tokens_per_s'] * g / 1e3:.3g} tokens a forward")
        if unit == "tokens/s" and not cpu:
            reason += (f"; {g:.3g} tokens/s of this model's forward is {need / 1e15:.3g} PFLOP/s, "
                       f"{need / (gemm.get(target, float('nan')) * 1e12):.3g}x the GEMM rate measured here")
        out.append(Verdict("G0-T1", claim, f"{g:g} {unit}", f"{value:.4g} {unit}", hw, verdict, reason))
    return out


def _g0_c1(target: str, hw: str, step: pd.DataFrame, order: list[str], cpu: bool) -> list[Verdict]:
    figures = guide_figures()["G0-C1"]["figures"]
    out = []
    # SDPA's "10-15x faster than naive attention" is a claim about the attention op: the attention_backends study
    # judges it on the op; a whole training step's gain from the sdpa rung is in the table, not a second verdict
    for rung, claim, band in (("compile", "torch.compile 10-30% more (whole training step)",
                               figures["compile_extra_speedup"]),):
        if rung not in order or order.index(rung) == 0:
            continue
        timed = [r for r in order[: order.index(rung)] if step["value"].get((target, r)) is not None]
        now = step["value"].get((target, rung))
        if not timed or now is None:
            continue
        before = step["value"][(target, timed[-1])]  # the nearest rung before it with a step (tf32: a GPU's)
        gain = before / now
        tol = knobs().guide_ratio_tolerance
        verdict = "not measurable here" if cpu else judge((gain, gain), tuple(band), True, tol)
        out.append(Verdict("G0-C1", claim, f"{band[0]:g}-{band[1]:g}x", f"{gain:.3g}x (median steps, one run)", hw,
                           verdict, GPU_CLAIM if cpu else f"+{rung} over the rung before it"))
    return out


def _g1_c1(df: pd.DataFrame) -> list[Section]:
    """G1-C1's GEMM claim (TF32 4x an fp32 GEMM) and module claim (nn.MultiheadAttention already optimised)."""
    runs = df[df["table_id"] == "G1-C1"]
    if runs.empty:
        return []
    cpus, ratios = cpu_targets(df), paired_frame(runs)
    times = runs[(runs["metric"] == "side_by_side_ms") & (runs["status"] == "ok")]
    table, verdicts = [], []
    claimed, tol = guide_figures()["G1-C1"]["figures"]["tf32_gemm_speedup"], knobs().guide_ratio_tolerance
    for (target, case_id, mode), frame in runs.groupby(["target", "case_id", "mode"], sort=False):
        hw, gemm = frame["hardware"].iloc[0], case_id.startswith("G1-C1/gemm")
        ms = times[(times["target"] == target) & (times["case_id"] == case_id) & (times["mode"] == mode)]
        ms = ms.set_index("provider")["value"]
        r = ratios[(ratios["target"] == target) & (ratios["case_id"] == case_id) & (ratios["mode"] == mode)]
        r = r.iloc[0].to_dict() if len(r) else None
        what = frame["model"].iloc[0] + ("" if gemm else f", B={int(frame['batch'].iloc[0])} "
                                         f"S={int(frame['seq_len'].iloc[0])}, {mode}")
        table.append({"target": target, "what": what, "times (ms)": ", ".join(f"{p} {v:.4g}" for p, v in ms.items()),
                      "ratio": (("tf32 / fp32 " if gemm else "mha / sdpa ") + ratio_text(r)) if r else "-"})
        if gemm:
            claim, guide = "TF32 makes fp32 GEMMs ~4x faster", f"{claimed:g}x"
            if target in cpus or r is None:
                verdicts.append(Verdict("G1-C1", claim, guide, "no TF32 here", hw, "not measurable here",
                                        "TF32 is a mode of NVIDIA tensor cores"))
                continue
            speed = (1 / r["ci_high"], 1 / r["ci_low"])  # the speedup's interval from the time ratio's
            verdicts.append(Verdict("G1-C1", claim, guide, f"{1 / r['value']:.2f}x ({speed[0]:.2f}-{speed[1]:.2f})",
                                    hw, judge(speed, (claimed, claimed), higher_is_better=True, tolerance=tol),
                                    f"{what}: fp32 time over tf32's, round by round"))
        elif r is not None:
            bound = 1 + knobs().same_time_tolerance
            verdicts.append(Verdict("G1-C1", f"the default nn.MultiheadAttention is already optimised ({mode})",
                                    f"as fast as SDPA (within {bound - 1:.0%})", ratio_text(r), hw,
                                    "not measurable here" if target in cpus else ratio_verdict(r, None, bound),
                                    f"{what}: nn.MultiheadAttention(need_weights=False) over the zoo's SDPA layer of "
                                    "the same width, heads and projections"))
    md = prose(__file__, "g1_c1", table=md_table(pd.DataFrame(table)))
    return [Section("G1-C1", "Bandwidth and compute claims (TF32 GEMMs, nn.MultiheadAttention)", md, verdicts)]
