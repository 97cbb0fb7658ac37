"""INT8 weight-only quantization on the CPU: per-channel scales and int8 weights, a layer's error within the
rounding's bound, a tiny model's logits close and its generation running, one byte a weight, the tied head
left alone, an LTM model refused."""

from __future__ import annotations

import pytest
import torch

from adaattn.models.config import ModelConfig
from adaattn.models.transformer import Transformer
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


def _int8_problem(rows: int, n_out: int, k_in: int, dtype: torch.dtype, bias: bool):
    g = torch.Generator().manual_seed(rows * 1000 + n_out + k_in)
    q = Int8WeightOnlyLinear.from_linear(torch.nn.Linear(k_in, n_out, bias=bias), dtype)
    q.weight.copy_(torch.randint(-127, 128, (n_out, k_in), generator=g, dtype=torch.int8))
    q.scale.copy_(torch.rand(n_out, generator=g).to(dtype) / 64)
    if bias:
        q.bias.copy_(torch.randn(n_out, generator=g).to(dtype))
    return q, torch.randn(rows, k_in, generator=g).to(dtype)



@pytest.mark.parametrize("rows", [1, 3, 17, 64, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_kernels_match_the_reference(rows, dtype):
    """The GEMV (one row), the tl.dot kernel (2-64 rows, masked tails in every dim) and the reference (more
    rows) against the cast-and-matmul in fp64; interpreted on the CPU."""
    from adaattn.kernels import get_kernel_status, int8_linear

    if not get_kernel_status()["use_triton_kernels"]:
        pytest.skip(get_kernel_status()["reason"])
    for n_out, k_in, bias in ((48, 200, True), (100, 64, False)):
        q, x = _int8_problem(rows, n_out, k_in, dtype, bias)
        got = int8_linear(x, q.weight, q.scale, q.bias)
        want = torch.nn.functional.linear(x.double(), q.weight.double()) * q.scale.double()
        if bias:
            want = want + q.bias.double()
        assert got.dtype == dtype and got.shape == (rows, n_out)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the output (8 bits)
        assert ((got.double() - want).abs() <= tol * want.abs().amax()).all(), (rows, n_out, k_in)


def test_int8_linear_takes_the_reference_where_autograd_records_and_checks_its_arguments():
    from adaattn.kernels import int8_linear

    q, x = _int8_problem(2, 16, 32, torch.float32, True)
    x.requires_grad_(True)
    int8_linear(x, q.weight, q.scale, q.bias).sum().backward()  # the kernel builds no gradient: the reference does
    assert torch.allclose(x.grad, (q.weight.float() * q.scale[:, None]).sum(0))
    with pytest.raises(TypeError, match="int8"):
        int8_linear(x, q.weight.float(), q.scale)
    with pytest.raises(ValueError, match="in_features 32"):
        int8_linear(torch.randn(2, 31), q.weight, q.scale)
    with pytest.raises(ValueError, match="scale must be a float"):
        int8_linear(x, q.weight, q.scale[:8])


@torch.no_grad()
def test_a_compiled_int8_model_calls_the_kernel_op_in_one_graph():
    """Under torch.compile the kernel is the custom op adaattn::int8_linear (fullgraph: no break), and the
    compiled model's logits are the eager one's."""
    from adaattn.kernels import get_kernel_status

    if not get_kernel_status()["use_triton_kernels"]:
        pytest.skip(get_kernel_status()["reason"])
    torch.manual_seed(0)
    model = quantize_int8_weight_only(Transformer(ModelConfig(**BASE)).eval())
    tokens = torch.randint(0, 61, (1, 1))
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("aot_eager")
    graphs = []
    compiled = torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or backend(gm, ex), fullgraph=True)
    assert torch.allclose(compiled(tokens), model(tokens), atol=1e-5)
    assert any("adaattn.int8_linear" in str(n.target) for g in graphs for n in g.graph.nodes)
