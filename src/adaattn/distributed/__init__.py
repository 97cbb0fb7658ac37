"""Past one GPU, on the engine PyTorch has: torch.distributed launched by torchrun (one process a GPU, NCCL;
gloo on CPUs), a device mesh, DDP, FSDP2 (``fully_shard``) and tensor parallelism (DTensor): ``parallel``
lays a model over a ``layout.Layout``; ``train`` and ``decode`` are the torchrun entry points.
``docs/distributed.md`` has the commands."""
