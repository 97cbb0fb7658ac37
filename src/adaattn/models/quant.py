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

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        w = self.quant_weight()
        if use_triton(x2, self.weight) and x2.shape[0] <= 64 and not x2.requires_grad:  # decode: the packed bytes
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
                setattr(module, child_name, new)
    return model


def quantize_int8_weight_only(model: nn.Module, dtype: torch.dtype | None = None, skip: tuple[str, ...] = ("head",),
                              ) -> nn.Module:
    """``quantize_weight_only(model, bits=8)``."""
    return quantize_weight_only(model, 8, dtype=dtype, skip=skip)
