"""``GraphedStep``: ``decode_next`` compiled by inductor and captured into one CUDA graph. On the CPU it is the
compiled step (no graph) and gives the eager step's tokens; on a GPU it captures once per model, buffers and
constants, replays the eager tokens, and its sampled draws are fresh each replay and follow ``torch.manual_seed``."""

from __future__ import annotations

import pytest
import torch

from adaattn.models.config import ModelConfig
from adaattn.models.decode_graph import WARM_STEPS, GraphedStep
from adaattn.models.generate import clear_kv_cache, decode_next, generate, setup_kv_cache
from adaattn.models.transformer import Transformer

BASE = {"vocab_size": 61, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64,
        "mlp": "gelu", "norm": "layernorm", "positions": "rope"}


def _model(device: str = "cpu", **kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**BASE, **kw})).to(device).eval()


def test_modes_with_graphs_of_their_own_are_refused():
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match=f"mode='{mode}'.*allowed: 'default', 'max-autotune-no-cudagraphs'"):
            GraphedStep(mode)


def test_without_a_decode_state_it_says_what_to_call():
    model = _model()
    model.decode_state = None
    with pytest.raises(ValueError, match="setup_kv_cache"):
        GraphedStep()(model)


@torch.no_grad()
def test_on_the_cpu_it_is_the_compiled_step():
    model = _model()
    prompt = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    setup_kv_cache(model, batch=2, max_seq_len=24)
    want = generate(model, prompt, 9, step=decode_next)
    step = GraphedStep()
    assert torch.equal(generate(model, prompt, 9, step=step), want)
    assert step.graph is None and step.captures == 0


@pytest.mark.gpu
def test_gpu_the_captured_step_replays_the_eager_tokens():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from adaattn.models.train import tf32_mode

    with tf32_mode(False):  # fp32 products both ways: a greedy near-tie does not flip between eager and compiled
        model = _model("cuda", vocab_size=512)
        prompt = torch.randint(0, 512, (2, 5), device="cuda")
        setup_kv_cache(model, batch=2, max_seq_len=48)
        want = generate(model, prompt, 40, step=decode_next)
        step = GraphedStep()
        for _ in range(2):  # the second loop replays the first loop's graph
            assert torch.equal(generate(model, prompt, 40, step=step), want)
        assert step.captures == 1
        draws = []
        for _ in range(2):
            torch.manual_seed(7)
            draws.append(generate(model, prompt, 40, temperature=2.0, step=step))
        assert step.captures == 2  # another temperature: another graph
        assert torch.equal(draws[0], draws[1])
        # draws after the capture (position 5 + 1 + WARM_STEPS + 1 on) are fresh ones, not the capture's replayed
        assert len(set(draws[0][0, 5 + WARM_STEPS + 2:].tolist())) > 10
        setup_kv_cache(model, batch=2, max_seq_len=48)  # new buffers: the old graph's addresses are gone
        assert torch.equal(generate(model, prompt, 40, step=step), want)
        assert step.captures == 3
        clear_kv_cache(model)  # the state freed, and a new one where it was
        setup_kv_cache(model, batch=2, max_seq_len=48)
        assert torch.equal(generate(model, prompt, 40, step=step), want)
        assert step.captures == 4
