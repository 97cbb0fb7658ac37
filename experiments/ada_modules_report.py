"""Reports of the module studies: cpu_baseline (G2-T1) and scaling (G2-B, G2-T2, and the 3% goal).

Rendered from the results table only (see ``ada_modules.py`` for the providers).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn.attention.kernel_manager import (CALL_BUDGET_MS, CALL_ROUNDS, CALL_SPREAD, CONTENDER_ROUNDS, HOST_SLACK,
                                                LOOKS_S, ROUNDS, TIE)
from adaattn.attention.kernel_manager import CONTENDER as MGR_CONTENDER
from adaattn.report.common import Section, Verdict, fmt, guide_figures, md_table, save_figure
from adaattn_experiments.ada_modules import GOAL_OVERHEAD, HOST_PROBE_EVERY_S, HOST_PROBE_LOOP
from adaattn_experiments.side_by_side import BURST, CI_LEVEL, CONTENDER, LEFT_ROUNDS

SAME_TOLERANCE = 0.10  # G2-T1: "the same ms" within 10%
MAIN = ["mha", "standard", "adaattn", "adaattn_auto", "adaattn_noopt"]
FIGURE_METRICS = ["time_ms", "kernel_ms", "peak_mem_mb"]  # the scaling figures' rows (kernel_ms: CUDA only)
GOAL_TIMES = {"kernel_ms": "kernel time (GPU, summed over the call's kernels; the providers' calls "
              "interleaved in one trace)",
              "goal_kernel_ms": "kernel time of a manager that ranks by it (adaattn_gpu: objective gpu; its calls and "
              "the direct backends' interleaved in one trace; the median over the trace's rounds of its kernel time "
              "over each backend's in the same round, the highest of them)",
              "paired_ratio": "time per call, side by side (adaattn's and the direct backends' calls interleaved "
              "in shuffled rounds; the median over rounds of adaattn's time over each backend's in the same round, "
              "the highest of them: the fastest backend's; on a GPU, CUDA events: host time shows where the device "
              "waits)"}


def render(study: str, df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[~df["case_id"].isin(["machine"]) & ~df["case_id"].str.startswith("manager/")].copy()
    if study == "cpu_baseline":
        return [_g2_t1(runs)]
    load = host_load(runs)
    return _scaling(runs[load == 0], df, out_dir, runs[load > 0])


def host_load(runs: pd.DataFrame) -> pd.Series:
    """Each row's host load (us of other host work before every call; 0 where the results have none)."""
    if "host_load_us" not in runs:
        return pd.Series(0.0, index=runs.index)
    return runs["host_load_us"].astype(float).fillna(0.0)


def _metric(runs: pd.DataFrame, metric: str, value: str = "value") -> pd.DataFrame:
    ok = runs[(runs["metric"] == metric) & (runs["status"] == "ok")]
    return ok.pivot_table(index=["target", "hardware", "case_id", "sweep", "batch", "seq_len", "causal", "mode"],
                          columns="provider", values=value).reset_index()


def host_probes(runs: pd.DataFrame) -> pd.DataFrame:
    """Per target, the host probe's times through the run (``host_probe_ms`` rows): how many, over how long,
    fastest, median, slowest, and slowest over fastest."""
    p = runs[runs["metric"] == "host_probe_ms"]
    rows = []
    for target, f in p.groupby("target"):
        at = f["reason"].astype(str).str.extract(r"^(\d+) s", expand=False).astype(float)
        v = f["value"].astype(float)
        rows.append({"target": target, "probes": len(f), "over s": fmt(at.max()), "fastest ms": fmt(v.min()),
                     "median ms": fmt(v.median()), "slowest ms": fmt(v.max()),
                     "slowest / fastest": fmt(v.max() / v.min(), 3)})
    return pd.DataFrame(rows)


def _probe_markdown(probes: pd.DataFrame) -> str:
    if probes.empty:
        return ""
    return ("### The host's speed through the run\n\n"
            f"A pure-Python loop of {HOST_PROBE_LOOP} multiply-adds (the fastest of 3), timed between the study's "
            f"steps, at most every {HOST_PROBE_EVERY_S:g} s (`host_probe_ms` rows; `host_probe_ms` in "
            "`experiments/ada_modules.py`): it touches neither torch nor the GPU, so it moves with the host alone "
            "(its clock, other tenants), not with the process. Where a call is host-bound its time per call moves "
            "with the host, and the fastest backend can change with it: the goal's time per call at such a shape "
            "is a verdict on the host this run had.\n\n" + md_table(probes) + "\n\n")


