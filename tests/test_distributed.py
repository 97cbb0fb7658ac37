"""Layouts on torch.distributed, on the CPU over gloo: processes started by torchrun, as a user starts them."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from adaattn.distributed.layout import Layout
from adaattn_pipeline.config import ConfigError, load_raw, validate
from adaattn.distributed.parallel import MULTICAST_OFF, check_layout, end_process_group, multicast_off

PARAMS = Path(__file__).parents[1] / "params.yaml"


@pytest.fixture(scope="module")
def params_file(tmp_path_factory) -> Path:
    raw = copy.deepcopy(load_raw(PARAMS))
    # PyTorch's MLP and norm, two layers: the layouts' arithmetic, not the kernels, is under test
    raw["models"]["dense_small"].update({"dim": 32, "n_layers": 2, "n_heads": 2, "mlp": "gelu", "norm": "layernorm"})
    # Llama's shape in small: GQA (4 query heads, 2 kv heads) and SwiGLU's fused gate-up, which tensor parallelism
    # reorders by rank
    raw["models"]["llama_tiny"] = {**raw["models"]["dense_small"], "n_heads": 4, "n_kv_heads": 2, "mlp": "swiglu",
                                   "mlp_hidden": 64, "norm": "rmsnorm"}
    path = tmp_path_factory.mktemp("dist") / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def torchrun(params: Path, out: Path, nproc: int, model: str = "dense_small", seq_len: int = 32, steps: int = 3,
             extra: tuple[str, ...] = (), **layout: int) -> subprocess.CompletedProcess:
    sets = [f"parallel.{k}={v}" for k, v in {"world_size": nproc, "param_dtype": "fp32", **layout}.items()]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # PyTorch's ops on the CPU, not Triton's
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that dies on a signal prints every thread's stack (CI, 2026-11-29)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "adaattn.distributed.train", "--model", model, "--steps", str(steps), "--warmup", "0", "--batch", "4",
           "--seq-len", str(seq_len), "--dtype", "fp32", "--params", str(params), "--out", str(out),
           *[a for s in sets for a in ("--set", s)], *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def run(params: Path, out: Path, nproc: int, **kw) -> dict:
    done = torchrun(params, out, nproc, **kw)
    assert done.returncode == 0, done.stderr[-8000:]
    return json.loads(out.read_text())


def assert_same_training(a: dict, b: dict) -> None:
    """The same losses step by step and the same weights after the steps (fp32; reductions in another order)."""
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    # the reduced gradients' norm, step by step: a rank that skipped or doubled a reduction would show here
    assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-3) and len(a["grad_norms"]) == len(a["losses"])
    assert a["weights"].keys() == b["weights"].keys()
    for name, value in b["weights"].items():
        assert a["weights"][name] == pytest.approx(value, rel=1e-5), name


@pytest.mark.parametrize("model, seq_len", [("dense_small", 32), ("ltm_small", 128), ("hydra_small", 64)])
def test_ddp_and_fsdp2_train_as_one_process_does(params_file, tmp_path, model, seq_len):
    one = run(params_file, tmp_path / "one.json", 1, model=model, seq_len=seq_len)
    assert one["losses"][-1] < one["losses"][0] + 1.0 and len(one["weights"]) > 5
    fsdp = run(params_file, tmp_path / "fsdp.json", 2, model=model, seq_len=seq_len, fsdp=2)
    assert_same_training(fsdp, one)
    assert fsdp["layout"]["fsdp"] == 2 and len(fsdp["ranks"]) == 2
    if model == "dense_small":
        ddp = run(params_file, tmp_path / "ddp.json", 2, model=model, seq_len=seq_len, dp=2)
        assert_same_training(ddp, one)
        # each rank trained on its half of every batch
        assert [r["tokens"] for r in ddp["ranks"]] == [3 * 2 * seq_len] * 2
        hsdp = run(params_file, tmp_path / "hsdp.json", 4, model=model, seq_len=seq_len, dp=2, fsdp=2)
        assert_same_training(hsdp, one)  # two replicas of two shards each


def test_blocks_compiled_under_ddp_train_as_the_eager_process_does(params_file, tmp_path):
    # issue 67: an eager step that is host-bound has the collectives wait on the slower rank; compiled blocks are
    # the fix, and they must train as eager does (fp32; inductor's fused reductions sum in another order)
    one = run(params_file, tmp_path / "one.json", 1)
    ddp = run(params_file, tmp_path / "ddp.json", 2, dp=2, extra=("--compile-mode", "default"))
    assert (ddp["compile_mode"], ddp["compiled_blocks"], one["compile_mode"], one["compiled_blocks"]) == \
        ("default", 2, None, 0)
    assert ddp["losses"] == pytest.approx(one["losses"], rel=1e-4)
    for name, value in one["weights"].items():
        assert ddp["weights"][name] == pytest.approx(value, rel=1e-4), name
    bad = torchrun(params_file, tmp_path / "x.json", 1, extra=("--compile-mode", "fast"))
    assert bad.returncode != 0 and "--compile-mode 'fast'; allowed: default, reduce-overhead" in bad.stderr
    assert not (tmp_path / "x.json").exists()
    # CUDA graphs with micro-batches: the Trainer's accumulation holds on one GPU and under DDP; FSDP2's and tensor
    # parallelism's are untried under them: refused before any step, on any device
    bad = torchrun(params_file, tmp_path / "x.json", 2, fsdp=2, extra=("--compile-mode", "reduce-overhead",
                                                                       "--micro-batches", "2"))
    assert bad.returncode != 0 and "run on one GPU or DDP only (parallel.fsdp=2, parallel.tp=1); allowed here: " \
        "default, max-autotune-no-cudagraphs" in " ".join(bad.stderr.split())
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("model", ["dense_small", "llama_tiny"])
def test_tensor_parallelism_trains_and_decodes_as_one_process_does(params_file, tmp_path, model):
    one = run(params_file, tmp_path / "one.json", 1, model=model)
    tp = run(params_file, tmp_path / "tp.json", 2, model=model, tp=2)
    assert_same_training(tp, one)
    # one batch shared by the pair: each rank is credited half its tokens
    assert [r["tokens"] for r in tp["ranks"]] == [3 * 4 * 32 / 2] * 2
    if model == "llama_tiny":  # a 2-D mesh of eight ranks (the 8-GPU layout): four FSDP2 shards of TP pairs
        two_d = run(params_file, tmp_path / "2d.json", 8, model=model, fsdp=4, tp=2)
        assert_same_training(two_d, one)
        assert [r["tokens"] for r in two_d["ranks"]] == [3 * 1 * 32 / 2] * 8  # a quarter of the batch a pair
    outs = {}
    # one process; two with plain local shards (the default); two with DTensor's (the training path's)
    for name, n, shards in (("one", 1, "local"), ("local", 2, "local"), ("dtensor", 2, "dtensor")):
        done = decode(params_file, tmp_path / f"{name}.json", n, model=model, shards=shards, tp=n)
        assert done.returncode == 0, done.stderr[-8000:]
        outs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert len(outs["one"]["tokens"][0]) == 6
    for name in ("local", "dtensor"):
        assert outs[name]["tokens"] == outs["one"]["tokens"] and outs[name]["shards"] == name
        gap = (torch.tensor(outs[name]["last_logits"]) - torch.tensor(outs["one"]["last_logits"])).abs().max()
        assert gap < 1e-5, name
        assert outs[name]["layout"]["tp"] == 2 and len(outs[name]["decode_ms_per_token"]) == 1


def decode(params: Path, out: Path, nproc: int, model: str = "dense_small", shards: str = "local",
           extra: tuple[str, ...] = (), **layout: int):
    sets = [f"parallel.{k}={v}" for k, v in {"world_size": nproc, **layout}.items()]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "adaattn.distributed.decode", "--model", model, "--batch", "2", "--prompt-len", "8", "--new-tokens",
           "6", "--rounds", "1", "--dtype", "fp32", "--shards", shards, "--params", str(params), "--out", str(out),
           *[a for s in sets for a in ("--set", s)], *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_a_tensor_parallel_run_refuses_checkpoints_and_decode_refuses_data_parallelism(params_file, tmp_path):
    done = torchrun(params_file, tmp_path / "x.json", 2, tp=2, extra=("--save", str(tmp_path / "ck")))
    assert done.returncode != 0 and "checkpoints run with tp=1" in " ".join(done.stderr.split())
    done = decode(params_file, tmp_path / "z.json", 2, tp=2, extra=("--allreduce", "one_shot"))
    assert done.returncode != 0 and "needs CUDA GPUs, --compile and parallel.tp > 1" in " ".join(done.stderr.split())
    done = decode(params_file, tmp_path / "y.json", 2, dp=2)
    assert done.returncode != 0 and "decoding runs one process or tensor parallelism" in " ".join(done.stderr.split())
    assert "ProcessGroup" not in done.stderr and not (tmp_path / "y.json").exists()


def test_accumulated_micro_batches_train_as_the_whole_batch_does(params_file, tmp_path):
    """Each rank's share in two parts, the gradients reduced once: the same step as the whole batch at once."""
    one = run(params_file, tmp_path / "one.json", 1)
    # fsdp_kept: each unit gathered once a step, kept through the micro-batches
    for name, layout in (("accum", {}), ("ddp", {"dp": 2}), ("fsdp", {"fsdp": 2}),
                         ("fsdp_kept", {"fsdp": 2, "reshard_after_forward": False})):
        nproc = 2 if layout else 1
        parts = run(params_file, tmp_path / f"{name}.json", nproc, extra=("--micro-batches", "2"), **layout)
        assert parts["micro_batches"] == 2
        assert_same_training(parts, one)
    done = torchrun(params_file, tmp_path / "x.json", 2, dp=2, extra=("--micro-batches", "4"))
    assert done.returncode != 0 and "--micro-batches 4 must divide each rank's 2 sequences" in \
        " ".join(done.stderr.split())


