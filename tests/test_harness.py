"""The harness: formulas, quantiles, status rows, memory, accuracy, atomic writes."""

import math
import warnings

import pandas as pd
import pytest
import torch

from adaattn.attention.providers import AttentionCase
from adaattn_pipeline.bench import results as results_mod
from adaattn_pipeline.bench.accuracy import accuracy
from adaattn_pipeline.bench.harness import Case, Harness, Workload, classify_error
from adaattn.errors import Unsupported
from adaattn.timing import trace as trace_mod
from adaattn.timing.memory import peak_memory_bytes
from adaattn_pipeline.bench.roofline import Ceilings, gbps, mode_flops, tflops
from adaattn.timing.timers import CpuTimer, KernelTrace, UncutTrace, quantiles


def test_attention_flops_formula():
    case = AttentionCase(batch=32, seq_len=1024, heads=16, head_dim=64, causal=False, dtype="bf16", device="cpu")
    assert case.flops_fwd() == 4 * 32 * 16 * 1024**2 * 64
    causal = AttentionCase(**{**case.__dict__, "causal": True})
    assert causal.flops_fwd() == case.flops_fwd() / 2
    assert mode_flops(100.0, "bwd") == 250.0 and mode_flops(100.0, "fwd_bwd") == 350.0
    with pytest.raises(ValueError, match="allowed"):
        mode_flops(1.0, "sideways")


def test_rate_units():
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)  # 2 TFLOP in 1 s
    assert gbps(3e9, 1.0) == pytest.approx(3000.0)  # 3 GB in 1 ms


