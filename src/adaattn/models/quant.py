"""Weight-only quantization for inference. INT8 (gpt-fast's scheme): each linear layer's weight stored as int8 with
one symmetric scale per output channel, dequantized inside the matmul. INT4: groups of ``group_size`` input
columns, each with a scale and an offset (w = q * scale + offset, q in 0..15: asymmetric, as torchao's and
gpt-fast's INT4 are), two values a byte. Decoding at small batch reads the weights once per token, so fewer
bytes is what speeds it up, if the matmul reads the packed bytes themselves: ``adaattn.kernels.int8_linear``'s
and ``adaattn.kernels.decode_proj``'s Triton kernels do, eager and compiled (``docs/models.md``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from adaattn.kernels import int8_linear
from adaattn.kernels.decode_proj import QuantWeight, norm_linear
from adaattn.kernels.runtime import use_triton

INT4_GROUPS = (32, 64, 128, 256)
# Rows of an INT4 matmul that run PyTorch's own INT4 GEMM (tinygemm, ``aten._weight_int4pack_mm``: what torchao's
# and gpt-fast's INT4 run) where it is packed: past one row our kernel's tensor-core path, which unpacks the codes
# in registers, was several times slower than tinygemm (docs/notebook.md, 2026-11-29). One row stays on our GEMV,
# which the fused decode step shares (tinygemm under the model's own layers was no faster there).
TINYGEMM_ROWS = range(2, 65)
TINYGEMM_K_TILES = 8


def tinygemm_unavailable(device: torch.device | str) -> str | None:
    """Why tinygemm cannot run on ``device`` (None: it can)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None  # its CPU twin (``_weight_int4pack_mm_for_cpu``), a test's stand-in
    if device.type != "cuda" or torch.version.hip is not None:
        return f"tinygemm is NVIDIA CUDA's (and its CPU twin's); not {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"tinygemm needs compute capability 8.0 or newer; this GPU is {torch.cuda.get_device_capability(device)}"
    return None


