"""Decode with a zoo preset on one GPU or tensor-parallel over several, one process a GPU (or CPU processes over
gloo), under torchrun:

    torchrun --standalone --nproc-per-node 2 -m adaattn.distributed.decode --model llama_1b \\
        --set parallel.world_size=2 --set parallel.tp=2

Every rank builds the same weights (one seed) and shards them (``parallel.tensor_parallel``: each rank its heads
and MLP units, two all-reduces a block; its shards plain tensors by default, DTensors with ``--shards dtensor``),
gives each attention layer a static KV cache of its own kv heads, and
takes the same prompt. A round is the prompt's prefill, then ``--new-tokens`` greedy decode steps, each the
gpt-fast step compiled with CUDA graphs (``--compile``) or eager; the first round warms up (compilation, CUDA
graphs' recording) and is not timed. Rank 0 writes the rounds' times (the slowest rank's), the peak memory of the
fullest rank, and the last round's tokens to ``--out``.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import typer
from rich.console import Console

from adaattn.distributed.layout import load_run_params
from adaattn.errors import ConfigError
from adaattn.distributed.parallel import (check_layout, end_process_group, init_mesh, tensor_parallel,
                                         write_run)
from adaattn.models.train import DTYPES

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
DECODE_DTYPES = ("bf16", "fp32")


@app.command()
def main(
    model: Annotated[str, typer.Option(help="a preset of params.yaml `models` (a dense decoder)")],
    batch_size: Annotated[int, typer.Option("--batch", min=1, help="sequences decoded together")] = 1,
    prompt_len: Annotated[int, typer.Option(min=1, help="the prompt's tokens")] = 512,
    new_tokens: Annotated[int, typer.Option(min=1, help="decode steps a round")] = 128,
    rounds: Annotated[int, typer.Option(min=1, help="timed rounds, after one untimed")] = 3,
    dtype: Annotated[str, typer.Option(help="the weights' and caches' dtype: bf16 or fp32")] = "bf16",
    compile_: Annotated[bool, typer.Option("--compile/--no-compile", help="the decode step compiled with CUDA "
                                           "graphs (mode reduce-overhead; GPUs only)")] = True,
    shards: Annotated[str, typer.Option(help="tensor parallelism's weights: local (plain tensors, a functional "
                                        "all-reduce) or dtensor (parallelize_module's)")] = "local",
    allreduce: Annotated[str, typer.Option(help="the compiled step's all-reduces: nccl, or one_shot (symmetric "
                                           "memory: each rank reads its peers' partial sums over NVLink, no "
                                           "multicast; inductor's lowering for messages up to 128 KiB)")] = "nccl",
    seed: Annotated[int, typer.Option(help="weights and prompt")] = 0,
    set_: Annotated[list[str] | None, typer.Option("--set", help="override a param, KEY=VALUE")] = None,
    params: Annotated[Path, typer.Option("--params", help="params.yaml to read")] = Path("params.yaml"),
    out: Annotated[Path | None, typer.Option(help="JSON of the run (rank 0 writes it)")] = None,
) -> None:
    """Prefill and decode ``--model`` in params.yaml's ``parallel`` layout (one process, or tensor parallelism)."""
    console = Console(stderr=True, soft_wrap=True)
    try:  # every check before a process group starts
        cfg_all = load_run_params(params, set_)
        if model not in cfg_all.models:
            raise ConfigError(f"--model {model!r} is not a preset of models; allowed: {', '.join(cfg_all.models)}")
        layout, cfg = cfg_all.parallel, cfg_all.models[model]
        if "MASTER_ADDR" not in os.environ:
            raise ConfigError("no torchrun environment: start it as torchrun --standalone --nproc-per-node "
                              f"{layout.world_size} -m adaattn.distributed.decode ... (docs/distributed.md)")
        check_layout(layout, cfg, model)
        if layout.dp > 1 or layout.fsdp > 1:
            raise ConfigError(f"parallel.dp={layout.dp}, parallel.fsdp={layout.fsdp}: decoding runs one process or "
                              "tensor parallelism; allowed: dp=1, fsdp=1 (replicas decode apart, with no traffic)")
        if dtype not in DECODE_DTYPES:
            raise ConfigError(f"--dtype {dtype!r}; allowed: {', '.join(DECODE_DTYPES)}")
        if shards not in ("local", "dtensor"):
            raise ConfigError(f"--shards {shards!r}; allowed: local, dtensor")
        if allreduce not in ("nccl", "one_shot"):
            raise ConfigError(f"--allreduce {allreduce!r}; allowed: nccl, one_shot")
        if allreduce == "one_shot" and not (torch.cuda.is_available() and compile_ and layout.tp > 1):
            raise ConfigError("--allreduce one_shot lowers the compiled step's all-reduces to symmetric memory: it "
                              "needs CUDA GPUs, --compile and parallel.tp > 1")
        if prompt_len + new_tokens > cfg.max_seq_len:
            raise ConfigError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} is over models.{model}."
                              f"max_seq_len={cfg.max_seq_len}")
        from adaattn.models.generate import check_decodable

        try:
            check_decodable(cfg)
        except ValueError as err:
            raise ConfigError(f"models.{model}: {err}") from None
    except ConfigError as err:
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(2) from None

    from adaattn.models.transformer import build_model
    from adaattn.models.generate import decode_one, prefill, setup_kv_cache

    mesh, finished = init_mesh(layout), False
    try:
        cuda = mesh.device_type == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        torch.manual_seed(seed)
        net = build_model(cfg, device=device).to(DTYPES[dtype]).eval().requires_grad_(False)
        if layout.tp > 1:
            tensor_parallel(net, mesh["tp"], local=shards == "local")
        if allreduce == "one_shot":
            # a decode step's all-reduces are a few KiB: latency, not bandwidth; inductor lowers those of a group
            # with symmetric memory to one kernel that reads every peer's buffer directly
            from torch._inductor import config as inductor_config
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            enable_symm_mem_for_group(mesh["tp"].get_group().group_name)
            inductor_config._collective.auto_select = True
            # CUDA-graph trees (torch 2.11) refuse the symmetric buffers the lowering allocates in their pool
            # ("tensors in the cudagraph pool not tracked as outputs"); the one-graph-per-shape capture takes them
            inductor_config.triton.cudagraph_trees = False
        P, N = prompt_len, new_tokens
        setup_kv_cache(net, batch_size, P + N, dtype=DTYPES[dtype])
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, cfg.vocab_size, (batch_size, P), generator=g).to(device)
        compiled = compile_ and cuda
        step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True) if compiled else decode_one
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def one_round() -> tuple[float, float, torch.Tensor, torch.Tensor]:
            sync()
            t0 = time.perf_counter()
            logits = prefill(net, prompt)
            sync()
            t1 = time.perf_counter()
            tokens = [logits.argmax(-1, keepdim=True)]
            for i in range(P, P + N - 1):
                if compiled:  # each call a new step of CUDA-graph trees: its outputs are read before the next
                    torch.compiler.cudagraph_mark_step_begin()
                logits = step(net, tokens[-1], torch.tensor([i], device=device))
                tokens.append(logits.argmax(-1, keepdim=True))
            sync()
            t2 = time.perf_counter()
            return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / max(N - 1, 1), torch.cat(tokens, 1), logits.float().clone()

        with torch.no_grad():
            one_round()  # compilation, CUDA graphs' recording, the allocator's first blocks
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            timed = [one_round() for _ in range(rounds)]
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
        mine = {"rank": dist.get_rank(), "prefill_ms": [t[0] for t in timed], "decode_ms": [t[1] for t in timed],
                "peak_mib": peak}
        ranks: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() == 0:
            # each round's time is its slowest rank's: the ranks wait for each other at every all-reduce
            prefill_ms = [max(r["prefill_ms"][i] for r in ranks) for i in range(rounds)]
            decode_ms = [max(r["decode_ms"][i] for r in ranks) for i in range(rounds)]
            tokens, logits = timed[-1][2], timed[-1][3]
            run = {"model": model, "layout": layout.model_dump(), "shards": shards, "allreduce": allreduce,
                   "batch": batch_size,
                   "prompt_len": P, "new_tokens": N, "dtype": dtype, "compiled": compiled, "device": device.type,
                   "prefill_ms": prefill_ms, "decode_ms_per_token": decode_ms,
                   "tokens_per_s": batch_size * 1e3 / statistics.median(decode_ms),
                   "peak_mib_max": max(r["peak_mib"] for r in ranks), "ranks": ranks,
                   "tokens": tokens.tolist(),
                   # the last step's logits, for checks on small models (a big vocabulary's would be megabytes)
                   "last_logits": logits.tolist() if logits.numel() <= 65536 else None}
            console.print(f"{model} tp={layout.tp} batch {batch_size}: prefill {statistics.median(prefill_ms):.2f} ms, "
                          f"decode {statistics.median(decode_ms):.3f} ms a token ({run['tokens_per_s']:.0f} tokens/s), "
                          f"peak {run['peak_mib_max']:.0f} MiB")
            write_run(out, run)
        finished = True
    finally:
        # CUDA graphs that captured NCCL calls are freed before the communicators those calls use
        torch._dynamo.reset()
        if cuda:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
            torch.cuda.synchronize()
        end_process_group(finished)


if __name__ == "__main__":
    app()