def _g2_t1(runs: pd.DataFrame) -> Section:
    """From the side-by-side rows: each provider's mean ± std over the rounds, and the verdict on
    adaattn's time over nn.MultiheadAttention's, round by round (``paired_ratio``)."""
    guide = guide_figures()["G2-T1"]["figures"]["forward_ms"]
    if not ((runs["metric"] == "side_by_side_ms") & (runs["status"] == "ok")).any():
        return Section("G2-T1", "CPU Baseline (Reference)", "No side-by-side timings in these results: rerun "
                       "`adaattn run cpu_baseline`.\n", [])
    mean, std = _metric(runs, "side_by_side_ms", "mean"), _metric(runs, "side_by_side_ms", "std")
    paired = _paired(runs)
    rows, verdicts = [], []
    for (_, m), (_, s) in zip(mean.iterrows(), std.iterrows(), strict=True):
        point = f"B{int(m['batch'])}_S{int(m['seq_len'])}"
        row = {"target": m["target"], "point": point, "mode": m["mode"]}
        for p in MAIN:
            if p in m and pd.notna(m[p]):
                row[f"{p} ms"] = f"{m[p]:.3g} ± {s[p]:.2g}"
        ratio = paired.get((m["target"], m["case_id"], m["mode"], "mha"))
        row["adaattn / mha, per round"] = "-" if ratio is None else _ratio_text(ratio)
        row["guide Standard ms"] = guide["standard"].get(point, "-")
        row["guide GPU Optimized ms"] = guide["gpu_optimized"].get(point, "-")
        rows.append(row)
        if m["mode"] == "fwd" and point in guide["standard"] and ratio is not None:
            verdicts.append(Verdict(
                "G2-T1", f"{point}: GPU-optimized AdaAttn takes the same time as standard on a CPU",
                f"{guide['gpu_optimized'][point]} vs {guide['standard'][point]} ms (CPU not named)",
                f"adaattn {m['adaattn']:.3g} ms vs nn.MultiheadAttention {m['mha']:.3g} ms (means); adaattn / mha "
                f"per round {_ratio_text(ratio)}", m["hardware"],
                _verdict(ratio, 1 - SAME_TOLERANCE, 1 + SAME_TOLERANCE),
                f"same within {SAME_TOLERANCE:.0%}, on the median of the per-round ratios: holds where its "
                f"{CI_LEVEL:.0%} confidence interval lies inside, does not hold where it lies outside; the guide's "
                "absolute ms are from a CPU it does not name, so only the ratio is compared"))
    md = ("Forward time per call (ms), embed 512, 8 heads, fp32: mean ± standard deviation over rounds in which "
          "every provider is called once, in a shuffled order (`experiments/side_by_side.py`), so that the "
          "machine's drift lands on all of them alike; `adaattn / mha, per round`: the median of adaattn's time over "
          f"nn.MultiheadAttention's in the same round, the {CI_LEVEL:.0%} confidence interval of that median "
          "(distribution-free) and the rounds' p20-p80. Providers: `mha` nn.MultiheadAttention; "
          "`standard` matmul-softmax-matmul module; `adaattn` AdaAttention (kernel manager, rank full); "
          "`adaattn_auto` (precision and rank auto); `adaattn_noopt` (enable_gpu_optimization=False). The harness's "
          "times of each provider alone, one after another, are the `time_ms` rows of the results. The guide's "
          "figures are the same for both of its rows.\n\n" + md_table(pd.DataFrame(rows)) + "\n")
    return Section("G2-T1", "CPU Baseline (Reference)", md, verdicts)


def _paired(runs: pd.DataFrame) -> dict[tuple, dict]:
    """(target, case_id, mode, other provider) -> adaattn's per-round ratio to it: value (p50), p20, p80,
    and the p50's confidence bounds ci_low, ci_high (unbounded where the results have none)."""
    return {(r["target"], r["case_id"], r["mode"], r["vs"]): r.to_dict() for _, r in _paired_frame(runs).iterrows()}


def _paired_frame(runs: pd.DataFrame, metric: str = "paired_ratio") -> pd.DataFrame:
    """The ``metric`` rows (``paired_ratio``: time per call; ``goal_kernel_paired_ratio``: kernel time), the
    other provider in ``vs``, with ``ci_low`` and ``ci_high`` from their ``<metric>_ci_*`` rows."""
    keys = ["target", "case_id", "mode", "provider"]
    ok = runs[runs["status"] == "ok"]
    out = ok[ok["metric"] == metric]
    for side, fill in (("low", -math.inf), ("high", math.inf)):
        b = ok[ok["metric"] == f"{metric}_ci_{side}"][[*keys, "value"]].rename(columns={"value": f"ci_{side}"})
        out = out.merge(b, on=keys, how="left")
        out[f"ci_{side}"] = out[f"ci_{side}"].fillna(fill)
    return out.rename(columns={"provider": "vs"})


def _ratio_text(r: dict) -> str:
    return f"{r['value']:.3f} (CI {r['ci_low']:.3f}-{r['ci_high']:.3f}; p20-p80 {r['p20']:.3f}-{r['p80']:.3f})"


def _verdict(r: dict, low: float, high: float) -> str:
    """A ratio's median claimed within [low, high]: by its confidence interval."""
    if low <= r["ci_low"] and r["ci_high"] <= high:
        return "holds"
    if r["ci_high"] < low or r["ci_low"] > high:
        return "does not hold"
    return "inconclusive"


