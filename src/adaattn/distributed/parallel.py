"""A layout (``distributed.layout.Layout``) made real: its checks before any process group starts, the device mesh, and a
model wrapped for it (DDP, FSDP2, HSDP or tensor parallelism); per-rank throughput and memory, gathered.

Processes come from torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE; one process a GPU (NCCL), or CPU
processes over gloo. NVLink multicast is forced off in every process before NCCL loads: on the shared
multi-GPU machines a program that uses it can put the host's GPUs out of service.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from adaattn.distributed.layout import Layout
from adaattn.errors import ConfigError
from adaattn.models.config import ModelConfig
from adaattn.models.train import DTYPES, optimize_model

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
        check_tensor_parallel(layout, cfg, model)
    if cfg.kind != "decoder" and layout.world_size > 1:
        raise ConfigError(f"models.{model}.kind={cfg.kind!r}: distributed training runs decoders; allowed: decoder")
    if cfg.attention == "ada" and layout.fsdp > 1:
        raise ConfigError(f"models.{model}.attention='ada' with parallel.fsdp={layout.fsdp}: AdaAttention under FSDP "
                          "is not tested yet; allowed attention with fsdp > 1: sdpa, ccgqa, flexible, naive")


TP_ATTENTION = ("sdpa", "naive", "flexible")  # the zoo's Attention module: one fused qkv, one output projection


def check_tensor_parallel(layout: Layout, cfg: ModelConfig, model: str = "model") -> None:
    """What ``tensor_parallel`` shards: whole heads (query and kv) and the MLP's hidden units, per rank; beside
    FSDP2 only (a 2-D mesh), not beside DDP."""
    tp, key = layout.tp, f"models.{model}"
    if layout.dp > 1:
        raise ConfigError(f"parallel.tp={tp} with parallel.dp={layout.dp}: tensor parallelism composes with FSDP2 "
                          "(a 2-D mesh: parallel.fsdp shards of tp ranks each), not with DDP or HSDP's replicas; "
                          "allowed with tp > 1: dp=1")
    if cfg.attention not in TP_ATTENTION or cfg.memory_slots is not None or cfg.routed:
        raise ConfigError(f"{key}: tensor parallelism shards the dense Attention (attention one of "
                          f"{', '.join(TP_ATTENTION)}, no memory_slots, no routing); this preset has attention="
                          f"{cfg.attention!r}, memory_slots={cfg.memory_slots}, routed={cfg.routed}")
    for name, count in (("n_heads", cfg.n_heads), ("kv heads", cfg.kv_heads), ("MLP hidden", cfg.hidden)):
        if count % tp:
            raise ConfigError(f"parallel.tp={tp} must divide {key}'s {name} ({count}): each rank computes whole "
                              f"heads and an equal share of the MLP; allowed tp: divisors of {count}")


def _rank_major(weight: Tensor, parts: list[int], tp: int) -> Tensor:
    """A fused projection's rows [a; b; c] reordered [a_0; b_0; c_0; a_1; ...]: tensor parallelism's contiguous
    row shard r then holds rank r's share of every part (its q, k and v heads; its gate and up units)."""
    chunks = [part.chunk(tp, dim=0) for part in weight.split(parts, dim=0)]
    return torch.cat([c[r] for r in range(tp) for c in chunks], dim=0)


