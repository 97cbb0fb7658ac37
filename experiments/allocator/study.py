"""The allocator study (G0-C1's "512 MB chunks" and "95% of GPU memory allowed"): a preset's eager training step
under each allocator setting, each setting in a fresh Python process, since PyTorch's caching allocator reads
``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA first allocates.

Per setting (``config.ALLOCATOR_SETTINGS``): the same steps from the same weights on the same batches, their
length cycling through ``seq_lens`` at a fixed token count (tensors of changing shapes: what splits and strands
a caching allocator's blocks); the median step time after the first cycle; the allocator's peaks (allocated:
what tensors held; reserved: what it took from the driver) and its cudaMalloc retries (a retry frees cached
blocks and tries again: fragmentation's cost); then the largest batch at ``probe_seq_len`` a step fits
(doubling, then bisecting, each trial one step; the limit a row says it reached). The processes run one after
another, so times compare across processes, not side by side; the memory figures are the point.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from adaattn_pipeline.bench.study import StudyDef
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.allocator.schema import AllocatorRun

# what each setting changes: the environment the process starts with, and a call after it starts
ALLOC_CONF = {"default": None, "split_512": "max_split_size_mb:512", "expandable": "expandable_segments:True",
              "fraction_95": None}
FRACTION = {"fraction_95": 0.95}


class Allocator(StudyDef):
    name = "allocator"
    table_ids = ("G0-C1",)
    config_columns = ["model", "batch", "seq_len"]
    sections = ("allocator",)

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        return [raw[section][profile]["model"]]

    def __init__(self, device: str = "cpu"):
        self.device = device

    def bind(self, device: str) -> Allocator:
        return Allocator(device)

    def cases(self, params: Params, target: Target) -> list:
        return []  # whole processes: extra_rows runs them

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        run: AllocatorRun | None = getattr(params.allocator, target.profile)
        base = {"table_id": "G0-C1", "kernel": "", "model": run.model, "mode": "step"}
        if self.device != "cuda":
            return [{**base, "case_id": f"allocator/{run.model}", "provider": s, "metric": "step_ms", "value": None,
                     "unit": "ms", "status": "unavailable", "reason": "the settings are CUDA's caching allocator's"}
                    for s in run.settings]
        torch.cuda.empty_cache()  # the ceilings' blocks: the children share the GPU with this process's context
        rows = []
        for setting in run.settings:
            rows += [{**base, **r} for r in run_setting(setting, run, params.models[run.model].model_dump())]
        return rows



def run_setting(setting: str, run: AllocatorRun, preset: dict) -> list[dict]:
    """The rows of one setting's process (an error row where the process fails or outlasts its timeout)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if ALLOC_CONF[setting]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF[setting]
    job = json.dumps({"setting": setting, "run": run.model_dump(), "preset": preset})
    case = f"allocator/{run.model}"
    try:
        done = subprocess.run([sys.executable, "-m", "adaattn_experiments.allocator.study"], input=job, env=env,
                              capture_output=True, text=True, timeout=run.timeout_s)
    except subprocess.TimeoutExpired:
        return [{"case_id": case, "provider": setting, "metric": "step_ms", "value": None, "unit": "ms",
                 "status": "error", "reason": f"the setting's process outlasted allocator.timeout_s={run.timeout_s}"}]
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " ".join(done.stderr.split())[-300:]
        return [{"case_id": case, "provider": setting, "metric": "step_ms", "value": None, "unit": "ms",
                 "status": "error", "reason": f"the setting's process exited {done.returncode}: {tail}"}]
    return json.loads(lines[-1])  # its last line: the rows (a library may print before)


def measure(setting: str, run: AllocatorRun, preset: dict) -> list[dict]:
    """In the setting's own process: the steps, the allocator's figures, the largest batch that fits."""
    from adaattn.models.config import ModelConfig
    from adaattn.models.train import create_optimized_training_setup

    if setting in FRACTION:
        torch.cuda.set_per_process_memory_fraction(FRACTION[setting])
    cfg = ModelConfig(**preset)
    torch.manual_seed(run.seed)
    model, optimizer, trainer = create_optimized_training_setup(cfg, compile_mode=None, dtype="bf16", device="cuda")
    g = torch.Generator().manual_seed(run.seed)
    case = f"allocator/{run.model}"
    row = {"provider": setting, "status": "ok", "reason": ""}
    times = []
    for step in range(run.steps):
        S = run.seq_lens[step % len(run.seq_lens)]
        tokens = torch.randint(0, cfg.vocab_size, (run.tokens // S, S + 1), generator=g)
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(tokens)
        torch.cuda.synchronize()
        if step >= len(run.seq_lens):  # the first cycle holds every shape's first call
            times.append((time.perf_counter() - start) * 1e3)
    stats = torch.cuda.memory_stats()
    mib = 2**20
    shapes = "/".join(map(str, run.seq_lens))
    rows = [{**row, "case_id": case, "batch": None, "seq_len": None, "metric": "step_ms",
             "value": statistics.median(times) if times else None, "unit": "ms", "samples": len(times),
             "reason": f"median step, lengths cycling {shapes} at {run.tokens} tokens, after the first cycle"},
            {**row, "case_id": case, "metric": "peak_allocated_mb", "value": stats["allocated_bytes.all.peak"] / mib,
             "unit": "MiB", "reason": "what tensors held at the peak"},
            {**row, "case_id": case, "metric": "peak_reserved_mb", "value": stats["reserved_bytes.all.peak"] / mib,
             "unit": "MiB", "reason": "what the allocator took from the driver at its peak"},
            {**row, "case_id": case, "metric": "alloc_retries", "value": stats["num_alloc_retries"], "unit": "retries",
             "reason": "cudaMalloc retries after freeing cached blocks"}]
    largest, limit_hit = probe(trainer, cfg.vocab_size, run, g)
    rows.append({**row, "case_id": f"{case}-s{run.probe_seq_len}", "batch": largest, "seq_len": run.probe_seq_len,
                 "metric": "max_batch", "value": largest, "unit": "sequences",
                 "reason": f"reached allocator.probe_limit={run.probe_limit}" if limit_hit else
                 "the largest batch a step fits (doubling, then bisecting)"})
    del model, optimizer, trainer
    return rows


def probe(trainer, vocab: int, run: AllocatorRun, g: torch.Generator) -> tuple[int, bool]:
    """The largest batch (at most ``probe_limit``) whose training step fits; whether the limit stopped the search.
    Not ``models.serving.find_optimal_batch_size``: that empties the cache after every trial, and this study
    measures the allocator's pool as the steps before left it."""
    def fits(batch: int) -> bool:
        tokens = torch.randint(0, vocab, (batch, run.probe_seq_len + 1), generator=g)
        try:
            trainer.train_step(tokens)
            torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            trainer.optimizer.zero_grad(set_to_none=True)
            return False

    low, high = 0, 1
    while fits(high):
        low = high
        if high == run.probe_limit:
            return low, True
        high = min(2 * high, run.probe_limit)
    while high - low > 1:  # low fits, high does not
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low, False


def _child() -> None:
    job = json.loads(sys.stdin.read())
    rows = measure(job["setting"], AllocatorRun(**job["run"]), job["preset"])
    print(json.dumps(rows))


if __name__ == "__main__":
    _child()


STUDY = Allocator()
