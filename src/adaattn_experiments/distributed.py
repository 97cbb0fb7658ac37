"""The distributed training study (G3-T2, issue 49's scaling goal): each preset trained in each layout at each
world size, every run a torchrun job of its own (``adaattn.distributed.train``: one process a GPU, NCCL; CPU
processes over gloo), then the all-reduce bus bandwidth at the largest world size (``adaattn.distributed.
allreduce``) in the same run: the ceiling for the gradients' traffic.

Weak scaling: the batch per rank is fixed, so a layout of N ranks trains on N times the tokens a step. Per job:
the whole job's tokens/s (every rank's tokens over the slowest rank's seconds), per rank, the fullest rank's peak
memory, the step time and the last step's loss. The jobs run one after another: tokens/s compare across jobs of
one run, on one machine. A world size the machine cannot hold is a row that says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml

from adaattn.bench.runner import StudyDef, target_sections
from adaattn.config import DistributedRun, Params, Target
from adaattn.distributed.parallel import multicast_off
from adaattn.report.common import Section

SINGLE = "single"  # the one-rank baseline of every layout


def layout_sets(layout: str, world_size: int) -> list[str]:
    """params.yaml ``parallel`` overrides for a layout at a world size."""
    dp, fsdp = (world_size, 1) if layout == "ddp" else (1, world_size) if layout == "fsdp" else (1, 1)
    return [f"parallel.world_size={world_size}", f"parallel.dp={dp}", f"parallel.fsdp={fsdp}", "parallel.tp=1"]


def torchrun(world_size: int, module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "-m", module, *args]


class Distributed(StudyDef):
    name = "distributed"
    table_ids = ("G3-T2",)
    config_columns = ["model", "world_size", "batch", "seq_len"]

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> Distributed:
        return Distributed(device)

    def param_sections(self, raw: dict, target: Target, target_name: str) -> dict[str, Any]:
        sections = target_sections(raw, target_name, ("G3-T2",))
        return {**sections, "parallel": raw.get("parallel", {}),
                **{f"models.{m}": raw["models"][m] for m in sections["G3-T2"]["models"]}}

    def cases(self, params: Params, target: Target) -> list:
        return []  # whole torchrun jobs: extra_rows runs them

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        run: DistributedRun = getattr(params.g3_t2, target.profile)
        held = torch.cuda.device_count() if self.device == "cuda" else None
        if self.device == "cuda":
            torch.cuda.empty_cache()  # the ceilings' blocks: the jobs share GPU 0 with this process's context
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            # the children read the same params this run did (overrides included)
            params_file = Path(tmp) / "params.yaml"
            params_file.write_text(yaml.safe_dump(params.model_dump(by_alias=True, mode="json", exclude_none=True),
                                                  sort_keys=False))
            for rnd in range(run.repeats):  # rounds: a slow spell of the machine falls on every layout alike
                trace = run.trace_steps if rnd == run.repeats - 1 else 0
                for model in run.models:
                    for ws in run.world_sizes:
                        for layout in [SINGLE] if ws == 1 else run.layouts:
                            base = {"table_id": "G3-T2", "kernel": "", "model": model, "world_size": ws,
                                    "batch": run.batch_per_rank * ws, "seq_len": run.seq_len, "mode": "train",
                                    "case_id": f"distributed/{model}/x{ws}/r{rnd}", "provider": layout}
                            if held is not None and ws > held:
                                if rnd == 0:
                                    rows.append({**base, "metric": "tokens_per_s", "value": None, "unit": "tokens/s",
                                                 "status": "unavailable", "reason": f"world size {ws} needs {ws} "
                                                 f"GPUs; this machine has {held}"})
                                continue
                            self.note(f"round {rnd + 1}/{run.repeats}: {model} {layout} x{ws}, a torchrun job")
                            rows += [{**base, **r} for r in run_job(model, layout, ws, run, params_file, Path(tmp),
                                                                    trace)]
            largest = max(w for w in run.world_sizes if held is None or w <= held)
            if largest > 1:
                self.note(f"all-reduce bus bandwidth x{largest}")
                rows += allreduce_rows(largest, run, Path(tmp))
        return rows

    def render(self, df: pd.DataFrame, out_dir: Path) -> list[Section]:
        from adaattn_experiments.distributed_report import render

        return render(df, out_dir)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    multicast_off(env)  # also set inside each process; here so that no launch forgets them
    return env


def _failed(done: subprocess.CompletedProcess | None, timeout_s: float, what: str) -> str:
    if done is None:
        return f"{what} outlasted G3-T2.timeout_s={timeout_s:g}"
    # a rank's own error line, not torchrun's summary of it (which names no cause)
    errors = [line for line in done.stderr.splitlines() if "Error" in line and "ChildFailedError" not in line
              or line.startswith("error:")]
    return f"{what} exited {done.returncode}: {(errors[-1] if errors else ' '.join(done.stderr.split()))[-300:]}"


def run_job(model: str, layout: str, ws: int, run: DistributedRun, params_file: Path, tmp: Path,
            trace_steps: int = 0) -> list[dict]:
    out = tmp / f"{model}-{layout}-{ws}.json"
    out.unlink(missing_ok=True)  # a failed job must not leave the round before's file to be read
    args = ["--model", model, "--batch", str(run.batch_per_rank * ws), "--seq-len", str(run.seq_len),
            "--steps", str(run.steps), "--warmup", str(run.warmup), "--dtype", run.dtype,
            "--params", str(params_file), "--out", str(out), "--trace-steps", str(trace_steps)]
    for s in layout_sets(layout, ws):
        args += ["--set", s]
    try:
        done = subprocess.run(torchrun(ws, "adaattn.distributed.train", args), env=_env(), capture_output=True,
                              text=True, timeout=run.timeout_s)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0 or not out.is_file():
        return [{"metric": "tokens_per_s", "value": None, "unit": "tokens/s", "status": "error",
                 "reason": _failed(done, run.timeout_s, "the torchrun job")}]
    job = json.loads(out.read_text())
    seconds = max(r["seconds"] for r in job["ranks"])
    ok = {"status": "ok", "reason": ""}
    return [{**ok, "metric": "tokens_per_s", "value": job["tokens_per_s"], "unit": "tokens/s",
             "reason": "every rank's tokens over the slowest rank's seconds"},
            {**ok, "metric": "tokens_per_s_per_rank", "value": job["tokens_per_s_per_rank"], "unit": "tokens/s"},
            {**ok, "metric": "step_ms", "value": seconds / job["steps"] * 1e3, "unit": "ms",
             "samples": job["steps"], "reason": "the slowest rank's seconds over the timed steps"},
            {"metric": "rank_peak_mem_mb", "value": job["peak_mib_max"], "unit": "MiB",
             **({"status": "unavailable", "reason": "CPU processes: no CUDA allocator statistics"}
                if job["device"] != "cuda" else {**ok, "reason": "the fullest rank's peak allocated memory"})},
            {**ok, "metric": "loss_last", "value": job["losses"][-1], "unit": "nats"},
            *trace_rows(job.get("trace"))]


def trace_rows(trace: list[dict] | None) -> list[dict]:
    """The traced steps' communication, the rank that waited on it most: NCCL kernel time a step, the part no
    other kernel ran beside (exposed), and that over the step's GPU span."""
    if not trace:
        return []
    worst = max(trace, key=lambda r: r["exposed_ms"] / r["span_ms"] if r["span_ms"] else 0.0)
    steps = worst["steps"]
    why = f"{steps} traced steps, the rank of the largest exposed share"
    return [{"status": "ok", "metric": "comm_ms", "value": worst["comm_ms"] / steps, "unit": "ms", "reason": why},
            {"status": "ok", "metric": "exposed_comm_ms", "value": worst["exposed_ms"] / steps, "unit": "ms",
             "reason": why},
            {"status": "ok", "metric": "exposed_comm_share", "value": worst["exposed_ms"] / worst["span_ms"]
             if worst["span_ms"] else None, "unit": "fraction", "reason": why}]