def _scaling(runs: pd.DataFrame, df: pd.DataFrame, out_dir: Path, loaded: pd.DataFrame) -> list[Section]:
    t = _metric(runs, "time_ms")
    mem = _metric(runs, "peak_mem_mb")
    util = _metric(runs, "gpu_util_pct")
    parts = []
    ok = runs[(runs["status"] == "ok") & runs["provider"].isin(MAIN) & runs["metric"].isin(FIGURE_METRICS)].copy()
    ok["tokens"] = ok["batch"] * ok["seq_len"]
    for target, frame in ok.groupby("target"):
        for sweep, x in (("seq", "seq_len"), ("batch", "batch")):
            f = frame[frame["sweep"] == sweep]
            if f.empty:
                continue
            grid = sns.relplot(data=f, x=x, y="value", hue="provider", hue_order=MAIN, row="metric", col="mode",
                               row_order=[m for m in FIGURE_METRICS if m in set(f["metric"])], kind="line",
                               marker="o", height=2.6, aspect=1.4, facet_kws={"sharey": False}, errorbar=None)
            grid.set(xscale="log", yscale="log")
            name = f"g2_b_{sweep}_{target}.png"
            save_figure(grid.figure, out_dir / name)
            parts.append(f"![{sweep} sweep, {target}]({out_dir.name}/{name})\n")
    rows = []
    mem_by_key = mem.set_index(["target", "case_id", "mode"])
    side = {(r["target"], r["case_id"], r["mode"]): f"{_ratio_text(r)} vs {r['vs'].removeprefix('direct:')}"
            for _, r in _paired_goal(runs).iterrows()}
    spread = same_kernel_spread(runs)
    for _, r in t.iterrows():
        direct = [c for c in t.columns if isinstance(c, str) and c.startswith("direct:") and pd.notna(r[c])]
        best = min(direct, key=lambda c: r[c]) if direct else None
        key = (r["target"], r["case_id"], r["mode"])
        m = mem_by_key.loc[key] if key in mem_by_key.index else None
        row = {"target": r["target"], "B": int(r["batch"]), "S": int(r["seq_len"]), "mode": r["mode"]}
        for p in MAIN:
            row[f"{p} ms"] = fmt(r.get(p))
        row["fastest direct"] = best.removeprefix("direct:") if best else "-"
        row["fastest direct ms"] = fmt(r[best]) if best else "-"
        row["same kernels, sweep ms apart"] = spread.get(key, "-")
        row["adaattn / fastest direct, per round"] = side.get(key, "-")
        if m is not None:
            row["standard MiB"], row["adaattn MiB"] = fmt(m.get("standard")), fmt(m.get("adaattn"))
        tok = r["batch"] * r["seq_len"]
        row["adaattn tokens/s"] = fmt(tok / r["adaattn"] * 1e3) if pd.notna(r.get("adaattn")) else "-"
        rows.append(row)
    table = pd.DataFrame(rows)
    goal_rows = _scaling_goal_rows(runs)
    load_rows = _load_rows(runs, loaded)
    probes = host_probes(runs)
    kern = runs[(runs["metric"] == "time_ms") & (runs["provider"] == "adaattn") & (runs["status"] == "ok")]
    kern_tab = kern[["target", "batch", "seq_len", "mode", "kernel"]].rename(columns={"kernel": "kernels (top 3)"})
    keys = ["target", "provider", "case_id"]
    rank_rows = df[df["metric"] == "manager_ranking"][[*keys, "kernel"]]
    looks = df[df["metric"] == "manager_looks"][[*keys, "kernel"]].rename(columns={"kernel": "looks"})
    rank_rows = (rank_rows.merge(looks, on=keys, how="left").fillna({"looks": ""}) if len(looks) else rank_rows).rename(
        columns={"provider": "module", "case_id": "signature", "kernel": "ranking (fastest first)",
                 "looks": "looks (s after the first: typical time per call, ms)"})
    util_tab = util[[c for c in util.columns if c in ("target", "batch", "seq_len", "mode", *MAIN)]] \
        if not util.empty else util
    md_b = "\n".join(parts) + (
        "\nThe sweep's time per call (the figures' `time_ms`, the table's ms: p50 of CUDA events around each call, "
        "the L2 cache flushed before it; on a CPU the host's time), its kernel time (`kernel_ms`: the GPU time of "
        "a call's kernels, summed; CUDA only), peak memory over one call (MiB), tokens/s of AdaAttention, and the "
        "goal's ratio: `adaattn` (kernel manager, rank full, precision = dtype) over the fastest "
        "`direct:<backend>` (the same projections around one backend, called directly), side by side (below). "
        "The sweep times each provider alone, one after another: where a call is host-bound, its time is the "
        "host's at that provider's turn, and the host's speed drifts (below), so the sweep's times rank "
        "providers only where the GPU's time decides. Column `same kernels, sweep ms apart` shows that drift at "
        "each shape: SDPA's own dispatch and the backends it dispatches to, forced, where they ran the same "
        "kernels (the profiler's three longest, in order), the same work but for the forcing: the slowest "
        "sweep time over the fastest, and theirs. "
        "Kernel time does not move with the host.\n\n"
        + md_table(table) + "\n\n### Goal: AdaAttention within 3% of the fastest backend called directly\n\n"
        "On two times. Time per call is what the kernel manager ranks the module's whole call by (its default "
        "objective, `call`): at small shapes on a GPU it is mostly host time, and there the manager may pick a "
        "backend with a slower kernel and a leaner host. Kernel time (the GPU time of a call's kernels) is what a "
        "caller whose host runs ahead of the GPU waits for (a CUDA graph, a GPU-bound model); a manager made with "
        "`objective=\"gpu\"` ranks by it. The default manager's module's kernel time reads above the fastest "
        "backend's wherever it picked a backend with a slower kernel, by that choice and not by its overhead; so "
        "the study also runs a module whose manager ranks by GPU time (`adaattn_gpu`, after the sweep: its calls "
        "and every direct backend's interleaved in one kernel trace per shape and mode, rounds of one call "
        "of each, its ranking in the manager table below), and gives the goal's kernel time for both: the default "
        "module's as the ratio of the medians (the harness's trace), adaattn_gpu's round by round as time per "
        "call below (its kernel time over each backend's in the same round, the median and its confidence "
        "interval: a kernel time of some 20 us is read to a few tenths of a microsecond). "
        "The host's speed drifts within a run (see `host_ms` in the results), so the goal's time per call is "
        "taken once more after the sweep with the providers side by side: per shape and mode, adaattn and every "
        f"direct backend within {CONTENDER:g}x of the fastest in a warm-up, one turn of each per round in a shuffled order "
        f"(on a GPU a turn is {BURST} calls on a flushed, drained queue, the first not counted, the other "
        f"{BURST - 1} back to back and timed together; after a first block of rounds a direct backend that "
        f"another beats with {CI_LEVEL:.0%} confidence leaves the rounds, as it cannot be the fastest, and the rest "
        "of the budget goes to the others; where then the interval of adaattn's ratio to a backend still in "
        f"the rounds spans {GOAL_OVERHEAD}, those take one more block of rounds, as many again, once, and the "
        "ratios come from all of them: `experiments/side_by_side.py`). The ratio is taken round by round, "
        "adaattn's turn over each backend's in "
        "the same round, and its median over the rounds is the goal's ratio to that backend: a drift between "
        "rounds cancels in it (column `adaattn / fastest direct, per round`: the median, its "
        f"{CI_LEVEL:.0%} confidence interval (distribution-free: order statistics of the rounds' ratios), the "
        "rounds' p20-p80, and the backend it is highest against). A shape is above the goal's bound where the "
        "interval lies above it, within where it lies below, and undecided where it spans the bound (against "
        "any backend). The table's other columns are the sweep's own time per call, one provider after "
        "another.\n\n"
        + (md_table(pd.DataFrame(goal_rows).drop(columns="by rounds")) if goal_rows else "no timings") + "\n\n"
        + _probe_markdown(probes) + _load_markdown(load_rows) +
        "### GPU utilization (NVML, % of its sample period with a kernel running, over 1 s of calls)\n\n"
        + (md_table(util_tab) if len(util_tab) else "not measured on these targets (CUDA only)") + "\n\n"
        "### Backend the manager ran (kernels of one call) and its measured ranking per signature\n\n"
        "The ranking's times are the manager's own, of the module's whole call with each backend (ms: time per "
        "call of calls back to back / host time to issue one / GPU time; forward and backward for a signature "
        f"with gradients; host time the fastest of the backend's {ROUNDS} turns, GPU time their median). Time per call: "
        f"the backends within {CALL_SPREAD:g}x of the fastest burst take paired rounds, one turn each per round, "
        f"until one leads every other with {CI_LEVEL:.0%} confidence or about {CALL_BUDGET_MS / 1e3:g} s of calls "
        f"are spent ({CALL_ROUNDS[0]}-{CALL_ROUNDS[1]} rounds), and their time per call is their typical turn; a "
        "time marked * is a fastest burst (no paired rounds), ranked after them. Ranked by time per call; times "
        f"within {TIE:.0%} tie (on a GPU only where their GPU times are within {TIE:.0%} too: the same kernel "
        f"through two dispatch paths): a backend that does not hold the (L, S) score matrix first (`math` and "
        "`sdpa_math` hold it), then SDPA's own dispatch, then the faster call. The backends of the paired "
        f"rounds take them again at the signature's first call {LOOKS_S[0]:g} s after the first look, and at the first "
        f"call {' s, then '.join(f'{t:g}' for t in LOOKS_S[1:])} s after that (column `looks`: each look's typical "
        "times), and the ranking puts them by their worst ratio to the "
        f"fastest over the looks (ties as before); the ranking column's times are the first look's. A backend over {MGR_CONTENDER:g}x "
        f"the fastest after {CONTENDER_ROUNDS} of the {ROUNDS} turns is not timed further. Module `adaattn_gpu` "
        "(its manager's objective gpu): no paired rounds (every time per call a fastest burst); ranked by GPU time, "
        f"a backend whose host time exceeds both its GPU time and {HOST_SLACK:g}x the leanest backend's after the "
        f"others; GPU times within {TIE:.0%} tie: as above, then the leaner host. The kernels "
        "table is adaattn's.\n\n"
        + md_table(kern_tab) + "\n\n" + (md_table(rank_rows) if len(rank_rows) else "") + "\n")
    return [Section("G2-B", "GPU Benchmarking Suite (batch and sequence scaling)", md_b,
                    _goal_verdicts(goal_rows, t, load_rows, probes) + _load_verdicts(load_rows, t)),
            _g2_t2(t, mem, _metric(runs, "kernel_ms"))]


