"""INT8 weight-only quantization on the CPU: per-channel scales and int8 weights, a layer's error within the
rounding's bound, a tiny model's logits close and its generation running, one byte a weight, the tied head
left alone, an LTM model refused."""

from __future__ import annotations

import torch

from adaattn.models import ModelConfig, Transformer
from adaattn.models.generate import generate, setup_kv_cache
from adaattn.models.quant import Int8WeightOnlyLinear, quantize_int8_weight_only

BASE = {"vocab_size": 61, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32, "mlp": "gelu",
        "norm": "layernorm"}


def test_a_layer_rounds_each_channel_to_127_steps():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 16, bias=True)
    q = Int8WeightOnlyLinear.from_linear(linear)
    assert q.weight.dtype == torch.int8 and q.scale.shape == (16,) and q.weight.abs().max() == 127
    x = torch.randn(5, 48)
    # each weight within half a step of its channel's scale: the output within sum |x| x scale / 2
    bound = x.abs().sum(-1, keepdim=True) * q.scale / 2
    assert ((q(x) - linear(x)).abs() <= bound + 1e-6).all()


@torch.no_grad()
def test_a_quantized_model_stays_close_and_generates():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**BASE)).eval()
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    want = model(tokens)
    quantize_int8_weight_only(model)
    assert not any(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n != "head")
    assert model.head.weight is model.embed.weight  # the tied head kept in full precision
    got = model(tokens)
    assert (got - want).norm() / want.norm() < 0.02
    blocks = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight"))
    dense = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Int8WeightOnlyLinear))
    assert blocks == dense  # one byte a weight
    setup_kv_cache(model, batch=2, max_seq_len=20)
    assert generate(model, tokens, 5).shape == (2, 17)


def test_an_ltm_model_is_refused():
    import pytest

    model = Transformer(ModelConfig(**BASE, memory_slots=4, segment_len=8, memory_compression=4))
    with pytest.raises(ValueError, match="memory_slots"):
        quantize_int8_weight_only(model)