def allreduce_rows(ws: int, run: DistributedRun, tmp: Path) -> list[dict]:
    out = tmp / "allreduce.json"
    args = [a for mib in run.allreduce_mib for a in ("--mib", f"{mib:g}")] + ["--out", str(out)]
    base = {"table_id": "G3-T2", "kernel": "", "world_size": ws, "mode": "all_reduce", "provider": "all_reduce"}
    try:
        done = subprocess.run(torchrun(ws, "adaattn.distributed.allreduce", args), env=_env(),
                              capture_output=True, text=True, timeout=run.timeout_s)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0 or not out.is_file():
        return [{**base, "case_id": f"all_reduce/x{ws}", "metric": "busbw_gbps", "value": None, "unit": "GB/s",
                 "status": "error", "reason": _failed(done, run.timeout_s, "the all-reduce job")}]
    job = json.loads(out.read_text())
    rows = []
    for s in job["sizes"]:
        case = {**base, "case_id": f"all_reduce/x{ws}/{s['mib']:g}MiB", "status": "ok",
                "reason": f"{job['backend']}, {s['dtype']}, {s['mib']:g} MiB"}
        rows += [{**case, "metric": "busbw_gbps", "value": s["busbw_gbps"], "unit": "GB/s"},
                 {**case, "metric": "allreduce_us", "value": s["us"], "unit": "us"}]
    return rows


STUDY = Distributed()
