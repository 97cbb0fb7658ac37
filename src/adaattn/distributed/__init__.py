"""Past one GPU, on the engine PyTorch has: torch.distributed launched by torchrun (one process a GPU, NCCL;
gloo on CPUs), a device mesh, DDP, FSDP2 (``fully_shard``) and tensor parallelism (DTensor).
``docs/distributed.md`` has the commands."""

from adaattn.distributed.parallel import (
    MULTICAST_OFF,
    RankStats,
    check_layout,
    gather_stats,
    init_mesh,
    multicast_off,
    parallelize,
    tensor_parallel,
)

__all__ = ["MULTICAST_OFF", "RankStats", "check_layout", "gather_stats", "init_mesh", "multicast_off",
           "parallelize", "tensor_parallel"]
