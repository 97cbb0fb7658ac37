"""The distributed study (G3-T2, G3-T3's TP row) on the CPU: torchrun jobs over gloo give their rows (tokens/s, per
rank, step time, loss; peak memory a row that says why not; tensor-parallel decode times), the all-reduce's bus
bandwidth in the same run, the report's scaling efficiency and TP decode ratio judged against the goals, a world
size the machine lacks and a layout a preset cannot run rows that say so; bad sections name their key."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pandas as pd
import pytest

from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
pytestmark = pytest.mark.usefixtures("pytorch_kernels")  # RoPE and norms by PyTorch: no interpreted Triton
TOY = {"models": ["dense_small"], "layouts": ["ddp"], "world_sizes": [1, 2], "batch_per_rank": 2, "seq_len": 16,
       "steps": 1, "warmup": 0, "dtype": "fp32", "allreduce_mib": [0.25]}


def _params(update=None):
    raw = copy.deepcopy(load_raw(PARAMS))
    # PyTorch's MLP and norm (and the fixture: RoPE), in the children too
    raw["models"]["dense_small"].update({"dim": 32, "n_layers": 2, "n_heads": 2, "mlp": "gelu", "norm": "layernorm"})
    raw["G3-T2"]["cpu"] = {**TOY, **(update or {})}
    return validate(raw)


def test_torchrun_jobs_give_their_rows_and_the_report_reads_the_scaling():
    from adaattn_experiments.distributed.study import STUDY
    from adaattn_experiments.distributed.report import render

    decode = {"model": "dense_small", "batches": [1], "prompt_len": 8, "new_tokens": 4, "rounds": 1,
              "allreduce": ["nccl", "one_shot"]}
    params = _params({"layouts": ["ddp", "tp"], "decode": decode})
    df = pd.DataFrame(STUDY.bind("cpu").extra_rows(params, params.targets["cpu"]))
    jobs = df[df["mode"] == "train"]
    ok = jobs[jobs.status == "ok"]
    assert set(ok.provider) == {"single", "ddp", "tp"}, jobs[jobs.status != "ok"].reason.tolist()
    for layout, ws in (("single", 1), ("ddp", 2), ("tp", 2)):
        mine = ok[ok.provider == layout].set_index("metric")["value"]
        assert mine["tokens_per_s"] > 0 and mine["tokens_per_s_per_rank"] == pytest.approx(mine["tokens_per_s"] / ws)
        assert mine["step_ms"] > 0 and mine["loss_last"] > 0 and mine["loss_first"] > 0
        # weak scaling: the batch a rank fixed (a tensor-parallel pair shares the pair's batch)
        assert (jobs[jobs.provider == layout].batch == 2 * ws).all()
    # both two-rank layouts train the same weights on the same batch of 4: one loss
    loss = ok[ok.metric == "loss_last"].set_index("provider")["value"]
    assert loss["tp"] == pytest.approx(loss["ddp"], rel=1e-5)
    dec = df[df["mode"] == "decode"]
    assert set(dec[dec.status == "ok"].provider) == {"single", "tp"}, dec[dec.status != "ok"].reason.tolist()
    (shot,) = dec[dec.provider == "tp_one_shot"].itertuples()  # symmetric memory: GPUs only, no job started
    assert shot.status == "unavailable" and "on CUDA GPUs" in shot.reason
    ms = dec[(dec.metric == "decode_ms_per_token") & (dec.status == "ok")]
    assert (ms.value > 0).all() and (ms.table_id == "G3-T3").all() and ms.reason.str.contains("eager").all()
    peak = jobs[jobs.metric == "rank_peak_mem_mb"]
    assert (peak.status == "unavailable").all() and peak.reason.str.contains("no CUDA").all()
    bus = df[df.metric == "busbw_gbps"]
    assert len(bus) == 1 and bus.value.iloc[0] > 0 and "gloo" in bus.reason.iloc[0]

    cpu = df.assign(target="cpu", hardware="test cpu", cuda=None)
    gpu = df.assign(target="h100x2", hardware="test gpu", cuda="13.0")
    section, tp = render(pd.concat([cpu, gpu]), Path("."))
    assert not [v for v in section.verdicts if "TP" in v.claim or "tensor" in v.claim]  # the goal is DDP's, FSDP2's
    assert "| tp " in section.markdown or "| tp |" in section.markdown
    first, last = (ok[(ok.provider == "ddp") & (ok.metric == m)].value.iloc[0] for m in ("loss_first", "loss_last"))
    assert f"{first:.3g} -> {last:.3g}" in section.markdown
    goal = [v for v in tp.verdicts if v.claim == "TP=2 batch-1 decode ms a token over one GPU's (dense_small)"]
    assert [v.verdict for v in goal][0] == "not measurable here"
    one, two = (ms[ms.world_size == w].value.iloc[0] for w in (1, 2))
    assert goal[1].measured == f"{two / one:.3g}"
    assert goal[1].verdict == ("holds" if two / one <= 0.6 else "worse than claimed")
    scaling = [v for v in section.verdicts if v.claim == "DDP x2 scaling efficiency (dense_small)"]
    assert [v.verdict for v in scaling][0] == "not measurable here"  # gloo on a CPU's cores
    per_rank = ok.set_index(["provider", "metric"])["value"]
    eff = per_rank["ddp", "tokens_per_s_per_rank"] / per_rank["single", "tokens_per_s"]
    want = "holds" if eff >= 0.95 else "worse than claimed"
    assert scaling[1].verdict == want and scaling[1].measured == f"{eff:.3g} over 1 round"


def test_the_efficiency_is_read_round_by_round():
    """Each round's two-rank job against the same round's one-rank job: a slow round of the machine slows both."""
    from adaattn_experiments.distributed.report import render

    rows = []
    for rnd, (one, two) in enumerate([(100.0, 96.0), (50.0, 48.5)]):  # 0.96 and 0.97; pooled medians: 73/75 = 0.97
        for layout, ws, per_rank in (("single", 1, one), ("ddp", 2, two)):
            case = {"case_id": f"distributed/m/x{ws}/r{rnd}", "provider": layout, "world_size": ws, "model": "m",
                    "batch": 4 * ws, "mode": "train", "status": "ok", "target": "h100x2", "hardware": "gpu",
                    "cuda": "13.0"}
            rows += [{**case, "metric": "tokens_per_s", "value": per_rank * ws},
                     {**case, "metric": "tokens_per_s_per_rank", "value": per_rank}]
    (section,) = render(pd.DataFrame(rows), Path("."))
    (v,) = [v for v in section.verdicts if v.claim.startswith("DDP x2")]
    assert v.measured == "median 0.965 (range 0.96-0.97) over 2 rounds" and v.verdict == "holds"


def test_a_layout_is_read_against_one_rank_in_its_own_precision_regime(monkeypatch, tmp_path):
    """FSDP2 computes with bf16 copies of fp32 shards; the plain one-rank job keeps fp32 weights under autocast. FSDP2
    at two ranks is read against FSDP2 on one rank (it read 1.03x against the plain job before), DDP against the plain
    one; the one-rank FSDP2 job runs with --shard-one."""
    from adaattn_experiments.distributed import study as distributed
    from adaattn_experiments.distributed.report import render

    rows = []
    for layout, ws, per_rank in (("single", 1, 100.0), ("fsdp", 1, 120.0), ("ddp", 2, 96.0), ("fsdp", 2, 114.0)):
        case = {"case_id": f"distributed/m/x{ws}/r0", "provider": layout, "world_size": ws, "model": "m",
                "batch": 4 * ws, "mode": "train", "status": "ok", "target": "h100x2", "hardware": "gpu", "cuda": "13.0"}
        rows += [{**case, "metric": "tokens_per_s", "value": per_rank * ws},
                 {**case, "metric": "tokens_per_s_per_rank", "value": per_rank}]
    (section,) = render(pd.DataFrame(rows), Path("."))
    ddp, fsdp = ([v for v in section.verdicts if v.claim.startswith(name)][0] for name in ("DDP x2", "FSDP2 x2"))
    assert ddp.measured.startswith("0.96") and "one-rank single job" in ddp.reason
    assert fsdp.measured.startswith("0.95") and "one-rank fsdp job" in fsdp.reason and fsdp.verdict == "holds"
    run, launched = _params().g3_t2.cpu, []
    monkeypatch.setattr(distributed, "launch", lambda module, args, ws, run, out, layout: launched.append(
        (layout, ws, "--shard-one" in args, distributed.job_sets(layout, ws, run))) or "not run")
    for layout, ws in (("single", 1), ("fsdp", 1), ("fsdp", 2)):
        distributed.run_job("m", layout, ws, run, tmp_path / "p.yaml", tmp_path)
    assert [(layout, ws, one) for layout, ws, one, _ in launched] == [("single", 1, False), ("fsdp", 1, True),
                                                                      ("fsdp", 2, False)]
    assert [any("reshard" in s for s in sets) for *_, sets in launched] == [False, True, True]


def test_exposed_communication_is_collective_time_no_other_kernel_hid():
    from adaattn.distributed.parallel import exposed_communication

    kernels = [("gemm", 0, 10), ("gemm", 20, 10), ("ncclKernel_AllReduce", 5, 20), ("ncclDevKernel_AllGather", 28, 12),
               ("ncclDevKernel_AllGather", 30, 5)]  # 30-35 inside the one before: counted once
    got = exposed_communication(kernels)
    assert got == {"comm_ms": 32e-6, "exposed_ms": 20e-6, "span_ms": 40e-6}  # exposed: 10-20 and 30-40
    assert exposed_communication([("gemm", 0, 5)])["exposed_ms"] == 0


def test_the_ranks_collectives_side_by_side_split_transfer_from_waiting():
    from adaattn.distributed.parallel import collective_kernels, collective_skew
    from adaattn_experiments.distributed.study import trace_rows

    # rank 0 launches both all-reduces early and waits for rank 1, which runs each for its transfer alone
    r0 = collective_kernels([("gemm", 0, 5), ("ncclAllReduce", 10, 30), ("ncclAllReduce", 50, 10)])
    r1 = collective_kernels([("ncclAllReduce", 52, 9), ("gemm", 0, 5), ("ncclAllReduce", 35, 6)])
    assert r1 == [("ncclAllReduce", 35, 6), ("ncclAllReduce", 52, 9)]  # in start order, collectives only
    assert collective_skew([r0, r1]) == {"wire_ms": 15e-6, "wait_ms": 25e-6, "skew_ms": 27e-6, "collectives": 2}
    assert collective_skew([r0, r1[:1]]) is None and collective_skew([r0]) is None  # unmatched: no reading
    assert collective_skew([r0, [("ncclAllGather", 35, 6), r1[1]]]) is None
    trace = [{"comm_ms": 4.0, "exposed_ms": 2.0, "span_ms": 10.0, "steps": 2, "skew_wire_ms": 1.0,
              "skew_wait_ms": 3.0, "skew_skew_ms": 0.5, "skew_collectives": 8}] * 2
    rows = {r["metric"]: r["value"] for r in trace_rows(trace)}
    assert rows == {"comm_ms": 2.0, "exposed_comm_ms": 1.0, "exposed_comm_share": 0.2, "comm_wire_ms": 0.5,
                    "comm_wait_ms": 1.5, "comm_skew_ms": 0.25}
    assert "comm_wait_ms" not in {r["metric"] for r in trace_rows([{k: v for k, v in trace[0].items()
                                                                      if not k.startswith("skew")}])}


def test_a_world_size_the_machine_lacks_is_a_row_that_says_so(monkeypatch):
    import torch

    from adaattn_experiments.distributed import study as distributed

    params = _params({"world_sizes": [1, 2]})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    ran = []
    monkeypatch.setattr(distributed, "run_job", lambda model, layout, ws, *a, **k: ran.append((layout, ws)) or [])
    monkeypatch.setattr(distributed, "allreduce_rows", lambda *a: pytest.fail("no all-reduce on one GPU"))
    rows = distributed.STUDY.bind("cuda").extra_rows(params, params.targets["cpu"])
    assert ran == [("single", 1)]
    (row,) = rows
    assert row["status"] == "unavailable" and row["reason"] == "world size 2 needs 2 GPUs; this machine has 1"


def test_layouts_and_the_bus_factor():
    from adaattn.distributed.allreduce import bus_factor
    from adaattn_experiments.distributed.study import layout_sets

    assert layout_sets("ddp", 2) == ["parallel.world_size=2", "parallel.dp=2", "parallel.fsdp=1", "parallel.tp=1"]
    assert layout_sets("fsdp", 4)[1:3] == ["parallel.dp=1", "parallel.fsdp=4"]
    assert layout_sets("single", 1)[:3] == ["parallel.world_size=1", "parallel.dp=1", "parallel.fsdp=1"]
    assert layout_sets("tp", 2) == ["parallel.world_size=2", "parallel.dp=1", "parallel.fsdp=1", "parallel.tp=2"]
    assert layout_sets("fsdp_tp", 8) == ["parallel.world_size=8", "parallel.dp=1", "parallel.fsdp=4", "parallel.tp=2"]
    assert (bus_factor(1), bus_factor(2), bus_factor(8)) == (0.0, 1.0, 1.75)


def test_a_target_of_four_gpus_runs_the_4_gpu_profile():
    from adaattn_pipeline.config import load_params
    from adaattn_experiments.distributed.study import STUDY, run_profile

    params, raw = load_params(PARAMS)
    four, two = params.targets["h100x4"], params.targets["h100x2"]
    assert (run_profile(four, raw["G3-T2"]), run_profile(two, raw["G3-T2"])) == ("gpu4", "gpu")
    assert "G3-T2.gpu4" in STUDY.param_keys(raw, "h100x4") and "G3-T2.gpu" in STUDY.param_keys(raw, "h100x2")
    without = {k: v for k, v in raw["G3-T2"].items() if k != "gpu4"}  # no 4-GPU profile: the target's own
    assert run_profile(four, without) == "gpu"


def test_a_profiles_resharding_reaches_only_the_fsdp_jobs():
    from adaattn_pipeline.config import load_params
    from adaattn_experiments.distributed.study import job_sets

    run = load_params(PARAMS)[0].g3_t2.cpu.model_copy(update={"reshard_after_forward": False})
    assert job_sets("fsdp", 2, run)[-1] == "parallel.reshard_after_forward=False"
    assert job_sets("fsdp_tp", 4, run)[-1] == "parallel.reshard_after_forward=False"
    assert not any("reshard" in s for s in job_sets("ddp", 2, run) + job_sets("single", 1, run))


def test_the_compile_mode_reaches_every_training_job_and_its_rows_say_so(monkeypatch, tmp_path):
    import typing

    from adaattn.models.train import records_graphs
    from adaattn.models.train import COMPILE_MODES
    from adaattn_experiments.distributed import study as distributed
    from adaattn_experiments.distributed.schema import GRAPH_MODES, DistributedRun

    allowed = typing.get_args(typing.get_args(DistributedRun.model_fields["compile_mode"].annotation)[0])
    assert allowed == COMPILE_MODES  # spelled out in the schema (params validate without torch): kept in step
    assert GRAPH_MODES == tuple(m for m in COMPILE_MODES if records_graphs(m))
    job = {"ranks": [{"seconds": 2.0}], "steps": 1, "tokens_per_s": 10.0, "tokens_per_s_per_rank": 10.0,
           "peak_mib_max": 1.0, "device": "cpu", "losses": [2.0, 1.0]}
    for mode in ("max-autotune-no-cudagraphs", None):  # the CPU profile accumulates micro-batches: no CUDA graphs
        run, launched = _params({"compile_mode": mode}).g3_t2.cpu, []
        monkeypatch.setattr(distributed, "launch", lambda module, args, *a: launched.append(args) or job)
        for layout, ws in (("single", 1), ("ddp", 2)):
            rows = distributed.run_job("m", layout, ws, run, tmp_path / "p.yaml", tmp_path, mode=run.mode_of(layout))
            assert rows[0]["reason"].endswith(f"; blocks compiled ({mode})" if mode else "; eager")
        flags = [args[args.index("--compile-mode") + 1] if "--compile-mode" in args else None for args in launched]
        assert flags == [mode, mode]


def test_a_layout_of_its_own_compile_mode_is_read_against_one_rank_in_that_mode(monkeypatch):
    """layout_compile_modes: DDP's jobs under CUDA graphs, TP's and FSDP2's in compile_mode; a one-rank baseline in
    each mode a layout it serves uses, and the report reads each layout against the one of its own mode (a faster
    baseline under graphs must not flatter DDP, nor a slower one sink TP)."""
    from adaattn_experiments.distributed import study as distributed
    from adaattn_experiments.distributed.report import render

    params = _params({"layouts": ["ddp", "fsdp", "tp"], "compile_mode": "default",
                      "layout_compile_modes": {"ddp": "reduce-overhead"}})
    run = params.g3_t2.cpu
    assert distributed.one_rank_jobs(run) == [("single", "reduce-overhead"), ("single", "default"),
                                              ("fsdp", "default")]
    ran = []
    monkeypatch.setattr(distributed, "run_job", lambda model, layout, ws, *a, mode: ran.append((layout, ws, mode)) or
                        [{"metric": "tokens_per_s", "value": 1.0, "status": "ok"}])
    monkeypatch.setattr(distributed, "allreduce_rows", lambda *a: [])
    rows = distributed.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    assert ran == [("single", 1, "reduce-overhead"), ("single", 1, "default"), ("fsdp", 1, "default"),
                   ("ddp", 2, "reduce-overhead"), ("fsdp", 2, "default"), ("tp", 2, "default")]
    cases = [(r["provider"], r["compile_mode"], r["case_id"]) for r in rows]
    assert cases[:2] == [("single", "reduce-overhead", "distributed/dense_small/x1/reduce-overhead/r0"),
                         ("single", "default", "distributed/dense_small/x1/default/r0")]
    assert len({(p, c) for p, _, c in cases}) == len(cases)  # one MLflow run a job
    assert distributed.one_rank_jobs(_params({"layouts": ["fsdp"]}).g3_t2.cpu) == [("single", None), ("fsdp", None)]
    assert distributed.one_rank_jobs(run, ["ddp", "fsdp"]) == [("single", "reduce-overhead"), ("fsdp", "default")]
    ran.clear()  # HYDRA runs no tensor parallelism: no one-rank job in TP's mode for it
    distributed.STUDY.bind("cpu").extra_rows(params.model_copy(update={"g3_t2": params.g3_t2.model_copy(update={
        "cpu": run.model_copy(update={"models": ["hydra_small"]})})}), params.targets["cpu"])
    assert ran == [("single", 1, "reduce-overhead"), ("fsdp", 1, "default"), ("ddp", 2, "reduce-overhead"),
                   ("fsdp", 2, "default")]

    report = []
    for layout, ws, mode, per_rank in (("single", 1, "reduce-overhead", 200.0), ("single", 1, "default", 100.0),
                                       ("ddp", 2, "reduce-overhead", 190.0), ("tp", 2, "default", 90.0)):
        case = {"case_id": f"distributed/m/x{ws}/{mode}/r0", "provider": layout, "world_size": ws, "model": "m",
                "batch": 4 * ws, "mode": "train", "status": "ok", "target": "h100x2", "hardware": "gpu",
                "cuda": "13.0", "compile_mode": mode}
        report += [{**case, "metric": "tokens_per_s", "value": per_rank * ws},
                   {**case, "metric": "tokens_per_s_per_rank", "value": per_rank}]
    (section,) = render(pd.DataFrame(report), Path("."))
    (ddp,) = [v for v in section.verdicts if v.claim.startswith("DDP x2")]
    assert ddp.measured.startswith("0.95") and "compile mode reduce-overhead" in ddp.reason  # 190 / 200, not 1.9
    assert re.search(r"\| tp +\| +2 \| default +\| single x1 .*\| 0\.9 ", section.markdown)  # 90 / 100


def test_a_goal_not_measured_says_why():
    """A DDP or FSDP2 goal without its pair's numbers carries the reason of the row that did not run (the study's
    budget, a failure), its own or its baseline's, not only how it would have been read."""
    from adaattn_experiments.distributed.report import render

    case = {"model": "m", "mode": "train", "target": "h100x2", "hardware": "gpu", "cuda": "13.0",
            "compile_mode": "default", "metric": "tokens_per_s"}
    rows = [{**case, "case_id": "distributed/m/x1/default/r0", "provider": "single", "world_size": 1, "batch": 4,
             "status": "ok", "value": 100.0},
            {**case, "case_id": "distributed/m/x2/default/r0", "provider": "ddp", "world_size": 2, "batch": 8,
             "status": "unavailable", "value": None, "reason": "round 1 not run: past G3-T2 budget_s=9 at 10 s"},
            {**case, "case_id": "distributed/m/x1/default/r0", "provider": "fsdp", "world_size": 1, "batch": 4,
             "status": "error", "value": None, "reason": "out of memory"},
            {**case, "case_id": "distributed/m/x2/default/r0", "provider": "fsdp", "world_size": 2, "batch": 8,
             "status": "ok", "value": 190.0}]
    (section,) = render(pd.DataFrame(rows), Path("."))
    why = {v.claim.split()[0]: (v.verdict, v.reason) for v in section.verdicts if "scaling efficiency" in v.claim}
    assert why["DDP"][0] == "not measured yet" and why["DDP"][1].endswith("; round 1 not run: past G3-T2 "
                                                                          "budget_s=9 at 10 s")
    assert why["FSDP2"][0] == "not measured yet" and why["FSDP2"][1].endswith("; out of memory")


