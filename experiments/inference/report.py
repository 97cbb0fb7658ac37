"""The inference report (G3-T3 and issue 48's decode goals), from the results table only (``inference.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from adaattn_pipeline.report.common import (Section, Verdict, cpu_targets, filed, fmt, guide_figures, interval_text,
                                            judge, knobs, md_table, median_interval, prose)
from adaattn_experiments.common.paired import paired_frame, ratio_text
from adaattn_experiments.inference.schema import DecodeGoals, FieldPublished

GB = 2**20 / 1e9  # MiB -> GB
# the guide's rows and the config that measures each; its latencies' ratios are what another machine can check
GUIDE_ROWS = (("Base", "base"), ("+FlashAttention", "flash"), ("+INT8", "int8"))


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[df["case_id"] != "machine"]
    copy = df[(df["case_id"] == "machine") & (df["metric"] == "copy_gbps")].set_index("target")["value"]
    ok = runs[runs["status"] == "ok"]
    ratios, cpus = paired_frame(runs), cpu_targets(df)
    table, verdicts = [], []
    for (target, batch), frame in runs.groupby(["target", "batch"], sort=False):
        at = ok[(ok["target"] == target) & (ok["batch"] == batch)].set_index(["phase", "metric", "provider"])["value"]
        for config in dict.fromkeys(frame[frame["phase"] == "decode"]["provider"]):
            ms, read = at.get(("decode", "side_by_side_ms", config)), at.get(("decode", "decode_bytes", config))
            need = at.get(("decode", "decode_bytes_needed", config))
            gbps = read / (ms / 1e3) / 1e9 if ms and read else None
            needed = need / (ms / 1e3) / 1e9 if ms and need else None
            r = ratios[(ratios["target"] == target) & (ratios["batch"] == batch) & (ratios["vs"] == config)]
            bad = frame[(frame["provider"] == config) & (frame["status"] != "ok")]
            table.append({"target": target, "batch": int(batch), "config": config,
                          "prefill ms": fmt(at.get(("prefill", "side_by_side_ms", config))),
                          "decode ms / step": fmt(ms), "decode tokens/s": fmt(batch / ms * 1e3 if ms else None),
                          "GB read / step": fmt(read / 1e9 if read else None), "GB/s": fmt(gbps),
                          "of copy bandwidth": fmt(gbps / copy[target] if gbps and target in copy else None),
                          "needed GB / step": fmt(need / 1e9 if need else None),
                          "needed of copy": fmt(needed / copy[target] if needed and target in copy else None),
                          "kernels / step": fmt(at.get(("decode", "kernels_per_step", config))),
                          "kernel gap us": fmt(at.get(("decode", "kernel_gap_us", config))),
                          "generate ms / token": fmt(at.get(("generate", "generate_ms_per_token", config))),
                          "compiled / this": ratio_text(r.iloc[0].to_dict()) if len(r) else "-",
                          "peak GB": fmt(at.get(("generate", "peak_mem_mb", config), float("nan")) * GB),
                          "note": "" if bad.empty else f"{bad['status'].iloc[0]}: {bad['reason'].iloc[0]}"[:120]})
    for target, frame in ok.groupby("target", sort=False):
        verdicts += _verdicts(target, frame, copy.get(target), ratios, target in cpus)
        verdicts += decode_goal_verdicts(frame, runs[runs["target"] == target], copy.get(target), target in cpus,
                                         ratios[ratios["target"] == target])
    md = prose(__file__, "g3_t3", table=md_table(pd.DataFrame(table)) if table else "no results",
               quality=quality_table(ok), ltm=ltm_table(runs),
               field=field_table(runs, copy, filed("g3_t3", "field_published", None)), floor=floor_table(runs, copy))
    return [Section("G3-T3", "Inference Performance (prefill, decode, KV cache, INT8, CUDA graphs)", md, verdicts)]


def quality_table(ok: pd.DataFrame) -> str:
    """Weight-only quantization's price: each target's trained model's validation loss in full precision, INT8
    and INT4, and the change from full precision."""
    q = ok[(ok["phase"] == "quality") & (ok["metric"] == "val_loss") & ok["provider"].isin(["full", "int8", "int4"])]
    rows = []
    for (target, model), frame in q.groupby(["target", "model"], sort=False):
        loss = frame.set_index("provider")["value"]
        trained = ok[(ok["target"] == target) & (ok["phase"] == "quality") & (ok["metric"] == "train_loss")]
        for variant in ("full", "int8", "int4"):
            if variant in loss:
                change = loss[variant] - loss.get("full", float("nan"))
                rows.append({"target": target, "model": model, "steps": fmt(trained["step"].max())
                             if "step" in trained and len(trained) else "-", "weights": variant,
                             "val loss (nats)": f"{loss[variant]:.4f}",
                             "change": "-" if variant == "full" else f"{change:+.5f} ({change / loss['full']:+.3%})",
                             "note": frame.set_index("provider")["reason"][variant]})
    return md_table(pd.DataFrame(rows)) if rows else "no quality run (G3-T3.<profile>.quality)"


def floor_table(runs: pd.DataFrame, copy: pd.Series) -> str:
    """The batch-1 step's floor (``G3-T3.<profile>.floor``): the sweep's model, narrow, a token through the
    README's ``generate``; against the sweep's own batch-1 ``generate`` with the compiled step: the floor's share
    of it, and the bytes the step must read over the time past the floor."""
    ok = runs[runs["status"] == "ok"]
    rows = []
    for target, frame in runs[runs["phase"] == "floor"].groupby("target", sort=False):
        at = ok[(ok["target"] == target) & (ok["batch"] == 1)].set_index(["phase", "metric", "provider"])["value"]
        floor, step = (at.get((phase, "generate_ms_per_token", "compiled")) for phase in ("floor", "generate"))
        need = at.get(("decode", "decode_bytes_needed", "compiled"))
        past = need / ((step - floor) / 1e3) / 1e9 if floor and step and need and step > floor else None
        bad = frame[frame["status"] != "ok"]
        rows.append({"target": target, "model": frame["model"].iloc[0],
                     "floor GB / step": fmt(at.get(("floor", "decode_bytes_needed", "compiled"), float("nan")) / 1e9),
                     "floor kernels / step": fmt(at.get(("floor", "kernels_per_step", "compiled"))),
                     "floor ms / token": fmt(floor), "step ms / token": fmt(step),
                     "floor's share": fmt(floor / step if floor and step else None),
                     "GB / step": fmt(need / 1e9 if need else None), "GB/s past the floor": fmt(past),
                     "of copy bandwidth": fmt(past / copy[target] if past and target in copy else None),
                     "note": "" if bad.empty else f"{bad['status'].iloc[0]}: {bad['reason'].iloc[0]}"[:120]})
    return md_table(pd.DataFrame(rows)) if rows else "no floor run (G3-T3.<profile>.floor)"


def field_table(runs: pd.DataFrame, copy: pd.Series, published: FieldPublished | None) -> str:
    """Our decode on the field's model (``G3-T3.<profile>.field``) beside the step times the field published for
    the same model on the same GPU (``G3-T3.field_published``, quoted): ours a token, its bytes over that time
    against the run's copy bandwidth, kernels a step, and the published decoders' times over ours."""
    field = runs[runs["phase"] == "field"]
    rows = []
    for (target, model), frame in field.groupby(["target", "model"], sort=False):
        at = frame[frame["status"] == "ok"].set_index("metric")["value"]
        ms, need = at.get("generate_ms_per_token"), at.get("decode_bytes_needed")
        gbps = need / (ms / 1e3) / 1e9 if ms and need else None
        hw = frame["hardware"].iloc[0]
        theirs = {} if published is None or published.model != model else \
            next((v for k, v in published.step_us.items() if k in hw), {})
        bad = frame[frame["status"] != "ok"]
        rows.append({"target": target, "model": model, "ours us / token": fmt(ms * 1e3 if ms else None),
                     "GB / step": fmt(need / 1e9 if need else None), "GB/s": fmt(gbps),
                     "of copy bandwidth": fmt(gbps / copy[target] if gbps and target in copy else None),
                     "kernels / step": fmt(at.get("kernels_per_step")),
                     "published us / step (theirs / ours)": ", ".join(
                         f"{name} {us:g} ({us / (ms * 1e3):.3f})" if ms else f"{name} {us:g}"
                         for name, us in theirs.items()) or f"none published for {hw}",
                     "note": "" if bad.empty else f"{bad['status'].iloc[0]}: {bad['reason'].iloc[0]}"[:120]})
    if not rows:
        return "no field run (G3-T3.<profile>.field)"
    source = f"\n\nPublished: {published.source} (their runs, quoted; not measured here)." if published else ""
    return md_table(pd.DataFrame(rows)) + source


def ltm_table(runs: pd.DataFrame) -> str:
    """The LTM preset's decode (``G3-T3.<profile>.ltm``): generate's time a token with the step eager and compiled,
    the compiled step's graphs and greedy tokens against the eager step's."""
    ltm = runs[runs["phase"] == "ltm"]
    rows = []
    for (target, model), frame in ltm.groupby(["target", "model"], sort=False):
        at = frame[frame["status"] == "ok"].set_index(["metric", "provider"])["value"]
        eager, compiled = (at.get(("generate_ms_per_token", c)) for c in ("ltm_eager", "ltm_compiled"))
        bad = frame[frame["status"] != "ok"]
        rows.append({"target": target, "model": model, "prompt": fmt(frame["seq_len"].iloc[0]),
                     "eager ms / token": fmt(eager), "compiled ms / token": fmt(compiled),
                     "compiled speedup": f"{eager / compiled:.2f}x" if eager and compiled else "-",
                     "graphs": fmt(at.get(("graphs", "ltm_compiled"))),
                     "tokens agree": fmt(at.get(("tokens_agree", "ltm_compiled"))),
                     "note": "" if bad.empty else f"{bad['status'].iloc[0]}: {bad['reason'].iloc[0]}"[:120]})
    return md_table(pd.DataFrame(rows)) if rows else "no LTM decode run (G3-T3.<profile>.ltm)"


def decode_goal() -> DecodeGoals:
    """Issue 66's goals as filed in params.yaml (``G3-T3.decode_goals``; its defaults outside a render)."""
    return filed("g3_t3", "decode_goals", DecodeGoals())


