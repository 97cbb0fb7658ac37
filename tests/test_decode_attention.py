"""The split-K decode attention (kernels/decode_attention.py), interpreted on the CPU: against float64 attention
over the filled positions only, GQA groups, per-sequence lengths, a sliding window, chunks past the filled
positions; the cache's unfilled positions never read; a compiled call through its custom op; bad input named."""

from __future__ import annotations

import pytest
import torch

from adaattn.kernels import get_kernel_status
from adaattn.kernels.decode_attention import (decode_attention, decode_attention_fwd, decode_attention_ref,
                                              num_splits)


def _want(q, k, v, length, window=None):
    """float64 softmax attention of each sequence's query over its positions [length - window, length)."""
    B, H, D = q.shape
    G = k.shape[1]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(length.reshape(-1)[b if length.numel() > 1 else 0])
        lo = 0 if window is None else max(0, n - window)
        for h in range(H):
            kk, vv = k[b, h // (H // G), lo:n].double(), v[b, h // (H // G), lo:n].double()
            p = torch.softmax(kk @ q[b, h].double() * D ** -0.5, dim=0)
            out[b, h] = p @ vv
    return out


# the CPU tests run the kernels interpreted; on a GPU machine the GPU tests at the end run them
_STATUS = get_kernel_status()
_interpreted = pytest.mark.skipif(not (_STATUS["use_triton_kernels"] and _STATUS["interpreter"]),
                                  reason=_STATUS["reason"] or "a GPU machine: the GPU tests run the kernels")


@_interpreted
@pytest.mark.parametrize("B, H, G, D, M, lengths, window", [
    (1, 4, 4, 32, 200, [1], None),  # the first token: one position
    (1, 8, 2, 64, 300, [257], None),  # GQA, a length past several loop steps and chunks
    (3, 4, 1, 16, 130, [5, 130, 64], None),  # MQA, each sequence its own length, one of them the whole cache
    (2, 6, 3, 32, 256, [200], 70),  # a sliding window that starts inside a loop step
])
def test_decode_attention_matches_float64_over_the_filled_positions(B, H, G, D, M, lengths, window):
    torch.manual_seed(0)
    q = torch.randn(B, H, D)
    k, v = torch.randn(B, G, M, D), torch.randn(B, G, M, D)
    length = torch.tensor(lengths)
    want = _want(q, k, v, length, window)
    got = decode_attention(q, k, v, length, window)
    assert torch.equal(got, decode_attention_fwd(q, k, v, length, window))  # the kernels ran
    assert got.shape == (B, H, D) and got.dtype == q.dtype
    assert (got.double() - want).abs().max() < 1e-5
    assert (decode_attention_ref(q, k, v, length, window).double() - want).abs().max() < 1e-5
    # the cache past the filled positions is never read: poison in it changes nothing
    n = min(lengths)
    k[:, :, max(lengths):], v[:, :, max(lengths):] = float("nan"), float("nan")
    if len(lengths) == 1 and n < M:
        assert torch.equal(decode_attention(q, k, v, length, window), got)


def test_the_splits_depend_on_the_cache_shape_alone():
    """The launch is the same every step (a CUDA graph replays it as the cache fills): chunks by shape."""
    cpu = torch.device("cpu")
    assert num_splits(1, 8, 4096, cpu) == num_splits(1, 8, 4096, cpu) >= 1
    assert num_splits(1, 1, 64, cpu) == 1  # never more chunks than loop steps


@_interpreted
@torch.no_grad()
def test_a_compiled_call_runs_the_custom_op_in_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 2, 96, 32), torch.randn(2, 2, 96, 32)
    backend, graphs = CompileCounterWithBackend("aot_eager"), []
    step = torch.compile(decode_attention, backend=lambda gm, ex: graphs.append(gm) or backend(gm, ex),
                         fullgraph=True)
    for n in (10, 11, 96):  # the length is data: one graph for every step
        length = torch.tensor([n, n - 3])
        assert torch.allclose(step(q, k, v, length), decode_attention(q, k, v, length), atol=1e-6)
    assert backend.frame_count == 1
    assert any("adaattn.decode_attention" in str(node.target) for g in graphs for node in g.graph.nodes)


@pytest.mark.parametrize("args, message", [
    (((2, 4, 32), (2, 2, 64, 32), [5, 6, 7]), "length must be an int tensor of 1 or B=2 values"),
    (((2, 4, 32), (2, 3, 64, 32), [5]), "G must divide H=4"),
    (((2, 4, 24), (2, 2, 64, 24), [5]), "head dim 24 must be a power of two"),
    (((2, 4, 32, 1), (2, 2, 64, 32), [5]), r"takes q \(B, H, D\)"),
])
def test_bad_input_is_named(args, message):
    (qs, ks, lengths) = args
    with pytest.raises(ValueError, match=message):
        decode_attention(torch.randn(qs), torch.randn(ks), torch.randn(ks), torch.tensor(lengths))
    with pytest.raises(ValueError, match="length must be an int tensor"):
        decode_attention(torch.randn(1, 2, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16),
                         torch.tensor([1.0]))


@_interpreted
def test_a_bf16_cache_gives_bf16_out_within_its_rounding():
    torch.manual_seed(2)
    q, k, v = (torch.randn(s).bfloat16() for s in ((2, 8, 64), (2, 2, 160, 64), (2, 2, 160, 64)))
    length = torch.tensor([150, 33], dtype=torch.int32)
    got = decode_attention(q, k, v, length)
    assert got.dtype == torch.bfloat16
    assert (got.double() - _want(q, k, v, length)).abs().max() < 2e-2  # one rounding of the output (8 bits)


@pytest.mark.gpu
@pytest.mark.parametrize("B, H, G, D, M, lengths", [(2, 8, 2, 128, 4096, [1000, 4096]), (1, 32, 8, 64, 8192, [7])])
def test_on_the_gpu_bf16_matches_float64(B, H, G, D, M, lengths):
    torch.manual_seed(4)
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((B, H, D), (B, G, M, D), (B, G, M, D)))
    length = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    got = decode_attention(q, k, v, length)
    assert (got.double().cpu() - _want(q.cpu(), k.cpu(), v.cpu(), length.cpu())).abs().max() < 2e-2


@pytest.mark.gpu
def test_on_the_gpu_one_cuda_graph_serves_every_length():
    """Captured once, replayed as the lengths tensor changes in place: the same as an eager call each time."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((1, 8, 64), (1, 2, 2048, 64),
                                                                           (1, 2, 2048, 64)))
    length = torch.tensor([1], device="cuda", dtype=torch.int32)
    decode_attention(q, k, v, length)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, length)
    for n in (1, 63, 64, 65, 2048):
        length.fill_(n)
        graph.replay()
        assert torch.equal(out, decode_attention(q, k, v, length)), n
