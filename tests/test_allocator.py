"""The allocator study (G0-C1's allocator lines) on the CPU: the largest-batch search, each setting's process and
its environment, the report's verdicts, a CPU target's rows; bad runs name their key. The measurement itself is
CUDA's caching allocator's: the H100 runs it."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from adaattn_experiments.allocator.schema import AllocatorRun
from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
RUN = {"model": "llama_1b", "seq_lens": [512, 1024], "tokens": 2048, "steps": 4, "probe_seq_len": 1024,
       "probe_limit": 64}


@pytest.mark.parametrize("fits_up_to, expected", [(0, (0, False)), (1, (1, False)), (5, (5, False)),
                                                  (37, (37, False)), (63, (63, False)), (64, (64, True)),
                                                  (500, (64, True))])
def test_the_probe_finds_the_largest_batch_that_fits(monkeypatch, fits_up_to, expected):
    from adaattn_experiments.allocator.study import probe

    tried = []

    def step(tokens):
        tried.append(tokens.shape[0])
        if tokens.shape[0] > fits_up_to:
            raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    trainer = SimpleNamespace(train_step=step, optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)]))
    assert probe(trainer, 10, AllocatorRun(**RUN), torch.Generator().manual_seed(0)) == expected
    assert len(tried) <= 14 and len(set(tried)) == len(tried)  # doubling, then bisecting, no batch twice


def test_each_setting_runs_in_its_own_process_with_its_environment(monkeypatch):
    from adaattn_experiments.allocator import study as allocator

    calls = []

    def fake_run(cmd, input, env, **kw):
        job = json.loads(input)
        calls.append((job["setting"], env.get("PYTORCH_CUDA_ALLOC_CONF")))
        if job["setting"] == "expandable":
            return SimpleNamespace(returncode=1, stdout="", stderr="RuntimeError: boom")
        if job["setting"] == "fraction_95":
            raise subprocess.TimeoutExpired(cmd, 1)
        if job["setting"] == "split_512":
            return SimpleNamespace(returncode=0, stdout="", stderr="")  # a process that printed no rows
        return SimpleNamespace(returncode=0, stderr="", stdout="log line\n" + json.dumps([{"metric": "step_ms"}]))

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")  # not inherited
    monkeypatch.setattr(allocator.subprocess, "run", fake_run)
    run = AllocatorRun(**RUN)
    out = {s: allocator.run_setting(s, run, {}) for s in run.settings}
    assert calls == [("default", None), ("split_512", "max_split_size_mb:512"),
                     ("expandable", "expandable_segments:True"), ("fraction_95", None)]
    assert out["default"] == [{"metric": "step_ms"}] and out["split_512"][0]["status"] == "error"
    assert out["expandable"][0]["status"] == "error" and "exited 1: RuntimeError: boom" in out["expandable"][0]["reason"]
    assert "outlasted allocator.timeout_s" in out["fraction_95"][0]["reason"]


def test_a_cpu_target_says_why_it_has_no_rows():
    from adaattn_experiments.allocator.study import Allocator

    raw = copy.deepcopy(load_raw(PARAMS))
    raw["allocator"]["cpu"] = RUN
    params = validate(raw)
    rows = Allocator("cpu").extra_rows(params, params.targets["cpu"])
    assert {r["status"] for r in rows} == {"unavailable"} and len(rows) == 4
    assert all("caching allocator" in r["reason"] for r in rows)


def _rows(batches: dict[str, float], limit: bool = False) -> pd.DataFrame:
    base = {"target": "h100", "hardware": "test gpu", "cuda": "13.0", "model": "llama_1b", "mode": "step",
            "status": "ok", "reason": "", "case_id": "allocator/llama_1b"}
    rows = []
    for setting, batch in batches.items():
        rows += [{**base, "provider": setting, "metric": m, "value": v} for m, v in
                 (("step_ms", 100.0), ("peak_allocated_mb", 1000.0), ("peak_reserved_mb", 1200.0),
                  ("alloc_retries", 0))]
        rows.append({**base, "provider": setting, "metric": "max_batch", "value": batch,
                     "reason": "reached allocator.probe_limit=64" if limit else "the largest batch"})
    return pd.DataFrame(rows)


def test_the_report_judges_each_claimed_setting_against_the_default(tmp_path):
    from adaattn_experiments.allocator.report import render

    (section,) = render(_rows({"default": 12, "split_512": 12, "expandable": 13, "fraction_95": 11}), tmp_path)
    verdicts = {v.claim: v for v in section.verdicts}
    assert verdicts["optimized memory allocation (512 MB chunks)"].verdict == "holds"
    fraction = verdicts["95% GPU memory utilization allowed"]
    assert fraction.verdict == "worse than claimed" and "caps a process at 95%" in fraction.reason
    assert "| expandable" in section.markdown and "1.2" in section.markdown  # reserved / allocated
    (section,) = render(_rows({"default": 64, "split_512": 64, "fraction_95": 64}, limit=True), tmp_path)
    assert {v.verdict for v in section.verdicts} == {"inconclusive"}


@pytest.mark.parametrize("update, message", [
    ({"tokens": 1000}, "tokens=1000 must be a multiple of every seq_lens entry; got 512"),
    ({"settings": ["default", "default"]}, "settings must not repeat one"),
    ({"settings": ["huge_pages"]}, "settings"),
    ({"model": "llama_7b"}, "allocator.gpu.models: 'llama_7b' is not a preset of models"),
    ({"probe_seq_len": 4096}, "allocator.gpu.seq_len=4096 is over models.llama_1b.max_seq_len"),
])
def test_bad_runs_name_the_key(update, message):
    raw = copy.deepcopy(load_raw(PARAMS))
    raw["allocator"]["gpu"].update(update)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(raw)
