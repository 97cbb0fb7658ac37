"""A layout (``config.Layout``) made real: its checks before any process group starts, the device mesh, and a
model wrapped for it (DDP, FSDP2 or HSDP); per-rank throughput and memory, gathered.

Processes come from torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE; one process a GPU (NCCL), or CPU
processes over gloo. NVLink multicast is forced off in every process before NCCL loads: on the shared
multi-GPU machines a program that uses it can put the host's GPUs out of service.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from adaattn.config import ConfigError, Layout
from adaattn.models.config import ModelConfig
from adaattn.models.train import DTYPES

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MESH_DIMS = ("dp", "fsdp", "tp")


def multicast_off(env: dict | None = None) -> None:
    """Set the three switches in ``env`` (default: this process's environment), overriding any value: a run
    never turns multicast on, whatever its caller's environment says."""
    env = os.environ if env is None else env
    env.update(MULTICAST_OFF)


def check_layout(layout: Layout, cfg: ModelConfig, model: str = "model",
                 world_size: int | None = None) -> None:
    """Refuse a layout this model or launch cannot run, naming the key, before any process group starts.
    ``world_size``: the processes torchrun started (default: its WORLD_SIZE, 1 without torchrun)."""
    started = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if started != layout.world_size:
        raise ConfigError(f"parallel.world_size={layout.world_size} but {started} process"
                          f"{'es were' if started != 1 else ' was'} started: launch with torchrun "
                          f"--nproc-per-node {layout.world_size} (times the nodes), or set parallel.world_size="
                          f"{started}")
    if layout.tp > 1:
        raise ConfigError(f"parallel.tp={layout.tp}: tensor parallelism is not built yet; allowed: 1")
    if cfg.kind != "decoder" and layout.world_size > 1:
        raise ConfigError(f"models.{model}.kind={cfg.kind!r}: distributed training runs decoders; allowed: decoder")
    if cfg.attention == "ada" and layout.fsdp > 1:
        raise ConfigError(f"models.{model}.attention='ada' with parallel.fsdp={layout.fsdp}: AdaAttention under FSDP "
                          "is not tested yet; allowed attention with fsdp > 1: sdpa, ccgqa, flexible, naive")


def init_mesh(layout: Layout) -> DeviceMesh:
    """The process group (NCCL on GPUs, gloo on CPUs; torchrun's environment) and a (dp, fsdp, tp) mesh over it.
    Each process takes the GPU of its LOCAL_RANK."""
    multicast_off()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = "cuda"
    else:
        device = "cpu"
    return init_device_mesh(device, (layout.dp, layout.fsdp, layout.tp), mesh_dim_names=MESH_DIMS)


def parallelize(model: nn.Module, layout: Layout, mesh: DeviceMesh) -> nn.Module:
    """``model`` (on this rank's device, the same weights on every rank) wrapped for ``layout``: FSDP2 where
    ``fsdp`` > 1 (each block its own unit, so one block's parameters are gathered at a time, then the rest at the
    root; over a (dp, fsdp) mesh where dp > 1 too: HSDP), else DDP where ``dp`` > 1, else itself."""
    if layout.fsdp > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        shard_mesh = mesh["dp", "fsdp"] if layout.dp > 1 else mesh["fsdp"]
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[layout.param_dtype],
                                      reduce_dtype=DTYPES[layout.reduce_dtype])
        for block in model.blocks:
            # a Mixture-of-Depths router scores tokens before its block runs (outside the block's forward,
            # where FSDP gathers the block's parameters): a unit of its own
            for part in (getattr(block, "router", None), block):
                if part is not None:
                    fully_shard(part, mesh=shard_mesh, mp_policy=policy,
                                reshard_after_forward=layout.reshard_after_forward)
        # the root's own parameters (embeddings, final norm, head) are used last in the forward, first in the
        # backward: kept gathered between the two
        return fully_shard(model, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=False)
    if layout.dp > 1:
        from torch.nn.parallel import DistributedDataParallel

        local = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
        return DistributedDataParallel(model, device_ids=local, process_group=mesh["dp"].get_group())
    return model


@dataclass(frozen=True)
class RankStats:
    """One rank's share of a run: tokens it trained on, the seconds they took, its peak memory (MiB)."""
    rank: int
    tokens: int
    seconds: float
    peak_mib: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def gather_stats(mine: RankStats) -> dict:
    """Every rank's stats (on every rank) and their aggregate: the tokens/s of the whole job (all tokens over
    the slowest rank's seconds), per GPU, and the peak memory of the fullest rank."""
    ranks: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, asdict(mine))
    slowest = max(r["seconds"] for r in ranks)
    tokens = sum(r["tokens"] for r in ranks)
    total = tokens / slowest if slowest > 0 else float("nan")
    return {"ranks": ranks, "tokens_per_s": total, "tokens_per_s_per_rank": total / len(ranks),
            "peak_mib_max": max(r["peak_mib"] for r in ranks)}


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def exposed_communication(kernels: list[tuple[str, int, int]]) -> dict[str, float]:
    """From a trace's GPU kernels (name, start ns, duration ns) of some training steps: the time collective kernels
    (NCCL's) ran, the part of it no other kernel ran beside (communication the step waited on: exposed), and the
    span from the first kernel's start to the last one's end; in ms."""
    comm = _merged([(s, s + d) for name, s, d in kernels if "nccl" in name.lower()])
    work = _merged([(s, s + d) for name, s, d in kernels if "nccl" not in name.lower()])
    exposed, j = 0, 0
    for start, end in comm:
        covered = 0
        while j < len(work) and work[j][1] <= start:
            j += 1
        k = j
        while k < len(work) and work[k][0] < end:
            covered += min(end, work[k][1]) - max(start, work[k][0])
            k += 1
        exposed += (end - start) - covered
    span = (max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)) if kernels else 0
    return {"comm_ms": sum(e - s for s, e in comm) / 1e6, "exposed_ms": exposed / 1e6, "span_ms": span / 1e6}