def same_kernel_spread(runs: pd.DataFrame) -> dict[tuple, str]:
    """(target, case_id, mode) -> the sweep times of SDPA's own dispatch (``direct:sdpa``) and of the SDPA backends
    forced (``direct:sdpa_*``) whose calls ran the same kernels as it (their ``time_ms`` rows' ``kernel``: the
    profiler's three longest, in order): the same work but for the forcing. The slowest over the fastest, then
    each one's time, fastest first; only where one forced backend matches. Not by kernel time as well: the same
    kernels' time is read to a few tenths of a microsecond (``ModuleStudy.goal_kernel_calls``); in the H100 scaling
    run at code fe139c3f the sweep's kernel times of SDPA's own dispatch and forced cuDNN at B=1 S=512 forward, the
    same kernels, were 18.3 and 18.8 us."""
    t = runs[(runs["metric"] == "time_ms") & (runs["status"] == "ok") & runs["value"].notna()]
    out = {}
    for key, f in t.groupby(["target", "case_id", "mode"]):
        f = f.set_index("provider")
        own = f["kernel"].get("direct:sdpa")
        if not isinstance(own, str) or not own:
            continue
        group = f.loc[["direct:sdpa"] + [p for p in f.index if p.startswith("direct:sdpa_") and f.loc[p, "kernel"] == own],
                      "value"].sort_values()
        if len(group) > 1:
            out[key] = (f"{group.iloc[-1] / group.iloc[0]:.2f}x (" + ", ".join(
                f"{p.removeprefix('direct:')} {fmt(v)}" for p, v in group.items()) + ")")
    return out


