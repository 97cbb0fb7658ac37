"""Train a zoo preset in a layout, one process a GPU (or CPU processes over gloo), under torchrun:

    torchrun --standalone --nproc-per-node 2 -m adaattn.distributed.train --model llama_1b \\
        --set parallel.world_size=2 --set parallel.fsdp=2

Every rank builds the same weights (one seed) and draws the same global batch of the byte corpus, then trains
on its data-parallel share of it; the step's gradients are averaged across the shares (DDP's all-reduce,
FSDP's reduce-scatter), so a layout trains as one process on the whole batch would. Rank 0 prints each rank's
tokens/s and peak memory and the aggregate, and writes them (with the steps' losses) to ``--out``.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import typer
from rich.console import Console
from torch.distributed.tensor import DTensor

from adaattn.distributed.layout import load_run_params
from adaattn.errors import ConfigError
from adaattn.models.train import COMPILE_MODES, records_graphs
from adaattn.distributed.parallel import (RankStats, check_layout, collective_kernels, collective_skew,
                                         end_process_group, exposed_communication, gather_stats, init_mesh,
                                         parallelize, write_run)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def weights_digest(model: torch.nn.Module) -> dict[str, float]:
    """Each parameter's sum of squares over the whole tensor (gathered where sharded): the same numbers on every
    layout that holds the same weights. Called on every rank (a sharded tensor's gather is collective)."""
    inner = getattr(model, "module", model)  # DDP's
    out = {}
    for name, p in inner.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = float(full.detach().double().pow(2).sum())
    return out


def checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Model and optimizer state through torch.distributed.checkpoint: each rank writes its shards, and the
    folder loads into any layout (``restore``). Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")  # written whole, then renamed: a failed save keeps the last one
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state, "step": torch.tensor(step)}, checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        old = folder.with_name(f".{folder.name}.old")
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def restore(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load ``checkpoint``'s folder into this layout's model and optimizer (resharded as this layout needs);
    the steps the saved run had taken."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["step"])


@app.command()
def main(
    model: Annotated[str, typer.Option(help="a preset of params.yaml `models`")],
    steps: Annotated[int, typer.Option(min=1, help="optimizer steps")] = 20,
    warmup: Annotated[int, typer.Option(min=0, help="steps before the timed ones (compile, allocator)")] = 2,
    batch_size: Annotated[int, typer.Option("--batch", min=1, help="global batch: sequences a step, all ranks")] = 8,
    micro_batches: Annotated[int, typer.Option(min=1, help="each rank's share of a step in this many parts, "
                                               "forward and backward in turn, the gradients reduced once "
                                               "(gradient accumulation)")] = 1,
    seq_len: Annotated[int, typer.Option(min=1, help="tokens a sequence")] = 256,
    dtype: Annotated[str, typer.Option(help="the trainer's autocast dtype: bf16, fp16 or fp32")] = "bf16",
    lr: Annotated[float, typer.Option(help="AdamW's learning rate")] = 3e-4,
    seed: Annotated[int, typer.Option(help="weights and batches")] = 0,
    set_: Annotated[list[str] | None, typer.Option("--set", help="override a param, KEY=VALUE")] = None,
    params: Annotated[Path, typer.Option("--params", help="params.yaml to read")] = Path("params.yaml"),
    out: Annotated[Path | None, typer.Option(help="JSON of the run (rank 0 writes it)")] = None,
    load: Annotated[Path | None, typer.Option(help="a checkpoint folder to resume from (any layout's)")] = None,
    save: Annotated[Path | None, typer.Option(help="a folder to write the checkpoint to after the steps")] = None,
    trace_steps: Annotated[int, typer.Option(min=0, help="steps after the timed ones traced on the GPU: the "
                                             "exposed share of communication")] = 0,
    shard_one: Annotated[bool, typer.Option(help="FSDP2 at parallel.fsdp=1 too: one rank in FSDP2's precision "
                                            "regime (its MixedPrecisionPolicy), the baseline FSDP2 runs are "
                                            "read against")] = False,
    compile_mode: Annotated[str | None, typer.Option(help="each block compiled in this torch.compile mode "
                                                     f"({', '.join(COMPILE_MODES)}); unset: eager")] = None,
) -> None:
    """Train ``--model`` for ``--steps`` in params.yaml's ``parallel`` layout."""
    console = Console(stderr=True, soft_wrap=True)  # each rank's lines whole in a launcher's log
    try:  # every check before a process group starts: a bad layout stops each process alike, at once
        cfg_all = load_run_params(params, set_)
        if model not in cfg_all.models:
            raise ConfigError(f"--model {model!r} is not a preset of models; allowed: {', '.join(cfg_all.models)}")
        layout, cfg = cfg_all.parallel, cfg_all.models[model]
        if "MASTER_ADDR" not in os.environ:  # torchrun sets it, with RANK and WORLD_SIZE
            raise ConfigError("no torchrun environment: start it as torchrun --standalone --nproc-per-node "
                              f"{layout.world_size} -m adaattn.distributed.train ... (docs/distributed.md)")
        check_layout(layout, cfg, model)
        shares = layout.dp * layout.fsdp
        if batch_size % shares:
            raise ConfigError(f"--batch {batch_size} must divide among the {shares} data-parallel ranks "
                              f"(parallel.dp x parallel.fsdp)")
        if (batch_size // shares) % micro_batches:
            raise ConfigError(f"--micro-batches {micro_batches} must divide each rank's {batch_size // shares} "
                              f"sequences a step (--batch {batch_size} over {shares} data-parallel ranks)")
        if seq_len > cfg.max_seq_len:
            raise ConfigError(f"--seq-len {seq_len} is over models.{model}.max_seq_len={cfg.max_seq_len}")
        if compile_mode is not None and compile_mode not in COMPILE_MODES:
            raise ConfigError(f"--compile-mode {compile_mode!r}; allowed: {', '.join(COMPILE_MODES)} (unset: eager)")
        if micro_batches > 1 and records_graphs(compile_mode) and (layout.fsdp > 1 or layout.tp > 1 or shard_one):
            # the Trainer accumulates under CUDA graphs into gradients it allocated first (one GPU, DDP); FSDP2's
            # sharded gradients and tensor parallelism's are untried under them (notebook, 2026-12-01)
            raise ConfigError(f"--compile-mode {compile_mode} records CUDA graphs, with --micro-batches "
                              f"{micro_batches} run on one GPU or DDP only (parallel.fsdp={layout.fsdp}, "
                              f"parallel.tp={layout.tp}{', --shard-one' if shard_one else ''}); allowed here: "
                              f"{', '.join(m for m in COMPILE_MODES if not records_graphs(m))}")
        if dtype not in ("bf16", "fp16", "fp32"):
            raise ConfigError(f"--dtype {dtype!r}; allowed: bf16, fp16, fp32")
        if layout.tp > 1 and (load is not None or save is not None):
            raise ConfigError(f"--save / --load with parallel.tp={layout.tp}: a tensor-parallel model's fused "
                              "projections are reordered by rank (distributed.parallel.tensor_parallel), so its "
                              "checkpoint would not load as the unsharded model; checkpoints run with tp=1")
        if load is not None and not (load / ".metadata").is_file():
            raise ConfigError(f"--load {load}: not a checkpoint folder (no .metadata; --save writes one)")
        if shard_one and (layout.fsdp > 1 or layout.dp > 1 or layout.tp > 1):
            raise ConfigError("--shard-one is FSDP2 on one rank (parallel.world_size=1); with more ranks set "
                              "parallel.fsdp instead")
        if dtype == "fp16" and (layout.fsdp > 1 or shard_one):
            raise ConfigError("--dtype fp16 with parallel.fsdp > 1: the trainer's GradScaler does not reduce "
                              "across shards; allowed with fsdp: bf16, fp32")
    except ConfigError as err:
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(2) from None

    from adaattn.models.transformer import build_model
    from adaattn.models.data import batch, load_corpus
    from adaattn.models.train import Trainer, param_groups

    mesh, finished = init_mesh(layout), False
    try:
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device("cpu")
        torch.manual_seed(seed)
        base = build_model(cfg, device=device)
        net = parallelize(base, layout, mesh, shard_one=shard_one, compile_mode=compile_mode)
        optimizer = torch.optim.AdamW(param_groups(net, 0.1), lr=lr, betas=(0.9, 0.95),
                                      fused=device.type == "cuda")
        trainer = Trainer(net, optimizer, dtype=dtype, tf32=True if device.type == "cuda" else None)
        share = mesh.get_local_rank("dp") * layout.fsdp + mesh.get_local_rank("fsdp")
        per_rank = batch_size // shares
        corpus, g = load_corpus(), torch.Generator().manual_seed(seed)
        done, loaded = 0, None
        if load is not None:
            done = restore(load, net, optimizer)
            loaded = weights_digest(net)
            for _ in range(done):  # the batches the saved run took: a resumed run goes on where it stopped
                batch(corpus.train, batch_size, seq_len, g)
        losses, norms, start = [], [], None
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for step in range(warmup + steps):
            if step == warmup:
                sync()
                start = time.perf_counter()
            tokens = batch(corpus.train, batch_size, seq_len, g)[share * per_rank:(share + 1) * per_rank]
            done_step = trainer.train_step(tokens, micro_batches=micro_batches)
            loss = done_step["loss"]
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the whole batch's mean: equal shares
            losses.append(loss)
            norms.append(done_step["grad_norm"])  # the same on every rank: the reduced gradients' norm, before clipping
        sync()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
        # a tensor-parallel group trains on one share together: each of its ranks is credited its part of it
        stats = gather_stats(RankStats(dist.get_rank(), steps * per_rank * seq_len / layout.tp, seconds, peak))
        comm = None
        if trace_steps and device.type == "cuda":
            # after the timed steps, so the profiler costs them nothing; every rank traces its own GPU
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(trace_steps):
                    tokens = batch(corpus.train, batch_size, seq_len, g)[share * per_rank:(share + 1) * per_rank]
                    trainer.train_step(tokens, micro_batches=micro_batches)
                sync()
            kernels = [(e.name(), e.start_ns(), e.duration_ns()) for e in prof.profiler.kineto_results.events()
                       if e.device_type() == torch.autograd.DeviceType.CUDA]
            comm = [None] * dist.get_world_size()
            dist.all_gather_object(comm, {**exposed_communication(kernels), "steps": trace_steps,
                                          "collectives": collective_kernels(kernels)})
            # waiting for the other ranks, or for the wire: the ranks' collectives side by side (issue 67)
            skew = collective_skew([r.pop("collectives") for r in comm])
            comm = [{**r, **({} if skew is None else {f"skew_{k}": v for k, v in skew.items()})} for r in comm]
        digest = weights_digest(net)
        if save is not None:
            checkpoint(save, net, optimizer, done + warmup + steps + (trace_steps if comm else 0))
        if dist.get_rank() == 0:
            compiled = sum(getattr(b, "_compiled_call_impl", None) is not None for b in base.blocks)
            run = {"model": model, "layout": layout.model_dump(), "compile_mode": compile_mode,
                   "compiled_blocks": compiled, "steps": steps, "warmup": warmup,
                   "batch": batch_size, "micro_batches": micro_batches, "seq_len": seq_len, "dtype": dtype,
                   "device": device.type,
                   "losses": [float(x) for x in losses], "grad_norms": [float(x) for x in norms], "weights": digest,
                   "resumed_at": done,
                   "loaded_weights": loaded, "trace": comm, **stats}
            console.print(f"{model} {layout.model_dump()}: {stats['tokens_per_s']:.0f} tokens/s "
                          f"({stats['tokens_per_s_per_rank']:.0f} a rank), peak {stats['peak_mib_max']:.0f} MiB")
            write_run(out, run)
        finished = True
    finally:
        end_process_group(finished)


if __name__ == "__main__":
    app()
