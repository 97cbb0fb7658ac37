"""The memory-bank report (G3-T4), from the results table only (``memory_bank.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import seaborn as sns

from adaattn_experiments.memory_bank.schema import QualityGoal
from adaattn_pipeline.report.common import (Section, Verdict, cpu_targets, figure_link, filed, fmt, guide_figures,
                                            judge, knobs, md_table, prose)

GIB = 1024.0  # MiB


def guide_context(context: int) -> str | None:
    """The guide's row for a context of this many tokens ("2K" for 2048), if it has one."""
    key = f"{context // 1024}K" if context % 1024 == 0 else ""
    return key if key in guide_figures()["G3-T4"]["figures"] else None


# G3-C1's components: (the guide's name, where it is built, what checks it, what measures it); None: not built
COMPONENTS = [
    ("memory bank: adaptive compression, slot management (get_memory_stats, reduce_memory_slots)",
     "models/ltm.py, Transformer", "tests/test_ltm.py", "memory_bank (G3-T4), memory_analysis (G3-T1)"),
    ("gradient checkpointing granularity (full, selective, every k)", "layers (GradientCheckpointMixin)",
     "tests/test_checkpointing.py", "checkpointing (G4-T3), memory_analysis (G3-T1)"),
    ("GradScaler mixed precision (fp16)", "models/train.py, Trainer", "tests/test_train.py", None),
    ("INT8 engine (weight-only)", "models/quant.py", "tests/test_quant.py",
     "inference (G3-T3); its loss change: memory_bank (G3-T4)"),
    ("KV cache (static, and the LTM decoder's segment caches)", "models/generate.py, models/ltm.py",
     "tests/test_generate.py, tests/test_ltm.py", "inference (G3-T3), memory_bank (G3-T4)"),
    ("batch processor", "models/serving.py, BatchProcessor", "tests/test_serving.py", None),
    ("find_optimal_batch_size", "models/serving.py", "tests/test_serving.py", None),
    ("memory monitor", "BatchProcessor.stats (a GPU's peak a batch), bench/memory.py (any device)",
     "tests/test_serving.py", "every study's peak-memory rows"),
    ("throughput tracker (live progress)", "models/serving.py, ThroughputTracker", "tests/test_serving.py", None),
    ("data and tensor parallelism (DDP, FSDP2, TP)", "distributed/parallel.py, train.py, decode.py",
     "tests/test_distributed.py", "distributed (G3-T2, G3-T3)"),
]
PARALLEL = "pipeline parallelism"