def _load_rows(runs: pd.DataFrame, loaded: pd.DataFrame) -> list[dict]:
    """The 3% goal per target, shape and mode at every host load timed (0: the goal's own rounds): adaattn's
    per-round ratio to the fastest direct backend at each load (``_paired_goal``), that backend, and the
    direct backend whose worst ratio to the fastest over the loads is lowest. A backend's ratio to the fastest
    at a load comes from the paired ratios: adaattn's median ratio to the fastest over its median ratio to that
    backend, each taken round by round; not from the backends' median times, which come from different rounds
    where a backend left them early (``side_by_side_rows``): in the H100 scaling run at code 85c029fb, at B=4
    S=1024 forward without load, forced flash's median over its 40 rounds was 0.116 ms and forced efficient
    attention's over 1000 rounds 0.164, though efficient had outpaced flash in those 40. Empty where the
    results have no load but 0."""
    if loaded.empty:
        return []
    both = pd.concat([runs, loaded])
    both = both.assign(load=host_load(both).to_numpy())
    paired = both[(both["metric"] == "paired_ratio") & (both["status"] == "ok")
                  & both["provider"].astype(str).str.startswith("direct:")]
    adaattn_over = paired.pivot_table(index=["target", "case_id", "mode", "load"], columns="provider", values="value")
    med = adaattn_over.rdiv(adaattn_over.max(axis=1), axis=0)  # each backend over the fastest: (a / fastest) / (a / b)
    out = []
    for (target, case_id, mode), f in both.groupby(["target", "case_id", "mode"]):
        loads = sorted(f["load"].unique())
        per_load = {}
        for us in loads:
            goal = _paired_goal(f[f["load"] == us])
            if len(goal):
                per_load[us] = goal.iloc[0].to_dict()
        if not per_load:
            continue
        times = med.loc[(target, case_id, mode)] if (target, case_id, mode) in med.index.droplevel("load") else None
        worst = {}
        if times is not None:
            worst = times.reindex(loads).max(axis=0, skipna=False).dropna().to_dict()  # a backend missing at a load: none
        best = min(worst, key=worst.get) if worst else None
        first = f.iloc[0]
        out.append({"target": target, "B": int(first["batch"]), "S": int(first["seq_len"]), "mode": mode,
                    "loads": loads, "per_load": per_load, "single": best, "single_worst": worst.get(best, math.inf)})
    return out


