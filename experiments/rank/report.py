"""Report of the rank study (G2-C1's adaptive rank): the low-rank paths' (Nyström, pooled) error and
speed by rank and length, the rank estimators, the policy vs the oracle rank, and the low-rank speed
goal. From the results table only (see ``rank.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn.kernels.nystrom import fused_solve
from adaattn.attention.rank import LOW_RANK_METHODS, PINV_ITERS, PINV_MATMULS_PER_ITER
from adaattn.timing.rounds import BURST, CI_LEVEL
from adaattn_pipeline.report.common import (Section, Verdict, fmt, judge, knobs, md_table, one_point_table, prose,
                                            save_figure)
from adaattn_experiments.rank.study import low_rank_of

# what the r x r solve costs at least (``rank.RankStudy._solve_floor``): metric -> column
SOLVE_FLOORS = {"pinv_fp32_ms": "pinv products ms (cuBLAS fp32)", "pinv_bf16_ms": "pinv products ms (cuBLAS bf16)",
                "lu_solve_ms": "LU solve ms (fp32)"}
# the fused Nyström kernels (kernels/nystrom.py); the recorded names are a call's top 3
FUSED = re.compile(r"\b(_landmarks|_bv_partial|_landmark_solve|_nystrom_out)\b")


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    bound = knobs().low_rank_speedup  # the low-rank path over the best exact backend (params.yaml verdicts)
    runs = df[(df["case_id"] != "machine")]
    ok = runs[runs["status"] == "ok"]
    timed = ok[ok["metric"].isin(["time_ms", "kernel_ms", "rel_l2", "side_by_side_ms"])].pivot_table(
        index=["target", "hardware", "case_id", "inputs", "true_rank", "seq_len", "head_dim"],
        columns=["metric", "provider"],
        values="value")
    # which Nyström implementation ran (the harness records the kernels of each timed call); every per-case
    # lookup is keyed by (target, case_id): two GPUs of one profile run the same case ids
    names = ok[ok["metric"] == "time_ms"].set_index(["target", "case_id", "provider"])["kernel"].fillna("")
    tol = _tolerance(df)
    heads_of = (ok["batch"] * ok["heads"]).groupby([ok["target"], ok["case_id"]]).first().dropna().astype(int)
    heads_of = heads_of.to_dict()
    floors = _solve_floors(ok)
    parts, rows, goal_rows = [], [], []
    err = ok[(ok["metric"] == "rel_l2") & ok["provider"].map(lambda p: low_rank_of(p) is not None)].copy()
    err["method"] = err["provider"].map(lambda p: low_rank_of(p).method)
    err["landmarks"] = err["provider"].map(lambda p: low_rank_of(p).rank)
    for target, f in err.groupby("target"):
        lengths = sorted(f["seq_len"].dropna().astype(int).unique())  # a legend of the lengths measured
        f = f.assign(S=f["seq_len"].astype(int).astype(str))
        title = f"G2-C1 low-rank error (relative L2) on {f['hardware'].iloc[0]} ({target})"
        if (table := one_point_table(f, "landmarks", ["inputs", "S", "method"], title)) is not None:
            parts.append(table)
            continue
        grid = sns.relplot(data=f, x="landmarks", y="value", hue="S", hue_order=[str(n) for n in lengths],
                           style="method", col="inputs", kind="line", marker="o", height=2.6, aspect=1.1,
                           palette="viridis", errorbar=None, col_wrap=3)
        grid.set(xscale="log", yscale="log")
        grid.set_axis_labels("landmarks (segments)", "relative L2 error vs float64")
        grid.figure.suptitle(f"G2-C1 low-rank error on {f['hardware'].iloc[0]} ({target}); hue: sequence length",
                             y=1.01)
        name = f"g2_c1_error_{target}.png"
        save_figure(grid.figure, out_dir / name)
        parts.append(f"![error by rank, {target}]({out_dir.name}/{name})\n")
    est = ok[ok["provider"] == "estimator"].pivot_table(index=["target", "case_id", "inputs", "seq_len", "head"],
                                                         columns="metric", values="value").reset_index()
    for target, f in est.groupby("target"):
        grid = sns.relplot(data=f, x="entropy_rank", y="spectrum_rank_sampled", hue="inputs", style="seq_len",
                           height=3.0, aspect=1.4)
        grid.set(xscale="log", yscale="log")
        name = f"g2_c1_entropy_vs_rank_{target}.png"
        save_figure(grid.figure, out_dir / name)
        parts.append(f"![entropy rank vs sampled spectrum rank per head, {target}]({out_dir.name}/{name})\n")
    policy = ok[ok["provider"] == "policy"].pivot_table(index=["target", "case_id"], columns="metric",
                                                         values="value")
    reasons = runs[runs["metric"] == "policy_rank"].set_index(["target", "case_id"])["reason"]
    policy_path = runs[runs["metric"] == "policy_rank"].set_index(["target", "case_id"])["kernel"].fillna("")
    est_mean = est.groupby(["target", "case_id"])[
        [c for c in ("spectrum_rank_sampled", "spectrum_rank_full", "entropy_rank") if c in est]].mean()
    for idx, r in timed.iterrows():
        target, hw, case_id, inputs, true_rank, S, D = idx
        times, errs = r["time_ms"].dropna(), r["rel_l2"].dropna()
        ktimes = r["kernel_ms"].dropna() if "kernel_ms" in r.index.get_level_values(0) else pd.Series(dtype=float)
        exact = [p for p in times.index if low_rank_of(p) is None and p != "policy"]
        best = min(exact, key=lambda p: times[p]) if exact else None
        # the low-rank paths by landmarks, the policy's order at equal landmarks (cheaper first)
        low = sorted((c for c in map(low_rank_of, errs.index) if c is not None),
                     key=lambda c: (c.rank, LOW_RANK_METHODS.index(c.method)))
        oracle = next((c for c in low if errs[f"{c.method}-{c.rank}"] <= tol), None)
        key = (target, case_id)
        pol = policy.loc[key] if key in policy.index else pd.Series(dtype=float)
        prank = int(pol.get("policy_rank", 0) or 0)
        e = est_mean.loc[key] if key in est_mean.index else pd.Series(dtype=float)
        rows.append({"target": target, "inputs": inputs, "S": int(S), "true rank": int(true_rank) or "-",
                     "sampled spectrum rank (mean over heads)": fmt(e.get("spectrum_rank_sampled")),
                     "full-matrix rank": fmt(e.get("spectrum_rank_full")),
                     "entropy rank": fmt(e.get("entropy_rank")),
                     "policy path": f"{policy_path.get(key, '')} {prank}" if prank else
                     f"exact ({policy_path[key]})" if policy_path.get(key) else "exact",
                     "policy rel L2": fmt(errs.get("policy")),
                     "policy ms": fmt(times.get("policy")), "why exact": reasons.get(key, "") if not prank else "",
                     f"oracle path (rel L2 <= {tol:g})": str(oracle) if oracle else "none",
                     "best exact": best or "-", "best exact ms": fmt(times.get(best)) if best else "-"})
        if best and S >= knobs().low_rank_min_len:
            kbest = min(exact, key=lambda e: ktimes.get(e, float("inf"))) if len(ktimes) else None
            side = r["side_by_side_ms"].dropna() if "side_by_side_ms" in r.index.get_level_values(0) else None
            sbest = min((p for p in exact if p in side.index), key=lambda p: side[p], default=None) \
                if side is not None else None
            for method, n in low:
                p = f"{method}-{n}"
                if n <= S // knobs().low_rank_landmarks_div and p in times:
                    per_call = (side[sbest] / side[p] if sbest and p in side.index else float("nan")) \
                        if side is not None else times[best] / times[p]
                    # the batched solve's cost; the fused path solves inside one kernel (not these launches),
                    # the pooled path solves nothing
                    floor = {} if method != "nystrom" or fused_solve(n, int(D)) else \
                        floors.get((target, heads_of.get(key), n, int(D)), {})
                    budget = (side[sbest] if sbest else times[best]) / bound
                    goal_rows.append({
                        "target": target, "hardware": hw, "inputs": inputs, "S": int(S), "method": method,
                        "landmarks": n, "path": _path(method, names.get((target, case_id, p), ""), n, int(D)),
                        "speedup vs best exact": per_call,
                        "speedup by kernel time": (ktimes[kbest] / ktimes[p] if kbest in ktimes and p in ktimes
                                                   else float("nan")),
                        "rel L2 paid": errs.get(p), "best exact": (sbest or best),
                        f"{bound:g}x budget ms": budget,
                        **{SOLVE_FLOORS[m]: floor.get(m, float("nan")) for m in SOLVE_FLOORS}})
    goal = pd.DataFrame(goal_rows)
    verdicts = []
    per_call_basis = ("time per call, side by side" if (ok["metric"] == "side_by_side_ms").any()
                      else "time per call")
    groups = goal.groupby(["target", "hardware", "method"]) if len(goal) else []
    for (target, hw, method), f in sorted(groups, key=lambda g: LOW_RANK_METHODS.index(g[0][2])):
        for col, basis in (("speedup vs best exact", per_call_basis), ("speedup by kernel time", "kernel time")):
            x = f[col].dropna()
            if x.empty:
                continue
            # a point meets the goal only at an error the policy would pay (its budget, from the results)
            within = f["rel L2 paid"] <= tol
            met = f[(f[col] >= bound) & within]
            miss = len(x) - len(met)
            worst = 0.0 if (~within[x.index]).any() else x.min()  # over the budget: not met at any speed
            verdicts.append(Verdict(
                "G2-C1", f"goal: low-rank ({method}, landmarks <= S/{knobs().low_rank_landmarks_div}) >= {bound:g}x "
                "the best exact at "
                f"S >= {knobs().low_rank_min_len}, rel L2 <= {tol:g}, by {basis}", "(issue goal)",
                f"{x.min():.2f}-{x.max():.2f}x over {len(x)} points; {miss} not met "
                f"({int((~within[x.index]).sum())} over the error budget)"
                + (f" (met up to {int(met['landmarks'].max())} landmarks at some S)" if len(met) else ""),
                hw, judge((worst, worst), (bound, None)),
                f"error paid: rel L2 {f['rel L2 paid'].min():.2g}-{f['rel L2 paid'].max():.2g} (see the table)"
                + _floor_reason(f)))
    shown = goal.drop(columns=["hardware"]).copy() if len(goal) else goal
    if len(shown):
        for col in ("speedup vs best exact", "speedup by kernel time", "rel L2 paid", f"{bound:g}x budget ms",
                    *SOLVE_FLOORS.values()):
            shown[col] = shown[col].map(fmt)
    real = sorted({i for i in runs["inputs"].dropna().unique() if str(i).startswith("minilm-l")})
    sources = "".join(f"; {t}: {src}" for t, src in _real_sources(ok).items())
    real_note = prose(__file__, "g2_c1.real", inputs=", ".join(real), sources=sources) if real else ""
    shown_table = md_table(shown) if len(shown) else \
        f"no point of this sweep has S >= {knobs().low_rank_min_len} (the CPU profile)"
    md = prose(__file__, "g2_c1", figures="\n".join(parts), tol=f"{tol:g}", real_note=real_note,
               rows_table=md_table(pd.DataFrame(rows)), low_rank_landmarks_div=knobs().low_rank_landmarks_div,
               low_rank_min_len=knobs().low_rank_min_len, burst=BURST, burst_1=BURST - 1, ci_level=f"{CI_LEVEL:.0%}",
               bound=f"{bound:g}", pinv_products=PINV_ITERS * PINV_MATMULS_PER_ITER, pinv_iters=PINV_ITERS,
               pinv_matmuls_per_iter=PINV_MATMULS_PER_ITER, shown_table=shown_table)
    return [Section("G2-C1", "Adaptive rank (rank estimate, low-rank paths, policy)", md, verdicts)]


def _solve_floors(ok: pd.DataFrame) -> dict[tuple[str, int, int, int], dict[str, float]]:
    """(target, batch x heads, landmarks, head dim) -> the solve's floors (ms) from the ``solve-<r>`` rows."""
    f = ok[ok["provider"].str.startswith("solve-", na=False) & ok["metric"].isin(list(SOLVE_FLOORS))]
    out: dict[tuple[str, int, int, int], dict[str, float]] = {}
    for _, x in f.iterrows():
        key = (x["target"], int(x["batch"] * x["heads"]), int(x["provider"].removeprefix("solve-")),
               int(x["head_dim"]))
        out.setdefault(key, {})[x["metric"]] = x["value"]
    return out


