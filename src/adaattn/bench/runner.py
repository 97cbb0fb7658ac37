"""Run one study on one hardware target and write its results file.

The target is checked against the machine before anything is measured: a stage never writes a
result for hardware it is not running on.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from adaattn.bench.compile_cache import WarmItem, compile_in_process, warm_calls, warm_compile_cache
from adaattn.bench.harness import Case, Harness
from adaattn.bench.provenance import cpu_model, provenance
from adaattn.bench.results import results_path, write_results
from adaattn.bench.roofline import measure_ceilings
from adaattn.bench.timing import make_timer
from adaattn.config import ConfigError, Params, Target, params_hash

if TYPE_CHECKING:  # the report's imports (matplotlib, seaborn) stay out of a measuring run
    import pandas as pd

    from adaattn.report.common import Section


class StudyDef(Protocol):
    """What the runner and the report ask of a study. A study class subclasses this and gets the optional
    hooks' defaults (nothing to compile ahead, no extra rows, the harness's default options)."""

    name: str
    table_ids: tuple[str, ...]
    config_columns: list[str]

    def param_sections(self, raw: dict, target: Target, target_name: str) -> dict[str, Any]: ...

    def cases(self, params: Params, target: Target) -> list[Case]: ...

    def bind(self, device: str) -> StudyDef: ...

    def render(self, df: pd.DataFrame, out_dir: Path) -> list[Section]: ...

    def harness_options(self, params: Params, target: Target) -> dict[str, Any]:
        """Keyword arguments of ``Harness`` (host_calls, kernel_calls, utilization_s, ...)."""
        return {}

    def compile_groups(self, cases: list[Case]) -> list[list[WarmItem]]:
        """torch.compile'd calls to compile in worker processes before anything is timed."""
        return []

    def host_warm_items(self, cases: list[Case]) -> list[WarmItem]:
        """First calls whose cost is on the host, made here while the workers compile."""
        return []

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        """Measurements outside the harness, after it."""
        return []

    def note(self, message: str) -> None:
        """A line of progress from a long ``extra_rows`` (no bar there), with the time of day: where a run
        that ran out of time stopped, and what each part took."""
        _NOTES.log(message)


_NOTES = Console(stderr=True)


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


def target_sections(raw: dict, target_name: str, section_ids: tuple[str, ...]) -> dict[str, Any]:
    """The raw params one target's results depend on: its target entry, timing and study sizes."""
    target = raw["targets"][target_name]
    profile = target["profile"]
    bench = raw.get("bench", {}).get(profile, {})
    return {"target": target, "bench": bench, **{sid: raw[sid][profile] for sid in section_ids}}


def run_study(study: StudyDef, params: Params, raw: dict, target_name: str, results_root: Path,
              console: Console | None = None) -> Path:
    console = console or Console(stderr=True)
    target = resolve_target(params, target_name)
    check_study_target(study.name, params, target_name)
    check_hardware(target_name, target, study.name)
    study = study.bind(target.device)
    cases = study.cases(params, target)
    phash = params_hash(study.param_sections(raw, target, target_name))
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
    prov = provenance(target.device, target_name, phash)
    rows = [{"study": study.name, **r, **prov} for r in harness.ceiling_rows() + harness.rows + extra]
    write_results(path, rows, study.config_columns)
    if harness.phase_summary():
        console.print(f"time by phase: {harness.phase_summary()}")
    ok = sum(1 for r in harness.rows if r["status"] == "ok" and r["metric"] == "time_ms")
    console.print(f"wrote {path} ({ok} timed cases, {len(rows)} rows)")
    return path