def render(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    ok = df[(df["case_id"] != "machine")]
    memory_md, verdicts = _memory(ok)
    quality_md = _quality(ok)
    verdicts += quality_verdicts(ok)
    md = memory_md + quality_md + _figures(ok, out_dir)
    return [Section("G3-T4", "Memory Bank Performance (memory by context, and the price in quality)", md, verdicts),
            _components()]


def _components() -> Section:
    """G3-C1: each component the guide lists, where it is built, the tests that check it, the studies that measure
    it."""
    rows = [{"component": name, "built in": where, "checked by": tests, "measured by": measured or "-"}
            for name, where, tests, measured in COMPONENTS]
    rows.append({"component": PARALLEL, "built in": "-", "checked by": "-", "measured by": "-"})
    verdicts = [Verdict("G3-C1", name, "a component", f"built: {where}", "any", "by construction",
                        f"checked by {tests}" + (f"; measured by {measured}" if measured else ""))
                for name, where, tests, measured in COMPONENTS]
    verdicts.append(Verdict("G3-C1", PARALLEL, "a component", "-", "any", "not measured yet",
                            "not built: adaattn.distributed lays a model over data and tensor parallel ranks, with no "
                            "pipeline-parallel schedule"))
    md = ("Guide 003's components, each where it is built, what checks it (CI, on the CPU) and which study "
          "measures it.\n\n" + md_table(pd.DataFrame(rows)) + "\n")
    return Section("G3-C1", "Components (memory bank, checkpointing, mixed precision, INT8, KV cache, serving)", md,
                   verdicts)


def memory_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per target and context: each model's memory at the context (MiB; None where not measured, with the
    ``<model>_status`` that says why): its forward's peak over the weights plus the state its decoder keeps for the
    next token, ``math`` and ``fused`` (the standard model's two backends; its KV cache) and ``ltm`` (its
    segment caches and banks); and the two states alone (``kv_cache``, ``segment_cache``)."""
    mem = df[df["metric"].isin(["peak_mb", "state_mb"])]
    out = []
    for (target, context), frame in mem.groupby(["target", "context"], sort=True):
        value = {(r.provider, r.metric): (r.value if r.status == "ok" else None) for r in frame.itertuples()}
        status = {r.provider: r.status for r in frame.itertuples()}
        cache, state = value.get(("kv_cache", "state_mb")), value.get(("segment_cache", "state_mb"))
        row = {"target": target, "context": int(context), "hardware": frame["hardware"].iloc[0],
               "kv_cache": cache, "segment_cache": state}
        for p, kept_by in (("math", "kv_cache"), ("fused", "kv_cache"), ("ltm", "segment_cache")):
            peak, kept = value.get((p, "peak_mb")), value.get((kept_by, "state_mb"))
            row[p] = peak + kept if peak is not None and kept is not None else None
            row[f"{p}_status"] = status.get(p if peak is None else kept_by, "not measured")
        out.append(row)
    return pd.DataFrame(out)


def _memory(df: pd.DataFrame) -> tuple[str, list[Verdict]]:
    table = memory_table(df)
    if table.empty:
        return "no memory results\n", []
    guide, cpus, goal = guide_figures()["G3-T4"]["figures"], cpu_targets(df), knobs().ltm_memory_ratio

    def mib(v: float | None, status: str) -> str:
        return fmt(v) if pd.notna(v) else status

    rows, verdicts = [], []
    for r in table.itertuples():
        g = guide.get(guide_context(r.context) or "", {})
        # a model that did not run is NaN in the table (None in a float column)
        ratio = {p: getattr(r, p) / r.ltm if pd.notna(getattr(r, p)) and pd.notna(r.ltm) and r.ltm else None
                 for p in ("math", "fused")}
        rows.append({"target": r.target, "context": r.context,
                     "guide: standard GB / LTM GB (ratio)": f"{g['standard_gb']:g} / {g['ltm_gb']:g} "
                     f"({g['compression']:g}x)" if g else "-",
                     "standard, math MiB": mib(r.math, r.math_status),
                     "standard, fused MiB": mib(r.fused, r.fused_status),
                     "of which KV cache": fmt(r.kv_cache), "LTM MiB": mib(r.ltm, r.ltm_status),
                     "of which decode state": fmt(r.segment_cache),
                     "math / LTM": f"{ratio['math']:.1f}x" if ratio["math"] else "-",
                     "fused / LTM": f"{ratio['fused']:.1f}x" if ratio["fused"] else "-"})
        if g and ratio["math"]:
            verdicts.append(Verdict(
                "G3-T4", f"at {guide_context(r.context)} context the LTM model needs {g['compression']:g}x less "
                "memory than standard attention", f"{g['compression']:g}x", f"{ratio['math']:.1f}x", r.hardware,
                judge((ratio["math"], ratio["math"]), (g["compression"], g["compression"]), True,
                      knobs().guide_ratio_tolerance),
                prose(__file__, "g3_t4.compression_reason")))
        elif g and r.math_status != "ok" and pd.notna(r.ltm):
            verdicts.append(Verdict(
                "G3-T4", f"at {guide_context(r.context)} context the LTM model needs {g['compression']:g}x less "
                "memory than standard attention", f"{g['compression']:g}x", f"standard: {r.math_status}",
                r.hardware, "not measurable here",
                f"the standard model with SDPA's math backend did not run at {r.context} tokens on this device "
                f"({r.math_status}: its scores alone are over the device's memory), so there is no ratio to read"))
    for target, frame in table.groupby("target", sort=False):
        last = frame.sort_values("context").iloc[-1]
        measurable = target not in cpus and last["context"] >= 32768
        ratio = last["fused"] / last["ltm"] if pd.notna(last["fused"]) and pd.notna(last["ltm"]) and last["ltm"] \
            else math.nan
        verdicts.append(Verdict(
            "G3-T4", f"the LTM model's memory at 32K context at most 1/{goal:g} of the standard model's",
            f">= {goal:g}x", f"{ratio:.1f}x at {int(last['context'])} tokens" if not math.isnan(ratio) else
            "not measured", last["hardware"],
            judge((ratio, ratio), (goal, None), True) if measurable else "not measurable here",
            prose(__file__, "g3_t4.goal_reason", not_measurable="" if measurable else
                  f"; the goal is a GPU's at 32K tokens, this run's longest is {int(last['context'])}")))
    md = prose(__file__, "g3_t4.memory", rows_table=md_table(pd.DataFrame(rows)))
    return md, verdicts


def _quality(df: pd.DataFrame) -> str:
    """The three presets trained alike: their last training loss and speed, validation loss by context, recall
    by distance."""
    q = df[df["metric"].isin(["train_loss", "tokens_per_s", "val_loss", "val_loss_int8", "recall_accuracy"])
           & (df["status"] == "ok")]
    if q.empty:
        return "\nno quality results\n"
    parts = []
    for target, frame in q.groupby("target", sort=False):
        rows = []
        for role, one in frame.groupby("role", sort=False):
            train = one[one["metric"] == "train_loss"].sort_values("step")
            row = {"target": target, "role": role, "model": one["model"].iloc[0],
                   "steps": f"{train['step'].iloc[-1]:g}" if len(train) else "-",
                   "last train loss": fmt(train["value"].iloc[-1]) if len(train) else "-",
                   "tokens/s": fmt(one.loc[one["metric"] == "tokens_per_s", "value"].max())}
            val = one[(one["metric"] == "val_loss") & one["context"].notna()]
            int8 = one[one["metric"] == "val_loss_int8"].set_index("context")["value"]
            for r in val.sort_values("context").itertuples():
                row[f"val loss @{int(r.context)}"] = fmt(r.value) + (
                    f" (INT8 {int8[r.context] - r.value:+.4f})" if r.context in int8 else "")
            for r in one[one["metric"] == "recall_accuracy"].sort_values("distance").itertuples():
                row[f"recall @{int(r.distance)}"] = f"{r.value:.2f}"
            rows.append(row)
        parts.append(md_table(pd.DataFrame(rows)))
    return prose(__file__, "g3_t4.quality", presets="\n\n".join(parts))


def quality_goal() -> QualityGoal:
    """G3-T4's quality goals as filed in params.yaml (``G3-T4.quality``; its defaults outside a render)."""
    return filed("g3_t4", "quality", QualityGoal())