def decode_goal_verdicts(ok: pd.DataFrame, runs: pd.DataFrame, copy: float | None, cpu: bool,
                         ratios: pd.DataFrame) -> list[Verdict]:
    """Issue 66's goals, each read as ``G3-T3.decode_goals`` files it, on the ``compiled`` config."""
    goal, hw, out = decode_goal(), ok["hardware"].iloc[0], []
    dec = ok[ok["phase"] == "decode"]
    at = dec.set_index(["batch", "metric", "provider"])["value"]
    for batch in sorted({int(b) for b in dec["batch"]}):
        ms, need = at.get((batch, "side_by_side_ms", "compiled")), at.get((batch, "decode_bytes_needed", "compiled"))
        bound = goal.roofline_b1 if batch == 1 else goal.roofline_batched
        claim = f"compiled bf16 decode at batch {batch} at least {bound:.0%} of the copy bandwidth (issue 66)"
        if not (ms and need and copy):
            out.append(Verdict("G3-T3", claim, f">= {bound:.0%}", "-", hw,
                               "not measurable here" if cpu else "not measured yet",
                               "a goal of the GPU's bandwidth" if cpu else
                               "no compiled decode step with its bytes in this run"))
            continue
        fraction = need / (ms / 1e3) / 1e9 / copy
        out.append(Verdict("G3-T3", claim, f">= {bound:.0%}", f"{fraction:.1%}", hw,
                           "not measurable here" if cpu else judge((fraction, fraction), (bound, None), True),
                           f"the weights and the cache's filled positions over the step's time, against the "
                           f"{copy:.0f} GB/s copy measured in the same run"))
    kernels = at.get((1, "kernels_per_step", "compiled"))
    claim = f"at most {goal.max_kernels_b1} kernels in a compiled batch-1 decode step (issue 66)"
    if kernels is None:
        why = runs[(runs["metric"] == "kernels_per_step") & (runs["provider"] == "compiled")]["reason"]
        out.append(Verdict("G3-T3", claim, f"<= {goal.max_kernels_b1}", "-", hw,
                           "not measurable here" if cpu else "not measured yet",
                           why.iloc[0] if len(why) else "no trace of a compiled step in this run"))
    else:
        out.append(Verdict("G3-T3", claim, f"<= {goal.max_kernels_b1}", f"{kernels:.0f}", hw,
                           "not measurable here" if cpu else judge((kernels, kernels), (None, goal.max_kernels_b1),
                                                                   False),
                           "kernels in a CUDA trace of one step, copies and memsets left out"))
    claim = f"INT4 weight-only decode at batch 1 at least {goal.int4_speedup:g}x bf16's (issue 66)"
    r = ratios[(ratios["batch"] == 1) & (ratios["vs"] == "compiled_int4")]
    if len(r):
        r = r.iloc[0].to_dict()
        out.append(Verdict("G3-T3", claim, f">= {goal.int4_speedup:g}x", ratio_text(r), hw,
                           "not measurable here" if cpu else judge((r["ci_low"], r["ci_high"]),
                                                                   (goal.int4_speedup, None), True),
                           "compiled over compiled_int4 in the paired rounds of one run"))
    else:
        out.append(Verdict("G3-T3", claim, f">= {goal.int4_speedup:g}x", "-", hw,
                           "not measurable here" if cpu else "not measured yet",
                           "no compiled and compiled_int4 pair at batch 1 in this run"))
    claim = (f"the README's generate at batch 1 at most {goal.generate_within:.0%} slower a token than the step "
             "(issue 66)")
    gen = ok[(ok["phase"] == "generate") & (ok["metric"] == "generate_ms_per_token")]
    gen = gen.set_index(["batch", "provider"])["value"]
    step, loop = at.get((1, "side_by_side_ms", "compiled")), gen.get((1, "compiled"))
    if step and loop:
        over = loop / step - 1
        out.append(Verdict("G3-T3", claim, f"<= {goal.generate_within:.0%}", f"{over:+.1%}", hw,
                           "not measurable here" if cpu else judge((over, over), (None, goal.generate_within),
                                                                   False),
                           f"generate's {loop:.3f} ms a token against the compiled step's {step:.3f} ms, one run"))
    else:
        out.append(Verdict("G3-T3", claim, f"<= {goal.generate_within:.0%}", "-", hw,
                           "not measurable here" if cpu else "not measured yet",
                           "no compiled step and generate loop at batch 1 in this run"))
    return out


