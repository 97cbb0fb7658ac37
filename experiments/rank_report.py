"""Report of the rank study (G2-C1's adaptive rank): Nyström error and speed by rank and length,
the rank estimators, the policy vs the oracle rank, and the low-rank speed goal. From the results
table only (see ``rank.py``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn.report.common import Section, Verdict, fmt, md_table, save_figure

GOAL_SPEEDUP = 2.0  # low-rank at rank <= S/16 at least 2x faster than the best exact backend ...
GOAL_MIN_LEN = 8192  # ... at S >= 8192


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    runs = df[(df["case_id"] != "machine")]
    ok = runs[runs["status"] == "ok"]
    timed = ok[ok["metric"].isin(["time_ms", "rel_l2"])].pivot_table(
        index=["target", "hardware", "case_id", "inputs", "true_rank", "seq_len"], columns=["metric", "provider"],
        values="value")
    tol = _tolerance(df)
    parts, rows, goal_rows = [], [], []
    err = ok[(ok["metric"] == "rel_l2") & ok["provider"].str.startswith("nystrom-")].copy()
    err["landmarks"] = err["provider"].str.removeprefix("nystrom-").astype(int)
    for target, f in err.groupby("target"):
        grid = sns.relplot(data=f, x="landmarks", y="value", hue="seq_len", col="inputs", kind="line", marker="o",
                           height=2.6, aspect=1.1, palette="viridis", errorbar=None, col_wrap=3)
        grid.set(xscale="log", yscale="log")
        grid.set_axis_labels("Nyström landmarks", "relative L2 error vs float64")
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
    policy = ok[ok["provider"] == "policy"].pivot_table(index="case_id", columns="metric", values="value")
    reasons = runs[runs["metric"] == "policy_rank"].set_index("case_id")["reason"]
    est_mean = est.groupby("case_id")[[c for c in ("spectrum_rank_sampled", "spectrum_rank_full", "entropy_rank")
                                       if c in est]].mean()
    for idx, r in timed.iterrows():
        target, hw, case_id, inputs, true_rank, S = idx
        times, errs = r["time_ms"].dropna(), r["rel_l2"].dropna()
        exact = [p for p in times.index if not p.startswith("nystrom-") and p != "policy"]
        best = min(exact, key=lambda p: times[p]) if exact else None
        ny = sorted((int(p.removeprefix("nystrom-")) for p in errs.index if p.startswith("nystrom-")))
        oracle = next((n for n in ny if errs[f"nystrom-{n}"] <= tol), None)
        pol = policy.loc[case_id] if case_id in policy.index else pd.Series(dtype=float)
        prank = int(pol.get("policy_rank", 0) or 0)
        e = est_mean.loc[case_id] if case_id in est_mean.index else pd.Series(dtype=float)
        rows.append({"target": target, "inputs": inputs, "S": int(S), "true rank": int(true_rank) or "-",
                     "sampled spectrum rank (mean over heads)": fmt(e.get("spectrum_rank_sampled")),
                     "full-matrix rank": fmt(e.get("spectrum_rank_full")),
                     "entropy rank": fmt(e.get("entropy_rank")),
                     "policy landmarks": prank or "exact", "policy rel L2": fmt(errs.get("policy")),
                     "policy ms": fmt(times.get("policy")), "why exact": reasons.get(case_id, "") if not prank else "",
                     f"oracle landmarks (rel L2 <= {tol:g})": oracle or "none",
                     "best exact": best or "-", "best exact ms": fmt(times.get(best)) if best else "-"})
        if best and S >= GOAL_MIN_LEN:
            for n in ny:
                if n <= S // 16 and f"nystrom-{n}" in times:
                    goal_rows.append({"target": target, "hardware": hw, "inputs": inputs, "S": int(S), "landmarks": n,
                                      "speedup vs best exact": times[best] / times[f"nystrom-{n}"],
                                      "rel L2 paid": errs.get(f"nystrom-{n}"), "best exact": best})
    goal = pd.DataFrame(goal_rows)
    verdicts = []
    for (target, hw), f in goal.groupby(["target", "hardware"]) if len(goal) else []:
        miss = f[f["speedup vs best exact"] < GOAL_SPEEDUP]
        verdicts.append(Verdict(
            "G2-C1", f"goal: low-rank path (landmarks <= S/16) >= {GOAL_SPEEDUP}x the best exact backend at "
            f"S >= {GOAL_MIN_LEN}", "(issue goal)",
            f"{f['speedup vs best exact'].min():.2f}-{f['speedup vs best exact'].max():.2f}x over {len(f)} points; "
            f"{len(miss)} below {GOAL_SPEEDUP}x", hw, "holds" if miss.empty else "does not hold",
            f"error paid: rel L2 {f['rel L2 paid'].min():.2g}-{f['rel L2 paid'].max():.2g} (see the table)"))
    shown = goal.drop(columns=["hardware"]).copy() if len(goal) else goal
    if len(shown):
        shown["speedup vs best exact"] = shown["speedup vs best exact"].map(fmt)
        shown["rel L2 paid"] = shown["rel L2 paid"].map(fmt)
    md = ("\n".join(parts) + "\nPer case: the estimators (mean over heads), the policy's choice and error, the "
          f"oracle (fewest landmarks of the sweep with rel L2 <= {tol:g}), and the best exact backend.\n\n"
          + md_table(pd.DataFrame(rows)) + "\n\n"
          f"### Goal: low-rank at landmarks <= S/16, S >= {GOAL_MIN_LEN}: speed vs the best exact backend, and the "
          "error it pays\n\n" + (md_table(shown) if len(shown) else "no point of this sweep has S >= "
                                 f"{GOAL_MIN_LEN} (the CPU profile)") + "\n")
    return [Section("G2-C1", "Adaptive rank (rank estimate, Nyström path, policy)", md, verdicts)]


def _tolerance(df: pd.DataFrame) -> float:
    """The error tolerance the run's policy used (one row per case says it)."""
    tol = df.loc[df["metric"] == "policy_tolerance", "value"].dropna().unique()
    if len(tol) != 1:
        raise ValueError(f"expected one policy tolerance in the rank results, found {list(tol)}")
    return float(tol[0])