def quality_verdicts(df: pd.DataFrame) -> list[Verdict]:
    """The goals filed in ``G3-T4.quality``, per target: the standard model learned the task (its recall at the
    shortest distance); then the window and LTM models against it, recall at each distance and validation loss
    at each context. One trained model a role, one reading each (recall over its trials): points, no intervals.
    Where the standard model did not learn the task, or does not read the passkey at a distance (beyond its
    training windows), the comparisons there are `not measured yet`: a memory is judged on a task the model it is
    compared with can do."""
    goal, out = quality_goal(), []
    cpus = cpu_targets(df)
    q = df[(df["status"] == "ok") & df["metric"].isin(["recall_accuracy", "val_loss"])]
    for target, frame in q.groupby("target", sort=False):
        hw = frame["hardware"].iloc[0]
        recall = frame[frame["metric"] == "recall_accuracy"].set_index(["role", "distance"])["value"]
        # the trained model's loss by context (the training curve's val_loss rows have no context)
        loss = frame[(frame["metric"] == "val_loss") & frame["context"].notna()].set_index(["role", "context"])["value"]
        if "standard" not in recall.index.get_level_values(0):
            continue
        first = min(recall["standard"].index)
        base = float(recall["standard"][first])
        learned = judge((base, base), (goal.recall_floor, None), higher_is_better=True)
        out.append(Verdict("G3-T4", f"the standard model reads a passkey back at distance {int(first)} (recall at "
                           f"least {goal.recall_floor:g}; the task learned)", f">= {goal.recall_floor:g}",
                           f"{base:.2f}", hw, learned,
                           "one trained model, recall over its trials; without it the comparisons below are not "
                           "readable" + ("; a CPU's toy training" if target in cpus else "")))
        for role in ("window", "ltm"):
            for (r, distance), value in recall.items():
                if r != role or ("standard", distance) not in recall.index:
                    continue
                there = float(recall["standard", distance])
                gap = there - float(value)
                # a gap is read only where the standard model reads the passkey back, at this distance too
                why = (f"the standard model did not learn the task (recall {base:.2f} at distance {int(first)})"
                       if learned != "holds" else
                       f"the standard model reads {there:.2f} at this distance, under the floor of "
                       f"{goal.recall_floor:g}: a gap to a model that cannot read it says nothing"
                       if there < goal.recall_floor else None)
                out.append(Verdict(
                    "G3-T4", f"{role} recall at distance {int(distance)} at most {goal.recall_gap:g} below the "
                    f"standard model's", f"<= {goal.recall_gap:g} below", f"{float(value):.2f} vs "
                    f"{there:.2f} ({gap:+.2f})", hw,
                    judge((gap, gap), (None, goal.recall_gap), higher_is_better=False) if why is None
                    else "not measured yet",
                    why or "the standard model's minus this model's recall, the same trials"))
            for (r, context), value in loss.items():
                if r != role or ("standard", context) not in loss.index:
                    continue
                gap = float(value) - float(loss["standard", context])
                out.append(Verdict(
                    "G3-T4", f"{role} validation loss at {int(context)} bytes at most {goal.loss_gap:g} nats above "
                    "the standard model's", f"<= +{goal.loss_gap:g} nats", f"{float(value):.3f} vs "
                    f"{float(loss['standard', context]):.3f} ({gap:+.3f})", hw,
                    judge((gap, gap), (None, goal.loss_gap), higher_is_better=False),
                    "this model's mean next-byte loss minus the standard model's, the same held-out windows"))
    return out


