"""INT8 weight-only quantization for inference (gpt-fast's scheme): each linear layer's weight stored as int8 with
one symmetric scale per output channel, dequantized inside the matmul. Decoding at small batch reads the
weights once per token, so halving their bytes is what speeds it up, if the matmul reads the int8 bytes
themselves: ``adaattn.kernels.int8_linear``'s Triton kernels do, eager and compiled (``docs/models.md``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from adaattn.kernels import int8_linear


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

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


def quantize_int8_weight_only(model: nn.Module, dtype: torch.dtype | None = None, skip: tuple[str, ...] = ("head",),
                              ) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` in place (names in ``skip`` kept: a tied LM head shares the
    embedding's weight, which a lookup reads in full precision) and return it. Inference only: the int8
    weights take no gradient."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.memory_slots is not None:
        raise ValueError("memory_slots: an LTM layer reads its banks through its k and v weights directly; "
                         "INT8 weight-only quantization of an LTM model is not built")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and full not in skip:
                setattr(module, child_name, Int8WeightOnlyLinear.from_linear(child, dtype))
    return model
