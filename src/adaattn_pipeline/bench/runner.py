"""Run one study on one hardware target and write its results file.

The target is checked against the machine before anything is measured: a stage never writes a
result for hardware it is not running on.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from adaattn.timing.timers import make_timer
from adaattn_pipeline.bench.compile_cache import compile_in_process, warm_calls, warm_compile_cache
from adaattn_pipeline.bench.harness import Harness
from adaattn_pipeline.bench.provenance import cpu_model, provenance
from adaattn_pipeline.bench.results import results_path, write_results
from adaattn_pipeline.bench.roofline import measure_ceilings
from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.codegraph import study_code_hash
from adaattn_pipeline.config import ConfigError, Params, Target, param_values, params_hash


def resolve_target(params: Params, name: str) -> Target:
    if name not in params.targets:
        raise ConfigError(f"--target {name!r} is not a target in params.yaml; allowed: {', '.join(params.targets)}")
    return params.targets[name]


def check_study_target(study: str, params: Params, name: str) -> None:
    """A study with ``study_targets`` runs on those targets only (its DVC stages are ``<study>@<target>``)."""
    own = params.study_targets.get(study)
    if own is not None and name not in own:
        raise ConfigError(f"study {study!r} has no target {name!r} (no stage {study}@{name}); its targets: "
                          f"{', '.join(own)} (params.yaml study_targets.{study})")


def check_hardware(name: str, target: Target, stage: str = "<study>") -> None:
    """Refuse to measure a target on hardware that is not it."""
    if target.device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            f"target {name!r} needs a CUDA GPU whose name contains {target.gpu_name!r}, but this machine has "
            f"no CUDA device (CPU: {cpu_model()}). Its committed results are left as they are; measure it on "
            f"that GPU with `dvc repro -f {stage}@{name}` there."
        )
    gpu = torch.cuda.get_device_name(0)
    if target.gpu_name.lower() not in gpu.lower():
        raise ConfigError(
            f"target {name!r} is for a GPU whose name contains {target.gpu_name!r}; this machine has {gpu!r}. "
            f"Add a target for it in params.yaml (docs/gpu-box.md, 'Targets') instead of relabelling."
        )
    if torch.cuda.device_count() < target.gpus:
        raise ConfigError(
            f"target {name!r} needs {target.gpus} GPUs (targets.{name}.gpus); this machine has "
            f"{torch.cuda.device_count()}. Measure it on a machine that has them."
        )


def run_study(study: StudyDef, params: Params, raw: dict, target_name: str, results_root: Path,
              console: Console | None = None) -> Path:
    console = console or Console(stderr=True)
    target = resolve_target(params, target_name)
    check_study_target(study.name, params, target_name)
    check_hardware(target_name, target, study.name)
    missing = [sid for sid in study.sections if raw.get(sid) is None]
    if missing:
        raise ConfigError(f"study {study.name!r} reads params.yaml section(s) {', '.join(missing)}, which the file "
                          f"does not have (their schema: experiments/{study.name}/schema.py)")
    study = study.bind(target.device)
    cases = study.cases(params, target)
    phash = params_hash(param_values(raw, study.param_keys(raw, target_name)))
    chash = study_code_hash(study.name, study.data_deps)
    path = results_path(results_root, study.name, target_name)

    workers = getattr(params.bench, target.profile).compile_workers
    groups = study.compile_groups(cases)
    if workers and groups:
        # meanwhile, this process makes the first calls whose cost is on the host (a fresh instance:
        # the study sent to the workers stays as it is)
        host_items = study.host_warm_items(cases)
        console.print(f"compiling {len(groups)} torch.compile segments in {min(workers, len(groups))} worker "
                      f"processes; meanwhile {len(host_items)} host-heavy first calls here")
        warm = warm_compile_cache(study, groups, target.device, workers,
                                  meanwhile=lambda: warm_calls(study.bind(target.device), host_items, target.device))
        compile_in_process()
        console.print(f"  done in {warm.seconds:.0f} s (first calls here: {warm.meanwhile_seconds:.0f} s)"
                      + (f"; {len(warm.failures)} calls failed there (measured again below): {warm.failures[0]}"
                         if warm.failures else ""))

    torch.manual_seed(0)
    timer = make_timer(target.device, params.bench)
    console.print(f"[bold]{study.name}[/] on target [bold]{target_name}[/]: measuring machine ceilings")
    harness = Harness(target.device, timer, measure_ceilings(target.device, timer),
                      **study.harness_options(params, target))
    console.print(f"  copy {harness.ceilings.copy_gbps:.0f} GB/s, {harness.ceilings.gemm_dtype} GEMM "
                  f"{harness.ceilings.gemm_tflops:.1f} TFLOP/s")
    total = sum(len(c.providers) for c in cases)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False, disable=not cases) as bar:
        task = bar.add_task(study.name, total=total)

        def progress(label: str) -> None:
            if bar.tasks[task].description != study.name:
                bar.advance(task)
            bar.update(task, description=f"{label:<60.60}")

        harness.run(study, cases, progress, log=console.print)
        bar.advance(task)
    if workers and groups:
        harness.phase_seconds["parallel compile (workers)"] = warm.seconds
    extra = study.extra_rows(params, target)
    prov = provenance(target.device, target_name, phash, chash)
    rows = [{"study": study.name, **r, **prov} for r in harness.ceiling_rows() + harness.rows + extra]
    write_results(path, rows, study.config_columns)
    if harness.phase_summary():
        console.print(f"time by phase: {harness.phase_summary()}")
    ok = sum(1 for r in harness.rows if r["status"] == "ok" and r["metric"] == "time_ms")
    console.print(f"wrote {path} ({ok} timed cases, {len(rows)} rows)")
    return path