def _figures(df: pd.DataFrame, out_dir: Path) -> str:
    parts = []
    table = memory_table(df)
    if not table.empty:
        long = table.melt(id_vars=["target", "context"], value_vars=["math", "fused", "ltm"], var_name="model",
                          value_name="MiB").dropna()
        if not long.empty:
            grid = sns.relplot(data=long, x="context", y="MiB", hue="model", col="target", kind="line", marker="o",
                               height=3.2, facet_kws={"sharey": False})
            grid.set(xscale="log", yscale="log")
            grid.figure.suptitle("G3-T4 memory at each context: standard (math, fused) and LTM", y=1.04)
            parts.append(figure_link(grid.figure, out_dir, "g3_t4_memory.png", "memory by context"))
    recall = df[(df["metric"] == "recall_accuracy") & (df["status"] == "ok")]
    if not recall.empty:
        grid = sns.relplot(data=recall, x="distance", y="value", hue="role", col="target", kind="line", marker="o",
                           height=3.2)
        grid.set(xscale="log", ylim=(0, 1))
        grid.set_axis_labels("distance (bytes)", "digits recalled")
        grid.figure.suptitle("G3-T4 passkey recall by distance", y=1.04)
        parts.append(figure_link(grid.figure, out_dir, "g3_t4_recall.png", "recall by distance"))
    return "\n" + "\n".join(parts)