@pytest.mark.parametrize("update, match", [
    ({"compile_mode": "fast"}, "G3-T2.cpu.compile_mode"),
    ({"compile_mode": "reduce-overhead", "micro_batches": 2, "layouts": ["ddp", "fsdp"]},
     "compile_mode=reduce-overhead records CUDA graphs, which with micro_batches=2 run under ddp only, not fsdp; "
     "allowed for fsdp: default, max-autotune-no-cudagraphs"),
    ({"layout_compile_modes": {"tp": "max-autotune"}, "micro_batches": 2, "layouts": ["ddp", "tp"]},
     "layout_compile_modes.tp=max-autotune records CUDA graphs, .* not tp; allowed for tp: default, "),
    ({"layout_compile_modes": {"fsdp": "default"}}, r"layout_compile_modes names \['fsdp'\], not in layouts; "
     r"allowed: \['ddp'\]"),
    ({"layout_compile_modes": {"ddp": "fast"}}, "G3-T2.cpu.layout_compile_modes.ddp"),
    ({"world_sizes": [2]}, "world_sizes must hold 1"),
    ({"layouts": ["ddp", "ddp"]}, "layouts must not repeat"),
    ({"layouts": ["pp"]}, "layouts"),
    ({"decode": {"model": "nope", "batches": [1], "prompt_len": 4, "new_tokens": 2}},
     "G3-T2.cpu.decode.models: 'nope' is not a preset"),
    ({"decode": {"model": "hydra_small", "batches": [1], "prompt_len": 4, "new_tokens": 2}},
     "G3-T2.cpu.decode.model 'hydra_small': attention='ccgqa'"),
    ({"models": ["nope"]}, "G3-T2.cpu.models: 'nope' is not a preset"),
    ({"seq_len": 100000}, "G3-T2.cpu.seq_len=100000 is over models.dense_small.max_seq_len"),
])
def test_bad_sections_name_their_key(update, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _params(update)


def test_a_layout_a_preset_cannot_run_is_a_row_that_says_so(monkeypatch):
    from adaattn_experiments.distributed import study as distributed

    params = _params({"models": ["hydra_small"], "layouts": ["tp"], "seq_len": 16})
    ran = []
    monkeypatch.setattr(distributed, "run_job", lambda model, layout, ws, *a, **k: ran.append((layout, ws)) or [])
    monkeypatch.setattr(distributed, "allreduce_rows", lambda *a: [])
    rows = distributed.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    assert ran == [("single", 1)]  # no job started for the layout the check refused
    (row,) = rows
    assert row["provider"] == "tp" and row["status"] == "unavailable"
    assert "tensor parallelism shards the dense Attention" in row["reason"] and "ccgqa" in row["reason"]


def test_later_rounds_run_only_while_the_budget_lasts(monkeypatch):
    """Round 1 (with the traces), then the all-reduce, then round 2's jobs while each one's round-1 time still fits
    budget_s; the rest rows that say why not."""
    from adaattn_experiments.distributed import study as distributed

    params = _params({"layouts": ["ddp", "fsdp"], "repeats": 2, "budget_s": 55, "trace_steps": 1})
    clock, ran = [0.0], []

    def job(model, layout, ws, run, params_file, tmp, trace, mode=None):
        ran.append((layout, ws, trace))
        clock[0] += 10  # every job takes 10 s
        return [{"metric": "tokens_per_s", "value": 1.0, "status": "ok"}]

    monkeypatch.setattr(distributed, "run_job", job)
    monkeypatch.setattr(distributed.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(distributed, "allreduce_rows", lambda *a: ran.append(("all-reduce", None, None)) or [])
    rows = distributed.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    # round 1: the plain and FSDP2 one-rank jobs (FSDP2 is read against its own), then two ranks; round 2's plain
    # one-rank job starts at 40 s (40 + 10 <= 55); its FSDP2 one would end at 60
    assert ran == [("single", 1, 1), ("fsdp", 1, 1), ("ddp", 2, 1), ("fsdp", 2, 1), ("all-reduce", None, None),
                   ("single", 1, 0)]
    skipped = [r for r in rows if r["status"] == "unavailable"]
    assert [(r["provider"], r["world_size"], r["case_id"][-2:]) for r in skipped] == [
        ("fsdp", 1, "r1"), ("ddp", 2, "r1"), ("fsdp", 2, "r1")]
    assert skipped[0]["reason"] == "round 2 not run: its 10 s (round 1's) past G3-T2 budget_s=55 at 50 s"


def test_first_round_jobs_decode_and_all_reduce_start_only_while_the_budget_lasts(monkeypatch):
    """A first-round job is guessed at its model's longest job so far, a decode job at the longest decode job so
    far, the all-reduce at nothing: what would end past budget_s is a row that says so, and the run still ends with
    what it measured (a device call's kill would keep nothing)."""
    from adaattn_experiments.distributed import study as distributed

    decode = {"model": "dense_small", "batches": [1], "prompt_len": 8, "new_tokens": 4, "rounds": 1,
              "allreduce": ["nccl"]}
    params = _params({"layouts": ["ddp", "fsdp"], "budget_s": 25, "decode": decode})
    clock, ran = [0.0], []

    def job(name):
        def run(*args, **kwargs):
            ran.append(name if name != "train" else args[1:3])
            clock[0] += 10  # every job takes 10 s
            return [{"metric": "tokens_per_s", "value": 1.0, "status": "ok"}]
        return run

    monkeypatch.setattr(distributed, "run_job", job("train"))
    monkeypatch.setattr(distributed, "decode_job", job("decode"))
    monkeypatch.setattr(distributed, "allreduce_rows", job("all-reduce"))
    monkeypatch.setattr(distributed.time, "monotonic", lambda: clock[0])
    rows = distributed.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    # single x1 ends at 10, fsdp x1 at 20; ddp x2 would end at 30; the first decode job has no guess (20 <= 25)
    # and ends at 30, the second would end at 40; the all-reduce starts past the budget
    assert ran == [("single", 1), ("fsdp", 1), "decode"]
    skipped = {(r["mode"], r["provider"], r["world_size"]): r["reason"] for r in rows if r["status"] == "unavailable"}
    assert skipped == {
        ("train", "ddp", 2): "round 1 not run: its 10 s (dense_small's longest job so far) past G3-T2 budget_s=25 "
                             "at 20 s",
        ("train", "fsdp", 2): "round 1 not run: its 10 s (dense_small's longest job so far) past G3-T2 budget_s=25 "
                              "at 20 s",
        ("decode", "tp", 2): "the decode job not run: its 10 s (the longest decode job so far) past G3-T2 "
                             "budget_s=25 at 30 s",
        ("all_reduce", "all_reduce", 2): "the all-reduce job not run: past G3-T2 budget_s=25 at 30 s"}


def test_fsdp_over_tp_pairs_needs_four_ranks(monkeypatch):
    """At two ranks FSDP2 x TP would be TP alone: a row that says so, no job; at four, a job of a 2 x 2 mesh."""
    from adaattn_experiments.distributed import study as distributed

    params = _params({"layouts": ["fsdp_tp"], "world_sizes": [1, 2, 4]})
    ran = []
    monkeypatch.setattr(distributed, "run_job", lambda model, layout, ws, *a, **k: ran.append((layout, ws)) or [])
    monkeypatch.setattr(distributed, "allreduce_rows", lambda *a: [])
    rows = distributed.STUDY.bind("cpu").extra_rows(params, params.targets["cpu"])
    assert ran == [("single", 1), ("fsdp", 1), ("fsdp_tp", 4)]  # fsdp x1: FSDP2 x TP's baseline
    (row,) = rows
    assert row["world_size"] == 2 and row["status"] == "unavailable"
    assert row["reason"] == "fsdp_tp shards tensor-parallel pairs: an even world size of at least 4; got 2 (at 2 it " \
                            "is tp alone)"


def test_the_8_gpu_projection_is_a_range_from_the_2_gpu_jobs_and_never_a_measurement():
    from adaattn_experiments.distributed.report import projection, render

    rows = []
    for target in ("h100x2", "cpu"):
        for layout, ws, step, comm, exposed in (("single", 1, 100.0, None, None), ("ddp", 2, 110.0, 20.0, 5.0)):
            case = {"case_id": f"distributed/m/x{ws}/r0", "provider": layout, "world_size": ws, "model": "m",
                    "batch": 4 * ws, "mode": "train", "status": "ok", "target": target,
                    "hardware": "gpu" if target != "cpu" else "cpu", "cuda": "13.0" if target != "cpu" else None,
                    "hardware_count": 2 if target != "cpu" else None}
            metrics = {"step_ms": step, "tokens_per_s_per_rank": 1000.0, "tokens_per_s": 1000.0 * ws,
                       "comm_ms": comm, "exposed_comm_ms": exposed}
            rows += [{**case, "metric": k, "value": v} for k, v in metrics.items() if v is not None]
    df = pd.DataFrame(rows)
    got = projection(df, {"cpu"})
    assert [(r["target"], r["ranks"]) for r in got] == [("h100x2", 4), ("h100x2", 8)]  # no CPU target, no fsdp
    # 8 ranks: 1.75x the traffic; 100 / (110 + 0.75 x 20) = 0.80 to 100 / (110 + 0.75 x 5) = 0.879
    assert got[1]["scaling efficiency, projected"] == "0.80-0.88"
    assert got[1]["tokens/s, projected"] == "6.4e+03-7.03e+03"
    measured = df[(df.target == "h100x2") & (df.provider == "ddp")].assign(world_size=4)
    got = projection(pd.concat([df, measured]), {"cpu"})  # 4 was measured: beside its projection
    assert [(r["ranks"], r["scaling efficiency, measured"]) for r in got] == [(4, "1.00"), (8, "-")]
    (section,) = render(df, Path("."))
    assert "Projected, not measured" in section.markdown
    # a multi-GPU target's verdicts name its GPU count; the guide's fixed rows once per kind of machine
    assert {v.hardware for v in section.verdicts if v.claim.startswith("DDP")} == {"2x gpu", "cpu"}
    assert sum(v.claim.startswith("8xH100") for v in section.verdicts) == 2
    eight = [v for v in section.verdicts if v.claim.startswith("8xH100")]
    assert eight and all(v.measured == "-" and v.verdict != "holds" for v in eight)