def test_a_checkpoint_saved_at_world_size_2_resumes_at_world_size_1(params_file, tmp_path):
    folder = tmp_path / "ckpt"
    saved = run(params_file, tmp_path / "a.json", 2, fsdp=2, extra=("--save", str(folder)))
    resumed = run(params_file, tmp_path / "b.json", 1, steps=2, extra=("--load", str(folder)))
    assert resumed["resumed_at"] == 3 and resumed["loaded_weights"] == saved["weights"]
    straight = run(params_file, tmp_path / "c.json", 1, steps=5)  # the same five steps in one process
    assert_same_training({**resumed, "losses": saved["losses"] + resumed["losses"],
                          "grad_norms": saved["grad_norms"] + resumed["grad_norms"]}, straight)
    assert not list(tmp_path.glob(".ckpt.*"))  # written whole, then renamed


def test_a_launch_that_does_not_match_the_layout_stops_before_any_process_group(params_file, tmp_path):
    done = torchrun(params_file, tmp_path / "x.json", 2, world_size=1)
    assert done.returncode != 0 and not (tmp_path / "x.json").exists()
    assert "parallel.world_size=1 but 2 processes were started" in " ".join(done.stderr.split())
    assert "ProcessGroup" not in done.stderr  # stopped in the check, not in a collective
    done = torchrun(params_file, tmp_path / "y.json", 1, extra=("--load", str(tmp_path / "nothing")))
    assert done.returncode != 0 and "not a checkpoint folder" in " ".join(done.stderr.split())


