"""KV-cache inference on the CPU: prefill gives the full forward's logits, greedy generation with the cache gives
the tokens of recomputing the whole sequence at every step (rotary, GQA, learned positions, QK-norm), the decode
step compiles with fullgraph and agrees, and what cannot decode says so."""

from __future__ import annotations

import pytest
import torch

from adaattn.models.config import ModelConfig
from adaattn.models.transformer import Transformer
from adaattn.models.generate import clear_kv_cache, decode_next, decode_one, generate, setup_kv_cache

# PyTorch's MLP and norm keep the tests fast (the zoo's kernels run interpreted under TRITON_INTERPRET)
BASE = {"vocab_size": 61, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 24, "mlp": "gelu",
        "norm": "layernorm", "positions": "rope"}
VARIANTS = {"rope_gqa": {"n_kv_heads": 2}, "learned": {"positions": "learned"},
            "qk_norm_rope": {"positions": "qk_norm_rope", "n_kv_heads": 1}}


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**BASE, **kw})).eval()


def _prompt(b: int = 2, p: int = 5) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (b, p), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_cached_generation_is_the_full_forward(variant):
    model = _model(**VARIANTS[variant])
    prompt = _prompt()
    # greedy by recomputing everything at every step
    want = prompt
    for _ in range(8):
        want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    setup_kv_cache(model, batch=2, max_seq_len=16)
    got = generate(model, prompt, 8)
    assert torch.equal(got, want)
    # the cache's prefill logits are the full forward's, at every position
    clear_kv_cache(model)
    full = model(prompt)
    setup_kv_cache(model, batch=2, max_seq_len=16)
    torch.testing.assert_close(model(prompt, input_pos=torch.arange(5)), full, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_decode_step_compiles_once_and_agrees():
    model = _model(n_kv_heads=2)
    setup_kv_cache(model, batch=2, max_seq_len=16)
    eager = generate(model, _prompt(), 6)
    setup_kv_cache(model, batch=2, max_seq_len=16)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # other tests' graphs
    compiled = torch.compile(decode_one, fullgraph=True, dynamic=False, backend="aot_eager")
    assert torch.equal(generate(model, _prompt(), 6, decode=compiled), eager)
    # the position is a tensor: the later steps reuse the first graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@torch.no_grad()
def test_the_in_place_step_compiles_to_one_graph_and_gives_the_same_tokens():
    """``generate(step=decode_next)``: the token picked, written and the position advanced inside one graph, the
    same greedy tokens as the loop over ``decode_one`` (with and without an end token), one graph for every
    position, and every tensor it mutates a buffer (a CUDA graph replays it with no input copied)."""
    model = _model(n_kv_heads=2, positions="learned")
    prompt = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(0))
    setup_kv_cache(model, batch=2, max_seq_len=16)
    want = generate(model, prompt, 7)
    eos = int(want[1, 5])  # the second sequence's first new token: it ends there, and then repeats it
    want_eos = generate(model, prompt, 7, eos_token=eos)
    assert (want_eos[1, 5:] == eos).all() and not torch.equal(want_eos, want)
    assert torch.equal(generate(model, prompt, 7, step=decode_next), want)  # eager
    assert torch.equal(generate(model, prompt, 7, step=decode_next, eos_token=eos), want_eos)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, inputs):
        graphs.append([t for t in inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    step = torch.compile(decode_next, fullgraph=True, dynamic=False, backend=backend)
    assert torch.equal(generate(model, prompt, 7, step=step), want)
    assert torch.equal(generate(model, prompt, 7, step=step, eos_token=eos), want_eos)
    assert len(graphs) == 2  # one a value of eos_token, whatever the position
    # the graph's inputs are the model's parameters and buffers alone (the state's among them): nothing a CUDA
    # graph would copy in a token
    held = {id(t) for t in [*model.parameters(), *model.buffers()]}
    s = model.decode_state
    assert all(id(t) in held for t in graphs[0]) and {id(s.token), id(s.pos), id(s.out)} <= {id(t) for t in graphs[0]}


def test_the_in_place_step_samples_on_the_device_generator():
    model = _model()
    setup_kv_cache(model, batch=2, max_seq_len=16)
    torch.manual_seed(3)
    a = generate(model, _prompt(), 6, temperature=1.0, step=decode_next)
    torch.manual_seed(3)
    b = generate(model, _prompt(), 6, temperature=1.0, step=decode_next)
    greedy = generate(model, _prompt(), 6, step=decode_next)
    assert torch.equal(a, b) and a.shape == (2, 11) and not torch.equal(a, greedy)
    assert int(a.min()) >= 0 and int(a.max()) < BASE["vocab_size"]
    with pytest.raises(ValueError, match="generator: a step compiled from decode_next"):
        generate(model, _prompt(), 3, temperature=1.0, step=decode_next, generator=torch.Generator())


def test_sampling_follows_the_generator():
    model = _model()
    setup_kv_cache(model, batch=2, max_seq_len=16)
    a = generate(model, _prompt(), 5, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = generate(model, _prompt(), 5, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (2, 10)


@pytest.mark.parametrize("update, message", [
    ({"attention": "ccgqa", "n_kv_heads": 2}, "attention='ccgqa': KV-cache decoding supports attention 'sdpa'"),
    ({"kind": "encoder"}, "kind='encoder'"),
    ({"recursions": 3, "n_layers": 3}, "recursions / mod_capacity"),
])
def test_what_cannot_decode_is_named(update, message):
    with pytest.raises(ValueError, match=message):
        setup_kv_cache(_model(**update), batch=1)


def test_generation_checks_the_cache():
    model = _model()
    with pytest.raises(ValueError, match="no KV cache"):
        generate(model, _prompt(), 3)
    with pytest.raises(ValueError, match="setup_kv_cache"):
        model(_prompt(), input_pos=torch.arange(5))
    setup_kv_cache(model, batch=2, max_seq_len=8)
    with pytest.raises(ValueError, match=r"does not fit the cache \(batch 2, max_seq_len 8\)"):
        generate(model, _prompt(), 4)
    with pytest.raises(ValueError, match=r"does not fit the cache"):
        generate(model, _prompt(), 4, step=decode_next)
    with pytest.raises(ValueError, match=r"prompt must be token ids \(B, P\); got shape \(5,\)"):
        generate(model, _prompt()[0], 1)
    with pytest.raises(ValueError, match="over the config's 24"):
        setup_kv_cache(_model(positions="learned"), batch=1, max_seq_len=64)


@torch.no_grad()
def test_a_sliding_window_sees_its_window_and_decodes_alike():
    from adaattn.models.transformer import window_mask

    assert window_mask(4, 2).tolist() == [[True, False, False, False], [True, True, False, False],
                                          [False, True, True, False], [False, False, True, True]]
    model = _model(n_kv_heads=2, attention_window=3)
    prompt = _prompt(p=6)
    # a token's logits do not depend on tokens more than (window - 1) x layers before it
    later = prompt.clone()
    later[:, 0] = (later[:, 0] + 1) % BASE["vocab_size"]
    torch.testing.assert_close(model(prompt)[:, 5], model(later)[:, 5])
    assert not torch.allclose(model(prompt)[:, 4], model(later)[:, 4])
    want = prompt
    for _ in range(6):
        want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    setup_kv_cache(model, batch=2, max_seq_len=16)
    assert torch.equal(generate(model, prompt, 6), want)


@pytest.mark.gpu
def test_gpu_the_in_place_step_under_cuda_graphs():
    """``decode_next`` compiled with CUDA graphs (reduce-overhead): greedy, the tokens of the uncompiled in-place
    step; at a temperature, the draws replayed graph after graph are fresh ones (the graph's random numbers
    are not frozen at capture) and follow ``torch.manual_seed``."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from adaattn.models.train import tf32_mode

    with tf32_mode(False):  # fp32 products both ways: a greedy near-tie does not flip between eager and compiled
        _in_place_under_cuda_graphs()


def _in_place_under_cuda_graphs():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**BASE, "vocab_size": 512, "max_seq_len": 64})).cuda().eval()
    prompt = torch.randint(0, 512, (2, 5), device="cuda")
    setup_kv_cache(model, batch=2, max_seq_len=48)
    want = generate(model, prompt, 40, step=decode_next)
    step = torch.compile(decode_next, mode="reduce-overhead", fullgraph=True)
    assert torch.equal(generate(model, prompt, 40, step=step), want)
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        draws.append(generate(model, prompt, 40, temperature=2.0, step=step))
    assert torch.equal(draws[0], draws[1])
    assert len(set(draws[0][0, 6:].tolist())) > 10  # 39 draws at a high temperature over 512 tokens
