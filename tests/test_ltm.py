"""Guide 003's LTM transformer on the CPU: the memory bank's write and read invariants (slot counts, FIFO and
merged compression, the compressor's shapes, the statistics), a layer's attention over its bank against a
reference by hand, a stream of calls equal to one call (the segment recurrence), causality across segments,
checkpointing's gradients, a few training steps, and bad configs named."""

from __future__ import annotations

import math

import pytest
import torch

from adaattn.models.config import ModelConfig
from adaattn.models.transformer import Transformer
from adaattn.models.ltm import Compressor, write

# PyTorch's MLP and norm keep the tests fast (the zoo's kernels run interpreted under TRITON_INTERPRET)
BASE = {"vocab_size": 53, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64,
        "mlp": "gelu", "norm": "layernorm", "memory_slots": 6, "segment_len": 8, "memory_compression": 4}


def _ltm(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**BASE, **kw}))


def _tokens(b: int = 2, s: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (b, s), generator=torch.Generator().manual_seed(seed))


def test_a_bank_fills_then_merges_or_evicts_its_oldest_slots():
    bank = fifo = torch.zeros(1, 0, 2)
    for i in range(3):  # three writes of two slots into a bank of four
        new = torch.tensor([[[2.0 * i, 0.0], [2.0 * i + 1, 0.0]]])
        fifo = write(fifo, new, capacity=4, merge=False)
        bank = write(bank, new, capacity=4, merge=True)
    assert fifo[0, :, 0].tolist() == [2.0, 3.0, 4.0, 5.0]  # the oldest two dropped
    # merged: the oldest four (0, 1, 2, 3) became two (0.5, 2.5), the newest kept
    assert bank[0, :, 0].tolist() == [0.5, 2.5, 4.0, 5.0]


def test_the_compressor_pools_then_projects_from_the_identity():
    c = Compressor(4, rate=3)
    c.reset_parameters()
    x = torch.randn(2, 7, 4)  # the last token, a partial group, writes no slot
    out = c(x)
    assert out.shape == (2, 2, 4)
    torch.testing.assert_close(out, x[:, :6].reshape(2, 2, 3, 4).mean(2))


def test_slots_and_statistics_follow_the_segments():
    model = _ltm()
    model(_tokens(s=16))  # two segments of 8: 2 slots each
    stats = model.get_memory_stats()
    assert stats["filled"] == [4, 4] and stats["capacity"] == 6 and stats["utilization"] == pytest.approx(4 / 6)
    model(_tokens(s=40))  # five segments: 10 slots into 6, merged
    assert model.get_memory_stats()["filled"] == [6, 6]
    assert model.reduce_memory_slots() == 3  # half
    assert model.reduce_memory_slots(1) == 2  # never below one segment's slots (8 / 4)
    model(_tokens(s=40))
    assert model.get_memory_stats()["filled"] == [2, 2]


def test_a_layer_attends_over_its_bank_as_a_reference_says():
    """softmax(q [k_bank; k]^T / sqrt(D) + mask) [v_bank; v], every slot visible, the segment causal."""
    model = _ltm(positions="learned", n_kv_heads=4)
    attn = model.blocks[0].attn
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 3, 32)
    got = attn(x, None, memory)
    H, D = 4, 8
    w = attn.qkv.weight
    q = (x @ w[:32].T).view(2, 5, H, D).transpose(1, 2)
    k = torch.cat([memory @ w[32:64].T, x @ w[32:64].T], dim=1).view(2, 8, H, D).transpose(1, 2)
    v = torch.cat([memory @ w[64:].T, x @ w[64:].T], dim=1).view(2, 8, H, D).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    mask = torch.ones(5, 8, dtype=torch.bool)
    mask[:, 3:] = torch.ones(5, 5, dtype=torch.bool).tril()
    heads = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    want = heads.transpose(1, 2).reshape(2, 5, 32) @ attn.out.weight.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("update", [{}, {"memory_merge": False}, {"positions": "qk_norm_rope"}])
@torch.no_grad()
def test_a_stream_of_calls_is_one_call(update):
    model = _ltm(**update).eval()
    tokens = _tokens(s=40)
    whole = model(tokens)
    banks, parts = None, []
    for start in (0, 16, 24):  # calls of 2, 1 and 2 segments
        end = {0: 16, 16: 24, 24: 40}[start]
        logits, banks = model(tokens[:, start:end], memory=banks, return_memory=True)
        parts.append(logits)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-5, atol=1e-5)
    # the bank is read: the last segment alone, without it, predicts otherwise
    assert not torch.allclose(model(tokens[:, 32:]), whole[:, 32:], atol=1e-3)


@torch.no_grad()
def test_the_model_is_causal_across_segments():
    model = _ltm().eval()
    tokens = _tokens(s=32)
    later = tokens.clone()
    later[:, 19:] = (later[:, 19:] + 1) % BASE["vocab_size"]
    a, b = model(tokens), model(later)
    torch.testing.assert_close(a[:, :19], b[:, :19])
    assert not torch.allclose(a[:, 19:], b[:, 19:])


def test_checkpointing_gives_the_gradients_of_none():
    tokens = _tokens(s=24)
    grads = {}
    for gran in ("none", "full"):
        model = _ltm()
        model.set_checkpointing(gran)
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        grads[gran] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["none"].keys() == grads["full"].keys()
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_few_steps_lower_the_loss():
    from adaattn.models.train import create_optimized_training_setup

    torch.manual_seed(0)
    _, _, trainer = create_optimized_training_setup(ModelConfig(**BASE), lr=3e-3, compile_mode=None, dtype="fp32",
                                                    device="cpu")
    batch = _tokens(s=33)
    losses = [float(trainer.train_step(batch)["loss"]) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("update, message", [
    ({"attention": "naive"}, "memory_slots \\(LTM\\) is a dense causal decoder's with attention 'sdpa'"),
    ({"memory_compression": 3}, "memory_compression=3 must divide segment_len=8"),
    ({"memory_slots": 1}, "memory_slots=1 must hold one segment's slots: at least segment_len / memory_compression"),
    ({"positions": "learned", "max_seq_len": 4}, "segment_len=8 is over max_seq_len=4"),
    ({"attention_window": 4}, "attention_window is a dense causal decoder's with attention 'sdpa' and no memory"),
])
def test_bad_ltm_configs_name_the_key(update, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**BASE, **update})