def test_quantiles_interpolate_like_numpy():
    q = quantiles([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (q.p20, q.p50, q.p80, q.n) == (pytest.approx(1.8), 3.0, pytest.approx(4.2), 5)
    with pytest.raises(ValueError):
        quantiles([])


def test_cpu_timer_counts_calls_and_clears_grads():
    calls = []
    x = torch.ones(3, requires_grad=True)
    x.grad = torch.ones(3)

    def fn():
        assert x.grad is None
        calls.append(1)

    q = CpuTimer(warmup=2, repeats=7)(fn, grad_to_none=[x])
    assert len(calls) == 9 and q.n == 7 and q.p20 <= q.p50 <= q.p80


def test_cpu_peak_memory_sees_a_known_allocation():
    n = 8 * 2**20 // 4  # 8 MiB of float32

    def fn():
        a = torch.empty(n)
        b = torch.empty(n)  # both alive: 16 MiB peak
        return a.sum() + b.sum()

    peak = peak_memory_bytes(fn, "cpu")
    assert 16 * 2**20 <= peak < 17 * 2**20


def test_profiler_sessions_detach_cupti_when_they_stop(monkeypatch):
    """Kineto reads TEARDOWN_CUPTI when a session stops: a profiled call sets it where it is unset; a
    value the caller set stays, with one warning per value."""
    monkeypatch.delenv(trace_mod.TEARDOWN, raising=False)
    monkeypatch.setattr(trace_mod, "_warned", set())
    peak_memory_bytes(lambda: torch.ones(4), "cpu")
    assert trace_mod.os.environ[trace_mod.TEARDOWN] == "1"
    monkeypatch.setenv(trace_mod.TEARDOWN, "0")
    with pytest.warns(RuntimeWarning, match="TEARDOWN_CUPTI='0'"):
        assert trace_mod.detach_cupti_after_sessions() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peak_memory_bytes(lambda: torch.ones(4), "cpu")  # warned once for this value
    assert trace_mod.os.environ[trace_mod.TEARDOWN] == "0"


def test_accuracy_metrics():
    ref = torch.randn(4, 5, dtype=torch.float64)
    assert accuracy(ref.float(), ref)["rel_l2"] < 1e-6
    noisy = ref + 0.1 * ref.norm() / math.sqrt(ref.numel()) * torch.randn_like(ref)
    m = accuracy(noisy, ref)
    assert 0.02 < m["rel_l2"] < 0.3 and m["cosine"] < 1.0
    bad = ref.clone()
    bad[0, 0] = float("nan")
    m = accuracy(bad, ref)
    assert m["rel_l2"] == math.inf and math.isnan(m["cosine"])
    with pytest.raises(ValueError, match="shape"):
        accuracy(ref[:2], ref)


class _ToyStudy:
    """A study whose providers fail in every way the harness must record."""

    def __init__(self):
        self.x = torch.randn(64, 64)

    def setup(self, case, provider, requires_grad):
        x = self.x.detach().clone().requires_grad_(requires_grad)
        if provider == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        if provider == "unsupported":
            raise Unsupported("head dim 40 not supported")
        if provider == "broken":
            raise KeyError("boom")
        return Workload(fwd=lambda: torch.softmax(x @ x, -1), inputs=[x], flops_fwd=2 * 64**3)

    def reference(self, case):
        return torch.softmax(self.x.double() @ self.x.double(), -1)

    def unavailable(self, provider, device):
        return "package not importable" if provider == "missing" else None

    def has_backward(self, provider):
        return provider != "fwd_only"


def test_harness_records_every_status_and_goes_on():
    case = Case("toy/1", "T-1", {"n": 64}, ("ok", "oom", "unsupported", "broken", "missing", "fwd_only"),
                ("fwd", "fwd_bwd"))
    h = Harness("cpu", CpuTimer(1, 3), Ceilings(10.0, 1.0, "fp32", 64))
    rows = pd.DataFrame(h.run(_ToyStudy(), [case]))
    status = rows[rows.metric == "time_ms"].set_index(["provider", "mode"])["status"]
    assert status[("ok", "fwd")] == "ok" and status[("ok", "fwd_bwd")] == "ok"
    assert set(status.xs("oom", level=0)) == {"oom"}
    assert set(status.xs("unsupported", level=0)) == {"unsupported"}
    assert set(status.xs("broken", level=0)) == {"error"}
    assert set(status.xs("missing", level=0)) == {"unavailable"}
    assert status[("fwd_only", "fwd")] == "ok" and status[("fwd_only", "fwd_bwd")] == "unsupported"
    ok = rows[(rows.provider == "ok") & (rows["mode"] == "fwd")].set_index("metric")
    assert ok.loc["rel_l2", "value"] < 1e-6 and ok.loc["peak_mem_mb", "value"] > 0
    assert ok.loc["tflops", "p20"] <= ok.loc["tflops", "value"] <= ok.loc["tflops", "p80"]
    assert "aten::mm" in ok.loc["time_ms", "kernel"]
    reasons = rows[rows.status != "ok"].set_index("provider")["reason"]
    assert "out of memory" in reasons["oom"].iloc[0] and "KeyError" in reasons["broken"].iloc[0]


def test_classify_error():
    assert classify_error(torch.OutOfMemoryError("x"))[0] == "oom"
    assert classify_error(NotImplementedError("x"))[0] == "unsupported"
    assert classify_error(RuntimeError("x"))[0] == "error"


def test_write_results_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "study" / "cpu.csv"
    row = {"study": "s", "case_id": "c", "metric": "time_ms", "value": 1.0, "status": "ok"}
    results_mod.write_results(path, [row], [])
    before = path.read_bytes()

    def explode(self, *a, **k):
        raise KeyboardInterrupt  # interrupted mid-write

    monkeypatch.setattr(pd.DataFrame, "to_csv", explode)
    with pytest.raises(KeyboardInterrupt):
        results_mod.write_results(path, [{**row, "value": 2.0}], [])
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["cpu.csv"]  # no temp file left behind
    with pytest.raises(ValueError, match="unknown columns"):
        results_mod.write_results(path, [{"nonsense": 1}], [])


def test_per_call_kernel_ms_cuts_a_trace_at_the_flush_kernels():
    from adaattn.timing.timers import FLUSH_MARK, per_call_kernel_ms

    flush = f"vectorized_elementwise_kernel<{FLUSH_MARK}_kernel_cuda>"
    trace = [("edge", 0, 5_000), (flush, 10, 90_000), ("k1", 20, 2_000), ("Memset", 25, 500),
             ("k2", 30, 1_000), (flush, 40, 90_000), ("k1", 50, 4_000), (flush, 60, 90_000), ("edge", 70, 5_000)]
    # in start order, whatever the input order; before the first flush and after the closing one: no call's
    assert per_call_kernel_ms(list(reversed(trace)), 2) == [0.0035, 0.004]
    assert per_call_kernel_ms(trace, 3) is None  # not one flush per call and a closing one: no numbers rather than wrong ones
    assert per_call_kernel_ms(trace[:-2], 2) is None  # the closing flush lost: the last call's end is unknown


def test_a_trace_that_cannot_be_cut_is_taken_again_and_says_so(monkeypatch):
    """``kernel_times_ms`` with the profiler and the device replaced (they need CUDA): a trace that lost a
    flush marker is taken again, the result naming what the lost ones held; after ``attempts`` such traces,
    ``UncutTrace`` names every trace's count. Each trace launches its edge kernels and a closing flush around
    the calls, and records lost among the edge kernels cost nothing."""
    import contextlib
    from types import SimpleNamespace

    import adaattn.timing.timers as timing
    from adaattn.timing.timers import TRACE_EDGE, UncutTrace, kernel_times_ms

    launched: list[str] = []  # the "kernels" of the session under way, in launch order
    traces: list[list[str]] = []
    losses: list[tuple[int, int]] = []  # per session: (edge kernels, flush markers) lost from its start

    def event(name: str, start: int):
        return SimpleNamespace(name=lambda: name, start_ns=lambda: start, device_type=lambda: torch.autograd.DeviceType.CUDA,
                               duration_ns=lambda: 1_000_000 if name == "call" else 7)

    @contextlib.contextmanager
    def session(activities):
        launched.clear()
        prof = SimpleNamespace()
        yield prof
        traces.append(list(launched))
        lose = dict(zip(("edge", "bitwise_not"), losses.pop(0)))
        kept = []
        for name in launched:
            if lose.get(name):
                lose[name] -= 1
                continue
            kept.append(name)
        events = [event(n, i) for i, n in enumerate(kept)]
        prof.profiler = SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events))

    tensor = SimpleNamespace(add_=lambda _: launched.append("edge"), bitwise_not_=lambda: launched.append("bitwise_not"))
    device = SimpleNamespace(empty=lambda *a, **k: tensor, zeros=lambda *a, **k: tensor, int32=torch.int32,
                             cuda=SimpleNamespace(synchronize=lambda: None), autograd=torch.autograd)
    monkeypatch.setattr(timing, "profiler_session", session)
    monkeypatch.setattr(timing, "torch", device)
    fns = [lambda: launched.append("call"), lambda: launched.append("call")]

    losses[:] = [(TRACE_EDGE, 0)]
    trace = kernel_times_ms(fns, 3)
    assert trace.samples == [[1.0] * 3, [1.0] * 3] and trace.uncut == () and trace.note() == ""
    assert traces[-1][:TRACE_EDGE + 1] == ["edge"] * TRACE_EDGE + ["bitwise_not"]
    assert traces[-1][-TRACE_EDGE - 1:] == ["bitwise_not"] + ["edge"] * TRACE_EDGE
    assert traces[-1].count("bitwise_not") == 7  # one before each of the 6 calls, one closing

    losses[:] = [(0, 1), (2, 3), (0, 0)]
    trace = kernel_times_ms(fns, 3)
    assert trace.samples == [[1.0] * 3, [1.0] * 3] and trace.uncut == (6, 4)
    assert "taken again after 2 that could not be cut (held 6, 4 flush markers of 7)" in trace.note()

    losses[:] = [(0, 1), (0, 1), (0, 2)]
    with pytest.raises(UncutTrace, match="3 traces held 6, 6, 5 flush markers of 7"):
        kernel_times_ms(fns, 3)
    assert len(traces) == 7  # one, three (the third cut), three (none cut)


