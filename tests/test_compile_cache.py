"""Warming torch.compile's caches in worker processes: segments, fresh dynamo, cache hits."""

import multiprocessing
import os
import pickle
from types import SimpleNamespace

import torch

from adaattn_pipeline.bench import compile_cache
from adaattn_pipeline.bench.compile_cache import FreshCompiles, segments, warm_calls, warm_compile_cache
from adaattn_pipeline.bench.harness import Case, Workload


class _WarmStudy:
    """Records, per first call, the process and the grad mode it ran in (module level: picklable)."""

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def setup(self, case, provider, requires_grad):
        if provider == "broken":
            raise RuntimeError("cannot compile")
        x = torch.ones(3, requires_grad=requires_grad)

        def fwd():
            (self.log_dir / f"{case.case_id}-{provider}").write_text(f"{os.getpid()} {torch.is_grad_enabled()}")
            if provider == "pair":  # two outputs, as RoPE's (q, k)
                return x * 2, x * 3
            return x * 2

        return Workload(fwd=fwd, inputs=[x], flops_fwd=0)


def _case(i):
    return Case(f"c{i}", "T", {}, ("p",), ("fwd",))


def test_warm_compile_cache_runs_each_group_in_a_worker(tmp_path):
    groups = [[(_case(0), "p", "fwd"), (_case(1), "p", "fwd")], [(_case(2), "p", "fwd_bwd")],
              [(_case(3), "broken", "fwd")], [(_case(4), "pair", "fwd_bwd")]]
    here = []
    report = warm_compile_cache(_WarmStudy(tmp_path), groups, "cpu", workers=2,
                                meanwhile=lambda: here.append(os.getpid()))
    assert report.groups == 4 and report.workers == 2 and report.seconds >= report.meanwhile_seconds > 0
    assert here == [os.getpid()]  # meanwhile: in the measuring process
    assert len(report.failures) == 1 and "c3 broken fwd: RuntimeError: cannot compile" in report.failures[0]
    seen = {f.name: f.read_text().split() for f in tmp_path.iterdir()}
    assert set(seen) == {"c0-p", "c1-p", "c2-p", "c4-pair"}  # a two-output backward warms too
    assert all(pid != str(os.getpid()) for pid, _ in seen.values())  # never in the measuring process
    assert seen["c0-p"][1] == "False" and seen["c2-p"][1] == "True"  # the grad mode the harness times in
    assert warm_compile_cache(_WarmStudy(tmp_path), [], "cpu", workers=4).workers == 0


def test_segments_are_maximal_runs_of_one_key():
    items = [(_case(i), "p", "fwd") for i in range(6)]
    keys = {"c0": "a", "c1": "a", "c2": "b", "c3": "a", "c4": "a", "c5": "c"}
    out = segments(items, lambda item: keys[item[0].case_id])
    assert [[c.case_id for c, _, _ in g] for g in out] == [["c0", "c1"], ["c2"], ["c3", "c4"], ["c5"]]
    assert segments([], lambda item: 0) == []


def test_fresh_compiles_resets_dynamo_on_a_new_key_only(monkeypatch):
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    fresh = FreshCompiles()
    for key in ("a", "a", "b", "b", "a"):
        fresh.enter(key)
    assert len(resets) == 3
    copy = pickle.loads(pickle.dumps(fresh))  # what a worker gets: it resets before its first call
    assert copy.key is None
    copy.enter("a")
    assert len(resets) == 4


def _measuring_role(study, items):
    """The measuring process's side, in a process started like the workers (same import order)."""
    compile_cache.compile_in_process()
    from torch._dynamo.utils import counters

    counters.clear()
    failures = warm_calls(study, items, "cpu")
    return failures, dict(counters["inductor"])


def test_measuring_process_hits_every_graph_the_workers_compiled(tmp_path, monkeypatch):
    """The point of segments and fresh dynamo: after the workers, the measuring process, which
    makes all first calls in one process, compiles nothing itself (FlexAttention on CPU, with a
    size-1 batch and two masks, so the segments are cut by batch and by mask)."""
    from adaattn_experiments.attention_backends.study import AttentionBackends

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the workers inherit it
    study = AttentionBackends("cpu")
    section = SimpleNamespace(providers=["flex"], modes=["fwd"])
    cases = [study._case("T", 512 // s, s, 2, 16, causal, "fp32", section)
             for causal in (False, True) for s in (128, 256, 512)]
    groups = study.compile_groups(cases)
    assert len(groups) == 4  # (full, causal) x (B > 1, B = 1)
    report = warm_compile_cache(study, groups, "cpu", workers=2)
    assert report.failures == ()
    items = [item for g in groups for item in g]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        failures, inductor = pool.apply(_measuring_role, (AttentionBackends("cpu"), items))
    assert failures == []
    assert inductor.get("fxgraph_cache_miss", 0) == 0, inductor
    assert inductor.get("fxgraph_cache_hit", 0) >= len(groups)