def _verdicts(target: str, ok: pd.DataFrame, copy: float | None, ratios: pd.DataFrame, cpu: bool) -> list[Verdict]:
    hw, out = ok["hardware"].iloc[0], []
    decode = ok[(ok["phase"] == "decode") & (ok["metric"] == "side_by_side_ms")]
    guide, tol = guide_figures()["G3-T3"]["figures"], knobs().guide_ratio_tolerance
    for (row, config), (prev_row, prev) in zip(GUIDE_ROWS[1:], GUIDE_ROWS[:-1]):
        claimed = guide[prev_row]["latency_ms"] / guide[row]["latency_ms"]
        gains = []
        for _, frame in decode.groupby("batch"):
            ms = frame.set_index("provider")["value"]
            if config in ms and prev in ms:
                gains.append(ms[prev] / ms[config])
        if not gains:
            continue
        _, lo, hi = median_interval(gains)
        out.append(Verdict("G3-T3", f"{row}: {guide[row]['latency_ms']:g} ms after {guide[prev_row]['latency_ms']:g} "
                           f"({claimed:.2f}x)", f"{claimed:.2f}x", interval_text(gains) + f" over {len(gains)} "
                           "batch sizes", hw, "not measurable here" if cpu else judge((lo, hi), (claimed, claimed),
                                                                                        True, tol),
                           f"a decode step, {prev} over {config}; the guide names no model, batch or hardware, so "
                           "its ratios are read, not its milliseconds"))
    out.append(Verdict("G3-T3", "+TensorParallel: 12.4 ms", f"{guide['+TensorParallel']['latency_ms']:g} ms", "-", hw,
                       "not measured yet", "two GPUs: the distributed study's (reports/distributed.md, G3-T3)"))
    one = decode[decode["batch"] == 1]
    read = ok[(ok["phase"] == "decode") & (ok["metric"] == "decode_bytes") & (ok["batch"] == 1)]
    if not one.empty and copy:
        # the config nearest the roofline, not the fastest: INT8 reads half the bytes, so the fastest step
        # can be the one further from it
        fractions = (read.set_index("provider")["value"] / (one.set_index("provider")["value"] / 1e3) / 1e9
                     / copy).dropna()
        best, fraction = fractions.idxmax(), fractions.max()
        goal = knobs().decode_roofline
        out.append(Verdict("G3-T3", f"batch-1 decode at least {goal:.0%} of the bandwidth roofline", f">= {goal:.0%}",
                           f"{fraction:.1%} ({best})", hw, "not measurable here" if cpu else
                           judge((fraction, fraction), (goal, None), True),
                           f"the config nearest it: bytes read per step over the step's time, against the {copy:.0f} "
                           "GB/s copy measured in the same run"))
    r = ratios[(ratios["target"] == target) & (ratios["batch"] == 1) & (ratios["vs"] == "compiled_int8")]
    if len(r):
        r, goal = r.iloc[0].to_dict(), knobs().int8_decode_speedup
        out.append(Verdict("G3-T3", f"INT8 weight-only decode at batch 1 at least {goal:g}x bf16's", f">= {goal:g}x",
                           ratio_text(r), hw, "not measurable here" if cpu else
                           judge((r["ci_low"], r["ci_high"]), (goal, None), True),
                           prose(__file__, "g3_t3.int8_reason")))
    return out