def test_the_card_counts_the_banks_flops_and_memory():
    from adaattn.models.card import counted_flops_per_token, estimate_memory, flops_per_token, param_counts

    cfg = ModelConfig(**{**BASE, "positions": "rope"})
    model = Transformer(cfg)
    params = param_counts(model)
    formula, counted = flops_per_token(cfg, params, 40), counted_flops_per_token(model, 40)
    assert counted["train"] == pytest.approx(formula["train"], rel=0.02)
    # by hand, one sequence of 20 tokens: segments of 8, 8, 4 read 0, 2 and 4 slots (8 / 4 written each)
    dense = ModelConfig(**{**BASE, "memory_slots": None})
    extra = estimate_memory(cfg, params, 1, 20, "bf16")["activations"] - \
        estimate_memory(dense, params, 1, 20, "bf16")["activations"]
    E, H, G, D = 32, 4, 2, 8
    per_layer = sum(n * (E * 4 + E * 2 + 2 * G * D * 2) + (n + s) * 2 * H * D * 2 + (s // 4) * (E * 4 + E * 2)
                    for n, s in ((0, 8), (2, 8), (4, 4)))
    assert extra == 2 * per_layer


@pytest.fixture
def pytorch_rotary():
    """The rotary embedding in PyTorch: the fused kernel runs interpreted under the tests' TRITON_INTERPRET, tens of
    seconds over a decode loop (the kernel has tests of its own)."""
    from adaattn.kernels.runtime import set_use_triton_kernels

    set_use_triton_kernels(False)
    yield
    set_use_triton_kernels(True)


@torch.no_grad()
@pytest.mark.parametrize("kw", [{}, {"positions": "learned"}, {"positions": "qk_norm_rope", "memory_merge": False}])
def test_decoding_with_segment_caches_equals_reading_the_whole_prefix(kw, pytorch_rotary):
    """Prefill across segments (a partial one last), then one token at a time over several segment ends and a full
    bank (merges or evictions): every step's logits are the whole prefix's last ones, greedy tokens alike; the
    state stays the same size whatever the context."""
    from adaattn.models.generate import generate, prefill, setup_kv_cache

    model = _ltm(**kw).eval()
    full = _ltm(**kw).eval()  # the same weights, without caches: the whole prefix each time
    seq = _tokens(2, 44, seed=1)
    setup_kv_cache(model, batch=2)
    logits = prefill(model, seq[:, :13])
    torch.testing.assert_close(logits, full(seq[:, :13])[:, -1], atol=1e-5, rtol=1e-5)
    sizes = []
    for t in range(13, 44):  # 13..43: segment ends at 16, 24, 32, 40; the bank (6 slots) fills at the second
        logits = model(seq[:, t:t + 1], input_pos=torch.tensor([t]))[:, -1]
        torch.testing.assert_close(logits, full(seq[:, :t + 1])[:, -1], atol=1e-5, rtol=1e-5)
        sizes.append(sum(b.attn.cache.state_bytes() for b in model.blocks))
    assert len(set(sizes[-12:])) == 1  # once the bank is full the state no longer grows
    assert model.get_memory_stats()["filled"] == [6, 6]
    setup_kv_cache(model, batch=2)
    out = generate(model, seq[:, :13], 20)
    expect = seq[:, :13]
    for _ in range(20):  # greedy by recomputing everything
        expect = torch.cat([expect, full(expect)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, expect)


@torch.no_grad()
def test_ltm_decoding_goes_in_order():
    from adaattn.models.generate import prefill, setup_kv_cache

    model = _ltm().eval()
    setup_kv_cache(model, batch=2)
    prefill(model, _tokens(2, 5))
    with pytest.raises(ValueError, match="input_pos must continue from the 5 tokens read so far"):
        model(_tokens(2, 1), input_pos=torch.tensor([7]))


@torch.no_grad()
def test_a_compiled_ltm_step_is_one_graph_whatever_the_position(pytorch_rotary):
    """A compiled one-token step over segment ends and a full bank: the eager step's logits every token, and the
    graphs dynamo made by the second token are all it makes (the bank is written outside the graph, its buffers
    at capacity from the start)."""
    from torch._dynamo.testing import CompileCounter

    from adaattn.models.generate import decode_one, prefill, setup_kv_cache

    torch._dynamo.reset()
    model, twin = _ltm().eval(), _ltm().eval()
    seq = _tokens(2, 44, seed=3)
    for m in (model, twin):
        setup_kv_cache(m, batch=2)
        prefill(m, seq[:, :13])
    counter = CompileCounter()
    step = torch.compile(decode_one, backend=counter)
    graphs = []
    for t in range(13, 44):  # segment ends at 16, 24, 32, 40; the bank (6 slots) full from the second
        pos = torch.tensor([t])
        torch.testing.assert_close(step(model, seq[:, t:t + 1], pos), decode_one(twin, seq[:, t:t + 1], pos),
                                   atol=1e-5, rtol=1e-5)
        graphs.append(counter.frame_count)
    assert graphs[1] == graphs[-1]
    assert model.get_memory_stats()["filled"] == [6, 6]
    torch._dynamo.reset()