def _load_markdown(load_rows: list[dict]) -> str:
    if not load_rows:
        return ""
    loads = sorted({us for r in load_rows for us in r["loads"]})
    rows = []
    for r in load_rows:
        row = {"target": r["target"], "B": r["B"], "S": r["S"], "mode": r["mode"]}
        for us in loads:
            g = r["per_load"].get(us)
            row[f"{us:g} us"] = (f"{g['value']:.3f} ({g['ci_low']:.3f}-{g['ci_high']:.3f}) vs "
                                 f"{str(g['vs']).removeprefix('direct:')}") if g else "-"
        row["one backend at every load (its worst ratio to the fastest)"] = (
            f"{r['single'].removeprefix('direct:')} ({r['single_worst']:.3f})" if r["single"] else "-")
        rows.append(row)
    return ("### Goal under host load\n\n"
            "A model's other layers issue their work between two attention calls; the more host time that takes, "
            "the longer the GPU waits, and the fastest backend can change with it (the study's docstring, "
            "`experiments/ada_modules.py`, cites where it did). Here the goal's providers take side-by-side rounds "
            "once more with every call preceded by a fixed spell of other host work (a busy wait of the load in "
            "the column head; 0 us: the rounds above): adaattn's per-round ratio to the fastest direct backend "
            f"(median, its {CI_LEVEL:.0%} confidence interval) and that backend; the rounds go as above, the second "
            "block where open included. The times include the load. The manager "
            "ranks each signature by its own calls, without a load (its later looks too). Last column: the direct backend whose highest ratio to the "
            "fastest over the loads is lowest, its ratio at each load from the paired ratios (adaattn's ratio to the "
            f"fastest over its ratio to that backend): where it is above {GOAL_OVERHEAD}, no choice made per signature "
            "without the load holds the goal at every load.\n\n"
            + md_table(pd.DataFrame(rows)) + "\n\n")


def _load_verdicts(load_rows: list[dict], t: pd.DataFrame) -> list[Verdict]:
    hw = dict(zip(t["target"], t["hardware"], strict=False))
    out = []
    for target in sorted({r["target"] for r in load_rows}):
        rows = [r for r in load_rows if r["target"] == target]
        points = [(r, us, g) for r in rows for us, g in r["per_load"].items() if us > 0]
        if not points:
            continue
        side = [_verdict(g, -math.inf, GOAL_OVERHEAD) for _, _, g in points]
        n_above, n_open = side.count("does not hold"), side.count("inconclusive")
        worst_r, worst_us, worst = max(points, key=lambda p: p[2]["value"])
        loads = sorted({us for _, us, _ in points})
        single = sum(r["single_worst"] <= GOAL_OVERHEAD for r in rows)
        out.append(Verdict(
            "G2-B", "goal: AdaAttention (rank full) within 3% of the fastest backend called directly, under host "
            f"load ({', '.join(f'{us:g}' for us in loads)} us of other host work before each call)", "(issue goal)",
            f"time per call, side by side: {n_above} of {len(points)} (shape, mode, load) points above {GOAL_OVERHEAD}"
            + (f", {n_open} undecided" if n_open else "")
            + f"; worst {_ratio_text(worst)} at B={worst_r['B']} S={worst_r['S']} {worst_r['mode']}, {worst_us:g} us. "
            f"At {single} of {len(rows)} shapes x modes one direct backend is within {GOAL_OVERHEAD} of the fastest at "
            "every load (0 us included)", hw.get(target, target),
            "does not hold" if n_above else "inconclusive" if n_open else "holds",
            "the manager ranks each signature by its own calls, without a load (its later looks too); where no backend is within the bound at every "
            "load, no such choice holds the goal at all of them"))
    return out


def _scaling_goal_rows(runs: pd.DataFrame) -> list[dict]:
    """The 3% goal per target and time (``GOAL_TIMES``): shapes x modes, how many are above the bound (time
    per call: by the medians' confidence intervals, and how many are undecided), the median and worst ratio."""
    goal_rows = []
    for metric, label in GOAL_TIMES.items():
        has = lambda m: ((runs["metric"] == m) & (runs["status"] == "ok")).any()  # noqa: E731
        paired = PAIRED.get(metric) if has(PAIRED.get(metric, "")) else None
        if paired:
            tm = _paired_goal(runs, paired)
        elif metric != "paired_ratio" and has(metric):
            tm = _metric(runs, metric)
        else:
            continue
        for target, f in tm.groupby("target"):
            ratios = f["value"] if paired else _ratios(f, GOAL_PROVIDER.get(metric, "adaattn"))
            if ratios is None or not ratios.notna().any():
                continue
            worst = f.loc[ratios.idxmax()]
            at = f"B={int(worst['batch'])} S={int(worst['seq_len'])} {worst['mode']}"
            row = {"time": label, "target": target, "shapes x modes": int(ratios.notna().sum()), "by rounds": bool(paired)}
            if paired:  # decided by the medians' confidence intervals
                at += f" ({_ratio_text(worst)})"
                side = f.apply(lambda r: _verdict(r, -math.inf, GOAL_OVERHEAD), axis=1)
                row |= {f"above {GOAL_OVERHEAD}": int((side == "does not hold").sum()),
                        "undecided": int((side == "inconclusive").sum())}
            else:
                row |= {f"above {GOAL_OVERHEAD}": int((ratios > GOAL_OVERHEAD).sum()), "undecided": 0}
            goal_rows.append(row | {"median ratio": fmt(ratios.median(), 4), "worst ratio": fmt(ratios.max(), 4),
                                    "at": at})
    return goal_rows