def test_round_robin_order_and_split():
    from adaattn.timing.timers import round_robin, split_round_robin

    assert round_robin(3, 2) == [0, 1, 2, 0, 1, 2]
    order = round_robin(3, 4)
    samples = [100.0 * i + c for c, i in enumerate(order)]  # sample c comes from function order[c]
    split = split_round_robin(samples, 3, 4)
    assert [[int(x) // 100 for x in fn] for fn in split] == [[0] * 4, [1] * 4, [2] * 4]
    with pytest.raises(ValueError, match="functions"):
        split_round_robin(samples[:-1], 3, 4)


class _SizedStudy:
    """Providers whose forward output size stands for their memory, each recording its grad mode."""

    def __init__(self):
        self.grad_modes: list[tuple[str, bool]] = []

    def setup(self, case, provider, requires_grad):
        n = 1000 if provider == "big" else 10
        x = torch.randn(n, requires_grad=requires_grad)

        def fwd():
            self.grad_modes.append((provider, torch.is_grad_enabled()))
            return x * 2

        return Workload(fwd=fwd, inputs=[x])

    def reference(self, case):
        return None

    def unavailable(self, provider, device):
        return None

    def has_backward(self, provider):
        return True


def _cuda_harness_on_cpu(monkeypatch, timer, total_bytes):
    """A Harness for device "cuda" whose device-only parts (profiled call, memory, kernel trace) are
    stand-ins, so its kernel-time bookkeeping runs on a CPU machine."""
    import adaattn_pipeline.bench.harness as harness_mod
    from adaattn.timing.memory import Profiled

    monkeypatch.setattr(harness_mod, "profiled_call", lambda fn, device: Profiled(int(fn().numel()), "k"))
    monkeypatch.setattr(Harness, "_device_memory", lambda self: (0, total_bytes))
    return Harness("cuda", CpuTimer(0, 2), Ceilings(10.0, 1.0, "fp32", 64), kernel_calls=3, kernel_timer=timer)


def test_kernel_time_interleaves_a_cases_providers_per_mode(monkeypatch):
    traces = []
    study = _SizedStudy()

    def timer(fns, calls):
        traces.append(len(fns))
        study.grad_modes.clear()
        for fn in fns:
            fn()
        traces.append(list(study.grad_modes))
        return KernelTrace([[float(i + 1)] * calls for i in range(len(fns))])

    h = _cuda_harness_on_cpu(monkeypatch, timer, total_bytes=1000)
    case = Case("toy/1", "T-1", {"n": 10}, ("a", "big", "b"), ("fwd", "fwd_bwd"))
    rows = pd.DataFrame(h.run(study, [case]))
    # per mode: "big" (a 1000-byte call against a 500-byte budget) alone, then a and b in one trace
    assert traces == [1, [("big", False)], 1, [("big", True)],
                      2, [("a", False), ("b", False)], 2, [("a", True), ("b", True)]]
    k = rows[rows.metric == "kernel_ms"].set_index(["provider", "mode"])
    assert k.loc[("a", "fwd"), "value"] == 1.0 and k.loc[("b", "fwd_bwd"), "value"] == 2.0
    assert k.loc[("a", "fwd"), "reason"] == "calls interleaved with 1 other workload"
    assert k.loc[("a", "fwd"), "unit"] == "ms"
    assert k.loc[("big", "fwd"), "reason"] == "calls measured alone" and (k["samples"] > 0).all()
    assert not h._held  # nothing kept past its case


@pytest.mark.parametrize("failure", ["uncut", "oom"])
def test_kernel_time_failure_is_a_row_per_workload(monkeypatch, failure):
    def timer(fns, calls):
        if failure == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory")
        raise UncutTrace(2 * calls + 1, [2 * calls, 2 * calls - 1, 2 * calls])

    h = _cuda_harness_on_cpu(monkeypatch, timer, total_bytes=10**6)
    rows = pd.DataFrame(h.run(_SizedStudy(), [Case("toy/1", "T-1", {"n": 10}, ("a", "b"), ("fwd",))]))
    k = rows[rows.metric == "kernel_ms"]
    assert len(k) == 2 and k["value"].isna().all()
    assert set(k["status"]) == ({"oom"} if failure == "oom" else {"error"})
    if failure == "uncut":  # the reason says what the traces held
        assert set(k["reason"]) == {"the kernel trace could not be cut into calls: 3 traces held 6, 5, 6 flush markers of 7"}
    assert (rows[rows.metric == "time_ms"]["status"] == "ok").all()


def test_out_of_memory_beside_held_workloads_frees_them_and_tries_again(monkeypatch):
    """A workload that runs out of memory while others are held for the kernel-time trace: those are
    measured (interleaved among themselves) and freed first, then it runs again."""
    traces = []

    class _Flaky(_SizedStudy):
        failed = False

        def setup(self, case, provider, requires_grad):
            if provider == "flaky" and not self.failed:
                self.failed = True
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")
            return super().setup(case, provider, requires_grad)

    def timer(fns, calls):
        traces.append(len(fns))
        return KernelTrace([[1.0] * calls for _ in fns])

    h = _cuda_harness_on_cpu(monkeypatch, timer, total_bytes=10**6)
    rows = pd.DataFrame(h.run(_Flaky(), [Case("toy/1", "T-1", {"n": 10}, ("a", "b", "flaky", "c"), ("fwd",))]))
    assert traces == [2, 2]  # a and b when flaky ran out of memory; then flaky and c
    t = rows[rows.metric == "time_ms"].set_index("provider")["status"]
    assert (t == "ok").all() and len(t) == 4
    k = rows[rows.metric == "kernel_ms"].set_index("provider")
    assert k["value"].notna().all() and len(k) == 4