def _floor_reason(f: pd.DataFrame) -> str:
    """Where the r x r solve alone takes longer than the goal allows the whole call."""
    bound = knobs().low_rank_speedup
    budget, bf16, lu, fp32 = (f[f"{bound:g}x budget ms"], f[SOLVE_FLOORS["pinv_bf16_ms"]],
                              f[SOLVE_FLOORS["lu_solve_ms"]], f[SOLVE_FLOORS["pinv_fp32_ms"]])
    if bf16.isna().all():
        return ""
    n_mm = PINV_ITERS * PINV_MATMULS_PER_ITER
    out = ""
    over = f[(bf16 > budget) & (lu > budget)]
    if len(over):
        out += prose(__file__, "floor_reason", over_budget=len(over), cases=len(f),
                     fewest=int(over['landmarks'].min()),
                     most=int(over['landmarks'].max()), bound=f"{bound:g}", n_mm=n_mm)
    fp32_only = f[(fp32 > budget) & ~((bf16 > budget) & (lu > budget))]
    if len(fp32_only):
        out += (f"; at {len(fp32_only)} more the pseudo-inverse's products in cuBLAS fp32 alone exceed it (a "
                "lower-precision or direct solve could fit there, at an error not measured here)")
    return out


def _path(method: str, kernels: str, landmarks: int, head_dim: int) -> str:
    """Which implementation a timed low-rank call ran (Nyström's from its recorded kernel names)."""
    if method == "pooled":  # the fused forward's means kernel, else the PyTorch path (SDPA)
        return "fused Triton (means, output)" if "_pooled_means" in kernels else "PyTorch (SDPA over segment means)"
    if not FUSED.search(kernels):
        return "PyTorch"
    return "fused Triton" if fused_solve(landmarks, head_dim) else "Triton, batched solve (CUDA graph)"


def _tolerance(df: pd.DataFrame) -> float:
    """The error tolerance the run's policy used (one row per case says it)."""
    tol = df.loc[df["metric"] == "policy_tolerance", "value"].dropna().unique()
    if len(tol) != 1:
        raise ValueError(f"expected one policy tolerance in the rank results, found {list(tol)}")
    return float(tol[0])


def _real_sources(ok: pd.DataFrame) -> dict[str, str]:
    """target -> where its real inputs came from (the ``real_inputs_source`` row: the capture's source)."""
    rows = ok[ok["metric"] == "real_inputs_source"]
    return dict(zip(rows["target"], rows["reason"] + " (" + rows["kernel"] + ")", strict=True))