def tensor_parallel(model: nn.Module, mesh: DeviceMesh, local: bool = False) -> nn.Module:
    """Megatron's layout: in each block the qkv and MLP input projections column-wise (each rank its heads and
    hidden units; no communication), the output and down projections row-wise (their partial sums all-reduced):
    two all-reduces a block forward, two backward. Fused projections are reordered rank-major first
    (``_rank_major``), so the model's weights under tensor parallelism are a permutation of the unsharded ones:
    its checkpoints are refused (``adaattn.distributed.train``). The embedding, norms and head stay whole on every
    rank.

    Training shards with DTensor (``parallelize_module``), whose autograd places the backward's collectives.
    ``local=True`` (inference only: the shards take no gradient; gpt-fast's way) keeps each rank's shard as a
    plain tensor and all-reduces the row-wise projections' outputs with a functional collective: a compiled
    decode step is then plain tensors and NCCL calls, which CUDA graphs capture whole, with none of DTensor's
    dispatch in eager calls such as the prefill."""
    from adaattn.layers.common import SwiGLUMLP
    from adaattn.models.transformer import Attention

    tp = mesh.size()
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        if not isinstance(attn, Attention):
            raise TypeError(f"tensor parallelism shards the zoo's Attention; this block has {type(attn).__name__}")
        D = attn.cfg.head_dim
        fused = {attn.qkv: [attn.n_heads * D, attn.n_kv_heads * D, attn.n_kv_heads * D]}
        if isinstance(mlp, SwiGLUMLP):
            fused[mlp.gate_up] = [mlp.hidden_dim, mlp.hidden_dim]
        with torch.no_grad():
            for linear, parts in fused.items():
                for p in (linear.weight, linear.bias):
                    if p is not None:
                        p.copy_(_rank_major(p, parts, tp))
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
        if isinstance(mlp, SwiGLUMLP):
            mlp.hidden_dim //= tp
        columns = [attn.qkv, mlp.gate_up if isinstance(mlp, SwiGLUMLP) else mlp.up]
        rows = [attn.out, mlp.down]
        if local:
            _shard_locally(columns, rows, mesh)
        else:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            for linear in columns:
                parallelize_module(linear, mesh, ColwiseParallel())
            for linear in rows:
                parallelize_module(linear, mesh, RowwiseParallel())
    return model


def _shard_locally(columns: list[nn.Linear], rows: list[nn.Linear], mesh: DeviceMesh) -> None:
    """Each rank's shard as a plain parameter; a forward hook sums a row-wise projection's partial outputs."""
    import torch.distributed._functional_collectives as funcol

    tp, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()

    def summed(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        return funcol.all_reduce(out, "sum", group)

    with torch.no_grad():
        for linear in columns:
            linear.weight = nn.Parameter(linear.weight.chunk(tp, dim=0)[rank].clone(), requires_grad=False)
            if linear.bias is not None:
                linear.bias = nn.Parameter(linear.bias.chunk(tp, dim=0)[rank].clone(), requires_grad=False)
        for linear in rows:
            linear.weight = nn.Parameter(linear.weight.chunk(tp, dim=1)[rank].clone(), requires_grad=False)
            if linear.bias is not None:  # every rank adds it before the sum: a 1/tp share each
                linear.bias = nn.Parameter(linear.bias / tp, requires_grad=False)
            linear.register_forward_hook(summed)
    for linear in columns + rows:
        linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]


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


