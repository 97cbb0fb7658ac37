"""Guide 000's API (G0-C2) on PyTorch itself: ``optimize_model``, ``optimize_for_h200``,
``create_optimized_training_setup`` and ``Trainer.train_step``.

Each function says what it set (``Settings``): a study measures each setting's effect rather than taking
it on trust, and a user can see what a call changed in the process (TF32 and the allocator are global).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from adaattn.models.config import ModelConfig

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Settings:
    """What an optimize call set, and why, in words (``notes``)."""

    tf32: bool = False
    compile_mode: str | None = None
    dtype: str = "fp32"
    device: str = "cpu"
    gpu: str = ""
    memory_fraction: float | None = None
    notes: list[str] = field(default_factory=list)


def _check_mode(compile_mode: str | None) -> None:
    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode {compile_mode!r} is not one of: {', '.join(COMPILE_MODES)}, or None (eager)")


def _check_options(options: dict | None) -> None:
    unknown = sorted(set(options or ()) - set(torch._inductor.config.get_config_copy()))
    if unknown:
        raise ValueError(f"compile_options {unknown} are not inductor options (the names in torch._inductor.config)")


def _compile_kwargs(compile_mode: str, options: dict | None) -> dict:
    """torch.compile's arguments: ``compile_mode`` with inductor ``options`` over it. torch.compile takes a mode or
    options, not both, so with options the mode enters as its own table (``list_mode_options``)."""
    if not options:
        return {"mode": compile_mode}
    return {"options": {**torch._inductor.list_mode_options(compile_mode), **options}}


def _eager_outside_autograd(block: nn.Module) -> None:
    """``block``'s compiled call run as its eager code when autograd is off (evaluation, ``no_grad``).

    The blocks share one graph under CUDA graphs. Outside autograd, graph trees start a new generation when a
    graph already replayed in the current one runs again, which frees its earlier outputs: the next block's
    replay frees the output the block after it reads, and torch raises. Training steps are unaffected (autograd
    keeps the outputs alive); evaluation gives up the graphs, not the result."""
    compiled = block._compiled_call_impl  # what ``nn.Module.compile`` installed

    def call(*args, **kwargs):
        if torch.is_grad_enabled():
            return compiled(*args, **kwargs)
        with torch.compiler.set_stance("force_eager"):
            return compiled(*args, **kwargs)

    block._compiled_call_impl = call


def records_graphs(compile_mode: str | None, options: dict | None = None) -> bool:
    """Whether torch.compile's ``compile_mode`` (with inductor ``options`` over it) records CUDA graphs
    (inductor's ``triton.cudagraphs``); None (eager) records none."""
    if compile_mode is None:
        return False
    return bool({**torch._inductor.list_mode_options(compile_mode), **(options or {})}.get("triton.cudagraphs"))


def _gradients_allocated(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's gradient allocated (zeros) where it has none, so that every micro-batch's backward adds into
    it in place. Otherwise autograd keeps the first micro-batch's gradient as ``.grad`` without a copy; under CUDA
    graphs (``reduce-overhead``) that tensor is the backward graph's output, which the next micro-batch's replay
    overwrites before adding to it: an error (pytorch/pytorch#169545) or a wrong gradient (#96693)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def _check_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def enable_tf32() -> None:
    """fp32 matmuls and convolutions on tensor cores (TF32: 10-bit mantissa inputs, fp32 accumulation)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


@contextlib.contextmanager
def tf32_mode(on: bool | None) -> Iterator[None]:
    """TF32 on or off inside (None: as the process has it), restored after: a step of one configuration next
    to a step of another in the same process."""
    if on is None:
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _check_scope(scope: str, model: nn.Module) -> None:
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope {scope!r} is not one of: {', '.join(COMPILE_SCOPES)}")
    if scope == "blocks" and not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        raise ValueError("compile_scope 'blocks' needs a model with a `blocks` ModuleList (the zoo's Transformer)")


def optimize_model(model: nn.Module, compile_mode: str | None = "default", dtype: str | None = None,
                   tf32: bool = True, compile_scope: str = "model",
                   compile_options: dict | None = None) -> tuple[nn.Module, Settings]:
    """The model with ``dtype`` weights (None: as they are), TF32 on for a CUDA model (a process-wide switch)
    and compiled in ``compile_mode`` (None: eager, the guide's escape hatch). Returns the module to call and
    what was set; the module's parameters are the model's own (compilation wraps, it does not copy).

    ``compile_scope``: ``model`` compiles the whole forward as one graph; ``blocks`` compiles each of the
    model's blocks in place (regional compilation, as torchtitan does): identical blocks share one compiled
    graph, so a deep model compiles in about one block's time, and the embedding, head and loss stay eager.
    ``compile_options``: inductor options over the mode's (torchao's rowwise float8 training trains as it does
    eager only with ``emulate_precision_casts``: pytorch/pytorch#150859). Blocks compiled under CUDA graphs
    (``reduce-overhead``, ``max-autotune``) run their code eagerly outside autograd: see
    ``_eager_outside_autograd``."""
    _check_mode(compile_mode)
    _check_scope(compile_scope, model)
    _check_options(compile_options)
    settings = Settings(compile_mode=compile_mode, device=next(model.parameters()).device.type)
    if dtype is not None:
        model = model.to(_check_dtype(dtype))
        settings.dtype = dtype
    if tf32 and settings.device == "cuda":  # a mode of NVIDIA tensor cores
        enable_tf32()
        settings.tf32 = True
    if compile_mode is not None and compile_scope == "blocks":
        kwargs = _compile_kwargs(compile_mode, compile_options)
        graphs = records_graphs(compile_mode, compile_options)
        for block in model.blocks:
            block.compile(**kwargs)
            if graphs:
                _eager_outside_autograd(block)
    elif compile_mode is not None:
        model = torch.compile(model, **_compile_kwargs(compile_mode, compile_options))
    return model, settings


def optimize_for_h200(model: nn.Module, compile_mode: str | None = "default") -> tuple[nn.Module, Settings]:
    """Guide 000's H200 defaults: TF32, compilation, and 95% of the GPU's memory for this process. The GPU it
    runs on is named in the settings' notes: on another GPU the same defaults are applied and said to be
    applied there (the H100 has the H200's compute and less, slower memory); on a CPU, TF32 and the memory
    fraction do not apply."""
    model, settings = optimize_model(model, compile_mode=compile_mode)
    if torch.cuda.is_available() and settings.device == "cuda":
        settings.gpu = torch.cuda.get_device_name()
        torch.cuda.set_per_process_memory_fraction(0.95)
        settings.memory_fraction = 0.95
        if "H200" not in settings.gpu:
            settings.notes.append(f"H200 defaults applied on {settings.gpu}, not an H200")
    else:
        settings.notes.append("no CUDA device: TF32 and the memory fraction do not apply")
    return model, settings


class Trainer:
    """One training step at a time: autocast to ``dtype`` (weights stay fp32: mixed precision), loss, backward
    (through a GradScaler for fp16, whose range needs it; bf16 does not), gradient clipping, optimizer step.

    ``train_step`` returns the step's metrics as tensors on the device (``loss``, ``grad_norm``) and the
    token count: reading them (``float(...)``) waits for the GPU, so a loop reads them when it logs."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, dtype: str = "bf16",
                 grad_clip: float | None = 1.0, tf32: bool | None = None, compile_loss: bool = False):
        self.model, self.optimizer, self.tf32 = model, optimizer, tf32
        # the default loss compiled: the fp32 cast, log-softmax and gather fused, one read of the B x S x vocab
        # logits instead of an fp32 copy and its log-probabilities written and read again
        self._cross_entropy = torch.compile(_cross_entropy_fp32) if compile_loss else _cross_entropy_fp32
        self.compute_dtype = _check_dtype(dtype)
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None; got {grad_clip}")
        self.grad_clip = grad_clip
        self.device = next(model.parameters()).device
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=dtype == "fp16")
        self.steps = 0

    def train_step(self, batch: Tensor | tuple[Tensor, Tensor],
                   criterion: Callable[[Tensor, Tensor], Tensor] | None = None,
                   micro_batches: int = 1) -> dict[str, Tensor | int]:
        """``batch``: tokens (B, S + 1), whose shifted halves are inputs and targets, or (inputs, targets).
        ``criterion(logits, targets)``: the loss (default: mean cross-entropy over every position).
        ``micro_batches``: the batch split into that many equal parts, each's forward and backward in turn
        (gradient accumulation: one part's activations in memory at a time), one optimizer step; the gradients
        and the loss are the whole batch's mean. Under DDP or FSDP2 the gradients are reduced once, after the
        last part. The parts add into gradients allocated before the first (``_gradients_allocated``: under CUDA
        graphs a gradient taken from the first part's backward would be overwritten by the next)."""
        if isinstance(batch, Tensor) and batch.dim() != 2:
            raise ValueError(f"batch must be tokens (B, S + 1) or (inputs, targets); got shape {tuple(batch.shape)} "
                             f"(one sequence: batch[None])")
        inputs, targets = (batch[:, :-1], batch[:, 1:]) if isinstance(batch, Tensor) else batch
        if not isinstance(micro_batches, int) or micro_batches < 1 or inputs.shape[0] % micro_batches:
            raise ValueError(f"micro_batches={micro_batches!r} must be a positive int dividing the batch "
                             f"({inputs.shape[0]} sequences)")
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        self.model.train()
        if micro_batches > 1:
            _gradients_allocated(self.optimizer)
        losses = []
        for i, (x, y) in enumerate(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches), strict=True)):
            with tf32_mode(self.tf32), _gradient_sync(self.model, i == micro_batches - 1):
                loss, total = self.loss(x, y, criterion)
                self.scaler.scale(total / micro_batches).backward()
            losses.append(loss.detach())
        loss = losses[0] if micro_batches == 1 else torch.stack(losses).mean()
        self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = clip_grad_norm(params, self.grad_clip if self.grad_clip is not None else float("inf"))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"loss": loss.detach(), "grad_norm": norm.detach(), "tokens": targets.numel()}

    def loss(self, inputs: Tensor, targets: Tensor,
             criterion: Callable[[Tensor, Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """(the loss, what the backward takes: the loss and a routed model's auxiliary router loss, weighted), in
        the caller's grad mode and the model's mode. The B x S x vocab logits are not returned: they are not kept
        through the backward, where the loss's gradients peak."""
        logits, aux = self.forward(inputs, return_aux=True)
        loss = criterion(logits.float(), targets) if criterion is not None else self._cross_entropy(logits, targets)
        # a routed model's routers learn, beside the loss, whether a token makes their top k (causal inference)
        return loss, loss if aux is None else loss + _unwrapped(self.model).cfg.router_aux_weight * aux

    def held_bytes(self) -> int:
        """What a step holds between steps: the weights and the optimizer's state."""
        state = [t for st in self.optimizer.state.values() for t in st.values() if isinstance(t, Tensor)]
        return sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *state])

    def forward(self, inputs: Tensor, return_aux: bool = False) -> Tensor | tuple[Tensor, Tensor | None]:
        """The model's logits as a step computes them (autocast, TF32 as the trainer sets them), in the
        caller's grad mode and the model's train / eval mode; with ``return_aux``, also a routed model's
        auxiliary router loss (None for a model without routers)."""
        autocast = self.compute_dtype != torch.float32
        routed = getattr(getattr(_unwrapped(self.model), "cfg", None), "routed", False)
        with tf32_mode(self.tf32), torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
            if not return_aux:
                return self.model(inputs)
            return self.model(inputs, return_aux=True) if routed else (self.model(inputs), None)


def _full(norm: Tensor) -> Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grad_norm(params: list[Tensor], max_norm: float) -> Tensor:
    """``clip_grad_norm_`` where gradients may be DTensors on different meshes and plain tensors (tensor
    parallelism's sharded projections beside its whole norms and embeddings; under FSDP2 too, 1-D and 2-D
    shards), which one norm over them all refuses: each kind's norm apart, the whole norm from them, every
    gradient scaled by it. The whole norm, as a plain tensor."""
    kinds = _by_mesh([p for p in params if p.grad is not None], lambda p: p.grad)
    if len(kinds) < 2:
        return _full(torch.nn.utils.clip_grad_norm_(params, max_norm))
    total = torch.linalg.vector_norm(torch.stack([_full(torch.nn.utils.get_total_norm([p.grad for p in k]))
                                                  for k in kinds]))
    for k in kinds:
        torch.nn.utils.clip_grads_with_norm_(k, max_norm, total)
    return total


def _by_mesh(params: list[Tensor], of: Callable[[Tensor], Tensor] = lambda p: p) -> list[list[Tensor]]:
    """``params`` split by the mesh ``of(p)`` lives on (None: a plain tensor), in first-seen order."""
    kinds: dict[object, list[Tensor]] = {}
    for p in params:
        t = of(p)
        kinds.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(p)
    return list(kinds.values())


def _cross_entropy_fp32(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's groups: weight decay on matrices (linear weights), none on vectors (norms, biases) and on the
    embeddings (nanoGPT's and Llama's choice: decaying a lookup table shrinks rare tokens' rows)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, rest, seen = [], [], set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embeddings else rest).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    # a fused or foreach step refuses DTensors of different meshes, or beside plain tensors, in one list (tensor
    # parallelism has plain norms beside its shards; under FSDP2 too, 1-D shards beside 2-D ones)
    return [part for g in groups for part in ([{**g, "params": k} for k in _by_mesh(g["params"])] or [g])]


def create_optimized_training_setup(model_or_config: nn.Module | ModelConfig | dict, lr: float = 3e-4,
                                    weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                                    compile_mode: str | None = "default", dtype: str = "bf16",
                                    grad_clip: float | None = 1.0, checkpointing: str | None = None,
                                    device: str | torch.device | None = None, fused: bool | None = None,
                                    tf32: bool = True, compile_scope: str = "model", compile_loss: bool = False,
                                    compile_options: dict | None = None) -> tuple[nn.Module, torch.optim.Optimizer, Trainer]:
    """(model, optimizer, trainer): the model built (from a config) or taken, on ``device`` (default: CUDA
    where there is one), checkpointing set where given, TF32 on for its steps (``tf32``), compiled in
    ``compile_mode``; AdamW fused
    into one kernel per step (``fused``: None = on CUDA) over ``param_groups``; a
    ``Trainer`` with autocast to ``dtype`` and gradient clipping. ``compile_scope``, ``compile_options``: as
    ``optimize_model``'s; ``compile_loss``: the trainer's default loss (cross-entropy over fp32 logits) compiled too."""
    from adaattn.models.transformer import build_model

    _check_mode(compile_mode)
    _check_dtype(dtype)
    _check_options(compile_options)
    if compile_scope not in COMPILE_SCOPES:  # before the model is built
        raise ValueError(f"compile_scope {compile_scope!r} is not one of: {', '.join(COMPILE_SCOPES)}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0; got {lr}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model_or_config.to(device) if isinstance(model_or_config, nn.Module) else \
        build_model(model_or_config, device=device)
    if checkpointing is not None:
        if not hasattr(model, "set_checkpointing"):
            raise ValueError("checkpointing needs a model with set_checkpointing (a GradientCheckpointMixin)")
        model.set_checkpointing(checkpointing)
    if fused is None:
        fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, fused=fused)
    # TF32: per step (the trainer's)
    compiled, _ = optimize_model(model, compile_mode=compile_mode, tf32=False, compile_scope=compile_scope,
                                 compile_options=compile_options)
    return compiled, optimizer, Trainer(compiled, optimizer, dtype=dtype, grad_clip=grad_clip,
                                        tf32=tf32 if device.type == "cuda" else None, compile_loss=compile_loss)


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Within it, a backward reduces the gradients across ranks only if ``sync`` (DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync``): an accumulated step reduces once, after its last micro-batch. Under FSDP2
    with ``reshard_after_forward=False``, a step then gathers each unit's parameters once, as DDP's one
    all-reduce, with ZeRO-2's memory."""
    if isinstance(model, DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2's FSDPModule
        model.set_requires_gradient_sync(sync)
        # each unit's gathered parameters kept until the last backward: the next micro-batch's forward gathers
        # nothing (one unsharded copy held through the step, fewer all-gathers: the trade FSDP2's docs name)
        model.set_reshard_after_backward(sync)
        yield
    else:
        yield


def _unwrapped(model: nn.Module) -> nn.Module:
    model = getattr(model, "_orig_mod", model)  # a compiled module's own
    return model.module if isinstance(model, DistributedDataParallel) else model


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    **meta: int | float | str) -> None:
    """The model's config and weights (and the optimizer's state where given), written to a temporary file
    and renamed: a failed save leaves the last checkpoint as it was."""
    model = _unwrapped(model)
    body = {"config": model.cfg.model_dump(), "model": model.state_dict(), "meta": meta}
    if optimizer is not None:
        body["optimizer"] = optimizer.state_dict()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(body, tmp)
    os.replace(tmp, path)


def load_model(path: Path, device: str | torch.device = "cpu") -> nn.Module:
    """A ``Transformer`` rebuilt from a checkpoint's config, its weights loaded (strictly: every key)."""
    from adaattn.models.transformer import Transformer

    body = torch.load(path, map_location=device, weights_only=True)
    with torch.device(device):
        model = Transformer(ModelConfig(**body["config"]))
    model.load_state_dict(body["model"])
    return model