GOAL_PROVIDER = {"goal_kernel_ms": "adaattn_gpu"}  # the module a goal time is of, where not adaattn
# a goal time decided on per-round ratios with confidence intervals: its rows (results from before the kernel
# trace had them are decided on the ratio of the medians)
PAIRED = {"paired_ratio": "paired_ratio", "goal_kernel_ms": "goal_kernel_paired_ratio"}


def _ratios(f: pd.DataFrame, own: str = "adaattn") -> pd.Series | None:
    """``own`` over the fastest direct backend, per row of a ``_metric`` pivot (None: not both there)."""
    direct = [c for c in f.columns if isinstance(c, str) and c.startswith("direct:")]
    if own not in f or not direct:
        return None
    return f[own] / f[direct].min(axis=1)


def _paired_goal(runs: pd.DataFrame, metric: str = "paired_ratio") -> pd.DataFrame:
    """Per target, case and mode: the module's per-round ratio to the fastest direct backend (the highest
    of its ratios to the direct backends), with that backend in ``vs``. Its confidence bounds are the
    highest of the direct backends' (the goal holds against every backend or against none). A backend
    that left the rounds early, another faster than it with confidence (its reason: ``why_left``), is not
    the fastest and is not among them: its interval, from those few rounds, is wide (in the H100 scaling
    run at code f6b24ec3, at B=4 S=1024 forward and backward, adaattn over direct:sdpa, outpaced by
    efficient attention after 40 rounds: CI 0.900-1.050; over efficient attention, 895 rounds:
    1.018-1.032). ``metric``: as ``_paired_frame``."""
    cols = ["target", "case_id", "mode", "batch", "seq_len", "value", "p20", "p80", "vs", "ci_low", "ci_high"]
    ok = _paired_frame(runs, metric)
    left = ok["reason"].fillna("").astype(str).str.startswith(LEFT_ROUNDS) if "reason" in ok else False
    ok = ok[ok["vs"].astype(str).str.startswith("direct:") & ~left]
    if ok.empty:
        return pd.DataFrame(columns=cols)
    group = ok.groupby(["target", "case_id", "mode"])
    top = ok.loc[group["value"].idxmax()].set_index(["target", "case_id", "mode"])
    top[["ci_low", "ci_high"]] = group[["ci_low", "ci_high"]].max()
    return top.reset_index()[cols]


GOAL_REASONS = {
    GOAL_TIMES["kernel_ms"]: "adaattn's manager ranks by time per call (objective call, the default): where a call is "
    "host-bound it may run a backend with a longer kernel and a leaner host",
    GOAL_TIMES["goal_kernel_ms"]: "its manager ranks by GPU time measured with the GPU held while the host issues the "
    "calls, a host-heavy backend last; AdaAttention's default objective is call"}


def _goal_verdicts(goal_rows: list[dict], t: pd.DataFrame, load_rows: list[dict] = (),
                   probes: pd.DataFrame | None = None) -> list[Verdict]:
    """The 3% goal's verdict per target and time; under time per call, with host loads timed, how many of the
    shapes above the bound have no direct backend within it at every load (``_load_rows``), and how far the
    host's speed moved through the run (``host_probes``)."""
    hw = dict(zip(t["target"], t["hardware"], strict=False))
    spread = {} if probes is None or probes.empty else dict(zip(probes["target"], probes["slowest / fastest"],
                                                                strict=True))
    out = []
    for g in goal_rows:
        per_call = g["time"] == GOAL_TIMES["paired_ratio"]
        by_ci = (f"a shape is above where the {CI_LEVEL:.0%} confidence interval of the median over the rounds lies "
                 "above the bound, undecided where it spans it")
        above = [r for r in load_rows if r["target"] == g["target"] and 0 in r["per_load"]
                 and _verdict(r["per_load"][0], -math.inf, GOAL_OVERHEAD) == "does not hold"]
        none_single = sum(r["single_worst"] > GOAL_OVERHEAD for r in above)
        n_above, n_open = g[f"above {GOAL_OVERHEAD}"], g["undecided"]
        verdict = "does not hold" if n_above else "inconclusive" if n_open else "holds"
        name = "goal: AdaAttention (rank full) within 3% of the fastest backend called directly"
        if g["time"] == GOAL_TIMES["goal_kernel_ms"]:
            name = name.replace("(rank full)", "(rank full, objective gpu)")
        out.append(Verdict("G2-B", name,
                           "(issue goal)", f"{g['time']}: {n_above} of {g['shapes x modes']} above {GOAL_OVERHEAD}"
                           + (f", {n_open} undecided" if n_open else "")
                           + f"; median {g['median ratio']}, worst {g['worst ratio']} at {g['at']}",
                           hw.get(g["target"], g["target"]), verdict,
                           by_ci
                           + (f"; under host load (Goal under host load), at {none_single} of the {len(above)} "
                              "shapes above no direct backend is within the bound at every load"
                              if per_call and above else "")
                           + (f"; the host probe's slowest was {spread[g['target']]}x its fastest in this run"
                              if g["target"] in spread else "")
                           if per_call else (by_ci + "; " if g["by rounds"] else "") + GOAL_REASONS[g["time"]]))
    return out