def write_run(out: Path | None, run: dict) -> None:
    """Rank 0's JSON of a run at ``out`` (none: not kept), written beside it and then renamed over it: a run that
    dies while writing leaves the earlier file whole."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(run, indent=1))
    tmp.replace(out)


def end_process_group(finished: bool) -> None:
    """Destroy the process groups; when this rank ``finished`` its run, only once every rank has (a barrier), so no
    rank closes its connections while a peer is still writing its result or mid-collective. A rank that failed
    leaves at once: a barrier would hang it on the peers it broke. A 2-rank FSDP2 run over gloo once aborted at
    exit after writing its result (CI, 2026-11-29; docs/notebook.md): the ranks had left one at a time."""
    try:
        if finished:  # on this process's GPU (init_mesh set it), named, not guessed by NCCL
            dist.barrier(device_ids=[torch.cuda.current_device()] if torch.cuda.is_available() else None)
    finally:
        dist.destroy_process_group()


def parallelize(model: nn.Module, layout: Layout, mesh: DeviceMesh, shard_one: bool = False,
                compile_mode: str | None = None) -> nn.Module:
    """``model`` (on this rank's device, the same weights on every rank) wrapped for ``layout``: FSDP2 where
    ``fsdp`` > 1 (each block its own unit, so one block's parameters are gathered at a time, then the rest at the
    root; over a (dp, fsdp) mesh where dp > 1 too: HSDP), else DDP where ``dp`` > 1. Tensor parallelism where
    ``tp`` > 1 (``tensor_parallel``) comes first: FSDP2 then shards its DTensors over the fsdp dimension too (a
    2-D mesh, torchtitan's order). ``shard_one``: FSDP2 at fsdp = 1 too (one rank: FSDP2's precision regime,
    compute in ``param_dtype`` over fp32 sharded weights, what FSDP2 at N ranks is compared with).
    ``compile_mode``: each block compiled in that mode (``models.train.optimize_model``'s ``blocks`` scope) after
    tensor parallelism and before FSDP2 or DDP wrap it, torchtitan's order; None: eager. An eager step that is
    host-bound runs each rank at its host's pace, and the collectives then wait on the slowest rank."""
    if layout.tp > 1:
        tensor_parallel(model, mesh["tp"])
    if compile_mode is not None:
        optimize_model(model, compile_mode=compile_mode, tf32=False, compile_scope="blocks")
    if layout.fsdp > 1 or shard_one:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        shard_mesh = mesh["dp", "fsdp"] if layout.dp > 1 else mesh["fsdp"]
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[layout.param_dtype],
                                      reduce_dtype=DTYPES[layout.reduce_dtype])
        for block in model.blocks:  # a Mixture-of-Depths block's router runs in its forward: one unit
            fully_shard(block, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=layout.reshard_after_forward)
        # the root's own parameters (embeddings, final norm, head) are used last in the forward, first in the
        # backward: kept gathered between the two
        return fully_shard(model, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=False)
    if layout.dp > 1:  # check_layout refuses DDP beside tensor parallelism
        from torch.nn.parallel import DistributedDataParallel

        local = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
        return DistributedDataParallel(model, device_ids=local, process_group=mesh["dp"].get_group())
    return model


@dataclass(frozen=True)
class RankStats:
    """One rank's share of a run: tokens it trained on, the seconds they took, its peak memory (MiB)."""
    rank: int
    tokens: float
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


def collective_kernels(kernels: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """A trace's collective (NCCL) kernels, (name, start ns, duration ns), in the order they started."""
    return sorted((k for k in kernels if "nccl" in k[0].lower()), key=lambda k: k[1])


def collective_skew(ranks: list[list[tuple[str, int, int]]]) -> dict[str, float] | None:
    """Each rank's collective kernels of the same traced steps (``collective_kernels``), matched across ranks by
    name and order: where a collective's time goes. A collective kernel runs from its launch on a rank until every
    rank has joined and the data has moved, so the rank that joins last runs it for about the transfer alone:
    ``wire_ms`` sums, over the collectives, the shortest duration among the ranks; ``wait_ms`` is the largest
    rank's sum of its durations beyond that (time spent waiting for another rank to arrive); ``skew_ms`` sums the
    spread of the collectives' start times across ranks (hosts clock the events; on one machine they share a
    clock). None where the ranks' collectives do not match (a rank traced others)."""
    if len(ranks) < 2 or any(len(r) != len(ranks[0]) for r in ranks):
        return None
    if any(r[i][0] != ranks[0][i][0] for r in ranks for i in range(len(r))):
        return None
    wire = sum(min(r[i][2] for r in ranks) for i in range(len(ranks[0])))
    wait = max(sum(k[2] for k in r) for r in ranks) - wire
    skew = sum(max(r[i][1] for r in ranks) - min(r[i][1] for r in ranks) for i in range(len(ranks[0])))
    return {"wire_ms": wire / 1e6, "wait_ms": wait / 1e6, "skew_ms": skew / 1e6, "collectives": len(ranks[0])}
