"""All-reduce bus bandwidth over the ranks torchrun started (NCCL on GPUs, gloo on CPUs), nccl-tests' convention:

    torchrun --standalone --nproc-per-node 2 -m adaattn.distributed.allreduce --mib 64 --mib 256 --out ar.json

Per size: ``warmup`` untimed all-reduces (sum, bf16 on GPUs, fp32 on CPUs), then ``iters`` timed back to back
between two barriers; the slowest rank's time per call sets the algorithm bandwidth (bytes / time), and the bus
bandwidth is that times 2 (n - 1) / n: the bytes each rank's link carries in a ring all-reduce, comparable
across world sizes and with a link's own rate. The ceiling for a data-parallel step's gradient traffic.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import typer

from adaattn.distributed.layout import Layout
from adaattn.distributed.parallel import end_process_group, init_mesh, write_run

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def bus_factor(world_size: int) -> float:
    """A ring all-reduce moves 2 (n - 1) / n of the buffer over each rank's link."""
    return 2 * (world_size - 1) / world_size


def measure(mib: float, warmup: int, iters: int, device: torch.device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    numel = max(1, int(mib * 2**20) // dtype.itemsize)
    buf = torch.ones(numel, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        dist.all_reduce(buf)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    sync()
    mine = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's
    seconds = float(mine)
    nbytes = numel * dtype.itemsize
    algbw = nbytes / seconds / 1e9
    return {"mib": nbytes / 2**20, "dtype": str(dtype).removeprefix("torch."), "us": seconds * 1e6,
            "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(dist.get_world_size())}


@app.command()
def main(
    mib: Annotated[list[float], typer.Option(help="buffer sizes in MiB (repeat the option)")],
    warmup: Annotated[int, typer.Option(min=0)] = 5,
    iters: Annotated[int, typer.Option(min=1)] = 20,
    out: Annotated[Path | None, typer.Option(help="JSON of the sizes' results (rank 0 writes it)")] = None,
) -> None:
    if "MASTER_ADDR" not in os.environ:
        typer.echo("error: no torchrun environment: start it as torchrun --standalone --nproc-per-node N "
                   "-m adaattn.distributed.allreduce ...", err=True)
        raise typer.Exit(2)
    if any(m <= 0 for m in mib):
        typer.echo(f"error: --mib must be > 0; got {mib}", err=True)
        raise typer.Exit(2)
    world_size = int(os.environ["WORLD_SIZE"])
    mesh, finished = init_mesh(Layout(world_size=world_size, dp=world_size)), False  # multicast off, NCCL or gloo
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    try:
        sizes = [measure(m, warmup, iters, device) for m in mib]
        if dist.get_rank() == 0:
            # the default group may serve both devices ("undefined" to get_backend): named by the buffers' device
            run = {"world_size": dist.get_world_size(), "backend": "nccl" if device.type == "cuda" else "gloo",
                   "sizes": sizes}
            for s in sizes:
                typer.echo(f"all-reduce {s['mib']:.0f} MiB x{run['world_size']}: {s['us']:.0f} us, "
                           f"bus {s['busbw_gbps']:.1f} GB/s", err=True)
            write_run(out, run)
        finished = True
    finally:
        end_process_group(finished)


if __name__ == "__main__":
    app()