class Int8WeightOnlyLinear(nn.Module):
    """y = (x @ int8_weight^T) * scale (+ bias): the weight (out, in) int8, the scale (out,) in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype | None = None) -> Int8WeightOnlyLinear:
        """Per output channel: scale = max |w| / 127, the weight rounded to the nearest int8 step."""
        w = linear.weight.detach().float()
        dtype = dtype or linear.weight.dtype
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, w.device)
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q.weight.copy_(torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        q.scale.copy_(scale.to(dtype))
        if linear.bias is not None:
            q.bias.copy_(linear.bias.detach().to(dtype))
        return q

    def forward(self, x: Tensor) -> Tensor:
        return int8_linear(x, self.weight, self.scale, self.bias)

    def quant_weight(self) -> QuantWeight:
        return QuantWeight(self.weight, 8, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


class Int4WeightOnlyLinear(nn.Module):
    """y = x @ W^T (+ bias), W (out, in) stored as 4-bit codes, two a byte (``weight`` (out, in / 2) uint8, the
    even column in the low nibble), with a scale and an offset per group of ``group_size`` columns."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        if group_size not in INT4_GROUPS or in_features % group_size:
            raise ValueError(f"group_size must be one of {INT4_GROUPS} and divide in_features={in_features}; "
                             f"got {group_size}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = (out_features, in_features // group_size)
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.ones(groups, dtype=dtype, device=device))
        self.register_buffer("offset", torch.zeros(groups, dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.tiny_device_type: str | None = None  # where the tinygemm copy was packed: its layout is that device's
        # new codes from a state dict: the copy is packed again from them, never left describing the old ones
        self.register_load_state_dict_post_hook(Int4WeightOnlyLinear._repack)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, dtype: torch.dtype | None = None) -> Int4WeightOnlyLinear:
        """Per group: the 16 codes spread from the group's minimum to its maximum, each weight rounded to the
        nearest."""
        w = linear.weight.detach().float()
        dtype = dtype or linear.weight.dtype
        q = cls(linear.in_features, linear.out_features, group_size, linear.bias is not None, dtype, w.device)
        g = w.view(w.shape[0], -1, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view_as(w)
        q.weight.copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))
        q.scale.copy_(scale.to(dtype))
        q.offset.copy_(lo.to(dtype))
        if linear.bias is not None:
            q.bias.copy_(linear.bias.detach().to(dtype))
        return q

    def quant_weight(self) -> QuantWeight:
        return QuantWeight(self.weight, 4, self.scale, self.offset, self.group_size)

    def tinygemm_fits(self) -> bool:
        """Whether tinygemm takes this weight's shape (its tiles: 8 output rows, 16 x k-tiles input columns)."""
        return self.out_features % 8 == 0 and self.in_features % (TINYGEMM_K_TILES * 16) == 0

    def pack_tinygemm(self) -> Int4WeightOnlyLinear:
        """A copy of the codes in tinygemm's layout beside ours (half a byte a weight more), for the rows in
        ``TINYGEMM_ROWS``. Its form: w = (q - 8) * scale + zero (so zero = offset + 8 * scale), scales and zeros
        (K / group, N, 2); on CUDA the codes packed two a byte with the even column in the high nibble (ours: the
        low), on the CPU twin one code an int32. Buffers not kept in the state dict: the layout is the device's."""
        why = tinygemm_unavailable(self.weight.device)
        if why is not None:
            raise RuntimeError(why)
        if not self.tinygemm_fits():
            raise ValueError(f"tinygemm needs out_features % 8 == 0 and in_features % {TINYGEMM_K_TILES * 16} == 0; "
                             f"got {self.out_features} x {self.in_features}")
        low, high = self.weight & 15, self.weight >> 4
        if self.weight.is_cuda:
            packed = torch._convert_weight_to_int4pack((low << 4 | high).contiguous(), TINYGEMM_K_TILES)
        else:
            codes = torch.stack((low, high), dim=-1).reshape(self.out_features, -1).to(torch.int32)
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        zero = self.offset.float() + 8 * self.scale.float()
        sz = torch.stack((self.scale.float().t(), zero.t()), dim=-1).contiguous().to(torch.bfloat16)
        self.register_buffer("tiny_weight", packed, persistent=False)
        self.register_buffer("tiny_sz", sz, persistent=False)
        self.tiny_device_type = self.weight.device.type
        return self

    def _repack(self, _incompatible_keys) -> None:
        if self.tiny_device_type is not None:
            self.pack_tinygemm()

    def _tinygemm(self, x2: Tensor) -> Tensor | None:
        """x2 @ W^T through tinygemm where it is packed for x2's device and takes x2's rows and dtype; else None."""
        packed, rows = getattr(self, "tiny_weight", None), x2.shape[0]
        # bounds, not ``in``: under torch.compile with a dynamic batch the rows are a SymInt, which a comparison
        # guards on and a range's membership test cannot take. A copy moved by ``.to()`` to another kind of device
        # keeps the layout of the one it was packed on: not used there (``pack_tinygemm()`` again packs for it)
        if packed is None or packed.device != x2.device or x2.device.type != self.tiny_device_type or \
                not TINYGEMM_ROWS.start <= rows < TINYGEMM_ROWS.stop or x2.dtype != torch.bfloat16 or \
                x2.requires_grad:
            return None
        mm = torch.ops.aten._weight_int4pack_mm if x2.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x2.contiguous(), packed, self.group_size, self.tiny_sz)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self._tinygemm(x2)
        if y is None:
            w = self.quant_weight()
            if use_triton(x2, self.weight) and x2.shape[0] <= 64 and not x2.requires_grad:  # decode: packed bytes
                y = norm_linear(x2, None, 1.0, w, x.dtype)
            else:  # prefill is compute-bound: the dense weight once, then the library's matmul
                y = x2 @ w.dense(x.dtype).t()
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weight-only, " \
               f"group_size={self.group_size}"


def quantize_weight_only(model: nn.Module, bits: int = 8, group_size: int = 64, dtype: torch.dtype | None = None,
                         skip: tuple[str, ...] = ("head",)) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` in place by its INT8 (``bits=8``) or INT4 (``bits=4``, groups of
    ``group_size``) weight-only version (names in ``skip`` kept: a tied LM head shares the embedding's weight,
    which a lookup reads in full precision) and return it. Inference only: the codes take no gradient."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8; got {bits!r}")
    if bits == 4 and group_size not in INT4_GROUPS:
        raise ValueError(f"group_size must be one of {INT4_GROUPS}; got {group_size!r}")
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.memory_slots is not None:
        raise ValueError(f"memory_slots: an LTM layer reads its banks through its k and v weights directly; "
                         f"INT{bits} weight-only quantization of an LTM model is not built")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and full not in skip:
                new = Int8WeightOnlyLinear.from_linear(child, dtype) if bits == 8 else \
                    Int4WeightOnlyLinear.from_linear(child, group_size, dtype)
                if bits == 4 and new.weight.is_cuda and tinygemm_unavailable(new.weight.device) is None \
                        and new.tinygemm_fits():
                    new.pack_tinygemm()
                setattr(module, child_name, new)
    return model


def quantize_int8_weight_only(model: nn.Module, dtype: torch.dtype | None = None, skip: tuple[str, ...] = ("head",),
                              ) -> nn.Module:
    """``quantize_weight_only(model, bits=8)``."""
    return quantize_weight_only(model, 8, dtype=dtype, skip=skip)