def _speedups(times: pd.DataFrame, target: str) -> pd.DataFrame:
    """standard / adaattn per sequence length above 1024 of ``target``'s seq sweep, forward (``times``: a
    ``_metric`` pivot); empty where the results have not both."""
    f = times[(times["sweep"] == "seq") & (times["mode"] == "fwd") & (times["target"] == target)] \
        if len(times) else times
    if f.empty or "standard" not in f or "adaattn" not in f:
        return pd.DataFrame(columns=["seq_len", "speedup"])
    f = f[f["seq_len"] > 1024].dropna(subset=["standard", "adaattn"]).sort_values("seq_len")
    return pd.DataFrame({"seq_len": f["seq_len"], "speedup": f["standard"] / f["adaattn"]})


def _g2_t2(t: pd.DataFrame, mem: pd.DataFrame, kern: pd.DataFrame) -> Section:
    """G2-T2's memory and speed lines. Speed by the sweep's time per call and, on a GPU, by kernel time too:
    the sweep times each provider alone, and at a host-bound shape its time is the host's at that turn; where
    the two read different verdicts the claim is inconclusive."""
    guide = guide_figures()["G2-T2"]["figures"]
    verdicts, rows = [], []
    seq_t = t[(t["sweep"] == "seq") & (t["mode"] == "fwd")]
    seq_m = mem[(mem["sweep"] == "seq") & (mem["mode"] == "fwd")]
    for target, f in seq_m.sort_values("seq_len").groupby("target"):
        hw = f["hardware"].iloc[0]
        above = f[f["seq_len"] > 512].dropna(subset=["standard", "adaattn"]) if "standard" in f else f.iloc[0:0]
        lo, hi = guide["memory_reduction_above_512"]
        if above.empty:
            verdicts.append(Verdict("G2-T2", f"memory reduction {lo:.0%}-{hi:.0%} for sequences > 512", f"{lo:.0%}-{hi:.0%}",
                                    "-", hw, "not measurable here", "no sequence above 512 in this target's sweep"))
        else:
            red = 1 - above["adaattn"] / above["standard"]
            inside = ((red >= lo) & (red <= hi)).all()
            verdicts.append(Verdict(
                "G2-T2", f"memory reduction {lo:.0%}-{hi:.0%} for sequences > 512", f"{lo:.0%}-{hi:.0%}",
                f"{red.min():.0%}-{red.max():.0%} (adaattn vs standard peak memory, forward, S = "
                f"{', '.join(str(int(s)) for s in above['seq_len'])})", hw, "holds" if inside else "does not hold",
                "the standard module holds the S x S scores; a fused kernel does not, so the saving grows with S"))
        for _, r in f.iterrows():
            rows.append({"target": target, "S": int(r["seq_len"]), "standard MiB": fmt(r.get("standard")),
                         "adaattn MiB": fmt(r.get("adaattn")),
                         "reduction": fmt(1 - r["adaattn"] / r["standard"]) if pd.notna(r.get("standard")) else "-"})
    lo, hi = guide["speedup_above_1024"]
    for target, f in seq_t.groupby("target"):
        hw = f["hardware"].iloc[0]
        by = {basis: _speedups(times, target) for basis, times in (("time per call", t), ("kernel time", kern))}
        by = {basis: s for basis, s in by.items() if len(s)}
        if not by:
            verdicts.append(Verdict("G2-T2", f"speed {lo}-{hi}x for sequences > 1024", f"{lo}-{hi}x", "-", hw,
                                    "not measurable here", "no sequence above 1024 in this target's sweep"))
            continue
        reads = {basis: "holds" if s["speedup"].between(lo, hi).all() else "does not hold" for basis, s in by.items()}
        measured = "; ".join(
            f"{s['speedup'].min():.2f}-{s['speedup'].max():.2f}x by {basis} (standard / adaattn, forward, S = "
            f"{', '.join(str(int(v)) for v in s['seq_len'])})" for basis, s in by.items())
        agree = len(set(reads.values())) == 1
        verdicts.append(Verdict(
            "G2-T2", f"speed {lo}-{hi}x for sequences > 1024", f"{lo}-{hi}x", measured, hw,
            next(iter(reads.values())) if agree else "inconclusive",
            "" if agree else "the two times read different verdicts: " + ", ".join(
                f"{basis} {v}" for basis, v in reads.items())))
    md = ("G2-T2's third line (1.5-2x from FP16/BF16) is checked by the precision study, under G2-T3.\n\n"
          "Memory of the seq sweep (forward, batch as in params.yaml): the standard module vs AdaAttention.\n\n"
          + (md_table(pd.DataFrame(rows)) if rows else "no results") + "\n")
    return Section("G2-T2", "Expected GPU Performance Gains (memory and speed lines)", md, verdicts)
