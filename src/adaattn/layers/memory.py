"""Gradient checkpointing switch for models, and a measured memory footprint of a training step."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


CHECKPOINTING = ("none", "full", "selective", "every_k")


class GradientCheckpointMixin:
    """For an nn.Module whose forward runs its blocks through ``self.run_blocks(blocks, x)``.

    Granularity (``set_checkpointing``): ``none``; ``full``, every block's activations recomputed in the
    backward instead of kept (less activation memory, one more forward per block); ``every_k``, blocks 0, k,
    2k, ... only; ``selective``, only the sub-layer a block runs through ``self.checkpointed(...)`` (the
    zoo's blocks: the attention, whose activations grow with S^2 in a naive block). Checkpointing acts in
    training mode with grad enabled only.
    """

    checkpointing: str = "none"
    checkpoint_every: int = 2

    def set_checkpointing(self, granularity: str, every: int = 2) -> None:
        if granularity not in CHECKPOINTING:
            raise ValueError(f"checkpointing {granularity!r} is not one of: {', '.join(CHECKPOINTING)}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every must be an int >= 1; got {every!r}")
        self.checkpointing, self.checkpoint_every = granularity, every

    def enable_gradient_checkpointing(self, granularity: str = "full", every: int = 2) -> None:
        self.set_checkpointing(granularity, every)

    def disable_gradient_checkpointing(self) -> None:
        self.set_checkpointing("none")

    @property
    def gradient_checkpointing(self) -> bool:
        return self.checkpointing != "none"

    def _active(self) -> bool:
        return getattr(self, "training", False) and torch.is_grad_enabled()

    def run_blocks(self, blocks: Iterable[nn.Module], x: Tensor, *args) -> Tensor:
        for i, block in enumerate(blocks):
            x = self.run_block(block, i, x, *args)
        return x

    def run_block(self, block: nn.Module, index: int, x: Tensor, *args) -> Tensor:
        """``block(x, *args)``, the ``index``-th block the forward runs: recomputed in the backward where the
        granularity says so (``full``: every one; ``every_k``: index 0, k, 2k, ...)."""
        step = self.checkpoint_every if self.checkpointing == "every_k" else 1
        if self._active() and self.checkpointing in ("full", "every_k") and index % step == 0:
            return checkpoint(block, x, *args, use_reentrant=False)
        return block(x, *args)

    def checkpointed(self, fn: Callable[..., Tensor], *args) -> Tensor:
        """``fn(*args)``, recomputed in the backward where the granularity is ``selective``."""
        if self._active() and self.checkpointing == "selective":
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)


def _default_input(model: nn.Module, batch_size: int, seq_len: int, device) -> Tensor:
    if hasattr(model, "vocab_size"):
        return torch.randint(0, model.vocab_size, (batch_size, seq_len), device=device)
    for attr in ("dim", "hidden_size", "d_model"):
        if hasattr(model, attr):
            dtype = next(model.parameters()).dtype
            return torch.randn(batch_size, seq_len, getattr(model, attr), device=device, dtype=dtype)
    raise ValueError("compute_memory_footprint: the model has none of vocab_size, dim, hidden_size, d_model; "
                     "pass make_input=lambda batch_size, seq_len: <input tensor>")


def compute_memory_footprint(model: nn.Module, batch_size: int, seq_len: int,
                             make_input: Callable[[int, int], Tensor] | None = None) -> dict[str, int]:
    """Bytes of a training step: parameters, gradients, AdamW state (2 fp32 per parameter), and the
    activations, measured as the peak allocation of one forward + backward beyond what was held
    before it (CUDA allocator on a GPU, the profiler's allocation events on a CPU)."""
    from adaattn.timing.memory import peak_memory_bytes

    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1; got {batch_size}, {seq_len}")
    params = list(model.parameters())
    device = params[0].device
    x = make_input(batch_size, seq_len) if make_input else _default_input(model, batch_size, seq_len, device)

    def step():
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()

    for p in params:
        p.grad = None
    activations = peak_memory_bytes(step, device.type)
    for p in params:
        p.grad = None
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    optimizer_bytes = sum(2 * p.numel() * 4 for p in params if p.requires_grad)
    # the step's peak includes the gradients it allocates; activations are what is left
    activation_bytes = max(0, activations - grad_bytes)
    return {"parameters": param_bytes, "gradients": grad_bytes, "optimizer": optimizer_bytes,
            "activations": activation_bytes, "total": param_bytes + grad_bytes + optimizer_bytes + activation_bytes}
