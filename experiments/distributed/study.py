"""The distributed study (G3-T2, issue 49's goals): each preset trained in each layout (DDP, FSDP2, tensor
parallelism) at each world size, every run a torchrun job of its own (``adaattn.distributed.train``: one process a
GPU, NCCL; CPU processes over gloo); then G3-T3's +TensorParallel row, a dense preset decoded on one GPU and
tensor-parallel (``adaattn.distributed.decode``); then the all-reduce bus bandwidth at the largest world size
(``adaattn.distributed.allreduce``) in the same run: the ceiling for the gradients' traffic.

Weak scaling: the batch per rank is fixed, so a layout of N ranks trains on N times the tokens a step. Per job:
the whole job's tokens/s (every rank's tokens over the slowest rank's seconds), per rank, the fullest rank's peak
memory, the step time and the last step's loss. The jobs run one after another: tokens/s compare across jobs of
one run, on one machine. A world size the machine cannot hold is a row that says so. At world size 1 the
baselines: the plain job (fp32 weights under bf16 autocast: DDP's and TP's regime) and, where an FSDP2 layout is
measured, FSDP2 on one rank (its bf16 compute parameters over fp32 shards), each in the compile mode of the layouts
it serves: each layout is read against the one of its precision regime (``BASELINE``) and its compile mode.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from adaattn.distributed import allreduce as allreduce_job
from adaattn.distributed import decode as decode_job
from adaattn.distributed import train as train_job
from adaattn.distributed.layout import Layout
from adaattn.distributed.parallel import check_layout, multicast_off
from adaattn_experiments.distributed.schema import DistributedRun
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.config import ConfigError, Params, Target

# The torchrun jobs run these modules in processes of their own: named from the imports, so that the import graph
# (this stage's deps, its results' code hash) reaches what the jobs run
TRAIN, DECODE, ALLREDUCE = train_job.__name__, decode_job.__name__, allreduce_job.__name__

SINGLE = "single"  # the one-rank baseline of DDP and TP: fp32 weights under bf16 autocast, as they keep them
SHARDED_ONE = "fsdp"  # at world size 1, FSDP2 on one rank: the baseline of FSDP2's layouts, in their precision
# the one-rank job each layout's scaling is read against: the same precision regime (FSDP2 computes in its
# MixedPrecisionPolicy's bf16 parameters over fp32 shards; DDP and TP keep fp32 weights under autocast)
BASELINE = {"ddp": SINGLE, "tp": SINGLE, "fsdp": SHARDED_ONE, "fsdp_tp": SHARDED_ONE}


def one_rank_jobs(run: DistributedRun, layouts: list[str] | None = None) -> list[tuple[str, str | None]]:
    """The jobs at world size 1, each with its compile mode: the baseline of each of ``layouts`` (those a preset can
    run; default: the run's) in that layout's mode (the plain one always: in ``compile_mode`` where no layout reads
    it), the plain ones first."""
    jobs = [(BASELINE[layout], run.mode_of(layout)) for layout in (run.layouts if layouts is None else layouts)]
    if all(job != SINGLE for job, _ in jobs):
        jobs.insert(0, (SINGLE, run.compile_mode))
    return sorted(dict.fromkeys(jobs), key=lambda job: job[0] != SINGLE)  # stable: the layouts' order otherwise


def mode_name(mode: str | None) -> str:
    """A compile mode as the rows spell it (None: eager)."""
    return mode or "eager"


def layout_of(layout: str, world_size: int) -> Layout:
    """The ``parallel`` section of a layout at a world size (``single``: one rank; ``fsdp`` at one rank: one rank,
    run with ``--shard-one``; ``fsdp_tp``: FSDP2 shards of tensor-parallel pairs, the pairs inside a node's fastest
    links)."""
    if world_size == 1 or layout == SINGLE:
        return Layout()
    if layout == "fsdp_tp":
        if world_size < 4 or world_size % 2:
            raise ConfigError(f"fsdp_tp shards tensor-parallel pairs: an even world size of at least 4; got "
                              f"{world_size} (at 2 it is tp alone)")
        return Layout(world_size=world_size, fsdp=world_size // 2, tp=2)
    return Layout(world_size=world_size, **{{"ddp": "dp", "fsdp": "fsdp", "tp": "tp"}[layout]: world_size})


def layout_sets(layout: str, world_size: int) -> list[str]:
    """params.yaml ``parallel`` overrides for a layout at a world size."""
    chosen = layout_of(layout, world_size)
    return [f"parallel.{k}={getattr(chosen, k)}" for k in ("world_size", "dp", "fsdp", "tp")]


def shards_one(layout: str, world_size: int) -> bool:
    """Whether the job is FSDP2 on one rank (``--shard-one``)."""
    return world_size == 1 and layout == SHARDED_ONE


def job_sets(layout: str, world_size: int, run: DistributedRun) -> list[str]:
    """A study job's overrides: the layout's, and the profile's resharding where FSDP2 shards."""
    sets = layout_sets(layout, world_size)
    if layout_of(layout, world_size).fsdp > 1 or shards_one(layout, world_size):
        sets.append(f"parallel.reshard_after_forward={run.reshard_after_forward}")
    return sets


def unrunnable(params: Params, model: str, layout: str, world_size: int) -> str | None:
    """Why this preset cannot run in this layout (``check_layout``'s words), before any job starts; None if it can."""
    try:
        check_layout(layout_of(layout, world_size), params.models[model], model, world_size=world_size)
    except ConfigError as err:
        return str(err)
    return None


def run_profile(target: Target, section: dict) -> str:
    """The G3-T2 profile a target runs: ``gpu4`` on a GPU target of 4 GPUs or more where the section has one (the
    4-GPU rows), else the target's own."""
    return "gpu4" if target.device == "cuda" and target.gpus >= 4 and section.get("gpu4") else target.profile


def torchrun(world_size: int, module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "-m", module, *args]


class Distributed(StudyDef):
    name = "distributed"
    table_ids = ("G3-T2", "G3-T3")
    config_columns = ["model", "world_size", "batch", "seq_len", "compile_mode"]
    sections = ("G3-T2",)
    extra_params = ("parallel",)

    def profile(self, raw: dict, target_name: str, section: str) -> str:
        return run_profile(Target(**raw["targets"][target_name]), raw[section])

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        run = raw[section][profile]
        return [*run["models"], *([run["decode"]["model"]] if run.get("decode") else [])]

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> Distributed:
        return Distributed(device)

    def cases(self, params: Params, target: Target) -> list:
        return []  # whole torchrun jobs: extra_rows runs them

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        run: DistributedRun = getattr(params.g3_t2, run_profile(target, params.g3_t2.model_dump()))
        held = torch.cuda.device_count() if self.device == "cuda" else None
        if self.device == "cuda":
            torch.cuda.empty_cache()  # the ceilings' blocks: the jobs share GPU 0 with this process's context
        rows, took = [], {}
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            # the children read the same params this run did (overrides included)
            params_file = Path(tmp) / "params.yaml"
            params_file.write_text(yaml.safe_dump(params.model_dump(by_alias=True, mode="json", exclude_none=True),
                                                  sort_keys=False))
            # round 0 with its traces, then the decode jobs and the all-reduce, then the rounds the budget allows
            rows += self._round(params, run, held, 0, params_file, Path(tmp), took, start)
            if run.decode is not None:
                rows += self._decode_rows(params, run, held, params_file, Path(tmp), start)
            largest = max(w for w in run.world_sizes if held is None or w <= held)
            if largest > 1 and (why := _past_budget(run, start, 0.0, "the all-reduce job", "")):
                rows.append({"table_id": "G3-T2", "kernel": "", "world_size": largest, "mode": "all_reduce",
                             "provider": "all_reduce", "case_id": f"all_reduce/x{largest}", "metric": "busbw_gbps",
                             "value": None, "unit": "GB/s", "status": "unavailable", "reason": why})
            elif largest > 1:
                self.note(f"all-reduce bus bandwidth x{largest}")
                rows += allreduce_rows(largest, run, Path(tmp))
            for rnd in range(1, run.repeats):  # rounds: a slow spell of the machine falls on every layout alike
                rows += self._round(params, run, held, rnd, params_file, Path(tmp), took, start)
        return rows

    def _round(self, params: Params, run: DistributedRun, held: int | None, rnd: int, params_file: Path, tmp: Path,
               took: dict[tuple, float], start: float) -> list[dict]:
        """One round of every training job; ``took``: each job's seconds in round 0 (filled by it), which a later
        round's job must still fit in ``run.budget_s`` from ``start`` (a first-round job: its model's longest)."""
        rows = []
        for model in run.models:
            # a baseline only for the layouts this preset runs (HYDRA's has no tensor-parallel one to serve)
            served = [layout for layout in run.layouts
                      if any(unrunnable(params, model, layout, w) is None for w in run.world_sizes if w > 1)]
            for ws in run.world_sizes:
                jobs = one_rank_jobs(run, served) if ws == 1 else [(lay, run.mode_of(lay)) for lay in run.layouts]
                for layout, mode in jobs:
                    base = {"table_id": "G3-T2", "kernel": "", "model": model, "world_size": ws,
                            "batch": run.batch_per_rank * ws, "seq_len": run.seq_len, "mode": "train",
                            "compile_mode": mode_name(mode),
                            "case_id": f"distributed/{model}/x{ws}/{mode_name(mode)}/r{rnd}", "provider": layout}
                    why = (f"world size {ws} needs {ws} GPUs; this machine has {held}"
                           if held is not None and ws > held else unrunnable(params, model, layout, ws))
                    if why is not None:
                        if rnd == 0:
                            rows.append({**base, "metric": "tokens_per_s", "value": None, "unit": "tokens/s",
                                         "status": "unavailable", "reason": why})
                        continue
                    key = (model, layout, ws, mode)
                    # a later round's job guessed at its own first-round time; a first-round job at its model's
                    # longest so far (compiled jobs take minutes: the run must end inside the device call with
                    # its file written, not be killed with everything it measured)
                    guess = took.get(key, 0.0) if rnd else max((t for k, t in took.items() if k[0] == model),
                                                               default=0.0)
                    over = _past_budget(run, start, guess, f"round {rnd + 1}",
                                        "round 1's" if rnd else f"{model}'s longest job so far")
                    if over is not None:
                        rows.append({**base, "metric": "tokens_per_s", "value": None, "unit": "tokens/s",
                                     "status": "unavailable", "reason": over})
                        continue
                    self.note(f"round {rnd + 1}/{run.repeats}: {model} {layout} x{ws} ({mode_name(mode)}), a "
                              "torchrun job")
                    t0 = time.monotonic()
                    # the trace in the first round: after its timed steps, so it costs them nothing
                    rows += [{**base, **r} for r in run_job(model, layout, ws, run, params_file, tmp,
                                                            run.trace_steps if rnd == 0 else 0, mode=mode)]
                    took.setdefault(key, time.monotonic() - t0)
        return rows

    def _decode_rows(self, params: Params, run: DistributedRun, held: int | None, params_file: Path,
                     tmp: Path, start: float) -> list[dict]:
        dec = run.decode
        rows, took = [], [0.0]  # each decode job is guessed at the longest one so far
        for B in dec.batches:
            for ws in run.world_sizes:
                for allreduce in ["nccl"] if ws == 1 else dec.allreduce:
                    t0 = time.monotonic()
                    rows += self._decode_job_rows(params, run, held, B, ws, allreduce, params_file, tmp,
                                                  _past_budget(run, start, max(took), "the decode job",
                                                               "the longest decode job so far"))
                    took.append(time.monotonic() - t0)
        return rows

    def _decode_job_rows(self, params: Params, run: DistributedRun, held: int | None, B: int, ws: int,
                         allreduce: str, params_file: Path, tmp: Path, over: str | None = None) -> list[dict]:
        dec = run.decode
        layout = SINGLE if ws == 1 else "tp"
        provider = layout if allreduce == "nccl" else f"{layout}_{allreduce}"
        base = {"table_id": "G3-T3", "kernel": "", "model": dec.model, "world_size": ws, "batch": B,
                "seq_len": dec.prompt_len, "mode": "decode", "provider": provider,
                "case_id": f"decode/{dec.model}/b{B}/x{ws}/{allreduce}"}
        why = (f"world size {ws} needs {ws} GPUs; this machine has {held}" if held is not None and ws > held
               else "the one-shot all-reduce is symmetric memory's, on CUDA GPUs, in a compiled step"
               if allreduce != "nccl" and (self.device != "cuda" or not dec.compile)
               else unrunnable(params, dec.model, layout, ws) or over)
        if why is not None:
            return [{**base, "metric": "decode_ms_per_token", "value": None, "unit": "ms", "status": "unavailable",
                     "reason": why}]
        self.note(f"decode: {dec.model} batch {B} {provider} x{ws}, a torchrun job")
        return [{**base, **r} for r in decode_job(B, ws, allreduce, run, params_file, tmp)]


def _past_budget(run: DistributedRun, start: float, guess: float, what: str, whose: str) -> str | None:
    """Why ``what``, guessed at ``guess`` seconds (``whose`` time), would end past G3-T2.budget_s from ``start``;
    None: it fits."""
    elapsed = time.monotonic() - start
    if run.budget_s is None or elapsed + guess <= run.budget_s:
        return None
    its = f"its {guess:.0f} s ({whose}) " if guess else ""
    return f"{what} not run: {its}past G3-T2 budget_s={run.budget_s:g} at {elapsed:.0f} s"


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


def launch(module: str, args: list[str], ws: int, run: DistributedRun, out: Path, layout: str | None = None,
           what: str = "the torchrun job") -> dict | str:
    """A torchrun job of ``module`` at a world size (in ``layout``, given as ``--set`` overrides): the JSON it wrote
    to ``out``, or why there is none."""
    out.unlink(missing_ok=True)  # a failed job must not leave the round before's file to be read
    sets = job_sets(layout, ws, run) if layout is not None else []
    args = [*args, "--out", str(out), *[a for s in sets for a in ("--set", s)]]
    try:
        done = subprocess.run(torchrun(ws, module, args), env=_env(), capture_output=True, text=True,
                              timeout=run.timeout_s)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0 or not out.is_file():
        return _failed(done, run.timeout_s, what)
    return json.loads(out.read_text())


def run_job(model: str, layout: str, ws: int, run: DistributedRun, params_file: Path, tmp: Path,
            trace_steps: int = 0, mode: str | None = None) -> list[dict]:
    """A training job's rows, its blocks compiled in ``mode`` (None: eager)."""
    args = ["--model", model, "--batch", str(run.batch_per_rank * ws), "--micro-batches", str(run.micro_batches),
            "--seq-len", str(run.seq_len),
            "--steps", str(run.steps), "--warmup", str(run.warmup), "--dtype", run.dtype,
            "--params", str(params_file), "--trace-steps", str(trace_steps),
            *(["--shard-one"] if shards_one(layout, ws) else []),
            *(["--compile-mode", mode] if mode else [])]
    job = launch(TRAIN, args, ws, run, tmp / f"{model}-{layout}-{ws}-{mode_name(mode)}.json", layout)
    if isinstance(job, str):
        return [{"metric": "tokens_per_s", "value": None, "unit": "tokens/s", "status": "error", "reason": job}]
    seconds = max(r["seconds"] for r in job["ranks"])
    ok = {"status": "ok", "reason": ""}
    parts = (f"; each rank's batch in {run.micro_batches} micro-batches a step" if run.micro_batches > 1 else "") + \
        (f"; blocks compiled ({mode})" if mode else "; eager")
    return [{**ok, "metric": "tokens_per_s", "value": job["tokens_per_s"], "unit": "tokens/s",
             "reason": "every rank's tokens over the slowest rank's seconds" + parts},
            {**ok, "metric": "tokens_per_s_per_rank", "value": job["tokens_per_s_per_rank"], "unit": "tokens/s"},
            {**ok, "metric": "step_ms", "value": seconds / job["steps"] * 1e3, "unit": "ms",
             "samples": job["steps"], "reason": "the slowest rank's seconds over the timed steps"},
            {"metric": "rank_peak_mem_mb", "value": job["peak_mib_max"], "unit": "MiB",
             **({"status": "unavailable", "reason": "CPU processes: no CUDA allocator statistics"}
                if job["device"] != "cuda" else {**ok, "reason": "the fullest rank's peak allocated memory"})},
            {**ok, "metric": "loss_first", "value": job["losses"][0], "unit": "nats",
             "reason": "the first step's (warm-up included): beside the last, whether the job trained"},
            {**ok, "metric": "loss_last", "value": job["losses"][-1], "unit": "nats"},
            {**ok, "metric": "micro_batches", "value": run.micro_batches, "unit": "count",
             "reason": "each rank's batch a step in this many parts, the gradients reduced once"},
            *trace_rows(job.get("trace"))]


def decode_job(batch: int, ws: int, allreduce: str, run: DistributedRun, params_file: Path,
               tmp: Path) -> list[dict]:
    dec = run.decode
    args = ["--model", dec.model, "--batch", str(batch), "--prompt-len", str(dec.prompt_len), "--new-tokens",
            str(dec.new_tokens), "--rounds", str(dec.rounds), "--dtype", run.dtype, "--allreduce", allreduce,
            "--compile" if dec.compile else "--no-compile", "--params", str(params_file)]
    job = launch(DECODE, args, ws, run,
                 tmp / f"decode-{dec.model}-{batch}-{ws}-{allreduce}.json", SINGLE if ws == 1 else "tp")
    if isinstance(job, str):
        return [{"metric": "decode_ms_per_token", "value": None, "unit": "ms", "status": "error", "reason": job}]
    how = (f"{'compiled, CUDA graphs' if job['compiled'] else 'eager'}"
           f"{'' if ws == 1 else ', ' + job['shards'] + ' shards, ' + allreduce + ' all-reduce'}; the median of {len(job['decode_ms_per_token'])} "
           "rounds, each round's slowest rank")
    ok = {"status": "ok", "samples": len(job["decode_ms_per_token"])}
    return [{**ok, "metric": "decode_ms_per_token", "value": statistics.median(job["decode_ms_per_token"]),
             "unit": "ms", "reason": f"{job['new_tokens'] - 1} greedy steps a round; " + how},
            {**ok, "metric": "prefill_ms", "value": statistics.median(job["prefill_ms"]), "unit": "ms",
             "reason": f"a {job['prompt_len']}-token prompt, eager; " + how},
            {**ok, "metric": "tokens_per_s", "value": job["tokens_per_s"], "unit": "tokens/s",
             "reason": "batch over the median decode step"},
            {"metric": "rank_peak_mem_mb", "value": job["peak_mib_max"], "unit": "MiB",
             **({"status": "unavailable", "reason": "CPU processes: no CUDA allocator statistics"}
                if job["device"] != "cuda" else {**ok, "reason": "the fullest rank's peak allocated memory"})}]


def trace_rows(trace: list[dict] | None) -> list[dict]:
    """The traced steps' communication, the rank that waited on it most: NCCL kernel time a step, the part no
    other kernel ran beside (exposed), and that over the step's GPU span."""
    if not trace:
        return []
    worst = max(trace, key=lambda r: r["exposed_ms"] / r["span_ms"] if r["span_ms"] else 0.0)
    steps = worst["steps"]
    why = f"{steps} traced steps, the rank of the largest exposed share"
    rows = [{"status": "ok", "metric": "comm_ms", "value": worst["comm_ms"] / steps, "unit": "ms", "reason": why},
            {"status": "ok", "metric": "exposed_comm_ms", "value": worst["exposed_ms"] / steps, "unit": "ms",
             "reason": why},
            {"status": "ok", "metric": "exposed_comm_share", "value": worst["exposed_ms"] / worst["span_ms"]
             if worst["span_ms"] else None, "unit": "fraction", "reason": why}]
    if "skew_wire_ms" in worst:  # the ranks' collectives matched: transfer, waiting for a rank, start spread
        across = f"{steps} traced steps, {worst['skew_collectives']} collective kernels matched across the ranks"
        rows += [{"status": "ok", "metric": f"comm_{part}_ms", "value": worst[f"skew_{part}_ms"] / steps,
                  "unit": "ms", "reason": f"{across}: {what}"}
                 for part, what in (("wire", "each collective's shortest duration among the ranks (the last to "
                                     "join runs it for the transfer alone)"),
                                    ("wait", "the slowest rank's collective time beyond that: waiting for another "
                                     "rank"),
                                    ("skew", "the spread of each collective's start across the ranks"))]
    return rows


def allreduce_rows(ws: int, run: DistributedRun, tmp: Path) -> list[dict]:
    args = [a for mib in run.allreduce_mib for a in ("--mib", f"{mib:g}")]
    base = {"table_id": "G3-T2", "kernel": "", "world_size": ws, "mode": "all_reduce", "provider": "all_reduce"}
    job = launch(ALLREDUCE, args, ws, run, tmp / "allreduce.json", what="the all-reduce job")
    if isinstance(job, str):
        return [{**base, "case_id": f"all_reduce/x{ws}", "metric": "busbw_gbps", "value": None, "unit": "GB/s",
                 "status": "error", "reason": job}]
    rows = []
    for s in job["sizes"]:
        case = {**base, "case_id": f"all_reduce/x{ws}/{s['mib']:g}MiB", "status": "ok",
                "reason": f"{job['backend']}, {s['dtype']}, {s['mib']:g} MiB"}
        rows += [{**case, "metric": "busbw_gbps", "value": s["busbw_gbps"], "unit": "GB/s"},
                 {**case, "metric": "allreduce_us", "value": s["us"], "unit": "us"}]
    return rows


STUDY = Distributed()