def test_without_torchrun_it_says_how_to_start(params_file, monkeypatch, capsys):
    from adaattn.distributed import train

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(SystemExit) as stop:
        train.app(["--model", "dense_small", "--params", str(params_file)], standalone_mode=True)
    err = " ".join(capsys.readouterr().err.split())
    assert stop.value.code == 2 and "torchrun --standalone --nproc-per-node 1" in err


def test_bad_layouts_name_the_key():
    raw = copy.deepcopy(load_raw(PARAMS))
    cfg = validate(raw).models["llama_1b"]
    with pytest.raises(ConfigError, match=r"parallel.world_size=4 must be dp x fsdp x tp = 2 x 1 x 1 = 2"):
        validate({**raw, "parallel": {"world_size": 4, "dp": 2}})
    check_layout(Layout(world_size=2, tp=2), cfg, "llama_1b", world_size=2)  # whole heads and MLP units a rank
    with pytest.raises(ConfigError, match=r"parallel.tp=3 must divide models.llama_1b's n_heads \(32\)"):
        check_layout(Layout(world_size=3, tp=3), cfg, "llama_1b", world_size=3)
    with pytest.raises(ConfigError, match=r"parallel.tp=8 must divide models.llama_1b's kv heads \(4\)"):
        check_layout(Layout(world_size=8, tp=8), cfg, "llama_1b", world_size=8)
    with pytest.raises(ConfigError, match="parallel.tp=2 with parallel.dp=2: tensor parallelism composes with FSDP2"):
        check_layout(Layout(world_size=4, dp=2, tp=2), cfg, "llama_1b", world_size=4)
    check_layout(Layout(world_size=4, fsdp=2, tp=2), cfg, "llama_1b", world_size=4)  # a 2-D mesh
    hydra = validate(raw).models["hydra_1b"]
    with pytest.raises(ConfigError, match="attention='ccgqa'"):
        check_layout(Layout(world_size=2, tp=2), hydra, "hydra_1b", world_size=2)
    with pytest.raises(ConfigError, match="but 1 process was started"):
        check_layout(Layout(world_size=2, fsdp=2), cfg, "llama_1b", world_size=1)
    check_layout(Layout(world_size=2, fsdp=2), cfg, "llama_1b", world_size=2)  # a good one passes


def test_multicast_is_forced_off_whatever_the_environment_says():
    env = {"NCCL_NVLS_ENABLE": "1", "OTHER": "x"}
    multicast_off(env)
    assert env == {**MULTICAST_OFF, "OTHER": "x"}
    assert MULTICAST_OFF == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                             "NVSHMEM_DISABLE_NVLS": "1"}


def test_a_finished_rank_waits_for_the_others_before_its_groups_go_and_a_failed_one_does_not(monkeypatch):
    import adaattn.distributed.parallel as parallel

    calls = []
    monkeypatch.setattr(parallel.dist, "barrier", lambda device_ids=None: calls.append("barrier"))
    monkeypatch.setattr(parallel.dist, "destroy_process_group", lambda: calls.append("destroy"))
    end_process_group(True)
    assert calls == ["barrier", "destroy"]
    calls.clear()
    end_process_group(False)  # a rank that failed would hang in a barrier on the peers it broke
    assert calls == ["destroy"]
    calls.clear()

    def broken(device_ids=None):
        raise RuntimeError("peer gone")

    monkeypatch.setattr(parallel.dist, "barrier", broken)
    with pytest.raises(RuntimeError, match="peer gone"):
        end_process_group(True)
    assert calls == ["destroy"]  # the groups go even when the barrier fails
